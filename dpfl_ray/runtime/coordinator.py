"""Coordinator: the actor that owns the round loop (ARCHITECTURE.md, 'One round, one story').

sample -> plan faults -> begin_round -> broadcast (one ray.put) -> local updates (one message per
worker; SecAgg rounds: advertise keys -> share keys -> masked input -> after_upload -> unmask) ->
finish -> account -> evaluate -> commit. The algorithm plugs into these phases through its
interface; the driver only starts the coordinator and reads its events and committed state.
In a round without SecAgg, the evaluation of round t's model is carried by round t+1's training
calls (``_settle``): round t commits at once, and its event follows when the figures arrive.
"""
from __future__ import annotations

import dataclasses
import sys
import threading
import time
from typing import NamedTuple

import numpy as np
import ray
from ray.exceptions import GetTimeoutError, RayActorError

from ..algorithms import Abort, Aggregate, RoundOutcome, algorithm_class, make_algorithm
from ..faults.plan import CRASH, REJECTED, STRAGGLER, FaultPlan, overcommitted, tally
from ..training.evaluation import combine_shards, eval_shards
from ..privacy.randomness import DPRandomness
from ..privacy.reruns import RerunDiverged, RerunGuard, rerun_key
from ..privacy.client_sampling import sample_clients
from ..scenario import Scenario
from ..runs.record import client_accuracy_summary
from .messages import Canaries, Pending
from .resources import PoolPlan, assign_clients, assign_groups, deal, plan_pool, summation_groups, undeal
from .chaos import strike
from .checkpoint import scenario_fingerprint
from .cluster import placement_summary
from .messages import WorkerChaos
from .secagg_round import real_deadline, secagg_round, unplanned_wait
from . import warm
from .workers import make_worker_class


CALL_TIMEOUT_SECONDS = 120.0
MAX_REPLACEMENTS = 100  # worker deaths a run survives before it stops with an error
BUDGET_REFUSAL = "releasing this round would take the effective epsilon past privacy.target_epsilon"
STOPPING = "the run was asked to stop before this round released"
# How long a round waits for the driver to have written what it lists of a release (_await_listings)
# before it releases nothing and stops the run: the driver's calls are bounded by a minute as well.
LISTING_TIMEOUT_SECONDS = 60.0


class _Halted(Exception):
    """The round in flight stopped before its release (the run was asked to stop): not committed."""


class Coordinator:
    def __init__(self, scenario: dict, data: dict, theta0: np.ndarray | Pending, workers: list | None = None,
                 resume: dict | None = None, fault_plan: FaultPlan | None = None, dp_secret: bytes | None = None,
                 released: dict | None = None):
        """``data`` holds object refs (nested, so Ray hands them over unresolved) of the training
        arrays, plus the test set, partition and weights. ``theta0``: the initial model, flat, or
        Pending on the worker that builds it (this actor imports no torch unless it must, a second
        of CPU at every start). ``workers``: a pool the driver started next to this actor (so both
        start at once); None starts one in ``start_pool``. ``resume``: a checkpoint (runtime/checkpoint.py) to
        continue from. ``fault_plan``: built by the driver, which has the scenario's files (an
        availability trace). ``dp_secret``: the run's root of DP randomness in mode 'os'
        (runtime/checkpoint.py, ``run_secret``); a fresh one if None. ``released``: the rounds the run
        released in earlier attempts (runs/record.py, ``read_releases``), which it releases again only
        alike (privacy/reruns.py)."""
        self.sc = Scenario.model_validate(scenario, context={"read_files": False})
        self.faults = fault_plan or FaultPlan.from_scenario(self.sc)
        self.sampling = overcommitted(self.sc.sampling)
        # the client sample is a DP draw too (amplification by sampling): 'os' draws it from a secret
        randomness = DPRandomness.create(self.sc.privacy.randomness, self.sc.seed, dp_secret)
        self.sample_randomness = randomness.child("sample")
        self.reruns = RerunGuard(rerun_key(randomness), released)
        self._scenario_sha256 = scenario_fingerprint(self.sc)["scenario_sha256"]
        self._diverged: str | None = None  # why the round in flight must not be released (privacy/reruns.py)
        self._halted = False  # the round in flight was asked to stop before it released
        self._announced = False  # the round in flight is listed as about to release
        self._data = data
        self.x_test, self.y_test, offsets, self.weights = ray.get(
            [data[k] for k in ("x_test", "y_test", "offsets", "weights")], timeout=CALL_TIMEOUT_SECONDS)
        self.sizes = np.diff(offsets)
        self.num_real = len(self.sizes)
        self.model = None  # built only if the coordinator must evaluate by itself
        if isinstance(theta0, Pending):
            theta0 = ray.get(theta0.ref, timeout=CALL_TIMEOUT_SECONDS)
        self.theta = np.array(theta0, dtype=np.float32)
        audit = self.sc.privacy.audit
        self.audit = None
        alg_sizes = self.sizes
        if audit is not None:
            # Andrew et al. 2024: k canary clients join the population (their weight, 1, is in the
            # federation's weights); they have no data: one example each, for load balancing only
            from ..privacy.audit import AuditAccumulator

            self.audit = AuditAccumulator(int(self.theta.size), audit.canaries,
                                          self.sc.seed if audit.seed is None else audit.seed)
            alg_sizes = np.concatenate([self.sizes, np.full(audit.canaries, self.sizes.max())])
            self.sizes = np.concatenate([self.sizes, np.ones(audit.canaries, dtype=self.sizes.dtype)])
        cls = algorithm_class(self.sc)
        self.privacy = None
        if cls.private:  # dp_accounting (and scipy) load only in a coordinator that accounts
            from .privacy import ClientPrivacy, RunPrivacy

            self.privacy = (ClientPrivacy if cls.record_level else RunPrivacy)(self.sc, self.weights, alg_sizes)
        self.has_validation = data.get("num_validation", 0) > 0
        self.algorithm = make_algorithm(self.sc, self.weights, self.privacy.noise_multiplier if self.privacy else None,
                                        sizes=alg_sizes,
                                        randomness=randomness.child("algorithm") if cls.private else None)
        self.algorithm.bind_model(int(np.asarray(theta0).size))
        if self.privacy:
            self.privacy.bind(self.algorithm)
        # Evaluate round t's model inside round t+1's training calls: in a round without SecAgg,
        # each worker evaluates the broadcast model on its share of the test ranges before it
        # trains (no call of its own, no second round trip). Not when the algorithm reads the
        # figures before the next round, or a validation split must be evaluated with them.
        self.overlap_eval = not (self.sc.secagg.enabled or self.has_validation or self.algorithm.reads_evaluation())
        self._events: list[dict] = []
        # Guards what the driver may read while a round runs: a round's ledger entry, the model it
        # produced and its event are committed together, so a reader never sees one without the others.
        self._lock = threading.Lock()
        # Wakes a driver waiting for a listing to write (``events``), and a release waiting until it
        # is written (``_await_listings``); held through ``_lock``.
        self._listed = threading.Condition(self._lock)
        self._written = 0  # events the driver has written: it asks for those after them
        self._to_write = 0  # events up to the last listing (_list): written before what it lists is released
        self._listing_s = 0.0
        self._late = ""  # why listings are no longer written (one was not in time): nothing more is released
        self._over = False  # run() has returned: a waiting driver reads at once
        self._stop = threading.Event()
        # A committed round whose test evaluation rides on the next round's training calls, and the
        # model to evaluate: (its record, theta). Its event is emitted once it is evaluated
        # (_settle). Lock order: _settle_lock, then _lock.
        self._pending: tuple[dict, np.ndarray] | None = None
        self._settle_lock = threading.Lock()
        self.rounds_done = 0
        self.replacements = 0
        self._running = False
        self._nodes: dict = {}
        plan = plan_pool(self.sc.resources, ray.cluster_resources(), len(self.sizes))
        self._worker_cls = make_worker_class(plan.num_cpus, plan.num_gpus)
        self._worker_cls_resources = (plan.num_cpus, plan.num_gpus)
        self._pool_size = plan.workers
        self.workers: list = list(workers or [])
        self.groups = summation_groups(int(self.theta.size))
        self.final_eval: dict = {}  # the final model's evaluation, when the last round had none
        self._missed: list[str] = []  # planned faults the round in flight could not carry out (chaos.strike)
        self.pool: dict = {}
        if resume is not None:
            self._restore(resume)
        self._snapshot_algorithm()
        _one_torch_thread()  # an algorithm may have brought torch in; it runs on one core here

    def rebind(self, scenario: dict, data: dict, theta0: np.ndarray | Pending, workers: list | None = None,
               resume: dict | None = None, fault_plan: FaultPlan | None = None, dp_secret: bytes | None = None,
               released: dict | None = None) -> bool:
        """Serve another run (runtime/warm.py): every attribute the last run set is dropped and
        ``__init__`` runs anew, so the coordinator is the one a fresh process would be; only the
        imports (dp_accounting, torch where it evaluated) and the process stay."""
        self.__dict__.clear()
        self.__init__(scenario, data, theta0, workers, resume, fault_plan, dp_secret, released)
        return True

    def release(self) -> bool:
        """Drop the finished run's state (its model, ledgers, worker handles) while parked; False,
        and nothing dropped, while a run is still in ``run``."""
        if getattr(self, "_running", False):
            return False
        self.__dict__.clear()
        return True

    # -- checkpoints ------------------------------------------------------------------------------
    def checkpoint(self) -> dict:
        """The committed state, read in one piece: enough to continue the run exactly. A round still
        awaiting its evaluation is in it as ``pending``, its record without the figures."""
        with self._lock:
            return self._checkpoint()

    def _snapshot_algorithm(self) -> None:
        """The algorithm's state and summary as of the last committed round. The round in flight
        changes the live algorithm outside the lock (its ledgers, sigma), so a checkpoint read from
        it could hold half of the next round, or fail on a dict that grew while it was copied."""
        self._algorithm_state = self.algorithm.state_dict() if self.sc.output.checkpoint_every else None
        self._algorithm_summary = self.algorithm.summary_fields()

    def _checkpoint(self) -> dict:
        state = {"round": self.rounds_done,
                 "pending": None if self._pending is None else dict(self._pending[0]),
                 "algorithm": self._algorithm_state, "arrays": {"theta": self.theta},
                 **scenario_fingerprint(self.sc)}  # dpfl run --resume refuses an edited scenario.yaml
        if self.privacy:
            privacy = self.privacy.state_dict(self.rounds_done)
            state["arrays"].update({f"privacy.{k}": v for k, v in privacy.pop("arrays").items()})
            state["privacy"] = privacy
        if self.audit is not None:
            audit = self.audit.state_dict()
            state["audit"] = {k: v for k, v in audit.items() if not isinstance(v, np.ndarray)}
            state["arrays"].update({f"audit.{k}": v for k, v in audit.items() if isinstance(v, np.ndarray)})
        return state

    def _restore(self, state: dict) -> None:
        self.theta = np.asarray(state["arrays"]["theta"], dtype=np.float32)
        self.rounds_done = int(state["round"])
        if state.get("pending"):  # its evaluation comes with the first round run from here
            self._pending = (dict(state["pending"]), self.theta)
        self.algorithm.load_state_dict(state["algorithm"])
        if self.privacy:
            arrays = {k.removeprefix("privacy."): v for k, v in state["arrays"].items() if k.startswith("privacy.")}
            self.privacy.load_state_dict({**state["privacy"], "arrays": arrays})
        if self.audit is not None:
            arrays = {k.removeprefix("audit."): v for k, v in state["arrays"].items() if k.startswith("audit.")}
            self.audit.load_state_dict({**state["audit"], **arrays})

    # -- the pool -------------------------------------------------------------------------------
    def _new_worker(self):
        return self._worker_cls.remote(self.sc.model_dump(mode="json"), self._data)

    def start_pool(self) -> list[dict]:
        """Create the ClientWorkers (once) and return where each landed (node, GPU ids)."""
        if not self.workers:
            self.workers = [self._new_worker() for _ in range(self._pool_size)]
        infos = self.worker_info()
        self._nodes = {w: info["node"] for w, info in zip(self.workers, infos) if info}
        return infos

    def worker_handle(self, i: int):
        return self.workers[i]

    def worker_info(self) -> list[dict | None]:
        """Where each worker runs; None for one that is dead (it surfaces in its round, as a crash)."""
        refs = [w.info.remote() for w in self.workers]
        ray.wait(refs, num_returns=len(refs), timeout=CALL_TIMEOUT_SECONDS)
        infos = []
        for ref in refs:
            try:
                infos.append(ray.get(ref, timeout=0))
            except (RayActorError, GetTimeoutError):
                infos.append(None)
        return infos

    def assign(self, client_ids) -> list[list[int]]:
        return assign_clients(client_ids, self.sizes, len(self.workers))

    # -- what the driver reads -------------------------------------------------------------------
    def _emit(self, event: dict) -> None:
        with self._lock:
            self._events.append(event)

    def events(self, since: int = 0, wait_s: float = 0.0) -> list[dict]:
        """The events from number ``since`` on. Asking for them says the caller has written every
        event before ``since`` to disk (the driver, runtime/driver.py): a release listed among those
        may be made (``_await_listings``). ``wait_s``: return within that long, at once when a
        listing waits to be written or the run is over."""
        with self._listed:
            self._note_written(since)
            if wait_s > 0:
                self._listed.wait_for(lambda: self._to_write > since or self._over, timeout=wait_s)
            return self._events[since:]

    def written(self, count: int) -> None:
        """The driver has written the first ``count`` events (it says so as soon as their listings
        are on disk, before it goes on to the rest of what it does with them)."""
        with self._listed:
            self._note_written(count)

    def abandon(self) -> None:
        """The driver writes no more events (a stopped run, past its grace): a release waiting for
        its listing is not made, and the run ends now rather than at LISTING_TIMEOUT_SECONDS."""
        with self._listed:
            self._late = self._late or "the driver stopped writing the release list (releases.jsonl)"
            self._listed.notify_all()

    def _note_written(self, count: int) -> None:
        if count > self._written:
            self._written = count
            self._listed.notify_all()

    def stop(self) -> None:
        with self._lock:  # a release is listed (_list) before this, or not made
            self._stop.set()

    def committed(self) -> dict:
        """The state after the last committed round, read in one piece: the model, the ledger and
        how many rounds they cover, every one of them with its event: a round awaiting its
        evaluation is evaluated first, here if the run is still busy with the pool."""
        with self._settle_lock, self._lock_after_settling():
            out = {"rounds": self.rounds_done, "theta": self.theta,
                   "summary": {**self._algorithm_summary, "placement": self.pool, **self.final_eval}}
            if self.sc.output.checkpoint_every:
                out["checkpoint"] = self._checkpoint()
            if self.audit is not None and self.audit.rounds:
                delta, tm = self.sc.privacy.delta, self.sc.privacy.audit.threat_model
                out["audit"] = self.audit.to_record(delta)
                out["epsilon_empirical"] = self.audit.estimate(delta, tm).to_dict()
            if self.privacy:
                out["ledger"] = self.privacy.to_dict()
            return out

    def _lock_after_settling(self) -> threading.Lock:
        """With _settle_lock held: evaluate the round awaiting it, then hand back _lock to hold."""
        self._settle_now(here=True)
        return self._lock

    def _settle(self, sums: list | None = None, seconds: float = 0.0, here: bool = False) -> None:
        """Emit the round awaiting its evaluation, if any: with ``sums``, the workers' (correct,
        summed loss) per test range, in range order, else evaluated now (``here``: in this actor)."""
        with self._settle_lock:
            self._settle_now(sums, seconds, here)

    def _settle_now(self, sums: list | None = None, seconds: float = 0.0, here: bool = False) -> None:
        if self._pending is None:
            return
        record, theta = self._pending
        if sums is None:
            t0 = time.perf_counter()
            acc, loss = self._evaluate(theta, here=here)
            seconds = time.perf_counter() - t0
        else:
            acc, loss = combine_shards(sums, len(self.y_test))
        record.update(test_accuracy=acc, test_loss=loss, eval_seconds=seconds)
        with self._lock:
            self._events.append(record)
            self._pending = None

    # -- the loop --------------------------------------------------------------------------------
    def run(self) -> dict:
        self._running = True
        try:
            return self._run()
        finally:
            self._running = False
            with self._listed:
                self._over = True
                self._listed.notify_all()

    def _run(self) -> dict:
        infos = self.start_pool()
        self.pool = placement_summary(infos, self._worker_cls_resources[0], self._worker_cls_resources[1])
        self._emit({"event": "start", "workers": len(self.workers), "pool": infos, "num_params": int(self.theta.size)})
        tr = self.sc.training
        stop_reason, error = "completed", None
        for t in range(self.rounds_done, tr.rounds):
            if self._stop.is_set():
                stop_reason = "interrupted"
                break
            if self.privacy and not self.privacy.next_round_fits(t):
                stop_reason = "privacy_budget_exhausted"
                break
            try:
                self._round(t)
            except RerunDiverged as err:
                stop_reason, error = "error", str(err)
                break
            except _Halted:
                stop_reason = "interrupted"
                break
        # the last models go to the workers to be evaluated once their listings are written, else here
        here = self.privacy is not None and not self._await_listings(stops=False)
        self._settle(here=here)
        if stop_reason == "privacy_budget_exhausted":
            self._evaluate_final_model(here)
        if self._late and error is None and stop_reason != "interrupted":  # the last round's listing came late
            stop_reason, error = "error", (f"{self._late}: round {self.rounds_done} was released, evaluated here "
                                           "and committed, and the run stopped")
        self._record_stack_padding()
        return {"stop_reason": stop_reason, **({"error": error} if error else {})}

    def _evaluate_final_model(self, here: bool = False) -> None:
        """A budget that ends the run between two evaluations (output.eval_every) leaves the final
        model unevaluated: its accuracy, not the last evaluated round's, is the run's result."""
        done, every = self.rounds_done, self.sc.output.eval_every
        if done == 0 or done % every == 0 or done == self.sc.training.rounds:
            return
        acc, loss = self._evaluate(self.theta, here=here)
        with self._lock:
            self.final_eval = {"final_accuracy": acc, "final_loss": loss, "final_evaluated_round": done}

    def _record_stack_padding(self) -> None:
        """Put the stack sizes the workers' CPUs made them pad (dpfl_ray.training.local_batched) into the
        summary's placement: what made the run's bits independent of the pool on this host."""
        padding: dict[str, int] = {}
        for info in self.worker_info():
            padding.update((info or {}).get("stack_padding", {}))
        with self._lock:
            self.pool = {**self.pool, "stack_padding": dict(sorted(padding.items(), key=lambda kv: int(kv[0])))}

    def _round(self, t: int) -> dict:
        t0 = time.perf_counter()
        sc, alg = self.sc, self.algorithm
        self.reruns.begin(t + 1)
        self._announced = False
        self._listing_s = 0.0  # this round's waits for the driver to write its listings (_await_listings)
        if self.privacy:  # before the model goes out: uploads the server sees may carry the same noise
            why = self.reruns.check("model", self.theta)
            if why is None and not self._await_listings():  # the last round's, before its model goes out
                why = self._diverged
            if why is not None:
                raise RerunDiverged(why)
        sampled = sample_clients(self.sampling, len(self.sizes), sc.seed, t, self.sample_randomness)
        faults = self.faults.plan(t, sampled, len(self.workers))
        if self.audit is not None and not sc.privacy.audit.dropouts:  # canaries never drop out
            faults = dataclasses.replace(faults, dropped={c: p for c, p in faults.dropped.items() if c < self.num_real},
                                         causes={c: v for c, v in faults.causes.items() if c < self.num_real},
                                         corrupt={c: v for c, v in faults.corrupt.items() if c < self.num_real})
        active = [int(c) for c in sampled if faults.dropped.get(int(c)) != "training"]
        dropped = {c: d.label for c, d in faults.dropouts().items()}
        for c, cause in alg.withdrawals(t, sampled).items():  # e.g. a client whose budget is spent
            dropped.setdefault(int(c), f"{cause}@training")
        active = [c for c in active if not dropped.get(c, "").endswith("@training")]
        extra, rejected = {}, {}
        self._missed = []
        abort = alg.begin_round(t, sampled)
        spec = alg.client_spec() if abort is None else None
        if spec is not None and sc.output.client_accuracy and t + 1 == sc.training.rounds:
            spec = dataclasses.replace(spec, evaluate_local=True)  # Huang et al. Fig. 7: each user's model
        canaries = None
        if abort is None and self.audit is not None:
            canaries = Canaries(self.audit.seed, self.num_real, float(alg.canary_norm()))
        if abort is None and not active and spec.noise is not None:
            # the noise lives with the clients: with none of them left there is none to release
            abort = Abort("every sampled client dropped before uploading")
        if abort is not None:  # e.g. Baek et al. Alg. 3 line 17: the server stops before anyone trains
            outcome, extra, dropped = RoundOutcome(t, aborted=abort.reason), {"round_aborted": abort.reason}, {}
        elif sc.secagg.enabled and active:
            theta_ref = ray.put(self.theta)  # the broadcast: one object, read by every worker
            assignment = self.assign(active)
            res = secagg_round(self, t, theta_ref, active, len(sampled) - len(active), faults, spec,
                               lambda survivors: self._after_upload(survivors, secagg=True),
                               self._chaos(faults, assignment),
                               lambda phase: self._strike(faults, phase), canaries, self._before_calibration,
                               self._calibration_lost)
            dropped.update(res.lost)
            rejected = res.rejected
            self._replace(res.dead)
            outcome, extra = res.outcome, res.record
            if not res.calibrated:  # no calibration ran this round: nobody could drop out of it
                dropped = {c: p for c, p in dropped.items() if not p.endswith("@calibration")}
        else:
            # without SecAgg the server sees each upload (under client noise, each a release): listed
            # before the model goes out (written before an upload is read: _plain_round), or not
            # sent at all once the run is asked to stop
            if self.privacy and not self._list("model"):
                raise _Halted()
            theta_ref = ray.put(self.theta)
            survivors, total, updates, rejected, reports, worker_s, evals = self._plain_round(
                t, theta_ref, active, faults, dropped, spec, canaries, evaluate=self._pending is not None)
            if evals is not None:
                self._settle(*evals)
            if worker_s is not None:  # the slowest worker's own compute: the rest of the round is overhead
                extra["worker_seconds"] = worker_s
            plan = self._after_upload(survivors, secagg=False)
            if isinstance(plan, Abort):
                outcome, extra = RoundOutcome(t, aborted=plan.reason), {"round_aborted": plan.reason}
            else:
                outcome = RoundOutcome(t, survivors=tuple(survivors), updates=updates, total=total, reports=reports)
        if self._halted:  # asked to stop before it released: the round is not committed
            raise _Halted()
        if self._diverged is None and self.privacy and not outcome.released and self.reruns.released_before():
            self._diverged = self.reruns.nothing_now()
        if self._diverged is not None:  # the round released nothing; neither may any after it
            raise RerunDiverged(self._diverged)
        if outcome.released:
            agg = alg.finish(dataclasses.replace(outcome, theta=self.theta), self.theta.size)
        else:  # nothing was released: the model stays
            agg = Aggregate(np.zeros_like(self.theta), 0.0)
        theta = (self.theta + sc.training.server_lr * agg.delta).astype(np.float32)
        self._settle()  # the last round's evaluation, if this round's calls did not carry it
        acc, loss = None, None  # a round that is not evaluated (output.eval_every) has no accuracy
        metrics = {}
        t_eval = time.perf_counter()
        scheduled = (t + 1) % sc.output.eval_every == 0 or t + 1 == sc.training.rounds
        # evaluated in the next round's training calls: not the last round, nor one the algorithm reads
        deferred = scheduled and self.overlap_eval and t + 1 < sc.training.rounds
        validate = self.has_validation and (scheduled or alg.reads_validation_every_round())
        # the new model goes to the workers to be evaluated once its listings are written; else it
        # is evaluated here, and the round, released, commits (the next one stops)
        here = bool(self.privacy) and ((scheduled and not deferred) or validate) and not self._await_listings(
            stops=False)
        if scheduled and not deferred:
            acc, loss = self._evaluate(theta, here=here)
            metrics = {"test_accuracy": acc, "test_loss": loss}
        if validate:
            metrics["validation_loss"] = extra["validation_loss"] = self._evaluate(theta, "validation", here=here)[1]
        if metrics:
            extra["eval_seconds"] = time.perf_counter() - t_eval
        alg.observe(t, metrics)
        if spec is not None and spec.evaluate_local:
            local = {c: r.values["local_test_accuracy"] for c, r in outcome.reports.items()
                     if "local_test_accuracy" in r.values}
            extra["client_accuracy"] = client_accuracy_summary(local, alg.client_groups())
        dropped.update({c: f"{REJECTED}@upload" for c in rejected})
        if self._missed:
            extra["faults_not_carried_out"] = sorted(set(self._missed))
        if self.privacy:
            extra["listing_seconds"] = self._listing_s
        tallied = tally(dropped)
        if rejected:
            tallied["rejected"] = {str(c): why for c, why in sorted(rejected.items())}
        why = extra.get("round_aborted") or extra.get("secagg_aborted") or "nothing released"
        with self._settle_lock, self._lock:  # commit: ledger, model and event together
            if self.privacy:
                t_account = time.perf_counter()
                extra.update(self.privacy.account(t, outcome, why, tallied["dropped"]))
                extra["account_seconds"] = time.perf_counter() - t_account  # dp_accounting's share of the round
                self.privacy.exhausted |= why == BUDGET_REFUSAL
            record = {"event": "round", "round": t + 1, "sampled": len(sampled), "survived": len(outcome.survivors),
                      **tallied, "weight_sum": agg.weight_sum, "test_accuracy": acc,
                      "test_loss": loss, "seconds": time.perf_counter() - t0, **agg.info, **extra}
            if self._announced:  # its line in releases.jsonl says how it ended, before its row
                self._events.append({"event": "release", "round": t + 1, "scenario_sha256": self._scenario_sha256,
                                     "released": bool(outcome.released), "epsilon": record.get("epsilon")})
            if self.audit is not None and outcome.released:
                views = alg.server_views()
                self.audit.add_round(theta.astype(np.float64) - self.theta,
                                     **({} if views is None else {"views": views[0], "view_cov": views[1]}))
            self.theta = theta
            self.rounds_done = t + 1
            self._snapshot_algorithm()
            if deferred:  # its event waits for its evaluation (_settle)
                self._pending = (record, theta)
            else:
                self._events.append(record)
        return record

    def _after_upload(self, survivors: list[int], secagg: bool):
        """What the unmask request carries, or why nothing is released -- the mechanism's own
        reasons, a release that would take the effective epsilon past the budget, or a rerun round
        that would release otherwise than the server saw before (privacy/reruns.py). ``secagg``: the
        round sums through SecAgg, so the server has seen nothing of it yet."""
        if self.privacy:
            why = self.reruns.check("survivors", survivors)
            if why is not None:
                self._diverged = why
                return Abort(why)
        plan = self.algorithm.after_upload(survivors)
        if isinstance(plan, Abort) or not self.privacy:
            return plan
        if not self.privacy.release_fits(self.algorithm.mechanism()):
            return Abort(BUDGET_REFUSAL)
        if secagg:  # nothing is seen before the unmask request: a stop may still end the round
            if not self._announce("model", "survivors"):
                return Abort(self._diverged or STOPPING)
        else:  # the uploads are in: the round goes on to its commit, and the sum it releases leaves
            # this actor with the commit's events, after this listing, or in the next broadcast, once written
            self._list("survivors", may_halt=False)
        return plan

    def _before_calibration(self, senders: list[int]) -> str | None:
        """Why the calibration terms of ``senders`` must not be asked for (a rerun round whose
        calibrating clients differ from its release before), else None; listed before they are. A
        stop asked for by now does not end the round: its uncalibrated sum is unmasked already."""
        if not self.privacy:
            return None
        why = self.reruns.check("calibration", senders)
        if why is not None:
            self._diverged = why
            return why
        if not self._announce("calibration", may_halt=False):  # A is unmasked: on to the commit, once listed
            self._diverged = (f"{self._late}: round {self.reruns.round}'s sum without calibration was unmasked and "
                              "its calibration terms were not summed; the round is listed as released and is not in "
                              "the ledger (the summary's released_before_resume)")
            return self._diverged
        return None

    def _calibration_lost(self, missing: int) -> str | None:
        """Why the calibration terms that came must not be summed when ``missing`` of the listed
        senders' did not (their worker was lost after the listing), else None. The listing names
        the senders a rerun is checked against: a sum over fewer would let a rerun with all of them
        pass the check and hand the server the missing terms beside this release. So the round
        stops the run as a rerun that differs does: its uncalibrated sum A and the others' terms
        were seen, it is listed as possibly released (the summary's released_before_resume), and a
        resume releases it again once from the listed senders."""
        if not self.privacy:
            return None
        self._diverged = (f"round {self.reruns.round}: the worker of {missing} listed calibration sender(s) was lost "
                          "before their terms came; the others' terms were not summed and the round is not in the "
                          "ledger (the summary's released_before_resume); a resume releases it from the listed "
                          "senders")
        return self._diverged

    def _announce(self, *parts: str, may_halt: bool = True) -> bool:
        """List ``parts`` (``_list``) and wait until the driver has written them (``_await_listings``)."""
        return self._list(*parts, may_halt=may_halt) and self._await_listings()

    def _list(self, *parts: str, may_halt: bool = True) -> bool:
        """List the round's digests of ``parts`` for releases.jsonl, which the driver writes; what
        they describe is released only once it has (``_await_listings``), so a coordinator lost at
        any moment leaves every release it made listed on disk. With ``may_halt``, False, listing
        nothing, once the run is asked to stop: the release is then not made, so a driver that reads
        the events after asking never misses one (``stop`` takes the lock)."""
        with self._listed:
            if may_halt and self._stop.is_set():
                self._halted = True
                return False
            self._events.append({"event": "release", "round": self.reruns.round,
                                 "scenario_sha256": self._scenario_sha256, **{p: self.reruns.current[p] for p in parts}})
            self._announced = True
            self._to_write = len(self._events)
            self._listed.notify_all()
            return True

    def _await_listings(self, stops: bool = True) -> bool:
        """Wait until the driver has written every listing made so far (it says so with
        ``written``, or by asking for the events after them). False, releasing nothing more, when
        it has not within LISTING_TIMEOUT_SECONDS, or no longer writes (``abandon``): then, with
        ``stops``, the run stops at the caller's release (``_diverged`` says why)."""
        with self._listed:
            if not self._late:  # once late, late for good: the run stops at its next release
                t0 = time.perf_counter()  # wait_for returns at once when the listings are written
                self._listed.wait_for(lambda: self._written >= self._to_write or self._late,
                                      timeout=LISTING_TIMEOUT_SECONDS)
                self._listing_s += time.perf_counter() - t0
                if not self._late and self._written >= self._to_write:
                    return True
                self._late = self._late or (f"the driver did not write the release list (releases.jsonl) within "
                                            f"{LISTING_TIMEOUT_SECONDS:.0f} s")
        if stops and self._diverged is None:
            self._diverged = f"{self._late}: round {self.reruns.round} released nothing"
        return False

    def _chaos(self, faults, assignment) -> dict:
        """Each worker's share of the round's planned faults (see messages.WorkerChaos)."""
        out = {}
        for w, ids in zip(self.workers, assignment):
            on_time = [c for c in ids if faults.delivers(c)]
            out[w] = WorkerChaos(delay=max((faults.delays.get(c, 0.0) for c in on_time), default=0.0),
                                 corrupt={c: faults.corrupt[c] for c in ids if c in faults.corrupt},
                                 max_norm=self.sc.faults.max_update_norm)
        return out

    def _strike(self, faults, phase: str) -> dict:
        """Carry out the crashes and node losses planned for ``phase``; {worker: cause}."""
        if not faults.crashes and not faults.nodes_lost:
            return {}
        if any(loss.phase == phase for loss in faults.nodes_lost):
            self._nodes = {w: info["node"] for w, info in zip(self.workers, self.worker_info()) if info}
        return strike(self.workers, self._nodes, faults, phase, {ray.get_runtime_context().get_node_id()},
                      self._missed)

    def _plain_round(self, t, theta_ref, active, faults, dropped, spec, canaries=None, evaluate=False):
        """Local training without SecAgg, one message per worker: the survivors, and the sum of
        w_i * upload_i over them (the workers' partial sums, added in group order) -- or each
        upload, when the algorithm needs them -- the refused updates with their reasons, the
        clients' reports, and the longest time a worker spent on its clients (None: no reply).
        ``evaluate``: the workers also evaluate the broadcast model (the last round's) on the test
        ranges, dealt among them; the last item is then (the per-range sums, the slowest worker's
        seconds), or None if any worker's share did not come back."""
        calls = {}
        assignment = assign_groups(active, self.sizes, self.groups, len(self.workers))
        shares = deal(eval_shards(len(self.y_test)), len(self.workers)) if evaluate else []
        shares += [None] * (len(self.workers) - len(shares))
        chaos = self._chaos(faults, [[c for ids in groups.values() for c in ids] for groups in assignment])
        # {worker: (cause, phase)}: a planned strike is recorded in the phase it was planned for
        struck = {w: (cause, "training") for w, cause in self._strike(faults, "training").items()}
        evaluating = {}  # worker -> its test ranges' ref, for a worker without clients this round
        for w, groups, share in zip(self.workers, assignment, shares):
            if groups:
                lost = [c for ids in groups.values() for c in ids if not faults.delivers(c)]
                calls[w.run_clients.remote(t, theta_ref, groups, lost, spec, chaos[w], canaries,
                                           share)] = (w, groups)
            elif share:
                evaluating[w] = w.evaluate_shards.remote(theta_ref, "test", share)
        struck.update({w: (cause, "upload") for w, cause in self._strike(faults, "upload").items()})
        ready, late = ray.wait(list(calls), num_returns=len(calls),
                               timeout=real_deadline(self.sc.training)) if calls else ([], [])
        unplanned_wait(self.sc.training, t + 1, "training", [calls[ref][0] for ref in late])
        if not self._await_listings():  # the round's listing is written (meanwhile) before an upload is read
            raise RerunDiverged(self._diverged)
        survivors, sums, updates, rejected, reports = [], {}, {} if spec.per_client else None, {}, {}
        worker_s, dead, evals, eval_s = None, [], {}, 0.0
        for ref in ready:
            w, groups = calls[ref]
            try:
                if w in struck:  # killed as planned: its reply, should it beat the kill, never counts
                    raise RayActorError()
                reply = ray.get(ref, timeout=CALL_TIMEOUT_SECONDS)
            except (RayActorError, GetTimeoutError):
                # A dead worker's clients are this round's dropouts; a fresh worker takes its place.
                cause, phase = struck.get(w, (CRASH, "training"))  # an unplanned death: while training
                dropped.update({c: f"{cause}@{phase}" for ids in groups.values() for c in ids})
                dead.append(w)
                continue
            survivors += reply.client_ids
            worker_s = max(worker_s or 0.0, reply.seconds)
            if reply.evals is not None:
                evals[w], eval_s = reply.evals, max(eval_s, reply.eval_seconds)
            sums.update(reply.sums)
            rejected.update(reply.rejected)
            reports.update(reply.reports)
            if updates is not None:
                updates.update(zip(reply.client_ids, reply.updates))
        for ref in late:  # it hangs past the deadline: dropped, and the stuck worker is replaced
            w, groups = calls[ref]
            dropped.update({c: f"{STRAGGLER}@upload" for ids in groups.values() for c in ids})
            ray.kill(w, no_restart=True)
            dead.append(w)
        t_eval = time.perf_counter()
        for w, ref in evaluating.items():
            try:
                evals[w] = ray.get(ref, timeout=CALL_TIMEOUT_SECONDS)
            except (RayActorError, GetTimeoutError):
                pass  # its share is missing: _settle evaluates the whole split on the pool instead
        eval_s = max(eval_s, time.perf_counter() - t_eval) if evaluating else eval_s
        parts = [evals.get(w) for w, share in zip(self.workers, shares) if share]
        self._replace(dead)  # all at once: the fresh workers start side by side, not one after another
        total = sum(sums[g] for g in sorted(sums)) if sums else None
        evaluated = (undeal(parts), eval_s) if evaluate and all(p is not None for p in parts) else None
        return sorted(survivors), total, updates, rejected, reports, worker_s, evaluated

    def _evaluate(self, theta: np.ndarray, split: str = "test", here: bool = False) -> tuple[float, float]:
        """On the workers, idle at this point of the round, each taking its share of the split's
        fixed row ranges (the coordinator reserves no CPU); here if the pool does not answer, or
        ``here`` (the pool may be busy with a round, or the model may not go out yet). Either way the
        same ranges are added in the same order."""
        n = len(self.y_test) if split == "test" else int(self._data["num_validation"])
        shards = eval_shards(n)
        share = [] if here else deal(shards, len(self.workers))
        try:
            if not share:
                raise IndexError("no worker")
            theta_ref = ray.put(theta)
            parts = ray.get([w.evaluate_shards.remote(theta_ref, split, part) for w, part in zip(self.workers, share)],
                            timeout=CALL_TIMEOUT_SECONDS)
            sums = undeal(parts)
        except (RayActorError, GetTimeoutError, IndexError):
            from ..training.models import allow_read_only_arrays, build_model, set_flat, shard_sums

            if self.model is None:
                allow_read_only_arrays()  # x_test is the object store's
                self.model = build_model(self.sc.model, tuple(self._data["input_shape"]), self._data["num_classes"],
                                         self.sc.seed)
                _one_torch_thread()
            set_flat(self.model, theta)
            x, y = (self.x_test, self.y_test) if split == "test" else ray.get(
                [self._data["x_val"], self._data["y_val"]], timeout=CALL_TIMEOUT_SECONDS)
            sums = shard_sums(self.model, x, y, shards)
        return combine_shards(sums, n)

    def _replace(self, dead: list) -> None:
        """A fresh worker for each dead one, a bounded number of times per run.

        The coordinator waits for the fresh workers to start, as for the first pool (bounded;
        one that does not start surfaces in its round, as a crash). Otherwise a fresh worker's
        start-up (torch's import, the data) fell inside the next round's real deadline, and on a
        loaded machine the worker was cut off as a straggler: the results depended on timing."""
        fresh = []
        for w in dead:
            self.replacements += 1
            if self.replacements > MAX_REPLACEMENTS:
                raise RuntimeError(f"{self.replacements} workers died or hung in this run; giving up "
                                   "(see the rounds' 'dropped' records)")
            fresh.append(self._new_worker())
            self.workers[self.workers.index(w)] = fresh[-1]
        refs = [w.info.remote() for w in fresh]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=CALL_TIMEOUT_SECONDS)


def _one_torch_thread() -> None:
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)


class CoordinatorArgs(NamedTuple):
    """The arguments of ``Coordinator.__init__`` and ``Coordinator.rebind``, in their order."""
    scenario: dict
    data: dict
    theta0: np.ndarray | Pending
    workers: list | None
    resume: dict | None
    fault_plan: FaultPlan | None
    dp_secret: bytes | None = None
    released: dict | None = None


def coordinator_args(scenario: Scenario, data: dict, workers: list | None = None, resume: dict | None = None,
                     fault_plan: FaultPlan | None = None, theta0: np.ndarray | Pending | None = None,
                     dp_secret: bytes | None = None, released: dict | None = None) -> CoordinatorArgs:
    """``theta0``: the initial model, flat (models.initial_theta), or Pending on a worker that builds
    it; built here (torch) otherwise. Never in the coordinator, which then need not load torch."""
    if theta0 is None:
        from ..training.models import initial_theta

        theta0 = initial_theta(scenario.model, data["input_shape"], data["num_classes"], scenario.seed)
    return CoordinatorArgs(scenario.model_dump(mode="json"), data, theta0, workers, resume, fault_plan, dp_secret,
                           released)


def make_coordinator(scenario: Scenario, data: dict, workers: list | None = None, resume: dict | None = None,
                     fault_plan: FaultPlan | None = None, theta0: np.ndarray | None = None):
    """A fresh Coordinator actor (``coordinator_args`` says what the arguments are)."""
    return start_coordinator(coordinator_args(scenario, data, workers, resume, fault_plan, theta0))


def start_coordinator(args: CoordinatorArgs):
    """A fresh Coordinator actor for arguments already made (the driver's, which a parked
    coordinator did not take: runtime/warm.py)."""
    if args.workers is None:  # the coordinator starts its own pool: workers parked for a run here give their CPUs back
        warm.clear()
    cls = ray.remote(num_cpus=0, max_concurrency=4)(Coordinator)
    return cls.remote(*args)


def start_workers(scenario: Scenario, data: dict, num_clients: int,
                  count: int | None = None) -> tuple[list, tuple[float, float], bool]:
    """The ClientWorker pool, started from the driver at the same time as the coordinator, its
    shape (CPUs, GPUs per worker), and whether every worker starts at once: parked or in a
    placement group, or fitting the resources free when it was asked for (else it may wait for
    another run to end). Warm workers parked by an earlier run of this driver (runtime/warm.py) are
    taken first. ``count``: the pool's size where the caller decided it (a sweep trial: one per
    bundle of its placement group); else the cluster decides."""
    from ray.util import get_current_placement_group

    plan = plan_pool(scenario.resources, ray.cluster_resources(), num_clients)
    if count is not None:
        plan = PoolPlan(count, plan.num_cpus, plan.num_gpus)
    raw = scenario.model_dump(mode="json")
    workers = warm.take(plan.num_cpus, plan.num_gpus, plan.workers, raw, data)
    fresh = plan.workers - len(workers)
    now = True
    if fresh and get_current_placement_group() is None:  # a placement group reserved its workers' bundles
        free = ray.available_resources()  # a resource wholly in use is absent
        now = all(free.get(kind, 0.0) + 1e-9 >= fresh * each for kind, each in (("CPU", plan.num_cpus),
                                                                                ("GPU", plan.num_gpus)))
    cls = make_worker_class(plan.num_cpus, plan.num_gpus)
    workers += [cls.remote(raw, data) for _ in range(fresh)]
    return workers, (plan.num_cpus, plan.num_gpus), now
