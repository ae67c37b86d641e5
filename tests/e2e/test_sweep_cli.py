"""`dpfl sweep` for real: Ray Tune trials of the tiny synthetic scenario, side by side in the test
session's Ray (`--address`); the same run directory as `dpfl run`; resume; a bad grid refused
before anything runs; Ctrl-C, timeouts and a killed sweep."""
import csv
import json
import os
import signal
import subprocess
import sys
import time

import yaml

from dpfl_ray.runs import sweep as sw
from tests.helpers import every_client_straggles

from .test_cli import ROOT, TINY, dpfl

RUN_FILES = ("model.pt", "checkpoint.npz", "scenario.yaml", "accuracy.png", "ledger.json")
# The runs that are stopped or killed from outside sleep 0.2 s a round while they wait for it.
SLOW = {"faults": every_client_straggles(0.2)}


def _timings_aside(run_dir):
    """A run directory's summary and rows without what the clock or the placement decides."""
    summary = json.loads((run_dir / "summary.json").read_text())
    for key in ("wall_seconds", "timings", "placement"):
        summary.pop(key, None)
    rows = [{k: v for k, v in json.loads(line).items() if not k.endswith("seconds")}
            for line in (run_dir / "rounds.jsonl").read_text().splitlines()]
    return summary, rows


def test_a_real_sweep_writes_runs_csv_and_plots_and_resumes(ray_address, tmp_path):
    scenario = tmp_path / "tiny.yaml"
    scenario.write_text(yaml.safe_dump({**TINY, "training": {**TINY["training"], "rounds": 2},
                                        "resources": {"workers": 1, "num_cpus_per_worker": 0.5}}))
    out = tmp_path / "sweep"
    args = ("sweep", scenario, "--grid", "faults.dropout.rate=0,0.5", "--set", "faults.dropout.model=tail",
            "--out", out, "--timeout", "240", "--address", ray_address)
    res = dpfl(*args)
    assert res.returncode == 0, res.stdout + res.stderr
    with open(out / "sweep.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["faults.dropout.rate"], r["status"], r["stop_reason"], r["rounds"]) for r in rows] == \
        [("0", "ok", "completed", "2"), ("0.5", "ok", "completed", "2")]
    assert all(0 <= float(r["final_accuracy"]) <= 1 and r["seed"] == "1" for r in rows)
    survived = [[json.loads(line)["survived"] for line in (out / r["run"] / "rounds.jsonl").read_text().splitlines()]
                for r in rows]
    assert survived == [[6, 6], [3, 3]]  # the grid value reached the run: tail dropout of half the six
    assert (out / "accuracy_vs_faults.dropout.rate.png").read_bytes()[:4] == b"\x89PNG"

    # every round reached Tune: its per-trial progress.csv and TensorBoard event files
    (experiment,) = (out / "tune").iterdir()
    for r, run_rows in zip(rows, survived):
        with open(experiment / r["run"] / "progress.csv") as fh:
            reported = [x for x in csv.DictReader(fh) if x.get("round")]
        assert [int(x["round"]) for x in reported] == [1, 2]
        assert [int(x["survived"]) for x in reported] == run_rows
        assert list((experiment / r["run"]).glob("events.out.tfevents.*"))

    again = dpfl(*args)  # everything finished: nothing runs again, the csv is rewritten the same
    assert again.returncode == 0 and "2 runs, 2 finished before" in again.stdout, again.stdout + again.stderr
    with open(out / "sweep.csv") as fh:
        assert list(csv.DictReader(fh)) == rows

    # a trial writes what `dpfl run` writes for its combination (its folder named alike: plots carry it)
    plain = tmp_path / "plain" / "sweep" / rows[1]["run"]
    res = dpfl("run", scenario, "--set", "faults.dropout.model=tail", "--set", "faults.dropout.rate=0.5",
               "--out", plain, "--address", ray_address)
    assert res.returncode == 0, res.stdout + res.stderr
    trial = out / rows[1]["run"]
    assert sorted(p.name for p in trial.iterdir()) == sorted(p.name for p in plain.iterdir())
    for name in RUN_FILES:
        if (plain / name).exists():
            assert (trial / name).read_bytes() == (plain / name).read_bytes(), name
    assert _timings_aside(trial) == _timings_aside(plain)


def test_a_random_search_runs_its_drawn_points_and_more_samples_run_only_the_new_ones(ray_address, tmp_path):
    scenario = tmp_path / "tiny.yaml"
    scenario.write_text(yaml.safe_dump({**TINY, "training": {**TINY["training"], "rounds": 1}}))
    out = tmp_path / "search"
    args = ("sweep", scenario, "--search", "random", "--grid", "training.lr=loguniform(0.01,0.5)",
            "--grid", "sampling.clients_per_round=3,6", "--out", out, "--timeout", "240", "--address", ray_address)
    res = dpfl(*args, "--num-samples", "1")
    assert res.returncode == 0, res.stdout + res.stderr
    (first,) = json.loads((out / "sweep.json").read_text())["search"]["points"]

    more = dpfl(*args, "--num-samples", "2")  # the same space and seed: the first point is kept, one runs
    assert more.returncode == 0 and "2 runs, 1 finished before" in more.stdout, more.stdout + more.stderr
    points = json.loads((out / "sweep.json").read_text())["search"]["points"]
    assert points[0] == first and len(points) == 2
    with open(out / "sweep.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [[r["training.lr"], r["sampling.clients_per_round"]] for r in rows] == points
    assert [r["status"] for r in rows] == ["ok", "ok"]
    for r, (lr, per_round) in zip(rows, points):  # the drawn values reached the runs
        ran = yaml.safe_load((out / r["run"] / "scenario.yaml").read_text())
        assert (ran["training"]["lr"], ran["sampling"]["clients_per_round"]) == (float(lr), int(per_round))
        assert json.loads((out / r["run"] / "rounds.jsonl").read_text().splitlines()[0])["sampled"] == int(per_round)
        assert 0.01 <= float(lr) <= 0.5


def test_an_optuna_search_asks_each_batch_from_the_runs_before_it_and_resumes(ray_address, tmp_path):
    from dpfl_ray.runtime.search import OptunaSearch, parse_space

    scenario = tmp_path / "tiny.yaml"
    scenario.write_text(yaml.safe_dump({**TINY, "training": {**TINY["training"], "rounds": 1}}))
    out = tmp_path / "optuna"
    grid = ["training.lr=loguniform(0.01,0.5)", "sampling.clients_per_round=3,6"]
    args = ("sweep", scenario, "--search", "optuna", *(a for axis in grid for a in ("--grid", axis)),
            "--num-samples", "3", "--max-concurrent", "2", "--out", out, "--timeout", "240", "--address", ray_address)
    res = dpfl(*args)  # a batch of two, then one asked from their results, on the same Ray
    assert res.returncode == 0, res.stdout + res.stderr
    assert "2 of 3 points asked" in res.stdout and "optuna: 3 of 3 points asked" in res.stdout, res.stdout
    points = [tuple(p) for p in json.loads((out / "sweep.json").read_text())["search"]["points"]]
    with open(out / "sweep.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["training.lr"], r["sampling.clients_per_round"]) for r in rows] == points
    assert [r["status"] for r in rows] == ["ok"] * 3
    accuracy = [float(r["final_accuracy"]) for r in rows]
    # the third point is what TPE asks when told the first two runs' final accuracies
    assert OptunaSearch(parse_space(grid), 3, batch=2, asked=points[:2]).ask(accuracy[:2]) == [points[2]]
    best = max(range(3), key=lambda i: accuracy[i])
    assert (f"best of 3 points by final_accuracy: training.lr={points[best][0]} "
            f"sampling.clients_per_round={points[best][1]}: {accuracy[best]:.4f}") in res.stdout

    again = dpfl(*args)  # every point asked and run: nothing runs again
    assert again.returncode == 0 and "3 runs (optuna: 3 of 3 points asked), 3 finished before" in again.stdout, \
        again.stdout + again.stderr
    assert "points asked\n" not in again.stdout.split("finished before", 1)[1]
    fewer = dpfl(*("2" if args[i - 1] == "--num-samples" else a for i, a in enumerate(args)))  # a run left out
    assert fewer.returncode == 2 and f"--num-samples: {out} holds a search of 3 points: --num-samples 2 would leave 1" \
        in " ".join(fewer.stderr.split()), fewer.stdout + fewer.stderr
    assert len(json.loads((out / "sweep.json").read_text())["search"]["points"]) == 3

    # a batch the cluster cannot hold is said after the sweep's files are written, not instead of them
    wide = dpfl("sweep", scenario, "--search", "optuna", "--grid", "resources.workers=5", "--grid",
                "training.lr=loguniform(0.01,0.5)", "--num-samples", "1", "--out", tmp_path / "wide", "--address",
                ray_address)
    assert wide.returncode == 2 and "do not fit" in wide.stderr and "Traceback" not in wide.stderr, wide.stderr
    with open(tmp_path / "wide" / "sweep.csv") as fh:
        assert [r["status"] for r in csv.DictReader(fh)] == ["not run"]


def test_asha_stops_the_trailing_run_which_ends_with_its_files_and_is_not_run_again(ray_address, tmp_path):
    scenario = tmp_path / "tiny.yaml"
    # every client straggles 0.3 s (no deadline): a round takes that long, so Tune's decision on round 1
    # reaches the trial long before its 40th round
    scenario.write_text(yaml.safe_dump({**TINY, "training": {**TINY["training"], "rounds": 40},
                                        "faults": every_client_straggles(0.3)}))
    out = tmp_path / "asha"
    # one at a time: the learning run sets round 1's bar, which the run that cannot learn (lr 1e-9) misses
    args = ("sweep", scenario, "--grid", "training.lr=0.3,1e-9", "--scheduler", "asha", "--max-concurrent", "1",
            "--out", out, "--timeout", "240", "--address", ray_address)
    res = dpfl(*args)
    assert res.returncode == 0, res.stdout + res.stderr
    with open(out / "sweep.csv") as fh:
        rows = {r["training.lr"]: r for r in csv.DictReader(fh)}
    assert (rows["0.3"]["stop_reason"], rows["0.3"]["rounds"], rows["0.3"]["status"]) == ("completed", "40", "ok")
    stopped = rows["1e-9"]
    assert (stopped["stop_reason"], stopped["status"]) == ("stopped_early", "ok") and 1 <= int(stopped["rounds"]) < 40
    run_dir = out / stopped["run"]  # its files are those of the rounds it ran
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds_completed"] == int(stopped["rounds"]) == len((run_dir / "rounds.jsonl").read_text().splitlines())
    assert (run_dir / "model.pt").is_file()
    again = dpfl(*args)  # a run stopped early is finished: nothing runs again
    assert again.returncode == 0 and "2 runs, 2 finished before" in again.stdout, again.stdout + again.stderr


def test_a_bad_grid_is_one_line_and_runs_nothing(tmp_path):
    scenario = tmp_path / "tiny.yaml"
    scenario.write_text(yaml.safe_dump(TINY))
    out = tmp_path / "never"
    res = dpfl("sweep", scenario, "--grid", "faults.dropout.rate=0,2", "--out", out)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and "faults.dropout.rate" in lines[0], res.stderr
    assert not out.exists()


def _start(args, output=subprocess.PIPE):
    return subprocess.Popen([sys.executable, "-m", "cli.main", *map(str, args)], cwd=ROOT,
                            env=dict(os.environ, COLUMNS="200"), stdout=output, stderr=output, text=True)


def _wait_for(paths, proc, seconds=180):
    end = time.monotonic() + seconds
    while not all(p.exists() and p.stat().st_size for p in paths):
        if proc.poll() is not None or time.monotonic() > end:
            proc.kill()
            raise AssertionError(f"the sweep ended or took over {seconds} s: {proc.communicate(timeout=30)}")
        time.sleep(0.1)


def test_ctrl_c_stops_every_trial_with_its_files_and_the_same_command_resumes(ray_session, ray_address, tmp_path):
    scenario = tmp_path / "tiny.yaml"
    scenario.write_text(yaml.safe_dump({**TINY, "training": {**TINY["training"], "rounds": 100000}, **SLOW}))
    out = tmp_path / "sweep"
    args = ["sweep", scenario, "--grid", "training.lr=0.1,0.2", "--out", out, "--timeout", "600",
            "--address", ray_address]
    # CPUs an actor of an earlier test in this process may still hold until it is collected: not the sweep's
    before = ray_session.available_resources().get("CPU", 0.0)
    sweep = _start(args)
    runs = [out / "training.lr=0.1", out / "training.lr=0.2"]
    _wait_for([r / "rounds.jsonl" for r in runs], sweep)  # both trials train at once
    # each trial's worker sits in its placement group's bundle (0.5 CPU): no bundle has a CPU left; and
    # not beside it: the sweep takes the two bundles' CPUs and no more (an earlier test's actor that ends
    # meanwhile only gives CPUs back). Ray's view of the free resources lags the cluster's: it must settle
    # on that within seconds
    end = time.monotonic() + 15
    while True:
        free = ray_session.available_resources()
        placed = [k for k in free if k.startswith("CPU_group_")] == [] and free.get("CPU", 0.0) >= before - 2 * 0.5
        if placed or time.monotonic() > end:
            break
        time.sleep(0.2)
    assert placed, (before, free.get("CPU"), free)
    sweep.send_signal(signal.SIGINT)
    stdout, stderr = sweep.communicate(timeout=90)
    assert sweep.returncode == 130, stdout + stderr
    assert "interrupted; resume with: dpfl sweep" in stdout and stderr.strip() == "", stdout + stderr
    with open(out / "sweep.csv") as fh:
        assert [r["status"] for r in csv.DictReader(fh)] == ["interrupted", "interrupted"]
    before = {}
    for run in runs:  # each stopped between rounds and wrote its files for its last committed round
        summary = json.loads((run / "summary.json").read_text())
        rows = (run / "rounds.jsonl").read_text().splitlines()
        assert summary["stop_reason"] == "interrupted" and summary["rounds_completed"] == len(rows) > 0
        before[run] = rows
    assert not (out / ".stop").exists()
    # the same command resumes: each unfinished run goes on from its checkpoint (every round is one
    # here), its rows kept, until a 1 s timeout, past which each run stops itself with its files
    res = dpfl(*args[:-4], "--timeout", "1", "--address", ray_address)
    assert res.returncode == 1 and "0 finished before, 2 go on from their checkpoints" in res.stdout, \
        res.stdout + res.stderr
    assert "2 of 2 runs did not finish" in res.stdout
    assert not (out / ".incomplete").exists()
    with open(out / "sweep.csv") as fh:
        assert [r["status"] for r in csv.DictReader(fh)] == ["timeout", "timeout"]
    for run in runs:
        summary = json.loads((run / "summary.json").read_text())
        rows = (run / "rounds.jsonl").read_text().splitlines()
        assert summary["stop_reason"] == "interrupted" and len(before[run]) <= summary["rounds_completed"] < 100000
        assert rows[:len(before[run])] == before[run] and summary["rounds_completed"] == len(rows)


def test_a_live_sweep_directory_is_refused_and_a_killed_sweeps_runs_are_set_aside(ray_address, tmp_path):
    scenario = tmp_path / "tiny.yaml"
    scenario.write_text(yaml.safe_dump({**TINY, "training": {**TINY["training"], "rounds": 100000}, **SLOW}))
    out = tmp_path / "sweep"
    args = ["sweep", scenario, "--grid", "training.lr=0.1,0.2", "--out", out, "--timeout", "600",
            "--address", ray_address]
    sweep = _start(args, subprocess.DEVNULL)  # killed below: no pipe for a leftover child to hold open
    rows = out / "training.lr=0.1" / "rounds.jsonl"
    _wait_for([rows], sweep)
    second = dpfl(*args)
    lines = second.stderr.strip().splitlines()
    assert second.returncode == 2 and len(lines) == 1, second.stderr
    assert f"is in use by a sweep: PID {sweep.pid} on " in lines[0], lines[0]
    assert rows.exists() and not (out / ".incomplete").exists()  # the live run was left alone

    sweep.kill()  # SIGKILL: no handler runs in the sweep; Ray ends the trials of its dead driver
    sweep.wait(timeout=30)
    # both trials may have started: neither may outlive its sweep (each holds its run's lock while it lives)
    locks = [out / sw.RUNNING / f"training.lr={lr}.lock" for lr in ("0.1", "0.2")]
    end = time.monotonic() + 60
    while any(sw._held(lock) for lock in locks) and time.monotonic() < end:
        time.sleep(0.2)
    assert not any(sw._held(lock) for lock in locks), "a trial outlived its sweep by 60 s"
    with sw.SweepLock(out):
        todo, done = sw.set_aside(out, sw.expand({"training.lr": ["0.1", "0.2"]}, None))
    assert [r.name for r in todo] == ["training.lr=0.1", "training.lr=0.2"] and done == {}
    assert (out / ".incomplete" / "training.lr=0.1.1" / "rounds.jsonl").stat().st_size > 0  # its rounds kept
