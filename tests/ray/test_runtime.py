"""The Ray shell on a real local Ray: pool placement, a short run, dropouts, determinism."""
import json

import pytest
import torch

from dpfl_ray.data import build_federation
from dpfl_ray.runs.record import RunRecord
from dpfl_ray.runtime.coordinator import make_coordinator
from dpfl_ray.runtime.driver import put_federation, run_scenario
from tests.helpers import TWO_WORKERS, tiny_scenario


def _run(sc, tmp_path, name):
    fed = build_federation(sc)
    record = RunRecord(tmp_path / name)
    summary = run_scenario(sc, fed, record)
    rounds = [json.loads(line) for line in (tmp_path / name / "rounds.jsonl").read_text().splitlines()]
    return summary, rounds, torch.load(tmp_path / name / "model.pt")


def test_fractional_gpus_pack_two_workers_per_gpu(ray_session):
    # "auto" fills the session's two declared GPUs; a quarter GPU each (eight worker processes)
    # tests nothing more than a half and costs four more torch imports
    sc = tiny_scenario(resources={"workers": "auto", "num_cpus_per_worker": 0, "num_gpus_per_worker": 0.5})
    coord = make_coordinator(sc, put_federation(build_federation(sc)))
    infos = ray_session.get(coord.start_pool.remote())
    assert len(infos) == 4
    gpu_ids = sorted(g for info in infos for g in info["gpu_ids"])
    assert gpu_ids == ["0"] * 2 + ["1"] * 2
    ray_session.kill(coord)


@pytest.fixture(scope="module")
def one_worker_run(ray_session, tmp_path_factory):
    """tiny_scenario() as it is, on one worker: the files test reads it, the pool test compares with it."""
    tmp = tmp_path_factory.mktemp("one_worker")
    return (*_run(tiny_scenario(), tmp, "run"), tmp / "run")


def test_three_round_run_writes_every_file(one_worker_run):
    summary, rounds, state, run_dir = one_worker_run
    assert summary["stop_reason"] == "completed" and summary["rounds_completed"] == 3
    assert [r["round"] for r in rounds] == [1, 2, 3]
    assert all(r["sampled"] == 10 and r["survived"] == 10 for r in rounds)
    assert rounds[-1]["test_accuracy"] > 0.5  # 3 Gaussian blobs: well above chance (1/3)
    for name in ("scenario.yaml", "summary.json", "model.pt", "accuracy.png"):
        assert (run_dir / name).stat().st_size > 0
    assert set(state) and all(isinstance(v, torch.Tensor) for v in state.values())
    # where the time went (issue #14): marks in order, and each evaluated round's evaluation time
    marks = summary["timings"]
    order = ["data_in_object_store_seconds", "actors_requested_seconds", "first_round_committed_seconds",
             "last_round_committed_seconds", "files_written_seconds"]
    assert [marks[k] for k in order] == sorted(marks[k] for k in order)
    # plain FedAvg evaluates a round inside the next round's training calls (Coordinator._settle), the
    # last round inside its own: the evaluation is timed within the round that carried it
    carried_by = [rounds[i + 1] for i in range(len(rounds) - 1)] + [rounds[-1]]
    assert all(0 < r["eval_seconds"] < carrier["seconds"] for r, carrier in zip(rounds, carried_by))
    # and the slowest worker's own compute, inside the round and apart from the evaluation it carried
    carried = [0.0] + [r["eval_seconds"] for r in rounds[:-1]]
    carried[-1] += rounds[-1]["eval_seconds"]
    assert all(0 < r["worker_seconds"] < r["seconds"] - c for r, c in zip(rounds, carried))


class _Holder:
    def ready(self) -> bool:
        return True


def test_a_pool_that_waits_for_cpus_has_its_initial_model_built_by_the_driver(ray_session, one_worker_run, tmp_path,
                                                                               monkeypatch):
    """Workers that cannot start yet (another driver holds every CPU) would hold the coordinator's
    first reply if it waited for one of them to build the initial model: the driver builds it, and
    the run goes on once the CPUs are free, to the same bits as a run whose worker built it."""
    import threading

    from dpfl_ray.runtime import driver, warm
    from dpfl_ray.training import models

    built_here, starting = [], []
    initial_theta, start_workers = models.initial_theta, driver.start_workers
    monkeypatch.setattr(models, "initial_theta", lambda *a: built_here.append(a) or initial_theta(*a))

    def start_then_free(*args):
        pool, shape, now = start_workers(*args)
        starting.append(now)
        threading.Timer(1.0, ray_session.kill, [hold]).start()  # the CPUs come free while the run waits
        return pool, shape, now

    monkeypatch.setattr(driver, "start_workers", start_then_free)
    warm.clear()  # this process's parked workers hold CPUs too
    hold = ray_session.remote(num_cpus=2)(_Holder).remote()
    assert ray_session.get(hold.ready.remote(), timeout=60)
    summary, rounds, state = _run(tiny_scenario(), tmp_path, "waited")
    _, reference_rounds, reference_state, _ = one_worker_run

    def untimed(rows):
        return [{k: v for k, v in r.items() if "seconds" not in k} for r in rows]

    assert starting == [False] and len(built_here) == 1  # by this driver (the reference run's worker built its own)
    assert summary["stop_reason"] == "completed" and untimed(rounds) == untimed(reference_rounds)
    assert all(torch.equal(state[k], reference_state[k]) for k in reference_state)


def test_a_round_evaluated_inside_the_next_rounds_calls_has_its_own_models_figures(one_worker_run, tmp_path):
    """Round t's model is evaluated by the workers at the start of round t+1's training calls (no
    call of its own); its row must hold what evaluating round t's model gives. A 2-round run
    evaluates its round 2 at once (a last round has no next one): the 3-round run's round 2 agrees
    to the bit, and every row reaches rounds.jsonl in order, with its evaluation time."""
    _, rounds_3, _, _ = one_worker_run
    _, rounds_2, _ = _run(tiny_scenario(training={"rounds": 2}), tmp_path, "two")
    assert [r["round"] for r in rounds_3] == [1, 2, 3]
    for key in ("test_accuracy", "test_loss"):
        assert rounds_3[1][key] == rounds_2[1][key] and rounds_3[0][key] == rounds_2[0][key]
    assert all(r["eval_seconds"] > 0 for r in rounds_3)


def test_a_round_that_is_not_evaluated_has_no_accuracy_of_its_own(one_worker_run, tmp_path):
    """output.eval_every: 2 over 4 rounds evaluates rounds 2 and 4: rows 1 and 3 hold no accuracy
    and no loss, not round 2's carried into round 3. Round 2's figures are its own model's: the
    every-round run's, to the bit; the summary's are round 4's."""
    _, rounds_3, _, _ = one_worker_run
    summary, rows, _ = _run(tiny_scenario(training={"rounds": 4}, output={"eval_every": 2}), tmp_path, "every2")
    assert [(r["round"], r["test_accuracy"] is None, r["test_loss"] is None) for r in rows] == [
        (1, True, True), (2, False, False), (3, True, True), (4, False, False)]
    assert (rows[1]["test_accuracy"], rows[1]["test_loss"]) == (rounds_3[1]["test_accuracy"], rounds_3[1]["test_loss"])
    assert (summary["final_accuracy"], summary["final_loss"]) == (rows[3]["test_accuracy"], rows[3]["test_loss"])
    assert "final_evaluated_round" not in summary  # the last round was evaluated: its figures are model.pt's


def test_tail_dropout_leaves_seven_of_ten(ray_session, tmp_path):
    sc = tiny_scenario(faults={"dropout": {"model": "tail", "rate": 0.3, "phase": "upload"}})
    _, rounds, _ = _run(sc, tmp_path, "drop")
    assert all(r["survived"] == 7 and r["dropped_by_phase"] == {"upload": 3} for r in rounds)
    assert rounds[-1]["test_accuracy"] > 0.5


def test_same_seed_same_model_for_any_pool_size(one_worker_run, tmp_path):
    def flat(state):
        return torch.cat([v.flatten() for v in state.values()])

    _, rounds_1, state_1, _ = one_worker_run
    # three workers, which cannot split the ten clients of a round evenly, against one
    _, rounds_3, state_3 = _run(tiny_scenario(resources={"workers": 3, "num_cpus_per_worker": 0.5}), tmp_path, "w3")
    # separate runs agree to the bit, so a run also repeats itself
    assert [r["test_accuracy"] for r in rounds_3] == [r["test_accuracy"] for r in rounds_1]
    assert torch.equal(flat(state_3), flat(state_1))
    _, _, state = _run(tiny_scenario(seed=4), tmp_path, "seed4")
    assert not torch.equal(flat(state), flat(state_1))


def test_the_cnn_gives_the_same_model_on_one_worker_and_on_three_half_cpu_workers(ray_session, tmp_path):
    """The run-level form of the batch-invariance promise, on the model whose stacked kernels
    depend on the stack on some CPUs: ten equal clients a round split 10 / 4+3+3 over the pools,
    so stacks of 3 (the size oneDNN's AVX2 kernels treat apart) meet stacks of 10 and 4. Every worker
    has the same half CPU (a worker's torch threads are fixed, not its CPUs'): the second run takes
    the first's parked worker and starts two."""
    def cnn(resources):
        return tiny_scenario(data={"source": "mnist5k", "num_clients": 20, "examples_per_client": 10},
                             model={"name": "cnn"}, training={"rounds": 2, "batch_size": 5, "lr": 0.1},
                             resources=resources)

    summary_1, _, state_1 = _run(cnn({"workers": 1, "num_cpus_per_worker": 0.5}), tmp_path, "w1")
    summary_3, _, state_3 = _run(cnn({"workers": 3, "num_cpus_per_worker": 0.5}), tmp_path, "w3")
    assert all(torch.equal(state_1[k], state_3[k]) for k in state_1)
    for summary in (summary_1, summary_3):  # what each host had to pad is on record
        padding = summary["placement"]["stack_padding"]
        assert isinstance(padding, dict) and all(int(v) == 0 or int(v) > int(k) for k, v in padding.items())


def test_a_crashed_worker_counts_as_dropouts_and_is_replaced(ray_session):
    sc = tiny_scenario(training={"rounds": 2}, resources=TWO_WORKERS)
    coord = make_coordinator(sc, put_federation(build_federation(sc)))
    ray_session.get(coord.start_pool.remote())
    pids = [i["pid"] for i in ray_session.get(coord.worker_info.remote())]
    victim = ray_session.get(coord.worker_handle.remote(0))
    ray_session.kill(victim)
    with pytest.raises(ray_session.exceptions.RayActorError):  # dead before the first round, not during it
        ray_session.get(victim.info.remote(), timeout=60)
    ray_session.get(coord.run.remote())
    rounds = [e for e in ray_session.get(coord.events.remote(0)) if e["event"] == "round"]
    crashed = rounds[0]["dropped"]["crash"]["training"]
    assert crashed > 0 and sorted(rounds[0]["dropped_clients"]["crash"]) == rounds[0]["dropped_clients"]["crash"]
    assert rounds[0]["survived"] == 10 - crashed
    assert rounds[1]["survived"] == 10  # the replacement worker serves round 2
    assert len(set(pids) & {i["pid"] for i in ray_session.get(coord.worker_info.remote())}) == 1
    # The coordinator leaves training and evaluation to the pool and never loads torch (a second
    # of CPU at every start); with no pool left it evaluates by itself, to the same figures.
    has_torch = lambda self: __import__("sys").modules.get("torch") is not None  # noqa: E731
    assert ray_session.get(coord.__ray_call__.remote(has_torch)) is False
    for i in range(2):
        worker = ray_session.get(coord.worker_handle.remote(i))
        ray_session.kill(worker)
        with pytest.raises(ray_session.exceptions.RayActorError):  # dead before the coordinator evaluates
            ray_session.get(worker.info.remote(), timeout=60)
    alone = ray_session.get(coord.__ray_call__.remote(lambda self: self._evaluate(self.theta)), timeout=120)
    assert alone == (rounds[-1]["test_accuracy"], rounds[-1]["test_loss"])
    assert ray_session.get(coord.__ray_call__.remote(has_torch)) is True
    ray_session.kill(coord)


def test_a_row_that_cannot_be_written_still_leaves_a_summary(ray_session, tmp_path, monkeypatch):
    """An OSError writing rounds.jsonl (a full disk, a vanished mount) used to escape the driver's
    loop and skip the summary. Now the run stops between rounds, writes what it can -- every row
    once, in order -- and the summary says why."""
    from dpfl_ray.errors import DPFLError

    calls = {"n": 0}
    real = RunRecord.add_round

    def fails_once(self, row):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(28, "No space left on device")
        real(self, row)

    monkeypatch.setattr(RunRecord, "add_round", fails_once)
    sc = tiny_scenario(training={"rounds": 8})
    with pytest.raises(DPFLError, match="No space left on device"):
        run_scenario(sc, build_federation(sc), RunRecord(tmp_path / "run"))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    rows = [json.loads(line) for line in (tmp_path / "run" / "rounds.jsonl").read_text().splitlines()]
    assert summary["stop_reason"] == "error" and "OSError" in summary["error"]
    assert [r["round"] for r in rows] == list(range(1, len(rows) + 1))
    assert summary["rounds_completed"] == len(rows) >= 2
    assert (tmp_path / "run" / "model.pt").stat().st_size > 0


def test_a_warm_worker_trains_as_a_fresh_one(ray_session, tmp_path):
    """runtime/warm.py: the workers of a clean run serve the driver's next run of the same shape,
    rebound; a run on rebound workers that served another model meanwhile is bitwise the fresh run."""
    from dpfl_ray.runtime import warm

    def cnn():
        return tiny_scenario(data={"source": "mnist5k", "num_clients": 20, "examples_per_client": 10},
                             model={"name": "cnn"}, training={"rounds": 2, "batch_size": 5, "lr": 0.1})

    def parked():
        return sorted(h._actor_id.hex() for handles in warm._parked.values() for h in handles)

    warm.clear()
    _, rounds_fresh, fresh = _run(cnn(), tmp_path, "fresh")
    first = parked()
    assert len(first) == 1  # the run's one worker, kept
    _run(tiny_scenario(model={"name": "mlp", "hidden": [16]}), tmp_path, "other")
    assert parked() == first  # the same process served the other run
    _, rounds_warm, again = _run(cnn(), tmp_path, "warm")
    assert parked() == first
    assert [r["test_accuracy"] for r in rounds_warm] == [r["test_accuracy"] for r in rounds_fresh]
    assert all(torch.equal(fresh[k], again[k]) for k in fresh)
    warm.clear()
    assert parked() == []


def test_a_parked_coordinator_runs_the_next_run_as_a_fresh_one(ray_session, tmp_path):
    """runtime/warm.py: the coordinator of a clean run serves the driver's next run, rebound; after
    serving a run of another algorithm (SecAgg, its own accountant), it gives a private run the
    fresh coordinator's model, rows and ledger to the bit."""
    from dpfl_ray.runtime import warm

    def private():
        return tiny_scenario(training={"algorithm": "dp_fedavg", "rounds": 3},
                             sampling={"mode": "poisson", "rate": 0.3, "clients_per_round": None},
                             privacy={"target_epsilon": 4.0, "accountant": "rdp", "clipping": {"norm": 0.5}})

    def parked():
        return [h._actor_id.hex() for h in warm._coordinators.values()]

    def figures(rows):
        return [{k: v for k, v in r.items() if not k.endswith("seconds")} for r in rows]

    warm.clear()
    fresh_summary, rounds_fresh, fresh = _run(private(), tmp_path, "fresh")
    (first,) = parked()
    other = tiny_scenario(training={"algorithm": "baek", "rounds": 2},
                          sampling={"mode": "poisson", "rate": 0.5, "clients_per_round": None},
                          privacy={"noise_multiplier": 1.0, "accountant": "pld", "clipping": {"norm": 0.5}},
                          secagg={"enabled": True})
    assert _run(other, tmp_path, "other")[0]["rounds_completed"] == 2
    assert parked() == [first]  # the same process served the other run
    warm_summary, rounds_warm, again = _run(private(), tmp_path, "warm")
    assert parked() == [first]
    assert figures(rounds_warm) == figures(rounds_fresh)
    assert all(torch.equal(fresh[k], again[k]) for k in fresh)
    assert (tmp_path / "warm" / "ledger.json").read_bytes() == (tmp_path / "fresh" / "ledger.json").read_bytes()
    assert warm_summary["epsilon"] == fresh_summary["epsilon"] and warm_summary["noise_multiplier"] == \
        fresh_summary["noise_multiplier"]
    # one that died while parked is not handed over: the next run starts a fresh coordinator
    ray_session.kill(next(iter(warm._coordinators.values())))
    _, rounds_after, after = _run(private(), tmp_path, "after_death")
    assert figures(rounds_after) == figures(rounds_fresh) and all(torch.equal(fresh[k], after[k]) for k in fresh)
    assert len(parked()) == 1 and parked() != [first]
    warm.clear()
    assert parked() == []


def test_a_coordinator_killed_mid_run_leaves_its_checkpoint_and_the_resume_ends_as_an_uninterrupted_run(
        ray_session, tmp_path, monkeypatch):
    """README, "Faults, deadlines, checkpoints and sweeps": a run whose coordinator actor is killed
    mid-run ends with the files of its last checkpoint and the --resume command, and the resume
    ends with the uninterrupted run's model, ledger and rows (timings aside). Under
    privacy.randomness: os, the harder case (tests/e2e/test_resume.py resumes a reproducible run): the
    rounds after the checkpoint, which the server may have seen, are run again with the noise and
    client sample they had, from the secret the run keeps until it completes; here both runs are
    given one secret, so the resumed run must end as the uninterrupted one did."""
    from dpfl_ray.errors import DPFLError
    from dpfl_ray.runtime import driver, warm
    from dpfl_ray.runtime.checkpoint import DP_SECRET, open_for_resume, rows_covered

    def private():
        # The driver reads the rows polls behind the coordinator, so the kill after its first
        # checkpoint must land before the run's end even on a loaded machine: rounds to spare, each
        # held back 0.1 s by a straggler (a sleep, which leaves the CPU to the driver; no deadline, so
        # the figures are those of a run without it).
        return tiny_scenario(training={"algorithm": "dp_fedavg", "rounds": 40},
                             sampling={"mode": "poisson", "rate": 0.3, "clients_per_round": None},
                             privacy={"noise_multiplier": 1.0, "accountant": "rdp", "clipping": {"norm": 0.5},
                                      "randomness": "os"},
                             faults={"stragglers": {"tiers": [{"share": 1.0, "latency": {"distribution": "fixed",
                                                                                         "seconds": 0.1}}]}},
                             output={"checkpoint_every": 5, "eval_every": 5})

    def figures(rows):
        return [{k: v for k, v in r.items() if not k.endswith("seconds")} for r in rows]

    secret = bytes(range(7, 39))

    def record(path):  # the secret run_secret would have drawn: both runs draw from this one
        made = RunRecord(path)
        (path / DP_SECRET).write_bytes(secret)
        return made

    sc = private()
    run_scenario(sc, build_federation(sc), record(tmp_path / "fresh"))
    rounds_fresh = [json.loads(line) for line in (tmp_path / "fresh" / "rounds.jsonl").read_text().splitlines()]
    fresh = torch.load(tmp_path / "fresh" / "model.pt")
    assert not (tmp_path / "fresh" / DP_SECRET).exists()  # a completed run is never resumed: the secret goes
    warm.clear()  # the run below starts a coordinator of its own, which the test kills
    started = []
    start = driver.start_coordinator
    monkeypatch.setattr(driver, "start_coordinator", lambda args: started.append(start(args)) or started[-1])
    take_checkpoint, kills = driver._checkpoint, []

    def kill_after_the_first_checkpoint(*args):
        out = take_checkpoint(*args)
        if started and not kills:  # the moment its first checkpoint is on disk; the resume's goes on
            kills.append(started.pop())
            ray_session.kill(kills[-1])
        return out

    monkeypatch.setattr(driver, "_checkpoint", kill_after_the_first_checkpoint)
    killed = tmp_path / "killed"
    sc = private()
    with pytest.raises(DPFLError, match=r"the coordinator was lost .* resume with: dpfl run --resume "):
        run_scenario(sc, build_federation(sc), record(killed))
    assert (killed / DP_SECRET).read_bytes() == secret
    checkpoint, again = open_for_resume(killed)
    last = int(checkpoint["round"])
    summary = json.loads((killed / "summary.json").read_text())
    assert summary["stop_reason"] == "error" and 5 <= summary["rounds_completed"] == last < 40
    # the rows are cut back to the checkpoint's round (its row evaluated by the driver where the round
    # still awaited its evaluation), with the uninterrupted run's figures
    rows = [json.loads(line) for line in (killed / "rounds.jsonl").read_text().splitlines()]
    assert figures(rows) == figures(rounds_fresh[:last])
    covered = rows_covered(checkpoint)
    resumed = run_scenario(again, build_federation(again), RunRecord.reopen(killed, covered), resume=checkpoint)
    assert resumed["stop_reason"] == "completed" and resumed["rounds_completed"] == 40
    assert not (killed / DP_SECRET).exists()
    rows = [json.loads(line) for line in (killed / "rounds.jsonl").read_text().splitlines()]
    assert figures(rows) == figures(rounds_fresh)
    after = torch.load(killed / "model.pt")
    assert all(torch.equal(fresh[k], after[k]) for k in fresh)
    assert (killed / "ledger.json").read_bytes() == (tmp_path / "fresh" / "ledger.json").read_bytes()
    warm.clear()
