"""What a private Ray leaves orphaned is found by its session and stopped (runtime/private_ray.py)."""
import subprocess
import sys
import threading
import time

import psutil

from dpfl_ray.runtime.private_ray import session_processes, stop_sessions

# A session leader that forks a child ignoring SIGTERM, prints the child's pid and exits: the child
# is orphaned (as a Ray worker is when its raylet is gone) and keeps the leader's session.
_ORPHANING = """
import os, signal, sys, time
if os.fork() == 0:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print(os.getpid(), flush=True)
    time.sleep(600)
"""


def _gone(pid: int, within: float = 0.0) -> bool:
    """Has ``pid`` ended (a zombie has), or does it within ``within`` seconds?"""
    deadline = time.monotonic() + within
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def test_an_orphan_of_the_session_is_killed_and_other_sessions_are_left_alone():
    leader = subprocess.Popen([sys.executable, "-c", _ORPHANING], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    orphan = int(leader.stdout.readline())
    try:
        leader.wait(timeout=30)
        assert psutil.Process(orphan).ppid() != leader.pid
        assert session_processes({leader.pid}) == [orphan]

        assert stop_sessions({leader.pid}, grace=0.2) == 1

        assert _gone(orphan, within=10)
        assert bystander.poll() is None
        assert session_processes({leader.pid}) == []
    finally:
        bystander.kill()
        bystander.wait(timeout=10)
        if not _gone(orphan):
            psutil.Process(orphan).kill()


def test_a_process_that_ends_within_the_grace_is_not_killed():
    leader = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"], start_new_session=True)
    try:
        # the leader is this process's child: reaped as it exits, as kill_descendants reaps a Ray's
        threading.Thread(target=leader.wait, daemon=True).start()
        assert stop_sessions({leader.pid}, grace=30) == 0
        assert leader.wait(timeout=10) == 0
    finally:
        if leader.poll() is None:
            leader.kill()


def test_no_sessions_finds_nothing():
    assert session_processes(set()) == []
    assert stop_sessions(set(), grace=5) == 0
