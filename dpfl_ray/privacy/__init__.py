"""Differential-privacy accounting (dp_accounting under the hood) and the noise / clipping primitives.

The names below load their module on first use (PEP 562): ``from dpfl_ray.privacy import
gaussian_noise`` must not import dp_accounting and scipy (about 0.5 s of CPU) into a worker process
that only adds noise.
"""
from __future__ import annotations

import importlib

_MODULE_OF = {
    "ACCOUNTANTS": "accountants", "CLASSIC_RDP_ORDERS": "accountants", "DEFAULT_ACCOUNTANT": "accountants",
    "PLD_VALUE_DISCRETIZATION_INTERVAL": "accountants",
    "EpsilonCurve": "calibration", "calibrate_noise_multiplier": "calibration", "delta_for": "calibration",
    "epsilon_for": "calibration", "rounds_within_budget": "calibration",
    "PrivacyLedger": "ledger", "RoundRecord": "ledger",
    "clip_by_l2": "mechanisms", "gaussian_noise": "mechanisms",
    "FixedSizeSampling": "sampling", "NoSampling": "sampling", "PoissonSampling": "sampling", "Sampling": "sampling",
    "as_sampling": "sampling", "effective_noise_multiplier": "sampling", "event_to_dict": "sampling",
}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # the next lookup is a plain one
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MODULE_OF))
