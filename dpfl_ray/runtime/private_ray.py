"""The private local Ray's processes: started in sessions of their own, by a thread that outlives
them, and given up at once when a signal comes during the start (runtime/connect.start_local_ray)."""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from typing import Callable

from .shutdown import exit_without_waiting_for, signal_name


def own_sessions() -> set[int]:
    """The sessions that this process's children lead (:func:`own_session`): a private Ray's."""
    import psutil

    try:
        children = psutil.Process(os.getpid()).children(recursive=False)
    except psutil.Error:
        return set()
    sessions = set()
    for p in children:
        try:
            if os.getsid(p.pid) == p.pid:
                sessions.add(p.pid)
        except OSError:
            pass
    return sessions


def session_processes(sessions: set[int]) -> list[int]:
    """The pids of the live processes (zombies are not) whose session is one of ``sessions``, this
    one excepted."""
    import psutil

    found = []
    if not sessions:
        return found
    for proc in psutil.process_iter():
        if proc.pid != os.getpid():
            with contextlib.suppress(OSError, psutil.Error):
                if os.getsid(proc.pid) in sessions and proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(proc.pid)
    return found


def stop_sessions(sessions: set[int], grace: float = 0.0) -> int:
    """SIGKILL every process of these sessions still alive after ``grace`` seconds; returns how many.

    A process keeps its session when its parent dies, so this finds what a private Ray leaves
    orphaned: a worker whose raylet is gone can hang in its own exit handlers, on a mutex that Ray's
    io_context shutdown holds (CoreWorkerProcess::HandleAtExit -> ~Publisher -> pthread_mutex_lock),
    and would outlive the command with ppid 1."""
    deadline = time.monotonic() + grace
    left = session_processes(sessions)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = session_processes(sessions)
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return len(left)


# Set when a signal ended the wait for a private Ray's start-up: its ray.init may still run in the
# helper thread, so nothing may call into Ray's driver state (ray.shutdown) any more.
_START_ABANDONED = threading.Event()


def start_abandoned() -> bool:
    """Did a signal end this process's wait for a private Ray's start-up (its processes are killed)?"""
    return _START_ABANDONED.is_set()


def start_in_keeper(init: Callable[[], object], pending_signal: Callable[[], int]) -> None:
    """Run ``init`` in a helper thread and wait for it in 0.1 s steps; a recorded signal ends the
    wait at once with KeyboardInterrupt (the call goes on, abandoned: the process then exits without
    waiting for it).

    The thread that started Ray's processes stays alive, parked, as long as the process:
    Ray asks the kernel to kill them when their parent dies (PR_SET_PDEATHSIG), and for the kernel
    the parent is the thread that forked them, not the process."""
    box: dict = {}
    finished, stopped = threading.Event(), threading.Event()

    def body() -> None:
        try:
            with own_session(stopped):
                box["value"] = init()
        except BaseException as err:  # handed to the waiting thread; the failed start's processes go with it
            box["error"] = err
            finished.set()
            return
        finished.set()
        threading.Event().wait()

    keeper = threading.Thread(target=body, name="dpfl-ray-start", daemon=True)
    keeper.start()
    while not finished.wait(0.1):
        if pending_signal():
            stopped.set()
            _START_ABANDONED.set()
            exit_without_waiting_for(lambda: not finished.is_set(), 128 + pending_signal())
            raise KeyboardInterrupt(signal_name(pending_signal()))
    if "error" in box:
        raise box["error"]


@contextlib.contextmanager
def own_session(stopped: threading.Event | None = None):
    """Ray's processes, started meanwhile, each lead a session of their own instead of sharing the
    driver's process group. A signal to the user's terminal group (closing the terminal: SIGHUP;
    ``kill -TERM -PGID``) then reaches only the driver, which stops the run between rounds and
    stops Ray in order; in the driver's group, Ray died with it and took the coordinator's model
    and ledger along. Ray's processes still die with the driver (Ray asks the kernel for that), so
    only where the kernel does that (Linux): elsewhere Ray's reaper needs them in the group.
    Once ``stopped`` is set, no further process starts: that start was abandoned."""
    services = sys.modules.get("ray._private.services")
    if services is None or not sys.platform.startswith("linux"):
        yield
        return
    from ray._private.utils import detect_fate_sharing_support

    if not detect_fate_sharing_support():
        yield
        return
    base = services.ConsolePopen

    class OwnSessionPopen(base):
        def __init__(self, *args, **kwargs):
            if stopped is not None and stopped.is_set():
                raise OSError("the private Ray's start-up was stopped by a signal")
            kwargs["start_new_session"] = True
            super().__init__(*args, **kwargs)

    services.ConsolePopen = OwnSessionPopen
    try:
        yield
    finally:
        services.ConsolePopen = base
