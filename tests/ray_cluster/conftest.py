"""A real Ray head for the cluster tests, run the way a user runs one.

Every interaction is a separate process (``ray start``, the ``dpfl`` and ``ray`` CLIs, scripts):
the pytest process never calls ray.init, so these tests can share a session with tests/ray/'s
private Ray. The head binds to 127.0.0.1 on free ports, keeps its files in a private temp dir,
uses Ray's default authentication (token mode, because a token exists: the one made here), and is
stopped by killing exactly the processes it started -- never `ray stop`, which would stop every
Ray on the machine.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
HEAD_START_TIMEOUT_S = 180


def free_ports(n: int) -> list[int]:
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def client_env(**extra) -> dict:
    """This environment without any Ray address or auth setting of the person running the tests.

    Ray starts its workers at nice 15; beside the suite's other pytest worker (nice 0, busy) they then
    get about 4% of a core, and a cluster test's deadlines would measure the neighbour. Here the
    raylets start their workers at nice 0, as Ray's job supervisor does for a job's driver."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RAY_AUTH", "RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_JOB"))}
    env.update(PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
               COLUMNS="200", PYTHONUNBUFFERED="1", RAY_worker_niceness="0", **extra)
    return env


def dpfl(*args, env: dict, timeout: float, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """The real CLI, as `dpfl ...` (python -m cli.main from the checkout)."""
    return subprocess.run([sys.executable, "-m", "cli.main", *map(str, args)], cwd=cwd, env=env, timeout=timeout,
                          capture_output=True, text=True)


@dataclass
class Head:
    gcs: str
    dashboard: str
    token_path: Path
    temp_dir: Path
    proc: subprocess.Popen

    def env(self, **extra) -> dict:
        return client_env(RAY_AUTH_TOKEN_PATH=str(self.token_path), **extra)


def _wait_ready(head: Head, log: Path) -> None:
    import requests

    headers = {"Authorization": f"Bearer {head.token_path.read_text().strip()}"}
    end = time.monotonic() + HEAD_START_TIMEOUT_S
    while time.monotonic() < end:
        if head.proc.poll() is not None:
            raise RuntimeError(f"ray start exited {head.proc.returncode}:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(requests.RequestException):
            if requests.get(f"{head.dashboard}/api/jobs/", headers=headers, timeout=5).status_code == 200:
                return
        time.sleep(1)
    raise RuntimeError(f"the head was not ready within {HEAD_START_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")


def stop_tree(proc: subprocess.Popen, marker: str, grace: float = 5.0) -> None:
    """SIGTERM, then SIGKILL, for the head process, its descendants, and any process whose command
    line or working directory is inside the head's temp dir (job drivers run in their own session)."""
    procs = {}
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(proc.pid)
        procs = {p.pid: p for p in [root, *root.children(recursive=True)]}
    for p in psutil.process_iter(["cmdline", "cwd"]):
        if p.pid != os.getpid() and marker in (" ".join(p.info["cmdline"] or []) + " " + (p.info["cwd"] or "")):
            procs.setdefault(p.pid, p)
    for p in procs.values():
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(list(procs.values()), timeout=grace)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=grace)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace)


@pytest.fixture(scope="module")
def ray_head():
    """`ray start --head --block` on free loopback ports with a fresh token; stopped at the end."""
    temp_dir = Path(tempfile.mkdtemp(prefix="dpflrc", dir="/tmp"))  # short: Ray's socket paths are bounded
    token = temp_dir / "auth_token"
    token.write_text(secrets.token_hex(32) + "\n")
    gcs, dash, client, agent, agent_grpc, env_agent, metrics = free_ports(7)
    log = temp_dir / "head.log"
    cmd = [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={gcs}",
           f"--dashboard-port={dash}", "--dashboard-host=127.0.0.1", f"--ray-client-server-port={client}",
           f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={agent_grpc}",
           f"--runtime-env-agent-port={env_agent}", f"--metrics-export-port={metrics}", f"--temp-dir={temp_dir}",
           "--num-cpus=2", "--disable-usage-stats"]
    with open(log, "w") as out:
        # A stopped job gets 30 s, not Ray's 3, to write and pack its files on a loaded CI machine.
        head_env = client_env(RAY_AUTH_TOKEN_PATH=str(token), RAY_JOB_STOP_WAIT_TIME_S="30")
        proc = subprocess.Popen(cmd, env=head_env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    head = Head(f"127.0.0.1:{gcs}", f"http://127.0.0.1:{dash}", token, temp_dir, proc)
    try:
        _wait_ready(head, log)
        yield head
    finally:
        stop_tree(proc, str(temp_dir))
        shutil.rmtree(temp_dir, ignore_errors=True)
