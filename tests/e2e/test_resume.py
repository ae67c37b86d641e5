"""Exact resume: a private SecAgg run whose driver is killed with SIGKILL after round k -- as Ray's
core ends it when its node stops -- leaves the files of its last checkpoint (its watcher writes
them: runtime/rescue.py), and resumed with `dpfl run --resume` ends with the same bytes as an
uninterrupted run of the same scenario.

The runs join the test session's Ray (RAY_ADDRESS), as runs on a cluster do: a killed driver's
actors are ended by Ray, and its resume is a new driver. A private Ray's start and stop under
signals is tests/e2e/test_signals.py's subject."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from dpfl_ray.runtime.checkpoint import read_checkpoint
from tests.helpers import every_client_straggles

ROOT = Path(__file__).resolve().parents[2]

BAEK = {
    "name": "resume", "seed": 5,
    "data": {"source": "synthetic", "num_clients": 40, "synthetic_examples": 800, "synthetic_features": 6},
    "model": {"name": "logistic"},
    "training": {"algorithm": "baek", "rounds": 8, "batch_size": 8, "lr": 0.3},
    "sampling": {"mode": "poisson", "rate": 0.25, "clients_per_round": None},
    "privacy": {"noise_multiplier": 1.0, "clipping": {"norm": 0.5}, "accountant": "rdp", "calibration": "baek"},
    "secagg": {"enabled": True, "threshold": "majority"},
    "faults": {"dropout": {"model": "tail", "rate": 0.2, "phase": "upload"}},
    "resources": {"workers": 1, "num_cpus_per_worker": 0.5},
    "output": {"checkpoint_every": 1},
}

# Without SecAgg, a round's evaluation rides on the next round's training calls: a checkpoint can
# hold a round whose row is not written yet (its record, pending)
DP_FEDAVG = {**BAEK, "name": "resume_plain", "training": {**BAEK["training"], "algorithm": "dp_fedavg"},
             "privacy": {"noise_multiplier": 1.0, "clipping": {"norm": 0.5}, "accountant": "rdp"},
             "secagg": {"enabled": False}}


def _dpfl(address, *args, **kw):
    return subprocess.Popen([sys.executable, "-m", "cli.main", *map(str, args)], cwd=ROOT,
                            env=dict(os.environ, COLUMNS="200", RAY_ADDRESS=address), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def _rows(path):
    rows = [json.loads(line) for line in (path / "rounds.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if "seconds" not in k} for r in rows]


def test_a_killed_driver_resumes_to_the_uninterrupted_bytes(ray_address, tmp_path):
    scenario = tmp_path / "baek.yaml"
    scenario.write_text(yaml.safe_dump(BAEK))
    full, cut = tmp_path / "full", tmp_path / "cut"
    # the reference and the victim run side by side: nothing in a run depends on timing, which is
    # what the equal bytes below show
    ref = _dpfl(ray_address, "run", scenario, "--out", full)
    victim = _dpfl(ray_address, "run", scenario, "--out", cut, start_new_session=True)
    end = time.monotonic() + 300
    while not ((cut / "rounds.jsonl").exists() and len((cut / "rounds.jsonl").read_text().splitlines()) >= 3
               and (cut / "checkpoint.npz").exists()):
        assert victim.poll() is None and time.monotonic() < end, victim.communicate()
        time.sleep(0.05)
    victim.kill()  # the driver alone, without warning
    _, err = victim.communicate(timeout=120)  # its watcher holds the pipes until it is done
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"resume with: dpfl run --resume {cut}" in errors[0], err[-3000:]
    assert "Traceback" not in err
    rows, summary = _rows(cut), json.loads((cut / "summary.json").read_text())
    ledger = json.loads((cut / "ledger.json").read_text())
    assert summary["stop_reason"] == "error" and (cut / "model.pt").exists()
    assert summary["rounds_completed"] == len(rows) == ledger["num_rounds"] == read_checkpoint(cut)["round"] >= 1
    assert summary["epsilon"] == rows[-1]["epsilon"] == ledger["epsilon"]
    # the checkpoint the coordinator wrote knows its scenario: an edit is refused, naming the field
    original = (cut / "scenario.yaml").read_text()
    (cut / "scenario.yaml").write_text(original.replace("noise_multiplier: 1.0", "noise_multiplier: 0.3"))
    res = _cli("run", "--resume", cut, "--address", "127.0.0.1:9")
    assert res.exit_code == 2 and "privacy.noise_multiplier is 0.3, the run was checkpointed with 1.0" in res.stderr
    (cut / "scenario.yaml").write_text(original)
    assert ref.wait(timeout=300) == 0, ref.communicate()

    resumed = _dpfl(ray_address, "run", "--resume", cut)
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err

    a, b = torch.load(full / "model.pt"), torch.load(cut / "model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert _rows(full) == _rows(cut) and len(_rows(cut)) == 8
    ledger_a, ledger_b = (json.loads((d / "ledger.json").read_text()) for d in (full, cut))
    assert ledger_a == ledger_b  # every float, bit for bit
    summary = json.loads((cut / "summary.json").read_text())
    assert summary["rounds_completed"] == 8 and summary["stop_reason"] == "completed"
    before = _snapshot(cut)
    res = _cli("run", "--resume", cut)  # finished: said so, nothing rewritten, Ray not started
    assert res.exit_code == 0 and "already finished" in res.stdout and _snapshot(cut) == before


ROUNDS = 30


def test_ctrl_c_prints_the_resume_command_and_resume_finishes(ray_address, tmp_path):
    """Without SecAgg: the stop, and any checkpoint, may fall while a round awaits its evaluation.
    Every client straggles 0.2 s, so a round takes at least that: the stop after round 2 comes
    seconds before the last round, where rounds of tens of milliseconds could end the run before a
    loaded machine handles the signal, and the run sleeps rather than trains while it waits."""
    scenario = tmp_path / "plain.yaml"
    scenario.write_text(yaml.safe_dump({**DP_FEDAVG, "training": {**DP_FEDAVG["training"], "rounds": ROUNDS},
                                        "faults": {**DP_FEDAVG["faults"], **every_client_straggles(0.2)}}))
    run = tmp_path / "run"
    proc = _dpfl(ray_address, "run", scenario, "--out", run)
    end = time.monotonic() + 300
    while not ((run / "rounds.jsonl").exists() and len((run / "rounds.jsonl").read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.monotonic() < end, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130 and f"dpfl run --resume {run}" in out.replace("\n", "")
    stopped = json.loads((run / "summary.json").read_text())["rounds_completed"]
    at_stop = _rows(run)  # every committed round has its row, evaluated
    assert len(at_stop) == stopped == read_checkpoint(run)["round"]
    assert all(r["test_accuracy"] is not None for r in at_stop)
    resumed = _dpfl(ray_address, "run", "--resume", run)
    assert resumed.wait(timeout=300) == 0, resumed.communicate()
    rows = _rows(run)
    assert [r["round"] for r in rows] == list(range(1, ROUNDS + 1)) and stopped < ROUNDS
    assert all(r["test_accuracy"] is not None for r in rows)


def _cli(*args):
    """``dpfl`` in this process (typer's CliRunner), with the signal handlers `dpfl run` installs
    put back afterwards."""
    from typer.testing import CliRunner

    from cli.main import app
    from dpfl_ray.runtime.shutdown import SIGNALS

    saved = {sig: signal.getsignal(sig) for sig in SIGNALS}
    try:
        return CliRunner().invoke(app, [str(a) for a in args])
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _checkpointed_run(tmp_path, rounds_done=2, summary=None):
    """A run directory as a run stopped after ``rounds_done`` rounds leaves it: the resolved
    scenario, its rows, and a checkpoint written as the coordinator writes one."""
    from dpfl_ray.runtime.checkpoint import scenario_fingerprint, write_checkpoint
    from dpfl_ray.scenario import scenario_from_dict

    sc = scenario_from_dict(BAEK)
    run = tmp_path / "run"
    run.mkdir()
    (run / "scenario.yaml").write_text(sc.to_yaml())
    (run / "rounds.jsonl").write_text("".join(json.dumps({"round": t + 1, "test_accuracy": 0.5}) + "\n"
                                              for t in range(rounds_done)))
    write_checkpoint(run, {"round": rounds_done, "algorithm": {},
                           "arrays": {"theta": np.zeros(3, np.float32)}, **scenario_fingerprint(sc)})
    if summary is not None:
        (run / "summary.json").write_text(json.dumps(summary))
    return run


def _snapshot(path: Path) -> dict:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in path.iterdir()}


def _truncate(path: Path, keep) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:keep(len(data))])


def _rewritten(run: Path, theta=None, **meta) -> None:
    """The run's checkpoint written again (as the coordinator writes one) with ``meta``'s fields and
    ``theta`` in place of its own."""
    from dpfl_ray.runtime.checkpoint import CHECKPOINT, write_checkpoint

    with np.load(run / CHECKPOINT) as data:
        state = {**json.loads(bytes(data["_meta"]).decode()), **meta,
                 "arrays": {"theta": data["theta"] if theta is None else theta}}
    write_checkpoint(run, state)


@pytest.mark.parametrize("damage, needle", [
    (lambda run: _truncate(run / "checkpoint.npz", lambda n: n // 2), "checkpoint.npz is not a readable checkpoint"),
    # read whole, but not in the shapes the coordinator restores (internal errors once Ray had started)
    (lambda run: _rewritten(run, theta=np.zeros((3, 1), np.float32)), "its model is not a vector of floats"),
    (lambda run: _rewritten(run, pending="garbage"), "its pending is not a JSON object (str)"),
    (lambda run: _rewritten(run, algorithm=[1, 2]), "its algorithm is not a JSON object (list)"),
    (lambda run: _truncate(run / "checkpoint.npz", lambda n: 0), "checkpoint.npz is not a readable checkpoint"),
    (lambda run: (run / "checkpoint.npz").write_text("not a zip file\n"), "is not a readable checkpoint"),
    (lambda run: _truncate(run / "rounds.jsonl", lambda n: n - 9), "rounds.jsonl line 2 is not round 2's row"),
    (lambda run: (run / "scenario.yaml").write_text((run / "scenario.yaml").read_text().replace("lr: 0.3", "lr: 0.5")),
     "scenario.yaml was edited after the checkpoint: training.lr is 0.5, the run was checkpointed with 0.3"),
    (lambda run: (run / "scenario.yaml").write_text(
        (run / "scenario.yaml").read_text().replace("delta: 1.0e-05", "delta: 0.001")),
     "privacy.delta is 0.001, the run was checkpointed with 1e-05"),
])
def test_resume_refuses_what_it_cannot_trust_before_ray_starts(tmp_path, damage, needle):
    """One `error:` line naming the culprit, and nothing written. The address is dead: had Ray
    been started (joined) first, the error would be about it."""
    run = _checkpointed_run(tmp_path)
    damage(run)
    before = _snapshot(run)
    res = _cli("run", "--resume", run, "--address", "127.0.0.1:9")
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: --resume: "), res.stderr
    assert needle in lines[0], lines[0]
    assert "Traceback" not in res.stderr + res.stdout and _snapshot(run) == before


@pytest.mark.parametrize("listing, needle", [
    (None, "it released nothing: run its scenario.yaml again with another --out"),
    (json.dumps({"round": 1, "scenario_sha256": "0" * 64, "model": "ab"}) + "\n",
     "the server may have seen a round (releases.jsonl): move all but dp_secret and releases.jsonl away, then run "
     "its scenario.yaml again into this folder (same randomness: a listed round is released only as it was)"),
])
def test_a_run_stopped_before_its_first_checkpoint_says_what_to_do_instead(tmp_path, listing, needle):
    """A Ctrl-C while Ray started leaves 0 rounds and no checkpoint: the directory can be neither
    resumed nor reused as --out, and the refusal said only why. It now says what is safe: a new run
    when nothing was released, else a new run in the folder that keeps the list and the secret."""
    run = _checkpointed_run(tmp_path, rounds_done=0, summary={"stop_reason": "interrupted", "rounds_completed": 0})
    (run / "checkpoint.npz").unlink()
    if listing is not None:
        (run / "releases.jsonl").write_text(listing)
    before = _snapshot(run)
    res = _cli("run", "--resume", run, "--address", "127.0.0.1:9")
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: --resume: "), res.stderr
    assert f"{run} has no checkpoint.npz (stopped before its first checkpoint" in lines[0]
    assert needle in lines[0] and not lines[0].endswith("..."), lines[0]
    assert _snapshot(run) == before


def test_a_run_directory_another_process_writes_is_refused_as_resume_and_as_out(tmp_path):
    """`dpfl run --resume DIR` while a sweep's trial (or another `dpfl run`) holds DIR's lock wrote
    the same files as that process: rows of one, summary and checkpoint of the other. The lock is the
    one a sweep's trial takes (runs/sweep.hold_run); the refused command holds none of it after."""
    from dpfl_ray.runs.sweep import hold_run

    run = _checkpointed_run(tmp_path)
    before = _snapshot(run)
    for args, option, where in ((("--resume", run), "--resume", run),
                                (("scenarios/quickstart.yaml", "--out", tmp_path / "new"), "--out", tmp_path / "new")):
        held = hold_run(where.parent, where.name)
        try:
            res = _cli("run", *args, "--address", "127.0.0.1:9")
        finally:
            os.close(held)
        lines = res.stderr.strip().splitlines()
        assert res.exit_code == 2 and len(lines) == 1, res.stderr
        assert lines[0] == (f"error: {option}: {where} is being written by another dpfl process (a run, or a sweep's "
                            f"trial, holds {where.parent / '.running' / (where.name + '.lock')}); wait for it to end")
        os.close(hold_run(where.parent, where.name))  # (a command let go would go on to Ray: this process's)
    assert _snapshot(run) == before and not (tmp_path / "new").exists()


def test_resuming_a_finished_run_says_so_and_touches_nothing(tmp_path):
    run = _checkpointed_run(tmp_path, rounds_done=8, summary={"stop_reason": "completed", "rounds_completed": 8,
                                                               "wall_seconds": 12.5})
    before = _snapshot(run)
    res = _cli("run", "--resume", run, "--address", "127.0.0.1:9")
    assert res.exit_code == 0, res.stderr
    assert "the run already finished (completed, 8 rounds); nothing to resume" in " ".join(res.stdout.split())
    assert _snapshot(run) == before


@pytest.mark.parametrize("saved_accountants", [True, False])
def test_a_resumed_ledger_publishes_the_uninterrupted_floats(saved_accountants):
    """PLD composes k identical rounds in one call to other last digits than k calls. A dp_fedavg
    ledger composes its claimed epsilon only when ledger.json is written, as one backlog; a ledger
    rebuilt from a checkpoint must not compose the rounds before it one by one (which differed in
    the 11th digit). The checkpoint keeps the accountants as they stood; one written before it did
    (no "tracks") is rebuilt round by round to the same floats."""
    from dpfl_ray.algorithms import RoundOutcome, make_algorithm
    from dpfl_ray.runtime.privacy import RunPrivacy
    from dpfl_ray.scenario import scenario_from_dict

    sc = scenario_from_dict({
        "data": {"source": "synthetic", "num_clients": 40}, "model": {"name": "logistic"},
        "training": {"algorithm": "dp_fedavg", "rounds": 3},
        "sampling": {"mode": "poisson", "rate": 0.1, "clients_per_round": None},
        "privacy": {"noise_multiplier": 4.0, "accountant": "pld"}})  # a large z: PLD's grid stays small
    weights, sizes = np.ones(40), np.full(40, 20)

    def privacy():
        run = RunPrivacy(sc, weights, sizes)
        run.bind(make_algorithm(sc, weights, 4.0, sizes=sizes))
        return run

    def rounds(run, start, stop):
        for t in range(start, stop):
            assert run.next_round_fits(t)
            run.account(t, RoundOutcome(t, tuple(range(10))), "")

    full, cut = privacy(), privacy()
    rounds(full, 0, 3)
    rounds(cut, 0, 2)
    saved = cut.state_dict(2)
    state = json.loads(json.dumps({k: v for k, v in saved.items() if k != "arrays"}))  # as the checkpoint holds it
    assert [m["kind"] for m in state["tracks"]["ledger"]] == ["effective"]  # the claim is asked at the end only
    arrays = {k: np.array(v) for k, v in saved["arrays"].items()}
    if not saved_accountants:
        del state["tracks"]
        arrays = {k: v for k, v in arrays.items() if not k.startswith("tracks.")}
    resumed = privacy()
    resumed.load_state_dict({**state, "arrays": arrays})
    rounds(resumed, 2, 3)
    a, b = full.to_dict(), resumed.to_dict()
    assert a["epsilon_claimed"] == b["epsilon_claimed"] and a["epsilon"] == b["epsilon"]
    assert a == b
