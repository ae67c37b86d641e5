"""A round run twice must release the same values, or nothing.

A resumed run (a lost coordinator, a killed driver, a sweep trial's next attempt) runs again the
rounds after its last checkpoint; the server may have seen their first release. Their noise is
drawn again from the same source (the seed, or the kept ``os`` secret: runtime/checkpoint.py), so
the ledger, which books a round once, is right only if the second release is the same as the
first: the same model going out, the same clients' inputs in the sum, the same clients' calibration
terms (Baek et al. Alg. 2 line 22). Two sums with the same noise and other inputs give the server
their difference: under central noise the differing clients' updates with no noise at all.

Each released round's :func:`release_check` digests of those three things (keyed, so that they
tell a reader nothing of the secret sample) go to ``releases.jsonl`` before the server could see
what they describe (runs/record.py, RELEASES), which a resume keeps; :class:`RerunGuard` compares
a rerun round's with them where each is known and nothing new is sent or unmasked, and the
coordinator stops the run instead of releasing a round that differs, or that released before and
would release nothing now (docs/sensitivity.md).
"""
from __future__ import annotations

import hashlib
import hmac
from typing import Iterable, Mapping

import numpy as np

# what each digest covers, in the order the round learns it
PARTS = ("model", "survivors", "calibration")
_WHAT = {"model": "another model (an earlier round went otherwise, or this host's CPU computed other bits)",
         "survivors": "other surviving clients",
         "calibration": "other clients' calibration terms"}


def rerun_key(randomness) -> bytes:
    """The digests' key: a secret of the run's DP randomness (privacy/randomness.py), the seed's in
    mode 'reproducible'."""
    return randomness.child("reruns").secret("release_check", -1, -1, 0)


def release_check(key: bytes, round_number: int, part: str, value: np.ndarray | Iterable[int]) -> str:
    """A 128-bit keyed digest of one part of round ``round_number``'s release: the model's bits, or
    the sorted client ids."""
    if part not in PARTS:
        raise ValueError(f"unknown release part {part!r}")
    if part == "model":
        body = np.ascontiguousarray(value, dtype=np.float32).tobytes()
    else:
        body = ",".join(str(int(c)) for c in sorted(value)).encode()
    msg = f"{round_number}|{part}|".encode() + hashlib.sha256(body).digest()
    return hmac.new(key, msg, hashlib.sha256).hexdigest()[:32]


class RerunDiverged(Exception):
    """A rerun round would release otherwise than before: the run stops (its message says why)."""


class RerunGuard:
    """The checks of one run: ``key`` from its DP randomness, ``released``: round number -> the
    digests of that round's first release (runs/record.py, ``read_releases``)."""

    def __init__(self, key: bytes, released: Mapping[int, Mapping[str, str | None]] | None = None):
        self.key = key
        self.released = {int(r): dict(v) for r, v in (released or {}).items()}
        self.current: dict[str, str] = {}

    def begin(self, round_number: int) -> None:
        self.current, self.round = {}, round_number

    def check(self, part: str, value) -> str | None:
        """Digest ``part`` of the round in flight; why it must not be released when an earlier
        attempt of the same round listed another one, else None. An attempt whose line says it
        released nothing (``released: false``) constrains only the model; one that ended before
        its commit (no ``released``) only the parts it listed."""
        digest = self.current[part] = release_check(self.key, self.round, part, value)
        before = self.released.get(self.round)
        if not before or (before.get("released") is False and part != "model"):
            return None
        if before.get(part, None if before.get("released") else digest) != digest:
            return (f"round {self.round} ran again after a resume with {_WHAT[part]} than in the release "
                    f"the server saw before; with the same noise a second release would give it their "
                    f"difference, so nothing was released")
        return None

    def released_before(self) -> bool:
        """May an earlier attempt have released the round in flight (it listed the round and did
        not say it released nothing)?"""
        before = self.released.get(self.round)
        return bool(before) and before.get("released") is not False  # runs/record.py, may_have_released

    def nothing_now(self) -> str:
        """Why a round released before must not go by without a release now: the ledger would miss
        the release the server saw, and every later round's model would differ from that attempt's."""
        return (f"round {self.round} was released before the resume and releases nothing this time; the "
                f"ledger would miss the release the server saw")
