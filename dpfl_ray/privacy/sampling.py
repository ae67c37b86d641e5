"""Sampling schemes and the dp_accounting event that describes one round.

Sampling and neighbouring relations
-----------------------------------
:class:`PoissonSampling` (each client joins a round independently with probability ``rate``) is
accounted as ``PoissonSampledDpEvent`` under the **add/remove-one-client** relation.
:class:`FixedSizeSampling` (a uniformly random cohort of exactly ``m`` of the ``K`` clients) is
accounted as ``SampledWithoutReplacementDpEvent`` under the **replace-one-client** relation. The two
epsilons are not comparable, so one ledger never mixes them, and an accountant that cannot handle an
event (dp_accounting's PLD accountant and fixed-size cohorts, for one) is refused with a
:class:`~dpfl_ray.errors.DPFLError` naming the ``accountant`` field.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence, Union

import numpy as np

from dpfl_ray.errors import DPFLError
from dpfl_ray.privacy.validation import _check_dropout, _check_int, _check_noise, _check_rate, _is_real

if TYPE_CHECKING:
    from dp_accounting import NeighboringRelation
    from dp_accounting import dp_event as dpe

__all__ = ["PoissonSampling", "FixedSizeSampling", "NoSampling", "Sampling", "as_sampling", "sampling_of",
           "effective_noise_multiplier", "event_to_dict"]

# dp_accounting (and scipy under it) is imported where an event or a relation is first needed, not
# here: the algorithms import this module for sampling_of, and so does every worker process that
# checks its scenario, which never builds an event (about 0.5 s of CPU per worker of a private run).


def _relation(name: str) -> NeighboringRelation:
    from dp_accounting import NeighboringRelation

    return NeighboringRelation[name]


@dataclass(frozen=True)
class PoissonSampling:
    """Each client takes part in a round independently with probability ``rate`` in (0, 1].

    Accounted as dp_accounting's ``PoissonSampledDpEvent`` under the add/remove-one-client
    neighbouring relation (``NeighboringRelation.ADD_OR_REMOVE_ONE``).
    """

    rate: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "rate", _check_rate(self.rate, "sampling_rate"))

    @property
    def neighboring_relation(self) -> NeighboringRelation:
        return _relation("ADD_OR_REMOVE_ONE")

    def wrap(self, inner: dpe.DpEvent) -> dpe.DpEvent:
        import dp_accounting

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

    @property
    def neighboring_relation(self) -> NeighboringRelation:
        return _relation("REPLACE_ONE")

    @property
    def rate(self) -> float:
        return self.clients_per_round / self.num_clients

    def wrap(self, inner: dpe.DpEvent) -> dpe.DpEvent:
        import dp_accounting

        return dp_accounting.SampledWithoutReplacementDpEvent(
            source_dataset_size=self.num_clients, sample_size=self.clients_per_round, event=inner)

    def to_dict(self) -> dict:
        return {"kind": "fixed_size", "clients_per_round": self.clients_per_round,
                "num_clients": self.num_clients, "neighboring_relation": "replace_one"}

    def describe(self) -> str:
        return f"fixed-size cohorts of {self.clients_per_round} out of {self.num_clients}"


@dataclass(frozen=True)
class NoSampling:
    """No sampling of the protected unit: every record of a client is in each of its uploads
    (record-level DP of one client's release, as NbAFL). Accounted as the bare mechanism under the
    replace-one-record relation; nothing is amplified."""

    rate = 1.0

    @property
    def neighboring_relation(self) -> NeighboringRelation:
        return _relation("REPLACE_ONE")

    def wrap(self, inner: dpe.DpEvent) -> dpe.DpEvent:
        return inner

    def to_dict(self) -> dict:
        return {"kind": "none", "neighboring_relation": "replace_one"}

    def describe(self) -> str:
        return "no sampling (every record in every release)"


Sampling = Union[PoissonSampling, FixedSizeSampling, NoSampling]


def as_sampling(sampling: Sampling | float | dict, field: str = "sampling_rate") -> Sampling:
    """A float is a Poisson rate; a dict is the output of ``Sampling.to_dict()``."""
    if isinstance(sampling, (PoissonSampling, FixedSizeSampling, NoSampling)):
        return sampling
    if isinstance(sampling, dict):
        kind = sampling.get("kind")
        if kind == "poisson":
            return PoissonSampling(sampling["rate"])
        if kind == "fixed_size":
            return FixedSizeSampling(sampling["clients_per_round"], sampling["num_clients"])
        if kind == "none":
            return NoSampling()
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
    import dp_accounting

    # float() matters: dp_accounting's effective-multiplier helper silently mishandles ints.
    if len(zs) == 1:
        return dp_accounting.GaussianDpEvent(float(zs[0]))
    return dp_accounting.ComposedDpEvent([dp_accounting.GaussianDpEvent(float(z)) for z in zs])


def _round_event(zs: tuple[float, ...] | None, sampling: Sampling | None) -> dpe.DpEvent:
    import dp_accounting

    if zs is None or sampling is None:
        return dp_accounting.NoOpDpEvent()
    if isinstance(sampling, FixedSizeSampling) and sampling.clients_per_round == 0:
        return dp_accounting.NoOpDpEvent()
    return sampling.wrap(_gaussians(zs))


def effective_noise_multiplier(noise_multiplier: float, dropout_rate: float = 0.0) -> float:
    """The multiplier that survives dropouts when nothing re-calibrates: z * sqrt(1 - R) (Baek et
    al., section IV.B) -- the server's view of :mod:`dpfl_ray.privacy.dropouts`, mode 'none'."""
    from dpfl_ray.privacy.dropouts import planned_noise_multipliers

    return planned_noise_multipliers(_check_noise(noise_multiplier), "none", _check_dropout(dropout_rate))[1]


def event_to_dict(event: dpe.DpEvent) -> dict:
    """A JSON-able dict of a DpEvent: ``{"type": class name, <its attrs fields>}``, recursively."""
    import attr
    from dp_accounting import dp_event as dpe

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


def sampling_of(sampling_cfg, num_clients: int) -> tuple[Sampling, float, float]:
    """The ledger's sampling for a scenario's ``sampling`` section, the expected fraction of the
    population whose updates are kept (q, or m / K), and the displacement factor of the sensitivity.

    With ``overcommit`` > 1 (Bonawitz et al. 2019) the runtime samples oc * q (or ceil(oc * m) of K)
    and keeps the first q K (or m) to report; who reports first does not depend on the data. The
    ledger books the larger sampling, which bounds every client's inclusion, and under Poisson
    sampling doubles the sensitivity: an added client can push another out of the capped cohort
    (one in, one out). Under fixed-size cohorts the population and its ids are fixed, so replacing
    one client's data never changes who is kept: the replace-one sensitivity already covers it."""
    oc = float(getattr(sampling_cfg, "overcommit", 1.0))
    if sampling_cfg.mode == "poisson":
        rate = float(sampling_cfg.rate)
        if oc > 1:
            return PoissonSampling(min(1.0, rate * oc)), rate, 2.0
        return PoissonSampling(rate), rate, 1.0
    m = sampling_cfg.clients_per_round
    drawn = min(num_clients, math.ceil(m * oc - 1e-9)) if oc > 1 else m
    return FixedSizeSampling(drawn, num_clients), m / num_clients, 1.0
