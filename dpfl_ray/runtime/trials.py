"""Sweeps on Ray Tune: every combination (x seed) is one Tune trial, and every trial is one
federated run, in one Ray session (the sweep's private one, or the cluster it joined).

A trial reserves a placement group (resources.trial_bundles): one bundle per ClientWorker, and an
empty head bundle for the trial's function -- the run's driver, which starts the coordinator --
which reserves no CPU, as ``dpfl run`` and its coordinator reserve none.
Tune creates the trial's actor with ``placement_group_capture_child_tasks``, so the coordinator and
the workers (and any replacement the coordinator starts) land in the trial's bundles. The trial
calls the same ``run_scenario`` as ``dpfl run`` and writes the same run directory (a test compares
them byte for byte, timings aside), and reports every round to Tune (``tune.report``), so Tune's
logger callbacks (TensorBoard event files under ``SWEEP/tune/``, or MLflow / W&B callbacks) see the
curves.

A trial on another node than the sweep's sends its run directory back through the sweep's
collector (:func:`bring_back`), which the sweep starts only once its cluster has another node.

A trial's actor is reused by the next trial of the same shape (Tune's ``reuse_actors``), and with
it the placement group and the workers and coordinator the last run parked there (runtime/warm.py:
a rebound actor serves its run exactly as a fresh one), so only a sweep's first trials pay for the
processes' start and their imports. ``DPFL_WARM_WORKERS=0`` turns all of it off.

What Tune does not decide here:
- which runs are left to do (``runs.sweep.set_aside``: finished run directories are never run again;
  rerunning the command is the resume, so the same code resumes after a crash, a Ctrl-C or a
  ``kill -9``);
- where a trial started again goes on from: Tune starts a trial whose process ended under it (a
  lost node) again, and the new attempt resumes the run from its last checkpoint
  (:func:`earlier_attempt`), not from a Tune checkpoint;
- how a run stops. A Tune trial that Tune stops is killed with its actor, before the run could write
  its files; so each trial stops itself: at its ``--timeout``, when the sweep asks (a signal to
  the sweep writes ``SWEEP/.stop``, which every trial polls between rounds, as ``dpfl run`` polls
  its signals), or when the sweep's scheduler stops it early (:func:`early_stopping`) -- it then
  writes its files for its last committed round and returns. The queue of
  runs (``_Queue``, a Tune searcher) hands out no new trial once a stop was asked. Only trials that
  have not returned STOP_GRACE_SECONDS after that are stopped by Tune.
"""
from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path
from typing import Callable, Sequence

from ray import tune
from ray.tune import Callback, Stopper
from ray.tune.search import ConcurrencyLimiter, Searcher

from . import warm
from .resources import bundle_total, trial_bundles, trial_workers, trials_that_fit
from .shutdown import Shutdown

STOP_FLAG = ".stop"
# SWEEP/.early/NAME: the sweep's scheduler (ASHA) stopped run NAME; the trial stops itself between rounds.
EARLY = ".early"
FINISHED = "finished"
# How often Tune starts a trial again after its process ended under it (a lost node); each new
# attempt resumes the run from its last checkpoint (earlier_attempt).
MAX_TRIAL_FAILURES = 2
RETRY_LOCK_WAIT_SECONDS = 60.0
COLLECTOR_NAMESPACE = "dpfl-sweeps"
BRING_BACK_TIMEOUT_S = 300.0
# A sweep starts its collector once its cluster has a node besides the sweep's (at once, or when one
# joins: it looks every COLLECTOR_CHECK_S); a trial on that node waits up to COLLECTOR_WAIT_S for it.
COLLECTOR_CHECK_S = 2.0
COLLECTOR_WAIT_S = 60.0
ASK_TIMEOUT_S = 5.0
# How long the sweep waits, after a stop was asked, for its trials to write their files and return.
STOP_GRACE_SECONDS = 30.0
# How long a sweep waits while none of its trials runs and one waits for its placement group (what
# other jobs hold, or more than the cluster has): the trials not started are then "not run" (the next
# command runs them), instead of a sweep that waits forever.
RESOURCE_WAIT_SECONDS = 600.0
# Metrics a trial reports to Tune for every round (and the run's final status at its end).
ROUND_METRICS = ("round", "test_accuracy", "test_loss", "epsilon", "epsilon_claimed", "survived", "sampled")


class TrialStop(Shutdown):
    """A trial's ``Shutdown``: it is asked to stop when the sweep writes its stop file, when the
    sweep's scheduler stops it early (its file under ``SWEEP/.early/``: ``stopped_early``), or when
    the run passes its deadline (``timed_out``). Polled where ``dpfl run`` polls its signals.
    ``ask``: on a node that may not see the sweep's files, a question to the sweep's collector
    (which of those files exist there: "stop", "early" or ""), put at most once every ASK_EVERY_S."""

    ASK_EVERY_S = 1.0

    def __init__(self, flag: Path, deadline: float, ask: Callable[[], str] | None = None, early: Path | None = None):
        super().__init__()
        self.flag, self.deadline, self.timed_out, self.ask, self._asked = flag, deadline, False, ask, 0.0
        self.early, self.stopped_early = early, False

    @property
    def requested(self) -> bool:
        if not self.received:
            if time.monotonic() > self.deadline:
                self.timed_out = True
                self.received.append(signal.SIGINT)
            elif self.flag.exists():
                self.received.append(signal.SIGINT)
            elif self.early is not None and self.early.exists():
                self.stopped_early = True
                self.received.append(signal.SIGINT)
            else:
                answer = self._answer()
                if answer:
                    self.stopped_early = answer == "early"
                    self.received.append(signal.SIGINT)
        return bool(self.received)

    @property
    def stop_reason(self) -> str:
        return "stopped_early" if self.stopped_early else "interrupted"

    def _answer(self) -> str:
        if self.ask is None or time.monotonic() - self._asked < self.ASK_EVERY_S:
            return ""
        self._asked = time.monotonic()
        return self.ask()


def trial(config: dict) -> None:
    """One Tune trial: the run ``config`` names, into its run directory, as ``dpfl run`` would."""
    t0 = time.time()
    sweep_dir, run_dir = Path(config["sweep_dir"]), Path(config["sweep_dir"]) / config["name"]
    stop = TrialStop(sweep_dir / STOP_FLAG, time.monotonic() + float(config["timeout_s"]), ask=_ask_collector(config),
                     early=sweep_dir / EARLY / config["name"])
    # started after the sweep was told to stop: nothing to write. A trial started again after its
    # scheduler had stopped it (its process ended under it) goes on: its run ends at once, with its files.
    if stop.requested and not stop.stopped_early:
        tune.report({"status": "interrupted" if not stop.timed_out else "timeout", "started": False})
        return
    status, held = _run(config, run_dir, stop, t0, tune.report)
    # only a trial that held the run sends it back (not another attempt's directory it was refused)
    tune.report({"status": bring_back(config, run_dir, status) if held else status})


def _ask_collector(config: dict) -> Callable[[], str] | None:
    """For a trial on another node than the sweep's: asks the sweep's collector whether the sweep
    was told to stop, or its scheduler stopped this trial ("stop", "early" or "": its files may not
    be visible here). None on the sweep's node."""
    import ray

    if not _elsewhere(config):
        return None
    found = []  # the collector's handle, looked up once

    def ask() -> str:
        try:
            if not found:
                found.append(ray.get_actor(config["collector"], namespace=COLLECTOR_NAMESPACE))
            return str(ray.get(found[0].stopping.remote(config["name"]), timeout=ASK_TIMEOUT_S))
        except Exception:  # noqa: BLE001 - no answer is no stop; the sweep's grace ends the trial
            return ""

    return ask


def _elsewhere(config: dict) -> bool:
    """Does this trial run on another node than the sweep's (which has a collector)?"""
    import ray

    return bool(config.get("collector")) and ray.get_runtime_context().get_node_id() != config.get("driver_node")


def bring_back(config: dict, run_dir: Path, status: str) -> str:
    """Send the run directory a trial wrote on another node than the sweep's to the sweep's
    ``_Collector`` (on a cluster whose nodes share no file system it would stay on that node);
    returns the trial's status, or a failed one saying where the files stayed."""
    import ray

    if not _elsewhere(config) or not run_dir.is_dir():
        return status
    here = ray.get_runtime_context().get_node_id()
    from ..runs.sweep import pack_run

    try:
        collector = _find_collector(config["collector"])
        ray.get(collector.write.remote(config["name"], pack_run(run_dir)), timeout=BRING_BACK_TIMEOUT_S)
    except Exception as err:  # noqa: BLE001 - the run's files are still on this node: say where
        return f"failed: its files stayed on node {here} at {run_dir} ({type(err).__name__}: {err})"
    from ..runs.record import DP_SECRET

    (run_dir / DP_SECRET).unlink(missing_ok=True)  # an unfinished 'os' run resumes from the sweep node's copy
    return status


def _find_collector(name: str):
    """The sweep's collector, waiting up to COLLECTOR_WAIT_S for the sweep to start it (it does so
    within COLLECTOR_CHECK_S of a second node joining); ValueError if it never appears."""
    import ray

    end = time.monotonic() + COLLECTOR_WAIT_S
    while True:
        try:
            return ray.get_actor(name, namespace=COLLECTOR_NAMESPACE)
        except ValueError:
            if time.monotonic() > end:
                raise
            time.sleep(0.5)


class _Collector:
    """Runs on the sweep's node: writes the run directories that trials on other nodes send back
    (runs.sweep.unpack_run), so that the sweep directory holds every run wherever it ran."""

    def __init__(self, sweep_dir: str):
        self.sweep_dir = Path(sweep_dir)

    def stopping(self, name: str = "") -> str:
        if (self.sweep_dir / STOP_FLAG).exists():
            return "stop"
        return "early" if name and (self.sweep_dir / EARLY / name).exists() else ""

    def write(self, name: str, blob: bytes) -> bool:
        from ..runs.sweep import unpack_run

        return unpack_run(self.sweep_dir, name, blob)

    def _run_dir(self, name: str) -> Path | None:
        """Run ``name``'s directory here, None for a name that is not one (or a run that finished)."""
        from .checkpoint import finished

        run_dir = self.sweep_dir / name
        if run_dir.parent != self.sweep_dir or (run_dir.is_dir() and finished(run_dir) is not None):
            return None
        return run_dir

    def kept(self, name: str) -> dict[str, bytes] | None:
        """What run ``name``'s unfinished directory here holds for the run to start again from (its
        'os' secret, the rounds it released: runs/record.py, KEPT_FOR_RESTART), for a trial on a node
        that does not see this directory: without them it would release those rounds again with
        other noise or other inputs, which no ledger books (privacy/reruns.py). None: the run
        finished here (an attempt's process ended after sending it back)."""
        from ..runs.record import KEPT_FOR_RESTART

        run_dir = self._run_dir(name)
        if run_dir is None:
            return None
        return {f: (run_dir / f).read_bytes() for f in sorted(KEPT_FOR_RESTART) if (run_dir / f).is_file()}

    def keep(self, name: str, event: dict | None = None, secret: bytes | None = None) -> bool:
        """From a trial on another node, as it goes: the run's 'os' secret, and each line it lists of
        a release (runs/record.py, ReleaseList), so that the next attempt, wherever Tune starts it,
        finds them here (:meth:`kept`)."""
        from ..runs.record import DP_SECRET, ReleaseList

        run_dir = self._run_dir(name)
        if run_dir is None:
            return False
        run_dir.mkdir(parents=True, exist_ok=True)
        if secret is not None and not (run_dir / DP_SECRET).exists():
            write_kept(run_dir, {DP_SECRET: secret})
        if event is not None:  # read afresh: an unpacked attempt may have replaced the directory
            ReleaseList(run_dir).add(event)
        return True


def write_kept(run_dir: Path, files: dict[str, bytes]) -> None:
    """Bring what :meth:`_Collector.kept` sent into a run directory here: the secret where it has
    none (readable by its owner alone), and the listed releases merged into its own list (a copy
    an earlier attempt left on this node may lack what another node's attempt listed since)."""
    import tempfile

    from ..runs.record import DP_SECRET, RELEASES, ReleaseList, read_releases
    from .checkpoint import write_secret

    if not files:
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    if DP_SECRET in files and not (run_dir / DP_SECRET).exists():
        write_secret(run_dir, files[DP_SECRET])
    if RELEASES in files:
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / RELEASES).write_bytes(files[RELEASES])
            sent = read_releases(tmp)
        here = ReleaseList(run_dir)
        for r in sorted(sent):
            here.add({"event": "release", "round": r, **sent[r]})


def _ask_sweep_node(config: dict, what: str, method: str, *args):
    """Call the sweep's collector from a trial on another node (within ASK_TIMEOUT_S, once it is
    found); a one-line DPFLError naming ``what`` if it cannot answer: the run must not go on blind
    to, or unheard by, the sweep's node."""
    import ray

    from ..errors import DPFLError

    try:
        collector = _find_collector(config["collector"])
        return ray.get(getattr(collector, method).remote(config["name"], *args), timeout=ASK_TIMEOUT_S)
    except Exception as err:  # noqa: BLE001 - one line: the trial fails and Tune starts it again
        why = " ".join(str(err).split())[:300]
        raise DPFLError(f"cannot {what} the sweep's node ({type(err).__name__}: {why})") from None


def _fetch_kept(config: dict, run_dir: Path) -> bool:
    """On another node than the sweep's: bring what the sweep's node keeps of the run (the same
    files where the nodes share the file system). False when the run finished there (nothing to run)."""
    files = _ask_sweep_node(config, f"ask what run {config['name']} released before from", "kept")
    if files is None:
        return False
    write_kept(run_dir, files)
    return True


def collector_name() -> str:
    """A new sweep's collector name, unique in COLLECTOR_NAMESPACE."""
    import uuid

    return f"dpfl-sweep-{uuid.uuid4().hex}"


def start_collector(sweep_dir: Path, name: str | None = None):
    """The sweep's ``_Collector``, pinned to this node: (its actor, its name, this node's id)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node, name = ray.get_runtime_context().get_node_id(), name or collector_name()
    actor = ray.remote(_Collector).options(
        name=name, namespace=COLLECTOR_NAMESPACE, num_cpus=0, max_concurrency=4,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False)).remote(str(sweep_dir))
    return actor, name, node


class _LazyCollector:
    """The sweep's collector, started only once the cluster has a node besides this one: on one
    machine no trial runs elsewhere, and the collector's process (about 1.2 s of CPU) is saved.
    ``check()`` is called from Tune's controller loop; it looks at the nodes every COLLECTOR_CHECK_S."""

    def __init__(self, sweep_dir: Path):
        import ray

        self.sweep_dir, self.actor, self._checked = sweep_dir, None, 0.0
        self.name, self.node = collector_name(), ray.get_runtime_context().get_node_id()
        self.check()

    def check(self) -> None:
        import ray

        if self.actor is not None or time.monotonic() - self._checked < COLLECTOR_CHECK_S:
            return
        self._checked = time.monotonic()
        try:
            others = any(n.get("Alive") and n.get("NodeID") != self.node for n in ray.nodes())
        except Exception:  # noqa: BLE001 - no answer now (the head busy or lost): asked again later
            return
        if others:
            self.actor = start_collector(self.sweep_dir, self.name)[0]

    def stop(self) -> None:
        import ray

        if self.actor is not None:
            try:
                ray.kill(self.actor)
            except Exception:  # noqa: BLE001 - Ray is gone (its head was lost): so is the collector
                pass


def _run(config: dict, run_dir: Path, stop: TrialStop, t0: float, report: Callable[[dict], None]
         ) -> tuple[str, bool]:
    """The run's status, and whether this trial sends its directory back (it held the run's lock:
    runs.sweep.hold_run): a trial refused the lock must not send back a directory another attempt is
    writing, nor one that found the run finished on the sweep's node."""
    from ..data import build_federation
    from ..errors import DPFLError
    from ..runs.record import RunRecord
    from ..runs.sweep import hold_run
    from .checkpoint import rows_covered, run_secret
    from ..scenario import load_scenario
    from .driver import run_scenario, write_unstarted

    record, held = None, None
    try:
        # an earlier attempt's process may still be ending (its node was lost): it holds the run until it is gone
        held = hold_run(run_dir.parent, run_dir.name, wait_s=RETRY_LOCK_WAIT_SECONDS if run_dir.exists() else 0.0)
        elsewhere = _elsewhere(config)
        if elsewhere and not _fetch_kept(config, run_dir):
            return "ok", False  # an attempt before this one finished it and sent it back
        earlier = earlier_attempt(run_dir)
        if earlier == FINISHED:  # the attempt that ended had written every file
            return "ok", True
        checkpoint, sc = earlier or (None, load_scenario(config["scenario"], list(config["overrides"])))
        fed = build_federation(sc)
        startup = {"load_data": time.time() - t0}
        record = RunRecord(run_dir) if checkpoint is None else RunRecord.reopen(run_dir, rows_covered(checkpoint))
        if elsewhere:  # the secret the run draws from, kept on the sweep's node too before it releases
            secret = run_secret(run_dir, sc.privacy.randomness)
            if secret is not None:
                _ask_sweep_node(config, "give the run's secret to", "keep", None, secret)

        def on_event(ev: dict) -> None:
            if ev.get("event") == "round":
                report({k: ev.get(k) for k in ROUND_METRICS if ev.get(k) is not None})
            elif ev.get("event") == "release" and elsewhere:  # listed there as soon as here
                _ask_sweep_node(config, "list a release on", "keep", ev)

        summary = run_scenario(sc, fed, record, on_event=on_event, shutdown=stop, startup=startup,
                               started_at=t0, keep_workers=True, workers=int(config["workers"]), resume=checkpoint)
    except DPFLError as err:
        return f"failed: {err}", held is not None
    except Exception as err:  # noqa: BLE001 - one line in sweep.csv; the run's files say the rest
        if record is not None and not (run_dir / "summary.json").exists():
            try:
                write_unstarted(sc, fed, record, time.time() - t0)
            except Exception:  # noqa: BLE001 - the status below is what matters
                pass
        return f"failed: {type(err).__name__}: {err}", held is not None
    finally:
        if held is not None:
            os.close(held)
    if summary["stop_reason"] == "interrupted":
        return ("timeout" if stop.timed_out else "interrupted"), True
    return "ok", True


def earlier_attempt(run_dir: Path):
    """What an earlier attempt of this trial left in its run directory. Tune starts a trial again
    when its process ended under it (``MAX_TRIAL_FAILURES``: its node was lost, or the process was
    killed): the new attempt continues from the last checkpoint the run wrote, as ``dpfl run
    --resume`` would, so a lost node costs its trials only the rounds since their checkpoints.

    None: no earlier attempt, or one that left nothing to continue from (its directory is moved to
    ``.incomplete/`` and the run starts afresh); FINISHED: it had written every file; else
    (checkpoint, scenario). A new sweep command gets here with an unfinished directory only when
    ``runs.sweep.set_aside`` found its checkpoint resumable (else it moved it aside): the same
    command after a Ctrl-C, a crash or a ``kill -9`` continues its runs from their checkpoints."""
    from ..errors import DPFLError
    from ..runs.sweep import move_aside
    from .checkpoint import finished, open_for_resume

    if not run_dir.exists():
        return None
    if finished(run_dir) is not None:
        return FINISHED
    try:
        return open_for_resume(run_dir)
    except DPFLError:  # no checkpoint yet (it ended before its first round), or one cut short
        move_aside(run_dir.parent, run_dir.name)
        return None


def run_configs(sweep_dir: Path, runs: Sequence, scenario: Path | None, timeout_s: float, cluster: dict,
                max_concurrent: int | None = None) -> list[dict]:
    """Each run's trial config: where it writes, what it runs, its pool and placement group. A
    scenario's ``workers: auto`` shares the ``cluster`` among the runs that can run side by side
    (resources.trial_workers)."""
    from ..scenario import load_scenario

    side_by_side = min(len(runs), max_concurrent or len(runs))
    configs = []
    for run in runs:
        path = Path(run.scenario or scenario).resolve()
        sc = load_scenario(path, list(run.overrides))
        workers = trial_workers(sc.resources, sc.data.num_clients, cluster, side_by_side)
        configs.append({"name": run.name, "scenario": str(path), "overrides": list(run.overrides),
                        "sweep_dir": str(Path(sweep_dir).resolve()), "timeout_s": float(timeout_s),
                        "bundles": trial_bundles(sc.resources, workers), "workers": workers,
                        "rounds": sc.training.rounds})
    return configs


def default_concurrency(configs: Sequence[dict], cluster: dict) -> int:
    """As many trials at once as the cluster's resources hold (the largest trial's placement group)."""
    return min((trials_that_fit(cluster, c["bundles"]) for c in configs), default=1)


def import_tensorboardx_without_torch() -> None:
    """Import tensorboardX, for Tune's default TensorBoard logger, without the torch import it makes
    only to accept torch tensors as values: the sweep's process logs plain numbers and never trains,
    and torch's import is about 1.7 s of CPU, a fifth of a small sweep's driver. Nothing if torch or
    tensorboardX is already imported; torch stays importable afterwards."""
    import sys

    if "torch" in sys.modules or "tensorboardX" in sys.modules:
        return
    sys.modules["torch"] = None  # `import torch` raises ImportError, which tensorboardX expects
    try:
        import tensorboardX  # noqa: F401
    except ImportError:  # not installed: Tune then writes no event files, as it would anyway
        pass
    finally:
        if sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]


def run_trials(sweep_dir: Path, configs: Sequence[dict], max_concurrent: int | None, shutdown: Shutdown,
               on_result: Callable[[dict, dict], None] | None = None,
               on_done: Callable[[dict, str], None] | None = None,
               on_retry: Callable[[dict], None] | None = None, early_stop: dict | None = None,
               more: Callable[[dict[str, str]], Sequence[dict]] | None = None) -> dict[str, str]:
    """Run the trials on the connected Ray; returns {run name: status} for each config.

    ``on_result(config, metrics)``: a round a trial reported; ``on_done(config, status)``: a trial
    ended; ``on_retry(config)``: a trial's process ended under it and Tune starts it again (it
    resumes from its checkpoint: :func:`earlier_attempt`). All run in this thread (Tune's
    controller loop). ``early_stop``: ASHA's settings (``grace_rounds``, ``reduction_factor``:
    :func:`early_stopping`), or None. ``more(statuses)``: once every trial handed out has ended, the
    configs of the runs to run next (an adaptive search's next batch, asked from their results), or
    none: they are trials of the same Tune experiment, so they take over the actors (and the parked
    workers) of the trials before them, and no second experiment starts."""
    import ray

    os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = "1"  # the sweep's own Shutdown decides (module docstring)
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    # A trial's failure is one line of the sweep's (_Watch); its traceback is in its error.txt.
    os.environ.setdefault("TUNE_PRINT_ALL_TRIAL_ERRORS", "0")
    sweep_dir = Path(sweep_dir).resolve()
    flag = sweep_dir / STOP_FLAG
    flag.unlink(missing_ok=True)
    shutil.rmtree(sweep_dir / EARLY, ignore_errors=True)  # an earlier command's decisions: its runs are finished
    n = max_concurrent or default_concurrency(configs, ray.cluster_resources())
    import_tensorboardx_without_torch()
    collector = _LazyCollector(sweep_dir)

    def located(runs: Sequence[dict]) -> list[dict]:  # each trial finds the sweep's collector by these
        return [{**c, "collector": collector.name, "driver_node": collector.node} for c in runs]

    configs = located(configs)
    statuses: dict[str, str] = {}
    by_name = {c["name"]: c for c in configs}

    def extend(done: dict[str, str]) -> list[dict]:
        batch = located(more(done))
        by_name.update((c["name"], c) for c in batch)
        return batch

    queue = _Queue(configs, shutdown, statuses, extend if more is not None else None)
    grace = _Grace()
    watch = _Watch(shutdown, flag, by_name, statuses, on_result, on_done, grace, on_retry, collector.check)
    tuner = tune.Tuner(
        tune.with_resources(trial, lambda config: tune.PlacementGroupFactory(config["bundles"])),
        tune_config=tune.TuneConfig(search_alg=ConcurrencyLimiter(queue, max_concurrent=n),
                                    num_samples=len(configs) if more is None else -1,  # -1: until the queue ends
                                    reuse_actors=warm.enabled(), trial_name_creator=_trial_name,
                                    trial_dirname_creator=_trial_name,
                                    scheduler=early_stopping(sweep_dir, max(c["rounds"] for c in configs),
                                                             **early_stop) if early_stop is not None else None),
        run_config=tune.RunConfig(name=time.strftime("%Y%m%d-%H%M%S"), storage_path=str(sweep_dir / "tune"),
                                  verbose=0, callbacks=[watch], stop=grace,
                                  failure_config=tune.FailureConfig(max_failures=MAX_TRIAL_FAILURES)))
    try:
        tuner.fit()
    finally:
        collector.stop()
    flag.unlink(missing_ok=True)
    shutil.rmtree(sweep_dir / EARLY, ignore_errors=True)
    for name in by_name:
        statuses.setdefault(name, "interrupted" if shutdown.requested else "not run")
    return statuses


def early_stopping(sweep_dir: Path, max_rounds: int, grace_rounds: int = 1, reduction_factor: int = 4):
    """Tune's ASHA scheduler on each trial's reported test accuracy by round, whose stops the trials
    carry out themselves: a trial that Tune stops is killed before its run writes its files, so a
    STOP becomes the trial's file under ``SWEEP/.early/`` (polled between rounds, as the sweep's stop
    file is) and Tune is told to continue. The run then ends after its current round with
    ``stop_reason`` ``stopped_early``: finished, never run again. A run that reaches its last round
    is never stopped (ASHA's ``stop_last_trials`` is off)."""
    from ray.tune.schedulers import ASHAScheduler

    early = Path(sweep_dir) / EARLY

    class _StopsItself(ASHAScheduler):
        @property
        def metric(self):
            # Tune checks every result for a scheduler's metric; a trial's last report (its status)
            # and a round without evaluation (output.eval_every) have none: ASHA skips those
            return None

        def on_trial_result(self, tune_controller, trial, result: dict) -> str:
            if super().on_trial_result(tune_controller, trial, result) == self.STOP:
                early.mkdir(parents=True, exist_ok=True)
                (early / trial.config["name"]).touch()
            return self.CONTINUE

    return _StopsItself(time_attr="round", metric="test_accuracy", mode="max", max_t=max(int(max_rounds), 1),
                        grace_period=max(int(grace_rounds), 1), reduction_factor=reduction_factor,
                        stop_last_trials=False)


def _trial_name(trial) -> str:
    """A trial is named as its run directory (TensorBoard shows the runs under these names)."""
    return trial.config.get("name") or trial.trial_id


class _Queue(Searcher):
    """The runs, in order, one per trial; none once the sweep was asked to stop. ``more(statuses)``:
    asked once the queue is empty and every run handed out has its status (``statuses``), for the
    runs to hand out next; while one still runs, no trial is suggested (Tune asks again)."""

    def __init__(self, configs: Sequence[dict], shutdown: Shutdown, statuses: dict[str, str],
                 more: Callable[[dict[str, str]], Sequence[dict]] | None = None):
        super().__init__()
        self._todo, self._shutdown, self._statuses, self._more = list(configs), shutdown, statuses, more
        self._handed: list[str] = []

    def __getstate__(self) -> dict:
        """Tune saves its searcher with the experiment's state; a sweep resumes from its run
        directories, so what is saved is an empty queue (``more`` holds the live display)."""
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__([], Shutdown(), {})

    def suggest(self, trial_id: str):
        if self._shutdown.requested:
            return self.FINISHED
        if not self._todo and self._more is not None:
            if any(name not in self._statuses for name in self._handed):
                return None
            self._todo = list(self._more(self._statuses))
            if not self._todo:
                self._more = None
        if not self._todo:
            return self.FINISHED
        config = self._todo.pop(0)
        self._handed.append(config["name"])
        return dict(config)

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        pass


class _Grace(Stopper):
    """Stops (kills) the trials still running STOP_GRACE_SECONDS after the stop file was written."""

    def __init__(self):
        self.stop_since: float | None = None

    def __call__(self, trial_id: str, result: dict) -> bool:
        return False

    def stop_all(self) -> bool:
        return self.starved or (self.stop_since is not None
                                and time.monotonic() - self.stop_since > STOP_GRACE_SECONDS)

    starved = False  # no trial ran for RESOURCE_WAIT_SECONDS while one waited for its resources


class _Watch(Callback):
    """Tune's controller loop, seen from the sweep: a signal to the sweep becomes the stop file;
    each trial's rounds and end are handed on."""

    def __init__(self, shutdown, flag, by_name, statuses, on_result, on_done, grace: _Grace, on_retry=None,
                 on_step: Callable[[], None] | None = None):
        self.shutdown, self.flag, self.by_name, self.statuses = shutdown, flag, by_name, statuses
        self.on_result, self.on_done, self.grace, self.on_retry = on_result, on_done, grace, on_retry
        self.on_step = on_step

    def __getstate__(self) -> dict:
        """Tune pickles its run config into the experiment's state; the live display stays here.
        (A sweep resumes from its run directories, not from Tune's state.)"""
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__(Shutdown(), Path(os.devnull), {}, {}, None, None, _Grace())

    waiting_since: float | None = None  # since when a trial waits for resources and none runs

    def on_step_begin(self, iteration: int, trials: list, **info) -> None:
        if self.on_step is not None:
            self.on_step()
        if self.shutdown.requested and self.grace.stop_since is None:
            self.flag.touch()
            self.grace.stop_since = time.monotonic()
        self._starving([t for t in trials if t.status == "PENDING"], any(t.status == "RUNNING" for t in trials))

    def _starving(self, pending: list, running: bool) -> None:
        """A sweep whose trials all wait for resources the cluster never frees ends after
        RESOURCE_WAIT_SECONDS: each waiting run is "not run", with what it waited for."""
        if running or not pending or self.grace.stop_since is not None:
            self.waiting_since = None
            return
        now = time.monotonic()
        if self.waiting_since is None:
            self.waiting_since = now
        if now - self.waiting_since < RESOURCE_WAIT_SECONDS or self.grace.starved:
            return
        self.grace.starved = True
        import ray

        have = ray.cluster_resources()
        for trial in pending:
            need = bundle_total(trial.config.get("bundles") or [])
            what = ", ".join(f"{v:g} {k}" for k, v in need.items()) or "its resources"
            short = [f"{float(have.get(k, 0)):g} {k}" for k, v in need.items() if v > float(have.get(k, 0)) + 1e-9]
            why = (f"that the cluster does not have (it has {', '.join(short)})" if short
                   else "that the cluster never had free (other jobs hold them)")
            self._done(trial, f"not run: waited {RESOURCE_WAIT_SECONDS:.0f} s for {what} {why}; "
                              "run the same command again to run it")

    def on_trial_result(self, iteration: int, trials: list, trial, result: dict, **info) -> None:
        config = self.by_name.get(trial.config.get("name"))
        if config is not None and "round" in result and self.on_result:
            self.on_result(config, result)

    def on_trial_complete(self, iteration: int, trials: list, trial, **info) -> None:
        status = (trial.last_result or {}).get("status")
        if status is None:  # stopped by Tune: the grace after a stop ran out (or Tune ended it)
            status = ("interrupted" if self.grace.stop_since is not None
                      else "failed: the trial ended without a status")
        self._done(trial, status)

    def on_trial_recover(self, iteration: int, trials: list, trial, **info) -> None:
        config = self.by_name.get(trial.config.get("name"))
        if config is not None and self.on_retry:
            self.on_retry(config)

    def on_trial_error(self, iteration: int, trials: list, trial, **info) -> None:
        where = getattr(trial, "path", None) or getattr(trial, "local_path", None) or "its Tune trial directory"
        self._done(trial, f"failed: the trial's process ended ({where}/error.txt)")

    def _done(self, trial, status: str) -> None:
        config = self.by_name.get(trial.config.get("name"))
        if config is None or config["name"] in self.statuses:
            return
        self.statuses[config["name"]] = status
        if self.on_done:
            self.on_done(config, status)
