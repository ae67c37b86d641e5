"""What an algorithm plugs into the round (ARCHITECTURE.md, principle 2).

The coordinator owns the loop; an algorithm only says how the survivors' updates become the
server's step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Aggregate:
    delta: np.ndarray  # the server's step, added to the model (after server_lr)
    weight_sum: float  # sum of the survivors' weights
    info: dict = field(default_factory=dict)  # extra per-round figures for rounds.jsonl


def weighted_sum(updates: dict[int, np.ndarray], weights) -> tuple[np.ndarray, float]:
    """sum_i w_i Delta_i over clients in id order, accumulated in float64.

    A fixed order makes the sum independent of which worker computed which client and of the
    order replies arrived (ARCHITECTURE.md, principle 5).
    """
    total, wsum = None, 0.0
    for cid in sorted(updates):
        w = float(weights[cid])
        term = updates[cid].astype(np.float64) * w
        total = term if total is None else total + term
        wsum += w
    return total, wsum


def client_vector(update: np.ndarray, spec: dict) -> np.ndarray:
    """What a client sends for an algorithm's ``client_spec``: its update clipped to
    ``clip_norm``, with the clipped-count indicator b_i - 1/2 appended when ``indicator`` is set
    (Andrew et al. 2019). An empty spec sends the update as it is."""
    if not spec.get("clip_norm"):
        return update
    from ..privacy import clip_by_l2

    clipped, norm = clip_by_l2(update, spec["clip_norm"])
    if spec.get("indicator"):
        return np.append(clipped, np.float32(0.5 if norm <= spec["clip_norm"] else -0.5))
    return clipped
