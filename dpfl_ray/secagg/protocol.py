"""Full protocol runs over in-memory message passing (Bonawitz et al. 2017, Fig. 4 without Round 3;
SecAgg+ of Bell et al. 2020 with ``protocol='secagg+'``).

The state machines live in :mod:`.client` and :mod:`.server` and are re-exported here, so a
runtime can host ``SecAggClient`` objects on workers and a ``SecAggServer`` on the coordinator and
move the (picklable) message dicts itself; :func:`secure_sum` is the single-process reference.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from dpfl_ray.errors import DPFLError
from dpfl_ray.secagg.client import SecAggClient
from dpfl_ray.secagg.config import PHASES, SecAggRoundConfig, as_ring_vector, reduce_mod, word_dtype
from dpfl_ray.secagg.server import SecAggServer

__all__ = ["PHASES", "SecAggClient", "SecAggRoundConfig", "SecAggResult", "SecAggServer", "presum_masked", "secure_sum"]


@dataclass(frozen=True)
class SecAggResult:
    """Outcome of one round.

    ``sum`` is ``sum_{u in survivors} x_u mod 2^bits``; ``survivors`` are the clients whose masked
    input reached the server (U_3) -- a client that dropped at 'unmask' is among them.
    ``seconds_by_phase`` has the keys of :data:`PHASES` plus ``'reconstruct'`` and is wall time of
    the sequential simulation (all clients plus server); ``max_client_seconds_by_phase`` is the
    slowest single client, i.e. what a phase would take with clients running in parallel.
    """

    sum: np.ndarray
    survivors: tuple[int, ...]
    dropped_by_phase: dict[str, tuple[int, ...]]
    seconds_by_phase: dict[str, float]
    bytes_per_client: dict[int, int]
    server_bytes_received: int
    server_bytes_sent: int = 0
    max_client_seconds_by_phase: dict[str, float] | None = None
    rejected_shares: tuple[tuple[int, int], ...] = ()


def presum_masked(messages: Iterable[Mapping], bits: int) -> dict:
    """Fold several masked-input messages of one worker into one (ids concatenated, vectors added)."""
    messages = list(messages)
    if not messages:
        raise DPFLError("nothing to pre-sum", "messages")
    dtype = word_dtype(bits)
    rounds = {m.get("round_id") for m in messages}
    if len(rounds) != 1:
        raise DPFLError(f"masked inputs of different rounds {sorted(map(str, rounds))}", "round_id")
    total = np.array(messages[0]["masked"], dtype=dtype, copy=True)
    ids = list(messages[0]["clients"])
    for m in messages[1:]:
        np.add(total, np.asarray(m["masked"], dtype=dtype), out=total)
        ids.extend(m["clients"])
    return {"round_id": rounds.pop(), "clients": ids, "masked": reduce_mod(total, bits)}


def _check_dropouts(dropouts: Mapping[int, str] | None, n: int) -> dict[int, int]:
    """``{client: index of the first phase in which it sends nothing}``."""
    out = {}
    for u, phase in (dropouts or {}).items():
        if phase not in PHASES:
            raise DPFLError(f"dropout phase {phase!r} of client {u} is not one of {PHASES}", "dropouts")
        if not 0 <= int(u) < n:
            raise DPFLError(f"dropout for client {u}, but clients are 0..{n - 1}", "dropouts")
        out[int(u)] = PHASES.index(phase)
    return out


def secure_sum(vectors: Sequence[np.ndarray], *, bits: int, protocol: str = "secagg",
               threshold: int | None = None, dropouts: Mapping[int, str] | None = None, round_id: int = 0,
               graph_seed: int = 0, degree: int | None = None, dropout_fraction: float | None = None,
               failure_log2: float = 20.0) -> SecAggResult:
    """Run one round with real keys for ``len(vectors)`` clients; client ``u`` inputs ``vectors[u]``.

    ``dropouts[u] = phase`` makes ``u`` send nothing from that phase on. Raises
    :class:`~dpfl_ray.secagg.errors.SecAggAbort` when a threshold cannot be met or the survivors'
    graph is disconnected. Defaults of ``threshold`` and ``degree``, and how ``dropout_fraction``
    picks them: see :mod:`dpfl_ray.secagg.graph`.
    """
    n = len(vectors)
    if n < 1:
        raise DPFLError("secure_sum needs at least one vector", "vectors")
    dims = {np.shape(v) for v in vectors}
    if len(dims) != 1:
        raise DPFLError(f"all vectors must have one shape, got {sorted(dims)}", "vectors")
    config = SecAggRoundConfig(n_clients=n, bits=bits, protocol=protocol, threshold=threshold, round_id=round_id,
                          graph_seed=graph_seed, degree=degree, dim=int(np.shape(vectors[0])[0]),
                          dropout_fraction=dropout_fraction, failure_log2=failure_log2)
    inputs = [as_ring_vector(v, config, "vectors") for v in vectors]
    leaves = _check_dropouts(dropouts, n)
    clients = [SecAggClient(u, config) for u in range(n)]
    server = SecAggServer(config)
    wall = dict.fromkeys(PHASES, 0.0)
    slowest = dict.fromkeys(PHASES, 0.0)

    def run(phase: str, ids: Iterable[int], call) -> dict[int, dict]:
        """Call ``call(client)`` for the clients still online in ``phase``; time each call."""
        replies = {}
        for u in ids:
            if leaves.get(u, len(PHASES)) <= PHASES.index(phase):
                continue
            start = time.perf_counter()
            replies[u] = call(clients[u])
            spent = time.perf_counter() - start
            wall[phase] += spent
            slowest[phase] = max(slowest[phase], spent)
        return replies

    adverts = run("advertise", range(n), lambda c: c.advertise_keys())
    keys = server.receive_keys(adverts.values())
    shares = run("share", sorted(adverts), lambda c: c.share_keys(keys))
    forwarded = server.receive_shares(shares.values())
    masked = run("masked_input", sorted(forwarded), lambda c: c.masked_input(forwarded[c.id], inputs[c.id]))
    request = server.receive_masked(masked.values())
    answers = run("unmask", request["survivors"], lambda c: c.unmask(request))
    total = server.receive_unmask(answers.values())

    seconds = {phase: wall[phase] + server.seconds[phase] for phase in PHASES}
    seconds["reconstruct"] = server.seconds["reconstruct"]
    dropped_by_phase = {phase: tuple(sorted(u for u, k in leaves.items() if k == i)) for i, phase in enumerate(PHASES)}
    return SecAggResult(
        sum=total,
        survivors=tuple(sorted(server.u3)),
        dropped_by_phase=dropped_by_phase,
        seconds_by_phase=seconds,
        bytes_per_client={c.id: c.bytes_sent for c in clients},
        server_bytes_received=server.bytes_received,
        server_bytes_sent=server.bytes_sent,
        max_client_seconds_by_phase=slowest,
        rejected_shares=tuple(server.rejected_shares),
    )
