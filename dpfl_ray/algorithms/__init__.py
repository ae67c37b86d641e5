"""Algorithms of the papers, each one module implementing :class:`~.base.Algorithm`; the registry
maps a scenario's ``training.algorithm`` to its class. Nothing outside this package asks which
algorithm runs."""
from .base import (
    Abort, Aggregate, Algorithm, CalibrationSum, ClientNoise, ClientSpec, Mechanism, RoundOutcome, UnmaskPlan,
    weighted_sum,
)
from .baek import Baek
from .dp_fedavg import DPFedAvg
from .fedavg import FedAvg

REGISTRY: dict[str, type[Algorithm]] = {"fedavg": FedAvg, "dp_fedavg": DPFedAvg, "baek": Baek}


def make_algorithm(scenario, weights, noise_multiplier: float | None = None) -> Algorithm:
    cls = REGISTRY[scenario.training.algorithm]
    return cls(scenario, weights, noise_multiplier or scenario.privacy.noise_multiplier)


__all__ = ["REGISTRY", "Abort", "Aggregate", "Algorithm", "Baek", "CalibrationSum", "ClientNoise", "ClientSpec",
           "DPFedAvg", "FedAvg", "Mechanism", "RoundOutcome", "UnmaskPlan", "make_algorithm", "weighted_sum"]
