"""Which dp_accounting accountant composes the ledger's events, and whether it can.

Every privacy number comes from Google's ``dp_accounting`` package; the one formula written out
here is the 'rdp-classic' RDP -> (epsilon, delta) conversion (see below).

Accountants (``accountant=``)
-----------------------------
``"pld"`` (the default)
    Privacy-loss-distribution accounting with dp_accounting's PLD code, pessimistic estimates,
    ``value_discretization_interval`` = :data:`PLD_VALUE_DISCRETIZATION_INTERVAL` = 1e-4. 1e-4 keeps
    epsilon stable to two decimals out to 10^5 rounds of z=1, q=0.01 (1e-3 is about 0.02 off there)
    and, being pessimistic, is always an upper bound. The tightest of the three. Composed by
    :class:`_BoundedPLDAccountant`, which makes dp_accounting's PLD calls but builds each distinct
    per-round distribution once (0.4 s each at 1e-4) and bounds every call: the grid is picked
    from (z, q, rounds) before anything is built (:func:`pld_grid`), coarser where 1e-4 would need
    more than :data:`PLD_MAX_POINTS` / :data:`PLD_MAX_COMPOSED_POINTS` points (a tiny z, a huge
    number of rounds), and where no grid on :data:`PLD_GRID_LADDER` fits it falls back to 'rdp' and
    says so (``accountant_used``, ``note``). Where 1e-4 fits, the results equal ``PLDAccountant``'s.
    A round with several Gaussians under one sampling is accounted as its single equivalent Gaussian.
``"rdp"``
    dp_accounting's ``RdpAccountant`` with its default orders and its own (improved) conversion.
``"rdp-classic"``
    The convention of TF-Privacy's 2019-2021 ``compute_rdp``/``get_privacy_spent`` that the seed papers
    used: orders 1.1, 1.2, ..., 10.9 and 12, 13, ..., 63 (:data:`CLASSIC_RDP_ORDERS`), the RDP values
    from dp_accounting's ``RdpAccountant`` with those orders, and the classic conversion
    ``epsilon = min_a RDP(a) + log(1/delta)/(a-1)``, ``delta = min_a exp((a-1)(RDP(a) - epsilon))``.
    Reproduces e.g. Baek et al.'s 1.6118 for z=1, q=0.01, 100 rounds, delta=1e-5. With nothing
    composed it reports 0 (the bare conversion would give log(1/delta)/62).
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import dp_accounting
import numpy as np
from dp_accounting import NeighboringRelation
from dp_accounting import dp_event as dpe
from dp_accounting.pld import common as pld_common
from dp_accounting.pld import pld_pmf, pld_privacy_accountant
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.pld import privacy_loss_mechanism as pld_mech
from dp_accounting.rdp import rdp_privacy_accountant

from dpfl_ray.errors import DPFLError

ACCOUNTANTS = ("pld", "rdp", "rdp-classic")
DEFAULT_ACCOUNTANT = "pld"
PLD_VALUE_DISCRETIZATION_INTERVAL = 1e-4
CLASSIC_RDP_ORDERS: tuple[float, ...] = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)))

__all__ = ["ACCOUNTANTS", "DEFAULT_ACCOUNTANT", "PLD_VALUE_DISCRETIZATION_INTERVAL", "CLASSIC_RDP_ORDERS"]


def _check_accountant(name: Any, field: str = "accountant") -> str:
    if name not in ACCOUNTANTS:
        raise DPFLError(f"unknown accountant {name!r}; choose one of {', '.join(ACCOUNTANTS)}", field=field)
    return name


class _ClassicRdpAccountant(dp_accounting.rdp.RdpAccountant):
    """dp_accounting's RdpAccountant on TF-Privacy's classic orders, with the classic conversion."""

    def __init__(self, neighboring_relation: NeighboringRelation = NeighboringRelation.ADD_OR_REMOVE_ONE):
        super().__init__(orders=CLASSIC_RDP_ORDERS, neighboring_relation=neighboring_relation)

    def get_epsilon(self, target_delta: float) -> float:
        rdp, orders = self.rdp, self.orders
        if not np.any(rdp):
            return 0.0
        with np.errstate(invalid="ignore"):
            eps = rdp + math.log(1.0 / target_delta) / (orders - 1.0)
        return float(np.nanmin(eps)) if not np.all(np.isnan(eps)) else math.inf

    def get_delta(self, target_epsilon: float) -> float:
        rdp, orders = self.rdp, self.orders
        if not np.any(rdp):
            return 0.0
        with np.errstate(over="ignore", invalid="ignore"):
            deltas = np.exp((rdp - target_epsilon) * (orders - 1.0))
        if np.all(np.isnan(deltas)):
            return 1.0
        return float(min(np.nanmin(deltas), 1.0))


# --- bounded PLD: the grid is chosen from (z, q, rounds) so that no call runs without bound -----

# Cost model (measured on the 2-core dev box, dp_accounting 0.6): building one round's PLD costs
# ~2-5 us per grid point and direction (the Gaussian's delta at every point); composing costs one
# FFT of the composed length. 4e5 points build in about 1-2 s; 2^21 points are 32 MiB per complex
# FFT array (~200 MB peak in self_compose) and a Python-speed epsilon scan of ~1-2 s.
PLD_MAX_POINTS = 250_000
PLD_MAX_COMPOSED_POINTS = 2 ** 21
# Finer first; 1e-4 is the historical grid, so every schedule that fits at 1e-4 keeps its numbers.
# The grid is pessimistic at every step, so a coarse grid still gives an upper bound on epsilon;
# past 1 nat per step the grid would say less than RDP for the schedules that need it.
PLD_GRID_LADDER: tuple[float, ...] = (1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.2, 0.5, 1.0)
_TAIL_MASS = 1e-15  # dp_accounting's default tail_mass_truncation for compose / self_compose
_PROBE_POINTS = 8192
_SPARSE_MAX = getattr(pld_pmf, "_MAX_PMF_SPARSE_SIZE", 1000)  # dp_accounting's sparse/dense switch


def _adjacencies(sampling_prob: float, relation: NeighboringRelation) -> tuple:
    adj = pld_mech.AdjacencyType
    if relation is NeighboringRelation.REPLACE_ONE:
        return (adj.REPLACE,)
    return (adj.REMOVE,) if sampling_prob == 1.0 else (adj.REMOVE, adj.ADD)


@lru_cache(maxsize=1024)
def _single_width(noise_multiplier: float, sampling_prob: float, relation: NeighboringRelation) -> float:
    """Width (nats) of one round's privacy-loss grid, per direction: dp_accounting's own
    connect-the-dots bounds, which fix the grid from_gaussian_mechanism builds (closed form, cheap)."""
    widths = []
    for adjacency in _adjacencies(sampling_prob, relation):
        loss = pld_mech.GaussianPrivacyLoss(noise_multiplier, sampling_prob=sampling_prob, adjacency_type=adjacency)
        bounds = loss.connect_dots_bounds()
        widths.append(bounds.epsilon_upper - bounds.epsilon_lower)
    return float(max(widths))


@lru_cache(maxsize=256)
def _probe(noise_multiplier: float, sampling_prob: float, relation: NeighboringRelation):
    """One round's PLD on a grid of ~8k points: enough to bound the width of its T-fold composition."""
    interval = max(PLD_GRID_LADDER[0], _single_width(noise_multiplier, sampling_prob, relation) / _PROBE_POINTS)
    pld = pld_lib.from_gaussian_mechanism(noise_multiplier, value_discretization_interval=interval,
                                          sampling_prob=sampling_prob, neighboring_relation=relation)
    pmfs = [pld._pmf_remove.to_dense_pmf(), pld._pmf_add.to_dense_pmf()]  # pylint: disable=protected-access
    return interval, [pmf._probs for pmf in pmfs]  # pylint: disable=protected-access


def _composed_width(noise_multiplier: float, sampling_prob: float, relation: NeighboringRelation,
                    rounds: int) -> float:
    """Width (nats) that ``self_compose(rounds)`` keeps: dp_accounting's Chernoff truncation bounds,
    evaluated on the coarse probe (the bounds are in nats, nearly independent of the grid)."""
    if rounds == 1:
        return _single_width(noise_multiplier, sampling_prob, relation)
    interval, probs = _probe(noise_multiplier, sampling_prob, relation)
    widths = []
    for p in probs:
        lower, upper = pld_common.compute_self_convolve_bounds(p, rounds, _TAIL_MASS)
        widths.append(upper - lower + 1)
    return float(max(widths)) * interval


def _grid_at_least(interval: float) -> float | None:
    """The finest grid on the ladder that is >= ``interval`` (None: coarser than the ladder)."""
    return next((g for g in PLD_GRID_LADDER if g >= interval * (1 - 1e-12)), None)


def pld_grid(noise_multiplier: float, sampling_prob: float, rounds: int = 1,
             relation: NeighboringRelation = NeighboringRelation.ADD_OR_REMOVE_ONE, *,
             composed_width: float = 0.0, budget: float = 1.0) -> float | None:
    """The value_discretization_interval PLD uses for ``rounds`` rounds of a Poisson-sampled Gaussian,
    or None when no grid on :data:`PLD_GRID_LADDER` keeps the call within its bounds (then: RDP).

    Decided from (z, q, rounds) alone: one round's grid must stay under ``budget`` *
    :data:`PLD_MAX_POINTS` points and the composition (plus ``composed_width`` nats already
    composed) under ``budget`` * :data:`PLD_MAX_COMPOSED_POINTS`; both scale as 1/interval.
    """
    single = _single_width(noise_multiplier, sampling_prob, relation)
    if not math.isfinite(single) or _grid_at_least(single / (budget * PLD_MAX_POINTS)) is None:
        return None  # one round alone is too wide: no need to probe the composition
    total = composed_width + _composed_width(noise_multiplier, sampling_prob, relation, rounds)
    need = max(single / (budget * PLD_MAX_POINTS), total / (budget * PLD_MAX_COMPOSED_POINTS))
    return _grid_at_least(need)


@lru_cache(maxsize=16)  # one entry is up to 2 x 2.5e5 floats (4 MB); 1-4 MB at a 1e-4 interval
def _poisson_gaussian_pld(noise_multiplier: float, sampling_prob: float, relation: NeighboringRelation,
                          value_discretization_interval: float) -> pld_lib.PrivacyLossDistribution:
    # Exactly the call dp_accounting's PLDAccountant makes for a PoissonSampledDpEvent of a Gaussian.
    return pld_lib.from_gaussian_mechanism(
        standard_deviation=noise_multiplier,
        value_discretization_interval=value_discretization_interval,
        sampling_prob=sampling_prob,
        neighboring_relation=relation,
    )


def _self_compose(pld: pld_lib.PrivacyLossDistribution, count: int) -> pld_lib.PrivacyLossDistribution:
    """``pld.self_compose(count)``, minus one trap: a sparse PMF first computes ``size ** count`` as
    an exact integer to decide whether to go dense, which for 10^7 rounds takes minutes. The same
    decision is made here with logarithms and the dense PMFs are handed over ready."""
    # pylint: disable=protected-access
    pmfs = [pld._pmf_remove] if pld._symmetric else [pld._pmf_remove, pld._pmf_add]
    if all(isinstance(p, pld_pmf.DensePLDPmf) or count * math.log(max(p.size, 1)) <= math.log(_SPARSE_MAX)
           for p in pmfs):
        return pld.self_compose(count)
    dense = [p.to_dense_pmf() for p in pmfs]
    return pld_lib.PrivacyLossDistribution(*dense).self_compose(count)


def _regrid(pld: pld_lib.PrivacyLossDistribution, interval: float) -> pld_lib.PrivacyLossDistribution:
    """The same distribution on a coarser grid, every loss rounded *up*: a privacy loss that only
    grows keeps dp_accounting's pessimistic estimate an upper bound (delta(eps) = E[(1 - e^(eps-L))+])."""
    def one(pmf):
        dense = pmf.to_dense_pmf()
        # pylint: disable=protected-access
        losses = (dense._lower_loss + np.arange(dense.size)) * dense._discretization
        index = np.ceil(losses / interval).astype(np.int64)
        probs = np.bincount(index - index[0], weights=dense._probs)
        return pld_pmf.DensePLDPmf(interval, int(index[0]), probs, dense._infinity_mass, True)

    # pylint: disable=protected-access
    remove = one(pld._pmf_remove)
    return pld_lib.PrivacyLossDistribution(remove, None if pld._symmetric else one(pld._pmf_add))


class _BoundedPLDAccountant(dp_accounting.PrivacyAccountant):
    """The PoissonSampled-Gaussian subset of dp_accounting's ``PLDAccountant``, bounded and cached.

    It makes the same dp_accounting calls (``from_gaussian_mechanism``, ``self_compose``,
    ``compose``, ``get_epsilon_for_delta``), but

    * memoises each distinct per-round distribution (~0.4 s each at a 1e-4 interval), so a ledger of
      many similar rounds, a calibration or a budget search is not rebuilt round after round;
    * picks the grid with :func:`pld_grid` before building anything: 1e-4 where that fits (the
      results then equal ``PLDAccountant``'s), a coarser one where it would not; a composition that
      outgrows its grid is moved to a coarser one (losses rounded up, :func:`_regrid`);
    * on a coarse grid also composes the events with dp_accounting's ``RdpAccountant`` and answers
      with the smaller of the two (both are upper bounds; a coarse grid's rounding adds up over
      10^6+ rounds, e.g. z=20.6, q=0.01, 10^7 rounds: 15.1 at 2e-3 against rdp's 7.8);
    * falls back to the ``RdpAccountant`` alone when no grid fits.

    ``accountant_used`` is the accountant behind the last answer, ``note`` says why it is not pld
    on the usual grid. It accepts only what the ledger produces (NoOp, NonPrivate, Composed /
    SelfComposed, PoissonSampled(Gaussian)); anything else is reported as unsupported.
    """

    def __init__(self, neighboring_relation: NeighboringRelation = NeighboringRelation.ADD_OR_REMOVE_ONE,
                 budget: float = 1.0):
        super().__init__(neighboring_relation)
        self._budget = budget
        self._vdi: float | None = None
        self._pld: pld_lib.PrivacyLossDistribution | None = None
        self._events: list[tuple[float, float, int]] = []
        self._rdp: dp_accounting.rdp.RdpAccountant | None = None  # composed once the grid is coarse
        self._fell_back = False
        self._non_private = False
        self._answered = "pld"
        self._why = ""

    @property
    def accountant_used(self) -> str:
        return "rdp" if self._fell_back else self._answered

    @property
    def note(self) -> str:
        if self._fell_back or self._vdi is None or self._vdi <= PLD_VALUE_DISCRETIZATION_INTERVAL:
            return self._why
        if self._answered == "rdp":
            return (f"rdp gave the smaller epsilon: pld needed a {self._vdi:g}-nat grid (not "
                    f"{PLD_VALUE_DISCRETIZATION_INTERVAL:g}) to stay within bounds, and its rounding adds up")
        return (f"pld on a {self._vdi:g}-nat grid (not {PLD_VALUE_DISCRETIZATION_INTERVAL:g}) to stay within "
                "bounds; still an upper bound")

    @property
    def value_discretization_interval(self) -> float:
        return self._vdi or PLD_VALUE_DISCRETIZATION_INTERVAL

    def _maybe_compose(self, event, count, do_compose):
        details = dp_accounting.PrivacyAccountant.CompositionErrorDetails
        if isinstance(event, dpe.NoOpDpEvent):
            return None
        if isinstance(event, dpe.NonPrivateDpEvent):
            if do_compose:
                self._non_private = True
            return None
        if isinstance(event, dpe.SelfComposedDpEvent):
            return self._maybe_compose(event.event, event.count * count, do_compose)
        if isinstance(event, dpe.ComposedDpEvent):
            for e in event.events:
                err = self._maybe_compose(e, count, do_compose)
                if err is not None:
                    return err
            return None
        if isinstance(event, dpe.PoissonSampledDpEvent) and isinstance(event.event, dpe.GaussianDpEvent):
            if do_compose and count > 0 and event.sampling_probability > 0:
                if event.event.noise_multiplier == 0:
                    self._non_private = True
                else:
                    self._add(float(event.event.noise_multiplier), float(event.sampling_probability), int(count))
            return None
        return details(invalid_event=event, error_message="Unsupported event.")

    def _composed_nats(self) -> float:
        if self._pld is None:
            return 0.0
        # pylint: disable=protected-access
        return max(self._pld._pmf_remove.size, self._pld._pmf_add.size) * self._vdi

    def _start_rdp(self) -> None:
        """An RdpAccountant that has composed every event so far (each costs microseconds)."""
        if self._rdp is None:
            self._rdp = dp_accounting.rdp.RdpAccountant(neighboring_relation=self.neighboring_relation)
            for z, q, count in self._events:
                self._rdp.compose(_poisson_gaussian_event(z, q), count)

    def _add(self, z: float, q: float, count: int) -> None:
        self._events.append((z, q, count))
        if self._rdp is not None:
            self._rdp.compose(_poisson_gaussian_event(z, q), count)
        if self._fell_back:
            return
        grid = pld_grid(z, q, count, self.neighboring_relation, composed_width=self._composed_nats(),
                        budget=self._budget)
        if grid is None:
            self._why = (f"pld cannot account z={z:g}, q={q:g} over {count:,} round(s) within "
                         f"{PLD_MAX_COMPOSED_POINTS:,} grid points even at {PLD_GRID_LADDER[-1]:g} nat; "
                         "fell back to rdp")
            self._fell_back, self._pld = True, None
            self._start_rdp()
            return
        grid = max(grid, self._vdi or grid)
        if grid > PLD_VALUE_DISCRETIZATION_INTERVAL:
            self._start_rdp()
        if self._pld is not None and grid > self._vdi:
            self._pld = _regrid(self._pld, grid)
        self._vdi = grid
        one = _poisson_gaussian_pld(z, q, self.neighboring_relation, grid)
        many = _self_compose(one, count) if count > 1 else one
        self._pld = many if self._pld is None else self._pld.compose(many)

    def _smaller(self, pld_value: float, rdp_value: float) -> float:
        self._answered = "rdp" if rdp_value < pld_value else "pld"
        return min(pld_value, rdp_value)

    def get_epsilon(self, target_delta: float) -> float:
        if self._non_private:
            return math.inf
        if self._fell_back:
            return float(self._rdp.get_epsilon(target_delta))
        if self._pld is None:
            return 0.0
        eps = float(self._pld.get_epsilon_for_delta(target_delta))
        return eps if self._rdp is None else self._smaller(eps, float(self._rdp.get_epsilon(target_delta)))

    def get_delta(self, target_epsilon: float) -> float:
        if self._non_private:
            return 1.0
        if self._fell_back:
            return float(self._rdp.get_delta(target_epsilon))
        if self._pld is None:
            return 0.0
        delta = float(self._pld.get_delta_for_epsilon(target_epsilon))
        return delta if self._rdp is None else self._smaller(delta, float(self._rdp.get_delta(target_epsilon)))


_CachedPLDAccountant = _BoundedPLDAccountant  # the name before the bounds came


def _poisson_gaussian_event(z: float, q: float) -> dpe.DpEvent:
    return dpe.PoissonSampledDpEvent(q, dpe.GaussianDpEvent(z))


def _reference_accountant(name: str, relation: NeighboringRelation) -> dp_accounting.PrivacyAccountant:
    """The stock dp_accounting accountant whose ``supports()`` decides what ``name`` can account."""
    if name == "pld":
        return pld_privacy_accountant.PLDAccountant(relation, PLD_VALUE_DISCRETIZATION_INTERVAL)
    if name == "rdp":
        return dp_accounting.rdp.RdpAccountant(neighboring_relation=relation)
    return dp_accounting.rdp.RdpAccountant(orders=CLASSIC_RDP_ORDERS, neighboring_relation=relation)


def _fresh_accountant(name: str, relation: NeighboringRelation, budget: float = 1.0) -> dp_accounting.PrivacyAccountant:
    """A new accountant; for 'pld', ``budget`` scales its point bounds (a search that makes many
    calls gives each a share)."""
    if name == "pld":
        return _BoundedPLDAccountant(relation, budget)
    if name == "rdp":
        return dp_accounting.rdp.RdpAccountant(neighboring_relation=relation)
    return _ClassicRdpAccountant(relation)


def _accountant_details(name: str, accountant: dp_accounting.PrivacyAccountant | None = None) -> dict:
    """What computed the numbers: ``name`` as asked, and for 'pld' the grid it used or its fallback."""
    if name == "pld":
        used = getattr(accountant, "accountant_used", "pld")
        note = getattr(accountant, "note", "")
        if used == "rdp":
            return {"name": "rdp", "implementation": "dp_accounting RdpAccountant (fallback from pld)",
                    "orders": [float(o) for o in rdp_privacy_accountant.DEFAULT_RDP_ORDERS],
                    "conversion": "dp_accounting", "fallback_from": "pld", "note": note}
        interval = getattr(accountant, "value_discretization_interval", PLD_VALUE_DISCRETIZATION_INTERVAL)
        out = {"name": "pld", "implementation": "dp_accounting PLD (pessimistic)",
               "value_discretization_interval": interval}
        return {**out, "note": note} if note else out
    if name == "rdp":
        return {"name": "rdp", "implementation": "dp_accounting RdpAccountant",
                "orders": [float(o) for o in rdp_privacy_accountant.DEFAULT_RDP_ORDERS],
                "conversion": "dp_accounting"}
    return {"name": "rdp-classic", "implementation": "dp_accounting RdpAccountant",
            "orders": [float(o) for o in CLASSIC_RDP_ORDERS],
            "conversion": "classic: eps = min_a rdp(a) + log(1/delta)/(a-1)"}


def _describe_event(event: dpe.DpEvent) -> str:
    if isinstance(event, dpe.SampledWithoutReplacementDpEvent):
        return "fixed-size sampling (SampledWithoutReplacementDpEvent, replace-one relation)"
    if isinstance(event, dpe.PoissonSampledDpEvent):
        return f"Poisson sampling of {type(event.event).__name__}"
    return type(event).__name__


def _accountable(name: str, event: dpe.DpEvent, relation: NeighboringRelation) -> dpe.DpEvent:
    """The event ``name`` composes for ``event``; raises a DPFLError if it cannot.

    For 'pld', several Gaussians under one Poisson sampling (e.g. Andrew et al.'s update plus noised
    clipped count) become the single equivalent Gaussian, with the multiplier computed by
    dp_accounting's own helper (the one its RdpAccountant uses; section 3 of arXiv:1812.06210):
    dp_accounting's PLD accountant has no composed-Gaussian-under-one-sampling event.
    """
    if (name == "pld" and isinstance(event, dpe.PoissonSampledDpEvent)
            and isinstance(event.event, dpe.ComposedDpEvent)):
        sigma = getattr(rdp_privacy_accountant, "_effective_gaussian_noise_multiplier", lambda e: e)(event.event)
        if isinstance(sigma, float):
            event = dp_accounting.PoissonSampledDpEvent(event.sampling_probability,
                                                        dp_accounting.GaussianDpEvent(sigma))
    if not _reference_accountant(name, relation).supports(event):
        hint = "; use accountant 'rdp' or 'rdp-classic'" if name == "pld" else ""
        raise DPFLError(f"{name} cannot account {_describe_event(event)} "
                        f"(dp_accounting's accountant does not support it){hint}", field="accountant")
    return event
