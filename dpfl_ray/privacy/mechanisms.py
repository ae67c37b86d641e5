"""The two primitives every DP aggregation rule here is built from: Gaussian noise and L2 clipping.

The accounting for them lives in :mod:`dpfl_ray.privacy.ledger`; the standard deviation of the noise
added to a sum of updates clipped to ``C`` is ``noise_multiplier * C``.
"""
from __future__ import annotations

import math

import numpy as np

from dpfl_ray.errors import DPFLError

__all__ = ["gaussian_noise", "clip_by_l2"]


def gaussian_noise(shape: int | tuple[int, ...], std: float, generator: np.random.Generator,
                   dtype: np.dtype | type = np.float32) -> np.ndarray:
    """I.i.d. N(0, std^2) noise of ``shape``, drawn in float64 and returned as ``dtype``.

    ``generator`` must be a ``numpy.random.Generator`` (see :mod:`dpfl_ray.rng` for the per-purpose
    streams) or the cryptographic :class:`~dpfl_ray.privacy.randomness.ChaChaNormal`; the draws never
    touch numpy's global state.
    """
    from dpfl_ray.privacy.randomness import ChaChaNormal

    if not isinstance(generator, (np.random.Generator, ChaChaNormal)):
        raise DPFLError(f"must be a numpy.random.Generator, got {type(generator).__name__}", field="generator")
    if isinstance(std, bool) or not isinstance(std, (int, float, np.floating, np.integer)) \
            or not math.isfinite(float(std)) or std < 0:
        raise DPFLError(f"must be a finite number >= 0, got {std!r}", field="std")
    draws = generator.standard_normal(shape, dtype=np.float64)
    draws *= float(std)
    return draws.astype(dtype, copy=False)


def clip_by_l2(vec: np.ndarray, clip_norm: float) -> tuple[np.ndarray, float]:
    """Scale ``vec`` down to L2 norm at most ``clip_norm``; return ``(clipped, original_norm)``.

    The norm is computed in float64 and the result keeps ``vec``'s floating dtype; the scale is
    nudged down if rounding to that dtype would leave the norm above ``clip_norm``, so the bound the
    accountant relies on holds exactly. A vector already within the bound is returned unchanged (as a
    copy). Non-finite entries are rejected: they would make the bound meaningless.
    """
    if isinstance(clip_norm, bool) or not isinstance(clip_norm, (int, float, np.floating, np.integer)) \
            or not math.isfinite(float(clip_norm)) or clip_norm <= 0:
        raise DPFLError(f"must be a finite number > 0, got {clip_norm!r}", field="clip_norm")
    arr = np.asarray(vec)
    out_dtype = arr.dtype if np.issubdtype(arr.dtype, np.floating) else np.dtype(np.float64)
    wide = arr.astype(np.float64, copy=False)
    if not np.all(np.isfinite(wide)):
        raise DPFLError("contains NaN or infinite values", field="vec")
    norm = float(np.linalg.norm(wide.ravel()))
    clip_norm = float(clip_norm)
    if norm <= clip_norm:
        return arr.astype(out_dtype, copy=True), norm
    scale = clip_norm / norm
    for _ in range(64):
        clipped = (wide * scale).astype(out_dtype)
        if float(np.linalg.norm(clipped.astype(np.float64).ravel())) <= clip_norm:
            return clipped, norm
        scale = np.nextafter(scale, 0.0) * (1.0 - 4 * float(np.finfo(out_dtype).eps))
    raise AssertionError("clip_by_l2 could not reach the bound")  # pragma: no cover
