"""One privacy ledger per client, for record-level DP (Huang et al. 2020, Fu et al. 2022).

Client-level DP (:class:`~dpfl_ray.privacy.ledger.PrivacyLedger`) has one ledger for the run; with
record-level DP every client protects its *own records* and spends its *own* budget, so each client
has an accountant: its DP-SGD steps are booked as ``PoissonSampledDpEvent(q, Gaussian(sigma))``,
Huang's noisy arg-max as a pure-DP event (see :mod:`dpfl_ray.algorithms.huang2020_core`), all computed
under the add/remove-one-record relation of dp_accounting's ``RdpAccountant``: the run's own relation
(ledger.json's ``adjacency``) is met through the events (Huang's replace-one books doubled
sensitivities; Fu's zero-out has add/remove's curve for Poisson lots).

Speed: a client's RDP curve is the sum of its events' curves times their counts (RDP composes by
addition, which is exactly what ``RdpAccountant.compose`` does). Each *distinct* event's curve is
computed once by dp_accounting and cached, so 1000 clients x 100 rounds cost 100k vector additions,
not 100k accountant compositions; the leaf events' curves (a sampled Gaussian) are cached for the
whole process (:mod:`dpfl_ray.privacy.accountants`' memoised accountant), shared by every ledger.
The epsilon comes from dp_accounting's ``compute_epsilon`` (its improved conversion), or, with
``conversion="classic"``, from the classic conversion ``eps = min_a RDP(a) + log(1/delta)/(a-1)``
that Fu et al. 2022 state in eq. 10 (Definition 7) -- the one in
:mod:`dpfl_ray.privacy.accountants`, reused, not re-typed.
"""
from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any, Iterable, Literal, Sequence

import numpy as np
from dp_accounting import NeighboringRelation
from dp_accounting import dp_event as dpe
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

from dpfl_ray.errors import DPFLError
from dpfl_ray.privacy.accountants import _ClassicRdpAccountant, _MemoRdpAccountant
from dpfl_ray.privacy.sampling import event_to_dict
from dpfl_ray.privacy.validation import _check_delta

__all__ = ["ClientLedgers", "event_from_dict", "FU_EQ10_ORDERS"]

# Fu et al. 2022, Theorem 1: "we select alpha from {2, 3, ..., 64}".
FU_EQ10_ORDERS: tuple[float, ...] = tuple(float(a) for a in range(2, 65))
_CONVERSIONS = ("dp_accounting", "classic")


def event_from_dict(data: dict) -> dpe.DpEvent:
    """Inverse of :func:`dpfl_ray.privacy.sampling.event_to_dict`."""
    from dpfl_ray.privacy.discrete_rdp import CalibratedViewsDpEvent, DiscreteNoiseSumDpEvent

    fields = dict(data)
    name = fields.pop("type")
    own = {c.__name__: c for c in (DiscreteNoiseSumDpEvent, CalibratedViewsDpEvent)}
    cls = own.get(name) or getattr(dpe, name, None)
    if not (isinstance(cls, type) and issubclass(cls, dpe.DpEvent)):
        raise DPFLError(f"unknown dp_accounting event {data.get('type')!r}", field="events")

    def conv(v):
        if isinstance(v, dict) and "type" in v:
            return event_from_dict(v)
        if isinstance(v, list):
            return [conv(x) for x in v]
        return v
    return cls(**{k: conv(v) for k, v in fields.items()})


class ClientLedgers:
    """Per-client RDP accounting: book events on a client, ask its epsilon, or whether it can go on.

    ``num_clients``: when given, every client 0..K-1 is reported (one that booked nothing has
    epsilon 0, and counts in the min / median); otherwise only clients that booked something.
    ``orders``: RDP orders (default: dp_accounting's). ``conversion``: see the module docstring.
    """

    def __init__(self, delta: float, *, num_clients: int | None = None, orders: Sequence[float] | None = None,
                 conversion: Literal["dp_accounting", "classic"] = "dp_accounting"):
        self.delta = _check_delta(delta)
        if conversion not in _CONVERSIONS:
            raise DPFLError(f"must be one of {', '.join(_CONVERSIONS)}, got {conversion!r}", field="conversion")
        if num_clients is not None and (not isinstance(num_clients, int) or num_clients < 0):
            raise DPFLError(f"must be an integer >= 0, got {num_clients!r}", field="num_clients")
        self.conversion = conversion
        self.num_clients = num_clients
        self.orders = np.array(rdp_lib.DEFAULT_RDP_ORDERS if orders is None else orders, dtype=np.float64)
        self._curves: dict[str, np.ndarray] = {}     # repr(event) -> RDP curve of one occurrence
        self._events: dict[str, dpe.DpEvent] = {}
        self._event_dicts: dict[str, dict] = {}      # repr(event) -> event_to_dict(event), for to_dict
        self._rdp: dict[int, np.ndarray] = {}
        self._counts: dict[int, dict[str, int]] = {}
        self._rounds: dict[int, list[int]] = {}
        self._eps_cache: dict[int, dict[float, float]] = {}  # client -> {delta: epsilon}

    # --- booking ---------------------------------------------------------------------------------

    def _curve(self, event: dpe.DpEvent) -> tuple[str, np.ndarray]:
        key = repr(event)
        curve = self._curves.get(key)
        if curve is None:
            self._check_event(event)
            # the memoised accountant: a leaf event's curve is computed once per process, so the
            # runtime's ledgers and the algorithm's, which book the same events, share it
            acc = _MemoRdpAccountant(orders=self.orders, neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE)
            if not acc.supports(event):
                raise DPFLError(f"dp_accounting's RdpAccountant cannot account {type(event).__name__} under the "
                                "add/remove-one-record relation", field="event")
            acc.compose(event)
            curve = acc.rdp
            self._curves[key], self._events[key] = curve, event
        return key, curve

    @staticmethod
    def _check_event(event) -> None:
        if not isinstance(event, dpe.DpEvent):
            raise DPFLError(f"must be a dp_accounting DpEvent, got {type(event).__name__}", field="event")

    def _check_client(self, client: Any) -> int:
        if isinstance(client, bool) or not isinstance(client, (int, np.integer)) or client < 0 or \
                (self.num_clients is not None and client >= self.num_clients):
            limit = "" if self.num_clients is None else f" below {self.num_clients}"
            raise DPFLError(f"must be an integer >= 0{limit}, got {client!r}", field="client")
        return int(client)

    def record(self, client: int, event: dpe.DpEvent, count: int = 1, *, round: int | None = None) -> None:
        """Book ``count`` occurrences of ``event`` on ``client``'s ledger (``round``: for the record)."""
        self.record_many([client], event, count, round=round)

    def record_many(self, clients: Iterable[int], event: dpe.DpEvent, count: int = 1, *,
                    round: int | None = None) -> None:
        """Book the same event on several clients (one cached curve, one addition each)."""
        if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 0:
            raise DPFLError(f"must be an integer >= 0, got {count!r}", field="count")
        key, curve = self._curve(event)
        for c in clients:
            c = self._check_client(c)
            if count == 0:
                continue
            self._rdp[c] = self._rdp.get(c, 0.0) + count * curve
            counts = self._counts.setdefault(c, {})
            counts[key] = counts.get(key, 0) + int(count)
            if round is not None:
                rounds = self._rounds.setdefault(c, [])
                if not rounds or rounds[-1] != round:
                    rounds.append(int(round))
            self._eps_cache.pop(c, None)

    # --- questions -------------------------------------------------------------------------------

    @property
    def num_distinct_events(self) -> int:
        """How many distinct events were booked (each one's RDP curve is computed once, when needed)."""
        return len(self._events)

    @property
    def clients(self) -> list[int]:
        if self.num_clients is not None:
            return list(range(self.num_clients))
        return sorted(self._rdp)

    def rdp(self, client: int) -> np.ndarray:
        """The client's RDP curve at :attr:`orders`."""
        return np.array(self._rdp.get(self._check_client(client), np.zeros_like(self.orders)), dtype=np.float64)

    def _to_epsilon(self, curve: np.ndarray, delta: float) -> float:
        if not np.any(curve):
            return 0.0
        if self.conversion == "classic":
            # the accountant's method only reads .rdp and .orders: reuse it on this curve
            return float(_ClassicRdpAccountant.get_epsilon(SimpleNamespace(rdp=curve, orders=self.orders), delta))
        return float(rdp_lib.compute_epsilon(self.orders, curve, delta)[0])

    def epsilon(self, client: int, delta: float | None = None) -> float:
        """The client's epsilon at ``delta`` (default: the run's) over everything it booked."""
        delta = self.delta if delta is None else _check_delta(delta)
        c = self._check_client(client)
        cached = self._eps_cache.setdefault(c, {})
        if delta not in cached:
            cached[delta] = self._to_epsilon(self.rdp(c), delta)
        return cached[delta]

    def epsilon_after(self, client: int, event: dpe.DpEvent, count: int = 1, delta: float | None = None) -> float:
        """The client's epsilon if ``event`` were booked ``count`` more times (nothing is booked)."""
        delta = self.delta if delta is None else _check_delta(delta)
        _, curve = self._curve(event)
        return self._to_epsilon(self.rdp(client) + count * curve, delta)

    def would_exceed(self, client: int, event: dpe.DpEvent, budget: float, count: int = 1,
                     delta: float | None = None) -> bool:
        """Would booking ``event`` push the client past ``budget``? (Fu et al. 2022, Alg. 1 line 17:
        a client stops uploading once its epsilon would pass the budget.) Asked *before* the client
        touches its data, so the answer itself depends on nothing private."""
        if not (isinstance(budget, (int, float)) and budget > 0):
            raise DPFLError(f"must be a number > 0, got {budget!r}", field="budget")
        return self.epsilon_after(client, event, count, delta) > budget

    def epsilons(self, delta: float | None = None) -> dict[int, float]:
        """{client: epsilon} for :attr:`clients` (for the per-client histogram)."""
        return {c: self.epsilon(c, delta) for c in self.clients}

    def events(self, client: int) -> list[tuple[dpe.DpEvent, int]]:
        """The distinct events booked on ``client`` and how many times each."""
        return [(self._events[k], n) for k, n in self._counts.get(self._check_client(client), {}).items()]

    def rounds(self, client: int) -> list[int]:
        return list(self._rounds.get(self._check_client(client), []))

    def summary(self, delta: float | None = None) -> dict:
        """max / median / min epsilon over :attr:`clients` at ``delta`` (JSON-able; inf -> None)."""
        delta = self.delta if delta is None else _check_delta(delta)
        eps = np.array(list(self.epsilons(delta).values()), dtype=np.float64)

        def fin(x: float) -> float | None:
            return float(x) if math.isfinite(x) else None
        out: dict[str, Any] = {"delta": delta, "num_clients": int(eps.size), "accountant": self.accountant_details()}
        if eps.size:
            out.update(epsilon_max=fin(eps.max()), epsilon_median=fin(float(np.median(eps))),
                       epsilon_min=fin(eps.min()))
        else:
            out.update(epsilon_max=None, epsilon_median=None, epsilon_min=None)
        return out

    def accountant_details(self) -> dict:
        return {"implementation": "dp_accounting RdpAccountant (per-client curves)",
                "relation": "add_or_remove_one_record", "conversion": self.conversion,
                "orders": [float(o) for o in self.orders]}

    # --- serialisation ---------------------------------------------------------------------------

    def to_dict(self, include_epsilon: bool = True) -> dict:
        """JSON-able: settings, the distinct events, each client's counts and rounds (and epsilons).

        Without epsilons (a checkpoint's state), a ledger with more distinct events than clients
        (Fu et al.'s sigma, which decays round by round) also keeps each client's RDP curve as
        dp_accounting summed it (``rdp``): :meth:`from_dict` then restores the sums instead of
        computing every past event's curve again (one dp_accounting composition per past round,
        which for thousands of rounds outlasts the coordinator's first reply's deadline), and a
        resumed run's epsilons are the uninterrupted run's to the bit."""
        keys = sorted(self._events)
        index = {k: i for i, k in enumerate(keys)}
        clients = {}
        for c in sorted(self._counts):
            entry: dict[str, Any] = {"counts": {str(index[k]): n for k, n in self._counts[c].items()},
                                     "rounds": self.rounds(c)}
            if include_epsilon:
                e = self.epsilon(c)
                entry["epsilon"] = e if math.isfinite(e) else None
            clients[str(c)] = entry
        out = {"delta": self.delta, "num_clients": self.num_clients, "conversion": self.conversion,
               "orders": [float(o) for o in self.orders],
               "events": [self._event_dict(k) for k in keys], "clients": clients}
        if include_epsilon:
            out["summary"] = self.summary()
        elif len(self._events) > len(self._rdp):
            out["rdp"] = {str(c): [float(x) for x in self._rdp[c]] for c in sorted(self._rdp)}
        return out

    def _event_dict(self, key: str) -> dict:
        """event_to_dict of a booked event, made once: a ledger whose events keep changing (Fu et al.'s
        decaying sigma) is checkpointed with thousands of them, each converted only the first time."""
        out = self._event_dicts.get(key)
        if out is None:
            out = self._event_dicts[key] = event_to_dict(self._events[key])
        return out  # shared by every to_dict: serialised, never changed

    @classmethod
    def from_dict(cls, data: dict) -> "ClientLedgers":
        """Rebuild from :meth:`to_dict` output: each client's curve from its events, each computed by
        dp_accounting, or, where the state kept them (``rdp``), the sums dp_accounting made then."""
        led = cls(data["delta"], num_clients=data.get("num_clients"), orders=data.get("orders"),
                  conversion=data.get("conversion", "dp_accounting"))
        events = [event_from_dict(e) for e in data.get("events", [])]
        sums = data.get("rdp")
        for c, entry in data.get("clients", {}).items():
            if sums is None:
                for i, n in entry.get("counts", {}).items():
                    led.record(int(c), events[int(i)], int(n))
            else:
                led._restore(int(c), entry.get("counts", {}), events, sums.get(c))
            led._rounds[int(c)] = [int(r) for r in entry.get("rounds", [])]
        return led

    def _restore(self, client: int, counts: dict, events: list, curve) -> None:
        """A client's booked events and counts with its summed curve as saved (no curve computed)."""
        c = self._check_client(client)
        if curve is None or len(curve) != len(self.orders):
            raise DPFLError(f"client {c}'s saved RDP curve is missing or not one value per order", field="rdp")
        booked = self._counts.setdefault(c, {})
        for i, n in counts.items():
            event = events[int(i)]
            self._check_event(event)
            key = repr(event)
            self._events.setdefault(key, event)
            booked[key] = booked.get(key, 0) + int(n)
        self._rdp[c] = np.array(curve, dtype=np.float64)
