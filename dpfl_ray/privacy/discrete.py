"""Integer noise for distributed DP inside secure aggregation: the samplers (issue #36).

Each client adds integer noise to its integer (scaled, rotated, rounded) update; SecAgg sums the
shares mod 2^b. Two noises:

* **discrete Gaussian** N_Z(0, s2), ``s2`` a positive integer variance: sampled exactly as Canonne,
  Kamath & Steinke 2020 (CKS20, "The discrete Gaussian for differential privacy") give it: Alg. 1
  (Bernoulli(exp(-gamma))), Alg. 2 (discrete Laplace), Alg. 3 (discrete Gaussian by rejection from
  the discrete Laplace). Every random choice is an integer drawn uniformly below an integer bound and
  compared with an integer, so the law of the output is N_Z(0, s2) exactly: no float is on the path.
  The loops run over whole arrays at once (numpy), one element leaving a loop when it is done.
* **symmetric Skellam** Sk(mu/2, mu/2), the difference of two Poisson(mu/2) draws (variance mu): its
  sum over clients is again a Skellam, so the released noise is exactly Sk(n mu / 2, n mu / 2).
  numpy's Poisson sampler, seeded from the run's DP randomness (:mod:`dpfl_ray.privacy.randomness`).

Their accounting is :mod:`dpfl_ray.privacy.discrete_rdp`; this module needs numpy only, so the
workers that draw the noise load neither dp_accounting nor scipy.
"""
from __future__ import annotations

import math

import numpy as np

from ..errors import DPFLError

# Above this variance the exact sampler's integer arithmetic (2 s2 t^2) would pass int64.
MAX_DISCRETE_GAUSSIAN_VARIANCE = 2 ** 30


# -- exact samplers (CKS20) ------------------------------------------------------------------------
def _below(gen, bound) -> np.ndarray:
    """Integers uniform on [0, bound), exactly, one per element of ``bound`` (an int64 array)."""
    bound = np.asarray(bound, dtype=np.int64)
    return np.asarray(gen.integers(0, bound, size=bound.shape), dtype=np.int64)


def _bernoulli_exp_at_most_one(gen, num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """Bernoulli(exp(-num/den)) for 0 <= num <= den (CKS20 Alg. 1): K = 1; while Bernoulli(gamma / K),
    K += 1; the answer is whether K is odd. Bernoulli(gamma / K) is Bernoulli(num / den) and
    Bernoulli(1 / K), independent: no product of bounds is ever formed. Where num = den (gamma = 1,
    the discrete Laplace's geometric part) Bernoulli(num / den) is certain and is not drawn."""
    k = np.ones(num.shape, dtype=np.int64)
    active = np.flatnonzero(np.ones(num.shape, dtype=bool))
    certain = bool(np.all(num == den))
    while active.size:
        first = True if certain else _below(gen, den[active]) < num[active]
        go_on = first & (_below(gen, k[active]) == 0)
        k[active[go_on]] += 1
        active = active[go_on]
    return k % 2 == 1


def bernoulli_exp(gen, num, den) -> np.ndarray:
    """Bernoulli(exp(-num/den)) elementwise, exactly, for integers num >= 0 and den >= 1."""
    num = np.asarray(num, dtype=np.int64)
    den = np.broadcast_to(np.asarray(den, dtype=np.int64), num.shape)
    whole, frac = np.divmod(num, den)
    return _bernoulli_exp_split(gen, whole, frac, den)


def _bernoulli_exp_split(gen, whole: np.ndarray, frac: np.ndarray, den: np.ndarray) -> np.ndarray:
    """Bernoulli(exp(-(whole + frac/den))), 0 <= frac < den (CKS20 Alg. 1 extended to gamma > 1):
    ``whole`` Bernoulli(exp(-1)) draws, all 1, then Bernoulli(exp(-frac/den))."""
    out = np.ones(whole.shape, dtype=bool)
    left = whole.copy()
    todo = np.flatnonzero(left > 0)
    while todo.size:
        one = np.ones(todo.size, dtype=np.int64)
        ok = _bernoulli_exp_at_most_one(gen, one, one)
        out[todo[~ok]] = False
        left[todo] -= 1
        todo = todo[ok & (left[todo] > 0)]
    alive = np.flatnonzero(out)
    out[alive] = _bernoulli_exp_at_most_one(gen, frac[alive], den[alive])
    return out


def _accepted(propose, size: int, rate: float) -> np.ndarray:
    """``size`` draws by rejection: ``propose(m)`` gives m candidates and whether each is accepted.
    Each pass proposes enough for the draws still missing at the acceptance ``rate`` (with margin),
    and keeps its first accepted ones in order: the accepted candidates are independent draws of the
    target, whichever of them are kept. Proposing for every missing draw at once takes one or two
    passes; proposing again for the rejected ones alone would take a dozen over ever smaller arrays,
    each paying the random stream's per-call cost."""
    parts, missing = [], int(size)
    while missing > 0:
        m = int(missing / rate * 1.1) + 32
        values, ok = propose(m)
        got = values[ok][:missing]
        parts.append(got)
        missing -= got.size
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def discrete_laplace(gen, t: int, size: int) -> np.ndarray:
    """``size`` draws with P[Y = y] proportional to exp(-|y| / t), t a positive integer (CKS20 Alg. 2
    with s = 1)."""
    t = int(t)
    if t < 1:
        raise DPFLError(f"the discrete Laplace scale must be a positive integer, got {t}", field="t")

    def propose(m: int) -> tuple[np.ndarray, np.ndarray]:
        u = _below(gen, np.full(m, t))
        d = bernoulli_exp(gen, u, np.full(m, t))
        v = np.zeros(m, dtype=np.int64)  # failures before the first 0 of Bernoulli(exp(-1))
        alive = np.arange(m)
        while alive.size:
            one = np.ones(alive.size, dtype=np.int64)
            more = _bernoulli_exp_at_most_one(gen, one, one)
            v[alive[more]] += 1
            alive = alive[more]
        y = u + t * v
        negative = _below(gen, np.full(m, 2)) == 1
        return np.where(negative, -y, y), d & ~(negative & (y == 0))

    # accepted: Bernoulli(exp(-U/t)) with U uniform below t (at least 1 - exp(-1)), less the -0 case: 0.63 or more
    return _accepted(propose, size, 0.63)


def discrete_gaussian(gen, variance: int, size: int) -> np.ndarray:
    """``size`` draws from the discrete Gaussian N_Z(0, variance) (P[x] proportional to
    exp(-x^2 / (2 variance)), x integer), exactly: CKS20 Alg. 3 with t = floor(sigma) + 1, accepting
    a discrete Laplace draw Y with probability exp(-(|Y| - variance/t)^2 / (2 variance)), whose
    exponent is the integer fraction (|Y| t - variance)^2 / (2 variance t^2)."""
    if isinstance(variance, bool) or int(variance) != variance or not 1 <= variance <= MAX_DISCRETE_GAUSSIAN_VARIANCE:
        raise DPFLError(f"the discrete Gaussian's variance must be an integer in [1, 2^30], got {variance!r} "
                        "(a coarser scale keeps it there)", field="variance")
    s2 = int(variance)
    t = math.isqrt(s2) + 1
    den = 2 * s2 * t * t  # below 2^63 for s2 <= 2^30

    def propose(m: int) -> tuple[np.ndarray, np.ndarray]:
        y = discrete_laplace(gen, t, m)
        # the numerator in Python integers: (|Y| t - s2)^2 passes int64 in the tails
        diff = np.abs(y).astype(object) * t - s2
        num = diff * diff
        whole = (num // den).astype(np.int64)
        frac = (num % den).astype(np.int64)
        return y, _bernoulli_exp_split(gen, whole, frac, np.full(whole.shape, den, dtype=np.int64))

    # CKS20 Alg. 3 with t = floor(sigma) + 1 accepts 0.68-0.76 of the discrete Laplace draws (0.55 at
    # variance 1, which then takes a second pass)
    return _accepted(propose, size, 0.7)


def skellam(gen, variance: float, size: int) -> np.ndarray:
    """``size`` draws of the symmetric Skellam with this variance: Poisson(variance / 2) minus an
    independent Poisson(variance / 2). ``gen``: a numpy Generator, or the run's ChaCha20 stream, which
    then seeds numpy's sampler with 256 of its bits."""
    if not (np.isfinite(variance) and variance > 0):
        raise DPFLError(f"the Skellam variance must be a positive number, got {variance!r}", field="variance")
    if not isinstance(gen, np.random.Generator):
        gen = np.random.default_rng([int(w) for w in gen.integers(0, 2 ** 62, size=4)])
    half = float(variance) / 2.0
    return gen.poisson(half, int(size)).astype(np.int64) - gen.poisson(half, int(size)).astype(np.int64)


def draw(mechanism: str, gen, variance: float, size: int) -> np.ndarray:
    """``size`` draws of ``mechanism``'s noise ('skellam' or 'discrete_gaussian', whose variance must
    be an integer) of this variance."""
    if mechanism == "skellam":
        return skellam(gen, variance, size)
    return discrete_gaussian(gen, int(variance), size)
