"""The driver side of a run: start Ray, hand the data to a Coordinator, stream its events into
a RunRecord. Everything that decides what happens lives in the coordinator and the pure core."""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Sequence

import numpy as np
import ray

from ..algorithms import algorithm_class
from ..data import Federation
from ..errors import DPFLError
from ..faults.plan import FaultPlan
from ..runs.record import RunRecord, lists_a_release, may_have_released, read_releases, versions
from ..scenario import Scenario
from . import warm
from .coordinator import coordinator_args, start_coordinator, start_workers
from .checkpoint import (CHECKPOINT, ended_on_its_own, forget_run_secret, rows_covered, run_secret,
                         scenario_fingerprint, write_checkpoint)
from .messages import Pending
from .recovery import add_pending_row, committed_from_checkpoint, head_unreachable, row_of
from .shutdown import Shutdown, kill_descendants, stop_autoscaler_monitor


def ensure_ray(address: str | None = None, pending_signal: Callable[[], int] = lambda: 0) -> bool:
    """Join the cluster ``address`` (or RAY_ADDRESS) names, or start a private local Ray bound to
    127.0.0.1 (runtime/connect.py). Returns True when this call connected (so the caller shuts it down).
    ``pending_signal``: the number of a signal that came meanwhile, or 0 (``Shutdown.first``)."""
    from .connect import connect

    return connect(address, pending_signal=pending_signal)


_RAY_STOPPED = False
_HEAD_LOST = False  # set when the head stopped answering: ray.shutdown() would wait for it


def stop_ray() -> None:
    """Disconnect, and stop every process this one spawned: a private Ray's GCS, raylet, agents
    and workers (also after an interrupted start-up, which ray.shutdown does not know of, and a
    worker left orphaned by its raylet, which is no longer a descendant)."""
    global _RAY_STOPPED
    from .private_ray import own_sessions, start_abandoned, stop_sessions

    sessions = own_sessions()  # a private Ray's: what its processes leave orphaned is found by these
    abandoned = start_abandoned()  # ray.init may still run in its thread: Ray's driver state is not ours to touch
    gone = abandoned or _HEAD_LOST  # nothing left to disconnect from in order
    warm.forget()  # parked workers end with this Ray: their handles must not reach the next one
    if ray.is_initialized() and not gone:
        stop_autoscaler_monitor()  # only ever a child of this process when its Ray is private
        with contextlib.suppress(Exception):
            ray.shutdown()
    kill_descendants()
    stop_sessions(sessions, grace=2.0)
    _RAY_STOPPED = gone or not ray.is_initialized()


def ray_to_watch() -> tuple[str | None, set[int]]:
    """For the run's watcher (runtime/rescue.py): the GCS address of a joined cluster (None for a
    private Ray) and the sessions of a private Ray's processes (empty for a joined cluster)."""
    from .private_ray import own_sessions

    sessions = own_sessions()
    return (None if sessions else _gcs_address()), sessions


def cluster_resources() -> dict:
    """The resources (CPU, GPU, ...) of the Ray this process joined, for sizing pools and trials."""
    return ray.cluster_resources()


def ray_stopped() -> bool:
    """Did :func:`stop_ray` run last and leave nothing of Ray behind in this process (or nothing
    that could still be stopped in order: a start abandoned, a head gone)?"""
    from .private_ray import start_abandoned

    return _RAY_STOPPED and (not ray.is_initialized() or _HEAD_LOST or start_abandoned())


def put_federation(fed: Federation, canaries: int = 0) -> dict:
    """The federation in the object store; ``canaries`` audit clients join it with weight 1."""
    ds = fed.dataset
    weights = np.concatenate([fed.weights, np.ones(canaries)]) if canaries else fed.weights
    x_val, y_val = fed.validation_split()
    return {"x_train": ray.put(ds.x_train), "y_train": ray.put(ds.y_train), "x_test": ray.put(ds.x_test),
            "y_test": ray.put(ds.y_test), "indices": ray.put(fed.indices), "offsets": ray.put(fed.offsets),
            "weights": ray.put(weights), "x_val": ray.put(x_val), "y_val": ray.put(y_val),
            "num_validation": int(len(y_val)),
            "input_shape": list(ds.input_shape), "num_classes": ds.num_classes}


# How long a stopped run waits for the round in flight before it writes what was committed.
STOP_GRACE_SECONDS = 2.0
# Bound on every call to the coordinator while it is healthy.
CALL_TIMEOUT_SECONDS = 60.0
# A stopped run's first worker answers for model.pt from its own thread, mid-round too (ClientWorker.model_file);
# one still starting, or hung, gets this long, then the file is made here.
MODEL_FILE_GRACE_SECONDS = 3.0


def run_scenario(scenario: Scenario, fed: Federation, record: RunRecord,
                 on_event: Callable[[dict], None] | None = None, shutdown: Shutdown | None = None,
                 poll_seconds: float = 0.2, resume: dict | None = None, startup: dict | None = None,
                 theta0: np.ndarray | None = None, started_at: float | None = None,
                 keep_workers: bool = True, workers: int | None = None) -> dict:
    """Run a scenario on the connected Ray; returns the summary (also written to summary.json).

    Every round reaches ``rounds.jsonl`` as soon as the coordinator commits it. When the run is
    interrupted (any signal of ``shutdown``) or fails, the coordinator is stopped between rounds,
    and ``rounds.jsonl``, ``ledger.json``, ``model.pt`` and ``summary.json`` are written for the
    same last committed round. Every ``output.checkpoint_every`` rounds a checkpoint is written
    (runtime/checkpoint.py); ``resume`` continues from one (``record`` then holds its rows).
    ``startup``: seconds the caller spent before the run (loading data, joining Ray), for the
    summary's ``timings``. ``theta0``: the initial model (models.initial_theta) if the caller
    built it; else the first worker builds it (when the pool starts at once), and model.pt comes
    from that worker too: the driver loads no torch (about 2 s of CPU per run), except for a pool
    that waits for resources and for the model of a run whose workers are gone or busy.
    ``started_at``: when the caller began (before Ray started, and any second try of that start):
    the summary's wall time counts from there. ``keep_workers``: park the workers and coordinator
    of a run whose coordinator returned (an error of its own included), neither interrupted nor
    asked to stop, for this process's next run (runtime/warm.py). ``workers``: the pool's size,
    where the caller reserved it (a sweep trial's placement group); else as many as the cluster fits.

    When the coordinator is lost (its actor died, or the Ray head stopped answering), the files
    are written for the round of the last checkpoint the driver holds, ``rounds.jsonl`` is cut back
    to it, and the error names what was lost and the ``--resume`` command.
    """
    t0 = time.time()
    timings = Timings(t0, dict(startup or {}))
    shutdown = shutdown or Shutdown()
    record.write_scenario(scenario.to_yaml())
    coord, run_ref, seen, stop_reason, error, lost = None, None, 0, "completed", None, None
    pool, shape = [], (0.0, 0.0)
    answered = False  # has the coordinator replied yet (its process may still be starting)?
    returned = False  # has the coordinator's run() returned (then nothing of the run is in flight there)?
    sent = _Sent()
    last_checkpoint = resume  # the driver's own copy of the committed state
    try:
        # rounds an earlier attempt released: released again alike, or not at all (privacy/reruns.py)
        released = read_releases(record.path, None if resume else scenario_fingerprint(scenario)["scenario_sha256"],
                                 field="--resume" if resume else "--out")
        audit = scenario.privacy.audit
        data = put_federation(fed, audit.canaries if audit else 0)
        timings.mark("data_in_object_store")
        pool, shape, starting = start_workers(scenario, data, fed.num_clients, workers)
        # the coordinator waits for it while its own process starts; a worker that may wait for
        # another run's resources would hold the coordinator's first reply: then it is built here
        if theta0 is None and pool and starting:
            theta0 = Pending(pool[0].initial_model.remote())
        # privacy.randomness: os -- a resumed run draws from the secret its first rounds drew from
        secret = run_secret(record.path, scenario.privacy.randomness)
        args = coordinator_args(scenario, data, pool, resume, FaultPlan.from_scenario(scenario), theta0, secret,
                                released)
        # a coordinator parked by this process's last run (runtime/warm.py), else a fresh one
        coord = warm.take_coordinator(args, lambda ref: _ask(ref, shutdown=shutdown))
        if coord is None:
            coord = start_coordinator(args)
        timings.mark("actors_requested")
        run_ref = coord.run.remote()
        every = scenario.output.checkpoint_every
        next_checkpoint = (len(record.rounds) // every + 1) * every if every else None
        while True:
            if shutdown.requested:  # signals are only recorded (runtime/shutdown.py): this is where a run stops
                raise KeyboardInterrupt("signal received earlier")
            done, _ = ray.wait([run_ref], timeout=0)
            # returns at once when a release is listed, else within poll_seconds; asking again after
            # writing the events is what lets a listed release go ahead (Coordinator._await_listings)
            events = _ask(coord.events.remote(seen, 0.0 if done else poll_seconds), shutdown=shutdown)
            answered = True
            with shutdown.defer():
                before = len(record.rounds)
                seen = _write_events(events, seen, record, on_event, written=_tell_written(coord, sent))
                if len(record.rounds) > before:
                    timings.rounds_seen()
                if next_checkpoint is not None and len(record.rounds) >= next_checkpoint:
                    seen, last_checkpoint = _checkpoint(coord, seen, record, on_event, sent)
                    next_checkpoint = (last_checkpoint["round"] // every + 1) * every
            if done:
                result = _ask(run_ref)
                returned = True
                stop_reason, error = result["stop_reason"], result.get("error")
                if error:  # a rerun round that would have released otherwise (privacy/reruns.py)
                    error += _rerun_hint(record.path)
                break
    except KeyboardInterrupt:
        stop_reason = "interrupted"
        if answered:  # else its process may still be starting: nothing to wait for
            seen = _stop_between_rounds(coord, run_ref, seen, record, on_event)
    except LOST as err:  # asking the coordinator for its state would fail too, or wait for minutes
        stop_reason, error, lost = "error", _lost(err), err
    except ray.exceptions.RayError as err:
        stop_reason, error = "error", _one_line(err)
    except Exception as err:  # noqa: BLE001 - e.g. an OSError writing a row: the summary still gets written
        stop_reason = "error"
        error = _one_line(err) if isinstance(err, DPFLError) else f"{type(err).__name__}: {_one_line(err)}"
        seen = _stop_between_rounds(coord, run_ref, seen, record, on_event)
    if shutdown.requested:
        stop_reason = shutdown.stop_reason
    # A coordinator that is lost, or has not answered yet, is not asked (that would wait for it):
    # the state is then the driver's last checkpoint, or the initial one if no round was seen.
    state = (_committed(coord, scenario, fed, seen, record, on_event) if coord is not None and answered and not lost
             else None)
    if state is None and last_checkpoint is not None:
        state = committed_from_checkpoint(scenario, fed, last_checkpoint)
        record.close()
        record = RunRecord.reopen(record.path, rows_covered(last_checkpoint))
        add_pending_row(scenario, fed, record, last_checkpoint)
    elif state is None and not record.rounds:
        state = _initial_state(scenario)
    if stop_reason == "stopped_early" and len(record.rounds) >= scenario.training.rounds:
        stop_reason = "completed"  # the scheduler's stop came after the last round
    wall = time.time() - (t0 if started_at is None else started_at)
    clean = error is None and stop_reason != "interrupted" and not shutdown.requested
    # a stopped run's first worker may still be starting or be hung: it gets a moment, then torch loads here
    summary = finish(scenario, fed, record, state, stop_reason, error, wall, timings, () if lost else pool,
                     CALL_TIMEOUT_SECONDS if clean else MODEL_FILE_GRACE_SECONDS)
    # the os secret goes once nothing can run a released round again: the run finished, or it released none.
    # Rounds released before a first checkpoint keep it: a sweep starts such a run again from it (move_aside),
    # and its listed releases are checked with a key drawn from it (privacy/reruns.py).
    if ended_on_its_own(summary) or not ((record.path / CHECKPOINT).exists() or record.rounds
                                         or lists_a_release(record.path)):
        forget_run_secret(record.path)
    if keep_workers and returned and stop_reason != "interrupted" and not shutdown.requested:
        # for this driver's next run (runtime/warm.py): a run() that returned has nothing in flight
        # in the coordinator, and its last call to the workers (their stack padding) queued behind
        # every other; one that does not answer release in time is killed
        warm.park(*shape, pool)
        if sent.done(warm.RELEASE_SECONDS):
            warm.park_coordinator(coord)
    if lost is not None and last_checkpoint is not None:
        raise DPFLError(f"{error}: the run stopped after round {summary['rounds_completed']}; model.pt, ledger.json "
                        f"and summary.json are for that round; resume with: dpfl run --resume {record.path}")
    if error:
        raise DPFLError(f"run failed after {summary['rounds_completed']} rounds ({record.path}): {error}")
    return summary


class HeadLost(Exception):
    """The Ray head (its GCS) stopped answering while the driver waited for the coordinator."""


# What a lost coordinator raises in the driver: its actor died, Ray could not reach it, the head
# is gone, or it stopped answering within CALL_TIMEOUT_SECONDS.
LOST = (ray.exceptions.RayActorError, ray.exceptions.RaySystemError, ray.exceptions.GetTimeoutError, HeadLost)
# While a reply is late, how often the driver checks that the head still answers (a TCP connect)
# and that no signal came.
HEAD_CHECK_SECONDS = 0.2


def _gcs_address() -> str | None:
    try:
        return ray.get_runtime_context().gcs_address
    except Exception:  # noqa: BLE001 - only used to say what was lost, and to notice it sooner
        return None


def _ask(ref, timeout_s: float = CALL_TIMEOUT_SECONDS, shutdown: Shutdown | None = None):
    """``ray.get(ref)`` within ``timeout_s``. When the head stops, Ray's own calls neither fail nor
    return for half a minute and more (measured: 23-33 s on this 2-core machine), and
    ``ray.shutdown()`` then waits for it too: so every HEAD_CHECK_SECONDS without a reply the
    driver checks that the head's GCS still takes connections, and stops with HeadLost if not.
    A signal recorded by ``shutdown`` meanwhile ends the wait (KeyboardInterrupt): the first reply
    waits for the coordinator's process to start, seconds on a loaded machine."""
    global _HEAD_LOST
    end = time.monotonic() + timeout_s
    while True:
        ready, _ = ray.wait([ref], timeout=max(0.0, min(HEAD_CHECK_SECONDS, end - time.monotonic())))
        if ready:
            return ray.get(ref, timeout=max(1.0, end - time.monotonic()))
        if shutdown is not None and shutdown.requested:
            raise KeyboardInterrupt("signal received earlier")
        gcs = _gcs_address()
        if head_unreachable(gcs):
            _HEAD_LOST = True
            raise HeadLost(f"the Ray head at {gcs} is unreachable")
        if time.monotonic() >= end:
            return ray.get(ref, timeout=0)  # GetTimeoutError


def _lost(err: Exception) -> str:
    """What was lost, in one line: the head, if it no longer answers, else the coordinator."""
    global _HEAD_LOST
    gcs = _gcs_address()
    if isinstance(err, HeadLost) or head_unreachable(gcs):
        _HEAD_LOST = True
        return f"the Ray head at {gcs} is unreachable; the coordinator was lost with it"
    return f"the coordinator was lost ({type(err).__name__}: {_one_line(err)})"


def _rerun_hint(run_dir) -> str:
    """What a run stopped by a rerun check can do: go again, where another attempt can go alike."""
    again = (f"dpfl run --resume {run_dir}, or the same sweep command" if (run_dir / CHECKPOINT).exists()
             else "the same sweep command; without a checkpoint dpfl run cannot go on")
    return f"; an attempt whose clients survive alike releases the same values: run it again ({again})"


def _stop_between_rounds(coord, run_ref, seen: int, record: RunRecord, on_event=None) -> int:
    """Ask the coordinator (if it exists yet) to stop after the round in flight, and give that
    round (if the run has begun) a moment, writing its events meanwhile: a release it listed
    before the stop waits for its line on disk (Coordinator._await_listings), and is handed to
    ``on_event`` as in the run (rows are not). Returns the events read."""
    if coord is None:
        return seen
    with contextlib.suppress(ray.exceptions.RayError):
        # applied before the events are read: a release is listed by then, or never made (Coordinator._list)
        ray.get(coord.stop.remote(), timeout=STOP_GRACE_SECONDS)
    end = time.monotonic() + STOP_GRACE_SECONDS
    releases = _releases_only(on_event)
    while run_ref is not None and time.monotonic() < end:
        try:
            if ray.wait([run_ref], timeout=0)[0]:
                break
            events = ray.get(coord.events.remote(seen, min(0.2, end - time.monotonic())), timeout=STOP_GRACE_SECONDS)
            seen = _write_events(events, seen, record, releases, written=_tell_written(coord))
        except Exception:  # noqa: BLE001 - what is not written is not released; the round may still end
            with contextlib.suppress(ray.exceptions.RayError):
                ray.wait([run_ref], timeout=max(0.0, end - time.monotonic()))
            break
    with contextlib.suppress(ray.exceptions.RayError):  # a release still waiting for its listing is not made
        if run_ref is not None and not ray.wait([run_ref], timeout=0)[0]:
            coord.abandon.remote()
    return seen


def _write_events(events: list[dict], seen: int, record: RunRecord, on_event, up_to: int | None = None,
                  written: Callable[[int], object] | None = None) -> int:
    """Write the events to releases.jsonl and rounds.jsonl (up to round ``up_to``); returns how
    many events have been read in all. The batch's listings go first: once they are on disk and
    handed to ``on_event`` (which may send them on), ``written(count)`` tells the coordinator, whose
    releases wait for that (Coordinator._await_listings), before the rows go to ``on_event`` (a
    sweep trial's report to Tune may wait). Nothing is written twice: a batch cut short by a failed
    write is read again from its start."""
    end, last = _write_listings(events, record, on_event, up_to)
    if last is not None and written is not None:
        written(seen + last + 1)
    for ev in events[:end]:
        if ev.get("event") == "round" and (not record.rounds or ev["round"] > record.rounds[-1]["round"]):
            record.add_round(row_of(ev))
        seen += 1
        if on_event and ev.get("event") != "release":
            on_event(ev)
    return seen


def _write_listings(events: list[dict], record: RunRecord, on_event, up_to: int | None = None
                    ) -> tuple[int, int | None]:
    """Write the listings among ``events`` (up to round ``up_to``'s row) to releases.jsonl and hand
    each to ``on_event``; returns where the events up to ``up_to`` end and the last listing's index
    (None if none)."""
    end = len(events)
    if up_to is not None:
        end = next((i for i, ev in enumerate(events) if ev.get("event") == "round" and ev["round"] > up_to), end)
    last = None
    for i in range(end):
        if events[i].get("event") == "release":  # a round the server saw, whatever becomes of its row
            record.add_release(events[i])
            if on_event:
                on_event(events[i])
            last = i
    return end, last


def _releases_only(on_event) -> Callable[[dict], None] | None:
    """``on_event`` for listings alone: where a run that stops hands them on (a sweep trial on
    another node sends them to the sweep's node), but shows no more rows."""
    return (lambda ev: on_event(ev) if ev.get("event") == "release" else None) if on_event else None


class _Sent:
    """The driver's calls to its coordinator that await no reply (``written``). A threaded actor
    may run calls out of order, so one still pending when a run ends could land in the next run the
    coordinator serves, parked (runtime/warm.py), and acknowledge a listing of that run before it is
    written: the coordinator is parked only once every one of them has run."""

    def __init__(self):
        self.refs: list = []

    def __call__(self, ref) -> None:
        self.refs.append(ref)
        if len(self.refs) >= 64:  # keep those still pending
            self.refs = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)[1]

    def done(self, timeout_s: float) -> bool:
        return not self.refs or not ray.wait(self.refs, num_returns=len(self.refs), timeout=timeout_s)[1]


def _tell_written(coord, sent: _Sent | None = None) -> Callable[[int], None]:
    """How the driver tells ``coord`` that events are written (no reply awaited; kept in ``sent``)."""
    def tell(count: int) -> None:
        ref = coord.written.remote(count)
        if sent is not None:
            sent(ref)
    return tell


def _checkpoint(coord, seen: int, record: RunRecord, on_event, sent: _Sent | None = None) -> tuple[int, dict]:
    """Write checkpoint.npz for the coordinator's committed state, after every row it covers;
    returns the events read so far and the state."""
    state = _ask(coord.checkpoint.remote())
    events = _ask(coord.events.remote(seen))
    seen = _write_events(events, seen, record, on_event, up_to=state["round"], written=_tell_written(coord, sent))
    write_checkpoint(record.path, state)
    return seen, state


def _committed(coord, scenario, fed, seen: int, record: RunRecord, on_event=None) -> dict | None:
    """The coordinator's committed state, with every row it covers written; None if it is gone, or
    if a listing of a release in it cannot be written (or handed to ``on_event``): its model is
    then not published."""
    if coord is None:
        return None
    try:
        state = _ask(coord.committed.remote())
        events = _ask(coord.events.remote(seen))
    except (ray.exceptions.RayError, HeadLost):
        return None
    try:
        _write_listings(events, record, _releases_only(on_event), up_to=state["rounds"])
    except Exception:  # noqa: BLE001 - an OSError, or the sweep's node not answering
        return None
    with contextlib.suppress(OSError):  # rows that still cannot be written: the summary says why
        _write_events(events, seen, record, None, up_to=state["rounds"])
    return state


NO_MODEL = ("none: the run stopped before its coordinator began; its initial model is built from scenario.yaml's "
            "model and seed alone (training.models.initial_theta)")


def _initial_state(scenario) -> dict:
    """What a run that never got a coordinator leaves: no model (NO_MODEL) and an empty ledger."""
    p = scenario.privacy
    state = {"rounds": 0, "theta": None, "summary": {}}
    if algorithm_class(scenario).private:
        from ..privacy import PrivacyLedger  # dp_accounting and scipy: 0.7 s a non-private run does not need

        state["ledger"] = {**PrivacyLedger(p.accountant, p.delta).to_dict(), "noise_multiplier": p.noise_multiplier,
                           "randomness": p.randomness}
    return state


class Timings:
    """Wall-clock marks of one run, in seconds since the run started (issue #14: where start-up
    time goes). Rounds: when the driver first saw a committed round, and the last."""

    def __init__(self, t0: float, startup: dict):
        self.t0, self.marks = t0, {f"{k}_seconds": round(float(v), 3) for k, v in startup.items()}

    def mark(self, name: str) -> None:
        self.marks[f"{name}_seconds"] = round(time.time() - self.t0, 3)

    def rounds_seen(self) -> None:
        if "first_round_committed_seconds" not in self.marks:
            self.mark("first_round_committed")
        self.mark("last_round_committed")

    def to_dict(self) -> dict:
        return dict(self.marks)


def not_carried_out(rounds: Sequence[dict]) -> dict[str, list[int]]:
    """{planned fault (``node_failure@PHASE``): the rounds in which it could not be carried out},
    from the rows' ``faults_not_carried_out`` (runtime/chaos.strike): a node loss planned on a Ray
    with no node to remove but the head and the coordinator's."""
    out: dict[str, list[int]] = {}
    for r in rounds:
        for fault in r.get("faults_not_carried_out") or ():
            out.setdefault(fault, []).append(r["round"])
    return out


def final_figures(rounds: Sequence[dict]) -> dict:
    """The summary's ``final_accuracy`` and ``final_loss``: the last evaluated round's. When that is
    not the last committed round (a run stopped between two evaluations of ``output.eval_every``),
    ``final_evaluated_round`` names it: the figures are not those of the model in model.pt. (A budget
    stop evaluates its final model instead: the coordinator's figures replace these.)"""
    evaluated = next((r for r in reversed(rounds) if r.get("test_accuracy") is not None), None)
    if evaluated is None:
        return {"final_accuracy": None, "final_loss": None}
    figures = {"final_accuracy": evaluated["test_accuracy"], "final_loss": evaluated.get("test_loss")}
    if evaluated.get("round") != rounds[-1].get("round"):
        figures["final_evaluated_round"] = evaluated.get("round")
    return figures


# The epsilons a round's row reports beside its ``epsilon`` that the summary repeats from the last row.
ROW_EPSILONS = ("epsilon_nominal", "epsilon_claimed", "epsilon_median", "epsilon_min")


def finish(scenario, fed, record, state: dict | None, stop_reason, error, wall, timings: Timings | None = None,
           workers: Sequence = (), workers_wait_s: float = CALL_TIMEOUT_SECONDS) -> dict:
    """Write ledger.json, model.pt, summary.json (and the checkpoint, audit and plots) for
    ``state``: what the coordinator committed (``Coordinator.committed``), or None if it is gone.
    ``workers``: the run's workers, the first of which makes model.pt's bytes if it answers within
    ``workers_wait_s`` (else this process loads torch to make them)."""
    rounds = record.rounds
    summary = {"name": scenario.name, **final_figures(rounds),
               "rounds_completed": len(rounds), "rounds_planned": scenario.training.rounds,
               "stop_reason": stop_reason, "wall_seconds": round(wall, 3), "seed": scenario.seed,
               "versions": versions()}
    if error:
        summary["error"] = error
    try:
        again = {r: v for r, v in read_releases(record.path).items() if r > len(rounds) and may_have_released(v)}
    except DPFLError as err:
        again, summary["releases_unreadable"] = {}, str(err)
    if again:  # the server saw them, and this run has not released them again: not in its ledger yet
        summary["released_before_resume"] = {
            "rounds": sorted(again), "epsilon": max((v["epsilon"] for v in again.values()
                                                      if isinstance(v.get("epsilon"), (int, float))), default=None),
            "note": "listed as released, by an earlier attempt of this run or by this one after its last committed "
                    "round (releases.jsonl), and not in this run's ledger; epsilon is the ledger's after them where "
                    "that attempt committed them (null where none did), a bound on everything released until "
                    "these rounds run again alike"}
    missed = not_carried_out(rounds)
    if missed:
        summary["faults_not_carried_out"] = missed
    client_acc = next((r["client_accuracy"] for r in reversed(rounds) if "client_accuracy" in r), None)
    if client_acc is not None:  # rounds.jsonl keeps every client's figure; the summary the groups
        summary["client_accuracy"] = {k: v for k, v in client_acc.items() if k != "per_client"}
    ledger = state.get("ledger") if state else None
    if ledger is not None:
        record.write_json("ledger.json", ledger)
        last = rounds[-1] if rounds else {}
        summary.update(epsilon=last.get("epsilon"), delta=scenario.privacy.delta,
                       accountant=ledger.get("accountant", scenario.privacy.accountant),
                       dp_covered=ledger.get("fully_covered"),
                       noise_multiplier=ledger.get("noise_multiplier"),
                       noise_multiplier_booked=ledger.get("noise_multiplier_booked"),
                       epsilon_vs_server=ledger.get("epsilon_vs_server"),
                       epsilon_vs_server_note=ledger.get("epsilon_vs_server_note"),
                       randomness=ledger.get("randomness"), adjacency=ledger.get("adjacency"),
                       adjacency_public=ledger.get("adjacency_public"))
        if ledger.get("accountant_used"):
            # bounded accounting (privacy/bounded_pld.py): which accountant gave the figure, and why
            summary["accountant_used"] = ledger["accountant_used"]
            note = (ledger.get("accountant_details") or {}).get("note")
            if note:
                summary["accountant_note"] = note
        if "assumption" in ledger:  # beside epsilon, never instead of it (Mechanism.assumed_noise_multipliers)
            summary.update(epsilon_assumed=ledger["epsilon_assumed"], assumption=ledger["assumption"],
                           noise_multiplier_assumed=ledger["noise_multiplier_assumed"])
        if ledger.get("record_level"):  # one ledger per client: the row's epsilon is the worst client's
            summary["record_level"] = True
        summary.update({k: last[k] for k in ROW_EPSILONS if k in last})
    elif state is None and rounds and "epsilon" in rounds[-1]:
        # a private run whose coordinator was lost before any checkpoint: its ledger went with it,
        # but the rows kept each committed round's epsilon, and the summary must not drop what was spent
        last = rounds[-1]
        summary.update(epsilon=last["epsilon"], delta=scenario.privacy.delta,
                       ledger="unavailable: the coordinator died before handing it back; epsilon is the last "
                              "row's of rounds.jsonl (a round committed after it, still awaiting its "
                              "evaluation, is not in it)")
        summary.update({k: last[k] for k in (*ROW_EPSILONS, "epsilon_assumed") if k in last})
    if state is not None and "checkpoint" in state and scenario.output.checkpoint_every:
        write_checkpoint(record.path, state["checkpoint"])
    if state is not None and "audit" in state:  # the canaries' statistics: `dpfl audit` reads them
        record.write_json("audit.json", state["audit"])
        summary["epsilon_empirical"] = state["epsilon_empirical"]
        if ledger is not None:
            ledger["epsilon_empirical"] = state["epsilon_empirical"]
            record.write_json("ledger.json", ledger)
    if state is None:
        summary["model"] = "unavailable: the coordinator died before handing it back"
    elif state["theta"] is None:  # no model.pt: building the initial one would load torch into a stopping process
        summary.update(state["summary"])
        summary["model"] = NO_MODEL
    else:
        summary.update(state["summary"])
        record.write_model_file(_model_file(scenario, fed, state["theta"], workers, workers_wait_s))
    if timings is not None:
        timings.mark("files_written")
        summary["timings"] = timings.to_dict()
    record.write_json("summary.json", summary)
    record.close()
    record.plot_accuracy()
    if ledger is not None:
        record.plot_privacy()
    return summary


def _model_file(scenario, fed, theta: np.ndarray, workers: Sequence, wait_s: float) -> bytes:
    """model.pt's bytes for ``theta``: from the first of ``workers``, which has torch loaded, or built
    here where it does not answer within ``wait_s``."""
    if workers:
        try:
            return _ask(workers[0].model_file.remote(theta), timeout_s=wait_s)
        except (ray.exceptions.RayError, HeadLost):
            pass
    from ..training.models import model_file_bytes

    return model_file_bytes(scenario.model, fed.dataset.input_shape, fed.dataset.num_classes, theta)


def write_unstarted(scenario: Scenario, fed: Federation, record: RunRecord, wall: float,
                    stop_reason: str = "interrupted", error: str | None = None) -> dict:
    """The files of a run stopped before its coordinator existed: 0 rounds, and no model (NO_MODEL)."""
    record.write_scenario(scenario.to_yaml())
    return finish(scenario, fed, record, _initial_state(scenario), stop_reason, error, wall)


def _one_line(err: Exception) -> str:
    cause = getattr(err, "cause", None)  # a RayTaskError: the user's mistake the remote task raised, as itself
    if isinstance(cause, DPFLError):
        err = cause
    lines = [ln.strip() for ln in str(err).strip().splitlines() if ln.strip()]
    return lines[-1] if lines else type(err).__name__
