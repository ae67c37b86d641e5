"""Differential-privacy accounting (dp_accounting under the hood) and the noise / clipping primitives."""
from dpfl_ray.privacy.accountants import (
    ACCOUNTANTS,
    CLASSIC_RDP_ORDERS,
    DEFAULT_ACCOUNTANT,
    PLD_VALUE_DISCRETIZATION_INTERVAL,
)
from dpfl_ray.privacy.calibration import (
    EpsilonCurve,
    calibrate_noise_multiplier,
    delta_for,
    epsilon_for,
    rounds_within_budget,
)
from dpfl_ray.privacy.ledger import PrivacyLedger, RoundRecord
from dpfl_ray.privacy.mechanisms import clip_by_l2, gaussian_noise
from dpfl_ray.privacy.sampling import (
    FixedSizeSampling,
    NoSampling,
    PoissonSampling,
    Sampling,
    as_sampling,
    effective_noise_multiplier,
    event_to_dict,
)

__all__ = [
    "ACCOUNTANTS", "CLASSIC_RDP_ORDERS", "DEFAULT_ACCOUNTANT", "PLD_VALUE_DISCRETIZATION_INTERVAL",
    "EpsilonCurve", "FixedSizeSampling", "NoSampling", "PoissonSampling", "PrivacyLedger", "RoundRecord", "Sampling",
    "as_sampling", "calibrate_noise_multiplier", "delta_for", "effective_noise_multiplier", "epsilon_for",
    "event_to_dict", "rounds_within_budget", "clip_by_l2", "gaussian_noise",
]
