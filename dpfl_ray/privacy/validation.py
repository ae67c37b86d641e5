"""Argument checks shared by the privacy modules; each raises a :class:`~dpfl_ray.errors.DPFLError`
naming the offending field."""
from __future__ import annotations

import math
import numbers
from typing import Any

from dpfl_ray.errors import DPFLError


def _is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _check_real(x: Any, field: str) -> float:
    if not _is_real(x) or not math.isfinite(float(x)):
        raise DPFLError(f"must be a finite number, got {x!r}", field=field)
    return float(x)


def _check_int(x: Any, field: str, minimum: int) -> int:
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        if _is_real(x) and float(x).is_integer():
            x = int(x)
        else:
            raise DPFLError(f"must be an integer, got {x!r}", field=field)
    if int(x) < minimum:
        raise DPFLError(f"must be >= {minimum}, got {x}", field=field)
    return int(x)


def _check_rate(q: Any, field: str = "sampling_rate") -> float:
    q = _check_real(q, field)
    if not 0.0 < q <= 1.0:
        raise DPFLError(f"must be in (0, 1], got {q:g}", field=field)
    return q


def _check_noise(z: Any, field: str = "noise_multiplier") -> float:
    z = _check_real(z, field)
    if z <= 0.0:
        raise DPFLError(f"must be > 0, got {z:g}", field=field)
    return z


def _check_delta(delta: Any, field: str = "delta") -> float:
    delta = _check_real(delta, field)
    if not 0.0 < delta < 1.0:
        raise DPFLError(f"must be in (0, 1), got {delta:g}", field=field)
    return delta


def _check_epsilon(eps: Any, field: str = "epsilon") -> float:
    eps = _check_real(eps, field)
    if eps <= 0.0:
        raise DPFLError(f"must be > 0, got {eps:g}", field=field)
    return eps


def _check_rounds(rounds: Any, field: str = "rounds") -> int:
    return _check_int(rounds, field, 1)


def _check_dropout(rate: Any, field: str = "dropout_rate") -> float:
    rate = _check_real(rate, field)
    if not 0.0 <= rate < 1.0:
        raise DPFLError(f"must be in [0, 1), got {rate:g}", field=field)
    return rate
