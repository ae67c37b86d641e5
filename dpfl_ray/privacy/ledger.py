"""Privacy accounting: a per-round ledger of dp_accounting events, and the closed-form helpers.

Every privacy number here comes from Google's ``dp_accounting`` package; this package only decides
*which* ``DpEvent`` describes a round and *which* accountant composes it. The one formula written out
is the 'rdp-classic' RDP -> (epsilon, delta) conversion (see :mod:`dpfl_ray.privacy.accountants`).

The code is split by concern; this module holds the ledger itself and re-exports the rest, so
``from dpfl_ray.privacy.ledger import ...`` keeps working for every public name:

* :mod:`dpfl_ray.privacy.sampling` -- Poisson / fixed-size sampling and the per-round ``DpEvent``;
* :mod:`dpfl_ray.privacy.accountants` -- the 'pld', 'rdp' and 'rdp-classic' accountants;
* :mod:`dpfl_ray.privacy.calibration` -- fixed schedules: :func:`epsilon_for`, :func:`delta_for`,
  :func:`rounds_within_budget`, :func:`calibrate_noise_multiplier`, :class:`EpsilonCurve`.

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
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import dp_accounting
import numpy as np
from dp_accounting import NeighboringRelation
from dp_accounting import dp_event as dpe

from dpfl_ray.errors import DPFLError
from dpfl_ray.privacy.accountants import (
    ACCOUNTANTS,
    CLASSIC_RDP_ORDERS,
    DEFAULT_ACCOUNTANT,
    PLD_VALUE_DISCRETIZATION_INTERVAL,
    _accountable,
    _accountant_details,
    _check_accountant,
    _fresh_accountant,
    accountant_state,
    restore_accountant,
)
from dpfl_ray.privacy.calibration import (  # re-exported: the ledger module's historical names
    DEFAULT_MAX_ROUNDS,
    EpsilonCurve,
    calibrate_noise_multiplier,
    delta_for,
    epsilon_for,
    rounds_within_budget,
)
from dpfl_ray.privacy.sampling import (
    FixedSizeSampling,
    PoissonSampling,
    Sampling,
    _multipliers,
    _round_event,
    as_sampling,
    effective_noise_multiplier,
    event_to_dict,
)
from dpfl_ray.privacy.validation import _check_delta, _check_epsilon, _check_int

__all__ = [
    "ACCOUNTANTS", "DEFAULT_ACCOUNTANT", "PLD_VALUE_DISCRETIZATION_INTERVAL", "CLASSIC_RDP_ORDERS",
    "PoissonSampling", "FixedSizeSampling", "Sampling", "as_sampling",
    "RoundRecord", "PrivacyLedger", "EpsilonCurve",
    "epsilon_for", "delta_for", "calibrate_noise_multiplier", "rounds_within_budget",
    "effective_noise_multiplier", "event_to_dict",
]


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
    ``mechanism``: what the round released under its sampling when that is not Gaussian noise (a
    :class:`dpfl_ray.privacy.discrete_rdp.DiscreteNoiseSumDpEvent` or ``CalibratedViewsDpEvent``: integer
    noise inside SecAgg); the multipliers are then the continuous Gaussian's the scenario asked for,
    which the claim books.
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
    public: tuple[str, ...] = ()
    paper_epsilon: float | None = None
    claim_note: str = ""
    dropouts: Mapping[str, Mapping[str, int]] | None = None
    mechanism: dpe.DpEvent | None = None

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
            "public": list(self.public),
            "paper_epsilon": self.paper_epsilon,
            "claim_note": self.claim_note,
            "dropped": None if self.dropouts is None else {c: dict(p) for c, p in self.dropouts.items()},
            **({} if self.mechanism is None else {"mechanism": event_to_dict(self.mechanism)}),
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
        public: Sequence[str] = (),
        paper_epsilon: float | None = None,
        claim_note: str = "",
        dropouts: Mapping[str, Mapping[str, int]] | None = None,
        mechanism: dpe.DpEvent | None = None,
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
        ``public``: data-dependent quantities the round's analysis treats as public (e.g. Baek et
        al.'s sampled weight n and surviving weight n'), recorded for the reader.
        ``paper_epsilon``: the epsilon the mechanism's paper claims for this round by its own
        analysis, when that is not a multiplier dp_accounting can compose (NbAFL's classic Gaussian
        bound); ``claim_note`` says where that claim stands outside its own validity range.
        ``dropouts``: who was missing from the round, {cause: {phase: count}} (dpfl_ray.faults.plan), for
        the reader: what was booked already reflects them.
        ``mechanism``: the event the round released under its sampling, when it is not the Gaussians
        of ``noise_multiplier`` (integer noise inside SecAgg, privacy/discrete_rdp.py); the effective
        multipliers are then ignored and the claimed ones (default: ``noise_multiplier``) book the
        claim.
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

        claimed_event = _round_event(claimed if claimed is not None else zs, samp)
        if mechanism is None:
            event = _round_event(zs, samp)
        elif not isinstance(mechanism, dpe.DpEvent):
            raise DPFLError(f"must be a dp_accounting DpEvent, got {type(mechanism).__name__}", field="mechanism")
        else:
            event = dp_accounting.NoOpDpEvent() if samp is None else samp.wrap(mechanism)
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
                             claimed_accounted_event=claimed_accounted, public=tuple(str(x) for x in public),
                             paper_epsilon=None if paper_epsilon is None else float(paper_epsilon),
                             claim_note=str(claim_note), dropouts=dropouts, mechanism=mechanism)
        self._records.append(record)
        return record

    def record_no_release(self, reason: str, *, round: int | None = None,
                          dropouts: Mapping[str, Mapping[str, int]] | None = None) -> RoundRecord:
        """A round that released nothing (no sampled clients, everyone dropped, skipped)."""
        return self.record_round(None, None, reason=reason, round=round, dropouts=dropouts)

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
        """What the mechanisms' papers would claim: claimed multipliers, every round covered. Rounds
        that carry a ``paper_epsilon`` are the paper's own analysis, which composes by adding the
        epsilons up (basic composition); the claim is then that sum, as the paper states it."""
        paper = [r.paper_epsilon for r in self._records if r.paper_epsilon is not None]
        if paper:
            return float(math.fsum(paper))
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

    def tracks_state(self) -> tuple[list[dict], dict[str, np.ndarray]]:
        """Every accountant this ledger has advanced, as it stands: ``(metas, arrays)`` that
        :meth:`restore_tracks` takes back, so a ledger rebuilt from a checkpoint goes on with the
        same floats without composing its past rounds again (minutes for a long pld run)."""
        metas, arrays = [], {}
        for i, ((kind, delta), track) in enumerate(self._tracks.items()):
            meta, saved = accountant_state(track.accountant)
            metas.append({"kind": kind, "delta": delta, "n": track.n, "history": list(track.history),
                          "accountant": meta})
            arrays.update({f"{i}.{k}": v for k, v in saved.items()})
        return metas, arrays

    def restore_tracks(self, metas: list[dict], arrays: dict[str, np.ndarray]) -> None:
        """Take back :meth:`tracks_state` of this ledger's rounds (every round recorded first)."""
        for i, meta in enumerate(metas):
            if not 0 <= meta["n"] <= len(self._records) or meta["kind"] not in self._SELECT:
                raise DPFLError(f"a saved accountant covers {meta['n']} rounds of {meta['kind']!r}; the ledger "
                                f"holds {len(self._records)}", field="checkpoint")
            track = self._new_track(meta["kind"], float(meta["delta"]))
            saved = {k.split(".", 1)[1]: v for k, v in arrays.items() if k.split(".", 1)[0] == str(i)}
            track.accountant = restore_accountant(self.accountant, self.neighboring_relation, meta["accountant"],
                                                  saved)
            track.n, track.history = int(meta["n"]), [None if e is None else float(e) for e in meta["history"]]

    def replay(self) -> None:
        """Compose every recorded round one at a time, as a live run does, so that a ledger rebuilt
        from a checkpoint (:meth:`from_dict`) answers with the same floats as the uninterrupted one
        (a backlog composed in one call may round differently)."""
        for kind in ("effective", "claimed"):
            kind = self._kind(kind)
            if (kind, self.delta) not in self._tracks:
                self._new_track(kind, self.delta).advance(self._records, need_history=True)

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
            # for 'pld': the grid it used, or that 'rdp' answered (bounded accounting, issue #16)
            out["accountant_details"] = _accountant_details(self.accountant, self._state("effective"))
            out["accountant_used"] = out["accountant_details"]["name"]
            out["epsilon_covered_rounds"] = fin(self.epsilon(covered_only=True))
            out["epsilon_claimed"] = fin(self.claimed_epsilon())
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "PrivacyLedger":
        """Rebuild a ledger from :meth:`to_dict` output (re-recording every round)."""
        from dpfl_ray.privacy.client_ledgers import event_from_dict

        ledger = cls(accountant=data.get("accountant", DEFAULT_ACCOUNTANT), delta=data.get("delta", 1e-5))
        for r in data.get("rounds", []):
            ledger.record_round(r.get("noise_multipliers"),
                                None if r.get("sampling") is None else as_sampling(r["sampling"]),
                                reason=r.get("reason", ""),
                                claimed_noise_multiplier=r.get("claimed_noise_multipliers"),
                                covered=r.get("covered", True), round=r.get("round"),
                                public=r.get("public", ()), paper_epsilon=r.get("paper_epsilon"),
                                claim_note=r.get("claim_note", ""), dropouts=r.get("dropped"),
                                mechanism=None if r.get("mechanism") is None else event_from_dict(r["mechanism"]))
        return ledger
