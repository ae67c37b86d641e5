"""Tear-down of a private Ray: the autoscaler monitor, which takes SIGTERM slowly, is killed first."""
import subprocess
import sys
import textwrap

import psutil

from dpfl_ray.runtime.shutdown import stop_autoscaler_monitor

STUBBORN = textwrap.dedent("""
    import signal, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("ready", flush=True)
    time.sleep(120)
""")


def _start(path):
    proc = subprocess.Popen([sys.executable, "-u", str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_only_the_autoscaler_monitor_child_is_killed(tmp_path):
    monitor = tmp_path / "ray" / "autoscaler" / "_private" / "monitor.py"
    other = tmp_path / "ray" / "_private" / "log_monitor.py"
    for path in (monitor, other):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(STUBBORN)
    mon, keep = _start(monitor), _start(other)
    try:
        assert stop_autoscaler_monitor() is True
        # it ignores SIGTERM (Ray's takes a second); killed and already reaped, so Ray's poll() skips it
        assert mon.poll() is not None and not psutil.pid_exists(mon.pid)
        assert keep.poll() is None and psutil.pid_exists(keep.pid)
        assert stop_autoscaler_monitor() is False  # nothing left to find
    finally:
        for proc in (mon, keep):
            proc.kill()
            proc.wait(timeout=5)


def test_a_signal_is_recorded_never_raised_and_a_deferred_block_raises_it_at_its_end():
    """Shutdown's handler, called as the interpreter calls it (with the interrupted frame): raised
    there, a KeyboardInterrupt landed inside library code -- importlib's weakref callback, logging's
    at-fork lock release -- and left a lock held for good (`dpfl run` hung so, twice in `make
    test`). It only records; ``defer()`` raises at the end of its block, in our own code."""
    import signal

    from dpfl_ray.runtime.shutdown import Shutdown

    s = Shutdown()
    try:
        s._handle(signal.SIGTERM, sys._getframe())
        s._handle(signal.SIGINT, sys._getframe())
    except KeyboardInterrupt:  # (not left to pytest, which would end the whole session)
        raise AssertionError("the handler raised") from None
    assert s.requested and s.first == signal.SIGTERM and s.exit_code == 143
    assert s.received == [signal.SIGTERM, signal.SIGINT]

    s, done = Shutdown(), []
    try:
        with s.defer():
            s._handle(signal.SIGHUP, sys._getframe())
            done.append("the block went on")
    except KeyboardInterrupt as err:
        assert str(err) == "SIGHUP" and done == ["the block went on"]
    else:
        raise AssertionError("defer() did not raise the signal at the end of its block")
