"""A sweep on nodes that share no file system: a trial on another node than the sweep's sends its
run directory to the sweep's collector (runtime/trials.py), and asks it whether the sweep was told
to stop, over the test session's real Ray. The two nodes' disks are two folders here: the trial
writes under one, the sweep's node reads the other."""
import io
import tarfile
import threading
import time

import numpy as np
import pytest
import ray

from dpfl_ray.errors import DPFLError
from dpfl_ray.runs.sweep import pack_run, unpack_run
from dpfl_ray.runtime import trials
from dpfl_ray.runtime.trials import TrialStop, _ask_collector, bring_back, start_collector


def _run_dir(root, name="seed=0", stop="completed"):
    run = root / name
    (run / "plots").mkdir(parents=True)
    (run / "rounds.jsonl").write_text('{"round": 1}\n{"round": 2}\n')
    (run / "summary.json").write_text('{"stop_reason": "%s", "rounds_completed": 2}' % stop)
    (run / "model.pt").write_bytes(np.random.default_rng(0).bytes(200_000))
    (run / "plots" / "accuracy.png").write_bytes(b"\x89PNG fake")
    return run


def _files(run):
    return {p.relative_to(run).as_posix(): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def test_a_run_written_on_another_node_comes_back_whole(ray_session, tmp_path, monkeypatch):
    there, here = tmp_path / "node_b" / "sweep", tmp_path / "node_a" / "sweep"
    run = _run_dir(there)
    _run_dir(here, stop="interrupted")  # an unfinished try of the same run on the sweep's node
    collector, name, node = start_collector(here)
    try:
        config = {"name": "seed=0", "collector": name, "driver_node": "a node that is not this one"}
        assert bring_back(config, run, "ok") == "ok"
        assert _files(here / "seed=0") == _files(run)
        assert _files(here / ".incomplete" / "seed=0.1")["summary.json"].endswith(b'"interrupted", "rounds_completed": 2}')
        # the same run sent again (nodes that do share the file system see it there already): left alone
        assert ray.get(collector.write.remote("seed=0", pack_run(run)), timeout=60) is False
        # on the sweep's own node nothing is sent, and the stop file is read directly
        assert bring_back({**config, "driver_node": node}, run, "interrupted") == "interrupted"
        assert _ask_collector({**config, "driver_node": node}) is None
        # elsewhere a trial cannot see the sweep's stop file (here/.stop): it asks the collector
        stop = TrialStop(there / ".stop", time.monotonic() + 600, ask=_ask_collector(config))
        assert not stop.requested
        (here / ".stop").touch()
        end = time.monotonic() + 30
        while not stop.requested and time.monotonic() < end:
            time.sleep(0.1)
        assert stop.requested and not stop.timed_out
    finally:
        ray.kill(collector)
    monkeypatch.setattr(trials, "COLLECTOR_WAIT_S", 1.0)  # how long a trial waits for a collector to appear
    status = bring_back(config, run, "ok")  # the collector is gone: the files stay where they are, and it says so
    assert status.startswith("failed: its files stayed on node ") and str(run) in status


def test_a_sweep_on_one_node_starts_no_collector_and_a_trial_elsewhere_waits_for_it(ray_session, tmp_path,
                                                                                     monkeypatch):
    """The session Ray has one node: the sweep's collector is not started (no trial can run
    elsewhere). A trial on a node that joined later waits for the collector the sweep then starts."""
    lazy = trials._LazyCollector(tmp_path)
    monkeypatch.setattr(trials, "COLLECTOR_CHECK_S", 0.0)
    lazy.check()
    assert lazy.actor is None and lazy.node == ray.get_runtime_context().get_node_id()
    with pytest.raises(ValueError):
        ray.get_actor(lazy.name, namespace=trials.COLLECTOR_NAMESPACE)
    run = _run_dir(tmp_path / "node_b" / "sweep")
    config = {"name": "seed=0", "collector": lazy.name, "driver_node": "a node that is not this one"}
    started = []  # its handle kept: an actor whose handles are all gone is ended
    late = threading.Timer(1.0, lambda: started.append(start_collector(tmp_path / "sweep", lazy.name)[0]))
    late.start()
    try:
        assert bring_back(config, run, "ok") == "ok"  # it waited for the collector, then sent its run
        assert _files(tmp_path / "sweep" / "seed=0") == _files(run)
    finally:
        late.join()
        for actor in started:
            ray.kill(actor)


def test_only_the_run_s_own_directory_is_unpacked(tmp_path):
    here = tmp_path / "sweep"
    here.mkdir()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        data = b"x"
        info = tarfile.TarInfo("seed=0/../../escape.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    with pytest.raises(DPFLError, match="not that run's directory"):
        unpack_run(here, "seed=1", buf.getvalue())
    with pytest.raises(tarfile.FilterError):
        unpack_run(here, "seed=0", buf.getvalue())  # the name matches, the path leaves the sweep: tar's data filter
    assert not (tmp_path / "escape.txt").exists() and not (here / "seed=0").exists()


def test_a_sweep_whose_trials_never_get_their_resources_ends_and_says_what_they_waited_for(ray_session, tmp_path,
                                                                                          monkeypatch):
    """The sweep's one trial waits for a placement group the cluster cannot give it (here three GPUs
    of the two it has; on a shared cluster, what other jobs hold: Tune waits alike), none runs, and
    after RESOURCE_WAIT_SECONDS the sweep ends with the run "not run" (the next command runs it)
    instead of waiting forever."""
    from dpfl_ray.runtime import trials
    from dpfl_ray.runtime.shutdown import Shutdown

    monkeypatch.setattr(trials, "RESOURCE_WAIT_SECONDS", 3.0)
    config = {"name": "seed=0", "bundles": [{}, {"CPU": 1.0, "GPU": 3.0}], "rounds": 1}
    done: list = []
    started = time.monotonic()
    statuses = trials.run_trials(tmp_path / "sweep", [config], 1, Shutdown(),
                                 on_done=lambda c, status: done.append((c["name"], status)))
    assert time.monotonic() - started < 120
    assert statuses == dict(done) and set(statuses) == {"seed=0"}
    assert statuses["seed=0"].startswith("not run: waited 3 s for 1 CPU, 3 GPU that the cluster does not have (it has 2 GPU)")
    assert not (tmp_path / "sweep" / "seed=0").exists()


def test_a_trial_elsewhere_hands_its_releases_and_secret_to_the_sweep_node_for_the_next_attempt(
        ray_session, tmp_path, monkeypatch):
    """A private trial on node B lists each release and its 'os' secret on the sweep's node as it
    goes (privacy/reruns.py); Tune's next attempt, on node C after B is lost, starts from them."""
    from dpfl_ray.runs.record import DP_SECRET, read_releases

    here = tmp_path / "node_a" / "sweep"
    collector, name, _ = start_collector(here)
    config = {"name": "seed=0", "collector": name, "driver_node": "a node that is not this one"}
    try:
        assert trials._fetch_kept(config, tmp_path / "node_b" / "sweep" / "seed=0")
        assert not (tmp_path / "node_b" / "sweep" / "seed=0").exists()  # nothing kept: nothing written
        trials._ask_sweep_node(config, "give the secret to", "keep", None, bytes(range(32)))
        trials._ask_sweep_node(config, "list a release on", "keep", {
            "event": "release", "round": 1, "scenario_sha256": "a" * 64, "model": "m", "survivors": "s"})
        node_c = tmp_path / "node_c" / "sweep" / "seed=0"
        assert trials._fetch_kept(config, node_c)
        assert (node_c / DP_SECRET).read_bytes() == bytes(range(32))
        assert read_releases(node_c)[1] == {"round": 1, "scenario_sha256": "a" * 64, "model": "m", "survivors": "s"}
        (here / "seed=0" / "summary.json").write_text('{"stop_reason": "completed"}')
        assert not trials._fetch_kept(config, tmp_path / "node_d" / "sweep" / "seed=0")  # finished: nothing to run
    finally:
        ray.kill(collector)
    monkeypatch.setattr(trials, "COLLECTOR_WAIT_S", 1.0)
    with pytest.raises(DPFLError, match=r"^cannot ask what run seed=0 released before from the sweep's node \([^\n]*\)$"):
        trials._fetch_kept(config, tmp_path / "node_e" / "sweep" / "seed=0")
