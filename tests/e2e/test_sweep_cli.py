"""`dpfl sweep` for real: a two-run sweep of the tiny synthetic scenario through `dpfl run`
subprocesses, its resume, and a bad grid refused before anything runs. The runs join the test
session's Ray (`--address`), which the sweep hands to every run."""
import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from dpfl_ray.runs import sweep as sw

from .test_cli import ROOT, TINY, dpfl


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
    again = dpfl(*args)  # everything finished: nothing runs again, the csv is rewritten the same
    assert again.returncode == 0 and again.stdout.count(": skipped") == 2
    with open(out / "sweep.csv") as fh:
        assert list(csv.DictReader(fh)) == rows


def test_a_bad_grid_is_one_line_and_runs_nothing(tmp_path):
    scenario = tmp_path / "tiny.yaml"
    scenario.write_text(yaml.safe_dump(TINY))
    out = tmp_path / "never"
    res = dpfl("sweep", scenario, "--grid", "faults.dropout.rate=0,2", "--out", out)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and "faults.dropout.rate" in lines[0], res.stderr
    assert not out.exists()


def test_runs_past_their_timeout_are_stopped_and_recorded(ray_address, tmp_path):
    scenario = tmp_path / "tiny.yaml"
    # joining a running Ray is quick: enough rounds that no run can finish within its 1 s
    scenario.write_text(yaml.safe_dump({**TINY, "training": {**TINY["training"], "rounds": 500}}))
    out = tmp_path / "sweep"
    res = dpfl("sweep", scenario, "--grid", "training.lr=0.1,0.2", "--out", out, "--timeout", "1",
               "--address", ray_address)
    assert res.returncode == 1 and "2 of 2 runs did not finish" in res.stdout, res.stdout + res.stderr
    with open(out / "sweep.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["status"], r["final_accuracy"]) for r in rows] == [("timeout", ""), ("timeout", "")]
    assert (out / "logs" / f"{rows[0]['run']}.log").is_file()


def _processes_naming(text: str) -> list[int]:
    """PIDs of live processes whose command line contains ``text``."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and text.encode() in (proc / "cmdline").read_bytes():
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def test_a_live_sweep_directory_is_refused_and_a_killed_sweep_takes_its_runs_with_it(ray_address, tmp_path):
    scenario = tmp_path / "tiny.yaml"
    scenario.write_text(yaml.safe_dump({**TINY, "training": {**TINY["training"], "rounds": 500}}))
    out = tmp_path / "sweep"
    args = ["sweep", scenario, "--grid", "training.lr=0.1,0.2", "--out", out, "--timeout", "240",
            "--address", ray_address]
    sweep = subprocess.Popen([sys.executable, "-m", "cli.main", *map(str, args)], cwd=ROOT,
                             env=dict(os.environ, COLUMNS="200"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows, end = out / "training.lr=0.1" / "rounds.jsonl", time.monotonic() + 120
    while not rows.exists():  # its first run has joined Ray and opened its record
        assert sweep.poll() is None and time.monotonic() < end
        time.sleep(0.1)
    second = dpfl(*args)
    lines = second.stderr.strip().splitlines()
    assert second.returncode == 2 and len(lines) == 1, second.stderr
    assert f"is in use by a sweep: PID {sweep.pid} on " in lines[0], lines[0]
    assert rows.exists() and not (out / ".incomplete").exists()  # the live run was left alone

    sweep.kill()  # SIGKILL: no handler runs in the sweep
    sweep.wait(timeout=30)
    # the run holds the sweep's lock until its last thread has exited: then the directory is free
    end = time.monotonic() + 10
    while (_processes_naming(str(out)) or sw._held(out / sw.LOCK)) and time.monotonic() < end:
        time.sleep(0.1)
    assert _processes_naming(str(out)) == [] and not sw._held(out / sw.LOCK), "a run outlived its sweep by 10 s"
    with sw.SweepLock(out):
        pass
    summary = json.loads((rows.parent / "summary.json").read_text())
    assert summary["stop_reason"] == "interrupted"  # it stopped as told, with its files
