"""`dpfl report SWEEP_DIR`: every run of a sweep directory, through typer's CliRunner on run
directories written the way `dpfl run` writes them and a sweep.csv written by dpfl_ray.runs.sweep
(no Ray, no training)."""
import csv
import json

import pytest
from typer.testing import CliRunner

from cli.main import app
from dpfl_ray.runs import sweep as sw

runner = CliRunner()
GRID = {"faults.dropout.rate": ["0", "0.3"], "privacy.calibration": ["none", "baek"]}


def _write_run(path, accuracy, epsilon, claimed, calibration, survived):
    path.mkdir(parents=True)
    rounds = [{"round": t, "sampled": 10, "survived": survived, "test_accuracy": accuracy - 0.1 * (2 - t),
               "epsilon": epsilon * t / 2, "epsilon_claimed": claimed * t / 2, "dp_covered": True, "seconds": 0.1}
              for t in (1, 2)]
    summary = {"name": "baek_ci", "final_accuracy": accuracy, "rounds_completed": 2, "rounds_planned": 2,
               "stop_reason": "completed", "wall_seconds": 3.0, "seed": 0, "epsilon": epsilon,
               "epsilon_claimed": claimed, "delta": 1e-5, "dp_covered": True, "calibration": calibration}
    (path / "summary.json").write_text(json.dumps(summary))
    (path / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))


def _sweep(tmp_path, finished: int):
    """A sweep directory whose first ``finished`` runs finished; the others timed out (a log, no summary)."""
    out = tmp_path / "sweep"
    runs = sw.expand(GRID, [0])
    statuses = {}
    for i, run in enumerate(runs):
        values = dict(run.values)
        if i < finished:
            rate = float(values["faults.dropout.rate"])
            _write_run(out / run.name, 0.8 - rate / 3, 2.0 + 2 * rate, 2.0, values["privacy.calibration"],
                       round(10 * (1 - rate)))
            statuses[run.name] = "ok"
        else:
            (out / run.name).mkdir(parents=True)
            (out / run.name / "scenario.yaml").write_text("name: baek_ci\n")
            statuses[run.name] = "timeout"
    sw.write_csv(sw.collect(out, runs, statuses), list(GRID), out / "sweep.csv")
    return out, runs


def report(*args):
    return runner.invoke(app, ["report", *map(str, args)], env={"COLUMNS": "250"})


def test_a_sweep_directory_reports_every_finished_run_in_sweep_order(tmp_path):
    sweep, runs = _sweep(tmp_path, finished=3)
    res = report(sweep, "--out", tmp_path / "out")
    assert res.exit_code == 0, res.output
    with open(tmp_path / "out" / "report.csv") as fh:
        table = list(csv.DictReader(fh))
    assert [r["run"] for r in table] == [f"sweep/{run.name}" for run in runs[:3]]
    assert [r["calibration"] for r in table] == ["none", "baek", "none"]
    assert [float(r["final_accuracy"]) for r in table] == pytest.approx([0.8, 0.8, 0.7])
    assert [float(r["mean_survivors"]) for r in table] == [10.0, 10.0, 7.0]
    assert float(table[2]["epsilon"]) == pytest.approx(2.6) and float(table[2]["epsilon_claimed"]) == 2.0
    lines = res.stdout.splitlines()
    for run in runs[:3]:
        assert any(run.name in ln for ln in lines), res.stdout
    skipped = [ln for ln in lines if ln.startswith("skipped ")]
    assert len(skipped) == 1 and runs[3].name in skipped[0] and "did not finish" in skipped[0]
    for name in ("accuracy.png", "epsilon.png", "accuracy_vs_epsilon.png"):
        assert (tmp_path / "out" / name).read_bytes()[:4] == b"\x89PNG"


def test_sweep_and_run_directories_mix(tmp_path):
    sweep, runs = _sweep(tmp_path, finished=4)
    _write_run(tmp_path / "single", 0.9, 1.0, 1.0, "baek", 10)
    res = report(sweep, tmp_path / "single", "--out", tmp_path / "out")
    assert res.exit_code == 0, res.output
    with open(tmp_path / "out" / "report.csv") as fh:
        names = [r["run"] for r in csv.DictReader(fh)]
    assert names == [f"sweep/{run.name}" for run in runs] + [f"{tmp_path.name}/single"]
    assert "skipped" not in res.stdout


def test_a_sweep_with_no_finished_run_is_one_error_line(tmp_path):
    sweep, _ = _sweep(tmp_path, finished=0)
    res = report(sweep, "--out", tmp_path / "out")
    assert res.exit_code == 2
    lines = res.stderr.strip().splitlines() if res.stderr else res.output.strip().splitlines()
    assert len(lines) == 1 and "no finished run" in lines[0] and str(sweep) in lines[0], res.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("table", [None, "run,seed\n", "\x00\x01 not a csv"])
def test_a_live_or_killed_sweep_names_every_run_it_has_not_reported(tmp_path, table):
    """Before its sweep.csv (a live or a killed first sweep), with one cut to its header or not a
    csv at all: the manifest plans the runs, and each one without a summary is named as skipped."""
    out, scenario = tmp_path / "sweep", tmp_path / "tiny.yaml"
    scenario.write_text("name: baek_ci\n")
    sw.prepare(out, scenario, GRID, [0], [])
    runs = sw.expand(GRID, [0])
    _write_run(out / runs[0].name, 0.8, 2.0, 2.0, "none", 10)
    (out / runs[1].name).mkdir()  # a run still running
    if table is not None:
        (out / "sweep.csv").write_text(table)
    res = report(out, "--out", tmp_path / "out")
    assert res.exit_code == 0, res.output
    with open(tmp_path / "out" / "report.csv") as fh:
        assert [r["run"] for r in csv.DictReader(fh)] == [f"sweep/{runs[0].name}"]
    skipped = [ln for ln in res.stdout.splitlines() if ln.startswith("skipped ")]
    assert [next(r.name for r in runs if r.name in ln) for ln in skipped] == [r.name for r in runs[1:]], res.stdout


def test_a_sweep_s_choice_among_its_runs_is_said_under_its_runs(tmp_path):
    """No row's own epsilon covers choosing among a sweep's runs (nor, after optuna, any of them):
    the report says what does, from selection.json, as the sweep did."""
    sweep, _ = _sweep(tmp_path, finished=4)
    (sweep / sw.SELECTION).write_text(json.dumps({"runs": 4, "unfinished": 1, "epsilon_all_runs": 3.25,
                                                  "delta": 1e-5, "adaptive": True}))
    res = report(sweep, "--out", tmp_path / "out")
    assert res.exit_code == 0, res.output
    assert (f"{sweep}: optuna chose each point from the runs before it: any of these 4 private runs (1 of them "
            "unfinished), and choosing among them, is covered by epsilon 3.25 at delta 1e-05, their ledgers "
            "composed, not by its row's epsilon (selection.json)") in " ".join(res.stdout.split())
