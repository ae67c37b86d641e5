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
