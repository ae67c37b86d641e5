"""Where the randomness of every DP noise draw and every noise-layer seed comes from.

``privacy.randomness: reproducible`` (the default, for simulation): every stream is derived from
``(scenario seed, purpose, round, client)`` (:mod:`dpfl_ray.rng`), so a run repeats bit for bit --
and anyone who knows the scenario seed knows the noise. ``os``: one 32-byte root secret is drawn
from ``os.urandom`` when the run starts (kept in the run directory only while the run can be resumed:
runtime/checkpoint.py, ``run_secret``); each stream's key is derived
from it with HKDF-SHA256 bound to (purpose, round, client), and the stream itself is the ChaCha20
keystream under that key (the ``cryptography`` package), turned into normal draws by the
Box-Muller transform (uniforms, Laplace draws and permutations come from the same keystream).
Floating-point attacks on the transform (Mironov 2012) are out of scope.

Every DP draw goes through :meth:`DPRandomness.generator`: the client- and server-side Gaussian
noise, record-level DP-SGD's lots and noise and DPAGD's noise and Laplace arg-max
(:class:`dpfl_ray.training.local_dp.TorchNormal` turns a stream into tensors), and the client sample whose
secrecy the ledger's amplification by sampling assumes.
"""
from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from dpfl_ray import rng as rngmod

MODES = ("reproducible", "os")
_DOMAIN = b"dpfl-ray/dp-randomness/v1"


def _derive(key: bytes, label: str) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                info=_DOMAIN + b"|" + label.encode()).derive(key)


class ChaChaNormal:
    """Draws from the ChaCha20 keystream under ``key`` (a cryptographic PRG).

    Mirrors the part of ``numpy.random.Generator`` the DP code uses: ``standard_normal``,
    ``random``, ``integers``, ``laplace`` and ``permutation``.
    """

    def __init__(self, key: bytes):
        self._stream = Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None).encryptor()

    def _words(self, n: int) -> np.ndarray:
        return np.frombuffer(self._stream.update(bytes(8 * n)), dtype="<u8")

    def _uniform(self, n: int) -> np.ndarray:
        # 53 random bits -> (0, 1]: log() below never sees 0
        return ((self._words(n) >> np.uint64(11)).astype(np.float64) + 1.0) * 2.0 ** -53

    def random(self, size=None):
        """Uniform on [0, 1), 53 bits each (what ``rng.random(n) < q`` needs for Poisson sampling)."""
        n = 1 if size is None else int(np.prod(size))
        u = (self._words(n) >> np.uint64(11)).astype(np.float64) * 2.0 ** -53
        return float(u[0]) if size is None else u.reshape(size)

    def integers(self, low, high=None, size=None):
        """Integers uniform on [low, high) exactly (``high`` may be an array, every bound below 2^63):
        each draw is a 64-bit word, drawn again while it falls in the top 2^64 mod (high - low) words."""
        low, high = (0, low) if high is None else (low, high)
        span = np.asarray(high, dtype=np.int64) - np.asarray(low, dtype=np.int64)
        if np.any(span <= 0):
            raise ValueError("integers needs high > low")
        shape = np.broadcast_shapes(span.shape, () if size is None else tuple(np.atleast_1d(size).tolist()))
        span = span.astype(np.uint64)
        if span.ndim:  # a bound per draw; one bound stays a scalar
            span = np.broadcast_to(span, shape).ravel()
        limit = (np.uint64(2 ** 64 - 1) // span) * span  # words below it map uniformly onto [0, span)
        words = self._words(math.prod(shape)).copy()
        # the rejected words are drawn again, in order, until each is below its limit
        todo = np.flatnonzero(words >= limit)
        while todo.size:
            words[todo] = self._words(todo.size)
            todo = todo[words[todo] >= (limit[todo] if limit.ndim else limit)]
        draws = (words % span).astype(np.int64).reshape(shape) + np.asarray(low, dtype=np.int64)
        return int(draws) if size is None and draws.ndim == 0 else draws

    def laplace(self, loc=0.0, scale=1.0, size=None):
        """Laplace(loc, scale) as the difference of two Exp(1) draws, -log of (0, 1] uniforms."""
        n = 1 if size is None else int(np.prod(size))
        draws = loc + scale * (np.log(self._uniform(n)) - np.log(self._uniform(n)))
        return float(draws[0]) if size is None else draws.reshape(size)

    def permutation(self, n: int) -> np.ndarray:
        """A uniformly random permutation of range(n): the order of n random 64-bit keys (two keys
        are equal with probability below n^2 / 2^65, the only departure from uniform)."""
        return np.argsort(self._words(int(n)), kind="stable")

    def standard_normal(self, size=None, dtype=np.float64):
        n = 1 if size is None else int(np.prod(size))
        half = (n + 1) // 2
        u1, u2 = self._uniform(half), self._uniform(half)
        radius = np.sqrt(-2.0 * np.log(u1))
        draws = np.concatenate([radius * np.cos(2 * math.pi * u2), radius * np.sin(2 * math.pi * u2)])[:n]
        draws = draws.astype(dtype, copy=False)
        return float(draws[0]) if size is None else draws.reshape(size)


@dataclass(frozen=True)
class DPRandomness:
    """The source of DP randomness of one run; picklable, so workers draw client noise from it.

    ``root`` (mode 'os') is the run's secret; ``repr`` hides it.
    """

    mode: Literal["reproducible", "os"]
    seed: int
    root: bytes | None = field(default=None, repr=False)

    @classmethod
    def create(cls, mode: str, seed: int, root: bytes | None = None) -> "DPRandomness":
        """``root``: the run's secret in mode 'os' (a resumed run's, so that it redraws the noise of
        the rounds it runs again); a fresh one from ``os.urandom`` when None."""
        if mode not in MODES:
            raise ValueError(f"unknown randomness mode {mode!r}")
        if mode != "os":
            return cls(mode, int(seed))
        if root is not None and len(root) != 32:
            raise ValueError(f"the DP root secret has {len(root)} bytes, not 32")
        return cls(mode, int(seed), os.urandom(32) if root is None else bytes(root))

    @classmethod
    def for_run(cls, scenario, given: "DPRandomness | None" = None) -> "DPRandomness":
        """``given`` (the coordinator's, from the run's kept secret), else a source of the scenario's
        mode and seed: what an algorithm built outside a run (a test, ``dpfl privacy``) draws from."""
        return given if given is not None else cls.create(scenario.privacy.randomness, scenario.seed)

    def child(self, label: str) -> "DPRandomness":
        """An independent source for one part of the run (the client sample, the algorithm's noise):
        in mode 'os' its root is derived from this one; 'reproducible' streams are already told apart
        by their purpose, so it is this source itself."""
        if self.mode != "os":
            return self
        return DPRandomness(self.mode, self.seed, _derive(self.root, f"child|{label}"))

    def generator(self, purpose: str, round_idx: int = -1, client_id: int = -1):
        """A stream with ``standard_normal``: numpy's seeded PCG64 (reproducible) or ChaCha20 (os)."""
        if self.mode == "reproducible":
            return rngmod.generator(self.seed, purpose, round_idx, client_id)
        return ChaChaNormal(_derive(self.root, f"stream|{purpose}|{round_idx}|{client_id}"))

    def secret(self, purpose: str, round_idx: int, client_id: int, index: int) -> bytes:
        """A 32-byte secret, e.g. the PRG seed of one noise layer that SecAgg Shamir-shares."""
        if self.mode == "reproducible":
            # the message format predates this class; keep it so runs stay bit-identical
            return hashlib.sha256(f"dpfl-{purpose}|{self.seed}|{round_idx}|{client_id}|{index}".encode()).digest()
        return _derive(self.root, f"secret|{purpose}|{round_idx}|{client_id}|{index}")
