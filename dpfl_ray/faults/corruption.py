"""Corrupt updates (docs/faults.md): how a faulty client spoils its update, and the check that
keeps such an update from ever reaching the model.

The check runs in the worker on what each client sends (its update as the algorithm prepares it:
clipped, before weighting and noise), before its group sum or its SecAgg masking: a stand-in for
the client-side validity proof a deployment would need, since the server never sees an individual
masked input.
"""
from __future__ import annotations

import math

import numpy as np

from .. import rng as rngmod

CORRUPTIONS = ("nan", "inf", "shape", "norm")
ABSURD_NORM = 1e20  # far past any max_update_norm a scenario would set


def corrupt(vector: np.ndarray, kind: str, rng: np.random.Generator) -> np.ndarray:
    """A corrupted copy of an update: NaN or +-Inf in ~1% of the entries (at least one), one
    entry too few or too many, or the same direction scaled to norm :data:`ABSURD_NORM`."""
    v = np.array(vector, copy=True)
    n = v.size
    if kind in ("nan", "inf"):
        v = v.astype(np.result_type(v.dtype, np.float32))
        if n == 0:
            return np.array([np.nan if kind == "nan" else np.inf], dtype=v.dtype)
        idx = rng.choice(n, size=max(1, n // 100), replace=False)
        v.flat[idx] = np.nan if kind == "nan" else np.where(rng.random(idx.size) < 0.5, -np.inf, np.inf)
        return v
    if kind == "shape":
        return v.ravel()[:-1] if n > 1 and rng.random() < 0.5 else np.append(v.ravel(), v.dtype.type(0))
    if kind == "norm":
        v = v.astype(np.result_type(v.dtype, np.float32))
        norm = float(np.linalg.norm(v.astype(np.float64)))
        base = v / norm if norm > 0 else np.full_like(v, 1.0 / math.sqrt(max(n, 1)))
        return (base * ABSURD_NORM).astype(v.dtype)
    raise ValueError(f"unknown corruption {kind!r}; one of {', '.join(CORRUPTIONS)}")


# float32 clipping lands within a few ulps of the bound; a client past this is not one that clipped
CLIP_TOLERANCE = 1e-5


def check_update(vector, expected_dim: int, max_norm: float | None, clip_norm: float | None = None,
                 indicator: bool = False) -> str | None:
    """Why an update must not reach the model, or None. The reason starts with its kind
    (``shape``, ``nan``, ``inf``, ``norm``) so records can count rejections by kind. ``clip_norm``:
    the bound the client must have clipped to (ClientSpec.clip_norm), the sensitivity the ledger
    books, its last value the clipped-count bit (+-1/2) where ``indicator``."""
    try:
        v = np.asarray(vector)
    except (ValueError, TypeError):  # ragged, or not an array at all
        return "shape: not an array of numbers"
    if v.shape != (expected_dim,):
        return f"shape: {tuple(v.shape)} instead of ({expected_dim},)"
    if not (np.issubdtype(v.dtype, np.floating) or np.issubdtype(v.dtype, np.integer)):
        return f"shape: {v.dtype} values instead of real numbers"
    # The reason names no figure of the vector (how many NaNs, its norm): it reaches rounds.jsonl by
    # client id, and the check stands for a validity proof that says pass or fail and nothing more.
    if np.issubdtype(v.dtype, np.inexact) and np.isnan(v).any():
        return "nan: NaN values"
    if np.issubdtype(v.dtype, np.inexact) and np.isinf(v).any():
        return "inf: infinite values"
    if max_norm is not None and float(np.linalg.norm(v.astype(np.float64))) > max_norm:
        return f"norm: above faults.max_update_norm={max_norm:g}"
    if clip_norm:
        body = v[:-1] if indicator else v
        if float(np.linalg.norm(body.astype(np.float64))) > clip_norm * (1 + CLIP_TOLERANCE):
            return f"norm: above the clipping bound {clip_norm:g}"
        if indicator and float(v[-1]) not in (0.5, -0.5):
            return "norm: its clipped-count bit is neither +1/2 nor -1/2"
    return None


def corruption_rng(seed: int, round_idx: int, client_id: int) -> np.random.Generator:
    """The values of one corruption: a child of the stream that chose the client, not the same draws."""
    return np.random.Generator(np.random.PCG64(rngmod.seed_sequence(seed, "corrupt", round_idx, client_id).spawn(1)[0]))
