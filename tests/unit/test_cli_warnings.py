"""A third-party warning raised while `dpfl` imports stays off stderr even when another thread's
``warnings.catch_warnings()`` block drops the filter the library installed for it (the race `dpfl
run` has: matplotlib loads in a thread while the main thread imports Ray, which imports requests)."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

RACE = """
import threading, warnings
{setup}
entered, leave = threading.Event(), threading.Event()

def other():  # holds a catch_warnings block across the main thread's import of requests
    with warnings.catch_warnings():
        entered.set()
        leave.wait()

t = threading.Thread(target=other)
t.start()
entered.wait()
import requests  # installs its own filter for urllib3's DependencyWarning ...
leave.set()
t.join()  # ... which the block's exit has now dropped
try:
    import urllib3.contrib.socks  # a failed import is not cached: it runs again, and warns again
except ImportError:
    pass
"""


def _stderr(setup: str) -> str:
    r = subprocess.run([sys.executable, "-c", RACE.format(setup=setup)], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stderr


def test_the_socks_notice_stays_off_stderr_when_a_thread_drops_requests_filter():
    if importlib.util.find_spec("socks") is not None:
        pytest.skip("PySocks is installed: urllib3 has nothing to warn about")
    assert "SOCKS support in urllib3" in _stderr(""), "the race no longer drops requests' filter"
    assert _stderr("from cli.main import quiet_import_warnings; quiet_import_warnings()") == ""
