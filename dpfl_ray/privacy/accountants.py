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
    :mod:`dpfl_ray.privacy.bounded_pld`'s accountant, which makes dp_accounting's PLD calls but
    builds each distinct per-round distribution once (0.4 s each at 1e-4) and bounds every call:
    the grid is picked from (z, q, rounds) before anything is built, coarser where 1e-4 would need
    more than :data:`PLD_MAX_POINTS` / :data:`PLD_MAX_COMPOSED_POINTS` points (a tiny z, a huge
    number of rounds; rdp answers there when it gives less), and where no grid on
    :data:`PLD_GRID_LADDER` fits it falls back to 'rdp' and says so (``accountant_used``, ``note``).
    Where 1e-4 fits, the results equal ``PLDAccountant``'s. A round with several Gaussians under one
    sampling is accounted as its single equivalent Gaussian.
``"rdp"``
    dp_accounting's ``RdpAccountant`` with its default orders and its own (improved) conversion.
    Both RDP accountants compute each distinct round's RDP curve once (:class:`_MemoRdpAccountant`):
    dp_accounting recomputes it at every ``compose``, 0.08 s for a Poisson-sampled Gaussian and 0.16 s
    for fixed-size sampling on the default orders, which a 30-round run paid 30 times per track.
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
from typing import Any

import dp_accounting
import numpy as np
from dp_accounting import NeighboringRelation
from dp_accounting import dp_event as dpe
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from dpfl_ray.defaults import DEFAULT_ACCOUNTANT
from dpfl_ray.errors import DPFLError
from dpfl_ray.privacy.bounded_pld import PLD_VALUE_DISCRETIZATION_INTERVAL, _BoundedPLDAccountant

ACCOUNTANTS = ("pld", "rdp", "rdp-classic")
CLASSIC_RDP_ORDERS: tuple[float, ...] = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)))

__all__ = ["ACCOUNTANTS", "DEFAULT_ACCOUNTANT", "PLD_VALUE_DISCRETIZATION_INTERVAL", "CLASSIC_RDP_ORDERS"]


def _check_accountant(name: Any, field: str = "accountant") -> str:
    if name not in ACCOUNTANTS:
        raise DPFLError(f"unknown accountant {name!r}; choose one of {', '.join(ACCOUNTANTS)}", field=field)
    return name


# Events whose RDP curve RdpAccountant adds in a single ``self._rdp += count * curve`` statement;
# adding the memoised curve the same way gives the same floats, bit for bit.
_LEAF_EVENTS = (dpe.GaussianDpEvent, dpe.PoissonSampledDpEvent, dpe.SampledWithoutReplacementDpEvent)


_CURVES: dict[tuple[str, tuple[float, ...], NeighboringRelation], np.ndarray] = {}
_MAX_CURVES = 4096  # one entry: a curve over the orders (~150 floats)


def _rdp_curve(event: dpe.DpEvent, orders: tuple[float, ...], relation: NeighboringRelation) -> np.ndarray:
    """dp_accounting's RDP curve of one supported leaf event: what a stock RdpAccountant holds after
    composing it once (0 + 1 * curve: exactly the curve). Keyed by ``repr`` (a ComposedDpEvent
    inside a sampling event holds a list, so events are not always hashable; attrs' repr is exact
    for floats). Read-only: every accountant of the process shares it."""
    key = (repr(event), orders, relation)
    curve = _CURVES.get(key)
    if curve is None:
        stock = dp_accounting.rdp.RdpAccountant(orders=list(orders), neighboring_relation=relation)
        stock._maybe_compose(event, 1, True)  # pylint: disable=protected-access - support was checked
        curve = stock.rdp
        curve.setflags(write=False)
        if len(_CURVES) >= _MAX_CURVES:
            _CURVES.clear()
        _CURVES[key] = curve
    return curve


def _discrete_curve(event: dpe.DpEvent, orders: tuple[float, ...], relation: NeighboringRelation) -> np.ndarray | None:
    """The RDP curve of an integer-noise sum (privacy/discrete_rdp.py), alone or sampled (Poisson or a
    fixed-size cohort); None for every other event. Cached as :func:`_rdp_curve` caches dp_accounting's."""
    from dpfl_ray.privacy.discrete_rdp import discrete_rdp_of

    sampled = (dpe.PoissonSampledDpEvent, dpe.SampledWithoutReplacementDpEvent)
    inner = event.event if isinstance(event, sampled) else event
    if discrete_rdp_of(inner) is None:
        return None
    key = (repr(event), orders, relation)
    curve = _CURVES.get(key)
    if curve is None:
        from dpfl_ray.privacy.discrete_rdp import event_rdp_curve

        curve = event_rdp_curve(event, orders, relation)
        curve.setflags(write=False)
        if len(_CURVES) >= _MAX_CURVES:
            _CURVES.clear()
        _CURVES[key] = curve
    return curve


class _MemoRdpAccountant(dp_accounting.rdp.RdpAccountant):
    """dp_accounting's RdpAccountant, computing each distinct event's RDP curve once per process.

    It overrides the accountant's composition hook only for the leaf events (a Gaussian, Poisson
    or fixed-size sampling of one) and only to take their curve from :func:`_rdp_curve`; whether an
    event is supported, composite events, and every conversion stay dp_accounting's. The state
    after any sequence of events equals the stock accountant's to the bit (tested).
    """

    def _maybe_compose(self, event, count, do_compose):
        curve = _discrete_curve(event, tuple(float(o) for o in self._orders), self._neighboring_relation)
        if curve is not None:  # integer noise inside SecAgg (privacy/discrete_rdp.py): not a dp_accounting event
            if do_compose:
                self._rdp += count * curve
            return None
        if not (do_compose and isinstance(event, _LEAF_EVENTS)):
            return super()._maybe_compose(event, count, do_compose)
        error = super()._maybe_compose(event, count, False)  # the stock checks (relation, sub-event)
        if error is not None:
            return error
        self._rdp += count * _rdp_curve(event, tuple(float(o) for o in self._orders), self._neighboring_relation)
        return None


class _ClassicRdpAccountant(_MemoRdpAccountant):
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


def _reference_accountant(name: str, relation: NeighboringRelation) -> dp_accounting.PrivacyAccountant:
    """The accountant whose ``supports()`` decides what ``name`` can account."""
    if name == "pld":
        return pld_privacy_accountant.PLDAccountant(relation, PLD_VALUE_DISCRETIZATION_INTERVAL)
    if name == "rdp":  # the memoised accountants support what the stock one does, and the integer-noise sums
        return _MemoRdpAccountant(neighboring_relation=relation)
    return _ClassicRdpAccountant(relation)


def _fresh_accountant(name: str, relation: NeighboringRelation, budget: float = 1.0) -> dp_accounting.PrivacyAccountant:
    """A new accountant; for 'pld', ``budget`` scales its point bounds (a search that makes many
    calls gives each a share)."""
    if name == "pld":
        return _BoundedPLDAccountant(relation, budget)
    if name == "rdp":
        return _MemoRdpAccountant(neighboring_relation=relation)
    return _ClassicRdpAccountant(relation)


def accountant_state(accountant: dp_accounting.PrivacyAccountant) -> tuple[dict, dict[str, np.ndarray]]:
    """What :func:`restore_accountant` rebuilds ``accountant`` from, bit for bit: ``(meta, arrays)``."""
    if isinstance(accountant, _BoundedPLDAccountant):
        return accountant.state()
    if isinstance(accountant, _MemoRdpAccountant):  # its orders are its class's: the curve is its state
        return {"type": "rdp"}, {"rdp": np.array(accountant._rdp, dtype=np.float64)}  # pylint: disable=protected-access
    raise TypeError(f"no saved state for {type(accountant).__name__}")


def restore_accountant(name: str, relation: NeighboringRelation, meta: dict,
                       arrays: dict[str, np.ndarray]) -> dp_accounting.PrivacyAccountant:
    """The accountant ``name`` as :func:`accountant_state` saved it."""
    if name == "pld":
        return _BoundedPLDAccountant.from_state(relation, meta, arrays)
    accountant = _fresh_accountant(name, relation)
    saved = np.array(arrays["rdp"], dtype=np.float64)
    if saved.shape != accountant._rdp.shape:  # pylint: disable=protected-access
        raise DPFLError(f"a saved {name} state has {saved.size} orders, not {accountant._rdp.size}",  # pylint: disable=protected-access
                        field="checkpoint")
    accountant._rdp = saved  # pylint: disable=protected-access
    return accountant


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
