"""Client sampling for a round: Poisson with rate q, or a fixed cohort of m out of K."""
from __future__ import annotations

import numpy as np

from .randomness import DPRandomness


def sample_clients(sampling_cfg, num_clients: int, seed: int, round_idx: int,
                   randomness: DPRandomness | None = None) -> np.ndarray:
    """Sorted ids of the clients sampled in ``round_idx``.

    Poisson: each client independently with probability q (the cohort size varies, possibly 0).
    Fixed: m distinct clients uniformly at random (sampling without replacement).

    The draw is the "sample" stream of ``randomness`` (None: the reproducible stream of ``seed``):
    the amplification by sampling that the ledger books holds only against whoever cannot repeat
    the sample, so under ``privacy.randomness: os`` it comes from the run's secret too.
    """
    source = randomness if randomness is not None else DPRandomness("reproducible", int(seed))
    g = source.generator("sample", round_idx)
    if sampling_cfg.mode == "poisson":
        return np.flatnonzero(g.random(num_clients) < sampling_cfg.rate)
    if source.mode == "reproducible":  # numpy's choice: the cohorts seeded runs have always drawn
        return np.sort(g.choice(num_clients, size=sampling_cfg.clients_per_round, replace=False))
    return np.sort(g.permutation(num_clients)[:sampling_cfg.clients_per_round])
