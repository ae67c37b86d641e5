"""Algorithms of the papers, each one module implementing :class:`~.base.Algorithm`; the registry
maps a scenario's ``training.algorithm`` to its class. Nothing outside this package asks which
algorithm runs."""
from .base import (
    Abort, Aggregate, Algorithm, CalibrationSum, ClientNoise, ClientReport, ClientSpec, LocalProcedure, Mechanism,
    RoundOutcome, UnmaskPlan, weighted_sum,
)
from .adap_dpfl import AdapDPFL
from .baek import Baek
from .dp_fedavg import DPFedAvg
from .fedavg import FedAvg
from .huang2020 import Huang2020
from .nbafl import NbAFL

REGISTRY: dict[str, type[Algorithm]] = {"fedavg": FedAvg, "dp_fedavg": DPFedAvg, "baek": Baek, "nbafl": NbAFL,
                                        "huang2020": Huang2020, "adap_dpfl": AdapDPFL}


def algorithm_class(scenario) -> type[Algorithm]:
    return REGISTRY[scenario.training.algorithm]


def make_algorithm(scenario, weights, noise_multiplier: float | None = None, sizes=None) -> Algorithm:
    """The scenario's algorithm over clients of these weights (and data sizes, for algorithms whose
    noise depends on them)."""
    return algorithm_class(scenario)(scenario, weights, noise_multiplier or scenario.privacy.noise_multiplier,
                                     sizes=sizes)


__all__ = ["REGISTRY", "NbAFL", "Huang2020", "AdapDPFL", "algorithm_class", "Abort", "Aggregate", "Algorithm", "Baek", "CalibrationSum",
           "ClientNoise", "ClientReport", "ClientSpec", "LocalProcedure",
           "DPFedAvg", "FedAvg", "Mechanism", "RoundOutcome", "UnmaskPlan", "make_algorithm", "weighted_sum"]
