"""Federated averaging (McMahan et al. 2017) with Baek et al.'s weights w_i = min(n_i/n_max, 1)."""
from __future__ import annotations

import numpy as np

from .base import Aggregate, weighted_sum


class FedAvg:
    name = "fedavg"

    def aggregate(self, updates: dict[int, np.ndarray], weights: np.ndarray, dim: int) -> Aggregate:
        """Delta = sum_i w_i Delta_i / sum_i w_i over the survivors; no survivors, no step."""
        if not updates:
            return Aggregate(np.zeros(dim, dtype=np.float32), 0.0)
        total, wsum = weighted_sum(updates, weights)
        return Aggregate((total / wsum).astype(np.float32), wsum)
