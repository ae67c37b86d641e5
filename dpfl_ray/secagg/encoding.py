"""Fixed-point encoding of float vectors into Z_(2^bits) for secure summation.

A value ``x`` becomes the integer ``round(x * scale)`` with *stochastic* rounding (up with
probability equal to the fractional part), so the encoding is unbiased and each summand is off
by less than ``1 / scale``; negative integers are stored in two's complement, and decoding reads
words ``>= 2^(bits-1)`` as negative. Summation mod 2^bits is exact as long as the true integer
sum stays inside ``[-(2^(bits-1) - 1), 2^(bits-1) - 1]``; the encoder guarantees that by
requiring ``|round(x * scale)| <= floor((2^(bits-1) - 1) / n_summands)`` for every coordinate.

All float arithmetic is float64, so for ``|x| * scale > 2^52`` (reachable only with bits=64)
the product itself carries a relative error of up to 2^-53 on top of the rounding bound.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dpfl_ray.secagg.errors import EncodingError, EncodingOverflow

OVERFLOW_MODES = ("raise", "clip")
_SIGNED = {32: np.int32, 64: np.int64}
_UNSIGNED = {32: np.uint32, 64: np.uint64}


@dataclass(frozen=True)
class ClipEvent:
    """Coordinates that were clipped to ``[-limit, limit]`` before encoding one vector."""

    n_clipped: int
    n_total: int
    limit: float
    max_abs: float
    bits: int
    scale: float
    n_summands: int


@dataclass(frozen=True)
class EncodedVector:
    data: np.ndarray
    clip: ClipEvent | None = None


def _check(bits: int, scale: float, n_summands: int) -> None:
    if bits not in _UNSIGNED:
        raise EncodingError(f"bits must be 32 or 64, got {bits}", "bits")
    if not (np.isfinite(scale) and scale > 0):
        raise EncodingError(f"scale must be a positive finite number, got {scale}", "scale")
    if int(n_summands) != n_summands or n_summands < 1:
        raise EncodingError(f"n_summands must be a positive integer, got {n_summands}", "n_summands")


def summand_limit(bits: int, n_summands: int) -> int:
    """Largest ``|integer|`` one summand may have so that ``n_summands`` of them never wrap."""
    return ((1 << (bits - 1)) - 1) // int(n_summands)


def _float_limit(bits: int, n_summands: int) -> float:
    # Largest float64 not above the integer limit: float(limit) may round *up* past it for bits=64.
    limit = summand_limit(bits, n_summands)
    as_float = float(limit)
    return float(np.nextafter(as_float, 0.0)) if int(as_float) > limit else as_float


def max_abs_value(bits: int, scale: float, n_summands: int) -> float:
    """Largest ``|x|`` the encoder accepts for these parameters."""
    _check(bits, scale, n_summands)
    return _float_limit(bits, n_summands) / scale


def rounding_error_bound(n_summands: int, scale: float) -> float:
    """Per-coordinate bound on ``|decode(sum of encodings) - sum of values|``: ``n_summands / scale``.

    Stochastic rounding moves each summand by less than one integer step, i.e. ``< 1/scale``.
    """
    if n_summands < 1 or not scale > 0:
        raise EncodingError("rounding_error_bound needs n_summands >= 1 and scale > 0")
    return n_summands / scale


def encode(values: object, *, bits: int, scale: float, n_summands: int, rng: np.random.Generator,
           overflow: str = "raise") -> EncodedVector:
    """Encode ``values`` into uint{bits}; ``rng`` drives the stochastic rounding.

    ``overflow='raise'`` raises :class:`EncodingOverflow` if ``n_summands * max|x| * scale`` could
    exceed ``2^(bits-1) - 1``; ``overflow='clip'`` clips to ``+-max_abs_value(...)`` and reports
    the clipped coordinates in ``EncodedVector.clip`` (``None`` when nothing was clipped).
    """
    _check(bits, scale, n_summands)
    if overflow not in OVERFLOW_MODES:
        raise EncodingError(f"overflow must be one of {OVERFLOW_MODES}, got {overflow!r}", "overflow")
    if not isinstance(rng, np.random.Generator):
        raise EncodingError("encode needs a numpy Generator for stochastic rounding", "rng")
    x = np.asarray(values, dtype=np.float64)
    if not np.all(np.isfinite(x)):
        raise EncodingError(f"{int(np.sum(~np.isfinite(x)))} coordinates are NaN or infinite", "values")
    scaled = x * scale
    limit = _float_limit(bits, n_summands)
    max_abs = float(np.max(np.abs(x))) if x.size else 0.0
    over = np.abs(scaled) > limit
    clip = None
    if over.any():
        n_over = int(over.sum())
        if overflow == "raise":
            integer_limit = (1 << (bits - 1)) - 1
            raise EncodingOverflow(
                f"n_summands * max|value| * scale = {n_summands} * {max_abs:.6g} * {scale:.6g} = "
                f"{n_summands * max_abs * scale:.6g} exceeds 2^{bits - 1} - 1 = {integer_limit} "
                f"({n_over} coordinates above the per-summand limit {limit / scale:.6g})", "values",
                n_summands=n_summands, max_abs=max_abs, scale=scale, bits=bits, limit=limit / scale,
                n_over=n_over)
        scaled = np.clip(scaled, -limit, limit)
        clip = ClipEvent(n_over, int(x.size), limit / scale, max_abs, bits, scale, int(n_summands))
    low = np.floor(scaled)
    up = rng.random(scaled.shape) < (scaled - low)
    ints = low.astype(np.int64) + up
    data = ints.astype(_SIGNED[bits]).view(_UNSIGNED[bits])
    return EncodedVector(data, clip)


def decode(data: np.ndarray, *, bits: int, scale: float) -> np.ndarray:
    """Floats from (a sum of) encodings; words ``>= 2^(bits-1)`` are negative."""
    _check(bits, scale, 1)
    arr = np.asarray(data)
    if arr.dtype != _UNSIGNED[bits]:
        raise EncodingError(f"decode expects uint{bits} data, got {arr.dtype}", "data")
    return arr.view(_SIGNED[bits]).astype(np.float64) / scale


@dataclass
class FixedPointEncoder:
    """The encoding parameters of one round; every clip is appended to ``events``."""

    bits: int = 32
    scale: float = 2.0 ** 16
    n_summands: int = 1
    overflow: str = "raise"
    events: list[ClipEvent] = field(default_factory=list)

    def __post_init__(self):
        _check(self.bits, self.scale, self.n_summands)
        if self.overflow not in OVERFLOW_MODES:
            raise EncodingError(f"overflow must be one of {OVERFLOW_MODES}, got {self.overflow!r}", "overflow")

    @property
    def max_abs_value(self) -> float:
        return max_abs_value(self.bits, self.scale, self.n_summands)

    @property
    def error_bound(self) -> float:
        return rounding_error_bound(self.n_summands, self.scale)

    def encode(self, values: object, rng: np.random.Generator) -> np.ndarray:
        out = encode(values, bits=self.bits, scale=self.scale, n_summands=self.n_summands, rng=rng,
                     overflow=self.overflow)
        if out.clip is not None:
            self.events.append(out.clip)
        return out.data

    def decode(self, data: np.ndarray) -> np.ndarray:
        return decode(data, bits=self.bits, scale=self.scale)
