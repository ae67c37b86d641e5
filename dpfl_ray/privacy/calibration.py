"""Fixed schedules -- the same event every round: epsilon, delta, rounds within a budget, and the
noise multiplier for a target epsilon."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import dp_accounting
from dp_accounting import dp_event as dpe

from dpfl_ray.defaults import DEFAULT_ACCOUNTANT, DEFAULT_MAX_ROUNDS
from dpfl_ray.errors import DPFLError
from dpfl_ray.privacy.accountants import _accountable, _check_accountant, _fresh_accountant
from dpfl_ray.privacy.bounded_pld import PLD_VALUE_DISCRETIZATION_INTERVAL, pld_grid
from dpfl_ray.privacy.sampling import Sampling, _multipliers, _round_event, as_sampling, effective_noise_multiplier
from dpfl_ray.privacy.validation import _check_delta, _check_dropout, _check_epsilon, _check_int, _check_rounds

# A calibration makes ~12 accountant calls; each gets this share of one call's point bounds, which
# still keeps 1e-4 (and so the historical numbers) for z >= ~0.7 at q = 0.01.
CALIBRATION_BUDGET = 0.45
# Where even the RDP answer needs a coarse PLD grid (a tiny z, 10^6+ rounds, delta near 1) epsilon
# barely depends on the grid (z=0.05, q=0.01, 100 rounds: 1464.0 at 1e-3 and at 0.1), while an
# epsilon near delta=1 scans the whole distribution in Python: a smaller share keeps it to seconds.
COARSE_CALIBRATION_BUDGET = 0.1

__all__ = ["AccountingPlan", "EpsilonCurve", "NoiseCalibration", "epsilon_for", "delta_for",
           "calibrate_noise", "calibrate_noise_multiplier", "check_accounting_feasible", "rounds_within_budget"]


def _used(name: str, accountant) -> tuple[str, str]:
    """(the accountant that answered, why it differs from ``name`` or runs on a coarse grid)."""
    return getattr(accountant, "accountant_used", name), getattr(accountant, "note", "")


class EpsilonCurve:
    """Epsilon after T identical rounds, as a function of T, memoised.

    Each T is one dp_accounting composition with ``count=T`` (for 'pld' a ``self_compose`` of the
    cached one-round distribution), so a table or a search over T costs one composition per point.
    """

    def __init__(self, noise_multiplier: float | Sequence[float], sampling: Sampling | float,
                 delta: float | None, accountant: str = DEFAULT_ACCOUNTANT, dropout_rate: float = 0.0):
        self.accountant = _check_accountant(accountant)
        self.sampling = as_sampling(sampling)
        self.delta = None if delta is None else _check_delta(delta)
        self.dropout_rate = _check_dropout(dropout_rate)
        zs = _multipliers(noise_multiplier, "noise_multiplier")
        assert zs is not None
        self.noise_multipliers = zs
        self.effective_multipliers = tuple(effective_noise_multiplier(z, self.dropout_rate) for z in zs)
        relation = self.sampling.neighboring_relation
        self.event = _accountable(self.accountant, _round_event(self.effective_multipliers, self.sampling), relation)
        self._relation = relation
        self._cache: dict[int, float] = {}
        self._used: dict[int, tuple[str, str]] = {}

    def _accountant_after(self, rounds: int) -> dp_accounting.PrivacyAccountant:
        return _fresh_accountant(self.accountant, self._relation).compose(self.event, rounds)

    @property
    def accountants_used(self) -> dict[int, tuple[str, str]]:
        """(accountant, note) behind every epsilon computed so far, by number of rounds."""
        return dict(self._used)

    def accountant_used(self, rounds: int) -> tuple[str, str]:
        """(accountant, note) behind :meth:`epsilon` (rounds): 'rdp' where 'pld' fell back; the note
        says why, or which coarser grid 'pld' used ('' when nothing changed)."""
        if rounds not in self._used:
            self.epsilon(rounds)
        return self._used[rounds]

    def epsilon(self, rounds: int) -> float:
        rounds = _check_rounds(rounds)
        if self.delta is None:
            raise DPFLError("this curve was built without a delta", field="delta")
        if rounds not in self._cache:
            acc = self._accountant_after(rounds)
            self._cache[rounds] = float(acc.get_epsilon(self.delta))
            self._used[rounds] = _used(self.accountant, acc)
        return self._cache[rounds]

    def delta_at(self, rounds: int, epsilon: float) -> float:
        rounds, epsilon = _check_rounds(rounds), _check_epsilon(epsilon)
        return float(min(self._accountant_after(rounds).get_delta(epsilon), 1.0))

    def max_rounds(self, epsilon_budget: float, max_rounds: int = DEFAULT_MAX_ROUNDS) -> int:
        """The largest T <= max_rounds with epsilon(T) <= budget (0 if one round already exceeds it).

        A bracketing search on the integers in which every probe is an accountant evaluation.
        epsilon(T) is smooth and close to a power of T, so the next probe is the root of an inverse
        quadratic interpolation of log T against log epsilon through the three evaluated points
        nearest the budget (secant, then bisection, as fallbacks), rounded to the integer that
        closes the bracket; after 8 such probes it bisects. The result satisfies
        epsilon(T) <= budget < epsilon(T+1), both evaluated.
        """
        budget = _check_epsilon(epsilon_budget, "budget")
        max_rounds = _check_int(max_rounds, "max_rounds", 1)
        lo = max((t for t, e in self._cache.items() if e <= budget and t <= max_rounds), default=None)
        if lo is None:
            if self.epsilon(1) > budget:
                return 0
            lo = 1
        hi = min((t for t, e in self._cache.items() if e > budget and t > lo), default=None)
        while hi is None:
            t = min(lo * 10, max_rounds)
            if self.epsilon(t) > budget:
                hi = t
            elif t == max_rounds:
                return max_rounds
            else:
                lo = t
        probes = 0
        while hi - lo > 1:
            root = self._interpolated_root(budget, lo, hi) if probes < 8 else None
            if root is None:
                t = int(round(math.sqrt(lo * hi))) if hi > 4 * lo else (lo + hi) // 2
            else:
                t = int(math.floor(root))
            t = min(max(t, lo + 1), hi - 1)
            probes += 1
            if self.epsilon(t) <= budget:
                lo = t
            else:
                hi = t
        return lo

    def _interpolated_root(self, budget: float, lo: int, hi: int) -> float | None:
        pts = sorted(((math.log(e), math.log(t)) for t, e in self._cache.items()
                      if 0 < e < math.inf), key=lambda p: abs(p[0] - math.log(budget)))
        y0 = math.log(budget)
        for k in (3, 2):
            if len(pts) < k:
                continue
            sel = pts[:k]
            ys = [p[0] for p in sel]
            if len(set(ys)) < k:
                continue
            # Lagrange interpolation of log T as a function of log epsilon, evaluated at log budget
            x = 0.0
            for i, (yi, xi) in enumerate(sel):
                w = 1.0
                for j, (yj, _) in enumerate(sel):
                    if j != i:
                        w *= (y0 - yj) / (yi - yj)
                x += w * xi
            if math.log(lo) < x < math.log(hi) + 1e-12:
                root = math.exp(x)
                if lo < root < hi:
                    return root
        return None


def epsilon_for(noise_multiplier: float | Sequence[float], sampling: Sampling | float, rounds: int,
                delta: float, accountant: str = DEFAULT_ACCOUNTANT, dropout_rate: float = 0.0) -> float:
    """Epsilon after ``rounds`` identical rounds.

    ``sampling``: a Poisson rate q, :class:`PoissonSampling` or :class:`FixedSizeSampling`.
    ``dropout_rate`` R: each round's surviving multiplier is ``z * sqrt(1 - R)`` (Baek et al. IV.B).
    """
    curve = EpsilonCurve(noise_multiplier, sampling, delta, accountant, dropout_rate)
    return curve.epsilon(_check_rounds(rounds))


def delta_for(noise_multiplier: float | Sequence[float], sampling: Sampling | float, rounds: int,
              epsilon: float, accountant: str = DEFAULT_ACCOUNTANT, dropout_rate: float = 0.0) -> float:
    """The delta that ``rounds`` identical rounds satisfy at ``epsilon``."""
    _check_epsilon(epsilon)
    curve = EpsilonCurve(noise_multiplier, sampling, None, accountant, dropout_rate)
    return curve.delta_at(_check_rounds(rounds), epsilon)


def rounds_within_budget(noise_multiplier: float | Sequence[float], sampling: Sampling | float,
                         epsilon_budget: float, delta: float, accountant: str = DEFAULT_ACCOUNTANT,
                         dropout_rate: float = 0.0, max_rounds: int = DEFAULT_MAX_ROUNDS) -> int:
    """The most rounds whose epsilon stays <= ``epsilon_budget`` (capped at ``max_rounds``)."""
    curve = EpsilonCurve(noise_multiplier, sampling, delta, accountant, dropout_rate)
    return curve.max_rounds(epsilon_budget, max_rounds)


@dataclass(frozen=True)
class NoiseCalibration:
    """The calibrated multiplier, the epsilon it gives, and which accountant gave it."""

    noise_multiplier: float
    epsilon: float
    accountant: str
    accountant_used: str
    note: str = ""


def _bracket(eps, target: float, rounds: int, start: float, shrink: float = 0.5) -> tuple[float, float]:
    """[lo, hi] with eps(lo) > target >= eps(hi), by doubling from ``start``, then stepping down:
    first by ``shrink``, then by halves."""
    hi = start
    while eps(hi) > target:
        hi *= 2.0
        if hi > 1e6:
            raise DPFLError(f"no noise multiplier up to 1e6 reaches epsilon {target:g} after {rounds} rounds",
                            field="epsilon")
    lo = hi * shrink
    while eps(lo) <= target:
        hi, lo = lo, lo / 2.0
        if lo < 1e-4:
            raise DPFLError(f"epsilon {target:g} is met even with a noise multiplier below 1e-4",
                            field="epsilon")
    return lo, hi


def calibrate_noise(target_epsilon: float, delta: float, sampling: Sampling | float, rounds: int,
                    accountant: str = DEFAULT_ACCOUNTANT, tol: float = 1e-5) -> NoiseCalibration:
    """The smallest noise multiplier (within ``tol``; for 'pld', ``tol`` relative to the rdp answer it
    starts from) whose epsilon after ``rounds`` rounds is <= target.

    Uses ``dp_accounting.calibrate_dp_mechanism`` (Brent's method), which never returns a value
    above the target; the bracket is found first so that z -> 0 (epsilon -> inf) never enters the
    root finder. For 'pld' the search starts from the 'rdp' answer (milliseconds, and PLD needs no
    more noise than RDP), and every PLD call gets :data:`CALIBRATION_BUDGET` of the usual point
    bounds (:data:`COARSE_CALIBRATION_BUDGET` where the rdp answer already needs a coarse grid), so
    the whole search stays bounded; ``epsilon`` is computed under the same bounds, and
    ``accountant_used`` / ``note`` say where rdp answered and why.
    """
    target = _check_epsilon(target_epsilon, "epsilon")
    delta = _check_delta(delta)
    samp = as_sampling(sampling)
    rounds = _check_rounds(rounds)
    name = _check_accountant(accountant)
    tol = _check_epsilon(tol, "tol")
    relation = samp.neighboring_relation
    _accountable(name, _round_event((1.0,), samp), relation)
    budget = CALIBRATION_BUDGET if name == "pld" else 1.0

    def make_event(z: float) -> dpe.DpEvent:
        return dp_accounting.SelfComposedDpEvent(_round_event((float(z),), samp), rounds)

    def make_accountant() -> dp_accounting.PrivacyAccountant:
        return _fresh_accountant(name, relation, budget)

    seen: dict[float, float] = {}

    def eps(z: float) -> float:
        if z not in seen:
            seen[z] = make_accountant().compose(make_event(z)).get_epsilon(delta)
        return seen[z]

    start, shrink = 1.0, 0.5
    if name == "pld":
        start = calibrate_noise(target, delta, samp, rounds, "rdp", tol).noise_multiplier
        # PLD's answer is usually a little below RDP's (over 1e7 rounds its grid's rounding can put
        # it above; the bracket then steps up), so search close to it, to ``tol`` relative to it:
        # an absolute 1e-5 on z = 135 (1e7 rounds at epsilon 1) took 42 PLD accountants, 13 s
        shrink, tol = 0.8, tol * max(1.0, start)
        planned = _accountable(name, _round_event((start,), samp), relation)
        if pld_grid(planned.event.noise_multiplier, planned.sampling_probability, rounds, relation,
                    budget=budget) != PLD_VALUE_DISCRETIZATION_INTERVAL:
            budget = COARSE_CALIBRATION_BUDGET
    lo, hi = _bracket(eps, target, rounds, start, shrink)
    z = float(dp_accounting.calibrate_dp_mechanism(
        make_accountant, make_event, target, delta,
        bracket_interval=dp_accounting.ExplicitBracketInterval(lo, hi), tol=tol))
    final = make_accountant().compose(make_event(z))
    epsilon = float(final.get_epsilon(delta))
    used, note = _used(name, final)
    if name == "pld" and epsilon < 0.99 * target:
        # eps(z) jumps where pld's bounds end (below: rdp, which needs more noise); say why z is not tight
        note = "; ".join(filter(None, [note, f"pld cannot account a smaller z within its bounds, and rdp "
                                              f"needs more noise for epsilon {target:g}"]))
    return NoiseCalibration(z, epsilon, name, used, note)


def calibrate_noise_multiplier(target_epsilon: float, delta: float, sampling: Sampling | float, rounds: int,
                               accountant: str = DEFAULT_ACCOUNTANT, tol: float = 1e-5) -> float:
    """:func:`calibrate_noise`'s multiplier alone."""
    return calibrate_noise(target_epsilon, delta, sampling, rounds, accountant, tol).noise_multiplier


@dataclass(frozen=True)
class AccountingPlan:
    """What accounts a planned run: the accountant asked for, the one that will answer, and why."""

    accountant: str
    accountant_used: str
    value_discretization_interval: float | None = None
    note: str = ""

    @property
    def fallback(self) -> bool:
        return self.accountant_used != self.accountant


def check_accounting_feasible(accountant: str, noise_multipliers: float | Sequence[float],
                              sampling: Sampling | float, rounds: int, delta: float) -> AccountingPlan:
    """Before a run starts: can ``accountant`` account ``rounds`` rounds of this mechanism within
    bounds? Decided from (z, q, rounds) alone, with the rule the ledger's accountant applies
    (:func:`~dpfl_ray.privacy.bounded_pld.pld_grid`), so nothing is built or timed here.

    Raises a DPFLError for settings no accountant can take (e.g. 'pld' with fixed-size cohorts);
    returns the plan otherwise, with ``accountant_used`` 'rdp' where 'pld' would fall back.
    """
    name = _check_accountant(accountant)
    samp = as_sampling(sampling)
    rounds = _check_rounds(rounds)
    _check_delta(delta)
    zs = _multipliers(noise_multipliers, "noise_multiplier")
    if zs is None:
        raise DPFLError("needs at least one noise multiplier", field="noise_multiplier")
    event = _accountable(name, _round_event(zs, samp), samp.neighboring_relation)
    if name != "pld" or not isinstance(event, dpe.PoissonSampledDpEvent):
        return AccountingPlan(name, name)
    z, q = float(event.event.noise_multiplier), float(event.sampling_probability)
    grid = pld_grid(z, q, rounds, samp.neighboring_relation)
    if grid is None:
        return AccountingPlan(name, "rdp", None, (
            f"pld cannot account z={z:g}, q={q:g} over {rounds:,} rounds within its bounds (a tiny noise "
            "multiplier or a huge number of rounds); accounting with rdp instead"))
    note = "" if grid <= PLD_VALUE_DISCRETIZATION_INTERVAL else (
        f"pld accounts z={z:g}, q={q:g} over {rounds:,} rounds on a {grid:g}-nat grid (not "
        f"{PLD_VALUE_DISCRETIZATION_INTERVAL:g}) to stay within bounds; where rdp gives less, rdp answers")
    return AccountingPlan(name, "pld", grid, note)
