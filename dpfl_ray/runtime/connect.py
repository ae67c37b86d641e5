"""The one door to Ray for ``dpfl run``: join a cluster, or start the private local Ray.

Why this is more than ``ray.init(address)`` (issue #11): on a dead address ray.init blocks in C++
for minutes and ignores signals meanwhile; on a cluster with token authentication it retries for
20 s and reports ``InvalidAuthToken`` only in its own log; with an explicit address it never turns
token mode on by itself. So the address is parsed and the token found first (runtime/cluster.py),
the GCS is probed with short gRPC calls, and only then is ray.init called. The probe and ray.init
both run in a helper thread while the main thread waits in short steps (:func:`call_bounded`) and
stops as soon as a signal has been recorded (runtime/shutdown.py). When signals still raised
KeyboardInterrupt in the main thread, the probe ran there: about one SIGTERM in fifteen, sent just
after the probe connected, left gRPC's channel waiting forever, at close, for a call the interrupt
had cut in half.

``ray`` is imported only inside the functions that talk to it, after
:func:`~dpfl_ray.runtime.cluster.stay_on_loopback` has set what Ray reads at import time.
"""
from __future__ import annotations

import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from ..errors import DPFLError
from .shutdown import exit_without_waiting_for, signal_name, signal_number
from .cluster import (
    CLIENT_PORT, Target, Token, find_auth_token, missing_token_message, recorded_address, rejected_token_message,
    resolve_target, stay_on_loopback,
)

# Budget of each probe step; all steps together stay under the 15 s of issue #11.
TCP_TIMEOUT_S = 3.0
RPC_TIMEOUT_S = 4.0
# ray.init after a successful probe normally takes 1-3 s; more means something else is wrong.
JOIN_TIMEOUT_S = 60.0
# What is never worth shipping to the cluster with the package.
PACKAGE_EXCLUDES = ["__pycache__", "*.pyc", ".pytest_cache", ".hypothesis", ".mypy_cache", ".ruff_cache"]


# -- probing ---------------------------------------------------------------------------------------
def probe_tcp(target: Target, timeout_s: float = TCP_TIMEOUT_S) -> None:
    """Is anything listening? A refused or silent port is a one-line error at once (ray.init
    would retry for minutes)."""
    where = f"{target.address} ({target.source})"
    try:
        with socket.create_connection((target.host, target.port), timeout=timeout_s):
            return
    except ConnectionRefusedError:
        hint = ("is a Ray head running there? `--address` takes the GCS port (6379 by default), not the "
                "dashboard's" if target.kind == "gcs" else "is the Ray Client server running there (port 10001)?")
        raise DPFLError(f"cannot connect to Ray at {where}: connection refused; {hint}") from None
    except socket.gaierror:
        raise DPFLError(f"cannot connect to Ray at {where}: unknown host {target.host}") from None
    except (socket.timeout, TimeoutError):
        raise DPFLError(f"cannot connect to Ray at {where}: no answer within {timeout_s:g} s "
                        "(check the host, the port and the firewall)") from None
    except OSError as err:
        raise DPFLError(f"cannot connect to Ray at {where}: {err.strerror or err}") from None


def _rpc(stub_call, request, token: Token | None, timeout_s: float):
    """One unary gRPC call with a deadline; returns (reply, None) or (None, grpc.RpcError)."""
    import grpc

    metadata = [("authorization", f"Bearer {token.value}")] if token else []
    try:
        return stub_call(request, timeout=timeout_s, metadata=metadata), None
    except grpc.RpcError as err:
        return None, err


def probe_gcs(target: Target, token: Token | None, timeout_s: float = RPC_TIMEOUT_S,
              pending_signal: Callable[[], int] = lambda: 0) -> tuple[bool, list]:
    """Ask the GCS two cheap questions: does it need a token (and accept ours), and which nodes are
    alive. Returns (token needed, alive GcsNodeInfo list); every failure is a one-line DPFLError.

    The gRPC calls run in a helper thread (:func:`call_bounded`), at most three of ``timeout_s``
    each; the calling thread only waits, so a signal interrupts the wait, not gRPC."""
    where = f"{target.address} ({target.source})"
    return call_bounded(lambda: _ask_gcs(target, token, timeout_s), 3 * timeout_s + 1.0,
                        f"asking the Ray GCS at {where}", pending_signal=pending_signal)


def _ask_gcs(target: Target, token: Token | None, timeout_s: float) -> tuple[bool, list]:
    import grpc
    from ray.core.generated import gcs_service_pb2 as msgs
    from ray.core.generated import gcs_service_pb2_grpc as stubs

    where = f"{target.address} ({target.source})"
    with grpc.insecure_channel(target.address) as channel:
        kv_get = stubs.InternalKVGcsServiceStub(channel).InternalKVGet
        request = msgs.InternalKVGetRequest(key=b"dpfl-probe", namespace=b"dpfl")
        _, err = _rpc(kv_get, request, None, timeout_s)
        needs_token = err is not None and err.code() == grpc.StatusCode.UNAUTHENTICATED
        if needs_token:
            if token is None:
                raise DPFLError(missing_token_message(where))
            _, err = _rpc(kv_get, request, token, timeout_s)
            if err is not None and err.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise DPFLError(rejected_token_message(where, token))
        if err is not None:
            raise DPFLError(f"{where} answers but not as a Ray GCS ({_rpc_reason(err)}); `--address` takes the "
                            "GCS address HOST:PORT (6379 by default), not the dashboard's")
        nodes, err = _rpc(stubs.NodeInfoGcsServiceStub(channel).GetAllNodeInfo, msgs.GetAllNodeInfoRequest(),
                          token if needs_token else None, timeout_s)
    if err is not None:
        raise DPFLError(f"the Ray GCS at {where} did not list its nodes: {_rpc_reason(err)}")
    return needs_token, [n for n in nodes.node_info_list if n.state == 0]  # 0: ALIVE


def _rpc_reason(err) -> str:
    details = (err.details() or "").strip().splitlines()
    text = details[0] if details else str(err.code())
    if "HTTP/1" in text or "http1" in text.lower():
        return "it speaks HTTP, like the dashboard"
    return text[:160]


def local_node(alive: list, target: Target):
    """The cluster node whose raylet runs on this machine: a driver joined by HOST:PORT needs one
    (Ray would otherwise wait 60 s, then fail with 'No node info found')."""
    from ray._private.services import find_node_ids

    here = set(find_node_ids())
    mine = [n for n in alive if n.node_id.hex() in here]
    if not mine:
        raise DPFLError(
            f"no node of the Ray cluster at {target.address} ({target.source}) runs on this machine: a driver joining "
            f"by HOST:PORT must run on a cluster node (`ray start --address {target.address}` here adds one); from "
            f"elsewhere use ray://{target.host}:{CLIENT_PORT} or `dpfl submit --address http://{target.host}:8265`")
    return next((n for n in mine if n.is_head_node), mine[0])


def _use_token_mode(target: Target, needs_token: bool, environ=None) -> None:
    """Ray turns token mode on by itself only for clusters it finds on its own ('auto'); for an
    explicit address the driver must be told, or the GCS rejects it after 20 s of retries."""
    environ = os.environ if environ is None else environ
    mode = environ.get("RAY_AUTH_MODE")
    if not needs_token or (mode or "").lower() == "token":
        return
    if mode is not None:
        raise DPFLError(f"the Ray cluster at {target.address} uses token authentication but RAY_AUTH_MODE={mode} "
                        "here: unset RAY_AUTH_MODE", field="RAY_AUTH_MODE")
    try:
        from ray._private.authentication.authentication_token_setup import _enable_token_auth
    except ImportError:  # pragma: no cover - a Ray without the helper reads the variable at init
        environ["RAY_AUTH_MODE"] = "token"
        return
    _enable_token_auth()


def package_runtime_env() -> dict:
    """Ship this package to a cluster that may not have it (a Ray Job already has its working dir)."""
    import dpfl_ray

    return {"py_modules": [str(Path(dpfl_ray.__file__).parent)], "excludes": PACKAGE_EXCLUDES}


def package_for_workers(alive: list | None) -> dict:
    """The ray.init arguments by which the cluster's workers import this very package.

    When every alive node of the cluster runs on this machine (``alive``: their GcsNodeInfo, from
    :func:`probe_gcs`), the workers can read the package where the driver does: the folder that
    holds it goes first on each worker's sys.path (Ray's job setting for the driver's own paths). Nothing
    is zipped, uploaded and unpacked, and the job's workers need no runtime_env of their own, which
    saves about 2 s of CPU and 1 s of a run's start on a 2-core machine (benchmarks/RESULTS.md). A node
    elsewhere, or a Ray without that setting, gets the package shipped as py_modules."""
    from ray._private.services import find_node_ids

    if alive and {n.node_id.hex() for n in alive} <= set(find_node_ids()):
        import dpfl_ray
        from ray.job_config import JobConfig

        try:
            return {"job_config": JobConfig(_py_driver_sys_path=[str(Path(dpfl_ray.__file__).parent.parent)])}
        except TypeError:  # pragma: no cover - a Ray whose JobConfig lacks the setting
            pass
    return {"runtime_env": package_runtime_env()}


# -- connecting ------------------------------------------------------------------------------------
def connect(address: str | None = None, join_timeout_s: float = JOIN_TIMEOUT_S,
            pending_signal: Callable[[], int] = lambda: 0) -> bool:
    """Join the cluster ``address`` names (see :func:`resolve_target`) or start a private local
    Ray bound to 127.0.0.1. Returns True when this call connected (the caller shuts Ray down).
    ``pending_signal``: the number of a signal that came meanwhile, else 0 (see :func:`start_local_ray`)."""
    if "ray" in sys.modules and sys.modules["ray"].is_initialized():
        return False
    target = resolve_target(address, recorded=recorded_address)
    stay_on_loopback(target)
    import ray

    quiet_cluster_errors()

    kwargs = dict(log_to_driver=False, configure_logging=True, logging_level="ERROR")
    if target.kind == "local":
        # address="local" always starts a private instance, never joins one found on the machine.
        start_local_ray(lambda: ray.init(address="local", num_cpus=os.cpu_count(), _node_ip_address="127.0.0.1",
                                         include_dashboard=False, **kwargs), pending_signal=pending_signal)
        return True
    token = find_auth_token()
    probe_tcp(target)
    alive = None
    if target.kind == "gcs":
        needs_token, alive = probe_gcs(target, token, pending_signal=pending_signal)
        kwargs["_node_ip_address"] = local_node(alive, target).node_manager_address
        _use_token_mode(target, needs_token)
    elif token is not None and "RAY_AUTH_MODE" not in os.environ:
        _use_token_mode(target, True)  # Ray Client: the header is harmless where auth is off
    if not target.inside_job:
        kwargs.update(package_for_workers(alive))
    _join(target, kwargs, join_timeout_s, pending_signal)
    return True


def quiet_cluster_errors() -> None:
    """Keep the messages Ray's GCS pushes to every driver off the terminal, as log_to_driver=False
    keeps the workers' logs (both stay in the session's log files). When a head is stopped, its
    autoscaler's dying traceback arrives that way, ahead of the run's own one-line error; dpfl
    reports what happened to the run itself (crashed workers, a lost coordinator or head)."""
    import ray._private.worker as ray_worker

    shown = ray_worker.print_to_stdstream
    if getattr(shown, "dpfl_quiet", False):
        return

    def print_to_stdstream(data, ignore_prefix: bool):
        if data.get("pid") != "raylet":  # Ray's error listener sends everything as the raylet's
            shown(data, ignore_prefix)

    print_to_stdstream.dpfl_quiet = True
    ray_worker.print_to_stdstream = print_to_stdstream


# Ray's own start-up, tried this many times. Once, on this 2-core machine during `make test` (about
# 450 local starts that day), the raylet never registered and ray.init gave up after its 30 s: "The
# current node timed out during startup". Nothing of ours runs in that start; a second one works.
LOCAL_START_ATTEMPTS = 2


def start_local_ray(init: Callable[[], object], attempts: int = LOCAL_START_ATTEMPTS,
                    clear: Callable[[], None] | None = None, warn: Callable[[str], None] | None = None,
                    pending_signal: Callable[[], int] = lambda: 0) -> None:
    """Start a private local Ray with ``init`` (a ``ray.init(address="local", ...)``). When Ray's
    own start-up fails, ``clear`` removes what it left (default: ``ray.shutdown()``, then the
    processes started since the try began) and ``warn`` says so (default: a line on stderr) before
    the next try. After the last try: a one-line DPFLError.

    ``init`` runs in a helper thread (private_ray.start_in_keeper) while this thread waits in short
    steps, and Ray's processes start in sessions of their own (private_ray.own_session). A signal
    meanwhile (``pending_signal()``: its number, or 0) is a stop, not a failed start: the processes
    this try started are killed at once and KeyboardInterrupt is raised, however long Ray's own
    start-up would still take (on a loaded 2-core machine it takes 10 s and more). Nothing of a
    half-started private Ray is worth waiting for."""
    from .private_ray import start_in_keeper
    from .shutdown import descendant_pids, kill_descendants

    for attempt in range(1, attempts + 1):
        before = descendant_pids()  # e.g. a test session's Ray head: not this start's to clear
        try:
            start_in_keeper(init, pending_signal)
            return
        except KeyboardInterrupt:
            kill_descendants(grace=0.0, spare=before)
            raise
        except Exception as err:  # noqa: BLE001 - ray.init raises a bare Exception when its node never comes up
            reason = _one_line(err)
            if clear is None:
                _clear_failed_start(before)
            else:
                clear()
            if pending_signal():
                raise KeyboardInterrupt(signal_name(pending_signal())) from None
            if attempt == attempts:
                raise DPFLError(f"the private local Ray did not start ({attempts} tries): {reason}") from None
            (warn or _warn)(f"Ray's local start failed ({reason}); starting it again")


def _clear_failed_start(before: set[int]) -> None:
    """ray.shutdown(), then kill the processes the failed start left: those started since ``before``
    was taken, except what the processes already running then started meanwhile."""
    import ray

    from .shutdown import kill_descendants

    try:
        ray.shutdown()
    except Exception:  # noqa: BLE001 - half-started: whatever shutdown cannot do, the kill below does
        pass
    kill_descendants(spare=before)


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def _join(target: Target, kwargs: dict, timeout_s: float, pending_signal: Callable[[], int] = lambda: 0) -> None:
    import ray

    where = f"{target.address} ({target.source})"
    try:
        call_bounded(lambda: ray.init(address=target.address, **kwargs), timeout_s,
                     f"joining the Ray cluster at {where}", pending_signal=pending_signal)
    except DPFLError:
        raise
    except Exception as err:  # ray.init's ConnectionError/RuntimeError/AuthenticationError, one line each
        text = _one_line(err)
        if "auth" in type(err).__name__.lower() or "InvalidAuthToken" in text or "Authentication" in text:
            token = find_auth_token()
            raise DPFLError(rejected_token_message(where, token) if token else missing_token_message(where)) from None
        raise DPFLError(f"could not join the Ray cluster at {where}: {text}") from None


def _one_line(err: BaseException) -> str:
    """Ray's multi-line errors (a server traceback) as one line: the headline and the cause."""
    lines = [ln.strip() for ln in str(err).strip().splitlines() if ln.strip()]
    if not lines:
        return type(err).__name__
    return (lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}")[:400]


def call_bounded(fn: Callable[[], object], timeout_s: float, what: str, poll_s: float = 0.1,
                 pending_signal: Callable[[], int] = lambda: 0):
    """Run ``fn`` in a helper thread and wait for it in ``poll_s`` steps, so a recorded signal
    (``pending_signal``: its number, or 0) ends the wait at once with KeyboardInterrupt, and a call
    that never returns becomes a one-line error after ``timeout_s``. The abandoned call cannot be
    cancelled: the process then exits without running Ray's exit hooks (they would wait on it)."""
    box: dict = {}

    def body() -> None:
        try:
            box["value"] = fn()
        except BaseException as err:  # handed to the waiting thread
            box["error"] = err

    worker = threading.Thread(target=body, name="dpfl-connect", daemon=True)
    worker.start()
    deadline = time.monotonic() + timeout_s
    try:
        while worker.is_alive():
            worker.join(poll_s)
            if worker.is_alive() and pending_signal():
                raise KeyboardInterrupt(signal_name(pending_signal()))
            if worker.is_alive() and time.monotonic() > deadline:
                exit_without_waiting_for(worker.is_alive, 2)
                raise DPFLError(f"{what} did not finish within {timeout_s:g} s")
    except KeyboardInterrupt as interrupt:
        if worker.is_alive():
            exit_without_waiting_for(worker.is_alive, 128 + signal_number(interrupt))
        raise
    if "error" in box:
        raise box["error"]
    return box.get("value")
