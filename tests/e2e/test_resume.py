"""Exact resume: a private SecAgg run whose driver is killed with SIGKILL after round k, resumed with
`dpfl run --resume`, ends with the same bytes as an uninterrupted run of the same scenario.

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

import torch
import yaml

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
    os.killpg(victim.pid, signal.SIGKILL)  # the driver, without warning
    victim.wait(timeout=30)
    assert not (cut / "summary.json").exists()
    assert ref.wait(timeout=300) == 0, ref.communicate()

    resumed = _dpfl(ray_address, "run", "--resume", cut)
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err

    a, b = torch.load(full / "model.pt"), torch.load(cut / "model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert _rows(full) == _rows(cut) and len(_rows(cut)) == 8
    ledger_a, ledger_b = (json.loads((d / "ledger.json").read_text()) for d in (full, cut))
    assert ledger_a["rounds"] == ledger_b["rounds"]
    assert ledger_a["epsilon"] == ledger_b["epsilon"] and ledger_a["epsilon_vs_server"] == ledger_b["epsilon_vs_server"]
    summary = json.loads((cut / "summary.json").read_text())
    assert summary["rounds_completed"] == 8 and summary["stop_reason"] == "completed"


def test_ctrl_c_prints_the_resume_command_and_resume_finishes(ray_address, tmp_path):
    scenario = tmp_path / "baek.yaml"
    scenario.write_text(yaml.safe_dump({**BAEK, "training": {**BAEK["training"], "rounds": 12}}))
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
    resumed = _dpfl(ray_address, "run", "--resume", run)
    assert resumed.wait(timeout=300) == 0, resumed.communicate()
    rows = _rows(run)
    assert [r["round"] for r in rows] == list(range(1, 13)) and stopped < 12
