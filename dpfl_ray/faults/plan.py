"""Faults are data (ARCHITECTURE.md, principle 4): a plan drawn from the scenario and the seed,
before the round runs, saying which sampled client drops in which phase, who straggles and by how
long, which worker crashes when, which node is lost, and who sends a corrupt update. The runtime
carries the plan out; aggregation uses survivors only. docs/faults.md describes each kind.

Every kind draws from its own stream (``rng.generator(seed, purpose, round[, client])``), so
switching one kind on never changes who is hit by another: the dropout plan of a scenario stays
bit-identical whatever else its ``faults:`` section says.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from .. import rng as rngmod
from ..defaults import MAX_LATENCY_S
# re-exported: the runtime takes every fault helper from here
from .availability import TRACE_HEADER, load_trace  # noqa: F401
from .corruption import CORRUPTIONS, check_update, corrupt, corruption_rng  # noqa: F401

# The phases a client can vanish in, in protocol order. 'advertise' and 'share' are SecAgg's key
# rounds, 'upload' is the (masked) input, 'unmask' comes after the input reached the server, and
# 'calibration' after the unmask shares, before the client's calibration term (Baek et al. Alg. 2
# line 22) is sent.
PHASES = ("training", "advertise", "share", "upload", "unmask", "calibration")
# A client that leaves in one of these phases has already delivered its update.
DELIVERED_PHASES = ("unmask", "calibration")
SECAGG_ONLY_PHASES = ("advertise", "share", "unmask")
# Fault-plan phase -> the worker's phase (dpfl_ray.secagg.PHASES, then Baek's calibration)
SECAGG_PHASE = {"advertise": "advertise", "share": "share", "upload": "masked_input", "unmask": "unmask",
                "calibration": "calibration"}

# Why a client is missing from a round: one vocabulary in plans, records, ledger and docs.
DROPOUT = "dropout"          # the scenario's dropout model (bernoulli / tail)
STRAGGLER = "straggler"      # its update came after the deadline, or after the round had its first m
CRASH = "crash"              # its worker died in that phase
NODE_LOST = "node_lost"      # its worker's node was removed
REJECTED = "rejected"        # its update failed check_update (NaN, Inf, wrong shape, absurd norm)
UNAVAILABLE = "unavailable"  # the availability trace says the device was offline
EXHAUSTED = "exhausted"      # its own privacy budget is spent: it quits (record-level algorithms)
CAUSES = (DROPOUT, STRAGGLER, CRASH, NODE_LOST, REJECTED, UNAVAILABLE, EXHAUSTED)
# When two causes hit one client in the same phase, the record names the first of these.
_PRECEDENCE = (UNAVAILABLE, EXHAUSTED, NODE_LOST, CRASH, DROPOUT, STRAGGLER, REJECTED)


@dataclass(frozen=True)
class Dropout:
    """One client's absence: why (a :data:`CAUSES` entry) and in which :data:`PHASES` entry."""

    cause: str
    phase: str

    def __post_init__(self):
        if self.cause not in CAUSES or self.phase not in PHASES:
            raise ValueError(f"not a dropout: {self.cause!r} in phase {self.phase!r}")

    @property
    def label(self) -> str:
        return f"{self.cause}@{self.phase}"

    @classmethod
    def parse(cls, label: str) -> Dropout:
        """Read a label: 'cause@phase', a bare phase (the dropout model), and today's runtime
        labels ('crash', 'deadline@masked_input') so old records read the same way."""
        cause, _, phase = label.partition("@") if "@" in label else (
            (DROPOUT, "", label) if label in PHASES else (label, "", "training"))
        cause = STRAGGLER if cause == "deadline" else cause
        phase = "upload" if phase == "masked_input" else phase
        return cls(cause, phase)

    def precedes(self, other: Dropout) -> bool:
        return (PHASES.index(self.phase), _PRECEDENCE.index(self.cause)) < (
            PHASES.index(other.phase), _PRECEDENCE.index(other.cause))


@dataclass(frozen=True)
class WorkerCrash:
    """Kill worker slot ``worker`` (an index into the pool) during ``phase``."""

    worker: int
    phase: str


@dataclass(frozen=True)
class NodeLoss:
    """Remove a node during ``phase``: the ``pick % n``-th of the n removable nodes, by node id."""

    pick: int
    phase: str


@dataclass(frozen=True)
class RoundFaults:
    """Everything the runtime needs to carry one round's faults out."""

    dropped: dict[int, str] = field(default_factory=dict)  # client id -> phase, every planned dropout
    report_order: tuple[int, ...] = ()
    causes: dict[int, str] = field(default_factory=dict)  # client id -> cause, where not DROPOUT
    delays: dict[int, float] = field(default_factory=dict)  # client id -> seconds its update is held back
    crashes: tuple[WorkerCrash, ...] = ()
    nodes_lost: tuple[NodeLoss, ...] = ()
    corrupt: dict[int, str] = field(default_factory=dict)  # client id -> a CORRUPTIONS entry

    def delivers(self, client_id: int) -> bool:
        """Did this client's update reach the server (it may still vanish afterwards)?"""
        return self.dropped.get(int(client_id), "unmask") in DELIVERED_PHASES

    def survivors(self, sampled) -> list[int]:
        return [int(c) for c in sampled if self.delivers(c)]

    def dropouts(self) -> dict[int, Dropout]:
        return {c: Dropout(self.causes.get(c, DROPOUT), p) for c, p in self.dropped.items()}


def num_tail_drops(rate: float, n: int) -> int:
    """Round-half-up of rate * n, guarded against float noise (0.3 * 10 -> 3)."""
    return min(n, int(math.floor(rate * n + 0.5 + 1e-9)))


def plan_round(dropout_cfg, sampled: np.ndarray, seed: int, round_idx: int) -> RoundFaults:
    """Draw the round's dropouts.

    ``dropout_cfg`` is one dropout model or a list of them (several phases of one round); they
    act in protocol order, each on the clients still present in its phase, so a ``rate`` of a
    later phase is a fraction of the clients that reached it.

    ``bernoulli``: each present client drops independently with probability ``rate``.
    ``tail``: clients report in a seeded random order and the last ``rate`` fraction to report
    drop (Baek et al. 2021, Sec. VI.B.2: 'dropped out in the order in which the data are sent').
    """
    specs = list(dropout_cfg) if isinstance(dropout_cfg, (list, tuple)) else [dropout_cfg]
    sampled = [int(c) for c in sampled]
    g = rngmod.generator(seed, "faults", round_idx)
    order = tuple(int(c) for c in g.permutation(sampled)) if sampled else ()
    dropped: dict[int, str] = {}
    for spec in sorted(specs, key=lambda d: PHASES.index(d.phase)):
        model, rate, phase = spec.model, spec.rate, spec.phase
        present = [c for c in sampled if c not in dropped]
        if model == "none" or rate == 0 or not present:
            continue
        if model == "bernoulli":
            hits = g.random(len(present)) < rate
            dropped.update({c: phase for c, h in zip(present, hits) if h})
        elif model == "tail":
            still = [c for c in order if c not in dropped]
            k = num_tail_drops(rate, len(still))
            dropped.update({c: phase for c in still[len(still) - k:]})
        else:
            raise ValueError(f"unknown dropout model {model!r}")
    return RoundFaults(dropped, order)


# --- overcommit and deadlines -------------------------------------------------------------------

def select_reporters(report_times: Mapping[int, float], deadline_s: float | None, target: int | None,
                     order: Sequence[int] = ()) -> tuple[list[int], list[int]]:
    """(kept, late): the server closes the round when ``target`` updates have arrived or the
    deadline passes, whichever is first; every later update is late (Bonawitz et al. 2019,
    Sec. 2.2 'Reporting' and Sec. 9 'pace steering': select 130% of the target, keep the first).
    Equal report times are broken by ``order`` (the round's seeded report order), then by id.
    """
    rank = {int(c): i for i, c in enumerate(order)}
    ranked = sorted(report_times, key=lambda c: (report_times[c], rank.get(int(c), len(rank)), c))
    on_time = [c for c in ranked if deadline_s is None or report_times[c] <= deadline_s]
    kept = on_time if target is None else on_time[:target]
    chosen = set(kept)
    return sorted(kept), [c for c in ranked if c not in chosen]


def overcommitted(sampling):
    """The sampling the runtime draws with: ceil(overcommit * m) of K, or rate overcommit * q."""
    if sampling.overcommit <= 1:
        return sampling
    if sampling.mode == "poisson":
        return sampling.model_copy(update={"rate": min(1.0, sampling.rate * sampling.overcommit)})
    m = math.ceil(sampling.clients_per_round * sampling.overcommit - 1e-9)
    return sampling.model_copy(update={"clients_per_round": m})


def cohort_target(sampling, num_clients: int) -> int | None:
    """How many reports an overcommitted round keeps (None: no overcommit, keep every report)."""
    if sampling.overcommit <= 1:
        return None
    if sampling.mode == "poisson":
        return max(1, round(sampling.rate * num_clients))
    return sampling.clients_per_round


# --- stragglers, crashes, node losses ----------------------------------------------------------

def draw_latency(latency, g: np.random.Generator) -> float:
    if latency.distribution == "fixed":
        return float(latency.seconds)
    if latency.distribution == "lognormal":  # a tail draw past the schema's bound is the bound
        return min(float(g.lognormal(math.log(latency.median_s), latency.sigma)), MAX_LATENCY_S)
    return float(g.uniform(latency.low_s, latency.high_s))


def straggler_tiers(stragglers, num_clients: int, seed: int) -> dict[int, int]:
    """client id -> tier index, drawn once per run: listed clients first, then each ``share``
    tier takes round(share * K) of the remaining clients in a seeded order."""
    tiers: dict[int, int] = {}
    for i, tier in enumerate(stragglers.tiers):
        for c in tier.clients or ():
            tiers.setdefault(int(c), i)
    pool = [int(c) for c in rngmod.generator(seed, "straggler_tiers").permutation(num_clients) if int(c) not in tiers]
    for i, tier in enumerate(stragglers.tiers):
        if tier.share is not None:
            take = min(len(pool), round(tier.share * num_clients))
            tiers.update({c: i for c in pool[:take]})
            pool = pool[take:]
    return tiers


def parse_crash_points(at) -> list[tuple[int, str, int | None]]:
    """``crash.at`` entries as (round, phase, worker or None); ValueError names a bad entry."""
    points = []
    for i, entry in enumerate(at):
        ok = isinstance(entry, (list, tuple)) and len(entry) in (2, 3)
        ok = ok and isinstance(entry[0], int) and not isinstance(entry[0], bool) and entry[0] >= 1
        ok = ok and entry[1] in PHASES and (len(entry) == 2 or (isinstance(entry[2], int) and entry[2] >= 0))
        if not ok:
            raise ValueError(f"entry {i} ({entry!r}) must be [round >= 1, phase] or [round, phase, worker >= 0] "
                             f"with phase one of {', '.join(PHASES)}")
        points.append((entry[0], entry[1], entry[2] if len(entry) == 3 else None))
    return points


@dataclass(frozen=True)
class FaultPlan:
    """The whole run's faults, built once on the driver (it reads the trace file) and shipped to
    whoever runs the rounds; :meth:`plan` draws one round."""

    faults: object  # scenario.FaultsConfig
    seed: int
    num_clients: int
    deadline_s: float | None = None
    target: int | None = None  # overcommit: keep the first `target` reports
    unavailable: frozenset = frozenset()
    tiers: dict = field(default_factory=dict)

    @classmethod
    def from_scenario(cls, sc) -> FaultPlan:
        f, k = sc.faults, sc.data.num_clients
        return cls(f, sc.seed, k, sc.training.round_deadline_s, cohort_target(sc.sampling, k),
                   load_trace(f.availability.trace, k) if f.availability else frozenset(),
                   straggler_tiers(f.stragglers, k, sc.seed) if f.stragglers else {})

    def plan(self, round_idx: int, sampled, num_workers: int = 1) -> RoundFaults:
        """Round ``round_idx`` (from 0) of the sampled cohort. Each kind is drawn on its own; a
        client hit by several is recorded with the earliest in protocol order."""
        base = plan_round(self.faults.dropouts, sampled, self.seed, round_idx)
        sampled = [int(c) for c in sampled]
        hits = base.dropouts()
        for c in sampled:
            if (round_idx + 1, c) in self.unavailable:
                _hit(hits, c, Dropout(UNAVAILABLE, "training"))
        delays = self._delays(round_idx, [c for c in sampled if c not in hits or hits[c].phase != "training"])
        reporters = {c: delays.get(c, 0.0) for c in sampled
                     if c not in hits or PHASES.index(hits[c].phase) > PHASES.index("upload")}
        _, late = select_reporters(reporters, self.deadline_s, self.target, base.report_order)
        for c in late:
            _hit(hits, c, Dropout(STRAGGLER, "upload"))
        delivering = [c for c in sampled if c not in hits or hits[c].phase in DELIVERED_PHASES]
        return RoundFaults(
            {c: d.phase for c, d in hits.items()}, base.report_order,
            {c: d.cause for c, d in hits.items() if d.cause != DROPOUT}, delays,
            self._crashes(round_idx, num_workers), self._nodes_lost(round_idx), self._corrupt(round_idx, delivering))

    def _delays(self, t: int, clients: list[int]) -> dict[int, float]:
        cfg = self.faults.stragglers
        delays: dict[int, float] = {}
        if cfg is None:
            return delays
        for c in clients:
            g = rngmod.generator(self.seed, "stragglers", t, c)
            if c in self.tiers:
                delays[c] = draw_latency(cfg.tiers[self.tiers[c]].latency, g)
            elif cfg.fraction > 0 and g.random() < cfg.fraction:
                delays[c] = draw_latency(cfg.latency, g)
        return delays

    def _crashes(self, t: int, num_workers: int) -> tuple[WorkerCrash, ...]:
        cfg = self.faults.crash
        if cfg is None or num_workers < 1:
            return ()
        g = rngmod.generator(self.seed, "crash", t)
        found = {int(w): cfg.phase for w in np.flatnonzero(g.random(num_workers) < cfg.rate)} if cfg.rate else {}
        for round_no, phase, worker in parse_crash_points(cfg.at):
            if round_no == t + 1:
                w = int(g.integers(num_workers)) if worker is None else worker % num_workers
                if w not in found or PHASES.index(phase) < PHASES.index(found[w]):
                    found[w] = phase
        return tuple(WorkerCrash(w, p) for w, p in sorted(found.items()))

    def _nodes_lost(self, t: int) -> tuple[NodeLoss, ...]:
        cfg = self.faults.node_failure
        if cfg is None or t + 1 not in cfg.rounds:
            return ()
        picks = rngmod.generator(self.seed, "node_failure", t).integers(2 ** 31, size=cfg.nodes)
        return tuple(NodeLoss(int(p), cfg.phase) for p in picks)

    def _corrupt(self, t: int, clients: list[int]) -> dict[int, str]:
        cfg = self.faults.corrupt
        out: dict[int, str] = {}
        if cfg is None:
            return out
        listed, kinds = set(cfg.clients), cfg.kinds
        for c in clients:
            g = rngmod.generator(self.seed, "corrupt", t, c)
            if c in listed or (cfg.fraction > 0 and g.random() < cfg.fraction):
                out[c] = kinds[int(g.integers(len(kinds)))] if len(kinds) > 1 else kinds[0]
        return out


def _hit(hits: dict[int, Dropout], client: int, d: Dropout) -> None:
    if client not in hits or d.precedes(hits[client]):
        hits[client] = d


# --- records ------------------------------------------------------------------------------------

def tally(dropouts: Mapping[int, Dropout | str]) -> dict:
    """The dropout fields of a rounds.jsonl row: ``dropped`` {cause: {phase: n}},
    ``dropped_clients`` {cause: [ids]}, and ``dropped_by_phase`` {phase: n} (all causes, as before)."""
    by_cause: dict[str, dict[str, int]] = {}
    clients: dict[str, list[int]] = {}
    by_phase: dict[str, int] = {}
    for c in sorted(dropouts):
        d = dropouts[c] if isinstance(dropouts[c], Dropout) else Dropout.parse(dropouts[c])
        phases = by_cause.setdefault(d.cause, {})
        phases[d.phase] = phases.get(d.phase, 0) + 1
        clients.setdefault(d.cause, []).append(int(c))
        by_phase[d.phase] = by_phase.get(d.phase, 0) + 1
    return {"dropped": by_cause, "dropped_clients": clients, "dropped_by_phase": by_phase}


# --- scenario checks ----------------------------------------------------------------------------

def check_scenario(sc, read_files: bool = True) -> None:
    """Fault settings that cannot be carried out in this scenario; ValueError('field: why').
    ``read_files=False`` skips the availability trace (where the file is not at hand)."""
    f, k, rounds = sc.faults, sc.data.num_clients, sc.training.rounds
    s = sc.sampling
    if s.overcommit > 1 and s.mode == "fixed" and overcommitted(s).clients_per_round > k:
        raise ValueError(f"sampling.overcommit: {s.overcommit:g} x {s.clients_per_round} clients needs "
                         f"{overcommitted(s).clients_per_round}, more than data.num_clients={k}")
    if s.overcommit > 1 and s.mode == "poisson" and s.rate * s.overcommit > 1:
        raise ValueError(f"sampling.overcommit: {s.overcommit:g} x rate {s.rate:g} exceeds 1")
    phases = [("faults.crash.phase", f.crash.phase)] if f.crash else []
    if f.crash:
        for round_no, phase, worker in parse_crash_points(f.crash.at):
            _check_round("faults.crash.at", round_no, rounds)
            phases.append(("faults.crash.at", phase))
            if worker is not None and isinstance(sc.resources.workers, int) and worker >= sc.resources.workers:
                raise ValueError(f"faults.crash.at: worker {worker} does not exist "
                                 f"(resources.workers={sc.resources.workers})")
    if f.node_failure:
        for round_no in f.node_failure.rounds:
            _check_round("faults.node_failure.at_round", round_no, rounds)
        phases.append(("faults.node_failure.phase", f.node_failure.phase))
    for where, phase in phases:
        if phase in SECAGG_ONLY_PHASES and not sc.secagg.enabled:
            raise ValueError(f"{where}: phase {phase!r} exists only with secagg.enabled: true")
        if phase == "calibration" and not _has_calibration_phase(sc):
            raise ValueError(f"{where}: {sc.training.algorithm} has no calibration phase")
    _check_clients("faults.corrupt.clients", f.corrupt.clients if f.corrupt else [], k)
    if f.stragglers:
        listed = [c for t in f.stragglers.tiers for c in (t.clients or [])]
        _check_clients("faults.stragglers.tiers", listed, k)
        if len(set(listed)) < len(listed):
            raise ValueError("faults.stragglers.tiers: a client is listed in two tiers")
        if sum(t.share or 0 for t in f.stragglers.tiers) > 1 + 1e-9:
            raise ValueError("faults.stragglers.tiers: the shares add up to more than 1")
    if f.availability and read_files:
        load_trace(f.availability.trace, k)  # a DPFLError is a ValueError naming the line


def _has_calibration_phase(sc) -> bool:
    from ..algorithms import algorithm_class

    return algorithm_class(sc).has_calibration_phase


def _check_round(where: str, round_no: int, rounds: int) -> None:
    if round_no > rounds:
        raise ValueError(f"{where}: round {round_no} is past training.rounds={rounds}")


def _check_clients(where: str, clients, num_clients: int) -> None:
    bad = [c for c in clients if c >= num_clients]
    if bad:
        raise ValueError(f"{where}: client {bad[0]} does not exist (data.num_clients={num_clients})")
