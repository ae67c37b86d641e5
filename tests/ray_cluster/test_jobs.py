"""Against a real local head with Ray's default (token) authentication, as a user would:
`dpfl submit --follow`, `dpfl jobs fetch/list/status/stop`, plain `ray job submit -- dpfl run`,
`dpfl run --address HOST:PORT`, and one-line errors for a missing or wrong token."""
import csv
import json
import subprocess
import time

import torch
import yaml

from tests.helpers import every_client_straggles

from .conftest import BIN, ROOT, client_env, dpfl

QUICK = ["scenarios/quickstart.yaml", "--set", "training.rounds=2", "--set", "resources.workers=1",
         "--set", "resources.num_cpus_per_worker=0.5"]
TINY = {"name": "tiny", "seed": 3,
        "data": {"source": "synthetic", "num_clients": 12, "synthetic_examples": 240, "synthetic_features": 4},
        "model": {"name": "logistic"}, "training": {"rounds": 2, "batch_size": 8, "lr": 0.2},
        "sampling": {"mode": "fixed", "clients_per_round": 6},
        "resources": {"workers": 1, "num_cpus_per_worker": 0.5}}


def _timed(label, fn):
    t0 = time.monotonic()
    result = fn()
    print(f"[wall] {label}: {time.monotonic() - t0:.1f}s")
    return result


def _ok(r):
    assert r.returncode == 0, (r.returncode, r.stdout[-4000:], r.stderr[-4000:])
    return r


def test_submit_follow_then_fetch_the_run_directory(ray_head, tmp_path):
    env, url = ray_head.env(), ray_head.dashboard
    r = _ok(_timed("dpfl submit quickstart --follow", lambda: dpfl(
        "submit", *QUICK, "--follow", "--address", url, env=env, timeout=480)))
    job_id = r.stdout.splitlines()[0]
    assert f"job {job_id} SUCCEEDED" in r.stderr
    assert "completed: 2 rounds" in r.stdout and "run directory packed into this log" in r.stdout
    assert "DPFL-RUNDIR" not in r.stdout  # the block itself is not for people

    back = tmp_path / "back"
    _ok(_timed("dpfl jobs fetch", lambda: dpfl("jobs", "fetch", job_id, "--to", back, "--address", url, env=env,
                                               timeout=120)))
    summary = json.loads((back / "summary.json").read_text())
    assert summary["rounds_completed"] == 2 and summary["stop_reason"] == "completed"
    assert [json.loads(x)["round"] for x in (back / "rounds.jsonl").read_text().splitlines()] == [1, 2]
    assert yaml.safe_load((back / "scenario.yaml").read_text())["training"]["rounds"] == 2
    assert torch.load(back / "model.pt")  # a state_dict that loads
    assert (back / "accuracy.png").stat().st_size > 0

    listed = _ok(dpfl("jobs", "list", "--address", url, env=env, timeout=60)).stdout
    assert any(job_id in ln and "SUCCEEDED" in ln and "quickstart" in ln for ln in listed.splitlines())
    assert f"{job_id} SUCCEEDED" in _ok(dpfl("jobs", "status", job_id, "--address", url, env=env, timeout=60)).stdout
    again = dpfl("jobs", "fetch", job_id, "--to", back, "--address", url, env=env, timeout=60)
    assert again.returncode == 2 and "already holds files" in again.stderr


def test_a_sweep_job_runs_every_combination_on_the_cluster_and_its_directory_comes_back(ray_head, tmp_path):
    env, url = ray_head.env(), ray_head.dashboard
    scenario = tmp_path / "tiny.yaml"
    scenario.write_text(yaml.safe_dump(TINY))
    r = _ok(_timed("dpfl submit --grid --follow", lambda: dpfl(
        "submit", scenario, "--grid", "faults.dropout.rate=0,0.5", "--set", "faults.dropout.model=tail",
        "--max-concurrent", "1", "--follow", "--address", url, env=env, timeout=480)))
    job_id = r.stdout.splitlines()[0]
    assert f"job {job_id} SUCCEEDED" in r.stderr
    back = tmp_path / "back"
    fetched = _ok(dpfl("jobs", "fetch", job_id, "--to", back, "--address", url, env=env, timeout=120))
    assert "a sweep of 2 runs, 2 ok" in fetched.stdout
    with open(back / "sweep.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [(x["faults.dropout.rate"], x["status"], x["rounds"]) for x in rows] == [("0", "ok", "2"), ("0.5", "ok", "2")]
    survived = [[json.loads(line)["survived"] for line in (back / x["run"] / "rounds.jsonl").read_text().splitlines()]
                for x in rows]
    assert survived == [[6, 6], [3, 3]]  # the grid and the --set reached the runs on the cluster


def test_plain_ray_job_submit_runs_dpfl_as_its_entrypoint(ray_head):
    # Ray's own CLI turns token mode on only when told (dpfl finds the token by itself).
    env = ray_head.env(RAY_AUTH_MODE="token")
    cmd = [str(BIN / "ray"), "job", "submit", "--address", ray_head.dashboard, "--working-dir", ".", "--",
           "dpfl", "run", *QUICK]
    r = _ok(_timed("ray job submit --working-dir . -- dpfl run", lambda: subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=480)))
    out = r.stdout + r.stderr
    assert "succeeded" in out and "completed: 2 rounds" in out, out[-4000:]


def test_run_joins_the_head_by_its_gcs_address(ray_head, tmp_path):
    scenario = tmp_path / "tiny.yaml"
    scenario.write_text(yaml.safe_dump(TINY))
    r = _ok(_timed("dpfl run --address 127.0.0.1:GCS", lambda: dpfl(
        "run", scenario, "--address", ray_head.gcs, "--out", tmp_path / "run", env=ray_head.env(), timeout=300)))
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["rounds_completed"] == 2, r.stdout


def _job_api(head, job_id: str, what: str = "") -> dict:
    """GET /api/jobs/JOB_ID[what] from the head's dashboard, with the head's token ({} if no answer)."""
    import requests

    headers = {"Authorization": f"Bearer {head.token_path.read_text().strip()}"}
    try:
        answer = requests.get(f"{head.dashboard}/api/jobs/{job_id}{what}", headers=headers, timeout=10)
        return answer.json() if answer.status_code == 200 else {}
    except (requests.RequestException, ValueError):  # no answer yet, or not JSON
        return {}


def _one_line(r, needle):
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], (r.returncode, r.stderr[-3000:])


def test_a_missing_or_wrong_token_is_one_line_that_says_what_to_do(ray_head, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    scenario = tmp_path / "tiny.yaml"
    scenario.write_text(yaml.safe_dump(TINY))
    for env, needle in ((client_env(HOME=str(home)), "requires an authentication token and none was found"),
                        (client_env(HOME=str(home), RAY_AUTH_TOKEN="not-the-token"),
                         "rejected the token from RAY_AUTH_TOKEN")):
        _one_line(dpfl("jobs", "list", "--address", ray_head.dashboard, env=env, timeout=60), needle)
        t0 = time.monotonic()
        r = dpfl("run", scenario, "--address", ray_head.gcs, "--out", tmp_path / "run", env=env, timeout=60)
        _one_line(r, needle)
        assert time.monotonic() - t0 < 15 and "auth_token" in r.stderr
    assert not (tmp_path / "run").exists()


def test_stop_ends_a_running_job_and_its_files_still_come_back(ray_head, tmp_path):
    env, url = ray_head.env(), ray_head.dashboard
    scenario = tmp_path / "long.yaml"
    # every client straggles 0.2 s a round: the run sleeps, not trains flat out, while it waits for its stop
    scenario.write_text(yaml.safe_dump({**TINY, "training": {**TINY["training"], "rounds": 5000},
                                        "faults": every_client_straggles(0.2)}))
    job_id = _ok(dpfl("submit", scenario, "--address", url, env=env, timeout=120)).stdout.splitlines()[0]
    # waited on through the head's job API (a `dpfl jobs` process per poll would cost a CPU-second
    # each); what `dpfl jobs logs` and `dpfl jobs status` then say is checked once
    end = time.monotonic() + 240
    while " clients, 5000 rounds" not in _job_api(ray_head, job_id, "/logs").get("logs", ""):
        assert time.monotonic() < end, "the job never started its run"
        time.sleep(1)
    assert " clients, 5000 rounds" in _ok(dpfl("jobs", "logs", job_id, "--address", url, env=env, timeout=60)).stdout
    time.sleep(1.5)  # a few rounds in
    assert "stop requested" in _ok(dpfl("jobs", "stop", job_id, "--address", url, env=env, timeout=60)).stdout
    end = time.monotonic() + 90
    while _job_api(ray_head, job_id).get("status") != "STOPPED":
        assert time.monotonic() < end, "the job did not stop"
        time.sleep(0.5)
    assert f"{job_id} STOPPED" in _ok(dpfl("jobs", "status", job_id, "--address", url, env=env, timeout=60)).stdout
    back = tmp_path / "back"
    _ok(dpfl("jobs", "fetch", job_id, "--to", back, "--address", url, env=env, timeout=120))
    summary = json.loads((back / "summary.json").read_text())
    rows = (back / "rounds.jsonl").read_text().splitlines()
    assert summary["stop_reason"] == "interrupted" and summary["rounds_completed"] == len(rows) < 5000
    _one_line(dpfl("jobs", "status", "no-such-job", "--address", url, env=env, timeout=60), "no job no-such-job")
