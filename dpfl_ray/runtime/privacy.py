"""The run's privacy bookkeeping: one PrivacyLedger fed by the algorithm's actual mechanism each
round, and the budget rules that stop a run *before* a round that would break them."""
from __future__ import annotations

import math

from ..privacy import FixedSizeSampling, PoissonSampling, PrivacyLedger, calibrate_noise_multiplier
from ..privacy.dropouts import planned_noise_multipliers


class RunPrivacy:
    def __init__(self, scenario, weights):
        self.sc = scenario
        p = scenario.privacy
        self.ledger = PrivacyLedger(accountant=p.accountant, delta=p.delta)
        # A shadow ledger runs one round ahead, so budgets are checked before a round runs. It books
        # every round as covered: budget rules (Geyer's too) apply to the nominal mechanism, while
        # the real ledger still says when a round is not covered by the DP guarantee.
        self.shadow = PrivacyLedger(accountant=p.accountant, delta=p.delta)
        self.noise_multiplier = p.noise_multiplier
        self.calibrated = False
        self.exhausted = False  # a release was refused: it would have passed the target
        self.algorithm = None
        if self.noise_multiplier is None:
            s = scenario.sampling
            sampling = (PoissonSampling(s.rate) if s.mode == "poisson"
                        else FixedSizeSampling(s.clients_per_round, len(weights)))
            self.noise_multiplier = calibrate_noise_multiplier(
                p.target_epsilon, p.delta, sampling, scenario.training.rounds, p.accountant)
            if scenario.training.algorithm == "baek":
                # the target holds for the planned round's effective multiplier, not for z itself
                self.noise_multiplier /= planned_noise_multipliers(
                    1.0, p.calibration, min_weight_fraction=p.min_weight_fraction)[1]
            self.calibrated = True

    def bind(self, algorithm) -> None:
        self.algorithm = algorithm

    def _reason(self) -> str:
        if self.algorithm.name == "baek":
            return f"baek, calibration={self.sc.privacy.calibration}"
        return f"{self.algorithm.name}, clipping={self.sc.privacy.clipping.mode}"

    def next_round_fits(self, t: int) -> bool:
        """Record round t's mechanism on the shadow ledger and check the budgets there."""
        a, p = self.algorithm, self.sc.privacy
        if self.exhausted:
            return False
        self.shadow.record_round(a.multipliers, a.sampling, reason=self._reason(), round=t + 1)
        if p.target_epsilon is not None and (self.shadow.epsilon() > p.target_epsilon
                                             or self.ledger.epsilon() > p.target_epsilon):
            # the shadow books the planned mechanism; the real ledger may already be past it
            return False
        return p.geyer is None or self.shadow.delta_for_epsilon(p.geyer.epsilon) <= p.geyer.delta_threshold

    def release_fits(self, multipliers: list[float]) -> bool:
        """Would releasing a round with these effective multipliers keep the real ledger within
        privacy.target_epsilon? Asked after the uploads, before anything is unmasked."""
        p = self.sc.privacy
        if p.target_epsilon is None:
            return True
        trial = PrivacyLedger.from_dict(self.ledger.to_dict(include_epsilon=False))
        trial.record_round(multipliers, self.algorithm.sampling, reason="trial")
        if trial.epsilon() <= p.target_epsilon:
            return True
        self.exhausted = True
        return False

    def account(self, t: int, released: bool, why: str = "secure aggregation aborted") -> dict:
        """Ledger event of round t; the figures that go into its rounds.jsonl row. The effective
        multipliers are what protects the release after this round's dropouts; the claimed ones
        what the mechanism's paper states."""
        a, p = self.algorithm, self.sc.privacy
        if released:
            effective, claimed = a.round_mechanism()
            self.ledger.record_round(effective, a.sampling, reason=self._reason(), covered=a.covered,
                                     claimed_noise_multiplier=claimed, round=t + 1)
        else:
            self.ledger.record_no_release(why, round=t + 1)
        eps = self.ledger.epsilon()
        row = {"epsilon": None if math.isinf(eps) else eps, "dp_covered": self.ledger.fully_covered}
        if a.name == "baek":
            claimed_eps = self.ledger.claimed_epsilon()
            row["epsilon_claimed"] = None if math.isinf(claimed_eps) else claimed_eps
        if not self.ledger.fully_covered:
            row["epsilon_nominal"] = self.ledger.claimed_epsilon()
        if p.geyer is not None:
            # the shadow ledger holds exactly rounds 1..t+1 now: the nominal delta at Geyer's epsilon
            row["delta_at_epsilon"] = self.shadow.delta_for_epsilon(p.geyer.epsilon)
        return row

    def to_dict(self) -> dict:
        out = self.ledger.to_dict()
        out["noise_multiplier"] = self.noise_multiplier
        out["noise_multiplier_calibrated"] = self.calibrated
        return out
