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

# The largest noise share, in integer units, a round's plan gives one client (privacy/discrete_rdp.py).
# The discrete Gaussian's exact sampler is exact up to it: above, its integer arithmetic (2 s2 t^2)
# would pass int64. Skellam's draws come from numpy's Poisson sampler, which works in doubles:
# at a mean near 2^45 its draws visibly leave Poisson's law, and from 2^53 they are all even (the
# low bits of the sum would go out without noise). At a mean of 2^29 its acceptance test's rounding
# (about mean x ln(mean) x 2^-52) is below 3e-6.
MAX_SHARE_VARIANCE = 2 ** 30
# A Skellam share past MAX_SHARE_VARIANCE (a calibration's fresh share) is drawn in pieces of at
# most that variance; beyond this many pieces the plan, not the sampler, must change.
MAX_SKELLAM_PIECES = 2 ** 10


# -- exact samplers (CKS20) ------------------------------------------------------------------------
def _below(gen, bound, size: int | None = None) -> np.ndarray:
    """Integers uniform on [0, bound), exactly: one per element of ``bound`` (an int64 array), or
    ``size`` of them below the one integer ``bound``. Both forms draw the same stream for the same
    bounds (numpy's Generator and the ChaCha20 stream alike); one bound draws it in a quarter of the time."""
    if size is not None:
        return np.asarray(gen.integers(0, int(bound), size=int(size)), dtype=np.int64)
    bound = np.asarray(bound, dtype=np.int64)
    return np.asarray(gen.integers(0, bound, size=bound.shape), dtype=np.int64)


def _one_bound(den: np.ndarray):
    """The one value of ``den`` if all its elements are equal (and there is one), else None."""
    if den.size and bool(np.all(den == den.flat[0])):
        return int(den.flat[0])
    return None


def _bernoulli_exp_at_most_one(gen, num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """Bernoulli(exp(-num/den)) for 0 <= num <= den (CKS20 Alg. 1): K = 1; while Bernoulli(gamma / K),
    K += 1; the answer is whether K is odd. Bernoulli(gamma / K) is Bernoulli(num / den) and
    Bernoulli(1 / K), independent: no product of bounds is ever formed. Where num = den (gamma = 1,
    the discrete Laplace's geometric part) Bernoulli(num / den) is certain and is not drawn; nor is
    Bernoulli(1 / 1)."""
    shape = num.shape
    if bool(np.all(num == den)):
        return _bernoulli_exp_minus_one(gen, num.size).reshape(shape)
    num, den = num.ravel(), np.broadcast_to(den, num.shape).ravel()
    odd = np.zeros(num.size, dtype=bool)
    active = np.arange(num.size)
    bound = _one_bound(den)
    k = 1  # every element still in the loop has gone on the same number of times
    while active.size:
        if bound is not None:
            first = _below(gen, bound, active.size) < num[active]
        else:
            first = _below(gen, den[active]) < num[active]
        go_on = first if k == 1 else first & (_below(gen, k, active.size) == 0)
        if k % 2 == 1:
            odd[active[~go_on]] = True
        k += 1
        active = active[go_on]
    return odd.reshape(shape)


def _bernoulli_exp_minus_one(gen, n: int) -> np.ndarray:
    """``n`` draws of Bernoulli(exp(-1)): CKS20 Alg. 1 at gamma = 1, where each Bernoulli(gamma / K)
    is Bernoulli(1 / K) alone, certain at K = 1: the loop starts at K = 2 (e - 1 draws each on average)."""
    odd = np.zeros(n, dtype=bool)
    active = np.arange(n)
    k = 2
    while active.size:
        go_on = _below(gen, k, active.size) == 0
        if k % 2 == 1:
            odd[active[~go_on]] = True
        k += 1
        active = active[go_on]
    return odd


def bernoulli_exp(gen, num, den) -> np.ndarray:
    """Bernoulli(exp(-num/den)) elementwise, exactly, for integers num >= 0 and den >= 1."""
    num = np.asarray(num, dtype=np.int64)
    den = np.broadcast_to(np.asarray(den, dtype=np.int64), num.shape).ravel()
    whole, frac = np.divmod(num.ravel(), den)
    return _bernoulli_exp_split(gen, whole, frac, den).reshape(num.shape)


def _bernoulli_exp_split(gen, whole: np.ndarray, frac: np.ndarray, den: np.ndarray) -> np.ndarray:
    """Bernoulli(exp(-(whole + frac/den))), 0 <= frac < den (CKS20 Alg. 1 extended to gamma > 1):
    ``whole`` Bernoulli(exp(-1)) draws, all 1, then Bernoulli(exp(-frac/den))."""
    out = np.ones(whole.shape, dtype=bool)
    left = whole.copy()
    todo = np.flatnonzero(left > 0)
    while todo.size:
        ok = _bernoulli_exp_minus_one(gen, todo.size)
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
        u = _below(gen, t, m)
        d = _bernoulli_exp_at_most_one(gen, u, np.full(m, t, dtype=np.int64))  # exp(-U/t), U < t
        v = np.zeros(m, dtype=np.int64)  # failures before the first 0 of Bernoulli(exp(-1))
        alive = np.arange(m)
        while alive.size:
            more = _bernoulli_exp_minus_one(gen, alive.size)
            v[alive[more]] += 1
            alive = alive[more]
        y = u + t * v
        negative = _below(gen, 2, m) == 1
        return np.where(negative, -y, y), d & ~(negative & (y == 0))

    # accepted: Bernoulli(exp(-U/t)) with U uniform below t (at least 1 - exp(-1)), less the -0 case: 0.63 or more
    return _accepted(propose, size, 0.63)


def discrete_gaussian(gen, variance: int, size: int) -> np.ndarray:
    """``size`` draws from the discrete Gaussian N_Z(0, variance) (P[x] proportional to
    exp(-x^2 / (2 variance)), x integer), exactly: CKS20 Alg. 3 with t = floor(sigma) + 1, accepting
    a discrete Laplace draw Y with probability exp(-(|Y| - variance/t)^2 / (2 variance)), whose
    exponent is the integer fraction (|Y| t - variance)^2 / (2 variance t^2)."""
    if isinstance(variance, bool) or int(variance) != variance or not 1 <= variance <= MAX_SHARE_VARIANCE:
        raise DPFLError(f"the discrete Gaussian's variance must be an integer in [1, 2^30], got {variance!r} "
                        "(a coarser scale keeps it there)", field="variance")
    s2 = int(variance)
    t = math.isqrt(s2) + 1
    den = 2 * s2 * t * t  # below 2^63 for s2 <= 2^30

    def propose(m: int) -> tuple[np.ndarray, np.ndarray]:
        y = discrete_laplace(gen, t, m)
        # the numerator (|Y| t - s2)^2 in int64 where it fits (|Y| t - s2 below 3,037,000,499 = floor
        # sqrt(2^63 - 1)), in Python integers in the tails where it would pass int64
        ay = np.abs(y)
        fits = ay <= (3_037_000_499 + s2) // t
        whole, frac = np.empty(m, dtype=np.int64), np.empty(m, dtype=np.int64)
        diff = ay[fits] * t - s2
        whole[fits], frac[fits] = np.divmod(diff * diff, den)
        if not fits.all():
            tail = ay[~fits].astype(object) * t - s2
            square = tail * tail
            whole[~fits], frac[~fits] = (square // den).astype(np.int64), (square % den).astype(np.int64)
        return y, _bernoulli_exp_split(gen, whole, frac, np.full(m, den, dtype=np.int64))

    # CKS20 Alg. 3 with t = floor(sigma) + 1 accepts 0.68-0.76 of the discrete Laplace draws (0.55 at
    # variance 1, which then takes a second pass)
    return _accepted(propose, size, 0.7)


def skellam(gen, variance: float, size: int) -> np.ndarray:
    """``size`` draws of the symmetric Skellam with this variance: Poisson(variance / 2) minus an
    independent Poisson(variance / 2), each drawn as the sum of as many Poissons as keep every piece's
    variance within MAX_SHARE_VARIANCE (one, for any share a round's plan gives). ``gen``: a numpy
    Generator, or the run's ChaCha20 stream, which then seeds numpy's sampler with 256 of its bits."""
    if not (np.isfinite(variance) and variance > 0):
        raise DPFLError(f"the Skellam variance must be a positive number, got {variance!r}", field="variance")
    pieces = math.ceil(variance / MAX_SHARE_VARIANCE)
    if pieces > MAX_SKELLAM_PIECES:
        raise DPFLError(f"a Skellam share of variance {variance:.4g} is past what is drawn in pieces "
                        f"({MAX_SKELLAM_PIECES} x 2^30; a coarser scale keeps it there)", field="variance")
    if not isinstance(gen, np.random.Generator):
        gen = np.random.default_rng([int(w) for w in gen.integers(0, 2 ** 62, size=4)])
    # Poisson(m x) is the sum of m independent Poisson(x): each piece stays where numpy's doubles keep its law
    half, size = float(variance) / 2.0 / pieces, int(size)
    out = np.zeros(size, dtype=np.int64)
    for sign in (1, -1):
        for _ in range(pieces):
            out += sign * gen.poisson(half, size).astype(np.int64)
    return out


def draw(mechanism: str, gen, variance: float, size: int) -> np.ndarray:
    """``size`` draws of ``mechanism``'s noise ('skellam' or 'discrete_gaussian', whose variance must
    be an integer) of this variance."""
    if mechanism == "skellam":
        return skellam(gen, variance, size)
    return discrete_gaussian(gen, int(variance), size)
