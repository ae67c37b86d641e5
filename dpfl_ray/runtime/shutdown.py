"""One shutdown path for every long command (SIGINT, SIGTERM and SIGHUP alike).

A signal is only recorded, never raised: the command checks ``requested`` wherever it waits --
while a private Ray starts (connect.start_local_ray: its processes are then killed, without waiting
for ray.init), while it joins a cluster (``call_bounded``), while it waits for the coordinator's
replies, before every poll of a running round -- and stops there: it stops the coordinator between
rounds and writes its files. Raised from the handler, a KeyboardInterrupt lands wherever the main
thread happens to be, and library code is not written for that: inside importlib's weakref callback
and inside logging's at-fork lock release it left a lock held for good, and `dpfl run` hung (both
seen in `make test` runs, and by py-spy and faulthandler dumps). A stop therefore waits for the
step in progress: a wait step (0.1-0.2 s), the model's build (torch's import) or the round in flight.
So no write of a run's files is ever cut short by a signal; ``defer()`` raises one at the end of a
block, in the run loop.
Ray replaces the SIGTERM handler when it connects, so ``install()`` is called again after
``ray.init``.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
from typing import Callable

SIGNALS = tuple(s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None)


class Shutdown:
    def __init__(self):
        self.received: list[int] = []

    def install(self) -> "Shutdown":
        for sig in SIGNALS:
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.received.append(signum)  # acted on at the command's next check (module docstring)

    def done(self) -> None:
        """Everything is written and stopped: a late signal must not kill the exiting process
        (Python restores the default handlers while it finalises)."""
        for sig in SIGNALS:
            signal.signal(sig, signal.SIG_IGN)

    @property
    def requested(self) -> bool:
        return bool(self.received)

    # What a run stopped by this request records as its stop_reason (a scheduler's early stop: trials.py).
    stop_reason = "interrupted"

    @property
    def first(self) -> int:
        """The first signal's number, 0 before any."""
        return self.received[0] if self.received else 0

    @property
    def exit_code(self) -> int:
        """128 + the first signal's number, as a shell reports a process ended by it."""
        return 128 + (self.received[0] if self.received else signal.SIGINT)

    @contextlib.contextmanager
    def defer(self):
        """A first signal arriving inside is raised as KeyboardInterrupt when the block ends (after a
        row is written to rounds.jsonl), in our own code, where the run loop handles it."""
        before = len(self.received)
        yield
        if before == 0 and self.received:
            raise KeyboardInterrupt(signal.Signals(self.received[0]).name)


@contextlib.contextmanager
def keep_handlers():
    """While Ray connects or starts, keep our handlers: ray.init installs SIGTERM handlers that
    exit the process (or kill the node) on the spot, which would skip writing the run's files."""
    import ray._private.utils as ray_utils

    original = getattr(ray_utils, "set_sigterm_handler", None)
    if original is None:  # a Ray without the hook: its handler is replaced right after init anyway
        yield
        return
    ray_utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        ray_utils.set_sigterm_handler = original


def _descendants() -> list:
    """Every process this one started, and they started, now (psutil.Process objects)."""
    import psutil

    try:
        return psutil.Process(os.getpid()).children(recursive=True)
    except psutil.Error:
        return []


def descendant_pids() -> set[int]:
    """The pids of :func:`_descendants`."""
    return {p.pid for p in _descendants()}


def kill_descendants(grace: float = 2.0, spare: frozenset[int] | set[int] = frozenset()) -> int:
    """Stop every process this one started (a private Ray's GCS, raylet, agents and workers):
    SIGTERM, then SIGKILL for those still alive after ``grace`` seconds. Returns how many there were.
    ``spare``: pids left alone, with every process they started."""
    import psutil

    children = _descendants()
    if spare:
        def spared(p) -> bool:
            try:
                return p.pid in spare or any(a.pid in spare for a in p.parents())
            except psutil.Error:
                return True  # gone already
        children = [p for p in children if not spared(p)]
    for p in children:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(children, timeout=grace)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=grace)
    return len(children)


def stop_autoscaler_monitor() -> bool:
    """Kill the autoscaler monitor of a Ray this process started, before ``ray.shutdown()``.

    A private single-node Ray has nothing for it to scale, and it is the one process that takes
    Ray's SIGTERM slowly: ``ray.shutdown()`` waits its full second of grace for it, a second of
    every run's tear-down. Dead already, it is skipped. Returns whether one was found."""
    import psutil

    try:
        children = psutil.Process(os.getpid()).children(recursive=False)
    except psutil.Error:
        return False
    found = []
    for p in children:
        with contextlib.suppress(psutil.Error):
            if any(part.replace("\\", "/").endswith("autoscaler/_private/monitor.py") for part in p.cmdline()):
                p.kill()
                found.append(p)
    psutil.wait_procs(found, timeout=2.0)
    return bool(found)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return "SIGINT"


def signal_number(interrupt: KeyboardInterrupt) -> int:
    name = interrupt.args[0] if interrupt.args else "SIGINT"
    return getattr(signal, str(name), signal.SIGINT)


def exit_without_waiting_for(running: Callable[[], bool], code: int) -> None:
    """Registered last, this runs first at exit: if the abandoned call still runs (``running()``),
    leave at once."""
    def leave() -> None:
        if running():
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:
                    pass
            os._exit(code)

    atexit.register(leave)
