"""What crosses the Ray boundary between the coordinator and its ClientWorkers (besides the
algorithm's ClientSpec and the secure-aggregation protocol's own message dicts)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Pending:
    """An object ref handed to an actor unresolved: Ray resolves only an actor's top-level
    arguments, and waits for them before the actor's process starts. The coordinator's initial
    model comes from a worker (ClientWorker.initial_model) this way, so both processes start at once."""

    ref: object


@dataclass(frozen=True)
class WorkerChaos:
    """A worker's share of the round's planned faults: how long its on-time clients hold their
    uploads back (the slowest of them; the straggler sleeps for real), which clients send a
    corrupt update and of which kind, and the norm above which any update is rejected."""

    delay: float = 0.0
    corrupt: dict = field(default_factory=dict)
    max_norm: float | None = None


@dataclass(frozen=True)
class Canaries:
    """Audit canary clients (dpfl_ray.privacy.audit): clients ``first_id`` and up have no data and
    send ``norm`` * u_j, u_j the seeded unit direction j = id - first_id, instead of an update."""

    seed: int
    first_id: int
    norm: float


@dataclass(frozen=True)
class LocalReply:
    """One worker's round: the clients whose upload arrived, and either their uploads stacked in
    ``client_ids`` order (ClientSpec.per_client) or, per summation group, sum_i w_i * upload_i
    in float64, accumulated in client-id order."""

    client_ids: list[int]
    seconds: float
    updates: np.ndarray | None = None
    sums: dict = field(default_factory=dict)
    rejected: dict = field(default_factory=dict)  # client id -> why its update was refused
    reports: dict = field(default_factory=dict)  # client id -> ClientReport of its local procedure
    # when the call carried test ranges (Coordinator._settle): the last round's model evaluated on
    # them, (correct, summed loss) per range, and the seconds that took
    evals: list | None = None
    eval_seconds: float = 0.0


@dataclass(frozen=True)
class Encoding:
    """Fixed-point encoding of the SecAgg inputs (dpfl_ray.secagg.encoding)."""

    scale: float
    overflow: str  # 'error' | 'clip'
    n_summands: int


@dataclass(frozen=True)
class PhaseReply:
    """One worker's reply to a SecAgg phase: the protocol messages of its clients, and what else
    the phase produced. ``aborted``: a client of this worker cannot take part (e.g. its input
    overflows the ring) -- the round must abort."""

    messages: list = field(default_factory=list)
    clipped: int = 0  # coordinates clipped by overflow: clip
    calibration: dict = field(default_factory=dict)  # client id -> calibration term
    bytes_sent: dict = field(default_factory=dict)  # protocol index -> bytes
    aborted: str | None = None
    rejected: dict = field(default_factory=dict)  # client id -> why its update was refused
    reports: dict = field(default_factory=dict)  # client id -> ClientReport of its local procedure
