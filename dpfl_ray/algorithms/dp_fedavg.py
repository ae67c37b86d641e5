"""Client-level DP federated averaging: McMahan et al. 2018 (DP-FedAvg), Geyer et al. 2017
(median-norm clipping, Alg. 1 line 13-14), Andrew et al. 2019 (adaptive quantile clipping).

Every client update is clipped to S and weighted by w_i <= 1, so adding or removing one client
moves the weighted sum by at most S. The server adds N(0, (z S)^2 I) once, centrally, and divides
by a denominator (``privacy.denominator``):

* ``expected`` (default): the expected cohort weight qW, public -- McMahan et al.'s f_f, whose
  add/remove sensitivity is S / (qW);
* ``bounded``: max(F qW, sum of the survivors' weights), F = ``privacy.min_weight_fraction`` --
  McMahan et al.'s f_c with W_min = F W, add/remove sensitivity 2S / (F qW) (their Lemma 1); the
  noise on the released average is z times that;
* ``actual``: the survivors' weight W'.

Every denominator must be unchanged between neighbours or public (docs/sensitivity.md). Under
add/remove (Poisson sampling) or replace-one (fixed-size cohorts) the population itself differs
between neighbours, so W is the declared constant ``privacy.population_weight`` (default
``data.num_clients`` plus an audit's canaries, every weight being <= 1), never the data's sum: with the data's W every
round's scale would reveal the population (K = 1000 vs 1001 separates at mu ~ 1.5 over 40 rounds of
the quickstart). W' depends on who took part, so ``actual`` is covered only under zero-out
adjacency (a client replaced by one that sends nothing): the population, its weights and who
survives then stay as they are, and W' is public. ``actual`` defaults to zero-out; the others to
the sampling's own relation. Zero-out is booked with the sampling's relation: for Poisson
sampling its subsampled-Gaussian bound is the add/remove one, and replace-one bounds it for
fixed-size cohorts.

The ledger books each Gaussian with :mod:`dpfl_ray.privacy.sensitivity`'s rule: z under Poisson
sampling (add/remove), z/2 under fixed-size cohorts (replace one: 2x the add/remove sensitivity).
"""
from __future__ import annotations

import math

import numpy as np

from ..errors import DPFLError
from ..privacy.mechanisms import gaussian_noise
from ..privacy.randomness import DPRandomness
from ..privacy.sampling import sampling_of
from ..privacy.sensitivity import booked_noise_multiplier, l2_sensitivity
from .base import Aggregate, Algorithm, ClientSpec, Mechanism, RoundOutcome, require_public_weight_cap, weighted_sum

# The clipped-count indicator b_i - 1/2 of Andrew et al. 2019 moves the count by 1/2.
COUNT_CONTRIBUTION = 0.5


def split_noise_multiplier(z: float, count_noise_multiplier: float) -> float:
    """Andrew et al. 2019, Thm. 1: the update's multiplier z_D such that the update (z_D) and the
    clipped-count query (multiplier 2*sigma_b, sensitivity 1/2) compose to one Gaussian of z:
    z_D = (z^-2 - (2 sigma_b)^-2)^(-1/2)."""
    count_z = 2.0 * count_noise_multiplier
    if count_z <= z:
        raise DPFLError(f"count noise multiplier 2*sigma_b={count_z:g} must exceed z={z:g} so the update keeps "
                        "some of the budget", field="privacy.clipping.count_noise_multiplier")
    return (z ** -2 - count_z ** -2) ** -0.5


def booked_multipliers(update_z: float, count_sigma: float | None, relation, units: float = 1.0,
                       displacement: float = 1.0) -> tuple[float, ...]:
    """What the ledger books for one round: the update's Gaussian -- noise std update_z * units
    against the add/remove sensitivity units (units of S; 1 for the expected denominator,
    2 / F for the bounded one) -- and, with adaptive clipping, the clipped count's (std sigma_b,
    contribution 1/2), both through the sensitivity rule of the sampling's relation, times the
    displacement factor of an overcommitted cohort (privacy.sampling.sampling_of)."""
    zs = [booked_noise_multiplier(update_z * units, l2_sensitivity(units, relation) * displacement)]
    if count_sigma is not None:
        zs.append(booked_noise_multiplier(count_sigma, l2_sensitivity(COUNT_CONTRIBUTION, relation) * displacement))
    return tuple(zs)


ZERO_OUT_PUBLIC = ("the population, its weights and who survives (the actual denominators)",)


class DPFedAvg(Algorithm):
    @classmethod
    def adjacencies(cls, sc) -> dict[str, tuple[str, ...]]:
        zero_out = {"zero_out": ZERO_OUT_PUBLIC}
        if (sc.privacy.denominator or "expected") == "actual":
            return zero_out
        declared = ("W = privacy.population_weight" if sc.privacy.population_weight is not None
                    else "W = data.num_clients (declared population)",)
        if sc.sampling.mode == "fixed":
            return {"replace_one": declared + ("the population size K (cohort m of K)",), **zero_out}
        return {"add_remove": declared, **zero_out}

    @classmethod
    def check_scenario(cls, sc) -> None:
        super().check_scenario(sc)
        p = sc.privacy
        if p.population_weight is not None and cls.adjacency(sc)[0] == "zero_out":
            raise ValueError("privacy.population_weight: under zero_out adjacency the denominators use the "
                             "actual population's weight; remove population_weight or choose another adjacency")
        if sc.secagg.enabled and p.clipping.mode == "median":
            raise ValueError("privacy.clipping.mode: median needs every client's update norm, which "
                             "secure aggregation hides")
        if p.calibration != "none":
            raise ValueError("privacy.calibration: dp_fedavg adds its noise centrally, after the dropouts; "
                             "calibration modes belong to training.algorithm: baek")

    def __init__(self, scenario, weights: np.ndarray, noise_multiplier: float, sizes=None,
                 randomness: DPRandomness | None = None):
        require_public_weight_cap(scenario, weights)
        p = scenario.privacy
        self.randomness = DPRandomness.for_run(scenario, randomness)
        self.clipping = p.clipping
        self.denominator = p.denominator or "expected"
        self.z = float(noise_multiplier)
        k = len(weights)
        self.sampling, frac, self.displacement = sampling_of(scenario.sampling, k)
        self.relation, self.public = self.adjacency(scenario)
        if self.relation == "zero_out":
            population_weight = float(np.sum(weights))
        else:  # declared: the scenario's clients, and an audit's canaries (weight 1 each), which join them
            canaries = p.audit.canaries if p.audit is not None else 0
            population_weight = float(p.population_weight or scenario.data.num_clients + canaries)
        self.expected_weight = frac * population_weight
        self.floor = p.min_weight_fraction * self.expected_weight
        self.expected_count = frac * k
        self.clip_norm = float(p.clipping.norm)
        self.count_sigma = None
        self.update_z = self.z
        if p.clipping.mode == "adaptive":
            # Andrew et al. suggest sigma_b = m/20; small cohorts need sigma_b >= z so that 2*sigma_b > z.
            self.count_sigma = p.clipping.count_noise_multiplier or max(self.expected_count / 20.0, self.z)
            self.update_z = split_noise_multiplier(self.z, self.count_sigma)
        self.weights = weights

    # -- what each client does to its update before it leaves (also used for SecAgg on workers) --
    def client_spec(self) -> ClientSpec:
        """Clip to this round's S; adaptive clipping appends the indicator b_i - 1/2 as one more
        coordinate so the clipped count can be summed securely too. Median clipping needs the
        raw updates."""
        return ClientSpec(per_client=True) if self.clipping.mode == "median" else self._spec()

    def _spec(self) -> ClientSpec:
        return ClientSpec(clip_norm=self.clip_norm, indicator=self.clipping.mode == "adaptive")

    # -- what the ledger books -------------------------------------------------------------------
    def _update_sensitivity_units(self) -> float:
        """The released average's add/remove sensitivity, in units of S / (expected weight)."""
        return 2.0 * self.expected_weight / self.floor if self.denominator == "bounded" else 1.0

    def planned_mechanism(self) -> Mechanism:
        """The update's Gaussian (and the clipped count's, with adaptive clipping), booked with the
        sensitivity under the sampling's relation. Noise is central and added after the dropouts,
        so the planned round is the round."""
        zs = booked_multipliers(self.update_z, self.count_sigma, self.sampling.neighboring_relation,
                                self._update_sensitivity_units(), self.displacement)
        covered = self.clipping.mode != "median"  # a denominator its relation does not cover cannot be chosen
        return Mechanism(zs, self.sampling, f"dp_fedavg, clipping={self.clipping.mode}, "
                         f"denominator={self.denominator}, adjacency={self.relation}", covered=covered,
                         public=self.public)

    def summary_fields(self) -> dict:
        return {"denominator": self.denominator}

    def canary_norm(self) -> float:
        return self.clip_norm

    def state_dict(self) -> dict:
        """The clipping bound S moves with adaptive (and median) clipping."""
        return {"clip_norm": self.clip_norm}

    def load_state_dict(self, state: dict) -> None:
        self.clip_norm = float(state["clip_norm"])

    # -- the server ------------------------------------------------------------------------------
    def finish(self, outcome: RoundOutcome, dim: int) -> Aggregate:
        if outcome.updates is not None:
            # The clients clipped as client_spec said; median clipping needs their raw norms,
            # which the server sees (central DP), so it clips here.
            updates = outcome.updates
            if self.clipping.mode == "median" and updates:
                self.clip_norm = float(np.median([np.linalg.norm(u.astype(np.float64)) for u in updates.values()]))
                updates = {c: self._spec().vector(u) for c, u in updates.items()}
            total, weight_sum = weighted_sum(updates, self.weights) if updates else (None, 0.0)
        else:
            total, weight_sum = outcome.total, sum(float(self.weights[c]) for c in outcome.survivors)
        return self._noised_step(total, weight_sum, dim, outcome.round)

    def _noised_step(self, total: np.ndarray | None, weight_sum: float, dim: int, round_idx: int) -> Aggregate:
        """Noise the sum of client vectors (McMahan et al. 2018, Alg. 1 'server') and take a step."""
        indicator = self.clipping.mode == "adaptive"
        if total is None:
            total = np.zeros(dim + (1 if indicator else 0))
        total = np.asarray(total, dtype=np.float64)
        count = None
        if indicator:
            total, count = total[:-1], float(total[-1])
        s = self.clip_norm
        noise_std = self.update_z * s * self._update_sensitivity_units()
        noise = gaussian_noise(dim, noise_std, self.randomness.generator("noise", round_idx), np.float64)
        if self.denominator == "bounded":
            # f_c: the noise is calibrated to the released average, whose sensitivity 2S / (F qW)
            # holds whatever the denominator turns out to be
            denom = max(self.floor, weight_sum)
            delta = total / denom + noise / self.expected_weight
        else:
            denom = self.expected_weight if self.denominator == "expected" else weight_sum
            delta = (total + noise) / denom if denom > 0 else np.zeros(dim)
        info = {"clip_norm": s, "noise_std": noise_std, "noise_multiplier": self.z}
        if indicator:
            # Andrew et al. 2019, Alg. 1: noised fraction of unclipped updates, geometric step towards gamma.
            noisy = count + self.count_sigma * self.randomness.generator("clip", round_idx).standard_normal()
            unclipped = noisy / self.expected_weight + 0.5  # weighted like the update sum
            self.clip_norm = s * math.exp(-self.clipping.learning_rate * (unclipped - self.clipping.target_quantile))
            info["unclipped_fraction"] = unclipped
        return Aggregate(delta.astype(np.float32), weight_sum, info)
