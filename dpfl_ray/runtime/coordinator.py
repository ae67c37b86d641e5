"""Coordinator: the actor that owns the round loop (ARCHITECTURE.md, 'One round, one story').

sample -> plan faults -> broadcast (one ray.put) -> local updates (one message per worker)
-> aggregate survivors -> evaluate -> record. The driver only starts it and reads its events.
"""
from __future__ import annotations

import threading
import time

import numpy as np
import ray
import torch
from ray.exceptions import RayActorError

from ..algorithms import Aggregate, make_algorithm
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
        self.privacy = RunPrivacy(self.sc, self.weights) if self.sc.training.algorithm != "fedavg" else None
        self.algorithm = make_algorithm(self.sc, self.weights, self.privacy.noise_multiplier if self.privacy else None)
        if self.privacy:
            self.privacy.bind(self.algorithm)
        self._events: list[dict] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
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

    # -- events for the driver -------------------------------------------------------------------
    def _emit(self, event: dict) -> None:
        with self._lock:
            self._events.append(event)

    def events(self, since: int = 0) -> list[dict]:
        with self._lock:
            return self._events[since:]

    def stop(self) -> None:
        self._stop.set()

    def final_model(self) -> np.ndarray:
        return self.theta

    def ledger(self) -> dict | None:
        return self.privacy.to_dict() if self.privacy else None

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
            self._emit(record)
        return {"stop_reason": stop_reason}

    def _round(self, t: int, last_eval) -> dict:
        t0 = time.perf_counter()
        sc = self.sc
        sampled = sample_clients(sc.sampling, len(self.sizes), sc.seed, t)
        faults = plan_round(sc.faults.dropouts, sampled, sc.seed, t)
        active = [int(c) for c in sampled if faults.dropped.get(int(c)) != "training"]
        theta_ref = ray.put(self.theta)  # the broadcast: one object, read by every worker
        dropped = dict(faults.dropped)
        extra: dict = {}
        alg = self.algorithm
        refused = alg.begin_round(t, sampled) if hasattr(alg, "begin_round") else None
        if refused is None and hasattr(alg, "begin_round") and not active:
            refused = "every sampled client dropped before uploading"
        if refused:  # Baek et al. Alg. 3 line 17: the server stops before anyone trains
            survivors, extra, dropped = [], {"round_aborted": refused}, {}
            agg, released = Aggregate(np.zeros_like(self.theta), 0.0), False
        elif sc.secagg.enabled and active:
            out = secagg_round(self, t, theta_ref, active, faults, alg.client_spec(),
                               self._after_upload if hasattr(alg, "after_upload") else None)
            dropped.update(out["lost"])
            self._replace(out["dead"])
            survivors, extra = out["survivors"], out["record"]
            if out["sum"] is None:  # aborted: nothing was released, the model stays
                agg, released = Aggregate(np.zeros_like(self.theta), 0.0), False
            elif hasattr(alg, "from_secagg"):
                agg, released = alg.from_secagg(out, self.theta.size), True
            else:
                agg, released = alg.from_sum(out["sum"], sum(float(self.weights[c]) for c in survivors),
                                             self.theta.size, t), True
            if getattr(alg, "plan", None) is not None and "calibration" not in alg.plan.extras:
                # no calibration ran this round: nobody could drop out of it
                dropped = {c: p for c, p in dropped.items() if p != "calibration"}
        else:
            updates = self._plain_updates(t, theta_ref, active, faults, dropped)
            survivors, released = sorted(updates), True
            agg = self.algorithm.aggregate(updates, self.weights, self.theta.size, t)
        why = extra.get("round_aborted") or extra.get("secagg_aborted") or "nothing released"
        extra.update(self.privacy.account(t, released, why) if self.privacy else {})
        self.theta = (self.theta + sc.training.server_lr * agg.delta).astype(np.float32)
        acc, loss = last_eval
        if (t + 1) % sc.output.eval_every == 0 or t + 1 == sc.training.rounds:
            set_flat(self.model, self.theta)
            acc, loss = evaluate(self.model, self.x_test, self.y_test)
        by_phase: dict[str, int] = {}
        for p in dropped.values():
            by_phase[p] = by_phase.get(p, 0) + 1
        return {"event": "round", "round": t + 1, "sampled": len(sampled), "survived": len(survivors),
                "dropped_by_phase": by_phase, "weight_sum": agg.weight_sum, "test_accuracy": acc,
                "test_loss": loss, "seconds": time.perf_counter() - t0, **agg.info, **extra}

    def _after_upload(self, survivors: list[int]) -> dict | str:
        """Baek et al.: what the unmask request carries, or why nothing is unmasked -- the
        mechanism's own reasons, or a release that would take the effective epsilon past the budget."""
        extras = self.algorithm.after_upload(survivors)
        if isinstance(extras, str) or not self.privacy:
            return extras
        if not self.privacy.release_fits([self.algorithm.upload_effective()]):
            return "releasing this round would take the effective epsilon past privacy.target_epsilon"
        return extras

    def _plain_updates(self, t, theta_ref, active, faults, dropped) -> dict[int, np.ndarray]:
        """One message per worker; updates of clients whose upload the fault plan does not lose."""
        calls = []
        for w, ids in zip(self.workers, assign_clients(active, self.sizes, len(self.workers))):
            if ids:
                lost = [c for c in ids if not faults.delivers(c)]
                calls.append((w, ids, w.run_clients.remote(t, theta_ref, ids, lost)))
        updates: dict[int, np.ndarray] = {}
        for w, ids, ref in calls:
            try:
                reply = ray.get(ref)
            except RayActorError:
                # A dead worker's clients are this round's dropouts; a fresh worker takes its place.
                dropped.update({c: "crash" for c in ids})
                self._replace([w])
                continue
            updates.update({c: u for c, u in zip(reply["client_ids"], reply["updates"])})
        return updates

    def _replace(self, dead: list) -> None:
        for w in dead:
            self.workers[self.workers.index(w)] = self._new_worker()


def make_coordinator(scenario: Scenario, data: dict):
    cls = ray.remote(num_cpus=0, max_concurrency=4)(Coordinator)
    return cls.remote(scenario.model_dump(mode="json"), data)
