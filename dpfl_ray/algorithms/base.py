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
