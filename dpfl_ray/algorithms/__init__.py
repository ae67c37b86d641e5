"""Algorithms of the papers, each plugged into the coordinator's round."""
from .base import Aggregate, client_vector, weighted_sum
from .baek import Baek
from .dp_fedavg import DPFedAvg
from .fedavg import FedAvg


def make_algorithm(scenario, weights, noise_multiplier: float | None = None):
    name = scenario.training.algorithm
    if name == "fedavg":
        return FedAvg()
    if name == "dp_fedavg":
        return DPFedAvg(scenario, weights, noise_multiplier or scenario.privacy.noise_multiplier)
    if name == "baek":
        return Baek(scenario, weights, noise_multiplier or scenario.privacy.noise_multiplier)
    raise ValueError(f"unknown algorithm {name!r}")


__all__ = ["Aggregate", "Baek", "DPFedAvg", "FedAvg", "client_vector", "make_algorithm", "weighted_sum"]
