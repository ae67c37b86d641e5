"""The fixed workloads of ``dpfl bench`` (issue 14), as scenario dicts.

Each runs through the ordinary scenario path (``dpfl run``) and, for the floor, through the same
federation, sampling and fault plan. mnist5k has 4,000 training digits, so workloads that ask for
more examples than that reuse digits (``data.repeat``), as the paper scenarios do.
"""
from __future__ import annotations

import copy
import math

from dpfl_ray.errors import DPFLError

_BASE = {
    "seed": 0,
    "data": {"source": "mnist5k", "partition": {"kind": "iid"}},
    "model": {"name": "cnn"},
    "training": {"algorithm": "fedavg", "local_epochs": 1, "lr": 0.15},
    "resources": {"workers": "auto", "num_cpus_per_worker": 1},
}

_W1 = {
    "description": "100 clients x 50 mnist5k digits, 10 per round, 30 rounds, the cnn, B=10",
    "data": {"num_clients": 100, "examples_per_client": 50, "repeat": True},
    "training": {"rounds": 30, "batch_size": 10},
    "sampling": {"mode": "fixed", "clients_per_round": 10},
}

WORKLOADS: dict[str, dict] = {
    "W1": _W1,
    "W2": {
        "description": "1,000 clients x 5 digits, 100 per round, 10 rounds, B=5 (one step per client)",
        "data": {"num_clients": 1000, "examples_per_client": 5, "repeat": True},
        "training": {"rounds": 10, "batch_size": 5},
        "sampling": {"mode": "fixed", "clients_per_round": 100},
    },
    "W1-DP": {
        "description": "W1 as client-level DP-FedAvg (McMahan et al. 2018): clip S=0.5, z=1",
        "data": _W1["data"], "sampling": _W1["sampling"],
        "training": {**_W1["training"], "algorithm": "dp_fedavg"},
        # fixed-size cohorts are sampled without replacement: PLD cannot account them, RDP can
        "privacy": {"noise_multiplier": 1.0, "clipping": {"mode": "fixed", "norm": 0.5}, "accountant": "rdp",
                    "delta": 1e-5},
    },
    "W3": {
        "description": "Baek et al. 2021 over SecAgg: 500 clients x 20 digits, q=0.1, 30% tail dropout at "
                       "upload, calibration baek, 10 rounds",
        "data": {"num_clients": 500, "examples_per_client": 20, "repeat": True, "n_max": 20},
        "training": {"algorithm": "baek", "rounds": 10, "batch_size": 10},
        "sampling": {"mode": "poisson", "rate": 0.1, "clients_per_round": None},
        "privacy": {"noise_multiplier": 1.0, "clipping": {"mode": "fixed", "norm": 0.5}, "calibration": "baek",
                    "accountant": "rdp-classic", "delta": 1e-5},
        "secagg": {"enabled": True, "threshold": "majority"},
        "faults": {"dropout": {"model": "tail", "rate": 0.3, "phase": "upload"}},
    },
    "W4": {
        "description": "100,000 clients x 10 digits, 10,000 per round, 1 local step, 3 rounds",
        "data": {"num_clients": 100_000, "examples_per_client": 10, "repeat": True},
        "training": {"rounds": 3, "batch_size": 10},
        "sampling": {"mode": "fixed", "clients_per_round": 10_000},
    },
}


# Workloads that run a base workload another way (issue #35):
# - W1-warm, W2-warm: `dpfl run --address` against a Ray that was started once (`ray start --head`),
#   the start a user pays once per session;
# - S8: W1 x 8 seeds as one `dpfl sweep` (Ray Tune trials side by side in one private Ray), against
#   8 floor processes run one after another.
VARIANTS: dict[str, tuple[str, str, str]] = {
    "W1-warm": ("W1", "warm", "W1 through `dpfl run --address` against a running Ray (`ray start --head` once)"),
    "W2-warm": ("W2", "warm", "W2 through `dpfl run --address` against a running Ray (`ray start --head` once)"),
    "S8": ("W1", "sweep", "W1 x 8 seeds as one `dpfl sweep` (Ray Tune), against 8 floor processes in a row"),
}
SWEEP_SEEDS = 8


def base_and_mode(name: str) -> tuple[str, str]:
    """A workload's base workload and how it runs: 'cold' (its own `dpfl run`), 'warm' or 'sweep'."""
    if name in VARIANTS:
        return VARIANTS[name][0], VARIANTS[name][1]
    return name, "cold"


def _merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def workload(name: str) -> dict:
    """The scenario dict of workload ``name`` (a fresh copy; the caller may change it)."""
    base, _ = base_and_mode(name)
    if base not in WORKLOADS:
        raise DPFLError(f"unknown workload {name!r} (choose from {', '.join([*WORKLOADS, *VARIANTS])})",
                        field="workload")
    return _merge({**_BASE, "name": f"bench-{base}"}, WORKLOADS[base])


def scenario(name: str, overrides: list[str] | None = None):
    """The validated Scenario of a workload, with ``--set``-style overrides applied."""
    from dpfl_ray.scenario import scenario_from_dict

    return scenario_from_dict(workload(name), overrides or [])


def trained_clients(sc, round_idx: int) -> list[int]:
    """The clients that run a local update in ``round_idx``: the sampled ones, less those the fault
    plan drops before training (a client that drops at upload has trained)."""
    from dpfl_ray.faults.plan import plan_round
    from dpfl_ray.privacy.client_sampling import sample_clients

    sampled = sample_clients(sc.sampling, sc.data.num_clients, sc.seed, round_idx)
    faults = plan_round(sc.faults.dropouts, sampled, sc.seed, round_idx)
    return [int(c) for c in sampled if faults.dropped.get(int(c)) != "training"]


def implied_sgd_steps(sc, sizes) -> int:
    """SGD steps a run of ``sc`` takes: each trained client runs E epochs of ceil(n_i / B) steps."""
    tr = sc.training
    return sum(tr.local_epochs * math.ceil(int(sizes[c]) / tr.batch_size)
               for t in range(tr.rounds) for c in trained_clients(sc, t))
