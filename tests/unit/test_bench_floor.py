"""dpfl bench: the floor loop trains and takes the SGD steps the workload implies; the harness's
parsing and aggregation on synthetic inputs. No workload is run through Ray here."""
from __future__ import annotations

import math

import pytest

from benchmarks.floor import train_floor
from benchmarks.harness import classify, derive_phases, machine, parse_rounds, ratios, stats, summarize
from benchmarks.workloads import WORKLOADS, implied_sgd_steps, scenario, trained_clients
from dpfl_ray.data import build_federation
from dpfl_ray.errors import DPFLError
from dpfl_ray.privacy.client_sampling import sample_clients

FAST = ["model.name=logistic"]  # the same steps, on a model that trains in milliseconds


def test_every_workload_is_a_valid_scenario():
    for name in WORKLOADS:
        sc = scenario(name)
        assert sc.name == f"bench-{name}"
    w1, w2, w3, w4 = (scenario(n) for n in ("W1", "W2", "W3", "W4"))
    assert (w1.data.num_clients, w1.data.examples_per_client, w1.sampling.clients_per_round, w1.training.rounds,
            w1.model.name) == (100, 50, 10, 30, "cnn")
    assert (w2.data.num_clients, w2.data.examples_per_client, w2.sampling.clients_per_round, w2.training.rounds,
            w2.training.batch_size) == (1000, 5, 100, 10, 5)
    dp = scenario("W1-DP")
    assert (dp.training.algorithm, dp.privacy.clipping.norm, dp.privacy.noise_multiplier) == ("dp_fedavg", 0.5, 1.0)
    assert (w3.training.algorithm, w3.data.num_clients, w3.sampling.rate, w3.secagg.enabled,
            w3.privacy.calibration, w3.faults.dropouts[0].rate, w3.training.rounds) == ("baek", 500, 0.1, True,
                                                                                      "baek", 0.3, 10)
    assert (w4.data.num_clients, w4.sampling.clients_per_round, w4.training.rounds) == (100_000, 10_000, 3)
    assert math.ceil(w4.data.examples_per_client / w4.training.batch_size) * w4.training.local_epochs == 1
    with pytest.raises(DPFLError, match="unknown workload"):
        scenario("W9")
    # the warm and sweep variants run their base workload's scenario, another way
    from benchmarks.workloads import base_and_mode

    assert [base_and_mode(n) for n in ("W1", "W1-warm", "W2-warm", "S8")] == \
        [("W1", "cold"), ("W1", "warm"), ("W2", "warm"), ("W1", "sweep")]
    assert scenario("S8") == scenario("W1") and scenario("W2-warm") == w2


def test_floor_trains_and_counts_the_implied_steps():
    sc = scenario("W1", FAST + ["training.rounds=6"])
    fed = build_federation(sc)
    out = train_floor(sc, fed)
    assert out["sgd_steps"] == implied_sgd_steps(sc, fed.sizes) == 6 * 10 * 5
    assert out["client_updates"] == 60
    losses = out["round_mean_loss"]
    assert losses[-1] < 0.8 * losses[0]


def test_floor_evaluates_after_the_rounds_dpfl_evaluates():
    """Like for like (issue #35): the coordinator evaluates round t when (t + 1) % eval_every == 0
    and after the last round; so does the floor, on the same test split."""
    from dpfl_ray.training.models import build_model, evaluate

    sc = scenario("W1", FAST + ["training.rounds=7", "output.eval_every=3"])
    fed = build_federation(sc)
    out = train_floor(sc, fed)
    assert sorted(out["test_accuracy"]) == [3, 6, 7]
    assert 0 < out["eval_seconds"] < out["train_seconds"]
    assert out["train_seconds_without_eval"] == pytest.approx(out["train_seconds"] - out["eval_seconds"], abs=1e-3)
    untrained = build_model(sc.model, fed.dataset.input_shape, fed.dataset.num_classes, sc.seed)
    chance, _ = evaluate(untrained, fed.dataset.x_test, fed.dataset.y_test)
    assert out["test_accuracy"][7] > chance + 0.2  # the evaluated model is the trained one


@pytest.mark.parametrize("name, overrides", [
    ("W2", ["training.rounds=2"]),
    ("W3", ["training.rounds=2"]),  # Poisson cohorts; the upload dropouts have trained
    ("W1", ["training.rounds=2", "faults.dropout.model=tail", "faults.dropout.rate=0.3",
            "faults.dropout.phase=training"]),
])
def test_floor_steps_follow_sampling_and_training_dropouts(name, overrides):
    sc = scenario(name, FAST + overrides)
    fed = build_federation(sc)
    out = train_floor(sc, fed)
    per_client = sc.training.local_epochs * math.ceil(sc.data.examples_per_client / sc.training.batch_size)
    trained = [trained_clients(sc, t) for t in range(sc.training.rounds)]
    assert out["sgd_steps"] == implied_sgd_steps(sc, fed.sizes) == per_client * sum(map(len, trained))
    if name == "W1":
        assert all(len(t) == 7 for t in trained)  # 3 of 10 drop before training
    if name == "W3":  # Poisson cohorts, and every sampled client trains before it drops at upload
        sampled = [sample_clients(sc.sampling, sc.data.num_clients, sc.seed, t) for t in range(2)]
        assert [len(t) for t in trained] == [len(s) for s in sampled] and len(sampled[0]) != len(sampled[1])


def test_stats_and_summaries():
    assert stats([3.0, 1.0, 2.0, None]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert stats([None]) is None
    samples = [{"train_seconds": 2.0, "peak_rss_bytes": {"driver": 100, "workers": 300}, "phases_derived": True},
               {"train_seconds": 4.0, "peak_rss_bytes": {"driver": 200, "workers": 100}},
               {"train_seconds": 3.0, "peak_rss_bytes": {"driver": 150, "workers": 200}, "rc": 0}]
    s = summarize(samples)
    assert s["train_seconds"] == {"median": 3.0, "min": 2.0, "max": 4.0, "n": 3}
    assert s["peak_rss_bytes.workers"]["max"] == 300 and s["peak_rss_bytes.driver"]["median"] == 150
    assert "phases_derived" not in s  # booleans are not measurements
    floor = summarize([{"train_seconds": 6.0, "process_seconds": 10.0}, {"train_seconds": 8.0, "process_seconds": 12.0}])
    r = ratios({**s, "process_seconds": stats([13.0])}, floor)
    assert r == {"train": pytest.approx(3.0 / 7.0), "process": pytest.approx(13.0 / 11.0), "train_without_eval": None}
    r = ratios({**s, "train_seconds_without_eval": stats([1.4])}, floor)
    assert r["train_without_eval"] == pytest.approx(1.4 / 7.0)  # against the floor's training, which has no eval
    assert ratios(s, {})["train"] is None


def test_parse_rounds_counts_trained_clients_and_the_secagg_share():
    rounds = [
        {"round": 1, "sampled": 50, "dropped_by_phase": {"training": 5, "upload": 10}, "seconds": 2.0,
         "secagg_seconds": {"advertise": 1.0, "share": 0.25, "masked_input": 0.25, "unmask": 0.5}},
        {"round": 2, "sampled": 40, "dropped_by_phase": {}, "seconds": 2.0,
         "secagg_seconds": {"advertise": 0.5, "reconstruct": 0.5}},
    ]
    out = parse_rounds(rounds)
    assert out["train_seconds"] == 4.0 and out["client_updates"] == 85 and out["rounds"] == 2
    assert out["updates_per_second"] == pytest.approx(85 / 4.0)
    assert out["secagg_seconds"] == pytest.approx(1.5) and out["secagg_share"] == pytest.approx(1.5 / 4.0)
    assert out["advertise_seconds"] == pytest.approx(1.5)
    plain = parse_rounds([{"sampled": 10, "seconds": 0.5}])
    assert "secagg_share" not in plain and plain["client_updates"] == 10
    assert parse_rounds([])["updates_per_second"] is None
    timed = parse_rounds([{"sampled": 10, "seconds": 0.5, "eval_seconds": 0.2}, {"sampled": 10, "seconds": 0.5}])
    assert timed["eval_seconds"] == pytest.approx(0.2) and timed["train_seconds_without_eval"] == pytest.approx(0.8)
    assert "account_seconds" not in timed
    booked = parse_rounds([{"sampled": 10, "seconds": 0.5, "account_seconds": 0.15}, {"sampled": 10, "seconds": 0.5}])
    assert booked["account_seconds"] == pytest.approx(0.15) and "listing_seconds" not in booked
    listed = parse_rounds([{"sampled": 10, "seconds": 0.5, "listing_seconds": 0.01}, {"sampled": 10, "seconds": 0.5,
                                                                                     "listing_seconds": 0.005}])
    assert listed["listing_seconds"] == pytest.approx(0.015)
    assert "worker_seconds" not in booked
    worked = parse_rounds([{"sampled": 10, "seconds": 0.5, "worker_seconds": 0.3}, {"sampled": 10, "seconds": 0.5,
                                                                                    "worker_seconds": 0.25}])
    assert worked["worker_seconds"] == pytest.approx(0.55)


def test_phases_from_timestamps_and_from_file_times():
    ts = {"ray_init_start": 102.0, "ray_init_end": 105.0, "pool_start": 105.5, "pool_ready": 108.0,
          "first_round_start": 108.2, "last_round_end": 111.2, "finish_end": 112.0}
    exact = derive_phases(100.0, 113.5, 3.0, timestamps=ts)
    assert exact["phases_derived"] is False
    assert exact["process_seconds"] == 13.5 and exact["imports_and_data_seconds"] == 2.0
    assert exact["ray_startup_seconds"] == 3.0 and exact["worker_startup_seconds"] == 2.5
    assert exact["training_span_seconds"] == pytest.approx(3.0)
    assert exact["finish_seconds"] == pytest.approx(0.8) and exact["teardown_seconds"] == pytest.approx(1.5)
    derived = derive_phases(100.0, 113.5, 3.0, ray_start=102.0, run_start=105.0, last_round_written=111.5,
                            finish_end=112.0)
    assert derived["phases_derived"] is True
    assert derived["ray_startup_seconds"] == 3.0
    assert derived["worker_startup_seconds"] == pytest.approx(3.5)  # up to the first round's start
    assert derived["finish_seconds"] == pytest.approx(0.5) and derived["teardown_seconds"] == pytest.approx(1.5)
    missing = derive_phases(100.0, 101.0, 0.0)
    assert missing["ray_startup_seconds"] is None and missing["process_seconds"] == 1.0


def test_processes_are_classified_by_role():
    assert classify("python -m cli.main run x.yaml", True) == "driver"
    assert classify("python -m benchmarks.floor W1", True, "floor") == "floor"
    assert classify("ray::Coordinator.run", False) == "coordinator"
    assert classify("ray::ClientWorker.run_clients", False) == "workers"
    assert classify("ray::IDLE", False) is None
    assert classify("python /venv/lib/ray/_private/workers/default_worker.py --node-ip-address=1", False) is None
    assert classify("", False) is None  # exiting: keeps the role it had
    assert classify("ray::DashboardAgent", False) == "ray_system"
    # the raylet's own arguments name default_worker.py and ray:: things; it is still a daemon
    assert classify("/venv/ray/raylet/raylet --python_worker_command=python default_worker.py ray::x", False) \
        == "ray_system"


def test_batched_shares_take_the_floors_steps_between_them():
    sc = scenario("W2", FAST + ["training.rounds=2"])
    fed = build_federation(sc)
    whole = train_floor(sc, fed)
    halves = [train_floor(sc, fed, share=(i, 2), batched=True) for i in range(2)]
    assert sum(h["sgd_steps"] for h in halves) == whole["sgd_steps"] == implied_sgd_steps(sc, fed.sizes)
    assert sum(h["client_updates"] for h in halves) == whole["client_updates"] == 200


def test_a_report_names_its_host_and_how_fast_one_thread_of_it_is():
    """Two hosts of one model name differ severalfold (benchmarks/RESULTS.md): a report carries the
    CPU's model and a one-thread probe, and the probe leaves torch's thread count as it found it."""
    import torch

    before = torch.get_num_threads()
    m = machine()
    assert torch.get_num_threads() == before
    assert isinstance(m["cpu_model"], str) and m["cpu_model"]
    assert set(m["probe"]) == {"python_loop_s", "torch_matmul_s"}
    assert all(0 < v < 60 for v in m["probe"].values()), m["probe"]


def _interrupt_the_bench_once(child: str, ready, log) -> None:
    """The harness times ``child`` (Python code) and is interrupted (KeyboardInterrupt, as Ctrl-C)
    once ``ready()`` says the child is under way: the alarm repeats every 0.5 s until then."""
    import signal
    import sys

    from benchmarks.harness import _run_tree

    def interrupt(*_):
        if ready():
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.5, 0.5)
    try:
        with pytest.raises(KeyboardInterrupt):
            _run_tree([sys.executable, "-c", child], 60, "driver", log)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_an_interrupted_bench_ends_the_run_it_was_timing(tmp_path):
    """Each timed run has a session of its own, so Ctrl-C at the terminal never reaches it: the
    harness ends it (and every process under it) before the interrupt goes on."""
    import psutil

    pids = tmp_path / "pids"
    child = ("import os, subprocess, sys, time; g = subprocess.Popen([sys.executable, '-c', 'import time; "
             f"time.sleep(60)']); open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{g.pid}}'); time.sleep(60)")
    # once the run has started the process it starts
    _interrupt_the_bench_once(child, lambda: pids.exists() and len(pids.read_text().split()) == 2, tmp_path / "log")

    def running(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:  # gone
            return False

    started = [int(pid) for pid in pids.read_text().split()]  # the run and the process it started
    assert len(started) == 2
    _, alive = psutil.wait_procs([psutil.Process(pid) for pid in started if running(pid)], timeout=5)  # SIGKILL lands
    assert not any(running(p.pid) for p in alive)


def test_an_interrupted_bench_lets_the_run_stop_by_itself_first(tmp_path):
    """SIGTERM before SIGKILL: the `dpfl run` a bench times writes its summary.json on SIGTERM, as for
    a user (a bench stopped with Ctrl-C left a run directory without one)."""
    ready, stopped = tmp_path / "ready", tmp_path / "stopped"
    child = ("import signal, sys, time\n"
             f"def stop(*_):\n    open({str(stopped)!r}, 'w').write('summary'); sys.exit(143)\n"
             f"signal.signal(signal.SIGTERM, stop); open({str(ready)!r}, 'w').close(); time.sleep(60)\n")
    _interrupt_the_bench_once(child, ready.exists, tmp_path / "log")
    assert stopped.read_text() == "summary"


def test_a_bench_stopped_by_sigterm_exits_143_as_a_run_does():
    """cli.common.interrupt turns SIGTERM into a KeyboardInterrupt named after it; the exit code is
    128 + that signal (a bench exited 130 where `dpfl run` exits 143); Ctrl-C stays 130."""
    import click

    from cli.main import _interrupted_code

    assert _interrupted_code(KeyboardInterrupt("SIGTERM")) == 143
    assert _interrupted_code(KeyboardInterrupt("SIGINT")) == 130
    assert _interrupted_code(KeyboardInterrupt()) == 130
    assert _interrupted_code(KeyboardInterrupt("signal received earlier")) == 130
    assert _interrupted_code(click.exceptions.Abort()) == 130
