"""What integer noise inside SecAgg costs, as RDP curves over integer orders (issue #36); the samplers
are :mod:`dpfl_ray.privacy.discrete`.

* :func:`skellam_rdp`: Agarwal, Kairouz & Liu 2021 ("The Skellam mechanism for differentially private
  federated learning"), the multi-dimensional Skellam mechanism with l1 and l2 sensitivities, in the
  integer domain: eps(a) = a D2^2 / (2 mu) + min(((2a - 1) D2^2 + 6 D1) / (4 mu^2), 3 D1 / (2 mu)),
  mu the variance of the summed noise.
* :func:`ddgauss_rdp`: Kairouz, Liu & Steinke 2021 ("The distributed discrete Gaussian mechanism for
  federated learning with secure aggregation"), Prop. 14 with the divergence term tau of a sum of n
  discrete Gaussians (Thm. 1: tau = 10 sum_{k=1}^{n-1} exp(-2 pi^2 s2 k / (k + 1))).
* :func:`rounded_l2_bound`, :func:`rounded_l1_bound`: the sensitivities after (conditional) randomized
  rounding to integers (Kairouz et al. 2021, Thm. 1 and Prop. 22).
* :func:`poisson_subsampled_rdp`: the amplification by Poisson sampling of a mechanism given by its RDP
  at integer orders, Zhu & Wang 2019 ("Poisson subsampled Renyi differential privacy", Thm. 5, the
  upper bound), at most the mechanism's own.
* :func:`wor_subsampled_rdp`: the same for a fixed-size cohort (m of n without replacement, the
  replace-one relation), Wang, Balle & Kasiviswanathan 2019 ("Subsampled Renyi differential privacy
  and analytical moments accountant", Thm. 9, for a mechanism without a pure-DP bound).

dp_accounting has no event for these mechanisms: :class:`DiscreteNoiseSumDpEvent` is one, alone or
inside dp_accounting's ``PoissonSampledDpEvent`` or ``SampledWithoutReplacementDpEvent``, and the
project's RDP accountants (:mod:`dpfl_ray.privacy.accountants`) compose its curve
(:func:`event_rdp_curve`) with every other event and convert the sum with dp_accounting's own
conversion. The Gaussian special cases are tested
against dp_accounting's RdpAccountant (tests/unit/test_discrete_noise.py).
"""
from __future__ import annotations

import functools
import math

import attr
import numpy as np
from dp_accounting import NeighboringRelation
from dp_accounting import dp_event as dpe
from scipy import special

from ..errors import DPFLError
from .discrete import MAX_SHARE_VARIANCE

# Integer orders only: the subsampling bound (Zhu & Wang 2019, Thm. 5) is stated for them.
ORDERS = tuple(range(2, 129)) + (256,)


# -- sensitivities after rounding ------------------------------------------------------------------
def rounded_l2_bound(l2: float, dim: int, beta: float = 0.0) -> float:
    """The l2 norm bound of a vector of norm <= ``l2`` (integer units) after randomized rounding to
    integers: l2 + sqrt(dim) (each coordinate moves by less than 1); with conditional rounding at
    ``beta`` in (0, 1) (a rounding whose norm passes the second bound is drawn again) also
    sqrt(l2^2 + dim/4 + sqrt(2 ln(1/beta)) (l2 + sqrt(dim)/2)) (Kairouz et al. 2021, Thm. 1 / Prop. 22);
    the smaller of the two."""
    if not (l2 > 0 and int(dim) == dim and dim >= 1 and 0 <= beta < 1):
        raise DPFLError(f"rounded_l2_bound needs l2 > 0, an integer dim >= 1 and 0 <= beta < 1, got {l2}, {dim}, "
                        f"{beta}", field="beta")
    plain = l2 + math.sqrt(dim)
    if beta == 0:
        return plain
    squared = l2 ** 2 + 0.25 * dim + math.sqrt(2.0 * math.log(1.0 / beta)) * (l2 + 0.5 * math.sqrt(dim))
    return min(plain, math.sqrt(squared))


def rounded_l1_bound(l2: float, dim: int) -> float:
    """The l1 bound of an integer vector of l2 norm <= ``l2``: l1 <= sqrt(dim) l2, and l1 <= l2^2 for
    integer coordinates."""
    return l2 * min(math.sqrt(dim), l2)


# -- RDP -------------------------------------------------------------------------------------------
def skellam_rdp(order: int, l1: float, l2: float, variance: float) -> float:
    """RDP at ``order`` of releasing a sum plus symmetric Skellam noise of total ``variance`` (integer
    units) when one client moves the sum by at most ``l1`` / ``l2`` (Agarwal, Kairouz & Liu 2021)."""
    a, mu = float(order), float(variance)
    if not (a > 1 and mu > 0):
        raise DPFLError(f"skellam_rdp needs order > 1 and variance > 0, got {order}, {variance}", field="variance")
    return a * l2 ** 2 / (2.0 * mu) + min(((2.0 * a - 1.0) * l2 ** 2 + 6.0 * l1) / (4.0 * mu ** 2),
                                          3.0 * l1 / (2.0 * mu))


@functools.lru_cache(maxsize=1024)  # a curve asks it at every order, with the same two arguments
def ddgauss_tau(local_variance: float, shares: int) -> float:
    """The divergence term of a sum of ``shares`` discrete Gaussians of variance ``local_variance``
    each from one discrete Gaussian of the total variance (Kairouz et al. 2021, Thm. 1)."""
    return 10.0 * sum(math.exp(-2.0 * math.pi ** 2 * local_variance * k / (k + 1)) for k in range(1, int(shares)))


def ddgauss_rdp(order: int, l1: float, l2: float, local_variance: float, shares: int, dim: int) -> float:
    """RDP at ``order`` of releasing a sum plus ``shares`` independent N_Z(0, local_variance) draws per
    coordinate (integer units), sensitivities ``l1`` / ``l2`` (Kairouz et al. 2021, Prop. 14)."""
    a = float(order)
    if not (a > 1 and local_variance > 0 and shares >= 1):
        raise DPFLError(f"ddgauss_rdp needs order > 1, local_variance > 0 and shares >= 1, got {order}, "
                        f"{local_variance}, {shares}", field="local_variance")
    total_std = math.sqrt(shares * local_variance)
    s1, s2, tau = l1 / total_std, l2 / total_std, ddgauss_tau(local_variance, shares)
    return min(a / 2.0 * s2 ** 2 + tau * dim,
               a / 2.0 * (s2 ** 2 + 2.0 * s1 * tau + tau ** 2 * dim),
               a / 2.0 * (s2 + math.sqrt(dim) * tau) ** 2)


def _subsampling_args(order, rate: float, name: str, rdp) -> tuple[int, float]:
    """A subsampling bound's checked integer order and the mechanism's own RDP there."""
    alpha = int(order)
    if alpha != order or alpha < 2:
        raise DPFLError(f"the subsampling bound needs an integer order >= 2, got {order}", field="order")
    if not 0 < rate <= 1:
        raise DPFLError(f"the sampling {name} must be in (0, 1], got {rate}", field=name)
    return alpha, rdp(alpha)


def _log_binom(n: int, k: int) -> float:
    return float(special.gammaln(n + 1) - special.gammaln(k + 1) - special.gammaln(n - k + 1))


def poisson_subsampled_rdp(order: int, rate: float, rdp, generic: bool = True) -> float:
    """RDP at integer ``order`` >= 2 of a mechanism run on a Poisson sample at ``rate``, the mechanism's
    RDP given as the function ``rdp(order)``: Zhu & Wang 2019, Thm. 5 (an upper bound), and never above
    the mechanism's own RDP.

    ``generic=False`` drops Thm. 5's factor 3 on the terms of order 3 and up, which covers the other
    direction of the divergence for any mechanism: the exact form that Zhu & Wang prove for the
    Gaussian and Laplace mechanisms only. No ledger uses it; it shows what the factor costs
    (docs/distributed_dp.md)."""
    alpha, own = _subsampling_args(order, rate, "rate", rdp)
    if rate == 1:
        return own
    g = float(rate)
    terms = [0.0, rdp(2)]
    weights = [(1 - g) ** (alpha - 1) * (alpha * g - g + 1), special.comb(alpha, 2) * g ** 2 * (1 - g) ** (alpha - 2)]
    for ell in range(3, alpha + 1):
        terms.append((ell - 1) * rdp(ell) + _log_binom(alpha, ell) + (alpha - ell) * math.log1p(-g) + ell * math.log(g))
        weights.append(3.0 if generic else 1.0)
    return min(float(special.logsumexp(terms, b=weights)) / (alpha - 1), own)


def wor_subsampled_rdp(order: int, ratio: float, rdp) -> float:
    """RDP at integer ``order`` >= 2 of a mechanism run on m of n records drawn without replacement
    (``ratio`` = m / n), under the replace-one relation, the mechanism's replace-one RDP given as
    ``rdp(order)``: Wang, Balle & Kasiviswanathan 2019, Thm. 9 with eps(inf) = inf (the integer noises
    have no pure-DP bound), so each min{2, (e^eps(inf) - 1)^j} there is 2:

        (1 / (a - 1)) log(1 + g^2 C(a, 2) min{4 (e^eps(2) - 1), 2 e^eps(2)}
                          + sum_{j=3}^{a} 2 g^j C(a, j) e^((j - 1) eps(j))),

    and never above the mechanism's own RDP."""
    alpha, own = _subsampling_args(order, ratio, "ratio", rdp)
    if ratio == 1:
        return own
    g, e2 = float(ratio), rdp(2)
    terms = [0.0, 2 * math.log(g) + math.log(special.comb(alpha, 2))
             + min(math.log(4.0) + e2 + math.log(-math.expm1(-e2)) if e2 > 0 else -math.inf, math.log(2.0) + e2)]
    for j in range(3, alpha + 1):
        terms.append(math.log(2.0) + j * math.log(g) + _log_binom(alpha, j) + (j - 1) * rdp(j))
    return min(float(special.logsumexp(terms)) / (alpha - 1), own)


def rdp_curve(rdp, rate: float = 1.0, orders=ORDERS, bound=poisson_subsampled_rdp) -> np.ndarray:
    """One round's RDP at every order of ``orders``, amplified by sampling at ``rate`` (``bound``:
    :func:`poisson_subsampled_rdp`, or :func:`wor_subsampled_rdp` for a fixed-size cohort). The bound
    at order a reads the mechanism's RDP at every integer order up to a: each is computed once."""
    rdp = functools.lru_cache(maxsize=None)(rdp)
    return np.array([bound(a, rate, rdp) if rate < 1 else rdp(a) for a in orders])


def epsilon(curve, delta: float, orders=ORDERS) -> float:
    """epsilon at ``delta`` of an RDP curve (several rounds: the sum of theirs), by dp_accounting's
    conversion."""
    from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

    eps, _ = compute_epsilon(list(orders), list(np.asarray(curve, dtype=float)), delta)
    return float(eps)


# -- the ledger's event ------------------------------------------------------------------------------
MECHANISMS = ("skellam", "discrete_gaussian")


@attr.s(frozen=True, slots=True, auto_attribs=True)
class DiscreteNoiseSumDpEvent(dpe.DpEvent):
    """One release of a secure sum of integer vectors carrying the clients' integer noise shares.

    ``mechanism``: 'skellam' or 'discrete_gaussian'. ``l1``, ``l2``: how far one client can move the
    integer sum (its rounded, scaled contribution's bounds) under the ledger's neighbouring relation.
    ``variance``: for Skellam the variance of the summed noise (its shares add up to one Skellam), for
    the discrete Gaussian each share's.
    ``shares``: the number of noise shares in the sum. ``dim``: the vector's length (after padding)."""

    mechanism: str
    l1: float
    l2: float
    variance: float
    shares: int
    dim: int

    def with_shares(self, shares: int, local_variance: float) -> "DiscreteNoiseSumDpEvent":
        """The same release with ``shares`` shares of ``local_variance`` each in the sum."""
        total = local_variance * shares if self.mechanism == "skellam" else local_variance
        return attr.evolve(self, variance=float(total), shares=int(shares))

    def rdp(self, order: float) -> float:
        if self.mechanism == "skellam":
            return skellam_rdp(order, self.l1, self.l2, self.variance)
        if self.mechanism == "discrete_gaussian":
            return ddgauss_rdp(order, self.l1, self.l2, self.variance, self.shares, self.dim)
        raise DPFLError(f"unknown discrete mechanism {self.mechanism!r}; choose one of {', '.join(MECHANISMS)}",
                        field="mechanism")


@attr.s(frozen=True, slots=True, auto_attribs=True)
class CalibratedViewsDpEvent(dpe.DpEvent):
    """What the server holds of a round of Baek's calibration with integer shares (Alg. 2 lines
    17-24): the first aggregate A = X + D + E and the release R = X + D + F, where E and F are the
    first and fresh shares of the ``senders`` survivors that sent a calibration term (their terms
    securely summed: the server sees A and R only), D the first shares of the other
    ``survivors - senders``. ``first``: the event of one first share (``shares`` 1, ``variance``
    the share's); ``fresh_variance``: one fresh share's. ``senders`` None: the worst case over every number of senders, what the round
    can cost before the calibration phase tells.

    The RDP at each order is the smaller of two bounds, each from handing the server noise that does
    not depend on the data: given D, two views X + E and X + F with independent noises, whose
    divergences add (exact when every survivor sends); given E and F, one view X + D."""

    first: DiscreteNoiseSumDpEvent
    fresh_variance: float
    survivors: int
    senders: int | None = None

    def rdp_with(self, order: float, senders: int) -> float:
        first, local = self.first, self.first.variance
        two = (first.with_shares(senders, local).rdp(order) + first.with_shares(senders, self.fresh_variance).rdp(order)
               if senders > 0 else math.inf)
        one = first.with_shares(self.survivors - senders, local).rdp(order) if senders < self.survivors else math.inf
        return min(two, one)

    def rdp(self, order: float) -> float:
        if self.senders is not None:
            return self.rdp_with(order, self.senders)
        return max(self.rdp_with(order, s) for s in range(self.survivors + 1))


def discrete_rdp_of(event):
    """The RDP function (order -> RDP) of a :class:`DiscreteNoiseSumDpEvent` or a
    :class:`CalibratedViewsDpEvent`; None for any other event."""
    if isinstance(event, (DiscreteNoiseSumDpEvent, CalibratedViewsDpEvent)):
        return event.rdp
    return None


def event_rdp_curve(event, orders, relation: NeighboringRelation) -> np.ndarray | None:
    """The RDP curve over ``orders`` of a discrete release (:func:`discrete_rdp_of`), or of one inside
    dp_accounting's ``PoissonSampledDpEvent`` (Zhu & Wang's bound on the whole release, add/remove-one
    only) or ``SampledWithoutReplacementDpEvent`` (Wang et al.'s, replace-one only); None for any
    other event. The release's ``l1`` and ``l2`` must bound one client's move under the ledger's
    relation (Baek's state the replace-one sensitivity 2C, which bounds both). A fractional order gets
    the next integer order's value: Renyi divergence never decreases with the order, so that bounds it."""
    inner, rate, bound = event, 1.0, poisson_subsampled_rdp
    if isinstance(event, dpe.PoissonSampledDpEvent) and discrete_rdp_of(event.event) is not None:
        if relation != NeighboringRelation.ADD_OR_REMOVE_ONE:
            raise DPFLError("a Poisson-sampled discrete noise sum is accounted under the add/remove-one relation "
                            f"only, not {relation.name}", field="accountant")
        inner, rate = event.event, float(event.sampling_probability)
    elif isinstance(event, dpe.SampledWithoutReplacementDpEvent) and discrete_rdp_of(event.event) is not None:
        if relation != NeighboringRelation.REPLACE_ONE:
            raise DPFLError("a fixed-size cohort's discrete noise sum is accounted under the replace-one relation "
                            f"only, not {relation.name}", field="accountant")
        inner, bound = event.event, wor_subsampled_rdp
        rate = event.sample_size / event.source_dataset_size
        if rate == 0:  # nobody sampled: nothing released
            return np.zeros(len(orders))
    rdp = discrete_rdp_of(inner)
    if rdp is None:
        return None
    if rate >= 1.0:
        return np.array([rdp(float(a)) for a in orders])
    return rdp_curve(rdp, rate, [max(2, math.ceil(float(a))) for a in orders], bound=bound)


# -- one round's ring plan ---------------------------------------------------------------------------
@attr.s(frozen=True, slots=True, auto_attribs=True)
class RingPlan:
    """How one round carries the clients' vectors through Z_(2^bits) (secagg/ring.py) and what it
    releases. ``scale``: integer steps per model unit (1/gamma). ``local_variance``: each client's
    noise share in integer units (an integer for the discrete Gaussian). ``event``: what the ledger
    books for the round, before sampling. ``wrap_probability``: the bound on a modular wrap."""

    bits: int
    scale: float
    local_variance: float
    event: DiscreteNoiseSumDpEvent
    wrap_probability: float

    @property
    def mechanism(self) -> str:
        return self.event.mechanism


def plan_ring(mechanism: str, bits: int, shares: int, dim: int, clip_norm: float, noise_std: float,
              sensitivity: float, max_wrap_probability: float = 1e-4, beta: float = math.exp(-0.5),
              replace_one: bool = False) -> RingPlan:
    """The finest scale at which ``shares`` clients' vectors of norm <= ``clip_norm`` (in sum at most
    shares * clip_norm), rounded and carrying noise whose sum has std ``noise_std`` (model units),
    wrap in Z_(2^bits) with probability at most ``max_wrap_probability``; and the event the round
    releases, with the rounded sensitivity of one client (``sensitivity`` in model units,
    conditional rounding at ``beta``). Under ``replace_one`` one client's rounded vector leaves and
    another's comes in: each is rounded on its own, so the sum moves by up to twice one rounded
    bound, 2 B(clip_norm), more than B(2 clip_norm) by the rounding's sqrt(dim) term; the larger of
    that and B(sensitivity) is booked. The discrete Gaussian's share variance is rounded up to an
    integer, so its sum carries at least the asked noise. Either share's variance stays within
    MAX_SHARE_VARIANCE, where its sampler keeps its law: a ring wider than that needs keeps the coarser
    scale. A ring too small for any scale is a one-line error naming bits."""
    from ..secagg.ring import padded_dim, wrap_probability

    if mechanism not in MECHANISMS:
        raise DPFLError(f"unknown discrete mechanism {mechanism!r}; choose one of {', '.join(MECHANISMS)}",
                        field="distributed_noise")
    d = padded_dim(dim)

    def at(scale: float) -> RingPlan:
        total = (scale * noise_std) ** 2
        if mechanism == "discrete_gaussian":
            local = float(max(1, math.ceil(total / shares)))
            wrap = wrap_probability(bits, d, shares * clip_norm * scale, shares, dg_variance=local)
            variance = local
        else:
            local = total / shares
            wrap = wrap_probability(bits, d, shares * clip_norm * scale, shares, skellam_variance=local)
            variance = total
        l2 = rounded_l2_bound(sensitivity * scale, d, beta)
        if replace_one:
            l2 = max(l2, 2.0 * rounded_l2_bound(clip_norm * scale, d, beta))
        event = DiscreteNoiseSumDpEvent(mechanism, rounded_l1_bound(l2, d), l2, variance, int(shares), d)
        return RingPlan(int(bits), scale, local, event, wrap)

    low, high = 1e-6, 2.0 ** bits / (noise_std + clip_norm)
    if at(low).wrap_probability > max_wrap_probability:
        raise DPFLError(f"a {bits}-bit ring cannot hold the sum of {shares} clients' vectors of {dim} values with "
                        f"a wrap probability below {max_wrap_probability:g}; use more bits", field="bits")
    for _ in range(60):  # bisection on log(scale)
        mid = math.sqrt(low * high)
        if at(mid).wrap_probability <= max_wrap_probability:
            low = mid
        else:
            high = mid
    plan = at(low)
    if plan.local_variance > MAX_SHARE_VARIANCE:  # where both samplers are exact (privacy/discrete.py)
        scale = math.sqrt(MAX_SHARE_VARIANCE * shares) / noise_std
        while (plan := at(scale)).local_variance > MAX_SHARE_VARIANCE:  # the square root's round-off
            scale = math.nextafter(scale, 0.0)
    return plan
