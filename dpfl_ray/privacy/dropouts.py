"""What noise really protects a round of Baek et al. 2021 after dropouts: per calibration mode,
from everything the server observes (derivation: docs/baek2021.md).

Units. T = 2 C z is the noise standard deviation the mechanism targets on the weighted *sum*
sum_i w_i Delta_i, whose replace-one sensitivity is 2C (w_i <= 1, ||Delta_i|| <= C). Variances
below are in units of T^2, so a view whose noise has variance v protects the sum with noise
multiplier z * sqrt(v). Weight sums: n (sampled), n' (whose masked input reached the server),
w_d (of those, the ones that never sent their calibration term), n_0 (baek-extended's floor).

The server's views of one round are y_j = S + noise_j with jointly Gaussian noise of covariance
Sigma. Their likelihood in S depends on the data only through the generalised-least-squares
estimate, whose error variance is 1 / (1' Sigma^-1 1); the round is exactly a Gaussian mechanism
of that variance (:func:`best_estimate_variance`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dpfl_ray.errors import DPFLError

CALIBRATIONS = ("none", "baek", "baek-extended", "layered")
_REL = 1e-12


def best_estimate_variance(cov) -> float:
    """Error variance of the best linear unbiased estimate of S from views S + N(0, cov)."""
    cov = np.atleast_2d(np.asarray(cov, dtype=np.float64))
    ones = np.ones(cov.shape[0])
    return float(1.0 / (ones @ np.linalg.solve(cov, ones)))


def calibrates(mode: str, n: float, n_prime: float) -> bool:
    """Is there a calibration phase? 'baek' skips it when nobody dropped (n' = n): re-drawing the
    noise then would hand the server a second, independent view for nothing."""
    if mode == "baek-extended":
        return True
    return mode == "baek" and n_prime < n * (1 - _REL)


@dataclass(frozen=True)
class ServerView:
    """The views the server holds of one round: ``cov`` (units of T^2) of [first aggregate,
    released sum] -- or of the released sum alone -- and the released sum's noise variance."""

    cov: np.ndarray
    released_variance: float

    @property
    def effective_variance(self) -> float:
        return best_estimate_variance(self.cov)


def server_view(mode: str, n: float, n_prime: float, w_cal_dropped: float = 0.0,
                n0: float | None = None) -> ServerView:
    """The covariance of what the server sees, per mode.

    * none: A = S + sum e_i, e_i ~ N(0, w_i T^2 / n): one view, variance n'/n.
    * baek / baek-extended: A as above (per-client variance w_i T^2 / n, or / n_0), then the
      calibration terms -e_i + f_i, f_i ~ N(0, w_i T^2 / n'), of the clients that send one. The
      released sum R = A + sum of those terms. A and R share the noise e_i of the calibration
      dropouts (variance v_d) and differ in the rest: v_e (old noise of the senders) in A,
      v_f (their new noise) in R. Cov = [[v_d + v_e, v_d], [v_d, v_d + v_f]]; the best estimate
      has variance v_d + v_e v_f / (v_e + v_f). The individual terms add nothing to their sum:
      both noises of a client scale with w_i, so E[sum e_i | each term] is a multiple of the sum.
    * layered: the released sum carries exactly the target, T^2, and the removed layers are
      known exactly -- they are no view at all.
    """
    if mode not in CALIBRATIONS:
        raise DPFLError(f"unknown calibration {mode!r}; choose one of {', '.join(CALIBRATIONS)}",
                        field="calibration")
    if not n > 0 or not 0 < n_prime <= n * (1 + _REL):
        raise DPFLError(f"needs 0 < n' <= n, got n={n:g}, n'={n_prime:g}", field="weight_sum")
    if not 0 <= w_cal_dropped <= n_prime * (1 + _REL):
        raise DPFLError(f"calibration dropouts weigh {w_cal_dropped:g}, more than the n'={n_prime:g} that uploaded",
                        field="weight_sum")
    if mode == "layered":
        return ServerView(np.array([[1.0]]), 1.0)
    first = n
    if mode == "baek-extended":
        if n0 is None or not n0 > 0:
            raise DPFLError("baek-extended needs n_0 > 0", field="min_weight_fraction")
        first = n0
    if not calibrates(mode, n, n_prime):
        v = n_prime / first
        return ServerView(np.array([[v]]), v)
    senders = max(n_prime - w_cal_dropped, 0.0)
    v_d, v_e, v_f = w_cal_dropped / first, senders / first, senders / n_prime
    if senders == 0.0:  # nobody calibrated: the release is the first aggregate
        return ServerView(np.array([[v_d]]), v_d)
    cov = np.array([[v_d + v_e, v_d], [v_d, v_d + v_f]])
    return ServerView(cov, v_d + v_f)


def effective_noise_multipliers(z: float, mode: str, n: float, n_prime: float, w_cal_dropped: float = 0.0,
                                n0: float | None = None) -> tuple[float, float]:
    """``(claimed, effective)`` noise multipliers of one round. Claimed is z for every mode: it is
    what the mechanism promises (Baek et al. claim it for their calibration); effective is what
    the server's view guarantees."""
    view = server_view(mode, n, n_prime, w_cal_dropped, n0)
    return float(z), float(z) * math.sqrt(view.effective_variance)


def planned_noise_multipliers(z: float, mode: str, dropout_rate: float = 0.0, calibration_dropout_rate: float = 0.0,
                              min_weight_fraction: float = 0.5) -> tuple[float, float]:
    """The same for a planned round in which a fraction ``dropout_rate`` of the sampled weight
    drops before its masked input arrives and a fraction ``calibration_dropout_rate`` of the rest
    before its calibration term; n is the expected sampled weight, so n_0 = F n."""
    if not 0 <= dropout_rate < 1:
        raise DPFLError(f"must be in [0, 1), got {dropout_rate!r}", field="dropout_rate")
    if not 0 <= calibration_dropout_rate <= 1:
        raise DPFLError(f"must be in [0, 1], got {calibration_dropout_rate!r}", field="calibration_dropout_rate")
    if not 0 < min_weight_fraction <= 1:
        raise DPFLError(f"must be in (0, 1], got {min_weight_fraction!r}", field="min_weight_fraction")
    if mode == "layered" and dropout_rate > 1 - min_weight_fraction + _REL:
        raise DPFLError(f"layered tolerates dropout up to 1 - F = {1 - min_weight_fraction:g}; a round losing "
                        f"{dropout_rate:g} is aborted, nothing is released", field="dropout_rate")
    n_prime = 1.0 - dropout_rate
    return effective_noise_multipliers(z, mode, 1.0, n_prime, calibration_dropout_rate * n_prime,
                                       min_weight_fraction if mode == "baek-extended" else None)


def layer_variances(n_sampled: int, tolerated: int) -> np.ndarray:
    """Variances (units of T^2) of layers 0..L, L = ``tolerated``, of each of the N sampled clients.

    Layer 0 has 1/N and layer k 1/(N-k) - 1/(N-k+1), so layers 0..d add up to 1/(N-d): after d
    dropouts the N-d clients left keep layers 0..d and carry T^2 together, exactly.
    """
    if not 0 <= tolerated < n_sampled:
        raise DPFLError(f"tolerated dropouts must be in 0..{n_sampled - 1}, got {tolerated}", field="layers")
    k = np.arange(1, tolerated + 1, dtype=np.float64)
    return np.concatenate([[1.0 / n_sampled], 1.0 / (n_sampled - k) - 1.0 / (n_sampled - k + 1)])


# Draws of N_Z(0, u) a client's layers 0..d hold when nobody dropped (:func:`layer_quanta`): the
# survivors' sum then carries at most 1/8 more than the cohort's total, and a client draws about
# 8 N / (N - L) values a coordinate (16 at F = 0.5).
LAYER_QUANTA = 8


def layer_quanta(total: float, n_sampled: int, tolerated: int, quanta: int = LAYER_QUANTA) -> tuple[int, tuple[int, ...]]:
    """Discrete Gaussian layers for ``layered``: ``(u, counts)``, layer k being the sum of counts[k]
    independent draws of N_Z(0, u) (``total``: the cohort's noise variance in integer units).

    Discrete Gaussians of unequal variances, such as :func:`layer_variances` would give, do not add
    up to one, and the bound this project books for a sum of them (Kairouz et al. 2021, Thm. 1)
    holds for equal variances. So every layer is made of draws of one variance u = ceil(total /
    (N Q)), Q = ``quanta``: after d dropouts each of the N - d survivors keeps layers 0..d, holding
    c_d = ceil(total / ((N - d) u)) draws, and the release sums (N - d) c_d draws of N_Z(0, u): at
    least ``total`` and less than total + (N - d) u <= (1 + 1/Q) total + N. Layer 0 holds c_0 draws
    and layer k c_k - c_(k-1) (possibly none)."""
    if not 0 <= tolerated < n_sampled:
        raise DPFLError(f"tolerated dropouts must be in 0..{n_sampled - 1}, got {tolerated}", field="layers")
    if not total > 0 or quanta < 1:
        raise DPFLError(f"needs a positive total variance and at least one quantum, got {total!r}, {quanta!r}",
                        field="layers")
    u = max(1, math.ceil(total / (n_sampled * quanta)))
    held = [math.ceil(total / ((n_sampled - d) * u)) for d in range(tolerated + 1)]
    return u, tuple([held[0]] + [held[k] - held[k - 1] for k in range(1, tolerated + 1)])


def tolerated_dropouts(n_sampled: int, min_fraction: float) -> int:
    """L = N - ceil(F N), at most N - 1 (one survivor is needed to release anything)."""
    if n_sampled < 1:
        return 0
    keep = max(1, math.ceil(min_fraction * n_sampled - 1e-9))
    return n_sampled - keep
