import os

import pytest

# Keep the test Ray on the loopback interface: without this Ray swaps 127.0.0.1 for the routable IP.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# pytest-xdist's workers start with COLUMNS=80, which rich would fix as the width of the CLI's console
# when cli.common is imported; without it the console reads COLUMNS per call, as the tests set it.
os.environ.pop("COLUMNS", None)


# pytest-xdist's worksteal hands its k-th of n processes a contiguous block of the collected tests
# (len(left) // (n - k) of them) and lets a process that runs dry take the second half of the
# longest queue. A minute-long cluster or CLI test collected last would run alone at the end while
# the other processes sit idle; so each block gets an equal share of the long tests' rough cost,
# first, and is filled up with unit tests. A module's long tests stay together (module fixtures
# start a Ray head or a cluster). The costs are rough CPU seconds per test (a serial run's, per
# module), by where it lives: the first prefix that matches.
_COST = (("tests/ray_cluster/test_nodes.py", 90.0), ("tests/ray_cluster/test_connect_cli.py", 2.0),
         ("tests/ray_cluster/test_cluster_yaml.py", 2.0), ("tests/ray_cluster/", 20.0),
         ("tests/e2e/test_sweep_cli.py", 30.0), ("tests/e2e/test_reproduce.py", 20.0),
         ("tests/e2e/test_signals.py", 9.0), ("tests/e2e/test_resume.py", 7.0), ("tests/e2e/test_cli.py", 2.5),
         ("tests/e2e/test_hostile_inputs.py", 1.0), ("tests/ray/", 8.0))
_UNIT_COST = 0.3


def _cost(item) -> float:
    return next((cost for prefix, cost in _COST if item.nodeid.startswith(prefix)), _UNIT_COST)


def pytest_collection_modifyitems(session, config, items):
    modules: dict[str, list] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    long = sorted((m for m in modules.values() if _cost(m[0]) > _UNIT_COST), key=lambda m: -sum(map(_cost, m)))
    short = [item for m in modules.values() if _cost(m[0]) == _UNIT_COST for item in m]
    n = int(getattr(config, "workerinput", {}).get("workercount", 1))
    sizes, left = [], len(items)
    for k in range(n):
        sizes.append(left // (n - k))
        left -= sizes[-1]
    blocks, load = [[] for _ in range(n)], [0.0] * n
    for module in long:  # the costliest first, each to the block with the least cost so far that has room
        room = [k for k in range(n) if len(blocks[k]) + len(module) <= sizes[k]] or range(n)
        k = min(room, key=lambda b: load[b])
        blocks[k] += module
        load[k] += sum(map(_cost, module))
    for k in range(n):  # then unit tests, in their order, up to each block's size
        take = max(0, sizes[k] - len(blocks[k]))
        blocks[k] += short[:take]
        short = short[take:]
    items[:] = [item for block in blocks for item in block] + short


@pytest.fixture(scope="session")
def ray_session():
    """One real local Ray for the whole test session (for each pytest-xdist process: `make test`
    runs two), bound to 127.0.0.1.

    Two GPUs are declared (they do not exist) so fractional-GPU scheduling is tested on a CPU box.
    """
    import warnings

    import ray

    from dpfl_ray.runtime.connect import start_local_ray
    from dpfl_ray.runtime.private_ray import own_sessions, stop_sessions

    # As `dpfl run` does: a second try if Ray's own start-up fails (once in `make test`, the raylet
    # never registered and every test of this process errored at set-up).
    start_local_ray(lambda: ray.init(address="local", num_cpus=2, num_gpus=2, include_dashboard=False,
                                     _node_ip_address="127.0.0.1", log_to_driver=False, configure_logging=True,
                                     logging_level="ERROR"),
                    warn=lambda message: warnings.warn(message, RuntimeWarning))
    yield ray
    sessions = own_sessions()
    ray.shutdown()
    # Ray's own exit path can deadlock and leave a worker orphaned (private_ray.stop_sessions):
    # it would outlive the suite with ppid 1.
    stop_sessions(sessions, grace=5.0)


@pytest.fixture(scope="session")
def ray_address(ray_session) -> str:
    """The session Ray's GCS address, for `dpfl` subprocesses that join it (``--address`` or
    RAY_ADDRESS) instead of starting a private Ray of their own: about 3 s of CPU and 2-3 s of wall
    time less per run. Tests of a private Ray's start-up and tear-down (signals, quickstart) keep
    their own."""
    return ray_session.get_runtime_context().gcs_address


@pytest.fixture(autouse=True)
def _no_parked_workers_for_other_drivers(request):
    """Workers parked by this process's last in-process run (runtime/warm.py) hold the session
    Ray's CPUs: a test whose `dpfl` subprocess joins that Ray gets them back first."""
    if "ray_address" in request.fixturenames:
        from dpfl_ray.runtime import warm

        warm.clear()
    yield


@pytest.fixture
def one_torch_thread():
    """torch on one thread, as a worker runs it (resources.torch_threads): bitwise claims are made
    for a fixed count, and tiny tensors only pay for a second thread's synchronisation."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
