"""Client sampling for a round: Poisson with rate q, or a fixed cohort of m out of K."""
from __future__ import annotations

import numpy as np

from . import rng as rngmod


def sample_clients(sampling_cfg, num_clients: int, seed: int, round_idx: int) -> np.ndarray:
    """Sorted ids of the clients sampled in ``round_idx``.

    Poisson: each client independently with probability q (the cohort size varies, possibly 0).
    Fixed: m distinct clients uniformly at random (sampling without replacement).
    """
    g = rngmod.generator(seed, "sample", round_idx)
    if sampling_cfg.mode == "poisson":
        return np.flatnonzero(g.random(num_clients) < sampling_cfg.rate)
    return np.sort(g.choice(num_clients, size=sampling_cfg.clients_per_round, replace=False))
