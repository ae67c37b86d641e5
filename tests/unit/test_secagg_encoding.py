"""Fixed-point encoding into Z_(2^bits): round trips, wrap-around, overflow and clipping."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpfl_ray.secagg import (
    EncodingError, EncodingOverflow, FixedPointEncoder, decode, encode, max_abs_value, rounding_error_bound,
    secure_sum,
)


@settings(max_examples=80, deadline=None)
@given(bits=st.sampled_from([32, 64]), n=st.integers(1, 20), log_scale=st.integers(0, 24),
       dim=st.integers(1, 16), seed=st.integers(0, 2**32), data=st.data())
def test_sum_of_encodings_decodes_within_the_rounding_bound(bits, n, log_scale, dim, seed, data):
    scale = 2.0 ** log_scale
    bound = max_abs_value(bits, scale, n)
    rng = np.random.default_rng(seed)
    values = [np.array(data.draw(st.lists(st.floats(-bound, bound), min_size=dim, max_size=dim)))
              for _ in range(n)]
    dtype = np.uint32 if bits == 32 else np.uint64
    total = np.zeros(dim, dtype=dtype)
    for v in values:
        enc = encode(v, bits=bits, scale=scale, n_summands=n, rng=rng)
        assert enc.clip is None and enc.data.dtype == dtype
        assert np.all(np.abs(decode(enc.data, bits=bits, scale=scale) - v) < 1 / scale + 1e-12 * np.abs(v))
        total += enc.data
    exact = np.sum(values, axis=0)
    err = np.abs(decode(total, bits=bits, scale=scale) - exact)
    # float64 products carry a 2^-53 relative error on top (only visible for huge bits=64 values).
    assert np.all(err <= rounding_error_bound(n, scale) + 2.0**-50 * np.sum(np.abs(values), axis=0))


@pytest.mark.parametrize("bits", [32, 64])
def test_negative_values_wrap_around_and_decode_back(bits):
    rng = np.random.default_rng(0)
    enc = encode(np.array([-1.0, -2.5, 3.0, 0.0]), bits=bits, scale=2.0, n_summands=3, rng=rng)
    top = 2**bits
    assert enc.data.tolist() == [top - 2, top - 5, 6, 0]
    np.testing.assert_array_equal(decode(enc.data, bits=bits, scale=2.0), [-1.0, -2.5, 3.0, 0.0])


def test_encoded_negatives_sum_through_secure_aggregation():
    rng = np.random.default_rng(1)
    vals = [np.array([-0.75, 1.5, -3.0]), np.array([0.25, -2.0, -1.0]), np.array([0.5, 0.5, 2.0])]
    encoded = [encode(v, bits=32, scale=4.0, n_summands=3, rng=rng).data for v in vals]
    result = secure_sum(encoded, bits=32, threshold=2)
    np.testing.assert_array_equal(decode(result.sum, bits=32, scale=4.0), [0.0, 0.0, -2.0])


def test_overflow_raises_and_names_the_numbers():
    rng = np.random.default_rng(0)
    limit = max_abs_value(32, 2.0**16, 10)
    assert limit == ((2**31 - 1) // 10) / 2.0**16
    encode(np.array([limit, -limit]), bits=32, scale=2.0**16, n_summands=10, rng=rng)
    with pytest.raises(EncodingOverflow) as err:
        encode(np.array([0.0, 3300.0]), bits=32, scale=2.0**16, n_summands=10, rng=rng)
    text = str(err.value)
    assert "10 * 3300 * 65536" in text and "2^31 - 1 = 2147483647" in text
    assert err.value.n_summands == 10 and err.value.max_abs == 3300.0 and err.value.n_over == 1


@pytest.mark.parametrize("bits", [32, 64])
def test_clip_mode_counts_clipped_coordinates_and_never_wraps(bits):
    rng = np.random.default_rng(0)
    scale, n = 2.0**10, 4
    limit = max_abs_value(bits, scale, n)
    values = np.array([0.0, 2 * limit, -3 * limit, limit, 1e300])
    enc = encode(values, bits=bits, scale=scale, n_summands=n, rng=rng, overflow="clip")
    assert enc.clip is not None
    assert (enc.clip.n_clipped, enc.clip.n_total, enc.clip.max_abs) == (3, 5, 1e300)
    decoded = decode(enc.data, bits=bits, scale=scale)
    np.testing.assert_allclose(decoded, [0.0, limit, -limit, limit, limit], rtol=1e-12)
    total = enc.data * np.array(n, dtype=enc.data.dtype)  # n worst-case summands still fit
    assert decode(total, bits=bits, scale=scale)[1] > 0


def test_encoder_records_every_clip_event():
    encoder = FixedPointEncoder(bits=32, scale=1.0, n_summands=2**20, overflow="clip")
    rng = np.random.default_rng(0)
    encoder.encode(np.array([1.0, 2.0]), rng)
    assert encoder.events == []
    encoder.encode(np.array([5000.0, -5000.0, 1.0]), rng)
    assert len(encoder.events) == 1 and encoder.events[0].n_clipped == 2
    assert encoder.error_bound == 2**20


def test_stochastic_rounding_is_unbiased():
    rng = np.random.default_rng(42)
    enc = encode(np.full(200_000, 0.3), bits=32, scale=1.0, n_summands=1, rng=rng)
    ups = enc.data.astype(np.float64)
    assert set(np.unique(ups)) == {0.0, 1.0}
    # mean of 200k Bernoulli(0.3): sd ~ 0.001, so 0.006 is six standard deviations.
    assert abs(ups.mean() - 0.3) < 0.006


def test_invalid_inputs_are_encoding_errors():
    rng = np.random.default_rng(0)
    for kwargs in ({"bits": 16}, {"scale": 0.0}, {"scale": float("inf")}, {"n_summands": 0},
                   {"overflow": "wrap"}):
        args = {"bits": 32, "scale": 1.0, "n_summands": 1, "rng": rng, **kwargs}
        with pytest.raises(EncodingError):
            encode(np.zeros(2), **args)
    with pytest.raises(EncodingError):
        encode(np.array([np.nan]), bits=32, scale=1.0, n_summands=1, rng=rng)
    with pytest.raises(EncodingError):
        decode(np.zeros(2, np.uint64), bits=32, scale=1.0)
