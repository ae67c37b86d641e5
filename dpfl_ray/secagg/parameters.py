"""Degree ``k`` and threshold ``t`` of SecAgg+ from a dropout fraction (Bell et al. 2020, Sec. 3).

Bell et al. 2020 ("Secure Single-Server Aggregation with (Poly)Logarithmic Overhead", CCS 2020)
need three events to be unlikely over the random graph, for ``n`` clients of which at most
``gamma * n`` drop out and at most ``delta * n`` are corrupt (collude with the server):

1. the graph of the surviving (honest) clients is disconnected -- otherwise the sum of one part
   can be unmasked on its own;
2. some client keeps fewer than ``t`` surviving holders of its shares -- the round cannot finish;
3. some client has so many corrupt neighbours that, with the server's help, they reach ``t``.

Our graph is a uniformly relabelled Harary graph H(n, k) (:mod:`.graph`), for which these are
computed exactly or by a union bound, as Google's production SecAgg+ does
(federated-compute, ``fcp/secagg/server/graph_parameter_finder.cc``):

* Event 1. Removing a set R splits the circulant graph with offsets ``1..k/2`` iff R contains
  two runs of ``k/2`` consecutive ring positions separated by survivors on both sides. There are
  ``n (n - k - 1) / 2`` such pairs of runs, and a uniformly placed R of size ``r`` covers ``k``
  given positions with probability ``r! (n-k)! / ((r-k)! n!)``; the union bound is their product.
* Event 2. For a fixed dropout set of size ``D`` the number of dropped neighbours of a client is
  hypergeometric (``n - 1`` others, ``D`` or ``D - 1`` of them dropped, ``k`` drawn); the union bound
  over the ``n`` clients sums its tails.
* Event 3. ``t`` must exceed ``(k + 1 + a) / 2`` where ``a`` bounds the corrupt neighbours of every
  client except with probability ``2^-(security_log2 + 1)``: then two disjoint sets of honest holders,
  one revealing a peer's ``b`` share and one its ``s_sk`` share, cannot both reach ``t`` even with the
  ``a`` corrupt holders revealing both (Bonawitz et al. 2017's ``t > n/2`` argument, per neighbourhood,
  for a server that lies about who dropped). With ``delta = 0`` this is the strict majority of
  ``k + 1`` holders that :func:`.graph.majority_threshold` has always used.

With ``delta = 0`` event 1 is not a privacy failure here: the server aborts and every client refuses
to unmask when the survivors' graph is disconnected (:meth:`.graph.NeighbourGraph.components`), so
events 1 and 2 only cost the round, and their sum is the ``failure`` bound. With ``delta > 0`` the
corrupt survivors hide a split of the honest ones, so event 1 (with ``gamma + delta`` removed) joins
event 3 in the ``security`` bound.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from dpfl_ray.errors import DPFLError


def _hypergeom_sf(x: int, population: int, marked: int, drawn: int) -> float:
    """P(more than ``x`` marked among ``drawn`` of ``population``)."""
    # scipy.stats costs about half a second to import; only rounds with a dropout fraction need it.
    from scipy.stats import hypergeom

    return float(hypergeom.sf(x, population, marked, drawn))


@dataclass(frozen=True)
class SecAggPlusParameters:
    """A degree and threshold and what they guarantee for ``dropouts = floor(gamma n)`` dropouts.

    ``failure``: probability bound that the round aborts (events 1 + 2), for any set of at most
    ``dropouts`` dropouts chosen independently of the graph. ``security``: probability bound of a
    privacy failure with ``corrupt`` colluding clients (events 1 + 3): 0 with none and a majority
    threshold, 1 when ``t`` is no strict majority (a server lying about who dropped needs no help).
    """

    n: int
    degree: int
    threshold: int
    dropouts: int
    corrupt: int
    failure: float
    security: float

    @property
    def failure_log2(self) -> float:
        return math.log2(self.failure) if self.failure > 0 else -math.inf


def disconnection_bound(n: int, degree: int, removed: int) -> float:
    """Union bound on P(removing ``removed`` uniformly placed clients splits H(n, degree)) (event 1)."""
    if degree == 0:
        return 0.0 if n - removed <= 1 else 1.0
    if degree >= n - 1 or removed < degree:
        return 0.0  # the complete graph never splits; two runs of k/2 need k removed clients
    log_p = (math.log(n) + math.log(n - degree - 1) - math.log(2)
             + math.lgamma(removed + 1) - math.lgamma(removed - degree + 1)
             + math.lgamma(n - degree + 1) - math.lgamma(n + 1))
    return min(1.0, math.exp(log_p))


def shortfall_bound(n: int, degree: int, threshold: int, dropouts: int) -> float:
    """Union bound on P(some client keeps < ``threshold`` surviving holders) (event 2).

    A dropped client's holders are its surviving neighbours; a surviving client also holds its own
    share. Both counts are hypergeometric under a uniformly random relabelling of the clients.
    """
    if dropouts == 0:
        return 0.0 if threshold <= degree + 1 else 1.0
    # P(dropped neighbours > k - t) for a dropped client, P(> k + 1 - t) for a survivor.
    dropped_tail = _hypergeom_sf(degree - threshold, n - 1, dropouts - 1, degree)
    survivor_tail = _hypergeom_sf(degree + 1 - threshold, n - 1, dropouts, degree) if dropouts < n else 0.0
    return min(1.0, dropouts * dropped_tail + (n - dropouts) * survivor_tail)


def collusion_bound(n: int, degree: int, threshold: int, corrupt: int) -> float:
    """Union bound on P(some client has >= 2t - k - 1 corrupt neighbours) (event 3).

    Then the corrupt holders plus two disjoint sets of honest ones could reach ``t`` twice, once
    with ``b`` shares and once with ``s_sk`` shares of one peer; 1 when ``2t <= k + 1`` (a server
    lying about who dropped needs no corrupt client at all).
    """
    if 2 * threshold - degree - 1 <= 0:
        return 1.0
    return min(1.0, n * _hypergeom_sf(2 * threshold - degree - 2, n - 1, corrupt, degree))


def corrupt_neighbours(n: int, degree: int, corrupt: int, security_log2: float) -> int:
    """The smallest ``a`` with ``n * P(corrupt neighbours > a) <= 2^-(security_log2 + 1)``."""
    target = 2.0 ** -(security_log2 + 1) / n
    return next(a for a in range(min(degree, corrupt) + 1)
                if a == min(degree, corrupt) or _hypergeom_sf(a, n - 1, corrupt, degree) <= target)


def threshold_for(degree: int, corrupt_neighbours: int = 0) -> int:
    """``floor((k + 1 + a) / 2) + 1``: a strict majority of the ``k + 1`` holders plus ``a`` corrupt ones."""
    return (degree + 1 + corrupt_neighbours) // 2 + 1


def _count(fraction: float, n: int, field: str) -> int:
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction < 1:
        raise DPFLError(f"must be a fraction in [0, 1), got {fraction!r}", field)
    return math.floor(fraction * n + 1e-9)  # 0.57 * 100 is 56.999...


def evaluate(n: int, degree: int, threshold: int, dropout_fraction: float, *,
             corrupt_fraction: float = 0.0) -> SecAggPlusParameters:
    """The failure and security bounds of a given ``(degree, threshold)`` on H(n, degree)."""
    dropouts = _count(dropout_fraction, n, "dropout_fraction")
    corrupt = _count(corrupt_fraction, n, "corrupt_fraction")
    failure = disconnection_bound(n, degree, dropouts) + shortfall_bound(n, degree, threshold, dropouts)
    security = collusion_bound(n, degree, threshold, corrupt)
    if corrupt:  # corrupt survivors can hide a split of the honest ones from the abort check
        security += disconnection_bound(n, degree, dropouts + corrupt)
    return SecAggPlusParameters(n, degree, threshold, dropouts, corrupt, min(1.0, failure), min(1.0, security))


def _check_log2(value: float, field: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1000:
        raise DPFLError(f"must be a number in (0, 1000], got {value!r}", field)


@functools.lru_cache(maxsize=256)
def secagg_plus_parameters(n: int, dropout_fraction: float, failure_log2: float = 20.0, *,
                           corrupt_fraction: float = 0.0, security_log2: float = 40.0) -> SecAggPlusParameters:
    """The smallest even degree ``k`` (or ``n - 1``, the complete graph) and its threshold ``t`` such
    that at most ``floor(dropout_fraction * n)`` dropouts abort the round with probability at most
    ``2^-failure_log2`` and ``floor(corrupt_fraction * n)`` corrupt clients break privacy with
    probability at most ``2^-security_log2`` (Bell et al. 2020, Sec. 3; bounds in the module docstring).

    Raises :class:`DPFLError` when even the complete graph cannot meet them (e.g. ``gamma >= 1/2``:
    a strict majority of every neighbourhood must survive).
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise DPFLError(f"need at least one client, got {n!r}", "n_clients")
    _check_log2(failure_log2, "failure_log2")
    _check_log2(security_log2, "security_log2")
    corrupt = _count(corrupt_fraction, n, "corrupt_fraction")
    for degree in ([*range(2, n - 1, 2), n - 1] if n > 1 else [0]):
        threshold = threshold_for(degree, corrupt_neighbours(n, degree, corrupt, security_log2))
        if threshold > degree + 1:
            continue
        found = evaluate(n, degree, threshold, dropout_fraction, corrupt_fraction=corrupt_fraction)
        if found.failure <= 2.0 ** -failure_log2 and found.security <= 2.0 ** -security_log2:
            return found
    raise DPFLError(f"no SecAgg+ degree survives {dropout_fraction:g} of {n} clients dropping"
                    + (f" with {corrupt_fraction:g} corrupt" if corrupt else "")
                    + f" (failure <= 2^-{failure_log2:g}): every neighbourhood needs a surviving strict "
                    "majority; lower the dropout fraction", "dropout_fraction")
