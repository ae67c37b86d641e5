"""Warm actors: ClientWorker and Coordinator processes kept between runs of one driver process.

A worker's start is mostly its process and torch's import (about 1.7 s of CPU, several seconds of
wall time on a loaded machine); its run-specific work (the scenario, the data refs, the model) is a
few milliseconds. A driver that runs several scenarios in one Ray session (the test suite, a grid
run in-process) parks the workers of a run whose coordinator returned and hands them to the next run
of the same worker shape, which rebinds them (``ClientWorker.rebind``: every attribute is set anew,
so a rebound worker trains exactly as a fresh one; tests/ray compare runs on fresh and rebound
workers). The run's Coordinator is parked too (``Coordinator.rebind`` runs its ``__init__`` anew):
its start is a process and the imports of the runtime, dp_accounting and scipy (about 2 s of CPU),
and it reserves no CPU, so a parked one holds nothing another run needs.

What is never reused: the workers and coordinator of a run that was interrupted, or whose
coordinator did not return (lost, or stopped by a failure of the driver: either may be mid-call);
one that does not answer ``release`` within RELEASE_SECONDS or ``rebind`` within REBIND_SECONDS
(hung, or dead: the coordinator kills the stragglers it replaces); a coordinator whose ``run`` is
still going (its ``release`` says so); and workers of another Ray session (``stop_ray`` forgets them
before ``ray.shutdown``). Parked workers hold their CPU and GPU reservation, so a run that needs
another shape first kills every parked worker, and an idle driver gives them (and the coordinator)
back after IDLE_SECONDS. ``dpfl run``, one run per process, parks nothing
(``run_scenario(keep_workers=False)``); ``DPFL_WARM_WORKERS=0`` turns parking off everywhere.
"""
from __future__ import annotations

import os
import threading
from typing import Callable, Sequence

import ray
import ray.exceptions

RELEASE_SECONDS = 5.0
REBIND_SECONDS = 10.0  # a rebind is milliseconds of work: a worker that takes longer is not reused
# Parked workers hold their CPUs: another driver on the same Ray waits for them at most this long.
IDLE_SECONDS = 30.0

_parked: dict[tuple, list] = {}
_coordinators: dict[tuple, object] = {}  # this driver's session -> its parked coordinator
_lock = threading.Lock()
_idle: threading.Timer | None = None


def enabled() -> bool:
    return os.environ.get("DPFL_WARM_WORKERS", "1") != "0"


def _session() -> tuple[str, str]:
    """This driver's connection: the job id restarts at 01000000 with every fresh Ray, the node id does not."""
    ctx = ray.get_runtime_context()
    return ctx.get_job_id(), ctx.get_node_id()


def _key(num_cpus: float, num_gpus: float) -> tuple:
    return _session(), float(num_cpus), float(num_gpus)


def _answering(handles: list, refs: list, timeout_s: float) -> list:
    """The handles whose call (``refs``, one each) returned True within ``timeout_s``; the others
    are killed."""
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    ok = []
    for h, ref in zip(handles, refs):
        try:
            if ref in ready and ray.get(ref, timeout=0):
                ok.append(h)
                continue
        except Exception:  # noqa: BLE001 - the actor died (or was killed) before it answered
            pass
        _kill(h)
    return ok


def _kill(handle) -> None:
    try:
        ray.kill(handle, no_restart=True)
    except Exception:  # noqa: BLE001 - already gone, or a handle of a session that ended
        pass


def _cancel_idle() -> None:
    global _idle  # noqa: PLW0603
    if _idle is not None:
        _idle.cancel()
        _idle = None


def forget() -> None:
    """Drop every parked handle without a call to Ray: before ``ray.shutdown()``, which ends them."""
    with _lock:
        _cancel_idle()
        _parked.clear()
        _coordinators.clear()


def clear() -> None:
    """Kill every parked worker and coordinator of this session; forget those of earlier sessions."""
    with _lock:
        _cancel_idle()
        _clear()
        parked = _coordinators.pop(_session(), None) if ray.is_initialized() else None
        if parked is not None:
            _kill(parked)
        _coordinators.clear()


def _clear() -> None:
    session = _session() if ray.is_initialized() else None
    for key, handles in list(_parked.items()):
        if key[0] == session:
            for h in handles:
                _kill(h)
    _parked.clear()


def take(num_cpus: float, num_gpus: float, count: int, scenario: dict, data: dict) -> list:
    """Up to ``count`` parked workers of this shape, rebound to ``scenario`` and ``data`` (those that
    do not answer are dropped); every other parked worker is killed first, so that none holds
    resources the new run needs."""
    with _lock:
        _cancel_idle()
        if not _parked:
            return []
        if not enabled():
            _clear()
            return []
        mine = _parked.pop(_key(num_cpus, num_gpus), [])
        _clear()
    spare, mine = mine[count:], mine[:count]
    for h in spare:
        _kill(h)
    if not mine:
        return []
    # one that died while parked, or does not answer, is killed: a fresh one takes its place
    return _answering(mine, [h.rebind.remote(scenario, data) for h in mine], REBIND_SECONDS)


def park(num_cpus: float, num_gpus: float, handles: list) -> None:
    """Keep the workers of a run whose coordinator returned for the next run; those that do not
    answer ``release`` in time are killed."""
    if not enabled() or not handles:
        return
    # one the coordinator replaced (killed), that died, or that is still busy is killed
    keep = _answering(handles, [h.release.remote() for h in handles], RELEASE_SECONDS)
    if keep:
        with _lock:
            _parked.setdefault(_key(num_cpus, num_gpus), []).extend(keep)
            _restart_idle()


def park_coordinator(handle) -> None:
    """Keep the coordinator of a run whose ``run`` returned for the next run."""
    if not enabled() or handle is None:
        return
    if _answering([handle], [handle.release.remote()], RELEASE_SECONDS):
        with _lock:
            session = _session()
            earlier = _coordinators.get(session)
            if earlier is not None:  # one is enough: the runs of a driver follow each other
                _kill(earlier)
            _coordinators[session] = handle
            _restart_idle()


def take_coordinator(args: Sequence, wait: Callable[[object], object]):
    """A parked coordinator rebound to ``args`` (those of ``Coordinator.__init__``), or None.
    ``wait(ref)``: the caller's wait for the rebind, which may be long (a coordinator that
    calibrates its noise does it in ``__init__``) and must end on a signal: its interruption
    propagates, as does a wait that timed out or a head that is gone. One that died while parked,
    or whose ``__init__`` raised, is killed, and the caller starts a fresh one, which then meets
    the same condition the way a fresh run would."""
    with _lock:
        handle = _coordinators.pop(_session(), None) if enabled() else None
    if handle is None:
        return None
    try:
        wait(handle.rebind.remote(*args))
    except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError):
        _kill(handle)
        return None
    except BaseException:
        _kill(handle)
        raise
    return handle


def _restart_idle() -> None:
    """With _lock held: what is parked is given back after IDLE_SECONDS without a run."""
    global _idle  # noqa: PLW0603
    _cancel_idle()
    _idle = threading.Timer(IDLE_SECONDS, clear)
    _idle.daemon = True
    _idle.start()
