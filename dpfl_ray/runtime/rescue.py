"""What a run leaves when its Ray goes away under it: the files of the last committed round.

Ray's core ends a driver process on the spot (``_Exit(1)``, no Python runs) when the node it is
attached to stops: a joined cluster's head, or a private Ray's raylet. The driver therefore starts
a small watcher process (:class:`Watcher`) next to each run. It holds the read end of a pipe and
waits, doing nothing; the driver says "done" once its files are written. If the pipe closes
without it, the driver died, and the watcher writes ``model.pt``, ``ledger.json`` and
``summary.json`` for the round of ``checkpoint.npz``, cuts ``rounds.jsonl`` back to that round
(so ``dpfl run --resume`` continues from exactly the files it finds), and prints one ``error:``
line with the ``--resume`` command.

The watcher stays in the driver's process group and ignores SIGINT, SIGTERM and SIGHUP: those
reach the driver, which stops in order and says "done". A SIGKILL of the whole group takes the
watcher along and leaves the files as the driver left them.

No Ray here: :func:`committed_from_checkpoint` rebuilds, from a checkpoint, what the coordinator
would have handed back (the model, the ledger, the algorithm's summary fields).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from .recovery import add_pending_row, committed_from_checkpoint, head_unreachable
from .private_ray import stop_sessions

DONE = b"done\n"


class Watcher:
    """The watcher process of one run (module docstring). ``started_at``: when the command began
    (epoch seconds), for the summary's wall time. ``head``: the GCS address of a joined cluster,
    None for a private Ray. ``ray_sessions``: the sessions of a private Ray's processes
    (connect.own_session): what of them outlives the driver is stopped with it."""

    def __init__(self, run_dir: Path, started_at: float, head: str | None = None, ray_sessions=()):
        code = "from dpfl_ray.runtime.rescue import watch; watch()"
        sessions = ",".join(str(s) for s in sorted(ray_sessions))
        self._proc = subprocess.Popen([sys.executable, "-c", code, str(run_dir), repr(started_at), head or "",
                                       sessions], stdin=subprocess.PIPE)

    def done(self) -> None:
        """The run's files are written (or it failed in a way it reported itself): stand down."""
        if self._proc.poll() is None:
            try:
                self._proc.stdin.write(DONE)
                self._proc.stdin.close()
            except OSError:
                pass
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()


def watch() -> None:
    """The watcher's body; ``argv``: what :class:`Watcher` passes."""
    for sig in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if sig is not None:
            signal.signal(sig, signal.SIG_IGN)
    run_dir, started_at, head = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3] or None
    sessions = {int(s) for s in sys.argv[4].split(",") if s}
    said = b""
    while True:
        chunk = os.read(sys.stdin.fileno(), 64)
        if not chunk:
            break
        said += chunk
    if DONE in said:
        return
    stop_sessions(sessions)  # the agents its raylet started would wait a minute and more for a GCS that is gone
    import logging

    logging.getLogger("absl").setLevel(logging.ERROR)  # dp_accounting's warnings, quiet in the coordinator too
    try:
        print(f"error: {rescue(run_dir, head, started_at)}", file=sys.stderr, flush=True)
    except Exception as err:  # noqa: BLE001 - one line, whatever went wrong
        print(f"error: the run's process ended before writing its files, and they could not be written from "
              f"{run_dir / 'checkpoint.npz'}: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
    os._exit(1)


def rescue(run_dir: Path, head: str | None, started_at: float) -> str:
    """Write the files of the checkpoint's round; returns the error line to print (without
    ``error:``). ``head``: the GCS address of a joined cluster, None for a private Ray."""
    from ..data import build_federation
    from ..runs.record import RunRecord
    from ..scenario import load_scenario
    from .checkpoint import CHECKPOINT, forget_run_secret, read_checkpoint, rows_covered
    from .driver import finish, write_unstarted

    what = (f"the Ray head at {head} is unreachable" if head_unreachable(head)
            else "the run's process ended before writing its files (its Ray node stopped, or it was killed)")
    sc = load_scenario(run_dir / "scenario.yaml")
    fed = build_federation(sc)
    wall = time.time() - started_at
    if not (run_dir / CHECKPOINT).is_file():
        forget_run_secret(run_dir)  # nothing will resume it (dpfl run --resume needs a checkpoint)
        rows = (run_dir / "rounds.jsonl").read_text().splitlines() if (run_dir / "rounds.jsonl").exists() else []
        if rows:
            return f"{what}; it had written no checkpoint yet (output.checkpoint_every), so its model is lost"
        write_unstarted(sc, fed, RunRecord.reopen(run_dir, 0), wall, stop_reason="error", error=what)
        return f"{what}, before the first round; {run_dir} holds a run of 0 rounds"
    state = read_checkpoint(run_dir)
    record = RunRecord.reopen(run_dir, rows_covered(state))
    add_pending_row(sc, fed, record, state)
    summary = finish(sc, fed, record, committed_from_checkpoint(sc, fed, state), "error", what, wall)
    return (f"{what}: the run stopped after round {summary['rounds_completed']}; model.pt, ledger.json and "
            f"summary.json are for that round; resume with: dpfl run --resume {run_dir}")
