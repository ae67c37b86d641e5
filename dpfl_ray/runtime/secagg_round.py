"""The SecAgg phases of a round, run by the coordinator over its workers (Bonawitz et al. 2017
Rounds 0-2 and 4; SecAgg+ of Bell et al. 2020).

Workers host the client state machines and pre-sum their clients' masked inputs; the coordinator
hosts the server. A worker that crashes or misses a phase's deadline loses its clients from that
phase on, and the protocol's recovery (Shamir shares held by the others) takes over.
"""
from __future__ import annotations

import time

import numpy as np
import ray
from ray.exceptions import RayActorError

from ..faults import SECAGG_PHASE
from ..secagg import SecAggAbort, SecAggConfig, SecAggServer, decode, rounding_error_bound
from .resources import assign_clients

# fault-plan phase names for the protocol phases, for the round's record
_FAULT_NAME = {v: k for k, v in SECAGG_PHASE.items()}


class _Phases:
    """Call one method on the live workers, collect replies; crashed or late workers go dark."""

    def __init__(self, assignment: dict, timeout: float | None):
        self.live = dict(assignment)  # worker handle -> its client ids this round
        self.timeout = timeout
        self.lost: dict[int, str] = {}  # client id -> "crash@phase" / "deadline@phase"
        self.dead: list = []

    def call(self, phase: str, make_call) -> list[dict]:
        refs = {make_call(w, ids): w for w, ids in self.live.items()}
        ready, late = ray.wait(list(refs), num_returns=len(refs), timeout=self.timeout) if refs else ([], [])
        replies = []
        for ref in ready:
            try:
                replies.append(ray.get(ref))
            except RayActorError:
                self._drop(refs[ref], f"crash@{phase}")
                self.dead.append(refs[ref])
        for ref in late:
            self._drop(refs[ref], f"deadline@{phase}")
        return replies

    def _drop(self, worker, why: str) -> None:
        for cid in self.live.pop(worker):
            self.lost[cid] = why


def secagg_round(coord, t: int, theta_ref, active: list[int], faults, spec: dict, after_upload=None) -> dict:
    """Securely sum w_i * Delta_i (+ noise) over ``active`` clients (those that trained). Returns the
    decoded sum, the survivors (whose masked input reached the server), and the round's SecAgg record.

    ``after_upload(survivors)`` (Baek et al.) sees who uploaded before unmasking and returns what
    the unmask request carries -- ``{"calibration": {"n_prime"}}`` or ``{"layers_from": k}`` -- or a
    reason to abort the round without unmasking anything. The output then also holds the
    survivors' calibration terms and the reconstructed noise-layer seeds."""
    sc, sa = coord.sc, coord.sc.secagg
    index = {cid: i for i, cid in enumerate(active)}
    n = len(active)
    if sa.threshold == "majority":  # secagg+ already defaults to a majority of each neighbourhood
        threshold = n // 2 + 1 if sa.protocol == "secagg" else None
    else:
        threshold = min(sa.threshold, n) if sa.threshold else None
    config = SecAggConfig(n_clients=n, bits=sa.bits, protocol=sa.protocol, threshold=threshold, round_id=t,
                          graph_seed=sc.seed, degree=min(sa.degree, n - 1) if sa.degree and n > 2 else None,
                          dim=int(coord.theta.size) + (1 if spec.get("indicator") else 0))
    server = SecAggServer(config)
    leave = {c: SECAGG_PHASE[p] for c, p in faults.dropped.items() if p in SECAGG_PHASE and c in index}
    assignment = {w: ids for w, ids in zip(coord.workers, assign_clients(active, coord.sizes, len(coord.workers)))
                  if ids}
    phases = _Phases(assignment, sa.phase_timeout_seconds)
    encoding = {"scale": sa.resolved_scale, "overflow": sa.overflow, "n_summands": n}
    seconds, record = {}, {"secagg_protocol": sa.protocol, "secagg_threshold": server_threshold(config)}

    def timed(phase, fn):
        start = time.perf_counter()
        out = fn()
        seconds[phase] = round(time.perf_counter() - start, 4)
        return out

    weights = {c: float(coord.weights[c]) for c in active}
    try:
        replies = timed("advertise", lambda: phases.call("advertise", lambda w, ids: w.secagg_start.remote(
            t, theta_ref, {c: index[c] for c in ids}, {c: leave[c] for c in ids if c in leave}, config,
            {c: weights[c] for c in ids}, encoding, spec)))
        record["secagg_clipped"] = sum(e["clipped"] for r in replies for e in r["clip_events"])
        keys = timed("advertise_server", lambda: server.receive_keys(m for r in replies for m in r["messages"]))
        replies = timed("share", lambda: phases.call("share", lambda w, ids: w.secagg_share.remote(keys)))
        forwarded = timed("share_server", lambda: server.receive_shares(m for r in replies for m in r["messages"]))
        replies = timed("masked_input", lambda: phases.call("masked_input", lambda w, ids: w.secagg_masked.remote(
            {index[c]: forwarded[index[c]] for c in ids if index[c] in forwarded})))
        request = timed("masked_input_server", lambda: server.receive_masked(
            m for r in replies for m in r["messages"]))
        extras = after_upload(sorted(active[u] for u in server.u3)) if after_upload else {}
        if isinstance(extras, str):  # the mechanism refuses to release this round
            record.update(round_aborted=extras, secagg_seconds=seconds)
            return {"sum": None, "survivors": [], "record": record, "lost": phases.lost, "dead": phases.dead}
        if "layers_from" in extras:
            request = server.request_layers(request, extras["layers_from"])
        calibration = extras.get("calibration")
        replies = timed("unmask", lambda: phases.call("unmask", lambda w, ids: w.secagg_unmask.remote(
            request, calibration)))
        total = timed("reconstruct", lambda: server.receive_unmask(m for r in replies for m in r["messages"]))
    except SecAggAbort as err:
        record.update(secagg_aborted=str(err), secagg_seconds=seconds)
        return {"sum": None, "survivors": [], "record": record, "lost": phases.lost, "dead": phases.dead}
    survivors = sorted(active[u] for u in server.u3)
    client_bytes = [b for r in replies for b in r["bytes_sent"].values()]
    record.update(
        secagg_seconds=seconds,
        secagg_bytes_per_client=round(float(np.mean(client_bytes)), 1) if client_bytes else 0.0,
        secagg_server_bytes_received=int(server.bytes_received),
        secagg_rounding_bound=rounding_error_bound(n, sa.resolved_scale))
    out = {"sum": decode(total, bits=sa.bits, scale=sa.resolved_scale), "survivors": survivors, "record": record,
           "lost": phases.lost, "dead": phases.dead}
    if calibration is not None:
        terms = {c: v for r in replies for c, v in r["calibration"].items()}
        # client-id order: the same float sum for any pool
        out["calibration"] = {"sum": sum(terms[c] for c in sorted(terms)) if terms else None,
                              "clients": sorted(terms)}
    if "layers_from" in extras:
        out["layer_seeds"] = {active[u]: dict(seeds) for u, seeds in server.layer_seeds.items()}
    return out


def server_threshold(config: SecAggConfig) -> int:
    return int(min(config.graph.thresholds)) if config.graph.thresholds else 0
