"""Coordinator: the actor that owns the round loop (ARCHITECTURE.md, 'One round, one story').

sample -> plan faults -> begin_round -> broadcast (one ray.put) -> local updates (one message per
worker; SecAgg rounds: advertise keys -> share keys -> masked input -> after_upload -> unmask) ->
finish -> account -> evaluate -> commit. The algorithm plugs into these phases through its
interface; the driver only starts the coordinator and reads its events and committed state.
"""
from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import ray
import torch
from ray.exceptions import RayActorError

from ..algorithms import Abort, Aggregate, RoundOutcome, algorithm_class, make_algorithm
from ..faults import plan_round
from ..models import build_model, evaluate, get_flat, set_flat
from ..sampling import sample_clients
from ..scenario import Scenario
from .privacy import RunPrivacy
from .resources import assign_clients, plan_pool
from .secagg_round import secagg_round
from .workers import make_worker_class


class Coordinator:
    def __init__(self, scenario: dict, data: dict):
        """``data`` holds object refs (nested, so Ray hands them over unresolved) of the training
        arrays, plus the test set, partition and weights."""
        self.sc = Scenario.model_validate(scenario)
        torch.set_num_threads(1)
        self._data = data
        self.x_test, self.y_test = ray.get(data["x_test"]), ray.get(data["y_test"])
        self.sizes = np.diff(ray.get(data["offsets"]))
        self.weights = ray.get(data["weights"])
        self.model = build_model(self.sc.model, tuple(data["input_shape"]), data["num_classes"], self.sc.seed)
        self.theta = get_flat(self.model)
        self.privacy = RunPrivacy(self.sc, self.weights, self.sizes) if algorithm_class(self.sc).private else None
        self.algorithm = make_algorithm(self.sc, self.weights, self.privacy.noise_multiplier if self.privacy else None,
                                        sizes=self.sizes)
        if self.privacy:
            self.privacy.bind(self.algorithm)
        self._events: list[dict] = []
        # Guards what the driver may read while a round runs: a round's ledger entry, the model it
        # produced and its event are committed together, so a reader never sees one without the others.
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.rounds_done = 0
        self.workers: list = []

    # -- the pool -------------------------------------------------------------------------------
    def _new_worker(self):
        d = self._data
        return self._worker_cls.remote(self.sc.model_dump(mode="json"), d["x_train"], d["y_train"],
                                       d["indices"], d["offsets"], d["input_shape"], d["num_classes"])

    def start_pool(self) -> list[dict]:
        """Create the ClientWorkers (once) and return where each landed (node, GPU ids)."""
        if self.workers:
            return self.worker_info()
        plan = plan_pool(self.sc.resources, ray.cluster_resources(), len(self.sizes))
        self._worker_cls = make_worker_class(plan.num_cpus, plan.num_gpus)
        self.workers = [self._new_worker() for _ in range(plan.workers)]
        return ray.get([w.info.remote() for w in self.workers])

    def worker_handle(self, i: int):
        return self.workers[i]

    def worker_info(self) -> list[dict]:
        return ray.get([w.info.remote() for w in self.workers])

    def assign(self, client_ids) -> list[list[int]]:
        return assign_clients(client_ids, self.sizes, len(self.workers))

    # -- what the driver reads -------------------------------------------------------------------
    def _emit(self, event: dict) -> None:
        with self._lock:
            self._events.append(event)

    def events(self, since: int = 0) -> list[dict]:
        with self._lock:
            return self._events[since:]

    def stop(self) -> None:
        self._stop.set()

    def committed(self) -> dict:
        """The state after the last committed round, read in one piece: the model, the ledger and
        how many rounds they cover."""
        with self._lock:
            out = {"rounds": self.rounds_done, "theta": self.theta,
                   "summary": self.algorithm.summary_fields()}
            if self.privacy:
                out["ledger"] = self.privacy.to_dict()
            return out

    # -- the loop --------------------------------------------------------------------------------
    def run(self) -> dict:
        # A pool started earlier is not probed again: a dead worker surfaces in its round, as a crash.
        infos = None if self.workers else self.start_pool()
        self._emit({"event": "start", "workers": len(self.workers), "pool": infos, "num_params": int(self.theta.size)})
        tr = self.sc.training
        stop_reason, last_eval = "completed", (None, None)
        for t in range(tr.rounds):
            if self._stop.is_set():
                stop_reason = "interrupted"
                break
            if self.privacy and not self.privacy.next_round_fits(t):
                stop_reason = "privacy_budget_exhausted"
                break
            record = self._round(t, last_eval)
            last_eval = (record["test_accuracy"], record["test_loss"])
        return {"stop_reason": stop_reason}

    def _round(self, t: int, last_eval) -> dict:
        t0 = time.perf_counter()
        sc, alg = self.sc, self.algorithm
        sampled = sample_clients(sc.sampling, len(self.sizes), sc.seed, t)
        faults = plan_round(sc.faults.dropouts, sampled, sc.seed, t)
        active = [int(c) for c in sampled if faults.dropped.get(int(c)) != "training"]
        dropped = dict(faults.dropped)
        extra: dict = {}
        abort = alg.begin_round(t, sampled)
        spec = alg.client_spec() if abort is None else None
        if abort is None and not active and spec.noise is not None:
            # the noise lives with the clients: with none of them left there is none to release
            abort = Abort("every sampled client dropped before uploading")
        if abort is not None:  # e.g. Baek et al. Alg. 3 line 17: the server stops before anyone trains
            outcome, extra, dropped = RoundOutcome(t, aborted=abort.reason), {"round_aborted": abort.reason}, {}
        elif sc.secagg.enabled and active:
            theta_ref = ray.put(self.theta)  # the broadcast: one object, read by every worker
            res = secagg_round(self, t, theta_ref, active, len(sampled) - len(active), faults, spec,
                               self._after_upload)
            dropped.update(res.lost)
            self._replace(res.dead)
            outcome, extra = res.outcome, res.record
            if not res.calibrated:  # no calibration ran this round: nobody could drop out of it
                dropped = {c: p for c, p in dropped.items() if p != "calibration"}
        else:
            theta_ref = ray.put(self.theta)
            updates = self._plain_updates(t, theta_ref, active, faults, dropped, spec)
            plan = self._after_upload(sorted(updates))
            if isinstance(plan, Abort):
                outcome, extra = RoundOutcome(t, aborted=plan.reason), {"round_aborted": plan.reason}
            else:
                outcome = RoundOutcome(t, survivors=tuple(sorted(updates)), updates=updates)
        if outcome.released:
            agg = alg.finish(dataclasses.replace(outcome, theta=self.theta), self.theta.size)
        else:  # nothing was released: the model stays
            agg = Aggregate(np.zeros_like(self.theta), 0.0)
        theta = (self.theta + sc.training.server_lr * agg.delta).astype(np.float32)
        acc, loss = last_eval
        if (t + 1) % sc.output.eval_every == 0 or t + 1 == sc.training.rounds:
            set_flat(self.model, theta)
            acc, loss = evaluate(self.model, self.x_test, self.y_test)
        by_phase: dict[str, int] = {}
        for p in dropped.values():
            by_phase[p] = by_phase.get(p, 0) + 1
        why = extra.get("round_aborted") or extra.get("secagg_aborted") or "nothing released"
        with self._lock:  # commit: ledger, model and event together
            if self.privacy:
                extra.update(self.privacy.account(t, outcome.survivors, outcome.released, why))
            record = {"event": "round", "round": t + 1, "sampled": len(sampled), "survived": len(outcome.survivors),
                      "dropped_by_phase": by_phase, "weight_sum": agg.weight_sum, "test_accuracy": acc,
                      "test_loss": loss, "seconds": time.perf_counter() - t0, **agg.info, **extra}
            self.theta = theta
            self.rounds_done = t + 1
            self._events.append(record)
        return record

    def _after_upload(self, survivors: list[int]):
        """What the unmask request carries, or why nothing is released -- the mechanism's own
        reasons, or a release that would take the effective epsilon past the budget."""
        plan = self.algorithm.after_upload(survivors)
        if isinstance(plan, Abort) or not self.privacy:
            return plan
        if not self.privacy.release_fits(self.algorithm.mechanism()):
            return Abort("releasing this round would take the effective epsilon past privacy.target_epsilon")
        return plan

    def _plain_updates(self, t, theta_ref, active, faults, dropped, spec) -> dict[int, np.ndarray]:
        """One message per worker; uploads of clients whose upload the fault plan does not lose."""
        calls = []
        for w, ids in zip(self.workers, self.assign(active)):
            if ids:
                lost = [c for c in ids if not faults.delivers(c)]
                calls.append((w, ids, w.run_clients.remote(t, theta_ref, ids, lost, spec)))
        updates: dict[int, np.ndarray] = {}
        for w, ids, ref in calls:
            try:
                reply = ray.get(ref)
            except RayActorError:
                # A dead worker's clients are this round's dropouts; a fresh worker takes its place.
                dropped.update({c: "crash" for c in ids})
                self._replace([w])
                continue
            updates.update({c: u for c, u in zip(reply.client_ids, reply.updates)})
        return updates

    def _replace(self, dead: list) -> None:
        for w in dead:
            self.workers[self.workers.index(w)] = self._new_worker()


def make_coordinator(scenario: Scenario, data: dict):
    cls = ray.remote(num_cpus=0, max_concurrency=4)(Coordinator)
    return cls.remote(scenario.model_dump(mode="json"), data)
