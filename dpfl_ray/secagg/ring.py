"""The integer pipeline that carries a client's update into SecAgg's ring Z_(2^b) and the sum back out,
for distributed DP with discrete noise (issue #36; Kairouz, Liu & Steinke 2021, Sec. 4; Agarwal,
Kairouz & Liu 2021):

1. scale by 1/gamma (the caller's ``scale``);
2. rotate: pad to a power of two, flip signs by a public per-round seed, apply the orthonormal
   Walsh-Hadamard transform (:func:`rotate`), which spreads a vector's norm evenly over the coordinates;
3. round to integers, unbiased, drawn again while the rounded norm passes a bound
   (:func:`conditional_round`);
4. add the client's integer noise (:mod:`dpfl_ray.privacy.discrete`);
5. reduce mod 2^b (:func:`to_ring`) and sum in SecAgg;
6. read the sum as centred integers (:func:`from_ring`), rotate back (:func:`unrotate`), unscale.

The sum mod 2^b equals the integer sum exactly as long as every coordinate of the integer sum lies in
[-2^(b-1), 2^(b-1)); :func:`wrap_probability` bounds the chance that one does not.
"""
from __future__ import annotations

import math

import numpy as np

from .errors import EncodingError

MAX_BITS = 62  # sums of int64 words mod 2^b stay exact below this


def padded_dim(dim: int) -> int:
    """The rotation's size: the smallest power of two >= dim."""
    if int(dim) != dim or dim < 1:
        raise EncodingError(f"the dimension must be a positive integer, got {dim}", "dim")
    return 1 << (int(dim) - 1).bit_length()


def rotation_signs(seed: bytes, dim: int) -> np.ndarray:
    """The +-1 signs of one round's rotation, from its public seed (the same for every client)."""
    rng = np.random.default_rng(np.frombuffer(bytes(seed), dtype=np.uint8).tolist() or [0])
    return rng.integers(0, 2, padded_dim(dim)).astype(np.float64) * 2.0 - 1.0


def hadamard(x: np.ndarray) -> np.ndarray:
    """The orthonormal Walsh-Hadamard transform along the last axis (a power of two long); it is its
    own inverse."""
    y = np.array(x, dtype=np.float64)
    n = y.shape[-1]
    if n & (n - 1):
        raise EncodingError(f"the Walsh-Hadamard transform needs a power-of-two length, got {n}", "dim")
    lead = y.shape[:-1]
    h = 1
    while h < n:
        y = y.reshape(*lead, n // (2 * h), 2, h)
        y = np.stack([y[..., 0, :] + y[..., 1, :], y[..., 0, :] - y[..., 1, :]], axis=-2).reshape(*lead, n)
        h *= 2
    return y / math.sqrt(n)


def rotate(x: np.ndarray, signs: np.ndarray) -> np.ndarray:
    """H D x of ``x`` zero-padded to ``len(signs)``: norm preserved."""
    x = np.asarray(x, dtype=np.float64)
    padded = np.zeros(signs.shape[-1])
    padded[:x.shape[-1]] = x
    return hadamard(padded * signs)


def unrotate(y: np.ndarray, signs: np.ndarray, dim: int) -> np.ndarray:
    """D H y, cut back to the first ``dim`` coordinates: the inverse of :func:`rotate`."""
    return (hadamard(np.asarray(y, dtype=np.float64)) * signs)[..., :dim]


def conditional_round(x: np.ndarray, rng, bound: float | None = None, max_tries: int = 1000) -> np.ndarray:
    """Round every coordinate to one of its two neighbouring integers, up with probability its
    fractional part (unbiased); with ``bound``, draw again while the rounded vector's l2 norm passes
    it (Kairouz et al. 2021, conditional randomized rounding)."""
    x = np.asarray(x, dtype=np.float64)
    low = np.floor(x)
    frac = x - low
    for _ in range(int(max_tries)):
        ints = low.astype(np.int64) + (rng.random(x.shape) < frac)
        # the squared norm of integers is an exact integer: the same decision on every host's kernels
        if bound is None or int(np.dot(ints, ints)) <= bound * bound:
            return ints
    raise EncodingError(f"no rounding within the norm bound {bound:.6g} in {max_tries} tries (the vector's own "
                        f"norm is {float(np.linalg.norm(x)):.6g})", "bound")


def _check_bits(bits: int) -> int:
    if int(bits) != bits or not 2 <= bits <= MAX_BITS:
        raise EncodingError(f"bits must be an integer in [2, {MAX_BITS}], got {bits}", "bits")
    return int(bits)


def to_ring(ints: np.ndarray, bits: int) -> np.ndarray:
    """Integers reduced mod 2^bits, as uint64 words in [0, 2^bits)."""
    mask = np.uint64((1 << _check_bits(bits)) - 1)
    return np.asarray(ints, dtype=np.int64).view(np.uint64) & mask


def ring_sum(words, bits: int) -> np.ndarray:
    """The sum mod 2^bits of several ring vectors (what SecAgg reveals)."""
    mask = np.uint64((1 << _check_bits(bits)) - 1)
    total = np.zeros_like(np.asarray(words[0], dtype=np.uint64))
    for w in words:
        total = (total + np.asarray(w, dtype=np.uint64)) & mask
    return total


def from_ring(words: np.ndarray, bits: int) -> np.ndarray:
    """Ring words read as the integers in [-2^(bits-1), 2^(bits-1)) they stand for."""
    b = _check_bits(bits)
    w = np.asarray(words, dtype=np.uint64).astype(np.int64)
    return np.where(w >= (1 << (b - 1)), w - (1 << b), w)


def decode_sum(words: np.ndarray, bits: int, scale: float, rotation_seed: bytes, dim: int) -> np.ndarray:
    """The float sum a ring sum stands for: the words mod 2^bits read as centred integers, rotated
    back to the first ``dim`` coordinates and unscaled."""
    ints = from_ring(to_ring(np.asarray(words).astype(np.int64), bits), bits)
    return unrotate(ints.astype(np.float64), rotation_signs(rotation_seed, dim), dim) / scale


def wrap_probability(bits: int, dim: int, signal_l2: float, shares: int, *, dg_variance: float = 0.0,
                     skellam_variance: float = 0.0) -> float:
    """An upper bound on the chance that some coordinate of the integer sum leaves [-2^(b-1), 2^(b-1))
    and wraps. The sum of ``shares`` client vectors, rotated (each coordinate of the rotated signal is
    sub-Gaussian with variance proxy signal_l2^2 / padded_dim, ``signal_l2`` the l2 norm bound of the
    sum in integer units), each share rounded (proxy 1/4) and carrying discrete Gaussian noise of
    ``dg_variance`` (proxy dg_variance) or Skellam noise of ``skellam_variance`` (moment generating
    function exp(mu (cosh l - 1))): a Chernoff bound per coordinate and side, times 2 padded_dim."""
    b = _check_bits(bits)
    d = padded_dim(dim)
    proxy = signal_l2 ** 2 / d + shares * (0.25 + dg_variance)
    mu = shares * skellam_variance
    edge = float(2 ** (b - 1))

    def log_mgf(lam: float) -> float:
        return lam * lam * proxy / 2.0 + (mu * (math.cosh(lam) - 1.0) if mu else 0.0)

    def slope(lam: float) -> float:
        return lam * proxy + (mu * math.sinh(lam) if mu else 0.0) - edge

    top = min(edge / proxy if proxy > 0 else math.inf, math.asinh(edge / mu) if mu > 0 else math.inf)
    # the exponent's minimiser: edge / proxy for a sub-Gaussian sum, else the root of its slope
    if mu:
        from scipy import optimize  # here: the workers, which rotate and round, never load scipy

        lam = optimize.brentq(slope, 0.0, top)
    else:
        lam = edge / proxy
    return min(1.0, 2.0 * d * math.exp(min(0.0, log_mgf(lam) - lam * edge)))
