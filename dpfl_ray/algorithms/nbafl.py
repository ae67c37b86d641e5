"""NbAFL, noising before model aggregation FL (Wei et al. 2020, "Federated Learning With Differential
Privacy: Algorithms and Performance Analysis", Algorithm 1), with its claimed and accounted epsilon.

Each scheduled client i minimises F_i(w) + mu/2 ||w - w^(t-1)||^2 from the broadcast (line 6),
clips its *parameters* to C, w / max(1, ||w|| / C) (line 8), and uploads w + n_i with
n_i ~ N(0, sigma_U^2 I) (line 9). The server averages the uploads with p_i proportional to the
data size (line 12) and broadcasts the average plus n_D ~ N(0, sigma_D^2 I) (line 14).

Noise (the paper's calibration, classic Gaussian mechanism):
    c = sqrt(2 ln(1.25 / delta)),  Delta s_U = 2C / m  (m: the smallest local dataset),
    sigma_U = c L Delta s_U / epsilon                    (L: uploads per client),
    sigma_D = 2 c C sqrt(T^2 - L^2 N) / (m N epsilon)    when T > L sqrt(N), else 0,
with N the clients aggregated per round (all of them, or K with K-of-N scheduling, Fig. 10).

What the ledger books (docs/nbafl.md): record-level, replace-one adjacency, each round one Gaussian,
unsampled (:class:`~dpfl_ray.privacy.sampling.NoSampling`), composed by dp_accounting over the rounds.
Its sensitivity is the one the code enforces: the client runs E epochs of SGD, not an exact argmin,
so one record replaced can move its clipped parameters anywhere in the ball of radius C, 2C apart.
That gives the run's ``epsilon``. The paper's Delta s_U = 2C/m (the argmin is an average of
per-record argmins) is booked beside it as ``assumed_noise_multipliers``, the run's
``epsilon_assumed``: what the same noise would give if that assumption held. The noise depends on
``privacy.nbafl.threat_model``: ``server`` -- the server sees each upload (or, with SecAgg, only
their sum); ``broadcast`` -- an observer of the broadcast models, protected by the uploads' noise in
the average plus the downlink noise. The paper's own claim, epsilon after the L uploads by basic
composition of per-upload epsilon / L, is booked as ``paper_epsilon``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..privacy.randomness import DPRandomness
from ..privacy.sampling import NoSampling
from ..privacy.sensitivity import booked_noise_multiplier, l2_sensitivity
from .base import Aggregate, Algorithm, ClientNoise, ClientSpec, Mechanism, RoundOutcome, weighted_sum


def classic_c(delta: float) -> float:
    """c = sqrt(2 ln(1.25 / delta)) of the classic Gaussian mechanism (Dwork & Roth, Thm. A.1)."""
    return math.sqrt(2.0 * math.log(1.25 / delta))


def uplink_std(epsilon: float, delta: float, clip: float, min_size: int, exposures: int) -> float:
    """sigma_U = c L Delta s_U / epsilon with Delta s_U = 2C/m (Wei et al., Sec. III-B)."""
    return classic_c(delta) * exposures * (2.0 * clip / min_size) / epsilon


def downlink_std(epsilon: float, delta: float, clip: float, min_size: int, exposures: int, clients: int,
                 rounds: int) -> float:
    """sigma_D = 2cC sqrt(T^2 - L^2 N) / (m N epsilon) if T > L sqrt(N), else 0 (Wei et al., Thm. 2)."""
    if rounds <= exposures * math.sqrt(clients):
        return 0.0
    return 2.0 * classic_c(delta) * clip * math.sqrt(rounds ** 2 - exposures ** 2 * clients) \
        / (min_size * clients * epsilon)


#: Where the paper's sensitivity comes from, and why the code does not enforce it.
ASSUMPTION = ("Wei et al.'s Delta s_U = 2C/m: the local solution is an average of m per-record argmins, so "
              "one record replaced moves it by at most 2C/m; the code runs E epochs of SGD and clips the "
              "parameters to C, which enforces 2C, not 2C/m")


#: The project's pld accountant composes Poisson-sampled Gaussians only; NbAFL's rounds are unsampled.
PLD_REFUSAL = ("privacy.accountant: nbafl's rounds are unsampled Gaussians, which the pld accountant does not "
               "compose; use rdp or rdp-classic")


def enforced_bound(clip: float) -> float:
    """Half the replace-one sensitivity of a client's clipped parameters as the code computes them:
    any record set gives parameters in the ball of radius C, so two neighbours differ by at most 2C."""
    return clip


def assumed_bound(clip: float, min_size: int) -> float:
    """Half of the paper's Delta s_U = 2C/m (Wei et al., Sec. III-B), which needs the exact argmin."""
    return clip / min_size


def booked_multiplier(noise_std: float, bound: float, weight_share: float = 1.0) -> float:
    """A release carrying ``noise_std`` of noise, in which one client's parameters count with
    ``weight_share`` (p_i) and one record moves them by at most ``bound`` when added or removed:
    the replace-one sensitivity is 2 p_i ``bound`` (docs/sensitivity.md)."""
    from dp_accounting import NeighboringRelation

    return booked_noise_multiplier(noise_std, l2_sensitivity(weight_share * bound, NeighboringRelation.REPLACE_ONE))


def round_multipliers(sigma_u: float, sigma_d: float, bound: float, shares: np.ndarray, secure: bool,
                      threat_model: str) -> tuple[float, float]:
    """(booked for the threat model, booked against the server) for a round aggregating clients
    with weight shares p_i, one record moving its client's parameters by ``bound`` (add/remove).
    The server sees each upload, or with SecAgg only sum p_i w~_i; an observer of the broadcast
    sees that sum plus the downlink noise."""
    share_sq, p_max = float(np.sum(np.square(shares))), float(np.max(shares))
    uploads_in_sum = sigma_u * math.sqrt(share_sq)
    server = (booked_multiplier(uploads_in_sum, bound, p_max) if secure
              else booked_multiplier(sigma_u, bound))
    if threat_model == "broadcast":
        return booked_multiplier(math.sqrt(uploads_in_sum ** 2 + sigma_d ** 2), bound, p_max), server
    return server, server


def claim_note(epsilon: float, exposures: int) -> str:
    """Where the paper's claim stands outside the classic Gaussian mechanism's range (epsilon < 1)."""
    per_upload = epsilon / exposures
    if per_upload < 1:
        return ""
    return (f"the paper's classic Gaussian bound sigma = c Delta / epsilon holds for epsilon < 1 per release; "
            f"here epsilon / L = {per_upload:.4g}: the claim is outside its validity range")


@dataclass(frozen=True)
class UplinkNoise(ClientNoise):
    """n_i ~ N(0, sigma_U^2 I) on the client's own clipped parameters (Alg. 1 line 9)."""

    on_weighted_sum = False
    std: float
    randomness: DPRandomness
    round: int

    def sample(self, client_id: int, weight: float, dim: int) -> np.ndarray:
        return self.randomness.generator("uplink", self.round, client_id).standard_normal(dim) * self.std


class NbAFL(Algorithm):
    reports_claimed_epsilon = True

    @classmethod
    def adjacencies(cls, sc) -> dict[str, tuple[str, ...]]:
        """Wei et al. 2020 (Lemma 1) bound one record replaced in a client's data set of m records."""
        return {"replace_one": ("each client's data size m",)}

    @classmethod
    def check_scenario(cls, sc) -> None:
        p = sc.privacy
        cls.adjacency(sc)
        if p.nbafl is None:
            raise ValueError("privacy.nbafl: nbafl needs its parameters, e.g. {epsilon: 60} (Wei et al.'s epsilon)")
        if p.noise_multiplier is not None or p.target_epsilon is not None:
            raise ValueError("privacy.noise_multiplier: nbafl derives its noise from privacy.nbafl.epsilon; "
                             "remove noise_multiplier and target_epsilon")
        if p.accountant == "pld":
            raise ValueError(PLD_REFUSAL)
        if p.clipping.mode != "fixed":
            raise ValueError("privacy.clipping.mode: nbafl clips the parameters to a fixed norm C")
        if p.calibration != "none" or p.denominator is not None or p.geyer is not None:
            raise ValueError("privacy: calibration, denominator and geyer do not apply to nbafl")
        if any(d.phase == "calibration" and d.model != "none" for d in sc.faults.dropouts):
            raise ValueError("faults.dropout.phase: nbafl has no calibration phase")
        if sc.training.server_lr != 1.0:
            raise ValueError("training.server_lr: nbafl's server broadcasts the average of the uploads itself")
        if sc.training.clip_norm is not None:
            raise ValueError("training.clip_norm: nbafl clips the parameters (privacy.clipping.norm), not the update")

    def __init__(self, scenario, weights: np.ndarray, noise_multiplier: float | None = None, sizes=None,
                 randomness: DPRandomness | None = None):
        p, nb = scenario.privacy, scenario.privacy.nbafl
        self.randomness = DPRandomness.for_run(scenario, randomness)
        self.weights = np.asarray(weights, dtype=np.float64)
        self.num_clients = len(weights)
        sizes = np.asarray(sizes if sizes is not None else np.ones(len(weights)), dtype=np.int64)
        self.min_size = int(sizes.min())  # m: public in the paper's replace-one analysis
        self.epsilon, self.delta, self.clip = float(nb.epsilon), float(p.delta), float(p.clipping.norm)
        self.rounds = scenario.training.rounds
        s = scenario.sampling
        self.per_round = s.clients_per_round if s.mode == "fixed" else max(1, round(s.rate * self.num_clients))
        self.exposures = nb.exposures or math.ceil(self.rounds * self.per_round / self.num_clients)
        self.mu = scenario.training.prox_mu
        self.threat_model = nb.threat_model
        self.secure = scenario.secagg.enabled
        self.sigma_u = uplink_std(self.epsilon, self.delta, self.clip, self.min_size, self.exposures)
        self.sigma_d = downlink_std(self.epsilon, self.delta, self.clip, self.min_size, self.exposures,
                                    self.per_round, self.rounds)
        self._round = 0
        self._current: Mechanism | None = None

    def begin_round(self, round_idx: int, sampled):
        self._round = round_idx
        self._current = None
        return None

    def client_spec(self) -> ClientSpec:
        return ClientSpec(clip_norm=self.clip, send_parameters=True, prox_mu=self.mu,
                          noise=UplinkNoise(self.sigma_u, self.randomness, self._round))

    # -- what the ledger books -------------------------------------------------------------------
    def _mechanism(self, shares: np.ndarray) -> Mechanism:
        """The round's Gaussian for weight shares p_i of the aggregated clients: booked with the
        sensitivity the code enforces (2C), and beside it with the paper's 2C/m."""
        def booked(bound):
            return round_multipliers(self.sigma_u, self.sigma_d, bound, shares, self.secure, self.threat_model)

        z, server = booked(enforced_bound(self.clip))
        assumed, _ = booked(assumed_bound(self.clip, self.min_size))
        return Mechanism((z,), NoSampling(), f"nbafl, threat_model={self.threat_model}, sensitivity 2C",
                         server_noise_multipliers=(server,), paper_epsilon=self.epsilon / self.rounds,
                         claim_note=claim_note(self.epsilon, self.exposures),
                         assumed_noise_multipliers=(assumed,), assumption=ASSUMPTION)

    def planned_mechanism(self) -> Mechanism:
        return self._mechanism(np.full(self.per_round, 1.0 / self.per_round))

    def mechanism(self) -> Mechanism:
        return self._current or self.planned_mechanism()

    def canary_norm(self) -> float:
        """One record can move its client's clipped parameters anywhere in the C-ball (the bound
        the code enforces and the ledger books): a canary moves them by C. A canary of C/m would
        probe only the paper's assumption."""
        return enforced_bound(self.clip)

    def summary_fields(self) -> dict:
        return {"nbafl_sigma_uplink": self.sigma_u, "nbafl_sigma_downlink": self.sigma_d,
                "nbafl_exposures": self.exposures, "nbafl_min_size": self.min_size,
                "nbafl_sensitivity": 2 * enforced_bound(self.clip),
                "nbafl_sensitivity_assumed": 2 * assumed_bound(self.clip, self.min_size),
                "threat_model": self.threat_model}

    # -- the server ------------------------------------------------------------------------------
    def finish(self, outcome: RoundOutcome, dim: int) -> Aggregate:
        """w^(t) = sum p_i w~_i (line 12), then w~^(t) = w^(t) + n_D (line 14); the step is w~ - theta."""
        survivors = list(outcome.survivors)
        if outcome.updates is not None:
            total, weight_sum = weighted_sum(outcome.updates, self.weights) if outcome.updates else (None, 0.0)
        else:
            total, weight_sum = outcome.total, float(self.weights[survivors].sum())
        info = {"sigma_uplink": self.sigma_u, "sigma_downlink": self.sigma_d}
        if total is None or weight_sum <= 0:
            return Aggregate(np.zeros(dim, dtype=np.float32), 0.0, info)
        self._current = self._mechanism(self.weights[survivors] / weight_sum)
        average = np.asarray(total, dtype=np.float64) / weight_sum
        if self.sigma_d > 0:
            average += self.randomness.generator("downlink", outcome.round).standard_normal(dim) * self.sigma_d
        return Aggregate((average - outcome.theta).astype(np.float32), weight_sum, info)
