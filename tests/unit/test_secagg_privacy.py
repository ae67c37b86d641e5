"""What the server receives from one client is uniform on Z_(2^bits), whatever that client's input.

Each test compares p-values with 1e-6 on fixed, real randomness: under the null hypothesis a
p-value is uniform, so the whole file fails spuriously with probability about 1e-5.
"""
from __future__ import annotations

import numpy as np
import pytest

from dpfl_ray.secagg import SecAggClient, SecAggRoundConfig, SecAggServer, encode

stats = pytest.importorskip("scipy.stats")

DIM = 1 << 16
LEVEL = 1e-6


def masked_vector_of_client_0(bits, x0):
    """The ``y_0`` client 0 sends in a 3-client round where the others input zeros."""
    config = SecAggRoundConfig(n_clients=3, bits=bits, threshold=2)
    clients = [SecAggClient(u, config) for u in range(3)]
    server = SecAggServer(config)
    keys = server.receive_keys([c.advertise_keys() for c in clients])
    forwarded = server.receive_shares([c.share_keys(keys) for c in clients])
    return clients[0].masked_input(forwarded[0], x0)["masked"]


def byte_histogram_p(values, bits, shift):
    counts = np.bincount(((values >> np.array(shift, values.dtype)) & np.array(0xFF, values.dtype)).astype(np.int64),
                         minlength=256)
    return stats.chisquare(counts).pvalue


def inputs(bits):
    dtype = np.uint32 if bits == 32 else np.uint64
    gradient = np.random.default_rng(5).normal(size=DIM)  # what a model update looks like once encoded
    return {"zeros": np.zeros(DIM, dtype), "all_ones": np.full(DIM, np.iinfo(dtype).max, dtype),
            "gradient": encode(gradient, bits=bits, scale=2.0**16, n_summands=3,
                               rng=np.random.default_rng(6)).data}


@pytest.mark.parametrize("bits", [32, 64])
def test_masked_input_is_uniform_for_very_different_inputs(bits):
    ys = {name: masked_vector_of_client_0(bits, x) for name, x in inputs(bits).items()}
    for name, y in ys.items():
        # Top byte: where small signed inputs pile up (0x00 / 0xFF); low byte: where an input's
        # fine structure would show through a weak mask.
        assert byte_histogram_p(y, bits, bits - 8) > LEVEL, name
        assert byte_histogram_p(y, bits, 0) > LEVEL, name
    scale = float(2**bits)
    for a, b in (("zeros", "all_ones"), ("zeros", "gradient"), ("all_ones", "gradient")):
        assert stats.ks_2samp(ys[a] / scale, ys[b] / scale).pvalue > LEVEL, (a, b)
        assert stats.kstest(ys[a] / scale, "uniform").pvalue > LEVEL, a


@pytest.mark.parametrize("bits", [32, 64])
def test_the_same_tests_reject_an_unmasked_input(bits):
    # Power check: the statistics above do notice structure when no mask hides it.
    gradient = inputs(bits)["gradient"]
    assert byte_histogram_p(gradient, bits, bits - 8) < LEVEL
    assert stats.kstest(gradient / float(2**bits), "uniform").pvalue < LEVEL


def test_masks_are_fresh_every_round():
    x = np.zeros(16, np.uint32)
    assert not np.array_equal(masked_vector_of_client_0(32, x), masked_vector_of_client_0(32, x))
