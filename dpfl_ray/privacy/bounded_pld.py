"""Bounded PLD accounting (issue #16): dp_accounting's PLD calls with a cost fixed in advance.

A tiny noise multiplier or 10^6+ rounds make dp_accounting's privacy-loss distribution grow without
bound (z=0.01: >3.6 GB and minutes). Here the grid is decided from (z, q, rounds) before anything is
built (:func:`pld_grid`); a coarse grid's answer is compared with RDP's, and where no grid fits the
accountant falls back to RDP -- and says so. See :class:`_BoundedPLDAccountant`.
"""
from __future__ import annotations

import math
from functools import lru_cache

import dp_accounting
import numpy as np
from dp_accounting import NeighboringRelation
from dp_accounting import dp_event as dpe
from dp_accounting.pld import common as pld_common
from dp_accounting.pld import pld_pmf
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.pld import privacy_loss_mechanism as pld_mech

PLD_VALUE_DISCRETIZATION_INTERVAL = 1e-4

# Cost model (measured on the 2-core dev box, dp_accounting 0.6): building one round's PLD costs
# ~2-5 us per grid point and direction (the Gaussian's delta at every point): 2.5e5 points, 1-2 s.
# Composing costs FFTs of the composed length: 2^20 points are 16 MiB per complex array, ~100 MB
# at the peak of a self_compose, and scipy keeps up to 16 FFT plans of such lengths (~16 MiB each)
# in a long-lived process; the Python-speed epsilon scan over them takes ~1 s at delta near 1.
PLD_MAX_POINTS = 250_000
PLD_MAX_COMPOSED_POINTS = 2 ** 20
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


    # --- state, for a checkpoint ----------------------------------------------------------------
    # A resumed run continues from the composed distribution itself: composing its rounds again
    # costs what the live run spent on them (~0.1 s a round at 1e-4), and only the same calls in the
    # same order give the same floats. Every value is kept exactly (float64 arrays, JSON floats).

    def state(self) -> tuple[dict, dict[str, np.ndarray]]:
        """``(meta, arrays)``: JSON-able values and float/int arrays that :meth:`from_state` rebuilds
        this accountant from, bit for bit."""
        meta = {"type": "pld", "budget": self._budget, "vdi": self._vdi, "fell_back": self._fell_back,
                "non_private": self._non_private, "answered": self._answered, "why": self._why,
                "rdp": self._rdp is not None, "pld": None}
        events = np.array(self._events, dtype=np.float64).reshape(-1, 3)
        arrays = {"events_zq": events[:, :2].copy(), "events_count": events[:, 2].astype(np.int64)}
        if self._rdp is not None:
            arrays["rdp"] = np.array(self._rdp._rdp, dtype=np.float64)  # pylint: disable=protected-access
        if self._pld is not None:
            # pylint: disable=protected-access
            pmfs = {"remove": self._pld._pmf_remove} if self._pld._symmetric else \
                {"remove": self._pld._pmf_remove, "add": self._pld._pmf_add}
            meta["pld"] = {}
            for side, pmf in pmfs.items():
                meta["pld"][side], side_arrays = _pmf_state(pmf)
                arrays.update({f"{side}.{k}": v for k, v in side_arrays.items()})
        return meta, arrays

    @classmethod
    def from_state(cls, neighboring_relation: NeighboringRelation, meta: dict,
                   arrays: dict[str, np.ndarray]) -> "_BoundedPLDAccountant":
        acc = cls(neighboring_relation, float(meta["budget"]))
        acc._vdi = None if meta["vdi"] is None else float(meta["vdi"])
        acc._fell_back, acc._non_private = bool(meta["fell_back"]), bool(meta["non_private"])
        acc._answered, acc._why = str(meta["answered"]), str(meta["why"])
        counts = np.asarray(arrays["events_count"], dtype=np.int64)
        zq = np.asarray(arrays["events_zq"], dtype=np.float64).reshape(len(counts), 2)
        acc._events = [(float(z), float(q), int(c)) for (z, q), c in zip(zq, counts)]
        if meta["rdp"]:
            acc._rdp = dp_accounting.rdp.RdpAccountant(neighboring_relation=neighboring_relation)
            acc._rdp._rdp = np.array(arrays["rdp"], dtype=np.float64)  # pylint: disable=protected-access
        if meta["pld"] is not None:
            pmfs = {side: _pmf_from_state(m, {k.split(".", 1)[1]: v for k, v in arrays.items()
                                              if k.startswith(side + ".")})
                    for side, m in meta["pld"].items()}
            acc._pld = pld_lib.PrivacyLossDistribution(pmfs["remove"], pmfs.get("add"))
        return acc


def _pmf_state(pmf) -> tuple[dict, dict[str, np.ndarray]]:
    # pylint: disable=protected-access
    meta = {"discretization": pmf._discretization, "infinity_mass": pmf._infinity_mass,
            "pessimistic": pmf._pessimistic_estimate}
    if isinstance(pmf, pld_pmf.DensePLDPmf):
        return {**meta, "dense": True, "lower_loss": int(pmf._lower_loss)}, {"probs": np.array(pmf._probs, np.float64)}
    # a sparse PMF's dict order is the order its compositions sum in: kept
    losses, probs = zip(*pmf._loss_probs.items()) if pmf._loss_probs else ((), ())
    return {**meta, "dense": False}, {"losses": np.array(losses, dtype=np.int64),
                                      "probs": np.array(probs, dtype=np.float64)}


def _pmf_from_state(meta: dict, arrays: dict[str, np.ndarray]):
    disc, inf_mass, pess = float(meta["discretization"]), float(meta["infinity_mass"]), bool(meta["pessimistic"])
    if meta["dense"]:
        return pld_pmf.DensePLDPmf(disc, int(meta["lower_loss"]), np.array(arrays["probs"], dtype=np.float64),
                                   inf_mass, pess)
    loss_probs = {int(k): float(v) for k, v in zip(arrays["losses"], arrays["probs"])}
    return pld_pmf.SparsePLDPmf(loss_probs, disc, inf_mass, pess)


_CachedPLDAccountant = _BoundedPLDAccountant  # the name before the bounds came


def _poisson_gaussian_event(z: float, q: float) -> dpe.DpEvent:
    return dpe.PoissonSampledDpEvent(q, dpe.GaussianDpEvent(z))
