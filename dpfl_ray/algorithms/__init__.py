"""Algorithms of the papers, each one module implementing :class:`~.base.Algorithm`; the registry
maps a scenario's ``training.algorithm`` to its class. Nothing outside this package asks which
algorithm runs."""
import importlib

from .base import (
    Abort, Aggregate, Algorithm, CalibrationSum, ClientNoise, ClientReport, ClientSpec, LocalProcedure, Mechanism,
    RoundOutcome, UnmaskPlan, weighted_sum,
)

# name in a scenario -> (module, class). The modules load on first use: a worker that trains plain
# FedAvg never imports dp_accounting (and scipy), which saves ~1 s of start-up per worker process.
_CLASSES: dict[str, tuple[str, str]] = {
    "fedavg": ("fedavg", "FedAvg"), "dp_fedavg": ("dp_fedavg", "DPFedAvg"), "baek": ("baek", "Baek"),
    "nbafl": ("nbafl", "NbAFL"), "huang2020": ("huang2020", "Huang2020"), "adap_dpfl": ("adap_dpfl", "AdapDPFL"),
}
_BY_CLASS = {cls: module for module, cls in _CLASSES.values()}


def __getattr__(name: str):
    if name in _BY_CLASS:
        return getattr(importlib.import_module(f".{_BY_CLASS[name]}", __name__), name)
    if name == "REGISTRY":
        return {key: algorithm_class_named(key) for key in _CLASSES}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def algorithm_class_named(name: str) -> type[Algorithm]:
    module, cls = _CLASSES[name]
    return getattr(importlib.import_module(f".{module}", __name__), cls)


def algorithm_class(scenario) -> type[Algorithm]:
    return algorithm_class_named(scenario.training.algorithm)


def make_algorithm(scenario, weights, noise_multiplier: float | None = None, sizes=None,
                   randomness=None) -> Algorithm:
    """The scenario's algorithm over clients of these weights (and data sizes, for algorithms whose
    noise depends on them). ``randomness``: a private algorithm's source of DP draws
    (privacy/randomness.py), the run's own where it is resumed; a fresh one of the scenario's mode if None."""
    extra = {} if randomness is None else {"randomness": randomness}
    return algorithm_class(scenario)(scenario, weights, noise_multiplier or scenario.privacy.noise_multiplier,
                                     sizes=sizes, **extra)


__all__ = ["REGISTRY", "NbAFL", "Huang2020", "AdapDPFL", "algorithm_class", "algorithm_class_named", "Abort",
           "Aggregate", "Algorithm", "Baek", "CalibrationSum",
           "ClientNoise", "ClientReport", "ClientSpec", "LocalProcedure",
           "DPFedAvg", "FedAvg", "Mechanism", "RoundOutcome", "UnmaskPlan", "make_algorithm", "weighted_sum"]
