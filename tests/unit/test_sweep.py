"""Sweeps (dpfl_ray.runs.sweep): grid expansion, validation before anything runs, resume, sweep.csv and
the plots, from run directories written by hand. No Ray, no subprocess."""
import csv
import json
import pickle
from pathlib import Path

import pytest
import yaml

from dpfl_ray.runs import sweep as sw
from dpfl_ray.errors import DPFLError

TINY = {"name": "tiny", "seed": 1, "data": {"source": "synthetic", "num_clients": 12},
        "model": {"name": "logistic"}, "training": {"rounds": 3},
        "sampling": {"mode": "fixed", "clients_per_round": 6}}


@pytest.fixture
def scenario(tmp_path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY))
    return path


def test_grid_values_keep_brackets_and_order():
    assert sw.split_values("0, 0.1,[1,2],{a: 1, b: 2}") == ["0", "0.1", "[1,2]", "{a: 1, b: 2}"]
    assert sw.parse_grid(["b.x=1,2", "a.y=none,baek"]) == {"b.x": ["1", "2"], "a.y": ["none", "baek"]}
    assert sw.parse_seeds("0,1, 2") == [0, 1, 2] and sw.parse_seeds(None) is None


@pytest.mark.parametrize("items, needle", [
    (["faults.dropout.rate"], "must look like key.path=value1,value2"),
    (["=1,2"], "must look like"),
    (["a.b=1,,2"], "a.b has an empty value"),
    (["a.b="], "a.b has an empty value"),
    (["a.b=1,1"], "lists one value twice"),
    (["a.b=1", "a.b=2"], "a.b is given twice"),
    (["seed=1,2"], "--seeds"),
])
def test_bad_grids_are_one_line(items, needle):
    with pytest.raises(DPFLError, match="--grid") as err:
        sw.parse_grid(items)
    assert needle in str(err.value)


def test_bad_seeds():
    with pytest.raises(DPFLError, match="--seeds: expected integers"):
        sw.parse_seeds("0,x")
    with pytest.raises(DPFLError, match="listed twice"):
        sw.parse_seeds("1,1")


def test_expand_is_the_product_seeds_outermost():
    grid = {"faults.dropout.rate": ["0", "0.3"], "privacy.calibration": ["none", "baek", "layered"]}
    runs = sw.expand(grid, [0, 1], ["training.rounds=2"])
    assert len(runs) == 12 and len({r.name for r in runs}) == 12
    assert [r.seed for r in runs] == [0] * 6 + [1] * 6
    first = runs[0]
    assert first.name == "faults.dropout.rate=0__privacy.calibration=none__seed=0"
    assert first.overrides == ("training.rounds=2", "faults.dropout.rate=0", "privacy.calibration=none", "seed=0")
    assert dict(runs[5].values) == {"faults.dropout.rate": "0.3", "privacy.calibration": "layered"}
    # no seeds: the scenario's own, and no seed in the names
    assert [r.name for r in sw.expand({"a.b": ["1"]}, None)] == ["a.b=1"]
    assert sw.expand({}, None)[0].overrides == ()  # no grid at all: the scenario once


def test_expand_refuses_clashes():
    with pytest.raises(DPFLError, match="--grid: a.b is also given with --set"):
        sw.expand({"a.b": ["1"]}, None, ["a.b=2"])
    with pytest.raises(DPFLError, match="--seeds"):
        sw.expand({}, [1], ["seed=3"])
    with pytest.raises(DPFLError, match="share a directory name"):
        sw.expand({"x.y": ["a/b", "a_b"]}, None)


def test_every_combination_is_validated_before_anything_runs(scenario):
    ok = sw.expand({"faults.dropout.rate": ["0", "0.5"], "faults.dropout.model": ["tail"]}, [0, 1])
    sw.validate(scenario, ok)
    for grid, needle in (({"faults.dropout.rat": ["0"]}, "faults.dropout.rat: unknown key"),
                         ({"faults.dropout.rate": ["0", "1.5"]}, "faults.dropout.rate"),
                         ({"sampling.clients_per_round": ["6", "13"]}, "exceeds data.num_clients"),
                         ({"data.examples_per_client": ["10", "1000"]}, "data.examples_per_client")):
        with pytest.raises(DPFLError) as err:
            sw.validate(scenario, sw.expand(grid, None))
        assert needle in str(err.value) and "in combination" in str(err.value) and "\n" not in str(err.value)


# --- fake runs ----------------------------------------------------------------------------------

def fake_run(run_dir: Path, accuracy: float, epsilon=None, claimed=None, stop="completed", seed=0, final_loss=None):
    """A run directory as `dpfl run` leaves it."""
    run_dir.mkdir(parents=True)
    rounds = [{"round": i, "sampled": 6, "survived": 5, "test_accuracy": accuracy - 0.1 * (3 - i),
               "epsilon": epsilon, "epsilon_claimed": claimed} for i in (1, 2, 3)]
    (run_dir / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
    summary = {"name": "tiny", "final_accuracy": accuracy, "rounds_completed": 3, "rounds_planned": 3,
               "stop_reason": stop, "wall_seconds": 1.5, "seed": seed}
    if final_loss is not None:
        summary["final_loss"] = final_loss
    if epsilon is not None:
        summary.update(epsilon=epsilon, delta=1e-5, epsilon_claimed=claimed)
    (run_dir / "summary.json").write_text(json.dumps(summary))


def accuracy_of(run) -> float:
    """A made-up result that depends on the combination: lower with more dropout, seeds differ."""
    v = dict(run.values)
    return round(0.9 - float(v["faults.dropout.rate"]) + 0.01 * (run.seed or 0)
                 - (0.05 if v.get("privacy.calibration") == "none" else 0), 6)


class FakeRunner:
    def __init__(self, stop="completed"):
        self.calls, self.stop = [], stop

    def __call__(self, run, run_dir):
        self.calls.append(run.name)
        rate = float(dict(run.values)["faults.dropout.rate"])
        fake_run(run_dir, accuracy_of(run), epsilon=2.0 + rate, claimed=2.0, stop=self.stop, seed=run.seed)
        return "ok" if self.stop == "completed" else "interrupted"


GRID = {"faults.dropout.rate": ["0", "0.1", "0.3"], "privacy.calibration": ["none", "baek"]}


def run_all(out, runs, runner) -> dict:
    """What the sweep does around its trials (runtime/trials.py), with a fake run in place of one."""
    todo, statuses = sw.set_aside(out, runs)
    for run in todo:
        statuses[run.name] = runner(run, out / run.name)
    return statuses


def test_a_sweep_runs_once_and_resumes(scenario, tmp_path):
    out = tmp_path / "sweep"
    runs = sw.expand(GRID, [0, 1, 2])
    sw.prepare(out, scenario, GRID, [0, 1, 2], [])
    runner = FakeRunner()
    first = run_all(out, runs, runner)
    assert set(first.values()) == {"ok"} and len(runner.calls) == 18
    sw.prepare(out, scenario, GRID, [0, 1, 2], [])  # reopening with the same scenario is fine
    again = run_all(out, runs, runner)
    assert set(again.values()) == {"skipped"} and len(runner.calls) == 18  # nothing ran twice


def test_unfinished_runs_are_moved_aside_and_run_again(scenario, tmp_path):
    out = tmp_path / "sweep"
    runs = sw.expand({"faults.dropout.rate": ["0", "0.5"]}, None)
    sw.prepare(out, scenario, {}, None, [])
    fake_run(out / runs[0].name, 0.5, stop="interrupted")
    (out / runs[1].name).mkdir()  # a run killed before it wrote anything
    runner = FakeRunner()
    assert run_all(out, runs, runner) == {r.name: "ok" for r in runs}
    assert runner.calls == [r.name for r in runs]
    aside = sorted(p.name for p in (out / ".incomplete").iterdir())
    assert aside == [f"{runs[0].name}.1", f"{runs[1].name}.1"]
    assert json.loads((out / runs[0].name / "summary.json").read_text())["stop_reason"] == "completed"


def test_a_grid_of_more_runs_than_a_sweep_plans_is_refused_before_it_expands():
    grid = {"training.lr": [str(i) for i in range(200)], "training.batch_size": [str(i) for i in range(1, 201)]}
    with pytest.raises(DPFLError, match="40,000 runs; a sweep plans at most 10,000") as err:
        sw.expand(grid, None)
    assert err.value.field == "--grid"
    with pytest.raises(DPFLError, match="20,000 runs"):
        sw.expand({"training.lr": [str(i) for i in range(100)]}, list(range(200)))


def test_a_reopened_grid_may_grow_but_never_drop_the_runs_it_holds(scenario, tmp_path):
    out = tmp_path / "sweep"
    sw.prepare(out, scenario, GRID, [0, 1], [])
    manifest = (out / sw.MANIFEST).read_bytes()
    fewer = {"faults.dropout.rate": ["0", "0.3"], "privacy.calibration": ["none", "baek"]}
    with pytest.raises(DPFLError, match=r"holds runs of faults.dropout.rate=0.1, which this grid leaves out") as err:
        sw.prepare(out, scenario, fewer, [0, 1], [])
    assert err.value.field == "--grid"
    with pytest.raises(DPFLError, match="keeps the axes in their order"):
        sw.prepare(out, scenario, dict(reversed(list(GRID.items()))), [0, 1], [])
    with pytest.raises(DPFLError, match="keeps the axes"):
        sw.prepare(out, scenario, {**GRID, "training.lr": ["0.1"]}, [0, 1], [])
    with pytest.raises(DPFLError, match="holds runs of --seeds 0,1: a rerun may add seeds") as err:
        sw.prepare(out, scenario, GRID, [1, 2], [])
    assert err.value.field == "--seeds"
    with pytest.raises(DPFLError, match="--seeds 0,1"):
        sw.prepare(out, scenario, GRID, None, [])
    assert (out / sw.MANIFEST).read_bytes() == manifest  # nothing was rewritten
    more = {"faults.dropout.rate": ["0", "0.1", "0.3", "0.5"], "privacy.calibration": ["none", "baek"]}
    sw.prepare(out, scenario, more, [0, 1, 2], [])  # more values and seeds: the sweep grows
    assert json.loads((out / sw.MANIFEST).read_text())["grid"] == more


def test_a_sweep_directory_belongs_to_one_scenario(scenario, tmp_path):
    out = tmp_path / "sweep"
    sw.prepare(out, scenario, GRID, None, ["training.rounds=2"])
    with pytest.raises(DPFLError, match="another --set overrides"):
        sw.prepare(out, scenario, GRID, None, [])
    scenario.write_text(yaml.safe_dump({**TINY, "seed": 5}))
    with pytest.raises(DPFLError, match="another scenario file"):
        sw.prepare(out, scenario, GRID, None, ["training.rounds=2"])
    other = tmp_path / "busy"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(DPFLError, match="not a sweep"):
        sw.prepare(other, scenario, GRID, None, [])


def test_csv_and_plots_from_run_directories(scenario, tmp_path):
    out = tmp_path / "sweep"
    runs = sw.expand(GRID, [0, 1, 2])
    sw.prepare(out, scenario, GRID, [0, 1, 2], [])
    for run in runs[:-1]:  # the last one never ran
        FakeRunner()(run, out / run.name)
    rows, written = sw.write_outputs(out, GRID, runs)
    names = sorted(p.name for p in written)
    assert names == ["accuracy_vs_faults.dropout.rate.png", "accuracy_vs_privacy.calibration.png",
                     "epsilon_vs_faults.dropout.rate.png", "epsilon_vs_privacy.calibration.png", "sweep.csv"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in written if p.suffix == ".png")
    with open(out / "sweep.csv") as fh:
        table = list(csv.DictReader(fh))
    assert list(table[0]) == ["run", "faults.dropout.rate", "privacy.calibration", "seed", "final_accuracy", "epsilon",
                              "epsilon_claimed", "rounds", "stop_reason", "wall_seconds", "status"]
    assert len(table) == 18 and table[-1]["status"] == "not run" and table[-1]["final_accuracy"] == ""
    row = next(r for r in table if r["run"] == "faults.dropout.rate=0.1__privacy.calibration=baek__seed=2")
    assert (row["seed"], float(row["final_accuracy"]), float(row["epsilon"]), float(row["epsilon_claimed"]),
            row["rounds"], row["stop_reason"], row["status"]) == ("2", 0.82, 2.1, 2.0, "3", "completed", "ok")
    # the numbers behind the error bars: mean and sample sd over the three seeds
    series = sw.axis_series(rows, GRID, "faults.dropout.rate", "final_accuracy")
    assert list(series) == ["calibration=none", "calibration=baek"]
    x, mean, sd, n = series["calibration=none"][1]
    assert (x, n) == ("0.1", 3) and mean == pytest.approx(0.76) and sd == pytest.approx(0.01)
    assert series["calibration=baek"][2][3] == 2  # the missing run is left out, not counted as 0
    assert sw.sweep_run_dirs(out) == [out / r.name for r in runs[:-1]] and sw.sweep_run_dirs(tmp_path) is None


def test_plots_skip_epsilon_when_no_run_is_private(scenario, tmp_path):
    out = tmp_path / "sweep"
    grid = {"faults.dropout.model": ["tail", "bernoulli"]}
    runs = sw.expand(grid, None)
    for run in runs:
        fake_run(out / run.name, 0.8)
    rows, written = sw.write_outputs(out, grid, runs)
    assert sorted(p.name for p in written) == ["accuracy_vs_faults.dropout.model.png", "sweep.csv"]
    assert [r["seed"] for r in rows] == [0, 0]  # read from the summary when the sweep has no --seeds


def test_a_sweep_directory_has_one_owner(tmp_path):
    """flock is per open file, so two locks taken in this one process contend as two sweeps would."""
    import os
    import socket
    import subprocess
    import sys

    out = tmp_path / "sweep"
    with sw.SweepLock(out) as first:
        owner = json.loads((out / sw.LOCK).read_text())
        assert (owner["pid"], owner["host"]) == (os.getpid(), socket.gethostname())
        with pytest.raises(DPFLError, match=f"is in use by a sweep: PID {os.getpid()} on {socket.gethostname()}"):
            sw.SweepLock(out).acquire()
        assert json.loads((out / sw.LOCK).read_text())["pid"] == os.getpid()  # a refusal leaves the name
        assert first.fd is not None
    # a sweep that died (kill -9) left its name but no flock: the next one takes over
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (out / sw.LOCK).write_text(json.dumps({"pid": int(dead.stdout), "host": socket.gethostname()}))
    with sw.SweepLock(out):
        pass
    assert (out / sw.LOCK).read_text() == ""  # released: no owner named
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(DPFLError, match="not a sweep"):
        sw.SweepLock(busy).acquire()
    assert sorted(p.name for p in busy.iterdir()) == ["notes.txt"]


def test_a_dry_run_refuses_what_the_sweep_would(scenario, tmp_path):
    """`--dry-run --out DIR` said ok where the sweep itself refuses: DIR held by a live sweep, or
    holding a sweep of other --set overrides."""
    from typer.testing import CliRunner

    from cli.main import app

    out = tmp_path / "sweep"
    grid = ["--grid", "faults.dropout.rate=0,0.5"]
    sw.prepare(out, scenario, {"faults.dropout.rate": ["0", "0.5"]}, None, [])
    runner = CliRunner()
    ok = runner.invoke(app, ["sweep", str(scenario), *grid, "--out", str(out), "--dry-run"])
    assert ok.exit_code == 0 and "ok: 2 combinations" in ok.stdout, ok.output
    other = runner.invoke(app, ["sweep", str(scenario), *grid, "--set", "training.lr=0.2", "--out", str(out),
                                "--dry-run"])
    assert other.exit_code == 2 and f"{out} holds a sweep of another --set overrides" in other.stderr, other.output
    with sw.SweepLock(out):
        busy = runner.invoke(app, ["sweep", str(scenario), *grid, "--out", str(out), "--dry-run"])
    assert busy.exit_code == 2 and "is in use by a sweep" in busy.stderr, busy.output


def test_a_run_still_stopping_is_not_set_aside_until_its_process_lets_go(scenario, tmp_path):
    """A trial holds its run's lock for its life (a killed sweep's trials may still be stopping)."""
    import os

    out = tmp_path / "sweep"
    runs = sw.expand({"faults.dropout.rate": ["0", "0.5"]}, None)
    sw.prepare(out, scenario, {}, None, [])
    fake_run(out / runs[0].name, 0.5, stop="interrupted")
    fd = sw.hold_run(out, runs[0].name)
    try:
        with pytest.raises(DPFLError, match=f"run {runs[0].name} of an earlier sweep is still stopping"):
            sw.set_aside(out, runs)
        assert (out / runs[0].name / "summary.json").exists()  # untouched
        with pytest.raises(DPFLError, match="already running"):
            sw.hold_run(out, runs[0].name)
    finally:
        os.close(fd)
    todo, done = sw.set_aside(out, runs)
    assert [r.name for r in todo] == [r.name for r in runs] and done == {}
    assert sorted(p.name for p in (out / ".incomplete").iterdir()) == [f"{runs[0].name}.1"]


def test_an_unfinished_run_with_a_checkpoint_to_go_on_from_stays_in_place(scenario, tmp_path):
    """The same sweep command after a stop: a run the predicate finds resumable keeps its directory
    (its trial resumes it), one it does not is set aside and starts afresh; finished runs are skipped.
    A directory without checkpoint.npz is not resumable (cli.sweep.resumable, as `dpfl run --resume`)."""
    from cli.sweep import resumable

    out = tmp_path / "sweep"
    runs = sw.expand({"faults.dropout.rate": ["0", "0.3", "0.5"]}, None)
    sw.prepare(out, scenario, {}, None, [])
    fake_run(out / runs[0].name, 0.5, stop="interrupted")
    fake_run(out / runs[1].name, 0.5, stop="interrupted")
    fake_run(out / runs[2].name, 0.5)
    assert not resumable(out / runs[0].name)  # fake_run writes no checkpoint
    todo, done = sw.set_aside(out, runs, resumable=lambda d: d.name == runs[0].name)
    assert [r.name for r in todo] == [runs[0].name, runs[1].name] and done == {runs[2].name: "skipped"}
    assert (out / runs[0].name / "summary.json").exists() and not (out / runs[1].name).exists()
    assert sorted(p.name for p in (out / ".incomplete").iterdir()) == [f"{runs[1].name}.1"]
    assert sw.resumed(out, todo) == 1


def test_a_trial_started_again_waits_for_its_last_attempt_then_goes_on_from_what_it_left(scenario, tmp_path):
    """Tune starts a trial again when its process ended under it (a lost node): the new attempt waits
    for the old process to let go of the run, skips a run it had finished, and starts afresh one that
    left no checkpoint, its directory set aside (resuming from a checkpoint: tests/ray_cluster/test_nodes.py)."""
    import os
    import threading

    from dpfl_ray.runtime.trials import FINISHED, earlier_attempt

    out = tmp_path / "sweep"
    runs = sw.expand({"faults.dropout.rate": ["0", "0.5"]}, None)
    sw.prepare(out, scenario, {}, None, [])
    old = sw.hold_run(out, runs[0].name)
    threading.Timer(0.3, os.close, [old]).start()  # the old attempt's process ends
    os.close(sw.hold_run(out, runs[0].name, wait_s=30))
    assert earlier_attempt(out / runs[0].name) is None  # no earlier attempt wrote anything
    fake_run(out / runs[0].name, 0.5)
    assert earlier_attempt(out / runs[0].name) == FINISHED
    fake_run(out / runs[1].name, 0.5, stop="interrupted")  # no checkpoint.npz: nothing to go on from
    assert earlier_attempt(out / runs[1].name) is None
    assert not (out / runs[1].name).exists() and (out / ".incomplete" / f"{runs[1].name}.1" / "summary.json").exists()


def test_the_trial_queue_asks_for_the_next_batch_once_every_run_handed_out_has_ended():
    """An adaptive search's batches are trials of one Tune experiment (runtime/trials.py): the queue
    suggests nothing while a run of the batch still runs, asks ``more`` with every status once all
    ended, and ends when ``more`` has none."""
    from dpfl_ray.runtime import trials
    from dpfl_ray.runtime.shutdown import Shutdown

    statuses, asked = {}, []
    batches = [[{"name": "c"}], []]

    def more(done):
        asked.append(dict(done))
        return batches.pop(0)

    queue = trials._Queue([{"name": "a"}, {"name": "b"}], Shutdown(), statuses, more)
    assert [queue.suggest("t1"), queue.suggest("t2")] == [{"name": "a"}, {"name": "b"}]
    statuses["a"] = "ok"
    assert queue.suggest("t3") is None and asked == []  # b still runs: its result may decide the next
    statuses["b"] = "failed: x"
    assert queue.suggest("t3") == {"name": "c"} and asked == [{"a": "ok", "b": "failed: x"}]
    assert queue.suggest("t4") is None  # c runs
    statuses["c"] = "ok"
    assert queue.suggest("t4") == queue.FINISHED and len(asked) == 2 and batches == []
    assert queue.suggest("t5") == queue.FINISHED and len(asked) == 2  # more is not asked again
    restored = pickle.loads(pickle.dumps(queue))  # Tune saves its searcher: the live parts stay here
    assert restored.suggest("t6") == restored.FINISHED


def test_the_trial_queue_and_the_stop_file(tmp_path):
    """The sweep's side of a stop (runtime/trials.py): the queue hands out no trial once a signal
    came, the next controller step writes the stop file the trials poll, and Tune ends what is left
    only after the grace; a trial reads the file (or its deadline) as a stop."""
    import signal
    import time
    from types import SimpleNamespace

    from dpfl_ray.runtime import trials
    from dpfl_ray.runtime.shutdown import Shutdown

    shutdown = Shutdown()
    configs = [{"name": "a"}, {"name": "b"}, {"name": "c"}]
    statuses = {}
    queue = trials._Queue(configs, shutdown, statuses)
    assert queue.suggest("t1") == {"name": "a"}
    grace, done = trials._Grace(), []
    watch = trials._Watch(shutdown, tmp_path / trials.STOP_FLAG, {c["name"]: c for c in configs}, statuses,
                          None, lambda c, s: done.append((c["name"], s)), grace)
    watch.on_step_begin(0, [])
    assert not (tmp_path / trials.STOP_FLAG).exists() and not grace.stop_all()
    shutdown.received.append(signal.SIGINT)  # as the handler records a Ctrl-C
    assert queue.suggest("t2") == queue.FINISHED
    watch.on_step_begin(1, [])
    assert (tmp_path / trials.STOP_FLAG).exists() and not grace.stop_all()
    grace.stop_since -= trials.STOP_GRACE_SECONDS + 1  # as if the stop was asked that long ago
    assert grace.stop_all()
    # a trial's last report names its status; one Tune ended after the grace has none: interrupted
    watch.on_trial_complete(2, [], SimpleNamespace(config={"name": "a"}, last_result={"status": "ok"}))
    watch.on_trial_complete(2, [], SimpleNamespace(config={"name": "b"}, last_result={"round": 3}))
    watch.on_trial_complete(3, [], SimpleNamespace(config={"name": "a"}, last_result={"status": "failed: x"}))
    assert statuses == {"a": "ok", "b": "interrupted"} and done == [("a", "ok"), ("b", "interrupted")]
    # the trial's side
    stop = trials.TrialStop(tmp_path / "no-such-flag", time.monotonic() + 60)
    assert not stop.requested
    assert trials.TrialStop(tmp_path / trials.STOP_FLAG, time.monotonic() + 60).requested
    late = trials.TrialStop(tmp_path / "no-such-flag", time.monotonic() - 1)
    assert late.requested and late.timed_out
    # a scheduler's early stop: the trial's own file, or the collector's answer on another node
    early = tmp_path / trials.EARLY / "a"
    mine = trials.TrialStop(tmp_path / "no-such-flag", time.monotonic() + 60, early=early)
    assert not mine.requested and mine.stop_reason == "interrupted"
    early.parent.mkdir()
    early.touch()
    assert mine.requested and mine.stopped_early and mine.stop_reason == "stopped_early"
    remote = trials.TrialStop(tmp_path / "no-such-flag", time.monotonic() + 60, ask=lambda: "early")
    assert remote.requested and remote.stop_reason == "stopped_early"
    told = trials.TrialStop(tmp_path / "no-such-flag", time.monotonic() + 60, ask=lambda: "stop")
    assert told.requested and told.stop_reason == "interrupted"
    collector = trials._Collector(str(tmp_path))
    assert collector.stopping("a") == "stop"  # the sweep's stop file (written above) comes first
    (tmp_path / trials.STOP_FLAG).unlink()
    assert (collector.stopping("a"), collector.stopping("b")) == ("early", "")


def _gaussian_rounds(count, z=1.0, q=0.1):
    event = {"type": "PoissonSampledDpEvent", "sampling_probability": q,
             "event": {"type": "GaussianDpEvent", "noise_multiplier": z}}
    return [{"round": t + 1, "reason": "test", "covered": True, "released": True,
             "sampling": {"kind": "poisson", "rate": q, "neighboring_relation": "add_or_remove_one"},
             "noise_multipliers": [z], "claimed_noise_multipliers": [z], "event": event, "accounted_event": event,
             "claimed_event": event, "public": [], "paper_epsilon": None, "claim_note": "", "dropped": {}}
            for t in range(count)]


def _ledger(rounds, accountant="rdp", delta=1e-5):
    from dpfl_ray.privacy.ledger import PrivacyLedger

    ledger = PrivacyLedger.from_dict({"accountant": accountant, "delta": delta, "rounds": rounds})
    return {**ledger.to_dict(), "accountant": accountant, "delta": delta}


def test_choosing_among_private_runs_is_booked_as_all_of_them_composed(tmp_path):
    """Picking the best of a sweep's runs releases what all of them learned: selection.json gives
    their ledgers composed by dp_accounting (3 + 2 rounds = one ledger of 5), above each run's own."""
    import dp_accounting

    for name, count in (("a", 3), ("b", 2)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "ledger.json").write_text(json.dumps(_ledger(_gaussian_rounds(count))))
    rows = [{"run": "a", "status": "ok"}, {"run": "b", "status": "ok"}, {"run": "c", "status": "not run"}]
    sel = sw.selection_privacy(tmp_path, rows)
    accountant = dp_accounting.rdp.RdpAccountant(list(range(2, 257)) + [1.5, 1.75, 2.5, 3.5])
    accountant.compose(dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(1.0)), 5)
    assert sel["runs"] == 2 and sel["accountant"] == "rdp" and sel["delta"] == 1e-5
    assert sel["epsilon_all_runs"] == _ledger(_gaussian_rounds(5))["epsilon"]
    assert sel["epsilon_all_runs"] == pytest.approx(accountant.get_epsilon(1e-5), rel=0.05)
    assert sel["epsilon_all_runs"] > sel["epsilon_max_single_run"] == _ledger(_gaussian_rounds(3))["epsilon"]
    assert "Papernot & Steinke" in sel["note"]

    (tmp_path / "b" / "ledger.json").write_text(json.dumps(_ledger(_gaussian_rounds(2), delta=1e-6)))
    sel = sw.selection_privacy(tmp_path, rows)
    assert sel["epsilon_all_runs"] is None and "different accountants or deltas" in sel["why"]
    assert sw.selection_privacy(tmp_path, [{"run": "c", "status": "ok"}]) is None  # nothing private
    # a ledger with an event this version cannot account: said, not raised (the sweep's other files
    # are written after this)
    foreign = _ledger(_gaussian_rounds(2))
    foreign["rounds"][0]["mechanism"] = {"type": "NoSuchDpEvent"}
    (tmp_path / "b" / "ledger.json").write_text(json.dumps(foreign))
    sel = sw.selection_privacy(tmp_path, rows)
    assert sel["epsilon_all_runs"] is None and "cannot be composed here" in sel["why"]


def test_a_private_run_that_stopped_early_still_counts_in_the_choice(tmp_path):
    """An interrupted or timed-out run released the rounds its ledger books: choosing among the runs
    composes them too (3 + 2 rounds), and says how many of the runs are unfinished; a run that
    released nothing adds nothing, and an unreadable ledger is said, not raised."""
    for name, count in (("a", 3), ("b", 2), ("c", 0)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "ledger.json").write_text(json.dumps(_ledger(_gaussian_rounds(count))))
    rows = [{"run": "a", "status": "ok"}, {"run": "b", "status": "interrupted"}, {"run": "c", "status": "failed"}]
    sel = sw.selection_privacy(tmp_path, rows)
    assert sel["runs"] == 2 and sel["unfinished"] == 1
    assert sel["epsilon_all_runs"] == _ledger(_gaussian_rounds(5))["epsilon"]
    assert "finished or not" in sel["note"]
    (tmp_path / "b" / "ledger.json").write_text('{"rounds": [')
    sel = sw.selection_privacy(tmp_path, rows)
    assert sel["epsilon_all_runs"] is None and sel["why"] == f"{tmp_path / 'b' / 'ledger.json'} is not a ledger (a JSON object)"


def test_the_sweep_s_tensorboard_logger_is_made_without_torch_and_torch_stays_importable(tmp_path):
    """A sweep's process logs numbers and never trains: Tune's TensorBoard logger must not cost it
    torch's import, and the events it writes must still be TensorBoard's."""
    import subprocess
    import sys

    code = """if True:
        import sys
        from dpfl_ray.runtime.trials import import_tensorboardx_without_torch
        import_tensorboardx_without_torch()
        from tensorboardX import SummaryWriter
        with SummaryWriter(sys.argv[1]) as writer:
            writer.add_scalar("test_accuracy", 0.5, 1)
        print("torch" in sys.modules)
        import torch
        print(torch.ones(2).sum().item())
    """
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split() == ["False", "2.0"]
    (events,) = tmp_path.glob("events.out.tfevents.*")
    assert events.stat().st_size > 0
