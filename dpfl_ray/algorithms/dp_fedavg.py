"""Client-level DP federated averaging: McMahan et al. 2018 (DP-FedAvg), Geyer et al. 2017
(median-norm clipping, Alg. 1 line 13-14), Andrew et al. 2019 (adaptive quantile clipping).

Every client update is clipped to S, the weighted sum gets N(0, (z S)^2 I) once, centrally, and
is divided by the expected cohort weight (McMahan et al.) or the actual one. With weights
w_i <= 1 one client moves the sum by at most S, so each round is a sampled Gaussian mechanism
with noise multiplier z on the sum (neighbouring relation: add/remove one client under Poisson
sampling, replace one under fixed-size cohorts). The ledger is told which rounds that holds for.
"""
from __future__ import annotations

import math

import numpy as np

from .. import rng as rngmod
from ..errors import DPFLError
from ..privacy import FixedSizeSampling, PoissonSampling, gaussian_noise
from .base import Aggregate, client_vector, weighted_sum


def split_noise_multiplier(z: float, count_noise_multiplier: float) -> float:
    """Andrew et al. 2019, Thm. 1: the update's multiplier z_D such that the update (z_D) and the
    clipped-count query (multiplier 2*sigma_b, sensitivity 1/2) compose to one Gaussian of z:
    z_D = (z^-2 - (2 sigma_b)^-2)^(-1/2)."""
    count_z = 2.0 * count_noise_multiplier
    if count_z <= z:
        raise DPFLError(f"count noise multiplier 2*sigma_b={count_z:g} must exceed z={z:g} so the update keeps "
                        "some of the budget", field="privacy.clipping.count_noise_multiplier")
    return (z ** -2 - count_z ** -2) ** -0.5


def make_sampling(s, num_clients: int):
    """The ledger's sampling of ``sampling`` (a SamplingConfig) and the expected sampled fraction."""
    if s.mode == "poisson":
        return PoissonSampling(s.rate), s.rate
    return FixedSizeSampling(s.clients_per_round, num_clients), s.clients_per_round / num_clients


class DPFedAvg:
    name = "dp_fedavg"

    def __init__(self, scenario, weights: np.ndarray, noise_multiplier: float):
        p, s = scenario.privacy, scenario.sampling
        self.seed = scenario.seed
        self.clipping = p.clipping
        self.denominator = p.denominator or "expected"
        self.z = float(noise_multiplier)
        k = len(weights)
        self.sampling, frac = make_sampling(s, k)
        self.expected_weight = frac * float(np.sum(weights))
        self.expected_count = frac * k
        self.clip_norm = float(p.clipping.norm)
        self.count_sigma = None
        self.update_z = self.z
        if p.clipping.mode == "adaptive":
            # Andrew et al. suggest sigma_b = m/20; small cohorts need sigma_b >= z so that 2*sigma_b > z.
            self.count_sigma = p.clipping.count_noise_multiplier or max(self.expected_count / 20.0, self.z)
            self.update_z = split_noise_multiplier(self.z, self.count_sigma)

    # -- what each client does to its update before it leaves (also used for SecAgg on workers) --
    def client_spec(self) -> dict:
        """Clip to this round's S; adaptive clipping appends the indicator b_i - 1/2 as one more
        coordinate so the clipped count can be summed securely too."""
        return {} if self.clipping.mode == "median" else self._spec()

    def _spec(self) -> dict:
        return {"clip_norm": self.clip_norm, "indicator": self.clipping.mode == "adaptive"}

    @property
    def multipliers(self) -> list[float]:
        """The Gaussian mechanisms of one round, for the ledger."""
        return [self.update_z] if self.count_sigma is None else [self.update_z, 2.0 * self.count_sigma]

    def round_mechanism(self) -> tuple[list[float], list[float] | None]:
        """(effective, claimed) multipliers of the round just released: central noise after the
        dropouts, so both are the planned ones."""
        return self.multipliers, None

    @property
    def covered(self) -> bool:
        # Geyer et al. use the median of the unclipped norms, "strictly speaking, a violation of privacy".
        return self.clipping.mode != "median"

    def aggregate(self, updates: dict[int, np.ndarray], weights: np.ndarray, dim: int, round_idx: int) -> Aggregate:
        """Clip in the clear (the server sees each update, as in central DP), then add noise."""
        if self.clipping.mode == "median" and updates:
            self.clip_norm = float(np.median([np.linalg.norm(u.astype(np.float64)) for u in updates.values()]))
        prepared = {c: client_vector(u, self._spec()) for c, u in updates.items()}
        total, wsum = weighted_sum(prepared, weights) if prepared else (None, 0.0)
        return self.from_sum(total, wsum, dim, round_idx)

    def from_sum(self, total: np.ndarray | None, weight_sum: float, dim: int, round_idx: int) -> Aggregate:
        """Noise the sum of client vectors (McMahan et al. 2018, Alg. 1 'server') and take a step."""
        indicator = self.clipping.mode == "adaptive"
        if total is None:
            total = np.zeros(dim + (1 if indicator else 0))
        total = np.asarray(total, dtype=np.float64)
        count = None
        if indicator:
            total, count = total[:-1], float(total[-1])
        s = self.clip_norm
        noise = gaussian_noise(dim, self.update_z * s, rngmod.generator(self.seed, "noise", round_idx), np.float64)
        denom = self.expected_weight if self.denominator == "expected" else weight_sum
        delta = (total + noise) / denom if denom > 0 else np.zeros(dim)
        info = {"clip_norm": s, "noise_std": self.update_z * s, "noise_multiplier": self.z}
        if indicator:
            # Andrew et al. 2019, Alg. 1: noised fraction of unclipped updates, geometric step towards gamma.
            noisy = count + self.count_sigma * rngmod.generator(self.seed, "clip", round_idx).standard_normal()
            unclipped = noisy / self.expected_weight + 0.5  # weighted like the update sum
            self.clip_norm = s * math.exp(-self.clipping.learning_rate * (unclipped - self.clipping.target_quantile))
            info["unclipped_fraction"] = unclipped
        return Aggregate(delta.astype(np.float32), weight_sum, info)
