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


def test_a_signal_inside_an_import_is_recorded_not_raised(tmp_path, monkeypatch):
    """Shutdown's handler, given the frames a signal really interrupts: raised inside the import
    machinery, a KeyboardInterrupt could leave the interpreter's import lock held for good (once,
    `dpfl run` hung so), so there the signal is only recorded; anywhere else it is raised at once."""
    import importlib
    import signal

    from dpfl_ray.runtime.shutdown import Shutdown, inside_import

    (tmp_path / "frame_at_import.py").write_text("import sys\nFRAME = sys._getframe()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    during_import = importlib.import_module("frame_at_import").FRAME  # its callers: importlib's frames
    assert inside_import(during_import) and not inside_import(sys._getframe())

    s = Shutdown()
    try:
        s._handle(signal.SIGTERM, during_import)
    except KeyboardInterrupt:  # (not left to pytest, which would end the whole session)
        raise AssertionError("a signal inside an import was raised") from None
    assert s.requested and s.first == signal.SIGTERM and s.exit_code == 143

    s = Shutdown()
    try:
        s._handle(signal.SIGINT, sys._getframe())
    except KeyboardInterrupt as err:
        assert str(err) == "SIGINT"
    else:
        raise AssertionError("a signal outside an import was not raised")
    s._handle(signal.SIGINT, sys._getframe())  # a second signal is only recorded
    assert s.received == [signal.SIGINT, signal.SIGINT]
