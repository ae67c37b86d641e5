"""A pytest plugin that writes each test's machine-wide CPU time and wall time, to see where the
suite's CPU goes (its Ray daemons, actors and subprocesses included, which per-process timers miss).

Run the suite serially, or the figures of parallel tests mix:

    PYTHONPATH=benchmarks SUITE_CPU_OUT=/tmp/suite_cpu.jsonl .venv/bin/python -m pytest -q -p suite_cpu tests

Each line: {"id": nodeid, "wall": seconds, "cpu": busy core-seconds of the whole machine}, from
/proc/stat (Linux) around the test's set-up, call and tear-down.
"""
import json
import os
import time

import pytest


def _busy_seconds() -> float:
    with open("/proc/stat") as fh:
        ticks = [int(v) for v in fh.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    cpu, wall = _busy_seconds(), time.monotonic()
    yield
    row = {"id": item.nodeid, "wall": round(time.monotonic() - wall, 2), "cpu": round(_busy_seconds() - cpu, 2)}
    with open(os.environ.get("SUITE_CPU_OUT", "suite_cpu.jsonl"), "a") as fh:
        fh.write(json.dumps(row) + "\n")
