"""Baek et al. 2021 on a real local Ray, over real SecAgg: every calibration mode releases, the
ledger books the effective multiplier of each round, and it agrees with `dpfl privacy epsilon`."""
import json
import math
import re

import pytest
import torch
import typer
from typer.testing import CliRunner

from cli import privacy as privacy_cli
from dpfl_ray.data import build_federation
from dpfl_ray.training.models import build_model
from dpfl_ray.privacy import FixedSizeSampling, epsilon_for
from dpfl_ray.privacy.dropouts import effective_noise_multipliers
from dpfl_ray.runs.record import RunRecord
from dpfl_ray.runtime.driver import run_scenario
from tests.helpers import TWO_WORKERS, tiny_scenario

MODES = ["none", "baek", "baek-extended", "layered"]
UPLOAD_30 = {"model": "tail", "rate": 0.3, "phase": "upload"}

cli_root = typer.Typer()
cli_root.add_typer(privacy_cli.app, name="privacy")


@cli_root.callback()
def _root() -> None:
    """Stand-in for cli/main.py."""


def _scenario(mode: str, dropout=UPLOAD_30, rounds: int = 3, resources=None, **privacy):
    # 40 clients with 15 examples each: every weight is 1; 10 sampled per round, 3 drop.
    return tiny_scenario(resources=resources or {},
        data={"num_clients": 40}, training={"algorithm": "baek", "rounds": rounds},
        sampling={"mode": "fixed", "clients_per_round": 10},
        privacy={"noise_multiplier": 1.0, "clipping": {"norm": 0.5}, "accountant": "rdp", "calibration": mode,
                 **privacy},
        secagg={"enabled": True, "threshold": "majority"}, faults={"dropout": dropout})


def _run(sc, path):
    summary = run_scenario(sc, build_federation(sc), RunRecord(path))
    rounds = [json.loads(line) for line in (path / "rounds.jsonl").read_text().splitlines()]
    return summary, rounds


def _cli_epsilon(mode: str, rounds: int) -> dict:
    res = CliRunner().invoke(cli_root, [
        "privacy", "epsilon", "--noise-multiplier", "1", "--clients-per-round", "10", "--num-clients", "40",
        "--rounds", str(rounds), "--delta", "1e-5", "--accountant", "rdp", "--dropout-rate", "0.3",
        "--calibration", mode, "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def _check_epsilon_against_the_server(summary, ledger):
    """The server picks the sample: against it, the rounds a client took part in compose without
    sampling amplification (Gaussians: their precisions add). Checked on the layered run of the test
    below."""
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    # layered keeps z in every released round; the worst-off client took part in at most 3 of them
    worst = summary["epsilon_vs_server"]
    candidates = [RdpAccountant().compose(dp_accounting.GaussianDpEvent(1.0), k).get_epsilon(1e-5) for k in (1, 2, 3)]
    assert any(worst == pytest.approx(c, rel=1e-9) for c in candidates), (worst, candidates)
    assert worst > summary["epsilon"]  # no amplification against the server
    assert ledger["epsilon_vs_server"] == worst and "client" in summary["epsilon_vs_server_note"]
    assert all(r["public"] == ["n", "n_prime"] for r in ledger["rounds"] if r["released"])


@pytest.mark.parametrize("mode", MODES)
def test_run_ledger_and_cli_agree_at_thirty_percent_dropout(ray_session, tmp_path, mode):
    summary, rounds = _run(_scenario(mode), tmp_path / mode)
    assert summary["stop_reason"] == "completed" and summary["calibration"] == mode
    for r in rounds:  # SecAgg ran, 3 of 10 really dropped, and the survivors' sum was released
        assert r["sampled"] == 10 and r["survived"] == 7 and r["dropped_by_phase"] == {"upload": 3}
        assert r["secagg_protocol"] == "secagg" and "secagg_aborted" not in r and "round_aborted" not in r
    cli = _cli_epsilon(mode, len(rounds))
    assert rounds[-1]["noise_multiplier_effective"] == pytest.approx(cli["noise_multiplier_effective"], rel=1e-12)
    assert summary["epsilon"] == pytest.approx(cli["epsilon"], rel=1e-6)
    assert summary["epsilon_claimed"] == pytest.approx(cli["epsilon_claimed"], rel=1e-6)
    ledger = json.loads((tmp_path / mode / "ledger.json").read_text())
    assert [r["claimed_noise_multipliers"] for r in ledger["rounds"]] == [[1.0]] * 3
    if mode == "layered":
        assert summary["epsilon"] == pytest.approx(summary["epsilon_claimed"], rel=1e-12)
        assert all(r["layers_removed"] == 7 * (5 - 3) for r in rounds)  # layers 4..5 of each survivor
        _check_epsilon_against_the_server(summary, ledger)
    else:
        assert summary["epsilon"] > summary["epsilon_claimed"]
    if mode in ("baek", "baek-extended"):
        assert all(r["calibration_senders"] == 7 for r in rounds)


def test_calibration_and_unmask_dropouts(ray_session, tmp_path):
    """Two survivors vanish before their calibration term, one during unmasking: for baek all three
    leave their first noise in; layered loses nothing (the others' shares remove the layers)."""
    drops = [UPLOAD_30, {"model": "tail", "rate": 0.15, "phase": "unmask"},
             {"model": "tail", "rate": 0.35, "phase": "calibration"}]
    # two workers: the calibration terms and the unmasking shares cross the pool
    _, rounds = _run(_scenario("baek", dropout=drops, rounds=2, resources=TWO_WORKERS), tmp_path / "baek")
    for r in rounds:
        assert r["dropped_by_phase"] == {"upload": 3, "unmask": 1, "calibration": 2} and r["survived"] == 7
        assert r["calibration_senders"] == 4
        _, z_eff = effective_noise_multipliers(1.0, "baek", 10.0, 7.0, 3.0)
        assert r["noise_multiplier_effective"] == pytest.approx(z_eff, rel=1e-12)
    _, rounds = _run(_scenario("layered", dropout=drops, rounds=2, resources=TWO_WORKERS), tmp_path / "layered")
    for r in rounds:
        assert r["survived"] == 7 and r["noise_multiplier_effective"] == 1.0 and r["layers_removed"] == 14


def test_layered_refuses_a_round_beyond_its_tolerance(ray_session, tmp_path):
    """F = 0.9 tolerates one dropout of ten; with three nothing is released or booked."""
    summary, rounds = _run(_scenario("layered", rounds=2, min_weight_fraction=0.9), tmp_path / "refused")
    assert all("tolerate 1" in r["round_aborted"] and r["weight_sum"] == 0.0 for r in rounds)
    assert summary["epsilon"] == 0.0
    ledger = json.loads((tmp_path / "refused" / "ledger.json").read_text())
    assert [r["released"] for r in ledger["rounds"]] == [False, False]
    model = torch.load(tmp_path / "refused" / "model.pt")
    sc = _scenario("layered")
    fed = build_federation(sc)
    init = build_model(sc.model, fed.dataset.input_shape, fed.dataset.num_classes, sc.seed).state_dict()
    assert all(torch.equal(model[k], init[k]) for k in init)  # the model never moved


def test_same_model_for_any_pool_size(ray_session, tmp_path):
    """Calibration terms are summed in client-id order, so the pool does not change the model."""
    models = []
    for workers in (1, 2):
        sc = _scenario("baek", rounds=2).model_copy(deep=True)
        sc.resources.workers = workers
        _run(sc, tmp_path / f"w{workers}")
        models.append(torch.load(tmp_path / f"w{workers}" / "model.pt"))
    assert all(torch.equal(models[0][k], models[1][k]) for k in models[0])


def test_budget_refuses_the_release_that_would_pass_it(ray_session, tmp_path):
    """Without calibration the effective epsilon runs ahead of the planned one; the run unmasks a
    round only if the effective epsilon stays within privacy.target_epsilon."""
    samp = FixedSizeSampling(10, 40)
    z_eff = math.sqrt(0.7)
    eff1, eff2 = (epsilon_for(z_eff, samp, t, 1e-5, "rdp") for t in (1, 2))
    claimed2 = epsilon_for(1.0, samp, 2, 1e-5, "rdp")
    target = (max(eff1, claimed2) + eff2) / 2
    assert eff1 < target < eff2 and claimed2 < target  # the planned check alone would release round 2
    summary, rounds = _run(_scenario("none", rounds=5, target_epsilon=target), tmp_path / "budget")
    assert summary["stop_reason"] == "privacy_budget_exhausted" and len(rounds) == 2
    assert "round_aborted" not in rounds[0] and "target_epsilon" in rounds[1]["round_aborted"]
    assert summary["epsilon"] == pytest.approx(eff1, rel=1e-6) and summary["epsilon"] <= target


def test_an_input_that_overflows_the_ring_aborts_the_round_not_the_run(ray_session, tmp_path):
    """Issue #9: an EncodingOverflow in a worker used to crash the run."""
    # the server's norm check (faults.max_update_norm) would refuse these updates first: lift it
    sc = tiny_scenario(training={"rounds": 2, "lr": 1e12}, sampling={"mode": "fixed", "clients_per_round": 6},
                       secagg={"enabled": True, "bits": 32, "scale": 2.0 ** 20}, faults={"max_update_norm": 1e30})
    summary, rounds = _run(sc, tmp_path / "overflow")
    assert summary["stop_reason"] == "completed" and len(rounds) == 2
    assert all("overflow" in r["secagg_aborted"].lower() or "exceed" in r["secagg_aborted"] for r in rounds), rounds
    assert all(r["survived"] == 0 for r in rounds)
    # the reason names no figure of the client's value (its largest coordinate was printed): only the scenario's
    reasons = [re.search(r"client \d+: (.*)$", r["secagg_aborted"]).group(1) for r in rounds]
    assert all(not any(ch.isdigit() for ch in why) for why in reasons), reasons


POISSON = {"mode": "poisson", "rate": 0.25, "clients_per_round": None}


def _integer_scenario(noise: str, bits: int, z: float = 1.0, rounds: int = 3, calibration: str = "none",
                      sampling: dict = POISSON):
    return tiny_scenario(
        data={"num_clients": 40}, training={"algorithm": "baek", "rounds": rounds}, sampling=sampling,
        privacy={"noise_multiplier": z, "clipping": {"norm": 0.5}, "accountant": "rdp", "calibration": calibration,
                 "distributed_noise": noise},
        secagg={"enabled": True, "threshold": "majority", "bits": bits if noise != "gaussian" else 32},
        faults={"dropout": UPLOAD_30})


@pytest.fixture(scope="module")
def gaussian_at_tiny_z(ray_session, tmp_path_factory):
    """The continuous Gaussian's run that the integer-noise runs are compared with: its summary and model."""
    path = tmp_path_factory.mktemp("gaussian")
    summary, _ = _run(_integer_scenario("gaussian", 32, z=1e-4), path)
    return summary, torch.load(path / "model.pt")


@pytest.mark.parametrize("noise", ["skellam", "discrete_gaussian"])
def test_integer_noise_inside_secagg_releases_the_sum_and_books_its_own_mechanism(gaussian_at_tiny_z, tmp_path, noise):
    """The clients' words of Z_2^24 carry their scaled, rotated, rounded updates and their integer noise
    shares; the server's decoded sum is the float one up to the rounding (z = 1e-4: the two runs'
    models agree far closer than either moved). The ledger books each round's survivors' shares
    (privacy/discrete_rdp.py), never less than the continuous Gaussian of the same multiplier."""
    gaussian, reference = gaussian_at_tiny_z
    summary, rows = _run(_integer_scenario(noise, 24, z=1e-4), tmp_path / noise)
    model = torch.load(tmp_path / noise / "model.pt")
    ledger = json.loads((tmp_path / noise / "ledger.json").read_text())
    for row, entry in zip(rows, ledger["rounds"]):
        assert entry["mechanism"]["type"] == "DiscreteNoiseSumDpEvent"
        assert entry["mechanism"]["mechanism"] == noise and entry["mechanism"]["shares"] == row["survived"]
        assert row["ring_bits"] == 24 and row["ring_wrap_bound"] <= 1e-4
    start = build_model(_integer_scenario("gaussian", 32).model, (8,), 3, seed=3)
    moved = sum(float((reference[k] - v).norm()) for k, v in start.state_dict().items())
    apart = sum(float((reference[k] - model[k]).norm()) for k in model)
    assert apart < 0.01 * moved, (apart, moved)
    assert summary["epsilon"] > gaussian["epsilon"]
    assert summary["epsilon_claimed"] == gaussian["epsilon_claimed"]


def test_a_fixed_size_cohort_with_skellam_shares_books_the_replace_one_bound_of_its_gaussian(ray_session, tmp_path):
    """Fixed-size cohorts (m of n without replacement, the replace-one relation) with integer noise:
    each round books its survivors' Skellam sum inside dp_accounting's
    SampledWithoutReplacementDpEvent, through Wang et al.'s bound (privacy/discrete_rdp.py); at
    z = 1 that is the epsilon of the continuous Gaussian's run of the same cohorts (the release's
    RDP is the Gaussian's within 1e-5, and the bound's terms are those dp_accounting takes)."""
    fixed = {"mode": "fixed", "clients_per_round": 10, "rate": None}
    runs = {noise: _run(_integer_scenario(noise, 24, sampling=fixed), tmp_path / noise)
            for noise in ("gaussian", "skellam")}
    ledgers = {noise: json.loads((tmp_path / noise / "ledger.json").read_text()) for noise in runs}
    assert ledgers["skellam"]["neighboring_relation"] == ledgers["gaussian"]["neighboring_relation"] == "replace_one"
    rows = runs["skellam"][1]
    assert [r["sampled"] for r in rows] == [10, 10, 10]
    for row, entry in zip(rows, ledgers["skellam"]["rounds"]):
        assert entry["mechanism"]["type"] == "DiscreteNoiseSumDpEvent"
        assert entry["mechanism"]["shares"] == row["survived"]
    gaussian, skellam = runs["gaussian"][0]["epsilon"], runs["skellam"][0]["epsilon"]
    assert gaussian <= skellam <= 1.01 * gaussian, (skellam, gaussian)


@pytest.mark.parametrize("calibration", ["baek", "baek-extended", "layered"])
def test_calibration_with_integer_shares_runs_through_secagg_and_books_what_the_server_sees(ray_session, tmp_path,
                                                                                           calibration):
    """Calibration with Skellam shares in Z_2^24, z = 1e-4, beside the continuous Gaussian's run of
    the same mode: the release is the Gaussian run's sum up to the rounding. ``baek`` (and
    ``baek-extended``, whose first shares start from the floor n_0): every survivor's integer term
    reaches the server, and each round books the server's two views of the sum. ``layered``: the
    seeded layers are removed in the ring, and each round books the one view left, the cohort's
    whole Skellam total over the survivors' shares; with discrete Gaussian layers too, whose
    survivors keep their layers' equal draws of N_Z(0, u), all of which the round books."""
    noises = ("gaussian", "skellam") + (("discrete_gaussian",) if calibration == "layered" else ())
    paths = {noise: tmp_path / noise for noise in noises}
    runs = {noise: _run(_integer_scenario(noise, 24, z=1e-4, calibration=calibration), path)
            for noise, path in paths.items()}
    if calibration == "layered":
        _layered_discrete_gaussian_rounds(runs["discrete_gaussian"], paths["discrete_gaussian"], runs["gaussian"][0],
                                          torch.load(paths["gaussian"] / "model.pt"))
    summary, rows = runs["skellam"]
    ledger = json.loads((paths["skellam"] / "ledger.json").read_text())
    assert summary["stop_reason"] == "completed" and len(rows) == 3
    for row, entry in zip(rows, ledger["rounds"]):
        event = entry["mechanism"]
        if calibration != "layered":  # 30% dropout at upload: every round calibrates, its terms securely summed
            assert row["calibration_senders"] == row["survived"] and row["secagg_calibration_seconds"] > 0
            assert event["type"] == "CalibratedViewsDpEvent"
            assert event["survivors"] == event["senders"] == row["survived"]
        else:
            assert row["layers_removed"] == row["survived"] * (row["layers_tolerated"] - (row["sampled"] - row["survived"]))
            assert event["type"] == "DiscreteNoiseSumDpEvent" and event["shares"] == row["survived"]
    model, reference = (torch.load(paths[n] / "model.pt") for n in ("skellam", "gaussian"))
    start = build_model(_integer_scenario("gaussian", 32).model, (8,), 3, seed=3)
    moved = sum(float((reference[k] - v).norm()) for k, v in start.state_dict().items())
    apart = sum(float((reference[k] - model[k]).norm()) for k in model)
    assert apart < 0.01 * moved, (apart, moved)
    assert summary["epsilon"] > runs["gaussian"][0]["epsilon"]
    if calibration == "layered":
        assert sum(r["layers_removed"] for r in rows) > 0, rows


def _layered_discrete_gaussian_rounds(run, path, gaussian_summary, reference):
    summary, rows = run
    ledger = json.loads((path / "ledger.json").read_text())
    assert summary["stop_reason"] == "completed" and len(rows) == 3
    for row, entry in zip(rows, ledger["rounds"]):
        event = entry["mechanism"]
        assert event["type"] == "DiscreteNoiseSumDpEvent" and event["mechanism"] == "discrete_gaussian"
        assert (event["shares"], event["variance"]) == (row["layer_draws_released"], row["layer_draw_variance"])
        assert row["layer_draws_released"] >= row["survived"] and row["noise_multiplier_effective"] >= 1e-4
    model = torch.load(path / "model.pt")
    start = build_model(_integer_scenario("gaussian", 32).model, (8,), 3, seed=3)
    moved = sum(float((reference[k] - v).norm()) for k, v in start.state_dict().items())
    apart = sum(float((reference[k] - model[k]).norm()) for k in model)
    assert apart < 0.01 * moved, (apart, moved)
    assert summary["epsilon"] > gaussian_summary["epsilon"]
