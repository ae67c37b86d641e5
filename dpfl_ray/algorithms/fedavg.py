"""Federated averaging (McMahan et al. 2017) with Baek et al.'s weights w_i = min(n_i/n_max, 1)."""
from __future__ import annotations

import numpy as np

from .base import Aggregate, Algorithm, RoundOutcome, weighted_sum


class FedAvg(Algorithm):
    """No privacy mechanism: nothing for the ledger."""

    private = False

    @classmethod
    def check_scenario(cls, sc) -> None:
        if sc.privacy != type(sc.privacy)():
            # A privacy section that nothing reads would look like protection that is not there.
            raise ValueError("privacy: these settings need a private algorithm; set training.algorithm: "
                             "dp_fedavg or baek")
        if any(d.phase == "calibration" and d.model != "none" for d in sc.faults.dropouts):
            raise ValueError("faults.dropout.phase: fedavg has no calibration phase")

    def __init__(self, scenario=None, weights=None, noise_multiplier: float | None = None, sizes=None):
        self.weights = weights

    def finish(self, outcome: RoundOutcome, dim: int) -> Aggregate:
        """Delta = sum_i w_i Delta_i / sum_i w_i over the survivors; no survivors, no step."""
        if outcome.updates is not None:
            total, weight_sum = weighted_sum(outcome.updates, self.weights) if outcome.updates else (None, 0.0)
        else:
            total, weight_sum = outcome.total, sum(float(self.weights[c]) for c in outcome.survivors)
        if total is None or weight_sum <= 0:
            return Aggregate(np.zeros(dim, dtype=np.float32), 0.0)
        return Aggregate((np.asarray(total, dtype=np.float64) / weight_sum).astype(np.float32), weight_sum)
