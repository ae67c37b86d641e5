"""One shutdown path for every long command (SIGINT, SIGTERM and SIGHUP alike).

The first signal raises KeyboardInterrupt in the main thread wherever it waits -- connecting,
starting Ray or the workers, or between polls of a running round -- so the command can stop the
coordinator between rounds and write its files. Inside an import it is only recorded
(:func:`inside_import`), and the command's next check of ``requested`` acts on it. While those
files are written (``protect()``) a further signal is only remembered: the write finishes first.
Ray replaces the SIGTERM handler when it connects, so ``install()`` is called again after
``ray.init``.
"""
from __future__ import annotations

import contextlib
import os
import signal

SIGNALS = tuple(s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None)


class Shutdown:
    def __init__(self):
        self.received: list[int] = []
        self._protected = False

    def install(self) -> "Shutdown":
        for sig in SIGNALS:
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.received.append(signum)
        if not self._protected and len(self.received) == 1 and not inside_import(frame):
            raise KeyboardInterrupt(signal.Signals(signum).name)

    def done(self) -> None:
        """Everything is written and stopped: a late signal must not kill the exiting process
        (Python restores the default handlers while it finalises)."""
        for sig in SIGNALS:
            signal.signal(sig, signal.SIG_IGN)

    @property
    def requested(self) -> bool:
        return bool(self.received)

    @property
    def first(self) -> int:
        """The first signal's number, 0 before any."""
        return self.received[0] if self.received else 0

    @property
    def exit_code(self) -> int:
        """128 + the first signal's number, as a shell reports a process ended by it."""
        return 128 + (self.received[0] if self.received else signal.SIGINT)

    @contextlib.contextmanager
    def protect(self):
        """Signals arriving inside only get recorded (the final write of a run's files)."""
        self._protected = True
        try:
            yield
        finally:
            self._protected = False

    @contextlib.contextmanager
    def defer(self):
        """A first signal arriving inside is raised when the block ends, not in its middle (a row
        half-written to rounds.jsonl)."""
        before = len(self.received)
        with self.protect():
            yield
        if before == 0 and self.received:
            raise KeyboardInterrupt(signal.Signals(self.received[0]).name)


def inside_import(frame) -> bool:
    """Is ``frame``, or a frame that called it, the interpreter's import machinery at work?

    A KeyboardInterrupt is not raised there; the signal stays recorded (``requested``), and the
    command acts on it at its next check. Raised there, it can leave a module half-initialised, or
    the interpreter's import lock held for good: ``_get_module_lock``'s weakref callback acquires
    it one line before its ``try``. That happened once in `make test`: a SIGINT while `dpfl run`
    started Ray landed on that line ("Exception ignored in: <function _get_module_lock.<locals>.cb>"),
    the thread that imports torch waited on the lock forever, and so did the stopped run."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


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


def descendant_pids() -> set[int]:
    """The pids of every process this one started, and they started, now."""
    import psutil

    try:
        return {p.pid for p in psutil.Process(os.getpid()).children(recursive=True)}
    except psutil.Error:
        return set()


def kill_descendants(grace: float = 2.0, spare: frozenset[int] | set[int] = frozenset()) -> int:
    """Stop every process this one started (a private Ray's GCS, raylet, agents and workers):
    SIGTERM, then SIGKILL for those still alive after ``grace`` seconds. Returns how many there were.
    ``spare``: pids left alone, with every process they started."""
    import psutil

    try:
        children = psutil.Process(os.getpid()).children(recursive=True)
    except psutil.Error:
        return 0
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
