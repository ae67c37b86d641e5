"""A Ray head stopped under a run that joined it (`dpfl run --address HOST:PORT`), as `ray stop`
stops one (SIGTERM to each of its processes): one `error:` line that says the head is unreachable
and gives the `--resume` command, a non-zero exit, no traceback, and model.pt, ledger.json,
rounds.jsonl and summary.json for the same last committed round (the checkpoint's).

Ray's core may end the driver at once when its node goes (then the run's watcher writes the files,
runtime/rescue.py), or the driver notices the head is gone itself: both must leave the same."""
import json
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch
import yaml

from dpfl_ray.data import build_federation
from dpfl_ray.training.models import build_model, evaluate
from dpfl_ray.runtime.checkpoint import read_checkpoint
from dpfl_ray.runtime.cluster import Token, resolve_target
from dpfl_ray.runtime.connect import probe_gcs
from dpfl_ray.scenario import load_scenario

from tests.helpers import long_dp_fedavg

from .conftest import BIN, HEAD_START_TIMEOUT_S, ROOT, client_env, free_ports, stop_tree

LONG = long_dp_fedavg("head_loss", 5000, output={"checkpoint_every": 1})


def _wait_for_node(gcs: str, token: str, head: subprocess.Popen, log: Path) -> None:
    """Until the head's GCS lists a live node (its raylet): a driver joining earlier is refused."""
    target, end = resolve_target(gcs, environ={}), time.monotonic() + HEAD_START_TIMEOUT_S
    while time.monotonic() < end:
        assert head.poll() is None, f"ray start exited {head.returncode}:\n{log.read_text()[-3000:]}"
        try:
            if probe_gcs(target, Token(token, "test"), timeout_s=2.0)[1]:
                return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(0.5)
    raise AssertionError(f"the head did not come up within {HEAD_START_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")


def test_a_head_stopped_mid_run_leaves_the_last_committed_round_and_the_resume_command(tmp_path):
    temp_dir = Path(tempfile.mkdtemp(prefix="dpflhl", dir="/tmp"))  # short: Ray's socket paths are bounded
    token = secrets.token_hex(32)
    (temp_dir / "auth_token").write_text(token + "\n")
    gcs_port, client, agent, agent_grpc, env_agent, metrics = free_ports(6)
    gcs = f"127.0.0.1:{gcs_port}"
    log = temp_dir / "head.log"
    env = client_env(RAY_AUTH_TOKEN_PATH=str(temp_dir / "auth_token"))
    cmd = [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={gcs_port}",
           "--include-dashboard=false", f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent}",
           f"--dashboard-agent-grpc-port={agent_grpc}", f"--runtime-env-agent-port={env_agent}",
           f"--metrics-export-port={metrics}", f"--temp-dir={temp_dir}", "--num-cpus=2", "--disable-usage-stats"]
    with open(log, "w") as out:
        head = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    scenario, run = tmp_path / "long.yaml", tmp_path / "run"
    scenario.write_text(yaml.safe_dump(LONG))
    driver = None
    try:
        _wait_for_node(gcs, token, head, log)
        driver = subprocess.Popen([sys.executable, "-m", "cli.main", "run", str(scenario), "--address", gcs,
                                   "--out", str(run)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        end = time.monotonic() + 300
        while not ((run / "checkpoint.npz").exists() and len((run / "rounds.jsonl").read_text().splitlines()) >= 3):
            assert driver.poll() is None and time.monotonic() < end, driver.communicate()
            time.sleep(0.05)
        stopped = time.monotonic()
        for p in [psutil.Process(head.pid), *psutil.Process(head.pid).children(recursive=True)]:
            try:
                p.terminate()
            except psutil.Error:
                pass
        stdout, stderr = driver.communicate(timeout=120)  # the watcher, if any, holds the pipes till done
        took = time.monotonic() - stopped
    finally:
        if driver is not None and driver.poll() is None:
            driver.kill()
        stop_tree(head, str(temp_dir))
        shutil.rmtree(temp_dir, ignore_errors=True)
    print(f"head stopped: the run ended {took:.1f} s later, exit {driver.returncode}")
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert driver.returncode != 0 and len(errors) == 1, (driver.returncode, stderr[-3000:])
    assert f"the Ray head at {gcs} is unreachable" in errors[0] and f"dpfl run --resume {run}" in errors[0]
    assert "Traceback" not in stdout + stderr, (stdout + stderr)[-3000:]
    assert took < 30, f"the run took {took:.1f} s to notice"

    rows = [json.loads(line) for line in (run / "rounds.jsonl").read_text().splitlines()]
    summary = json.loads((run / "summary.json").read_text())
    ledger = json.loads((run / "ledger.json").read_text())
    assert summary["stop_reason"] == "error" and "unreachable" in summary["error"]
    assert summary["rounds_completed"] == len(rows) == ledger["num_rounds"] == read_checkpoint(run)["round"] >= 1
    assert summary["epsilon"] == rows[-1]["epsilon"] == ledger["epsilon"]
    sc = load_scenario(run / "scenario.yaml")
    fed = build_federation(sc)
    model = build_model(sc.model, fed.dataset.input_shape, fed.dataset.num_classes, sc.seed)
    model.load_state_dict(torch.load(run / "model.pt"))
    assert evaluate(model, fed.dataset.x_test, fed.dataset.y_test)[0] == rows[-1]["test_accuracy"]
