"""What crosses the Ray boundary between the coordinator and its ClientWorkers (besides the
algorithm's ClientSpec and the secure-aggregation protocol's own message dicts)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class LocalReply:
    """Updates of the clients whose upload arrived, stacked in ``client_ids`` order."""

    client_ids: list[int]
    updates: np.ndarray
    seconds: float


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
