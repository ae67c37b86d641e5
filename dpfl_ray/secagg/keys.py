"""Cryptographic primitives of the protocol (Bonawitz et al. 2017, Sec. 3 and Fig. 4 notation).

* ``KA``: X25519 key agreement, the raw shared point passed through HKDF-SHA256 whose ``info``
  binds a domain tag, the purpose, the round id and the two client ids in ascending order, so
  ``KA(u, v) == KA(v, u)`` and no key is ever valid in another round, pair or role.
* ``AE``: ChaCha20-Poly1305 with a fresh random 96-bit nonce; the associated data binds sender,
  receiver and round, so a share cannot be replayed to another client or round.
* ``PRG``: the ChaCha20 keystream under a 32-byte seed, read as little-endian uint32/uint64 words.

Messages carry only raw bytes; key objects are rebuilt on demand, which keeps clients picklable.
"""
from __future__ import annotations

import functools
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from dpfl_ray.secagg.errors import SecAggProtocolError, ShareAuthenticationError

KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
_DOMAIN = b"dpfl-ray/secagg/v1"
PURPOSE_ENCRYPTION = b"share-encryption"
PURPOSE_MASK = b"pairwise-mask"
# The keystream counter starts at 0 with an all-zero nonce: every seed expands exactly one stream
# (b_i is fresh per round, s_ij is bound to round and pair by HKDF), so a fixed nonce is safe.
_PRG_NONCE = bytes(16)
_WORD = {32: np.dtype("<u4"), 64: np.dtype("<u8")}


@dataclass(frozen=True)
class KeyPair:
    """Raw X25519 key pair; ``repr`` hides the private half."""

    private: bytes
    public: bytes

    def __repr__(self) -> str:
        return f"KeyPair(public={self.public.hex()})"


def generate_keypair() -> KeyPair:
    key = X25519PrivateKey.generate()
    private = key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return KeyPair(private, public)


def public_key_of(private: bytes) -> bytes:
    key = X25519PrivateKey.from_private_bytes(private)
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def check_public_key(public: object, owner: int) -> bytes:
    if not isinstance(public, bytes) or len(public) != KEY_BYTES:
        raise SecAggProtocolError(f"public key of client {owner} is not {KEY_BYTES} raw bytes", client=owner)
    return public


def _info(purpose: bytes, round_id: int, id_a: int, id_b: int) -> bytes:
    lo, hi = sorted((int(id_a), int(id_b)))
    return _DOMAIN + struct.pack("<B", len(purpose)) + purpose + struct.pack("<qqq", int(round_id), lo, hi)


def derive_keys(private: bytes, own_id: int, peer_publics: Mapping[int, bytes], *,
                purpose: bytes, round_id: int) -> dict[int, bytes]:
    """``{peer: HKDF(X25519(private, peer_public))}`` -- 32-byte keys, symmetric in the two ids."""
    key = X25519PrivateKey.from_private_bytes(private)
    out = {}
    for peer, public in peer_publics.items():
        try:
            shared = key.exchange(X25519PublicKey.from_public_bytes(public))
        except ValueError as exc:  # low-order point: the shared secret would be all zeros
            raise SecAggProtocolError(f"public key of client {peer} is invalid: {exc}", client=peer) from exc
        out[peer] = HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None,
                         info=_info(purpose, round_id, own_id, peer)).derive(shared)
    return out


def _associated_data(sender: int, receiver: int, round_id: int) -> bytes:
    return _DOMAIN + b"/share" + struct.pack("<qqq", int(round_id), int(sender), int(receiver))


def seal(key: bytes, plaintext: bytes, *, sender: int, receiver: int, round_id: int) -> bytes:
    """``nonce || ChaCha20-Poly1305(plaintext)`` with (sender, receiver, round) authenticated."""
    nonce = os.urandom(NONCE_BYTES)
    return nonce + ChaCha20Poly1305(key).encrypt(nonce, plaintext, _associated_data(sender, receiver, round_id))


def open_sealed(key: bytes, ciphertext: bytes, *, sender: int, receiver: int, round_id: int) -> bytes:
    """Inverse of :func:`seal`; any flipped bit raises :class:`ShareAuthenticationError`."""
    if not isinstance(ciphertext, bytes) or len(ciphertext) < NONCE_BYTES + TAG_BYTES:
        raise ShareAuthenticationError(f"ciphertext from client {sender} is truncated", sender=sender,
                                       receiver=receiver)
    nonce, body = ciphertext[:NONCE_BYTES], ciphertext[NONCE_BYTES:]
    try:
        return ChaCha20Poly1305(key).decrypt(nonce, body, _associated_data(sender, receiver, round_id))
    except InvalidTag as exc:
        raise ShareAuthenticationError(
            f"share from client {sender} to client {receiver} failed authentication", sender=sender,
            receiver=receiver) from exc


@functools.lru_cache(maxsize=4)
def _zeros(nbytes: int) -> bytes:
    return bytes(nbytes)


def prg(seed: bytes, dim: int, bits: int) -> np.ndarray:
    """``dim`` words of the ChaCha20 keystream under ``seed`` (one cipher call per seed)."""
    if len(seed) != KEY_BYTES:
        raise SecAggProtocolError(f"a PRG seed must be {KEY_BYTES} bytes, got {len(seed)}")
    word = _WORD[bits]
    stream = Cipher(algorithms.ChaCha20(seed, _PRG_NONCE), mode=None).encryptor().update(_zeros(dim * word.itemsize))
    return np.frombuffer(stream, dtype=word)


def add_prg(acc: np.ndarray, seed: bytes, sign: int = 1) -> None:
    """``acc += sign * PRG(seed)`` in place, wrapping mod 2^bits."""
    words = prg(seed, acc.shape[0], acc.dtype.itemsize * 8)
    (np.add if sign > 0 else np.subtract)(acc, words, out=acc)


def expand_masks(masks: Sequence[tuple[bytes, int]], dim: int, dtype: str) -> np.ndarray:
    """sum of sign * PRG(seed) over ``masks`` mod 2^bits: the masks the server removes. Wrapping
    sums are exact and commute, so any split of ``masks`` (summed again) gives the same words."""
    acc = np.zeros(dim, dtype=np.dtype(dtype))
    for seed, sign in masks:
        add_prg(acc, seed, sign)
    return acc
