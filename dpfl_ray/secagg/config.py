"""Public round configuration shared by server and clients, and message-size accounting."""
from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from dpfl_ray.errors import DPFLError
from dpfl_ray.secagg.errors import SecAggProtocolError
from dpfl_ray.secagg.graph import NeighbourGraph, build_graph
from dpfl_ray.secagg.parameters import SecAggPlusParameters, evaluate

# Rounds of Bonawitz et al. 2017, Fig. 4, without Round 3 (ConsistencyCheck; honest-but-curious).
PHASES = ("advertise", "share", "masked_input", "unmask")
# Z_2^bits: 32 or 64 for fixed-point floats (encoding.py); 8-31 for integer vectors already in a
# smaller ring (ring.py). Fewer than 32 bits are held in uint32 words: 2^bits divides 2^32, so the
# masks, added mod 2^32, cancel mod 2^bits too, and each masked input is reduced mod 2^bits before it
# is sent, so it takes bits, not 32, per coordinate on the wire.
BITS = tuple(range(8, 33)) + (64,)
ID_BYTES = 4  # client ids and round ids on the wire


@dataclass(frozen=True)
class SecAggRoundConfig:
    """Everything public about one round; server and every client must hold an equal copy.

    ``dim`` is optional: when given, clients and server reject vectors of another length.
    ``dropout_fraction`` (SecAgg+ only): the fraction of the round's clients that may drop in all;
    with no explicit ``degree`` it picks ``k`` and ``t`` so that the round aborts with probability
    at most ``2^-failure_log2`` (:func:`~dpfl_ray.secagg.parameters.secagg_plus_parameters`).
    """

    n_clients: int
    bits: int = 32
    protocol: str = "secagg"
    threshold: int | None = None
    round_id: int = 0
    graph_seed: int = 0
    degree: int | None = None
    dim: int | None = None
    dropout_fraction: float | None = None
    failure_log2: float = 20.0

    def __post_init__(self):
        if self.bits not in BITS:
            raise DPFLError(f"bits must be 8-32 or 64, got {self.bits}", "bits")
        if self.dim is not None and self.dim < 1:
            raise DPFLError(f"dim must be >= 1, got {self.dim}", "dim")
        self.graph  # validate protocol / threshold / degree eagerly

    @functools.cached_property
    def graph(self) -> NeighbourGraph:
        return build_graph(self.n_clients, self.protocol, threshold=self.threshold, seed=self.graph_seed,
                           round_id=self.round_id, degree=self.degree, dropout_fraction=self.dropout_fraction,
                           failure_log2=self.failure_log2)

    @property
    def guarantee(self) -> SecAggPlusParameters | None:
        """Degree, threshold and failure bound of this SecAgg+ round at ``dropout_fraction``
        (also for an explicit ``degree`` / ``threshold``); None without a dropout fraction."""
        if self.protocol != "secagg+" or self.dropout_fraction is None:
            return None
        graph = self.graph
        return evaluate(self.n_clients, len(graph.neighbours[0]), min(graph.thresholds), self.dropout_fraction)

    def __getstate__(self) -> dict:
        # The graph is a pure function of the fields; rebuilding it is cheaper than shipping
        # O(n^2) neighbour sets to every worker.
        state = dict(self.__dict__)
        state.pop("graph", None)
        return state

    @property
    def dtype(self) -> np.dtype:
        return word_dtype(self.bits)

    @property
    def below(self) -> int | None:
        """2^bits - 1 when the ring is narrower than its words (the mask that reduces mod 2^bits)."""
        return (1 << self.bits) - 1 if self.bits < 32 else None


def word_dtype(bits: int) -> np.dtype:
    """The unsigned words that hold Z_2^bits."""
    return np.dtype(np.uint64 if bits > 32 else np.uint32)


def reduce_mod(words: np.ndarray, bits: int) -> np.ndarray:
    """``words`` mod 2^bits, in place (a no-op for a ring as wide as its words)."""
    if bits < 32:
        np.bitwise_and(words, np.uint32((1 << bits) - 1), out=words)
    return words


def as_ring_vector(vector: object, config: SecAggRoundConfig, what: str = "input") -> np.ndarray:
    """A fresh 1-D array of dtype uint{bits}; refuses floats and values outside [0, 2^bits)."""
    arr = np.asarray(vector)
    if arr.ndim != 1 or arr.size == 0:
        raise DPFLError(f"{what} must be a non-empty 1-D array, got shape {arr.shape}", what)
    if arr.dtype.kind not in "ui":
        raise DPFLError(f"{what} must hold integers of Z_2^{config.bits} (encode floats first), "
                        f"got dtype {arr.dtype}", what)
    if config.dim is not None and arr.shape[0] != config.dim:
        raise DPFLError(f"{what} has length {arr.shape[0]}, the round expects {config.dim}", what)
    if arr.dtype.itemsize * 8 > config.bits or arr.dtype.kind == "i":
        if arr.min() < 0 or int(arr.max()) >= 1 << config.bits:
            raise DPFLError(f"{what} has values outside [0, 2^{config.bits})", what)
    return arr.astype(config.dtype, copy=True)


def check_round(message: Mapping, config: SecAggRoundConfig) -> None:
    if not isinstance(message, Mapping):
        raise SecAggProtocolError(f"a message must be a dict, got {type(message).__name__}")
    if message.get("round_id") != config.round_id:
        raise SecAggProtocolError(f"message of round {message.get('round_id')!r}, this is round {config.round_id}")


def wire_size(obj: object, bits: int | None = None) -> int:
    """Bytes ``obj`` takes on the wire: raw bytes and arrays at their length, ids at 4 bytes.

    Counts payload only (no framing, field names free): a public key is 32 B, a masked vector
    ``ceil(dim * bits / 8)`` (``bits``: the round's ring; its words packed), a sealed share pair
    12 + 2 * 66 + 16 = 160 B, a revealed share 66 B.
    """
    if obj is None:
        return 0
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return len(obj)
    if isinstance(obj, np.ndarray):
        if bits is not None and obj.dtype.kind == "u":
            return -(-int(obj.size) * bits // 8)
        return int(obj.nbytes)
    if isinstance(obj, (bool, int, np.integer)):
        return ID_BYTES
    if isinstance(obj, (float, np.floating)):
        return 8
    if isinstance(obj, str):
        return 0  # field names are schema, not payload
    if isinstance(obj, Mapping):
        return sum(wire_size(k, bits) + wire_size(v, bits) for k, v in obj.items())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return sum(wire_size(v, bits) for v in obj)
    raise TypeError(f"cannot size a {type(obj).__name__} message part")
