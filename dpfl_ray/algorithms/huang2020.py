"""Huang et al. 2020, DP-FL for unbalanced data (Algorithms 1-3) on the Algorithm interface.

The server sets each client's budget eps_k from its data amount (Sec. 4.2, Fig. 7); every round
each sampled client runs DPAGD (Alg. 1) with eps_k / T from theta (eq. 11, Alg. 3 line 6) and the
server averages what it receives (Alg. 3). A client that can no longer afford one gradient and one
selection quits: it is recorded as an ``exhausted@training`` dropout and the round goes on.

Privacy is per record of each client: the client's own ledger books, for every round it trained
in, the bound on any path of Gaussian gradients and arg-max selections the round could have taken
(dp_accounting; the path depends on the noisy picks); the paper's claim, the budget spent in its
linear units, stands beside it. The building blocks and the reading of the paper are in
:mod:`.huang2020_core` and docs/record_level_dp.md.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..privacy.randomness import DPRandomness
from .base import Aggregate, Algorithm, ClientReport, ClientSpec, LocalProcedure, RoundOutcome
from .fedavg import FedAvg
from .huang2020_core import DPAGDConfig, HuangClientBudget, budgets_by_size, dpagd_update, round_dp_events


@dataclass(frozen=True)
class DPAGDProcedure(LocalProcedure):
    """One round of DPAGD on each sampled client, with its round budget (client id -> eps_k / T).
    ``randomness`` travels to the workers: it draws every client's gradient and arg-max noise."""

    config: DPAGDConfig
    round_budgets: tuple[tuple[int, float], ...]
    randomness: DPRandomness

    def run(self, model, theta, x, y, *, seed, round_idx, client_id):
        budget = dict(self.round_budgets)[client_id]
        res = dpagd_update(model, theta, x, y, self.config, budget, seed=seed, round_idx=round_idx,
                           client_id=client_id, randomness=self.randomness)
        # the bound on every path the round could take, not the path the picks took (round_dp_events)
        booked = round_dp_events(self.config, budget) if res.gradient_noise_multipliers else []
        return res.update, ClientReport(events=tuple(booked), spent=res.spent,
                                        values={"steps": float(res.steps_taken),
                                                "split_updates": float(res.split_updates)})


class Huang2020(Algorithm):
    record_level = True

    @classmethod
    def adjacencies(cls, sc) -> dict[str, tuple[str, ...]]:
        """The gradient is divided by the client's record count n, and n sets its budget category:
        n is released, so only neighbours of equal size are covered (huang2020_core's booking)."""
        return {"replace_one": ("each client's record count n (its budget category, the gradient's divisor)",)}

    @classmethod
    def check_scenario(cls, sc) -> None:
        h = sc.privacy.huang2020
        cls.adjacency(sc)
        if h is None:
            raise ValueError("privacy.huang2020: huang2020 needs its section (category_budgets, step_sizes, ...)")
        if sc.data.num_clients < len(h.category_budgets):
            raise ValueError(f"privacy.huang2020.category_budgets: {len(h.category_budgets)} categories need at "
                             f"least as many clients, got {sc.data.num_clients}")
        if sc.privacy.audit is not None:
            raise ValueError("privacy.audit: canary clients audit client-level DP; huang2020 is record-level")
        if any(d.phase == "calibration" and d.model != "none" for d in sc.faults.dropouts):
            raise ValueError("faults.dropout.phase: huang2020 has no calibration phase")

    def __init__(self, scenario, weights, noise_multiplier=None, sizes=None,
                 randomness: DPRandomness | None = None):
        h, p = scenario.privacy.huang2020, scenario.privacy
        self.weights = np.asarray(weights, dtype=np.float64)
        sizes = np.asarray(sizes if sizes is not None else np.ones(len(weights)), dtype=np.int64)
        self.rounds = scenario.training.rounds
        self.config = DPAGDConfig(
            clip_norm=p.clipping.norm, step_sizes=tuple(h.step_sizes), loss_clip=h.loss_clip,
            epsilon_gradient=h.epsilon_gradient, epsilon_selection=h.epsilon_selection, gamma=h.gamma,
            calibration=h.calibration, delta=p.delta if h.calibration == "eq3" else None)
        self.budget_of = budgets_by_size(sizes, h.category_budgets)  # eps_k (Fig. 7)
        self.randomness = DPRandomness.for_run(scenario, randomness)
        self.spent = np.zeros(len(sizes))
        self._sampled: list[int] = []

    def _budget(self, c: int) -> HuangClientBudget:
        return HuangClientBudget(float(self.budget_of[c]), float(self.spent[c]))

    def withdrawals(self, round_idx, sampled) -> dict[int, str]:
        """Clients that cannot afford one gradient and one selection this round quit (Sec. 4.2)."""
        return {int(c): "exhausted" for c in sampled if self._budget(int(c)).exhausted(self.config, self.rounds)}

    def begin_round(self, round_idx, sampled):
        self._sampled = [int(c) for c in sampled]
        return None

    def client_spec(self) -> ClientSpec:
        budgets = tuple((c, self._budget(c).round_budget(self.rounds)) for c in self._sampled)
        return ClientSpec(local=DPAGDProcedure(self.config, budgets, self.randomness))

    def finish(self, outcome: RoundOutcome, dim: int) -> Aggregate:
        for c, report in outcome.reports.items():
            if report.spent is not None:
                self.spent[c] += report.spent
        agg = FedAvg(weights=self.weights).finish(outcome, dim)
        steps = [r.values.get("steps", 0.0) for r in outcome.reports.values()]
        agg.info.update(dpagd_steps_mean=float(np.mean(steps)) if steps else None)
        return agg

    def summary_fields(self) -> dict:
        return {"category_budgets": sorted(set(float(b) for b in self.budget_of)),
                "budget_calibration": self.config.calibration}

    def client_groups(self) -> dict[int, str]:
        """Fig. 7's categories: a client's budget eps_k."""
        return {c: f"eps_k={b:g}" for c, b in enumerate(self.budget_of)}

    def state_dict(self) -> dict:
        return {"spent": [float(v) for v in self.spent]}

    def load_state_dict(self, state: dict) -> None:
        self.spent = np.asarray(state["spent"], dtype=np.float64)
