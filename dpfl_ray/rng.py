"""Every random stream is derived from ``(seed, round, client_id, purpose)`` (ARCHITECTURE.md, principle 5).

A stream therefore never depends on which worker ran a client or in which order replies came back.
"""
from __future__ import annotations

import hashlib

import numpy as np

# Distinct integers per purpose; new purposes go at the end so old streams keep their values.
_PURPOSES = (
    "init", "partition", "sample", "faults", "batches", "torch", "noise", "calibration",
    "secagg", "graph", "encode", "clip", "layers",
    # fault injection (issue 12)
    "stragglers", "straggler_tiers", "crash", "node_failure", "corrupt",
    # NbAFL's noise (issue 10); record-level DP-SGD, DPAGD and Adap DP-FL (issue 13)
    "uplink", "downlink", "dpsgd_lots", "dpsgd_noise", "dpagd_noise", "dpagd_argmax", "fu_initial_clip",
    "validation",
)
# Ids of purposes not listed above start here, so listing a new purpose never moves another stream.
_HASHED_BASE = 1 << 16


def purpose_id(purpose: str) -> int:
    if purpose in _PURPOSES:
        return _PURPOSES.index(purpose)
    # Unknown purposes still get a stable, collision-resistant id.
    return int.from_bytes(hashlib.sha256(purpose.encode()).digest()[:4], "little") + _HASHED_BASE


def seed_sequence(seed: int, purpose: str, round_idx: int = -1, client_id: int = -1) -> np.random.SeedSequence:
    """The SeedSequence of one stream; ``-1`` means 'not tied to a round / client'."""
    return np.random.SeedSequence([int(seed), purpose_id(purpose), int(round_idx) + 1, int(client_id) + 1])


def generator(seed: int, purpose: str, round_idx: int = -1, client_id: int = -1) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(seed_sequence(seed, purpose, round_idx, client_id)))


def int_seed(seed: int, purpose: str, round_idx: int = -1, client_id: int = -1) -> int:
    """A 63-bit integer seed (for ``torch.Generator.manual_seed``)."""
    return int(seed_sequence(seed, purpose, round_idx, client_id).generate_state(1, np.uint64)[0] >> np.uint64(1))
