"""`dpfl run --address` against addresses where no Ray GCS answers: one line, exit 2, in seconds,
and a signal while connecting ends the process at once. No Ray is started."""
import http.server
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest

from .conftest import ROOT, client_env, dpfl, free_ports

SCENARIO = "scenarios/quickstart.yaml"


def _one_error_line(result, *needles):
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert result.returncode == 2, (result.returncode, result.stdout[-2000:], result.stderr[-2000:])
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_a_dead_address_fails_before_ray_s_own_minute_of_retries_with_one_line(tmp_path):
    """A refused connection is answered at once; what the bound measures is the process's start
    and imports, which a loaded 2-core host stretches to tens of seconds. Without the probe,
    ray.init waits on an address like this for minutes (runtime/connect.py), so 30 s still tells
    the two apart."""
    t0 = time.monotonic()
    r = dpfl("run", SCENARIO, "--address", "127.0.0.1:1", "--out", tmp_path / "run", env=client_env(), timeout=60)
    took = time.monotonic() - t0
    line = _one_error_line(r, "127.0.0.1:1", "connection refused")
    print(f"[wall] dpfl run --address 127.0.0.1:1: {took:.1f}s -> {line}")
    assert took < 30
    assert not (tmp_path / "run").exists()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def test_the_dashboard_port_is_not_taken_for_the_gcs(tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), QuietHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        r = dpfl("run", SCENARIO, "--address", f"127.0.0.1:{port}", "--out", tmp_path / "run", env=client_env(),
                 timeout=60)
    finally:
        server.shutdown()
    _one_error_line(r, f"127.0.0.1:{port}", "not as a Ray GCS", "HTTP")


def test_a_dashboard_url_points_to_dpfl_submit(tmp_path):
    r = dpfl("run", SCENARIO, "--address", "http://127.0.0.1:8265", env=client_env(), timeout=60)
    _one_error_line(r, "--address", "dpfl submit")


@pytest.mark.parametrize("args, needles", [
    (["--grid", "training.nosuch=1,2"], ["training.nosuch"]),
    (["--grid", "faults.dropout.rate=0,1.5"], ["faults.dropout.rate"]),
    (["--timeout", "60"], ["--timeout", "--grid or --seeds"]),
], ids=["unknown_key", "impossible_value", "sweep_option_without_a_sweep"])
def test_a_bad_sweep_job_is_one_line_before_anything_is_submitted(args, needles):
    # nothing listens at port 9: the job would fail to submit, but the grid is refused first
    r = dpfl("submit", SCENARIO, *args, "--address", "http://127.0.0.1:9", env=client_env(), timeout=60)
    _one_error_line(r, *needles)


class SilentListener:
    """Accepts TCP connections and never says a word: ray.init would wait on it for minutes."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", free_ports(1)[0]))
        self.sock.listen(16)
        self.accepted = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                self.accepted.append(self.sock.accept()[0])
            except OSError:
                return

    def close(self):
        for s in self.accepted:
            s.close()
        self.sock.close()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_a_signal_while_connecting_stops_at_once(tmp_path, sig):
    listener = SilentListener()
    port = listener.sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "run", SCENARIO, "--address", f"127.0.0.1:{port}",
                             "--out", str(tmp_path / "run")], cwd=ROOT, env=client_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + 60
        while len(listener.accepted) < 2:  # the TCP probe, then the gRPC probe that now waits
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < end, "dpfl never reached the address"
            time.sleep(0.02)
        sent = time.monotonic()
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=30)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
        listener.close()
    assert took < 5, f"stopping took {took:.1f}s"
    assert proc.returncode in (128 + sig, -sig), (proc.returncode, stderr[-2000:])
    assert "Traceback" not in stderr, stderr[-2000:]
    assert not psutil.pid_exists(proc.pid) or psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE
