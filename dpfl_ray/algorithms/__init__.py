"""Algorithms of the papers, each plugged into the coordinator's round."""
from .base import Aggregate, weighted_sum
from .fedavg import FedAvg


def make_algorithm(scenario):
    name = scenario.training.algorithm
    if name == "fedavg":
        return FedAvg()
    raise ValueError(f"unknown algorithm {name!r}")


__all__ = ["Aggregate", "FedAvg", "make_algorithm", "weighted_sum"]
