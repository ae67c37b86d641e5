"""Warm workers: ClientWorker processes kept between runs of one driver process.

A worker's start is mostly its process and torch's import (about 1.7 s of CPU, several seconds of
wall time on a loaded machine); its run-specific work (the scenario, the data refs, the model) is a
few milliseconds. A driver that runs several scenarios in one Ray session (the test suite, a grid
run in-process) parks the workers of a run that ended cleanly and hands them to the next run of the
same worker shape, which rebinds them (``ClientWorker.rebind``: every attribute is set anew, so a
rebound worker trains exactly as a fresh one; tests/ray compare pools of fresh and rebound workers).

What is never reused: a worker of a run that failed or was interrupted (it may be mid-call), one
that does not answer ``release`` within RELEASE_SECONDS (hung, or dead: the coordinator kills the
stragglers it replaces), and workers of another Ray session. Parked workers hold their CPU and GPU
reservation, so a run that needs another shape first kills every parked worker. ``DPFL_WARM_WORKERS=0``
turns parking off.
"""
from __future__ import annotations

import os
import threading

import ray

RELEASE_SECONDS = 5.0
REBIND_SECONDS = 60.0
# Parked workers hold their CPUs: another driver on the same Ray waits for them at most this long.
IDLE_SECONDS = 30.0

_parked: dict[tuple, list] = {}
_lock = threading.Lock()
_idle: threading.Timer | None = None


def _cancel_idle() -> None:
    global _idle  # noqa: PLW0603
    if _idle is not None:
        _idle.cancel()
        _idle = None


def enabled() -> bool:
    return os.environ.get("DPFL_WARM_WORKERS", "1") != "0"


def _session() -> str:
    return ray.get_runtime_context().get_job_id()


def clear() -> None:
    """Kill every parked worker of this session; forget those of earlier sessions."""
    with _lock:
        _cancel_idle()
        _clear()


def _clear() -> None:
    session = _session() if ray.is_initialized() else None
    for key, handles in list(_parked.items()):
        if key[0] == session:
            for h in handles:
                try:
                    ray.kill(h, no_restart=True)
                except Exception:  # noqa: BLE001 - already gone
                    pass
    _parked.clear()


def take(num_cpus: float, num_gpus: float, count: int, scenario: dict, data: dict) -> list:
    """Up to ``count`` parked workers of this shape, rebound to ``scenario`` and ``data`` (those that
    do not answer are dropped); every other parked worker is killed first, so that none holds
    resources the new run needs."""
    with _lock:
        _cancel_idle()
        if not enabled() or not _parked:
            return []
        key = (_session(), float(num_cpus), float(num_gpus))
        mine = _parked.pop(key, [])
        _clear()
    spare, mine = mine[count:], mine[:count]
    for h in spare:
        ray.kill(h, no_restart=True)
    if not mine:
        return []
    refs = [h.rebind.remote(scenario, data) for h in mine]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=REBIND_SECONDS)
    ok = []
    for h, ref in zip(mine, refs):
        try:
            if ref in ready and ray.get(ref, timeout=0):
                ok.append(h)
                continue
        except Exception:  # noqa: BLE001 - died while parked: a fresh one takes its place
            pass
        ray.kill(h, no_restart=True)
    return ok


def park(num_cpus: float, num_gpus: float, handles: list) -> None:
    """Keep the workers of a run that ended cleanly for the next run; those that do not answer
    ``release`` in time are killed."""
    if not enabled() or not handles:
        return
    refs = [h.release.remote() for h in handles]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=RELEASE_SECONDS)
    keep = []
    for h, ref in zip(handles, refs):
        try:
            if ref in ready and ray.get(ref, timeout=0):
                keep.append(h)
                continue
        except Exception:  # noqa: BLE001 - the coordinator replaced (killed) it, or it died
            pass
        try:
            ray.kill(h, no_restart=True)
        except Exception:  # noqa: BLE001
            pass
    if keep:
        global _idle  # noqa: PLW0603
        with _lock:
            _parked.setdefault((_session(), float(num_cpus), float(num_gpus)), []).extend(keep)
            _cancel_idle()
            _idle = threading.Timer(IDLE_SECONDS, clear)
            _idle.daemon = True
            _idle.start()
