"""`dpfl privacy ...` through typer's CliRunner, mounted on a stand-in root app."""
import csv
import io
import json
import math
import re

import pytest
import typer
from typer.testing import CliRunner

from cli import privacy
from dpfl_ray.privacy import FixedSizeSampling, epsilon_for, rounds_within_budget

root = typer.Typer()
root.add_typer(privacy.app, name="privacy")


@root.callback()
def _root() -> None:
    """Stand-in for cli/main.py."""


runner = CliRunner()
BAEK = ["--noise-multiplier", "1.0", "--sampling-rate", "0.01", "--rounds", "100", "--delta", "1e-5"]


def run(*args):
    return runner.invoke(root, ["privacy", *args])


def _epsilon(output: str) -> float:
    m = re.search(r"epsilon = ([0-9.]+) after", output)
    assert m, output
    return float(m.group(1))


def test_rdp_classic_reproduces_baek_1_61_and_pld_is_smaller():
    res = run("epsilon", *BAEK, "--accountant", "rdp-classic")
    assert res.exit_code == 0, res.output
    assert "epsilon = 1.6118 after 100 rounds (delta=1e-05, accountant=rdp-classic)" in res.stdout
    classic = _epsilon(res.stdout)
    assert round(classic, 2) == 1.61
    rdp = _epsilon(run("epsilon", *BAEK, "--accountant", "rdp").stdout)
    res = run("epsilon", *BAEK)  # default: pld
    assert res.exit_code == 0 and "accountant=pld" in res.stdout
    pld = _epsilon(res.stdout)
    assert pld < rdp < classic


def test_epsilon_json():
    res = run("epsilon", *BAEK, "--accountant", "rdp-classic", "--dropout-rate", "0.1", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)  # exactly one JSON document
    assert isinstance(data, dict)
    assert data["epsilon"] == pytest.approx(epsilon_for(1.0, 0.01, 100, 1e-5, "rdp-classic", 0.1), rel=1e-12)
    assert data["noise_multiplier_effective"] == pytest.approx(math.sqrt(0.9))
    assert data["noise_multiplier"] == 1.0 and data["sampling_rate"] == 0.01 and data["rounds"] == 100
    assert data["delta"] == 1e-5 and data["accountant"] == "rdp-classic" and data["dropout_rate"] == 0.1
    assert data["neighboring_relation"] == "add_or_remove_one"


def test_epsilon_fixed_size_cohorts():
    res = run("epsilon", "--noise-multiplier", "1.0", "--clients-per-round", "10", "--num-clients", "1000",
              "--rounds", "100", "--delta", "1e-5", "--accountant", "rdp", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["sampling"] == "fixed_size" and data["neighboring_relation"] == "replace_one"
    assert data["clients_per_round"] == 10 and data["num_clients"] == 1000 and data["epsilon"] > 0


def test_noise_command():
    res = run("noise", "--epsilon", "2", "--sampling-rate", "0.01", "--rounds", "100", "--delta", "1e-5",
              "--accountant", "rdp-classic", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    z = data["noise_multiplier"]
    assert epsilon_for(z, 0.01, 100, 1e-5, "rdp-classic") <= 2.0 < epsilon_for(z - 1e-3, 0.01, 100, 1e-5, "rdp-classic")
    res = run("noise", "--epsilon", "2", "--sampling-rate", "0.01", "--rounds", "100", "--delta", "1e-5",
              "--accountant", "rdp-classic")
    assert res.exit_code == 0 and res.stdout.startswith("noise multiplier = ")


def test_table_csv_defaults_with_rdp_classic():
    res = run("table", "--accountant", "rdp-classic", "--csv")
    assert res.exit_code == 0, res.output
    rows = list(csv.DictReader(io.StringIO(res.stdout)))
    assert [r["dropout_rate"] for r in rows] == ["0", "0.1", "0.3"]
    assert float(rows[0]["epsilon_T100"]) == pytest.approx(1.6118, abs=1e-4)
    for r in rows:
        eps = [float(r[f"epsilon_T{t}"]) for t in (1, 10, 100, 1000, 10000, 100000)]
        assert eps == sorted(eps)
    assert int(rows[0]["max_rounds_eps4"]) == rounds_within_budget(1.0, 0.01, 4.0, 1e-5, "rdp-classic")
    # more dropout: fewer rounds within the same budget
    assert [int(r["max_rounds_eps8"]) for r in rows] == sorted((int(r["max_rounds_eps8"]) for r in rows), reverse=True)


def test_table_rich_output():
    res = run("table", "--accountant", "rdp", "--rounds", "1,100", "--budgets", "2", "--dropout-rates", "0,0.5")
    assert res.exit_code == 0, res.output
    assert "T=100" in res.stdout and "eps<=2" in res.stdout and "accountant=rdp" in res.stdout


BAEK_DROPOUT = [*BAEK, "--accountant", "rdp-classic", "--dropout-rate", "0.3", "--json"]


def _json(*args):
    res = run("epsilon", *args)
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_calibration_none_is_todays_dropout_epsilon():
    data = _json(*BAEK_DROPOUT, "--calibration", "none")
    default = _json(*BAEK_DROPOUT)  # --calibration none is the default
    assert data == default
    assert data["epsilon"] == pytest.approx(epsilon_for(1.0, 0.01, 100, 1e-5, "rdp-classic", 0.3), rel=1e-12)
    assert round(data["epsilon"], 3) == 2.463  # Baek et al., Table 2, R = 0.3, T = 100
    assert round(data["epsilon_claimed"], 4) == 1.6118
    assert data["noise_multiplier_effective"] == pytest.approx(math.sqrt(0.7), rel=1e-12)
    assert data["calibration"] == "none" and data["min_weight_fraction"] == 0.5
    assert data["calibration_dropout_rate"] == 0.0 and data["dropout_rate"] == 0.3
    assert data["noise_multiplier"] == 1.0 and data["neighboring_relation"] == "add_or_remove_one"


def test_calibration_modes_claimed_and_effective():
    no_dropout = _json(*BAEK, "--accountant", "rdp-classic", "--json")["epsilon"]
    none = _json(*BAEK_DROPOUT)
    baek = _json(*BAEK_DROPOUT, "--calibration", "baek")
    assert baek["epsilon_claimed"] == pytest.approx(no_dropout, rel=1e-12)  # the paper's claim
    assert round(baek["epsilon_claimed"], 4) == 1.6118
    assert baek["noise_multiplier_effective"] == pytest.approx(math.sqrt(0.7 / 1.7), rel=1e-9)
    assert baek["epsilon"] > none["epsilon"]  # two views of the round leak more than dropping alone

    ext = _json(*BAEK_DROPOUT, "--calibration", "baek-extended", "--min-weight-fraction", "0.5")
    z_ext = ext["noise_multiplier_effective"]
    assert z_ext == pytest.approx(math.sqrt(0.7 / 1.2), abs=1e-9)
    alone = _json("--noise-multiplier", repr(z_ext), "--sampling-rate", "0.01", "--rounds", "100",
                  "--delta", "1e-5", "--accountant", "rdp-classic", "--dropout-rate", "0", "--json")
    assert ext["epsilon"] == pytest.approx(alone["epsilon"], rel=1e-12)
    assert ext["epsilon_claimed"] == pytest.approx(no_dropout, rel=1e-12)
    assert none["epsilon"] < ext["epsilon"] < baek["epsilon"]

    layered = _json(*BAEK_DROPOUT, "--calibration", "layered")
    assert layered["epsilon"] == layered["epsilon_claimed"] == pytest.approx(no_dropout, rel=1e-12)
    assert layered["noise_multiplier_effective"] == 1.0


def test_calibration_text_line():
    res = run("epsilon", *BAEK, "--accountant", "rdp-classic", "--dropout-rate", "0.3", "--calibration", "baek")
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith("epsilon = ") and "after 100 rounds (delta=1e-05, accountant=rdp-classic)" in res.stdout
    assert "; calibration=baek, dropout rate 0.3: claimed epsilon 1.6118 (z=1), effective noise multiplier 0.6417 " \
           "-> the epsilon above" in res.stdout
    assert _epsilon(res.stdout) > 4
    res = run("epsilon", *BAEK, "--accountant", "rdp-classic", "--dropout-rate", "0.3")  # none: today's line + claim
    assert res.exit_code == 0, res.output
    assert res.stdout.strip() == ("epsilon = 2.4633 after 100 rounds (delta=1e-05, accountant=rdp-classic); "
                                  "noise multiplier 1 -> 0.8367 after dropout rate 0.3; "
                                  "calibration=none: claimed epsilon 1.6118 (z=1)")


@pytest.mark.parametrize(
    "args, field",
    [
        (["epsilon", "--noise-multiplier", "1", "--sampling-rate", "1.5", "--rounds", "10", "--delta", "1e-5"], "sampling_rate"),
        (["epsilon", "--noise-multiplier", "0", "--sampling-rate", "0.1", "--rounds", "10", "--delta", "1e-5"], "noise_multiplier"),
        (["epsilon", "--noise-multiplier", "1", "--sampling-rate", "0.1", "--rounds", "0", "--delta", "1e-5"], "rounds"),
        (["epsilon", "--noise-multiplier", "1", "--sampling-rate", "0.1", "--rounds", "10", "--delta", "1"], "delta"),
        (["epsilon", "--noise-multiplier", "1", "--sampling-rate", "0.1", "--rounds", "10", "--delta", "1e-5",
          "--accountant", "moments"], "accountant"),
        (["epsilon", "--noise-multiplier", "1", "--sampling-rate", "0.1", "--rounds", "10", "--delta", "1e-5",
          "--dropout-rate", "1"], "dropout_rate"),
        (["epsilon", "--noise-multiplier", "1", "--rounds", "10", "--delta", "1e-5"], "sampling_rate"),
        (["epsilon", "--noise-multiplier", "1", "--sampling-rate", "0.1", "--clients-per-round", "5",
          "--num-clients", "10", "--rounds", "10", "--delta", "1e-5"], "sampling_rate"),
        (["epsilon", "--noise-multiplier", "1", "--clients-per-round", "11", "--num-clients", "10",
          "--rounds", "10", "--delta", "1e-5", "--accountant", "rdp"], "clients_per_round"),
        (["epsilon", "--noise-multiplier", "1", "--clients-per-round", "5", "--num-clients", "10",
          "--rounds", "10", "--delta", "1e-5"], "accountant"),
        (["noise", "--epsilon", "-1", "--sampling-rate", "0.01", "--rounds", "10", "--delta", "1e-5"], "epsilon"),
        (["noise", "--epsilon", "1", "--sampling-rate", "0", "--rounds", "10", "--delta", "1e-5"], "sampling_rate"),
        (["table", "--dropout-rates", "0,abc", "--accountant", "rdp"], "dropout_rates"),
        (["table", "--budgets", "0", "--accountant", "rdp"], "budget"),
        (["table", "--dropout-rates", "1.2", "--accountant", "rdp"], "dropout_rate"),
        (["epsilon", "--noise-multiplier", "1", "--sampling-rate", "0.1", "--rounds", "10", "--delta", "1e-5", "--calibration", "magic"], "calibration"),
        (["epsilon", "--noise-multiplier", "1", "--sampling-rate", "0.1", "--rounds", "10", "--delta", "1e-5", "--min-weight-fraction", "0"], "min_weight_fraction"),
        (["epsilon", "--noise-multiplier", "1", "--sampling-rate", "0.1", "--rounds", "10", "--delta", "1e-5", "--calibration", "baek-extended",
          "--min-weight-fraction", "1.5"], "min_weight_fraction"),
        (["epsilon", "--noise-multiplier", "1", "--sampling-rate", "0.1", "--rounds", "10", "--delta", "1e-5", "--calibration", "baek",
          "--calibration-dropout-rate", "1.2"], "calibration_dropout_rate"),
        (["epsilon", "--noise-multiplier", "1", "--sampling-rate", "0.1", "--rounds", "10", "--delta", "1e-5", "--calibration-dropout-rate", "-0.1"], "calibration_dropout_rate"),
        # an option the chosen calibration never reads
        (["epsilon", "--noise-multiplier", "1", "--sampling-rate", "0.1", "--rounds", "10", "--delta", "1e-5", "--calibration", "baek",
          "--min-weight-fraction", "0.5"], "min_weight_fraction"),
        (["epsilon", "--noise-multiplier", "1", "--sampling-rate", "0.1", "--rounds", "10", "--delta", "1e-5", "--calibration", "layered",
          "--calibration-dropout-rate", "0.1"], "calibration_dropout_rate"),
        (["epsilon", "--noise-multiplier", "1", "--sampling-rate", "0.1", "--rounds", "10", "--delta", "1e-5", "--calibration", "baek",
          "--calibration-dropout-rate", "0.1"], "calibration_dropout_rate"),  # no dropout: nothing to calibrate
        (["epsilon", "--noise-multiplier", "1", "--sampling-rate", "0.1", "--rounds", "10", "--delta", "1e-5", "--calibration", "layered",
          "--dropout-rate", "0.3", "--min-weight-fraction", "0.8"], "dropout_rate"),
    ],
)
def test_bad_parameters_give_one_line_and_exit_2(args, field):
    res = run(*args)
    assert res.exit_code == 2
    assert res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith(f"error: {field}: ")
    assert "Traceback" not in res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)


def test_typer_usage_errors_do_not_traceback():
    res = run("epsilon", "--noise-multiplier", "abc", "--sampling-rate", "0.1", "--rounds", "10", "--delta", "1e-5")
    assert res.exit_code == 2 and "Traceback" not in res.output


def test_fixed_size_cohorts_book_half_of_z():
    """Issue #9: replace-one adjacency means sensitivity 2S, so z (std / clip norm) is booked as z/2."""
    data = json.loads(run("epsilon", "--noise-multiplier", "1", "--clients-per-round", "10", "--num-clients", "100",
                          "--rounds", "100", "--delta", "1e-5", "--accountant", "rdp", "--json").stdout)
    assert data["noise_multiplier_booked"] == 0.5 and data["mechanism"] == "dp_fedavg"
    assert data["epsilon"] == pytest.approx(83.94, abs=0.01)
    # Baek's z is std / 2C: booked as z under either relation
    baek = json.loads(run("epsilon", "--noise-multiplier", "1", "--clients-per-round", "10", "--num-clients", "100",
                          "--rounds", "100", "--delta", "1e-5", "--accountant", "rdp", "--mechanism", "baek",
                          "--json").stdout)
    assert baek["noise_multiplier_booked"] == 1.0 and baek["epsilon"] == pytest.approx(14.05, abs=0.01)
    noise = json.loads(run("noise", "--epsilon", "8", "--clients-per-round", "10", "--num-clients", "100",
                           "--rounds", "100", "--delta", "1e-5", "--accountant", "rdp", "--json").stdout)
    assert noise["noise_multiplier"] == pytest.approx(2 * noise["noise_multiplier_booked"], rel=1e-12)
    fixed = FixedSizeSampling(10, 100)
    assert epsilon_for(noise["noise_multiplier_booked"], fixed, 100, 1e-5, "rdp") <= 8.0
    res = run("epsilon", "--noise-multiplier", "1", "--sampling-rate", "0.1", "--rounds", "10", "--delta", "1e-5",
              "--mechanism", "dp_fedavg", "--dropout-rate", "0.3")
    assert res.exit_code == 2 and "mechanism" in res.output


def test_nbafl_mechanism_prints_sigmas_claimed_accounted_and_assumed():
    args = ["epsilon", "--mechanism", "nbafl", "--nbafl-epsilon", "60", "--delta", "0.01", "--clip-norm", "20",
            "--min-size", "80", "--clients", "50", "--rounds", "25", "--accountant", "rdp"]
    data = json.loads(run(*args, "--json").stdout)
    c = math.sqrt(2 * math.log(1.25 / 0.01))
    assert data["sigma_uplink"] == pytest.approx(c * 25 * (2 * 20 / 80) / 60) and data["sigma_downlink"] == 0.0
    # epsilon: the sensitivity the code enforces (2C = 40); epsilon_assumed: the paper's 2C/m = 0.5
    assert data["sensitivity"] == 40.0 and data["epsilon"] == pytest.approx(52533.0760, abs=1e-3)
    assert data["sensitivity_assumed"] == 0.5 and data["epsilon_assumed"] == pytest.approx(17.6087, abs=1e-4)
    assert data["epsilon_claimed"] == pytest.approx(60.0) and "2C/m" in data["assumption"]
    assert "validity" in data["claim_note"] and data["neighboring_relation"] == "replace_one"
    text = run(*args).stdout
    assert "accounted epsilon 52533.0760" in text and "epsilon 17.6087 under the paper's assumption" in text
    assert "the paper claims 60.0000" in text
    res = run("epsilon", "--mechanism", "nbafl", "--delta", "0.01", "--rounds", "25")
    assert res.exit_code == 2 and res.stderr.startswith("error: nbafl_epsilon: ")
    res = run("epsilon", "--mechanism", "nbafl", "--nbafl-epsilon", "60", "--delta", "0.01", "--rounds", "25")
    assert res.exit_code == 2 and res.stderr.startswith("error: accountant: nbafl's rounds are unsampled")
