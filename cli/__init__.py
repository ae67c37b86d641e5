"""The ``dpfl`` command line.

Started as the console command (or ``python -m cli.main``), a signal that arrives while its modules
import is recorded, not raised: a KeyboardInterrupt raised inside a library's import could be
swallowed by a bare ``except:`` (the command would then run on), or print a traceback.
:func:`cli.main.main` exits on it as soon as the imports are done. Imported by anything else (the
tests), nothing changes.
"""
import os as _os
import signal as _signal
import sys as _sys

EARLY_SIGNALS: list[int] = []
_EARLY = tuple(s for s in (_signal.SIGINT, _signal.SIGTERM, getattr(_signal, "SIGHUP", None)) if s is not None)


def _record(signum, frame) -> None:
    EARLY_SIGNALS.append(signum)


if _os.path.basename(_sys.argv[0]) in ("dpfl", "-m"):
    for _sig in _EARLY:
        _signal.signal(_sig, _record)


def release_early_signals() -> int | None:
    """Give the signals their usual handlers back; 128 + the first early signal, if one came."""
    for sig in _EARLY:
        if _signal.getsignal(sig) is _record:
            _signal.signal(sig, _signal.default_int_handler if sig == _signal.SIGINT else _signal.SIG_DFL)
    return 128 + EARLY_SIGNALS[0] if EARLY_SIGNALS else None
