"""Address forms, token discovery and the placement record (runtime/cluster.py), bounded calls
(runtime/connect.py) and the Jobs helpers that need no cluster (runtime/jobs.py). No Ray is started."""
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dpfl_ray.errors import DPFLError
from dpfl_ray.runtime.cluster import (
    Token, find_auth_token, placement_summary, recorded_address, resolve_target, stay_on_loopback,
)
from dpfl_ray.runtime.connect import call_bounded, probe_gcs, start_local_ray
from dpfl_ray.runtime.jobs import EXCLUDES, SCENARIO_ENV, dashboard_address, job_runtime_env, submission_id


@pytest.mark.parametrize("address, kind, host, port", [
    ("10.0.0.5:6379", "gcs", "10.0.0.5", 6379),
    (" head.example.org:7000 ", "gcs", "head.example.org", 7000),
    ("[::1]:6379", "gcs", "::1", 6379),
    ("ray://10.0.0.5:10001", "client", "10.0.0.5", 10001),
    ("ray://10.0.0.5", "client", "10.0.0.5", 10001),
])
def test_address_forms(address, kind, host, port):
    t = resolve_target(address, environ={})
    assert (t.kind, t.host, t.port, t.source) == (kind, host, port, "--address")


def test_address_strings_ray_init_receives():
    assert resolve_target("10.0.0.5:6379", environ={}).address == "10.0.0.5:6379"
    assert resolve_target("[::1]:6379", environ={}).address == "[::1]:6379"
    assert resolve_target("ray://h", environ={}).address == "ray://h:10001"


def test_no_address_joins_ray_address_else_runs_locally():
    assert resolve_target(None, environ={}).kind == "local"
    t = resolve_target(None, environ={"RAY_ADDRESS": "127.0.0.1:6380"})
    assert (t.kind, t.port, t.source) == ("gcs", 6380, "RAY_ADDRESS")
    assert resolve_target("local", environ={"RAY_ADDRESS": "127.0.0.1:6380"}).kind == "local"


def test_inside_a_ray_job():
    env = {"RAY_ADDRESS": "127.0.0.1:6380", "RAY_JOB_CONFIG_JSON_ENV_VAR": "{}"}
    assert resolve_target(None, environ=env).inside_job
    assert not resolve_target(None, environ={"RAY_ADDRESS": "127.0.0.1:6380"}).inside_job


def test_auto_uses_ray_address_then_the_last_ray_start():
    assert resolve_target("auto", environ={"RAY_ADDRESS": "10.1.1.1:6379"}).host == "10.1.1.1"
    t = resolve_target("auto", environ={}, recorded=lambda: "10.2.2.2:6379")
    assert (t.host, t.port) == ("10.2.2.2", 6379)
    with pytest.raises(DPFLError, match="no Ray cluster was started on this machine"):
        resolve_target("auto", environ={}, recorded=lambda: None)


@pytest.mark.parametrize("address, message", [
    ("http://127.0.0.1:8265", "dashboard .*dpfl submit"),
    ("127.0.0.1", "give the port"),
    ("127.0.0.1:http", "must be a number"),
    ("127.0.0.1:0", "1..65535"),
    ("tcp://h:1", "unknown scheme"),
])
def test_malformed_addresses_are_one_line(address, message):
    with pytest.raises(DPFLError, match=message) as err:
        resolve_target(address, environ={})
    assert "\n" not in str(err.value) and str(err.value).startswith("--address:")


def test_an_http_ray_address_names_the_variable():
    with pytest.raises(DPFLError, match="^RAY_ADDRESS: http"):
        resolve_target(None, environ={"RAY_ADDRESS": "http://127.0.0.1:8265"})


def test_loopback_targets_keep_ray_on_127_0_0_1():
    for address in (None, "127.0.0.1:6379", "localhost:6379", "[::1]:6379"):
        env = {}
        stay_on_loopback(resolve_target(address, environ={}), env)
        assert env == {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env = {}
    stay_on_loopback(resolve_target("10.0.0.5:6379", environ={}), env)
    assert env == {}


def test_recorded_address_is_read_where_ray_start_writes_it(tmp_path):
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("10.3.3.3:6379\n")
    assert recorded_address({"RAY_TMPDIR": str(tmp_path)}) == "10.3.3.3:6379"
    assert recorded_address({"RAY_TMPDIR": str(tmp_path / "none")}) is None


def test_token_precedence_follows_rays_loader(tmp_path):
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text("from-home\nsecond line\n")
    path = tmp_path / "tok"
    path.write_text("  from-path  \n")
    assert find_auth_token({}, home) == Token("from-home", str(home / ".ray" / "auth_token"))
    assert find_auth_token({"RAY_AUTH_TOKEN_PATH": str(path)}, home) == Token("from-path", f"RAY_AUTH_TOKEN_PATH={path}")
    assert find_auth_token({"RAY_AUTH_TOKEN": "from-env", "RAY_AUTH_TOKEN_PATH": str(path)}, home).value == "from-env"
    assert find_auth_token({}, tmp_path / "nobody") is None


def test_an_unreadable_token_path_is_one_line(tmp_path):
    with pytest.raises(DPFLError, match="RAY_AUTH_TOKEN_PATH=.*cannot be read or is empty"):
        find_auth_token({"RAY_AUTH_TOKEN_PATH": str(tmp_path / "missing")}, tmp_path)


def test_call_bounded_returns_raises_and_gives_up():
    assert call_bounded(lambda: 7, 5, "x") == 7
    with pytest.raises(ZeroDivisionError):
        call_bounded(lambda: 1 / 0, 5, "x")
    t0 = time.monotonic()
    with pytest.raises(DPFLError, match="slow thing did not finish within 0.2 s"):
        call_bounded(lambda: time.sleep(0.6), 0.2, "slow thing")
    assert time.monotonic() - t0 < 0.55
    time.sleep(0.6)  # the abandoned call ends before this process does: no forced exit
    # a signal recorded without a KeyboardInterrupt (it came inside an import) ends the wait too
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        call_bounded(lambda: time.sleep(0.6), 5, "x", pending_signal=lambda: signal.SIGTERM)
    assert time.monotonic() - t0 < 0.55
    time.sleep(0.6)


def test_a_dashboard_that_answers_a_byte_at_a_time_is_cut_off_by_the_request_s_deadline():
    """requests' read timeout bounds each read, not the answer: a server that sends one byte a second
    kept `dpfl jobs` waiting past any limit. Each request now has a deadline for the whole answer."""
    import http.server
    import socketserver

    from dpfl_ray.runtime.jobs import Jobs

    stop = threading.Event()

    class Drip(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200)
            self.send_header("Content-Length", "100000")
            self.end_headers()
            try:
                while not stop.wait(0.5):
                    self.wfile.write(b" ")
                    self.wfile.flush()
            except OSError:  # the client gave up
                pass

        def log_message(self, *args):
            pass

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Drip)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        t0 = time.monotonic()
        with pytest.raises(DPFLError, match=r"a request to the Ray dashboard at http://127.0.0.1:\d+ did not finish "
                                            r"within 3 s"):
            Jobs(f"http://127.0.0.1:{server.server_address[1]}", timeout_s=(1.0, 2.0))
        assert time.monotonic() - t0 < 25  # each read alone came within 2 s: only the deadline ends it
    finally:
        stop.set()  # the answer ends short: the abandoned request ends too, before this process does
        server.shutdown()
        server.server_close()
        time.sleep(1.0)


@pytest.mark.parametrize("body, calls", [
    (b"<html>a web server</html>", ("connect",)),
    (b'{"version": "4", "ray_version": "2.60.0", "logs": 5, "status": 7}', ("list", "info", "logs")),
])
def test_a_server_that_is_not_a_ray_dashboard_is_one_line_naming_it(body, calls):
    """Not JSON, or JSON of another shape: each Jobs call was an internal error (a JSONDecodeError, a
    TypeError, a pydantic dump) that named neither the address nor what was wrong."""
    import http.server
    import socketserver

    import ray

    from dpfl_ray.runtime.jobs import Jobs

    class Other(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Other)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    address = f"http://127.0.0.1:{server.server_address[1]}"
    needle = f"the server at {address} does not answer as Ray {ray.__version__}'s Jobs API does ("
    try:
        actions = {"connect": lambda: Jobs(address), "list": lambda: Jobs(address).list(),
                   "info": lambda: Jobs(address).info("raysubmit_x"), "logs": lambda: Jobs(address).logs("raysubmit_x")}
        for call in calls:
            with pytest.raises(DPFLError) as err:
                actions[call]()
            assert needle in str(err.value) and "\n" not in str(err.value), (call, str(err.value))
    finally:
        server.shutdown()
        server.server_close()


def test_the_gcs_probe_runs_grpc_outside_the_thread_a_signal_interrupts():
    """A signal handler raises KeyboardInterrupt in the main thread. Raised inside gRPC's own code, it
    left the channel waiting forever at close for a half-made call (`dpfl run --address` hung after
    SIGTERM, about once in fifteen). The thread that calls the probe must only wait: sampled every
    millisecond while a real gRPC probe talks to a listener that never answers, its stack never holds
    the probe's gRPC calls, which another thread makes."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    threading.Thread(target=lambda: [listener.accept() for _ in range(4)], daemon=True).start()
    caller, samples, elsewhere, done = threading.get_ident(), [], [], threading.Event()

    def sample():
        while not done.is_set():
            for ident, frame in sys._current_frames().items():
                names = []
                while frame is not None:
                    names.append((frame.f_code.co_name, frame.f_code.co_filename))
                    frame = frame.f_back
                (samples if ident == caller else elsewhere).append(names)
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    target = resolve_target(f"127.0.0.1:{listener.getsockname()[1]}", environ={})
    try:
        with pytest.raises(DPFLError, match="answers but not as a Ray GCS"):
            probe_gcs(target, None, timeout_s=0.5)
    finally:
        done.set()
        sampler.join(5)
        listener.close()

    def in_grpc(names):
        return [n for n in names if n[0] in ("_ask_gcs", "_rpc") or "/grpc/" in n[1].replace("\\", "/")]

    assert len(samples) > 20 and any(name == "_rpc" for names in elsewhere for name, _ in names)
    assert not [in_grpc(names) for names in samples if in_grpc(names)]


def test_a_failed_local_start_is_cleared_and_tried_once_more_then_one_line():
    """The retry policy of the private Ray's start-up, with plain functions in place of ray.init
    (the failure it answers cannot be caused on purpose: Ray's raylet once never registered)."""
    calls = []

    def flaky():
        calls.append("init")
        if calls.count("init") == 1:
            raise Exception("The current node timed out during startup. This could happen because\nsome raylet...")

    start_local_ray(flaky, clear=lambda: calls.append("clear"), warn=lambda m: calls.append(f"warn: {m}"))
    assert calls[:2] == ["init", "clear"] and calls[3] == "init" and len(calls) == 4
    assert calls[2].startswith("warn: Ray's local start failed (The current node timed out during startup.")

    calls.clear()

    def broken():
        calls.append("init")
        raise RuntimeError("no space left on device")

    with pytest.raises(DPFLError, match=r"^the private local Ray did not start \(2 tries\): no space left on device$"):
        start_local_ray(broken, clear=lambda: calls.append("clear"), warn=lambda m: calls.append("warn"))
    assert calls == ["init", "clear", "warn", "init", "clear"]

    with pytest.raises(KeyboardInterrupt):  # a signal is not a failed start: no second try
        start_local_ray(lambda: (_ for _ in ()).throw(KeyboardInterrupt()), clear=lambda: calls.append("x"))
    assert "x" not in calls
    calls.clear()
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        # a signal during the start: a stop, whether the start failed meanwhile (then it is cleared)
        # or still runs (then its processes are killed): never tried again
        start_local_ray(broken, clear=lambda: calls.append("clear"), warn=lambda m: calls.append("warn"),
                        pending_signal=lambda: signal.SIGTERM)
    assert calls in (["init", "clear"], ["init"], [])


CLEAR_SCRIPT = r"""
import subprocess, sys, time
import psutil
from dpfl_ray.errors import DPFLError
from dpfl_ray.runtime.connect import start_local_ray

quiet = dict(stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
older = psutil.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                      f"subprocess.Popen({sleeper!r}); time.sleep(60)"], **quiet)
started, lines = [], []
try:
    end = time.monotonic() + 30
    while not older.children() and time.monotonic() < end:  # the older process has started its own child
        time.sleep(0.05)

    def failing_init():  # as a half-started Ray: processes left behind, then ray.init's bare Exception
        started.append(subprocess.Popen(sleeper, **quiet))
        raise Exception("The current node timed out during startup.")

    try:
        start_local_ray(failing_init, warn=lines.append)
    except DPFLError as err:
        lines.append(str(err))
    older_tree = [older] + older.children(recursive=True)
    print(len(lines), len(started), sum(p.poll() is None for p in started), len(older_tree),
          sum(p.status() != psutil.STATUS_ZOMBIE for p in older_tree))
    print(lines[-1])
finally:
    for p in [older] + older.children(recursive=True) + started:
        try:
            p.kill()
        except Exception:
            pass
"""


def test_a_failed_local_start_kills_what_it_started_and_nothing_older():
    """The default clearing after a failed start, in a process of its own (it calls ray.shutdown(),
    which must not meet this test process's Ray): the processes the failed tries started are
    killed; a process started before, and the process that one started, are left alone."""
    r = subprocess.run([sys.executable, "-c", CLEAR_SCRIPT], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 0, r.stderr[-2000:]
    counts, last = r.stdout.strip().splitlines()
    assert counts == "2 2 0 2 2"  # 1 warning + the error; 2 tries, none left running; the older 2 alive
    assert last == "the private local Ray did not start (2 tries): The current node timed out during startup."


def test_placement_summary_counts_workers_and_gpu_ids_per_node():
    pool = [{"node": "b", "gpu_ids": ["0"]}, {"node": "a", "gpu_ids": ["1"]}, {"node": "a", "gpu_ids": ["0"]}, None]
    s = placement_summary(pool, 0.5, 0.25)
    assert s["nodes"] == {"a": {"workers": 2, "gpu_ids": ["0", "1"]}, "b": {"workers": 1, "gpu_ids": ["0"]}}
    assert (s["workers"], s["unreported"], s["num_gpus_per_worker"]) == (4, 1, 0.25)


def test_dashboard_address_sources():
    assert dashboard_address("http://h:8265/", {}) == "http://h:8265"
    assert dashboard_address(None, {"RAY_API_SERVER_ADDRESS": "http://a:1"}) == "http://a:1"
    assert dashboard_address(None, {"RAY_ADDRESS": "https://b:2"}) == "https://b:2"
    with pytest.raises(DPFLError, match="dashboard"):
        dashboard_address("h:6379", {})
    with pytest.raises(DPFLError, match="--address http://HEAD:8265"):
        dashboard_address(None, {"RAY_ADDRESS": "10.0.0.1:6379"})
    # a dashboard variable that is set but no dashboard is named, not passed over
    with pytest.raises(DPFLError, match="^RAY_API_SERVER_ADDRESS: garbage: jobs go through the dashboard"):
        dashboard_address(None, {"RAY_API_SERVER_ADDRESS": "garbage", "RAY_ADDRESS": "http://c:3"})
    for bad in ("http://[::1", "http://h:port", "https://:8265"):
        with pytest.raises(DPFLError, match="^--address: .*not a dashboard address"):
            dashboard_address(bad, {})


def test_submission_ids():
    assert submission_id("my-run_1", "quickstart") == "my-run_1"
    made = submission_id(None, "quick start", now=0)
    assert made.startswith("quick-start-19") and made != submission_id(None, "quick start", now=0)
    with pytest.raises(DPFLError, match="--name"):
        submission_id("bad id/", "x")


def test_job_runtime_env_ships_the_checkout_and_the_scenario():
    root = Path(__file__).resolve().parents[2]
    env = job_runtime_env("name: x\n", root)
    assert env["working_dir"] == str(root) and env["env_vars"] == {SCENARIO_ENV: "name: x\n"}
    assert {".venv", "runs", ".git", "**/__pycache__"} <= set(env["excludes"]) == set(EXCLUDES)
    assert "pip" not in env and "py_modules" not in env
    pip = job_runtime_env("name: x\n", root, install=True)["pip"]["packages"]
    assert any(p.startswith("torch==") for p in pip) and any(p.startswith("ray[default,tune]") for p in pip)
    installed = job_runtime_env("name: x\n", None)  # no checkout: the two packages travel
    assert "working_dir" not in installed
    assert sorted(Path(p).name for p in installed["py_modules"]) == ["cli", "dpfl_ray"]
