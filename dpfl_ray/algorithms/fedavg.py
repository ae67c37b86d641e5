"""Federated averaging (McMahan et al. 2017) with Baek et al.'s weights w_i = min(n_i/n_max, 1)."""
from __future__ import annotations

import numpy as np

from .base import Aggregate, weighted_sum


class FedAvg:
    name = "fedavg"

    multipliers = None  # no privacy mechanism: nothing for the ledger

    def client_spec(self) -> dict:
        return {}

    def aggregate(self, updates: dict[int, np.ndarray], weights: np.ndarray, dim: int, round_idx: int) -> Aggregate:
        """Delta = sum_i w_i Delta_i / sum_i w_i over the survivors; no survivors, no step."""
        if not updates:
            return self.from_sum(None, 0.0, dim, round_idx)
        return self.from_sum(*weighted_sum(updates, weights), dim, round_idx)

    def from_sum(self, total: np.ndarray | None, weight_sum: float, dim: int, round_idx: int) -> Aggregate:
        """The step from sum_i w_i Delta_i (computed in the clear or by secure aggregation)."""
        if total is None or weight_sum <= 0:
            return Aggregate(np.zeros(dim, dtype=np.float32), 0.0)
        return Aggregate((np.asarray(total, dtype=np.float64) / weight_sum).astype(np.float32), weight_sum)
