"""One secure aggregation of a round, run by the coordinator over its workers (Bonawitz et al. 2017
Rounds 0-2 and 4; SecAgg+ of Bell et al. 2020).

Workers host the client state machines and pre-sum their clients' masked inputs; the coordinator
hosts the server. A worker that crashes or misses a phase's deadline loses its clients from that
phase on, and the protocol's recovery (Shamir shares held by the others) takes over.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import ray
from ray.exceptions import GetTimeoutError, RayActorError

from ..algorithms import Abort, CalibrationSum, ClientSpec, RoundOutcome, UnmaskPlan
from ..errors import DPFLError
from ..faults.plan import CRASH, SECAGG_PHASE, STRAGGLER
from ..secagg import (SecAggAbort, SecAggError, SecAggRoundConfig, SecAggServer, decode, rounding_error_bound,
                      secure_sum)
from ..secagg.keys import expand_masks
from ..secagg.ring import decode_sum, ring_sum
from ..secagg.server import MaskExpander
from .messages import Encoding, PhaseReply, WorkerChaos
from .resources import deal

def real_deadline(training) -> float:
    """How long a phase is really waited for. Who is late is decided by the fault plan (planned
    delays against training.round_deadline_s), so results never depend on timing; the real wait
    adds room for the computation itself and only cuts off workers that truly hang. With no
    planned deadline the wait is training.hang_timeout_s, and a worker still at work then stops
    the run (:func:`unplanned_wait`) instead of losing its clients to the machine's speed."""
    deadline_s = training.round_deadline_s
    if deadline_s is None:
        return training.hang_timeout_s
    return deadline_s + max(10.0, deadline_s)


def unplanned_wait(training, round_no: int, phase: str, late: list) -> None:
    """Raise if workers outlived a wait that no planned deadline set: who is late must never
    depend on how fast this machine trains, so the run stops with its committed rounds on disk.
    The late workers are killed first, so that none goes on computing after the run."""
    if not late or training.round_deadline_s is not None:
        return
    for w in late:
        ray.kill(w, no_restart=True)
    raise DPFLError(f"round {round_no}: {len(late)} worker(s) still at work in phase {phase!r} after "
                    f"{training.hang_timeout_s:g} s, and no training.round_deadline_s is planned; no client is "
                    "dropped for this machine's speed: raise training.hang_timeout_s above a round's time (a "
                    "hung worker is what it catches) and run again", field="training.hang_timeout_s")


@dataclass
class SecAggRound:
    """What one secure aggregation produced: the outcome for the algorithm, the round's record,
    who was lost how (client id -> 'cause@phase', the vocabulary of dpfl_ray.faults.plan), whose
    update was refused and why, dead workers, and whether a calibration phase ran."""

    outcome: RoundOutcome
    record: dict
    lost: dict[int, str] = field(default_factory=dict)
    dead: list = field(default_factory=list)
    calibrated: bool = False
    rejected: dict[int, str] = field(default_factory=dict)


# the fault plan's name of each call's phase: a calibration sender is lost when the server asks who calibrates
_FAULT_PHASES = {"advertise": ("training", "advertise"), "share": ("share",), "masked_input": ("upload",),
                 "unmask": ("unmask",), "calibrating": ("calibration",), "calibration": ()}
# the phase a client lost in each call is recorded under (dpfl_ray.faults.plan's vocabulary)
_LOST_IN = {"masked_input": "upload", "calibrating": "calibration"}


class _Phases:
    """Call one method on the live workers, collect replies; crashed or late workers go dark.
    ``strike(phase)`` carries out the crashes and node losses planned for a phase before its call
    and says which workers it took down ({handle: cause})."""

    def __init__(self, assignment: dict, timeout: float | None, strike=None, unplanned=None):
        self.live = dict(assignment)  # worker handle -> its client ids this round
        self.timeout = timeout
        # (training config, round) when no phase deadline is configured: a worker still at work stops the run
        self.unplanned = unplanned
        self.strike = strike or (lambda phase: {})
        self.lost: dict[int, str] = {}
        self.dead: list = []
        self.rejected: dict[int, str] = {}
        self.reports: dict = {}

    def call(self, phase: str, make_call) -> list[PhaseReply]:
        struck = {}  # worker -> 'cause@phase': a planned strike is recorded in the phase it was planned for
        for fault_phase in _FAULT_PHASES[phase]:
            struck.update({w: f"{cause}@{fault_phase}" for w, cause in self.strike(fault_phase).items()})
        where = _LOST_IN.get(phase, phase)
        refs = {make_call(w, ids): w for w, ids in self.live.items()}
        ready, late = ray.wait(list(refs), num_returns=len(refs), timeout=self.timeout) if refs else ([], [])
        if self.unplanned is not None:
            unplanned_wait(*self.unplanned, phase, [refs[r] for r in late])
        replies = []
        for ref in ready:
            try:
                if refs[ref] in struck:  # killed as planned: a reply that beat ray.kill never counts
                    raise RayActorError()
                replies.append(ray.get(ref, timeout=60))
            except (RayActorError, GetTimeoutError):
                self._drop(refs[ref], struck.get(refs[ref], f"{CRASH}@{where}"))
                self.dead.append(refs[ref])
        for ref in late:  # past the deadline: the worker is killed and replaced after the round
            self._drop(refs[ref], f"{STRAGGLER}@{where}")
            ray.kill(refs[ref], no_restart=True)
            self.dead.append(refs[ref])
        for r in replies:
            self.rejected.update(r.rejected)
            self.reports.update(r.reports)
        aborted = [r.aborted for r in replies if r.aborted]
        if aborted:
            raise SecAggAbort(f"abort in phase {phase!r}: {aborted[0]}", phase=phase)
        return replies

    def _drop(self, worker, why: str) -> None:
        for cid in self.live.pop(worker):
            self.lost[cid] = why


def pool_expander(workers: list, timeout: float) -> MaskExpander:
    """The server's mask expansion (the bulk of its unmasking work) shared among the workers, idle
    at that point, so the coordinator, which reserves no CPU, does not do it alone. Each worker
    sums its share mod 2^bits; the shares are added here, which gives the same words in any split.
    A share whose worker fails is expanded here."""
    def expand(masks, dim: int, dtype: str) -> np.ndarray:
        shares = deal(list(masks), len(workers))
        if not shares:
            return expand_masks(masks, dim, dtype)
        refs = [w.expand_masks.remote(share, dim, dtype) for w, share in zip(workers, shares)]
        ray.wait(refs, num_returns=len(refs), timeout=timeout)  # one deadline for the whole pool
        total = np.zeros(dim, np.dtype(dtype))
        for ref, share in zip(refs, shares):
            try:
                part = ray.get(ref, timeout=0)
            except (RayActorError, GetTimeoutError):
                part = expand_masks(share, dim, dtype)
            np.add(total, part, out=total)
        return total
    return expand


def _messages(replies: list[PhaseReply]):
    return (m for r in replies for m in r.messages)


def secagg_round(coord, t: int, theta_ref, active: list[int], absent: int, faults, spec: ClientSpec,
                 after_upload: Callable[[list[int]], UnmaskPlan | Abort], chaos: dict | None = None,
                 strike=None, canaries=None,
                 before_calibration: Callable[[list[int]], str | None] | None = None,
                 calibration_lost: Callable[[int], str | None] | None = None) -> SecAggRound:
    """Securely sum w_i * spec.vector(Delta_i) (+ the client's noise) over ``active`` clients (those
    that trained; ``absent`` more were sampled). ``after_upload(survivors)`` sees who uploaded
    before unmasking and returns what the unmask request carries, or an Abort. ``chaos``: each
    worker's WorkerChaos; ``strike(phase)``: carries out the planned crashes and node losses.
    ``before_calibration(senders)``: why the calibration terms of these senders must not be asked
    for, or None; asked before any term leaves a client. ``calibration_lost(k)``: why the terms
    that came must not be summed when k listed senders' terms did not (a worker lost in between)."""
    sc, sa = coord.sc, coord.sc.secagg
    index = {cid: i for i, cid in enumerate(active)}
    n = len(active)
    if sa.threshold == "majority":  # secagg+ already defaults to a majority of each neighbourhood
        threshold = n // 2 + 1 if sa.protocol == "secagg" else None
    else:
        threshold = min(sa.threshold, n) if sa.threshold else None
    ring = spec.ring  # integer noise: SecAgg runs in Z_2^ring.bits, each word sent in ring.bits bits
    config = SecAggRoundConfig(n_clients=n, bits=sa.bits, protocol=sa.protocol, threshold=threshold,
                          round_id=t, graph_seed=sc.seed,
                          degree=min(sa.degree, n - 1) if sa.degree and n > 2 else None,
                          dim=ring.dim if ring is not None else int(coord.theta.size) + spec.extra_dims,
                          dropout_fraction=sa.dropout_tolerance, failure_log2=sa.failure_log2)
    server = SecAggServer(config)
    leave = {c: SECAGG_PHASE[p] for c, p in faults.dropped.items() if p in SECAGG_PHASE and c in index}
    assignment = {w: ids for w, ids in zip(coord.workers, coord.assign(active)) if ids}
    # a phase without a configured deadline still has one: a hung worker never hangs the run
    phases = _Phases(assignment, sa.phase_timeout_seconds or real_deadline(coord.sc.training), strike,
                     None if sa.phase_timeout_seconds else (coord.sc.training, t + 1))
    chaos = chaos or {}
    encoding = Encoding(sa.resolved_scale, sa.overflow, n)
    seconds, record = {}, {"secagg_protocol": sa.protocol, "secagg_threshold": server_threshold(config)}
    guarantee = config.guarantee
    if guarantee is not None:  # SecAgg+ sized for a dropout fraction (docs/secagg.md)
        record.update(secagg_degree=guarantee.degree, secagg_failure_bound=guarantee.failure)

    def timed(phase, fn):
        start = time.perf_counter()
        out = fn()
        seconds[phase] = round(time.perf_counter() - start, 4)
        return out

    plan = UnmaskPlan()

    def stopped(reason_key: str, reason: str) -> SecAggRound:
        record.update({reason_key: reason, "secagg_seconds": seconds})
        return SecAggRound(RoundOutcome(t, aborted=reason), record, phases.lost, phases.dead,
                           calibrated=plan.calibration_n_prime is not None, rejected=phases.rejected)

    weights = {c: float(coord.weights[c]) for c in active}
    try:
        replies = timed("advertise", lambda: phases.call("advertise", lambda w, ids: w.secagg_start.remote(
            t, theta_ref, {c: index[c] for c in ids}, {c: leave[c] for c in ids if c in leave}, config,
            {c: weights[c] for c in ids}, encoding, spec, chaos.get(w, WorkerChaos()), canaries)))
        record["secagg_clipped"] = sum(r.clipped for r in replies)
        keys = timed("advertise_server", lambda: server.receive_keys(_messages(replies)))
        replies = timed("share", lambda: phases.call("share", lambda w, ids: w.secagg_share.remote(keys, absent)))
        forwarded = timed("share_server", lambda: server.receive_shares(_messages(replies)))
        replies = timed("masked_input", lambda: phases.call("masked_input", lambda w, ids: w.secagg_masked.remote(
            {index[c]: forwarded[index[c]] for c in ids if index[c] in forwarded})))
        request = timed("masked_input_server", lambda: server.receive_masked(_messages(replies)))
        plan = after_upload(sorted(active[u] for u in server.u3))
        if isinstance(plan, Abort):  # the mechanism refuses to release this round
            reason, plan = plan.reason, UnmaskPlan()
            return stopped("round_aborted", reason)
        if plan.layers_from is not None:
            request = server.request_layers(request, plan.layers_from)
        replies = timed("unmask", lambda: phases.call("unmask", lambda w, ids: w.secagg_unmask.remote(request)))
        total = timed("reconstruct", lambda: server.receive_unmask(_messages(replies),
                                                                   pool_expander(list(phases.live), phases.timeout)))
    except SecAggAbort as err:
        return stopped("secagg_aborted", str(err))
    except SecAggError as err:  # a message against the protocol: this round releases nothing, the run goes on
        return stopped("secagg_aborted", f"protocol violation: {err}")
    survivors = tuple(sorted(active[u] for u in server.u3))
    client_bytes = {u: b for r in replies for u, b in r.bytes_sent.items()}
    dim = int(coord.theta.size)
    calibration, first = None, _decoded(total, sa, ring, dim)
    if plan.calibration_n_prime is not None:
        # who calibrates, then the check and listing of exactly them, then their terms: a term the
        # server must not sum never reaches it (a rerun round with other senders than its release before)
        ready = timed("calibrating", lambda: phases.call("calibrating", lambda w, ids: w.secagg_calibrating.remote(
            request["survivors"])))
        senders = sorted(c for r in ready for c in r.calibration)
        refused = before_calibration(senders) if before_calibration else None
        if refused is not None:  # A is unmasked, as in the release before; no term was asked for
            return stopped("round_aborted", refused)
        n_prime = plan.calibration_n_prime
        sent_terms = timed("calibration", lambda: phases.call("calibration", lambda w, ids: w.secagg_calibration.remote(
            [index[c] for c in senders if c in ids], n_prime))) if senders else []
        terms = {c: v for r in sent_terms for c, v in r.calibration.items()}
        for r in sent_terms:
            for u, b in r.bytes_sent.items():
                client_bytes[u] = client_bytes.get(u, 0) + b
        if len(terms) < len(senders):  # a worker lost after the listing: the server holds the others' terms
            record["secagg_calibration_terms_lost"] = len(senders) - len(terms)
            refused = calibration_lost(len(senders) - len(terms)) if calibration_lost else None
            if refused is not None:  # a sum over other senders than listed: a rerun could not be checked
                return stopped("round_aborted", refused)
        if ring is None:  # client-id order: the same float sum for any pool
            calibration = CalibrationSum(sum(terms[c] for c in sorted(terms)) if terms else None, tuple(sorted(terms)))
        else:
            calibration, sent = _secure_calibration(terms, total, first, sa, ring, t, sc.seed, dim, record)
            for c, b in sent.items():
                client_bytes[index[c]] = client_bytes.get(index[c], 0) + b
    else:  # no calibration phase this round: a crash or node loss planned for it comes now, after the unmask
        for w in phases.strike("calibration"):
            if w in phases.live:
                phases.live.pop(w)
                phases.dead.append(w)
    record.update(
        secagg_seconds=seconds,
        secagg_bytes_per_client=round(float(np.mean(list(client_bytes.values()))), 1) if client_bytes else 0.0,
        secagg_server_bytes_received=int(server.bytes_received))
    if ring is None:
        record["secagg_rounding_bound"] = rounding_error_bound(n, sa.resolved_scale)
    layer_seeds = None
    if plan.layers_from is not None:
        layer_seeds = {active[u]: dict(seeds) for u, seeds in server.layer_seeds.items()}
    outcome = RoundOutcome(t, survivors=survivors, total=first,
                           calibration=calibration, layer_seeds=layer_seeds, words=None if ring is None else total,
                           reports={c: phases.reports[c] for c in survivors if c in phases.reports})
    return SecAggRound(outcome, record, phases.lost, phases.dead, calibrated=calibration is not None,
                       rejected=phases.rejected)


def _secure_calibration(terms: dict, total: np.ndarray, first: np.ndarray, sa, ring, t: int, seed: int, dim: int,
                        record: dict) -> tuple[CalibrationSum, dict[int, int]]:
    """Integer calibration terms (Alg. 2 line 22) go through a secure sum of their own among the
    senders, with real keys: the server sees their sum, never one client's term (for integer noise
    the terms one by one would tell it more than their sum; docs/distributed_dp.md). The release is
    decoded whole from A + that sum mod 2^b. A secure sum that cannot finish leaves the round
    uncalibrated (no term reached the server). ``first``: A decoded. Returns the sum and each sender's
    bytes in it."""
    senders = sorted(terms)
    if not senders:
        return CalibrationSum(None, ()), {}
    k = len(senders)
    try:
        out = secure_sum([terms[c] for c in senders], bits=ring.bits, protocol=sa.protocol,
                         threshold=k // 2 + 1 if sa.protocol == "secagg" else None, round_id=t, graph_seed=seed,
                         dropout_fraction=sa.dropout_tolerance, failure_log2=sa.failure_log2)
    except SecAggAbort as err:
        record["secagg_calibration_aborted"] = str(err)
        return CalibrationSum(None, ()), {}
    record["secagg_calibration_seconds"] = round(float(sum(out.seconds_by_phase.values())), 4)
    release = decode_sum(ring_sum([np.asarray(total, dtype=np.uint64), out.sum], ring.bits), ring.bits, ring.scale,
                         ring.rotation_seed, dim)
    return (CalibrationSum(release - first, tuple(senders), release=release),
            {senders[u]: int(b) for u, b in out.bytes_per_client.items()})


def _decoded(total: np.ndarray, sa, ring, dim: int) -> np.ndarray:
    """The float sum from SecAgg's words: fixed-point decoding, or, for integer noise, the words
    mod 2^bits read as centred integers, rotated back and unscaled (secagg/ring.py)."""
    if ring is None:
        return decode(total, bits=sa.bits, scale=sa.resolved_scale)
    return decode_sum(total, ring.bits, ring.scale, ring.rotation_seed, dim)


def server_threshold(config: SecAggRoundConfig) -> int:
    return int(min(config.graph.thresholds)) if config.graph.thresholds else 0
