"""`dpfl report` through typer's CliRunner on fake run directories (no Ray, no training)."""
import csv
import json

import pytest
from typer.testing import CliRunner

from cli.main import app

runner = CliRunner()
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_run(path, summary, rounds):
    path.mkdir(parents=True)
    (path / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (path / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
    (path / "scenario.yaml").write_text(f"name: {summary['name']}\nseed: {summary['seed']}\n")
    return path


def _round(i, acc, survived, **extra):
    return {"round": i, "sampled": 10, "survived": survived, "dropped_by_phase": {"upload": 10 - survived} if
            survived < 10 else {}, "test_accuracy": acc, "test_loss": 2.0 - acc, "seconds": 0.1, **extra}


@pytest.fixture
def runs(tmp_path):
    plain = _write_run(tmp_path / "runs" / "plain", {
        "name": "quickstart", "final_accuracy": 0.81, "rounds_completed": 3, "rounds_planned": 3,
        "stop_reason": "completed", "wall_seconds": 12.5, "seed": 0,
    }, [_round(1, 0.5, 10), _round(2, 0.85, 8), _round(3, 0.81, 9)])
    dp = _write_run(tmp_path / "runs" / "dp", {
        "name": "dp_fedavg", "final_accuracy": 0.62, "rounds_completed": 2, "rounds_planned": 4,
        "stop_reason": "budget", "wall_seconds": 30.0, "seed": 1, "epsilon": 2.345678, "delta": 1e-5,
        "accountant": "pld", "dp_covered": True, "noise_multiplier": 1.0,
    }, [_round(1, 0.4, 10, epsilon=1.5, dp_covered=True), _round(2, 0.62, 10, epsilon=2.345678, dp_covered=True)])
    claimed = _write_run(tmp_path / "runs" / "claimed", {
        "name": "dp_secagg", "final_accuracy": 0.7, "rounds_completed": 2, "rounds_planned": 2,
        "stop_reason": "completed", "wall_seconds": 20.0, "seed": 2, "epsilon": 3.25, "delta": 1e-6,
        "accountant": "rdp", "dp_covered": True, "noise_multiplier": 0.8, "calibration": "baek",
        "epsilon_vs_server": 9.5, "epsilon_empirical": {"epsilon": 2.5, "low": 2.0, "high": 3.0, "k": 100},
    }, [_round(1, 0.55, 6, epsilon=2.0, epsilon_claimed=1.1, dp_covered=True),
        _round(2, 0.7, 7, epsilon=3.25, epsilon_claimed=1.75, dp_covered=True)])
    return plain, dp, claimed


def report(*args):
    return runner.invoke(app, ["report", *map(str, args)], env={"COLUMNS": "200"})


def test_report_table_plots_and_csv(runs, tmp_path):
    out = tmp_path / "out"
    res = report(*runs, "--out", out)
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    row = {label: next(ln for ln in lines if label in ln) for label in ("runs/plain", "runs/dp", "runs/claimed")}
    assert "quickstart" in row["runs/plain"] and "0.8100" in row["runs/plain"] and "0.8500" in row["runs/plain"]
    assert "3/3" in row["runs/plain"] and "9.0" in row["runs/plain"]  # mean survivors (10+8+9)/3
    assert "dp_fedavg" in row["runs/dp"] and "0.6200" in row["runs/dp"] and "2.346" in row["runs/dp"]
    assert "2/4" in row["runs/dp"] and "budget" in row["runs/dp"] and "1e-05" in row["runs/dp"]
    assert "0.7000" in row["runs/claimed"] and "3.250" in row["runs/claimed"] and "1.750" in row["runs/claimed"]
    assert "calibration" in res.stdout  # the header
    assert "baek" in row["runs/claimed"] and "baek" not in row["runs/dp"] and "baek" not in row["runs/plain"]

    for name in ("accuracy.png", "epsilon.png", "accuracy_vs_epsilon.png"):
        path = out / name
        assert path.read_bytes()[:8] == PNG_MAGIC, name
        assert str(path) in res.stdout
    assert str(out / "report.csv") in res.stdout

    with open(out / "report.csv", newline="") as fh:
        table = {r["run"]: r for r in csv.DictReader(fh)}
    assert list(table) == ["runs/plain", "runs/dp", "runs/claimed"]
    plain, dp, claimed = table.values()
    assert plain["scenario"] == "quickstart" and float(plain["final_accuracy"]) == 0.81
    assert float(plain["best_accuracy"]) == 0.85 and float(plain["mean_survivors"]) == 9.0
    assert plain["epsilon"] == "" and plain["epsilon_claimed"] == "" and plain["delta"] == ""
    assert float(dp["epsilon"]) == 2.345678 and float(dp["delta"]) == 1e-5 and dp["epsilon_claimed"] == ""
    assert dp["rounds_completed"] == "2" and dp["rounds_planned"] == "4" and dp["stop_reason"] == "budget"
    assert float(claimed["epsilon"]) == 3.25 and float(claimed["epsilon_claimed"]) == 1.75
    assert float(claimed["epsilon_vs_server"]) == 9.5 and float(claimed["epsilon_empirical_low"]) == 2.0
    assert dp["epsilon_vs_server"] == "" and dp["epsilon_empirical"] == ""
    assert float(claimed["wall_seconds"]) == 20.0
    assert claimed["calibration"] == "baek" and dp["calibration"] == "" and plain["calibration"] == ""


def test_table_cells_match_headers_and_columns(runs):
    from cli.report import HEADERS
    from dpfl_ray.runs.load import load_run
    from dpfl_ray.runs.report import COLUMNS, cells, row

    assert len(HEADERS) == len(COLUMNS)
    assert HEADERS.index("calibration") == COLUMNS.index("calibration")
    for path in runs:
        r = row(load_run(path))
        assert len(cells(r)) == len(COLUMNS)
        assert cells(r)[COLUMNS.index("calibration")] == (r["calibration"] or "-")
    assert row(load_run(runs[2]))["calibration"] == "baek"


def test_plot_legend_names_the_calibration(runs, monkeypatch, tmp_path):
    from dpfl_ray.runs import report as rep

    load = [rep.load_run(p) for p in runs]
    assert load[2].legend == "runs/claimed (calibration=baek)" and load[1].legend == "runs/dp"
    labels = []
    real_save = rep._save

    def spy(fig, ax, path, *args):
        labels.extend(line.get_label() for line in ax.get_lines())
        return real_save(fig, ax, path, *args)

    monkeypatch.setattr(rep, "_save", spy)
    rep.plot_epsilon(load, tmp_path / "epsilon.png")
    assert "runs/claimed (calibration=baek) (effective)" in labels
    assert "runs/claimed (calibration=baek) (claimed)" in labels
    assert "runs/dp" in labels


def test_non_private_runs_skip_the_epsilon_plots(runs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # default --out is ./report
    res = report(runs[0])
    assert res.exit_code == 0, res.output
    out = tmp_path / "report"
    assert (out / "accuracy.png").read_bytes()[:8] == PNG_MAGIC
    assert (out / "report.csv").exists()
    assert not (out / "epsilon.png").exists() and not (out / "accuracy_vs_epsilon.png").exists()


def test_assumed_epsilon_beside_the_enforced_one_and_the_claim(tmp_path, monkeypatch):
    """NbAFL: epsilon books the sensitivity the code enforces, epsilon_assumed the paper's; the table,
    the CSV and the epsilon plot (log scale: they are decades apart) carry both beside the claim."""
    from dpfl_ray.runs import report as rep

    run = _write_run(tmp_path / "runs" / "nbafl", {
        "name": "wei2020_n50_eps60", "final_accuracy": 0.5, "rounds_completed": 2, "rounds_planned": 2,
        "stop_reason": "completed", "wall_seconds": 1.0, "seed": 0, "epsilon": 52533.076, "delta": 0.01,
        "accountant": "rdp", "dp_covered": True, "epsilon_claimed": 60.0, "epsilon_assumed": 17.6087,
        "assumption": "Wei et al.'s Delta s_U = 2C/m ...",
    }, [_round(1, 0.4, 10, epsilon=30000.0, epsilon_claimed=30.0, epsilon_assumed=11.2, dp_covered=True),
        _round(2, 0.5, 10, epsilon=52533.076, epsilon_claimed=60.0, epsilon_assumed=17.6087, dp_covered=True)])
    res = report(run, "--out", tmp_path / "out")
    assert res.exit_code == 0, res.output
    assert "52533.076" in res.stdout and "17.609" in res.stdout and "60.000" in res.stdout
    assert "eps assumed" in res.stdout
    with open(tmp_path / "out" / "report.csv", newline="") as fh:
        (row,) = csv.DictReader(fh)
    assert float(row["epsilon"]) == 52533.076 and float(row["epsilon_assumed"]) == 17.6087
    assert float(row["epsilon_claimed"]) == 60.0
    seen = {}
    real_save = rep._save

    def spy(fig, ax, path, *args):
        seen.update(labels=[line.get_label() for line in ax.get_lines()], scale=ax.get_yscale())
        return real_save(fig, ax, path, *args)

    monkeypatch.setattr(rep, "_save", spy)
    rep.plot_epsilon([rep.load_run(run)], tmp_path / "epsilon.png")
    assert "runs/nbafl (assumed)" in seen["labels"] and "runs/nbafl (effective)" in seen["labels"]
    assert seen["scale"] == "log"


def test_nominal_epsilon_when_rounds_are_not_covered(tmp_path):
    run = _write_run(tmp_path / "runs" / "nominal", {
        "name": "uncovered", "final_accuracy": 0.5, "rounds_completed": 1, "rounds_planned": 1,
        "stop_reason": "completed", "wall_seconds": 1.0, "seed": 0, "epsilon": None, "epsilon_nominal": 0.9,
        "delta": 1e-5, "accountant": "pld", "dp_covered": False, "noise_multiplier": 1.0,
    }, [_round(1, 0.5, 10, epsilon=None, epsilon_nominal=0.9, dp_covered=False)])
    res = report(run, "--out", tmp_path / "out")
    assert res.exit_code == 0, res.output
    assert "nominal 0.900" in res.stdout
    assert (tmp_path / "out" / "epsilon.png").exists()


def _assert_user_error(res, *needles):
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)  # typer.Exit(2), not a crash
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), res.stderr
    for needle in needles:
        assert needle in lines[0]
    assert res.stdout == ""


def test_not_a_run_directory(runs, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    _assert_user_error(report(runs[0], empty, "--out", tmp_path / "out"), str(empty), "summary.json")
    assert not (tmp_path / "out").exists()  # nothing is written when an input is bad
    _assert_user_error(report(tmp_path / "missing"), str(tmp_path / "missing"))
    (empty / "summary.json").write_text("{}")
    _assert_user_error(report(empty), "rounds.jsonl")


def test_malformed_json(runs, tmp_path):
    plain = runs[0]
    with open(plain / "rounds.jsonl", "a") as fh:
        fh.write('{"round": 4, "test_accuracy": \n')
    _assert_user_error(report(plain), str(plain), "line 4")
    (runs[1] / "summary.json").write_text("{not json")
    _assert_user_error(report(runs[1]), str(runs[1]), "summary.json")


def test_record_level_runs_get_a_per_client_epsilon_histogram(runs, tmp_path):
    rl = _write_run(tmp_path / "runs" / "record", {
        "name": "fu", "final_accuracy": 0.6, "rounds_completed": 2, "rounds_planned": 2, "stop_reason": "completed",
        "wall_seconds": 5.0, "seed": 0, "epsilon": 1.9, "delta": 1e-5, "record_level": True,
    }, [_round(1, 0.5, 10, epsilon=1.0), _round(2, 0.6, 10, epsilon=1.9)])
    (rl / "ledger.json").write_text(json.dumps({"per_client_epsilon": {"0": 1.2, "1": 1.9, "2": 0.4}}))
    out = tmp_path / "rep"
    res = report(runs[1], rl, "--out", out)
    assert res.exit_code == 0, res.output
    assert (out / "client_epsilon.png").read_bytes()[:8] == PNG_MAGIC
    # negative epsilons are no client's (-1e308 beside 1e308 made matplotlib's bins fail: an internal error, files
    # half written)
    (rl / "ledger.json").write_text(json.dumps({"per_client_epsilon": {"0": -1e308, "1": 1e6, "2": 0.4}}))
    from dpfl_ray.runs.load import load_run
    from dpfl_ray.runs.report import client_epsilons
    assert client_epsilons(load_run(rl)) == [1e6, 0.4]
    res = report(runs[1], rl, "--out", tmp_path / "rep1")
    assert res.exit_code == 0, res.output
    (rl / "ledger.json").write_bytes(b"\x00 not json")  # a broken ledger loses the plot, not the report
    res = report(runs[1], rl, "--out", tmp_path / "rep2")
    assert res.exit_code == 0 and not (tmp_path / "rep2" / "client_epsilon.png").exists()


def test_per_client_accuracy_is_plotted_by_group(runs, tmp_path):
    from dpfl_ray.runs.load import load_run
    from dpfl_ray.runs.report import client_accuracy_groups

    groups = {"eps_k=1": {"clients": 2, "mean": 0.5, "min": 0.4, "median": 0.5, "max": 0.6},
              "eps_k=8": {"clients": 2, "mean": 0.7, "min": 0.65, "median": 0.7, "max": 0.75}}
    huang = _write_run(tmp_path / "runs" / "huang", {
        "name": "huang", "final_accuracy": 0.6, "rounds_completed": 1, "rounds_planned": 1, "stop_reason": "completed",
        "wall_seconds": 5.0, "seed": 0, "client_accuracy": {"clients": 4, "mean": 0.6, "min": 0.4, "median": 0.6,
                                                            "max": 0.75, "by_group": groups},
    }, [_round(1, 0.6, 10)])
    assert client_accuracy_groups(load_run(huang)) == {
        "eps_k=1": {"mean": 0.5, "min": 0.4, "max": 0.6}, "eps_k=8": {"mean": 0.7, "min": 0.65, "max": 0.75}}
    res = report(runs[0], huang, "--out", tmp_path / "rep")
    assert res.exit_code == 0, res.output
    assert (tmp_path / "rep" / "client_accuracy.png").read_bytes()[:8] == PNG_MAGIC
    # a group whose figures are not numbers is left out of the plot, not the report
    (huang / "summary.json").write_text(json.dumps({**json.loads((huang / "summary.json").read_text()),
                                                    "client_accuracy": {"by_group": {"x": {"mean": "high"}}}}))
    res = report(runs[0], huang, "--out", tmp_path / "rep2")
    assert res.exit_code == 0 and not (tmp_path / "rep2" / "client_accuracy.png").exists()
    # nor are figures out of order (a min above the mean made matplotlib fail on a negative error bar)
    (huang / "summary.json").write_text(json.dumps({**json.loads((huang / "summary.json").read_text()),
                                                    "client_accuracy": {"mean": 0.5, "min": 0.7, "max": 0.9}}))
    assert client_accuracy_groups(load_run(huang)) == {}
    res = report(runs[0], huang, "--out", tmp_path / "rep3")
    assert res.exit_code == 0 and not (tmp_path / "rep3" / "client_accuracy.png").exists()
    assert not (tmp_path / "rep" / "client_epsilon.png").exists()
