"""Who shares secrets and masks with whom, and the reconstruction threshold of each client.

* ``protocol='secagg'`` (Bonawitz et al. 2017): the complete graph, one global threshold. The
  default ``t = floor(2n/3) + 1`` is Bonawitz et al.'s bound (Sec. 6, active adversary) for a
  server that may lie about who dropped, colluding with fewer than n/3 clients; with honest
  clients any ``t > n/2`` already stops a lying server from collecting both kinds of share of
  one peer, because two disjoint sets of responders could not both reach ``t``. The price:
  the round survives at most ``n - t`` (about n/3) dropouts.
* ``protocol='secagg+'`` (Bell et al. 2020): a random Harary graph H(n, k) -- the circulant
  graph with offsets 1..k/2 laid on a uniformly random permutation of the clients -- so every
  client has exactly ``k`` neighbours and the graph is symmetric. Each client's threshold is a
  strict majority of its neighbourhood including itself, ``t_i = floor((k_i + 1) / 2) + 1``, the
  local analogue of ``t > n/2``. With a dropout fraction ``gamma`` (``dropout_fraction``), ``k``
  is the smallest even degree for which Bell et al.'s bounds promise that ``floor(gamma n)``
  dropouts abort the round with probability at most ``2^-failure_log2``
  (:func:`.parameters.secagg_plus_parameters`). Without it the degree is
  ``k = min(n - 1, ceil(c * log2 n))`` rounded up to even, ``c = DEFAULT_DEGREE_FACTOR = 8``,
  which carries no stated guarantee (with 30 % random dropouts 0.3 % of the rounds aborted at
  n = 1000, k = 80, in 5000 simulations).
* Both: a round also needs the survivors' graph -- the graph restricted to the clients whose
  masked input arrived -- to be connected (:meth:`NeighbourGraph.components`), or the server could
  unmask the sum of one part alone. With SecAgg+ a server choosing ``k`` dropouts can split it
  (two runs of ``k/2`` ring neighbours around a block), so the server aborts and every client
  refuses to unmask such a survivor set.

The graph is public, so it is drawn with NumPy from ``dpfl_ray.rng.seed_sequence(seed, 'graph',
round_id)``; server and clients rebuild the identical graph from the public configuration.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from dpfl_ray.errors import DPFLError
from dpfl_ray.rng import seed_sequence
from dpfl_ray.secagg.parameters import secagg_plus_parameters

PROTOCOLS = ("secagg", "secagg+")
DEFAULT_DEGREE_FACTOR = 8.0


def default_threshold(n: int) -> int:
    """Bonawitz et al.'s ``floor(2n/3) + 1``, capped at ``n``."""
    return min(n, 2 * n // 3 + 1)


def majority_threshold(neighbourhood_size: int) -> int:
    """Strict majority of a neighbourhood that includes the client itself."""
    return neighbourhood_size // 2 + 1


def secagg_plus_degree(n: int, factor: float = DEFAULT_DEGREE_FACTOR) -> int:
    """``min(n - 1, ceil(factor * log2 n))`` rounded up to even (Bell et al. 2020: k = O(log n))."""
    if n <= 1:
        return 0
    k = math.ceil(factor * math.log2(n))
    k += k % 2
    return min(n - 1, k)


def complete_graph(n: int) -> tuple[frozenset[int], ...]:
    everyone = frozenset(range(n))
    return tuple(everyone - {i} for i in range(n))


def random_harary_graph(n: int, degree: int,
                        rng: np.random.Generator) -> tuple[tuple[frozenset[int], ...], tuple[int, ...]]:
    """A uniformly relabelled Harary graph H(n, degree) and its ring order; ``degree`` even and < n - 1."""
    if degree < 0 or degree % 2:
        raise DPFLError(f"a Harary graph below the complete graph needs an even degree, got {degree}", "degree")
    order = rng.permutation(n)
    neighbours: list[set[int]] = [set() for _ in range(n)]
    # Offsets 1..k/2 with k/2 < n/2 are distinct mod n in both directions: exactly k-regular.
    for pos in range(n):
        i = int(order[pos])
        for offset in range(1, degree // 2 + 1):
            j = int(order[(pos + offset) % n])
            neighbours[i].add(j)
            neighbours[j].add(i)
    return tuple(frozenset(s) for s in neighbours), tuple(int(i) for i in order)


@dataclass(frozen=True)
class NeighbourGraph:
    """``neighbours[i]`` excludes ``i``; ``thresholds[i]`` applies to the secrets of client ``i``.

    ``ring``: the Harary graph's clients in ring order (empty for the complete graph); any rotation
    or reflection describes the same graph, so it takes no part in equality.
    """

    protocol: str
    neighbours: tuple[frozenset[int], ...]
    thresholds: tuple[int, ...]
    ring: tuple[int, ...] = field(default=(), compare=False, repr=False)

    @property
    def n(self) -> int:
        return len(self.neighbours)

    def holders(self, i: int) -> frozenset[int]:
        """The clients holding shares of ``i``'s secrets: its neighbours and itself."""
        return self.neighbours[i] | {i}

    def components(self, members: Iterable[int]) -> int:
        """Connected components of the graph restricted to ``members`` (ids in ``0..n-1``).

        The server can unmask the sum of any union of components on its own (Bell et al. 2020,
        Sec. 3), so a round needs exactly one. On a ring with offsets ``1..k/2`` two members are
        linked iff fewer than ``k/2`` ring positions lie between them, so the components are the
        arcs between runs of at least ``k/2`` missing positions: O(m log m), no graph search.
        """
        members = np.unique(np.fromiter(members, dtype=np.int64))
        if members.size <= 1 or not self.ring:  # the complete graph keeps any non-empty set whole
            return int(members.size > 0)
        position = np.empty(self.n, dtype=np.int64)
        position[np.asarray(self.ring)] = np.arange(self.n)
        ring_positions = np.sort(position[members])
        missing = np.diff(ring_positions, append=ring_positions[0] + self.n) - 1
        gaps = int(np.count_nonzero(missing >= len(self.neighbours[0]) // 2))
        return max(gaps, 1)


def build_graph(n: int, protocol: str = "secagg", *, threshold: int | None = None, seed: int = 0,
                round_id: int = 0, degree: int | None = None, degree_factor: float = DEFAULT_DEGREE_FACTOR,
                dropout_fraction: float | None = None, failure_log2: float = 20.0) -> NeighbourGraph:
    """The public neighbour graph and thresholds; see the module docstring for the defaults.

    With ``dropout_fraction`` (Bell et al.'s gamma) and no ``degree``, SecAgg+ takes ``k`` and ``t``
    from :func:`.parameters.secagg_plus_parameters`; an explicit ``degree`` or ``threshold`` wins.
    """
    if n < 1:
        raise DPFLError(f"need at least one client, got {n}", "n_clients")
    ring: tuple[int, ...] = ()
    plus_threshold = None
    if protocol == "secagg":
        if degree is not None and degree != n - 1:
            raise DPFLError("protocol 'secagg' uses the complete graph; degree applies to 'secagg+'", "degree")
        if dropout_fraction is not None:
            raise DPFLError("dropout_fraction picks the degree of 'secagg+'; 'secagg' uses the complete graph "
                            "(set its threshold instead)", "dropout_fraction")
        neighbours = complete_graph(n)
    elif protocol == "secagg+":
        if degree is None and dropout_fraction is not None:
            chosen = secagg_plus_parameters(n, dropout_fraction, failure_log2)
            degree, plus_threshold = chosen.degree, chosen.threshold
        elif degree is None:
            degree = secagg_plus_degree(n, degree_factor)
        if not 0 <= degree <= n - 1:
            raise DPFLError(f"degree must be in 0..{n - 1}, got {degree}", "degree")
        if degree >= n - 1:
            neighbours = complete_graph(n)
        else:
            rng = np.random.Generator(np.random.PCG64(seed_sequence(seed, "graph", round_id)))
            neighbours, ring = random_harary_graph(n, degree, rng)
    else:
        raise DPFLError(f"unknown protocol {protocol!r}; expected one of {PROTOCOLS}", "protocol")

    sizes = [len(s) + 1 for s in neighbours]
    if threshold is None:
        thresholds = ([default_threshold(n)] * n if protocol == "secagg"
                      else [plus_threshold or majority_threshold(size) for size in sizes])
    else:
        if not 1 <= threshold <= min(sizes):
            raise DPFLError(f"threshold must be in 1..{min(sizes)} (smallest neighbourhood incl. self), "
                            f"got {threshold}", "threshold")
        thresholds = [int(threshold)] * n
    return NeighbourGraph(protocol, neighbours, tuple(thresholds), ring)
