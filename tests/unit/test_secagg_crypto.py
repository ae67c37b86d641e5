"""Shamir sharing, key agreement, share encryption and the mask PRG."""
from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpfl_ray.secagg import ShamirError, ShareAuthenticationError, shamir
from dpfl_ray.secagg.keys import (
    PURPOSE_ENCRYPTION, PURPOSE_MASK, derive_keys, generate_keypair, open_sealed, prg, public_key_of, seal,
)


@settings(max_examples=50, deadline=None)
@given(st.binary(min_size=32, max_size=32), st.integers(1, 8), st.integers(0, 4), st.data())
def test_any_t_shares_reconstruct_and_fewer_are_refused(secret, t, extra, data):
    xs = data.draw(st.lists(st.integers(1, 10**6), min_size=t + extra, max_size=t + extra, unique=True))
    shares = shamir.split(shamir.secret_to_int(secret), t, xs)
    subset = data.draw(st.lists(st.sampled_from(xs), min_size=t, max_size=t, unique=True))
    value = shamir.reconstruct({x: shares[x] for x in subset}, t)
    assert shamir.int_to_secret(value) == secret
    assert shamir.decode_share(shamir.encode_share(shares[xs[0]])) == shares[xs[0]]
    if t > 1:
        with pytest.raises(ShamirError):
            shamir.reconstruct({x: shares[x] for x in subset[:-1]}, t)


def test_field_holds_256_bit_secrets_and_rejects_bad_points():
    assert shamir.PRIME > 2**256 and shamir.SHARE_BYTES == 66
    top = b"\xff" * 32
    shares = shamir.split(shamir.secret_to_int(top), 3, [1, 2, 3])
    assert shamir.int_to_secret(shamir.reconstruct(shares, 3)) == top
    with pytest.raises(ShamirError):
        shamir.split(1, 2, [1, 1, 2])
    with pytest.raises(ShamirError):
        shamir.split(1, 2, [0, 1])
    with pytest.raises(ShamirError):
        shamir.split(1, 4, [1, 2, 3])
    with pytest.raises(ShamirError):
        shamir.secret_to_int(b"short")


def test_key_agreement_is_symmetric_and_bound_to_round_pair_and_purpose():
    a, b, c = generate_keypair(), generate_keypair(), generate_keypair()
    assert public_key_of(a.private) == a.public and len(a.public) == 32
    kab = derive_keys(a.private, 1, {2: b.public}, purpose=PURPOSE_MASK, round_id=7)[2]
    kba = derive_keys(b.private, 2, {1: a.public}, purpose=PURPOSE_MASK, round_id=7)[1]
    assert kab == kba and len(kab) == 32
    assert kab != derive_keys(a.private, 1, {2: b.public}, purpose=PURPOSE_MASK, round_id=8)[2]
    assert kab != derive_keys(a.private, 1, {2: b.public}, purpose=PURPOSE_ENCRYPTION, round_id=7)[2]
    assert kab != derive_keys(a.private, 1, {3: b.public}, purpose=PURPOSE_MASK, round_id=7)[3]
    assert kab != derive_keys(a.private, 1, {2: c.public}, purpose=PURPOSE_MASK, round_id=7)[2]
    assert "private" not in repr(a) and a.private.hex() not in repr(a)


def test_every_single_bit_flip_of_a_sealed_share_is_rejected():
    key = os.urandom(32)
    sealed = seal(key, b"s" * 66 + b"b" * 66, sender=3, receiver=5, round_id=2)
    assert open_sealed(key, sealed, sender=3, receiver=5, round_id=2) == b"s" * 66 + b"b" * 66
    for bit in range(len(sealed) * 8):
        tampered = bytearray(sealed)
        tampered[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(ShareAuthenticationError):
            open_sealed(key, bytes(tampered), sender=3, receiver=5, round_id=2)


@pytest.mark.parametrize("sender,receiver,round_id", [(5, 3, 2), (3, 4, 2), (3, 5, 3)])
def test_a_share_replayed_to_another_pair_or_round_is_rejected(sender, receiver, round_id):
    key = os.urandom(32)
    sealed = seal(key, b"x" * 132, sender=3, receiver=5, round_id=2)
    with pytest.raises(ShareAuthenticationError):
        open_sealed(key, sealed, sender=sender, receiver=receiver, round_id=round_id)
    with pytest.raises(ShareAuthenticationError):
        open_sealed(key, sealed[:20], sender=3, receiver=5, round_id=2)


@pytest.mark.parametrize("bits,dtype", [(32, np.uint32), (64, np.uint64)])
def test_prg_is_deterministic_per_seed_and_reads_little_endian_words(bits, dtype):
    seed = bytes(range(32))
    words = prg(seed, 1000, bits)
    assert words.shape == (1000,) and words.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(words, prg(seed, 1000, bits))
    np.testing.assert_array_equal(prg(seed, 10, bits), words[:10])  # a prefix of the same stream
    assert not np.array_equal(words, prg(bytes(31) + b"\x01", 1000, bits))
    first = int.from_bytes(prg(seed, 1, 8 * 8)[0].tobytes(), "little")
    assert int(prg(seed, 2, 32)[0]) == first & 0xFFFFFFFF


def test_prg_pairs_differ_across_pairs():
    keys = [generate_keypair() for _ in range(4)]
    seeds = {(i, j): derive_keys(keys[i].private, i, {j: keys[j].public}, purpose=PURPOSE_MASK, round_id=0)[j]
             for i, j in itertools.combinations(range(4), 2)}
    assert len(set(seeds.values())) == len(seeds)
