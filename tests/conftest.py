import os

import pytest

# Keep the test Ray on the loopback interface: without this Ray swaps 127.0.0.1 for the routable IP.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Nothing reads the suite's Ray metrics: without their collection and the event loops' statistics an
# idle Ray's daemons use about a third less CPU (1.7 against 2.5 core-seconds a minute, measured),
# for the three session Rays and every Ray a test starts (the variables reach its processes).
os.environ.setdefault("RAY_enable_metrics_collection", "0")
os.environ.setdefault("RAY_event_stats", "0")
# Ray's log monitor looks for new worker log files every 0.1 s; the suite's Rays gather hundreds of
# them, and nothing here reads worker output (log_to_driver=False): every 5 s is enough.
os.environ.setdefault("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0")
os.environ.setdefault("LOG_NAME_UPDATE_INTERVAL_S", "5")
# pytest-xdist's workers start with COLUMNS=80, which rich would fix as the width of the CLI's console
# when cli.common is imported; without it the console reads COLUMNS per call, as the tests set it.
os.environ.pop("COLUMNS", None)


# Long tests first: `make test` runs on pytest-xdist with work stealing, and a minute-long cluster
# or CLI test collected last would run alone at the end while the other processes sit idle.
_FIRST = ("tests/ray_cluster/", "tests/e2e/", "tests/ray/")


def pytest_collection_modifyitems(session, config, items):
    def rank(item):
        path = item.nodeid
        return next((i for i, prefix in enumerate(_FIRST) if path.startswith(prefix)), len(_FIRST))

    items.sort(key=rank)  # stable: each group keeps its own order


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
        import gc

        from dpfl_ray.runtime import warm

        warm.clear()
        gc.collect()  # actors whose handles only a reference cycle keeps (a traceback's frames) end now
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
