"""SIGINT (once and twice), SIGTERM and SIGHUP at three moments of a private run -- Ray start-up,
worker start-up, mid-round -- through the real CLI (every moment with SIGINT; SIGTERM and SIGHUP
to the driver's whole process group, as a closed terminal or `kill -TERM -PGID` sends them).
Afterwards the run directory agrees with itself and every process the run started is gone."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
import yaml

from dpfl_ray.data import build_federation
from dpfl_ray.runs.record import read_releases
from dpfl_ray.training.models import build_model, evaluate, get_flat
from dpfl_ray.scenario import load_scenario
from tests.helpers import long_dp_fedavg

ROOT = Path(__file__).resolve().parents[2]

PRIVATE = long_dp_fedavg("signals", 400)


def _descendants(proc: psutil.Process) -> set[int]:
    try:
        return {p.pid for p in proc.children(recursive=True)}
    except psutil.Error:
        return set()


def _wait_for(condition, proc, timeout=120.0) -> set[int]:
    """Poll until ``condition()``; returns every descendant pid seen meanwhile."""
    seen, end = set(), time.monotonic() + timeout
    ps = psutil.Process(proc.pid)
    while not condition():
        assert proc.poll() is None, f"dpfl ended early: {proc.communicate()}"
        assert time.monotonic() < end, "the moment never came"
        seen |= _descendants(ps)
        time.sleep(0.05)
    return seen | _descendants(ps)


def _ray_sessions(proc: psutil.Process) -> set[int]:
    """The sessions of the private Ray's GCS and raylet (at least one of them exists)."""
    sessions = set()
    for p in proc.children(recursive=True):
        try:
            if p.name() in ("gcs_server", "raylet"):
                sessions.add(os.getsid(p.pid))
        except (psutil.Error, OSError):
            pass
    assert sessions, "no GCS or raylet among the run's processes"
    return sessions


def _alive(pids: set[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.Error:
            pass
    return out


SIGNALS = {"sigint": [signal.SIGINT], "double_sigint": [signal.SIGINT, signal.SIGINT],
           "sigterm_group": [signal.SIGTERM], "sighup_group": [signal.SIGHUP]}
# Every moment with Ctrl-C: all signals go through one handler (runtime/shutdown.py) and differ
# only in the exit code, except that a second Ctrl-C must not cut the files short -- so that one
# comes mid-round, while the round's files are being written. SIGTERM and SIGHUP go to the whole
# process group, which the private Ray must not be in: a closed terminal's SIGHUP mid-round took the
# coordinator's model and ledger along, and SIGTERM must stop as fast as SIGINT.
CASES = [("sigint", "ray_startup"), ("sigint", "worker_start"), ("sigint", "mid_round"),
         ("double_sigint", "mid_round"), ("sigterm_group", "ray_startup"), ("sighup_group", "mid_round")]


@pytest.mark.parametrize("kind, moment", CASES, ids=[f"{k}-{m}" for k, m in CASES])
def test_a_signal_leaves_a_consistent_run_and_no_process(tmp_path, kind, moment):
    path = tmp_path / "private.yaml"
    path.write_text(yaml.safe_dump(PRIVATE))
    out = tmp_path / "run"
    env = dict(os.environ, COLUMNS="200")
    # a session of its own, as a shell's job: the group signals reach this run and nothing else
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "run", str(path), "--out", str(out)], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        ps = psutil.Process(proc.pid)
        if moment == "ray_startup":  # Ray's first process exists, the run has not begun
            seen = _wait_for(lambda: any("gcs_server" in p.name() for p in ps.children(recursive=True)), proc)
        elif moment == "worker_start":  # the run directory is made right before the workers start
            seen = _wait_for(lambda: (out / "rounds.jsonl").exists(), proc)
        else:
            seen = _wait_for(lambda: (out / "rounds.jsonl").exists()
                             and len((out / "rounds.jsonl").read_text().splitlines()) >= 2, proc)
        assert _ray_sessions(ps) - {proc.pid} == _ray_sessions(ps), "the private Ray is in the driver's session"
        sent = time.monotonic()
        for i, sig in enumerate(SIGNALS[kind]):
            if i:
                time.sleep(0.3)
            if kind.endswith("_group"):
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=30)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    print(f"{kind} at {moment}: stopped {took:.1f} s after the signal")
    assert proc.returncode == 128 + SIGNALS[kind][0], (proc.returncode, stderr[-2000:])
    assert "Traceback" not in stderr and "SIGTERM received" not in stderr, stderr[-2000:]
    assert took < 10, f"stopping took {took:.1f}s"

    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    ledger = json.loads((out / "ledger.json").read_text())
    assert summary["stop_reason"] == "interrupted"
    assert summary["rounds_completed"] == len(rows) == ledger["num_rounds"]
    # the resume command only where there is a checkpoint to resume from
    assert ("dpfl run --resume" in stdout.replace("\n", "")) == (out / "checkpoint.npz").exists(), stdout[-2000:]
    # every round the server may have seen is in the rows or named by the summary (privacy/reruns.py)
    listed = {r for r, e in read_releases(out).items() if e.get("released") is not False}
    again = set(summary.get("released_before_resume", {}).get("rounds", []))
    assert listed == {r["round"] for r in rows} | again and len(again) <= 1, (listed, again)
    assert [r["round"] for r in ledger["rounds"]] == [r["round"] for r in rows]
    assert summary["epsilon"] == (rows[-1]["epsilon"] if rows else None)
    if rows:
        assert ledger["epsilon"] == pytest.approx(summary["epsilon"], rel=1e-12)
    if "timings" in summary:  # the wall time counts Ray's start-up (and any second try of it) too
        timings = summary["timings"]
        assert summary["wall_seconds"] >= timings["ray_init_seconds"] + timings["actors_requested_seconds"]

    sc = load_scenario(out / "scenario.yaml")
    fed = build_federation(sc)
    model = build_model(sc.model, fed.dataset.input_shape, fed.dataset.num_classes, sc.seed)
    if (out / "model.pt").exists():  # the coordinator's model: the initial one if no round committed
        initial = get_flat(model)
        model.load_state_dict(torch.load(out / "model.pt"))
        if rows:
            acc, _ = evaluate(model, fed.dataset.x_test, fed.dataset.y_test)
            assert acc == rows[-1]["test_accuracy"]
        else:
            assert np.array_equal(get_flat(model), initial)
    else:  # stopped before its coordinator began: no model, and the summary says so
        assert not rows and summary["model"].startswith("none: the run stopped before its coordinator began")

    end = time.monotonic() + 10
    while _alive(seen) and time.monotonic() < end:
        time.sleep(0.2)
    assert not _alive(seen), f"processes of the run still alive: {_alive(seen)}"


def _catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (Linux: SigCgt in /proc/PID/status)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next((int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigCgt:")), 0)
    return bool(mask >> (sig - 1) & 1)


@pytest.mark.parametrize("delay", [0.0, 0.6, 1.3])
def test_a_signal_while_the_command_loads_is_a_quiet_stop(tmp_path, delay):
    """While `dpfl run` imports its modules and checks the scenario, a signal is recorded and acted
    on once that is done: exit 130, no traceback, and a run that never went on training.

    ``delay`` counts from the moment the command's first module has taken the signals (it catches
    SIGTERM, which Python alone does not): before that the interpreter itself is starting, and a
    Ctrl-C there ends it by the signal's default action -- nothing has started, nothing is lost,
    but no code of ours can answer it."""
    scenario = tmp_path / "tiny.yaml"
    scenario.write_text(yaml.safe_dump({"name": "tiny", "data": {"source": "synthetic", "num_clients": 4},
                                        "model": {"name": "logistic"}, "training": {"rounds": 200},
                                        "sampling": {"mode": "fixed", "clients_per_round": 4}}))
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "run", str(scenario), "--out", str(out)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    end = time.monotonic() + 60
    while not _catches(proc.pid, signal.SIGTERM):
        assert proc.poll() is None and time.monotonic() < end, proc.communicate()
        time.sleep(0.005)
    time.sleep(delay)
    os.killpg(proc.pid, signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=60)
    finally:  # a run that did not stop must not outlive the test, nor its private Ray
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert proc.returncode == 130, err.decode()[-2000:]
    assert b"Traceback" not in err
    summary = out / "summary.json"
    assert not summary.exists() or json.loads(summary.read_text())["rounds_completed"] < 200


INTERRUPT_INSIDE_A_STRING_EXEC = '''
import os, signal, sys

class _Interrupt:
    """On the first import after the command has given the signals back, a real SIGINT whose
    KeyboardInterrupt ends an exec() of a string, as one landing in dataclasses' or typing's does."""
    fired = False

    def find_spec(self, name, path=None, target=None):
        released = "typer" in sys.modules and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        if not _Interrupt.fired and released:
            _Interrupt.fired = True
            open(os.environ["DPFL_TEST_MARK"], "w").write(name)
            exec("os.kill(os.getpid(), signal.SIGINT)\\nfor _ in range(3): pass", {"os": os, "signal": signal})
        return None

sys.meta_path.insert(0, _Interrupt())
'''


def test_an_interrupt_that_ends_a_string_exec_still_exits_130(tmp_path):
    """Under `python -m`, CPython turns a KeyboardInterrupt that ended an exec() of a string into a
    death by SIGINT at exit (status -2), even once it was handled. The command's Ctrl-C is a
    quiet exit 130 all the same. Deterministic: the interrupt is raised inside such an exec."""
    (tmp_path / "sitecustomize.py").write_text(INTERRUPT_INSIDE_A_STRING_EXEC)
    scenario = tmp_path / "tiny.yaml"
    scenario.write_text(yaml.safe_dump({"name": "tiny", "data": {"source": "synthetic", "num_clients": 4},
                                        "model": {"name": "logistic"}, "training": {"rounds": 2}}))
    mark = tmp_path / "fired"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]), "DPFL_TEST_MARK": str(mark)}
    done = subprocess.run([sys.executable, "-m", "cli.main", "run", str(scenario), "--out", str(tmp_path / "run")],
                          cwd=ROOT, env=env, capture_output=True, timeout=120)
    assert mark.exists(), "the interrupt was never raised"
    assert done.returncode == 130, (done.returncode, done.stderr.decode()[-2000:])
    assert b"Traceback" not in done.stderr
    assert not (tmp_path / "run" / "summary.json").exists()
