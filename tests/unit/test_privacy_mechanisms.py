"""gaussian_noise and clip_by_l2."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from scipy import stats

from dpfl_ray.errors import DPFLError
from dpfl_ray.privacy import clip_by_l2, gaussian_noise

LEVEL = 1e-9  # two-sided; with a fixed seed these tests are deterministic, and at this level cannot flake


def test_gaussian_noise_variance_and_mean():
    n, sigma = 1_000_000, 2.5
    x = gaussian_noise(n, sigma, np.random.default_rng(20240601), dtype=np.float64)
    assert x.shape == (n,) and x.dtype == np.float64
    s2 = float(np.var(x, ddof=1))
    # (N-1) s^2 / sigma^2 ~ chi2(N-1)
    chi = (n - 1) * s2 / sigma**2
    p_var = 2 * min(stats.chi2.cdf(chi, n - 1), stats.chi2.sf(chi, n - 1))
    assert p_var > LEVEL, (s2, p_var)
    # mean * sqrt(N) / sigma ~ N(0, 1)
    z = float(np.mean(x)) * math.sqrt(n) / sigma
    p_mean = 2 * stats.norm.sf(abs(z))
    assert p_mean > LEVEL, (z, p_mean)
    # sanity of the test itself: the wrong sigma is rejected at the same level
    chi_wrong = (n - 1) * s2 / (sigma * 1.01) ** 2
    assert 2 * min(stats.chi2.cdf(chi_wrong, n - 1), stats.chi2.sf(chi_wrong, n - 1)) < LEVEL


def test_gaussian_noise_float32_default_is_rounded_float64_draws():
    g1, g2 = np.random.default_rng(7), np.random.default_rng(7)
    a = gaussian_noise((3, 4), 0.5, g1)
    b = g2.standard_normal((3, 4), dtype=np.float64) * 0.5
    assert a.dtype == np.float32 and a.shape == (3, 4)
    np.testing.assert_array_equal(a, b.astype(np.float32))
    again = gaussian_noise((3, 4), 0.5, np.random.default_rng(7))
    np.testing.assert_array_equal(a, again)
    assert not np.any(gaussian_noise(5, 0.0, np.random.default_rng(1)))


@pytest.mark.parametrize("std", [-1.0, float("nan"), float("inf"), "1", True])
def test_gaussian_noise_rejects_bad_std(std):
    with pytest.raises(DPFLError) as err:
        gaussian_noise(3, std, np.random.default_rng(0))
    assert err.value.field == "std"


def test_gaussian_noise_needs_a_generator():
    with pytest.raises(DPFLError) as err:
        gaussian_noise(3, 1.0, np.random.RandomState(0))
    assert err.value.field == "generator"


def test_clip_by_l2_basic():
    v = np.array([3.0, 4.0], dtype=np.float32)
    c, norm = clip_by_l2(v, 10.0)
    assert norm == pytest.approx(5.0) and c.dtype == np.float32
    np.testing.assert_array_equal(c, v)
    assert c is not v
    c, norm = clip_by_l2(v, 1.0)
    assert norm == pytest.approx(5.0)
    np.testing.assert_allclose(c, [0.6, 0.8], rtol=1e-6)
    assert np.linalg.norm(c.astype(np.float64)) <= 1.0
    z, norm = clip_by_l2(np.zeros(4), 1.0)
    assert norm == 0.0 and not np.any(z)
    i, _ = clip_by_l2(np.array([3, 4]), 1.0)
    assert i.dtype == np.float64


@settings(max_examples=200, deadline=None)
@given(
    arrays(np.float32, st.integers(1, 64), elements=st.floats(-1e6, 1e6, width=32)),
    st.floats(1e-3, 1e3),
)
def test_clip_by_l2_never_exceeds_the_bound(vec, clip_norm):
    c, norm = clip_by_l2(vec, clip_norm)
    assert c.dtype == vec.dtype and c.shape == vec.shape
    assert np.linalg.norm(c.astype(np.float64)) <= clip_norm
    assert norm == pytest.approx(float(np.linalg.norm(vec.astype(np.float64))))
    if norm > 0:
        # direction is kept
        assert float(np.dot(c.astype(np.float64), vec.astype(np.float64))) >= 0


@pytest.mark.parametrize("clip", [0.0, -1.0, float("nan"), float("inf")])
def test_clip_by_l2_rejects_bad_bound(clip):
    with pytest.raises(DPFLError) as err:
        clip_by_l2(np.ones(3), clip)
    assert err.value.field == "clip_norm"


def test_clip_by_l2_rejects_non_finite_vectors():
    with pytest.raises(DPFLError) as err:
        clip_by_l2(np.array([1.0, np.nan]), 1.0)
    assert err.value.field == "vec"
