"""Which dp_accounting accountant composes the ledger's events, and whether it can.

Every privacy number comes from Google's ``dp_accounting`` package; the one formula written out
here is the 'rdp-classic' RDP -> (epsilon, delta) conversion (see below).

Accountants (``accountant=``)
-----------------------------
``"pld"`` (the default)
    Privacy-loss-distribution accounting with dp_accounting's PLD code, pessimistic estimates,
    ``value_discretization_interval`` = :data:`PLD_VALUE_DISCRETIZATION_INTERVAL` = 1e-4. 1e-4 keeps
    epsilon stable to two decimals out to 10^5 rounds of z=1, q=0.01 (1e-3 is about 0.02 off there)
    and, being pessimistic, is always an upper bound. The tightest of the three. The ledger composes
    with :class:`_CachedPLDAccountant`, which makes dp_accounting's PLD calls but builds each distinct
    per-round distribution once (0.4 s each at 1e-4); the results equal ``PLDAccountant``'s. A round
    with several Gaussians under one sampling is accounted as its single equivalent Gaussian.
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
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.pld import privacy_loss_distribution as pld_lib
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


@lru_cache(maxsize=32)  # one entry is 1-4 MB at a 1e-4 interval
def _poisson_gaussian_pld(noise_multiplier: float, sampling_prob: float, relation: NeighboringRelation,
                          value_discretization_interval: float) -> pld_lib.PrivacyLossDistribution:
    # Exactly the call dp_accounting's PLDAccountant makes for a PoissonSampledDpEvent of a Gaussian.
    return pld_lib.from_gaussian_mechanism(
        standard_deviation=noise_multiplier,
        value_discretization_interval=value_discretization_interval,
        sampling_prob=sampling_prob,
        neighboring_relation=relation,
    )


class _CachedPLDAccountant(dp_accounting.PrivacyAccountant):
    """The PoissonSampled-Gaussian subset of dp_accounting's ``PLDAccountant``, with a cache.

    ``PLDAccountant.compose`` rebuilds the per-round PLD on every call (~0.4 s at a 1e-4 interval),
    which makes a ledger of many similar rounds, a calibration search or a budget search slow. This
    class makes the same dp_accounting calls (``from_gaussian_mechanism`` with the sampling
    probability, ``self_compose``, ``compose``, ``get_epsilon_for_delta``) but memoises the
    per-round distribution. It accepts only what the ledger produces (NoOp, NonPrivate, Composed /
    SelfComposed, PoissonSampled(Gaussian)); anything else is reported as unsupported.
    """

    def __init__(self, neighboring_relation: NeighboringRelation = NeighboringRelation.ADD_OR_REMOVE_ONE,
                 value_discretization_interval: float = PLD_VALUE_DISCRETIZATION_INTERVAL):
        super().__init__(neighboring_relation)
        self._vdi = value_discretization_interval
        self._pld: pld_lib.PrivacyLossDistribution | None = None
        self._non_private = False

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
                    one = _poisson_gaussian_pld(float(event.event.noise_multiplier),
                                                float(event.sampling_probability),
                                                self.neighboring_relation, self._vdi)
                    many = one.self_compose(count) if count > 1 else one
                    self._pld = many if self._pld is None else self._pld.compose(many)
            return None
        return details(invalid_event=event, error_message="Unsupported event.")

    def get_epsilon(self, target_delta: float) -> float:
        if self._non_private:
            return math.inf
        if self._pld is None:
            return 0.0
        return float(self._pld.get_epsilon_for_delta(target_delta))

    def get_delta(self, target_epsilon: float) -> float:
        if self._non_private:
            return 1.0
        if self._pld is None:
            return 0.0
        return float(self._pld.get_delta_for_epsilon(target_epsilon))


def _reference_accountant(name: str, relation: NeighboringRelation) -> dp_accounting.PrivacyAccountant:
    """The stock dp_accounting accountant whose ``supports()`` decides what ``name`` can account."""
    if name == "pld":
        return pld_privacy_accountant.PLDAccountant(relation, PLD_VALUE_DISCRETIZATION_INTERVAL)
    if name == "rdp":
        return dp_accounting.rdp.RdpAccountant(neighboring_relation=relation)
    return dp_accounting.rdp.RdpAccountant(orders=CLASSIC_RDP_ORDERS, neighboring_relation=relation)


def _fresh_accountant(name: str, relation: NeighboringRelation) -> dp_accounting.PrivacyAccountant:
    if name == "pld":
        return _CachedPLDAccountant(relation, PLD_VALUE_DISCRETIZATION_INTERVAL)
    if name == "rdp":
        return dp_accounting.rdp.RdpAccountant(neighboring_relation=relation)
    return _ClassicRdpAccountant(relation)


def _accountant_details(name: str) -> dict:
    if name == "pld":
        return {"name": "pld", "implementation": "dp_accounting PLD (pessimistic)",
                "value_discretization_interval": PLD_VALUE_DISCRETIZATION_INTERVAL}
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
