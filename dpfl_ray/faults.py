"""Faults are data (ARCHITECTURE.md, principle 4): a plan drawn from the scenario and the seed,
before the round runs, saying which sampled client drops in which phase. The runtime carries
the plan out; aggregation uses survivors only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from . import rng as rngmod

# The phases a client can vanish in, in protocol order. 'advertise' and 'share' are SecAgg's key
# rounds, 'upload' is the (masked) input, 'unmask' comes after the input reached the server, and
# 'calibration' after the unmask shares, before the client's calibration term (Baek et al. Alg. 2
# line 22) is sent.
PHASES = ("training", "advertise", "share", "upload", "unmask", "calibration")
# A client that leaves in one of these phases has already delivered its update.
DELIVERED_PHASES = ("unmask", "calibration")
# Fault-plan phase -> the worker's phase (dpfl_ray.secagg.PHASES, then Baek's calibration)
SECAGG_PHASE = {"advertise": "advertise", "share": "share", "upload": "masked_input", "unmask": "unmask",
                "calibration": "calibration"}


@dataclass(frozen=True)
class RoundFaults:
    """Who drops, and when, in one round."""

    dropped: dict[int, str] = field(default_factory=dict)  # client id -> phase
    report_order: tuple[int, ...] = ()

    def delivers(self, client_id: int) -> bool:
        """Did this client's update reach the server (it may still vanish afterwards)?"""
        return self.dropped.get(int(client_id), "unmask") in DELIVERED_PHASES

    def survivors(self, sampled) -> list[int]:
        return [int(c) for c in sampled if self.delivers(c)]


def num_tail_drops(rate: float, n: int) -> int:
    """Round-half-up of rate * n, guarded against float noise (0.3 * 10 -> 3)."""
    return min(n, int(math.floor(rate * n + 0.5 + 1e-9)))


def plan_round(dropout_cfg, sampled: np.ndarray, seed: int, round_idx: int) -> RoundFaults:
    """Draw the round's dropouts.

    ``dropout_cfg`` is one dropout model or a list of them (several phases of one round); they
    act in protocol order, each on the clients still present in its phase, so a ``rate`` of a
    later phase is a fraction of the clients that reached it.

    ``bernoulli``: each present client drops independently with probability ``rate``.
    ``tail``: clients report in a seeded random order and the last ``rate`` fraction to report
    drop (Baek et al. 2021, Sec. VI.B.2: 'dropped out in the order in which the data are sent').
    """
    specs = list(dropout_cfg) if isinstance(dropout_cfg, (list, tuple)) else [dropout_cfg]
    sampled = [int(c) for c in sampled]
    g = rngmod.generator(seed, "faults", round_idx)
    order = tuple(int(c) for c in g.permutation(sampled)) if sampled else ()
    dropped: dict[int, str] = {}
    for spec in sorted(specs, key=lambda d: PHASES.index(d.phase)):
        model, rate, phase = spec.model, spec.rate, spec.phase
        present = [c for c in sampled if c not in dropped]
        if model == "none" or rate == 0 or not present:
            continue
        if model == "bernoulli":
            hits = g.random(len(present)) < rate
            dropped.update({c: phase for c, h in zip(present, hits) if h})
        elif model == "tail":
            still = [c for c in order if c not in dropped]
            k = num_tail_drops(rate, len(still))
            dropped.update({c: phase for c in still[len(still) - k:]})
        else:
            raise ValueError(f"unknown dropout model {model!r}")
    return RoundFaults(dropped, order)
