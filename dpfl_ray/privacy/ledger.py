"""Privacy accounting: a per-round ledger of dp_accounting events, and the closed-form helpers.

Every privacy number here comes from Google's ``dp_accounting`` package; this module only decides
*which* ``DpEvent`` describes a round and *which* accountant composes it. The one formula written out
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

Sampling and neighbouring relations
-----------------------------------
:class:`PoissonSampling` (each client joins a round independently with probability ``rate``) is
accounted as ``PoissonSampledDpEvent`` under the **add/remove-one-client** relation.
:class:`FixedSizeSampling` (a uniformly random cohort of exactly ``m`` of the ``K`` clients) is
accounted as ``SampledWithoutReplacementDpEvent`` under the **replace-one-client** relation. The two
epsilons are not comparable, so one ledger never mixes them, and an accountant that cannot handle an
event (dp_accounting's PLD accountant and fixed-size cohorts, for one) is refused with a
:class:`~dpfl_ray.errors.DPFLError` naming the ``accountant`` field.

Rounds not covered by the DP guarantee
--------------------------------------
``record_round(..., covered=False)`` marks a round whose release is not differentially private as
implemented (e.g. Geyer et al.'s median-norm clipping: the clipping bound depends on the data). The
round keeps its nominal event (what it would be with a data-independent bound) for the record and
the *claimed* epsilon, but the *effective* accounting composes it as dp_accounting's
``NonPrivateDpEvent``: :meth:`PrivacyLedger.epsilon` is then ``inf`` and
:meth:`PrivacyLedger.delta_for_epsilon` is 1 -- the number itself says that there is no guarantee. ``fully_covered`` and
``uncovered_rounds`` tell which rounds broke it, and ``epsilon(covered_only=True)`` gives the epsilon
of the covered rounds alone (a statement about those rounds only, not about the run).
"""
from __future__ import annotations

import itertools
import math
import numbers
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Sequence, Union

import attr
import dp_accounting
import numpy as np
from dp_accounting import dp_event as dpe
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.rdp import rdp_privacy_accountant

from dpfl_ray.errors import DPFLError

NeighboringRelation = dp_accounting.NeighboringRelation

ACCOUNTANTS = ("pld", "rdp", "rdp-classic")
DEFAULT_ACCOUNTANT = "pld"
PLD_VALUE_DISCRETIZATION_INTERVAL = 1e-4
CLASSIC_RDP_ORDERS: tuple[float, ...] = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)))
DEFAULT_MAX_ROUNDS = 10**7

__all__ = [
    "ACCOUNTANTS", "DEFAULT_ACCOUNTANT", "PLD_VALUE_DISCRETIZATION_INTERVAL", "CLASSIC_RDP_ORDERS",
    "PoissonSampling", "FixedSizeSampling", "Sampling", "as_sampling",
    "RoundRecord", "PrivacyLedger", "EpsilonCurve",
    "epsilon_for", "delta_for", "calibrate_noise_multiplier", "rounds_within_budget",
    "effective_noise_multiplier", "event_to_dict",
]


# ----------------------------------------------------------------------------------------------------
# Validation


def _is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _check_real(x: Any, field: str) -> float:
    if not _is_real(x) or not math.isfinite(float(x)):
        raise DPFLError(f"must be a finite number, got {x!r}", field=field)
    return float(x)


def _check_int(x: Any, field: str, minimum: int) -> int:
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        if _is_real(x) and float(x).is_integer():
            x = int(x)
        else:
            raise DPFLError(f"must be an integer, got {x!r}", field=field)
    if int(x) < minimum:
        raise DPFLError(f"must be >= {minimum}, got {x}", field=field)
    return int(x)


def _check_rate(q: Any, field: str = "sampling_rate") -> float:
    q = _check_real(q, field)
    if not 0.0 < q <= 1.0:
        raise DPFLError(f"must be in (0, 1], got {q:g}", field=field)
    return q


def _check_noise(z: Any, field: str = "noise_multiplier") -> float:
    z = _check_real(z, field)
    if z <= 0.0:
        raise DPFLError(f"must be > 0, got {z:g}", field=field)
    return z


def _check_delta(delta: Any, field: str = "delta") -> float:
    delta = _check_real(delta, field)
    if not 0.0 < delta < 1.0:
        raise DPFLError(f"must be in (0, 1), got {delta:g}", field=field)
    return delta


def _check_epsilon(eps: Any, field: str = "epsilon") -> float:
    eps = _check_real(eps, field)
    if eps <= 0.0:
        raise DPFLError(f"must be > 0, got {eps:g}", field=field)
    return eps


def _check_rounds(rounds: Any, field: str = "rounds") -> int:
    return _check_int(rounds, field, 1)


def _check_dropout(rate: Any, field: str = "dropout_rate") -> float:
    rate = _check_real(rate, field)
    if not 0.0 <= rate < 1.0:
        raise DPFLError(f"must be in [0, 1), got {rate:g}", field=field)
    return rate


def _check_accountant(name: Any, field: str = "accountant") -> str:
    if name not in ACCOUNTANTS:
        raise DPFLError(f"unknown accountant {name!r}; choose one of {', '.join(ACCOUNTANTS)}", field=field)
    return name


# ----------------------------------------------------------------------------------------------------
# Sampling


@dataclass(frozen=True)
class PoissonSampling:
    """Each client takes part in a round independently with probability ``rate`` in (0, 1].

    Accounted as dp_accounting's ``PoissonSampledDpEvent`` under the add/remove-one-client
    neighbouring relation (``NeighboringRelation.ADD_OR_REMOVE_ONE``).
    """

    rate: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "rate", _check_rate(self.rate, "sampling_rate"))

    neighboring_relation = NeighboringRelation.ADD_OR_REMOVE_ONE

    def wrap(self, inner: dpe.DpEvent) -> dpe.DpEvent:
        return dp_accounting.PoissonSampledDpEvent(sampling_probability=self.rate, event=inner)

    def to_dict(self) -> dict:
        return {"kind": "poisson", "rate": self.rate, "neighboring_relation": "add_or_remove_one"}

    def describe(self) -> str:
        return f"Poisson sampling q={self.rate:g}"


@dataclass(frozen=True)
class FixedSizeSampling:
    """A uniformly random cohort of exactly ``clients_per_round`` of the ``num_clients`` clients.

    Accounted as dp_accounting's ``SampledWithoutReplacementDpEvent`` under the replace-one-client
    neighbouring relation (``NeighboringRelation.REPLACE_ONE``): the population size is public and a
    neighbouring population swaps one client's data for another's. ``clients_per_round=0`` (nobody
    sampled) is allowed and releases nothing.
    """

    clients_per_round: int
    num_clients: int

    def __post_init__(self) -> None:
        k = _check_int(self.num_clients, "num_clients", 1)
        m = _check_int(self.clients_per_round, "clients_per_round", 0)
        if m > k:
            raise DPFLError(f"must be <= num_clients ({k}), got {m}", field="clients_per_round")
        object.__setattr__(self, "num_clients", k)
        object.__setattr__(self, "clients_per_round", m)

    neighboring_relation = NeighboringRelation.REPLACE_ONE

    @property
    def rate(self) -> float:
        return self.clients_per_round / self.num_clients

    def wrap(self, inner: dpe.DpEvent) -> dpe.DpEvent:
        return dp_accounting.SampledWithoutReplacementDpEvent(
            source_dataset_size=self.num_clients, sample_size=self.clients_per_round, event=inner)

    def to_dict(self) -> dict:
        return {"kind": "fixed_size", "clients_per_round": self.clients_per_round,
                "num_clients": self.num_clients, "neighboring_relation": "replace_one"}

    def describe(self) -> str:
        return f"fixed-size cohorts of {self.clients_per_round} out of {self.num_clients}"


Sampling = Union[PoissonSampling, FixedSizeSampling]


def as_sampling(sampling: Sampling | float | dict, field: str = "sampling_rate") -> Sampling:
    """A float is a Poisson rate; a dict is the output of ``Sampling.to_dict()``."""
    if isinstance(sampling, (PoissonSampling, FixedSizeSampling)):
        return sampling
    if isinstance(sampling, dict):
        kind = sampling.get("kind")
        if kind == "poisson":
            return PoissonSampling(sampling["rate"])
        if kind == "fixed_size":
            return FixedSizeSampling(sampling["clients_per_round"], sampling["num_clients"])
        raise DPFLError(f"unknown sampling kind {kind!r}", field="sampling")
    if _is_real(sampling):
        return PoissonSampling(_check_rate(sampling, field))
    raise DPFLError(f"expected a Poisson rate or a sampling object, got {sampling!r}", field="sampling")


def _multipliers(z: float | Sequence[float] | None, field: str) -> tuple[float, ...] | None:
    if z is None:
        return None
    if _is_real(z):
        return (_check_noise(z, field),)
    zs = tuple(z)
    if not zs:
        raise DPFLError("needs at least one noise multiplier", field=field)
    return tuple(_check_noise(v, field) for v in zs)


def _gaussians(zs: tuple[float, ...]) -> dpe.DpEvent:
    # float() matters: dp_accounting's effective-multiplier helper silently mishandles ints.
    if len(zs) == 1:
        return dp_accounting.GaussianDpEvent(float(zs[0]))
    return dp_accounting.ComposedDpEvent([dp_accounting.GaussianDpEvent(float(z)) for z in zs])


def _round_event(zs: tuple[float, ...] | None, sampling: Sampling | None) -> dpe.DpEvent:
    if zs is None or sampling is None:
        return dp_accounting.NoOpDpEvent()
    if isinstance(sampling, FixedSizeSampling) and sampling.clients_per_round == 0:
        return dp_accounting.NoOpDpEvent()
    return sampling.wrap(_gaussians(zs))


def effective_noise_multiplier(noise_multiplier: float, dropout_rate: float = 0.0) -> float:
    """The multiplier that survives dropouts: ``z * sqrt(1 - R)`` (Baek et al., section IV.B).

    Noise calibrated for n clients but summed over the n' = (1 - R) n survivors without
    re-calibration has variance n'/n of the planned one.
    """
    return _check_noise(noise_multiplier) * math.sqrt(1.0 - _check_dropout(dropout_rate))


# ----------------------------------------------------------------------------------------------------
# Accountants


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


def event_to_dict(event: dpe.DpEvent) -> dict:
    """A JSON-able dict of a DpEvent: ``{"type": class name, <its attrs fields>}``, recursively."""
    def conv(v):
        if isinstance(v, dpe.DpEvent):
            return event_to_dict(v)
        if isinstance(v, (list, tuple)):
            return [conv(x) for x in v]
        if isinstance(v, np.generic):
            return v.item()
        return v
    out = {"type": type(event).__name__}
    for f in attr.fields(type(event)):
        out[f.name] = conv(getattr(event, f.name))
    return out


# ----------------------------------------------------------------------------------------------------
# Ledger


@dataclass(frozen=True)
class RoundRecord:
    """One round as it actually happened.

    ``noise_multipliers`` are the effective ones (after dropouts), one per Gaussian released under
    the round's sampling; ``None`` means nothing was released. ``claimed_noise_multipliers`` are what
    the mechanism's paper claims (``None``: same as effective). ``event`` is the dp_accounting event
    of the round as released; ``accounted_event`` what the ledger's accountant composes for it
    (``NonPrivateDpEvent`` when ``covered`` is False; for 'pld', several Gaussians under one
    sampling become their single equivalent Gaussian). ``claimed_event`` /
    ``claimed_accounted_event``: the same with the claimed multipliers, ignoring ``covered``.
    """

    round: int
    reason: str
    sampling: Sampling | None
    noise_multipliers: tuple[float, ...] | None
    claimed_noise_multipliers: tuple[float, ...] | None
    covered: bool
    event: dpe.DpEvent
    accounted_event: dpe.DpEvent
    claimed_event: dpe.DpEvent
    claimed_accounted_event: dpe.DpEvent

    @property
    def released(self) -> bool:
        return not isinstance(self.event, dpe.NoOpDpEvent)

    def to_dict(self) -> dict:
        return {
            "round": self.round,
            "reason": self.reason,
            "covered": self.covered,
            "released": self.released,
            "sampling": None if self.sampling is None else self.sampling.to_dict(),
            "noise_multipliers": None if self.noise_multipliers is None else list(self.noise_multipliers),
            "claimed_noise_multipliers": (None if self.claimed_noise_multipliers is None
                                          else list(self.claimed_noise_multipliers)),
            "event": event_to_dict(self.event),
            "accounted_event": event_to_dict(self.accounted_event),
            "claimed_event": event_to_dict(self.claimed_event),
        }


class _Track:
    """A fresh accountant advanced over the ledger's rounds, never re-composing a round it has seen.

    Asking for epsilon after every new round therefore costs one composition per round, and a
    history (``per_round_delta`` set) is filled as the track advances one round at a time; a backlog
    of identical rounds is composed with one ``count=`` call instead.
    """

    def __init__(self, make: Callable[[], dp_accounting.PrivacyAccountant],
                 select: Callable[[RoundRecord], dpe.DpEvent], per_round_delta: float | None):
        self.accountant = make()
        self.select = select
        self.n = 0
        self.delta = per_round_delta
        self.history: list[float | None] = []

    def advance(self, records: Sequence[RoundRecord], need_history: bool = False) -> None:
        pending = [self.select(r) for r in records[self.n:]]
        if not pending:
            return
        if need_history or len(pending) == 1:
            for ev in pending:
                self.accountant.compose(ev)
                self.history.append(self.accountant.get_epsilon(self.delta) if self.delta is not None else None)
        else:
            for ev, group in itertools.groupby(pending):
                k = len(list(group))
                self.accountant.compose(ev, k)
                self.history.extend([None] * k)
        self.n = len(records)


class PrivacyLedger:
    """Records one dp_accounting event per round and answers epsilon/delta questions about the run.

    Rounds may differ in noise multiplier and sampling rate (heterogeneous composition); all rounds of
    one ledger share a neighbouring relation, fixed by the first round that samples: Poisson rounds
    mean add/remove-one-client, fixed-size cohorts replace-one-client (mixing them is refused).

    ``epsilon()`` is the *effective* guarantee (multipliers that actually applied; ``inf`` once a
    round is not covered, see the module docstring), ``claimed_epsilon()`` the one the mechanism's
    paper would state (claimed multipliers, every round counted as covered).
    """

    def __init__(self, accountant: str = DEFAULT_ACCOUNTANT, delta: float = 1e-5):
        self.accountant = _check_accountant(accountant)
        self.delta = _check_delta(delta)
        self._records: list[RoundRecord] = []
        self._relation: NeighboringRelation | None = None
        self._tracks: dict[tuple[str, float], _Track] = {}

    # --- recording -------------------------------------------------------------------------------

    @property
    def neighboring_relation(self) -> NeighboringRelation:
        return self._relation or NeighboringRelation.ADD_OR_REMOVE_ONE

    def record_round(
        self,
        noise_multiplier: float | Sequence[float] | None,
        sampling: Sampling | float | None,
        *,
        reason: str,
        claimed_noise_multiplier: float | Sequence[float] | None = None,
        covered: bool = True,
        round: int | None = None,
    ) -> RoundRecord:
        """Record one round with the parameters that actually applied.

        ``noise_multiplier``: the effective multiplier (the one that survived dropouts), or a list
        of them for a round that releases several Gaussian queries under one sampling -- e.g. Andrew
        et al.'s adaptive clipping: ``[z_update, z_count]`` becomes
        ``Sampled(ComposedDpEvent([Gaussian(z_update), Gaussian(z_count)]))``. ``None`` (or
        ``sampling=None``, or a fixed-size cohort of 0) records a round that released nothing, as a
        ``NoOpDpEvent``. Under Poisson sampling a round that sampled nobody but still released its
        noise is *not* a no-op: record it with its sampling and multiplier.
        ``covered=False``: the release is not DP as implemented (see module docstring); ignored
        for a round that released nothing.
        ``round``: the caller's round number; default: one more than the previous.
        """
        if not isinstance(reason, str):
            raise DPFLError(f"must be a string, got {reason!r}", field="reason")
        if not isinstance(covered, bool):
            raise DPFLError(f"must be True or False, got {covered!r}", field="covered")
        zs = _multipliers(noise_multiplier, "noise_multiplier")
        claimed = _multipliers(claimed_noise_multiplier, "claimed_noise_multiplier")
        if claimed is not None and zs is not None and len(claimed) != len(zs):
            raise DPFLError(f"has {len(claimed)} multipliers but the round released {len(zs)}",
                            field="claimed_noise_multiplier")
        samp = None if sampling is None else as_sampling(sampling)
        if round is None:
            round = self._records[-1].round + 1 if self._records else 1
        round = _check_int(round, "round", 0)

        event = _round_event(zs, samp)
        claimed_event = _round_event(claimed if claimed is not None else zs, samp)
        if isinstance(event, dpe.NoOpDpEvent):
            covered = True  # a round that released nothing cannot break the guarantee
        relation = self._relation
        releases = not (isinstance(event, dpe.NoOpDpEvent) and isinstance(claimed_event, dpe.NoOpDpEvent))
        if samp is not None and releases:
            if relation is None:
                relation = samp.neighboring_relation
            elif relation is not samp.neighboring_relation:
                raise DPFLError(
                    f"{samp.describe()} assumes the {samp.neighboring_relation.name.lower()} relation but this "
                    f"ledger's earlier rounds use {relation.name.lower()}; one ledger cannot mix them",
                    field="sampling")
        rel = relation or NeighboringRelation.ADD_OR_REMOVE_ONE
        # Checked even for an uncovered round: its nominal event must be accountable for the claim.
        accounted = _accountable(self.accountant, event, rel)
        if not covered:
            accounted = dp_accounting.NonPrivateDpEvent()
        claimed_accounted = _accountable(self.accountant, claimed_event, rel)

        if relation is not self._relation:
            self._relation = relation
            self._tracks.clear()  # only NoOp rounds were composed so far, under the default relation
        record = RoundRecord(round=round, reason=reason, sampling=samp, noise_multipliers=zs,
                             claimed_noise_multipliers=claimed, covered=covered, event=event,
                             accounted_event=accounted, claimed_event=claimed_event,
                             claimed_accounted_event=claimed_accounted)
        self._records.append(record)
        return record

    def record_no_release(self, reason: str, *, round: int | None = None) -> RoundRecord:
        """A round that released nothing (no sampled clients, everyone dropped, skipped)."""
        return self.record_round(None, None, reason=reason, round=round)

    # --- queries ---------------------------------------------------------------------------------

    @property
    def rounds(self) -> tuple[RoundRecord, ...]:
        return tuple(self._records)

    def __len__(self) -> int:
        return len(self._records)

    @property
    def fully_covered(self) -> bool:
        return all(r.covered for r in self._records)

    @property
    def uncovered_rounds(self) -> list[int]:
        return [r.round for r in self._records if not r.covered]

    _SELECT = {
        "effective": lambda r: r.accounted_event,
        "covered": lambda r: r.accounted_event if r.covered else dp_accounting.NoOpDpEvent(),
        "claimed": lambda r: r.claimed_accounted_event,
    }

    def _kind(self, kind: str) -> str:
        return "effective" if kind == "covered" and self.fully_covered else kind

    def _state(self, kind: str) -> dp_accounting.PrivacyAccountant:
        """An accountant that has composed every round of ``kind`` (its state is delta-free)."""
        kind = self._kind(kind)
        track = self._tracks.get((kind, self.delta))
        if track is None:
            track = next((t for (k, _), t in self._tracks.items() if k == kind), None)
        if track is None:
            track = self._new_track(kind, self.delta)
        track.advance(self._records)
        return track.accountant

    def _new_track(self, kind: str, delta: float) -> _Track:
        name, rel = self.accountant, self.neighboring_relation
        track = _Track(lambda: _fresh_accountant(name, rel), self._SELECT[kind], delta)
        self._tracks[(kind, delta)] = track
        return track

    def epsilon(self, delta: float | None = None, *, covered_only: bool = False) -> float:
        """Epsilon of the whole run at ``delta`` (default: the ledger's); ``inf`` if a round is not
        covered, unless ``covered_only`` (then: the covered rounds alone)."""
        delta = self.delta if delta is None else _check_delta(delta)
        return float(self._state("covered" if covered_only else "effective").get_epsilon(delta))

    def claimed_epsilon(self, delta: float | None = None) -> float:
        """What the mechanisms' papers would claim: claimed multipliers, every round covered."""
        delta = self.delta if delta is None else _check_delta(delta)
        return float(self._state("claimed").get_epsilon(delta))

    def delta_for_epsilon(self, epsilon: float, *, covered_only: bool = False) -> float:
        """The smallest delta the run satisfies at ``epsilon`` (1 if a round is not covered)."""
        epsilon = _check_epsilon(epsilon)
        acc = self._state("covered" if covered_only else "effective")
        return float(min(acc.get_delta(epsilon), 1.0))

    def history(self, delta: float | None = None, *, covered_only: bool = False) -> list[float]:
        """Epsilon after each recorded round (element i: after the first i+1 rounds).

        Built incrementally -- one composition per round, so T rounds cost O(T) accountant work;
        the ledger's own delta is kept up to date as rounds are recorded.
        """
        delta = self.delta if delta is None else _check_delta(delta)
        kind = self._kind("covered" if covered_only else "effective")
        track = self._tracks.get((kind, delta))
        if track is not None and None in track.history:
            track = None  # a backlog was composed in one call: its per-round figures are missing
        if track is None:
            track = self._new_track(kind, delta)
        track.advance(self._records, need_history=True)
        return [float(e) for e in track.history]

    def summary(self, delta: float | None = None) -> str:
        """One line for logs; says so when the run has no DP guarantee."""
        delta = self.delta if delta is None else _check_delta(delta)
        n = len(self._records)
        if self.fully_covered:
            return (f"epsilon = {self.epsilon(delta):.4f} after {n} rounds "
                    f"(delta={delta:g}, accountant={self.accountant})")
        return (f"no DP guarantee for the run: rounds {self.uncovered_rounds} are not covered; the "
                f"{n - len(self.uncovered_rounds)} covered rounds alone give epsilon = "
                f"{self.epsilon(delta, covered_only=True):.4f} (delta={delta:g}, accountant={self.accountant})")

    # --- serialisation ---------------------------------------------------------------------------

    def to_dict(self, include_epsilon: bool = True) -> dict:
        """JSON-able: the accountant, delta, every round's events, and (by default) the epsilons.

        An infinite epsilon is written as ``null`` (strict JSON has no infinity); ``fully_covered``
        says why.
        """
        def fin(x: float) -> float | None:
            return x if math.isfinite(x) else None

        out: dict[str, Any] = {
            "accountant": self.accountant,
            "accountant_details": _accountant_details(self.accountant),
            "delta": self.delta,
            "neighboring_relation": self.neighboring_relation.name.lower(),
            "num_rounds": len(self._records),
            "fully_covered": self.fully_covered,
            "uncovered_rounds": self.uncovered_rounds,
            "rounds": [r.to_dict() for r in self._records],
        }
        if include_epsilon:
            out["epsilon"] = fin(self.epsilon())
            out["epsilon_covered_rounds"] = fin(self.epsilon(covered_only=True))
            out["epsilon_claimed"] = fin(self.claimed_epsilon())
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "PrivacyLedger":
        """Rebuild a ledger from :meth:`to_dict` output (re-recording every round)."""
        ledger = cls(accountant=data.get("accountant", DEFAULT_ACCOUNTANT), delta=data.get("delta", 1e-5))
        for r in data.get("rounds", []):
            ledger.record_round(r.get("noise_multipliers"),
                                None if r.get("sampling") is None else as_sampling(r["sampling"]),
                                reason=r.get("reason", ""),
                                claimed_noise_multiplier=r.get("claimed_noise_multipliers"),
                                covered=r.get("covered", True), round=r.get("round"))
        return ledger


# ----------------------------------------------------------------------------------------------------
# Fixed schedules: the same event every round


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
        self.effective_multipliers = tuple(z * math.sqrt(1.0 - self.dropout_rate) for z in zs)
        relation = self.sampling.neighboring_relation
        self.event = _accountable(self.accountant, _round_event(self.effective_multipliers, self.sampling), relation)
        self._relation = relation
        self._cache: dict[int, float] = {}

    def _accountant_after(self, rounds: int) -> dp_accounting.PrivacyAccountant:
        return _fresh_accountant(self.accountant, self._relation).compose(self.event, rounds)

    def epsilon(self, rounds: int) -> float:
        rounds = _check_rounds(rounds)
        if self.delta is None:
            raise DPFLError("this curve was built without a delta", field="delta")
        if rounds not in self._cache:
            self._cache[rounds] = float(self._accountant_after(rounds).get_epsilon(self.delta))
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


def calibrate_noise_multiplier(target_epsilon: float, delta: float, sampling: Sampling | float, rounds: int,
                               accountant: str = DEFAULT_ACCOUNTANT, tol: float = 1e-5) -> float:
    """The smallest noise multiplier (within ``tol``) whose epsilon after ``rounds`` rounds is <= target.

    Uses ``dp_accounting.calibrate_dp_mechanism``, which never returns a value above the target;
    the bracket is found first so that z -> 0 (epsilon -> inf) never enters the root finder.
    """
    target = _check_epsilon(target_epsilon, "epsilon")
    delta = _check_delta(delta)
    samp = as_sampling(sampling)
    rounds = _check_rounds(rounds)
    name = _check_accountant(accountant)
    tol = _check_epsilon(tol, "tol")
    relation = samp.neighboring_relation
    _accountable(name, _round_event((1.0,), samp), relation)

    def make_event(z: float) -> dpe.DpEvent:
        return dp_accounting.SelfComposedDpEvent(_round_event((float(z),), samp), rounds)

    seen: dict[float, float] = {}

    def eps(z: float) -> float:
        if z not in seen:
            seen[z] = _fresh_accountant(name, relation).compose(make_event(z)).get_epsilon(delta)
        return seen[z]

    # Bracket [lo, hi] with eps(lo) > target >= eps(hi), by doubling / halving from z = 1.
    hi = 1.0
    while eps(hi) > target:
        hi *= 2.0
        if hi > 1e6:
            raise DPFLError(f"no noise multiplier up to 1e6 reaches epsilon {target:g} after {rounds} rounds",
                            field="epsilon")
    lo = hi / 2.0
    while eps(lo) <= target:
        hi, lo = lo, lo / 2.0
        if lo < 1e-4:
            raise DPFLError(f"epsilon {target:g} is met even with a noise multiplier below 1e-4",
                            field="epsilon")
    z = dp_accounting.calibrate_dp_mechanism(
        lambda: _fresh_accountant(name, relation), make_event, target, delta,
        bracket_interval=dp_accounting.ExplicitBracketInterval(lo, hi), tol=tol)
    return float(z)

