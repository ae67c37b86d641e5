"""Batched multi-client training (dpfl_ray/training/local_batched.py) against the sequential local update.

Batched and sequential agree to float tolerance (the vmapped kernels sum in another order). A
client's batched update is *bitwise* the same whichever clients share its batch, in any position
and any chunk size: that is what keeps a run identical for every worker pool size.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from torch import nn

from dpfl_ray import rng as rngmod
from dpfl_ray.training.local import local_update
from dpfl_ray.training.local_batched import (batched_local_updates, batching_pays, can_batch, clients_per_batch,
                                   stacked_program, warm_up)
from dpfl_ray.training.models import build_model, get_flat

SHAPE = (1, 28, 28)
SEED = 5


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _model(name: str) -> nn.Module:
    return build_model(SimpleNamespace(name=name, hidden=[32]), SHAPE, 10, SEED)


def _clients(sizes, seed=0):
    g = np.random.default_rng(seed)
    xs = [g.random((n, *SHAPE), dtype=np.float32) for n in sizes]
    ys = [g.integers(0, 10, n) for n in sizes]
    return xs, ys


def _rngs(ids, round_idx=0):
    return [rngmod.generator(SEED, "batches", round_idx, c) for c in ids]


def _sequential(model, theta, xs, ys, ids, **kw):
    return [local_update(model, theta, x, y, rng=g, torch_seed=0, **kw)
            for x, y, g in zip(xs, ys, _rngs(ids))]


def _batched(model, theta, xs, ys, ids, max_clients=64, fixed_shape=None, **kw):
    return batched_local_updates(model, theta, xs, ys, rngs=_rngs(ids), torch_seeds=[0] * len(ids),
                                 max_clients=max_clients, fixed_shape=fixed_shape, **kw)


@pytest.mark.parametrize("name", ["cnn", "mlp", "logistic"])
@pytest.mark.parametrize("clip_norm", [None, 0.05])
def test_batched_matches_sequential_with_ragged_sizes(name, clip_norm):
    model = _model(name)
    theta = get_flat(model)
    sizes = [12, 12, 7, 12, 3, 7]  # groups of 3, 2 and a lone client; 12 and 7 leave ragged last batches
    xs, ys = _clients(sizes)
    ids = list(range(len(sizes)))
    kw = dict(epochs=2, batch_size=5, lr=0.1, clip_norm=clip_norm)
    seq = _sequential(model, theta, xs, ys, ids, **kw)
    bat = _batched(model, theta, xs, ys, ids, **kw)
    for s, b in zip(seq, bat):
        assert b.dtype == np.float32 and b.shape == theta.shape
        np.testing.assert_allclose(b, s, rtol=1e-4, atol=1e-6)
        if clip_norm is not None:
            assert np.linalg.norm(b) <= clip_norm * (1 + 1e-5)
    if clip_norm is not None:  # the bound binds: clipping is exercised, not skipped
        assert max(np.linalg.norm(s) for s in seq) > 0.99 * clip_norm


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "vmap"])
@pytest.mark.parametrize("name", ["cnn", "logistic"])
@pytest.mark.parametrize("clip_norm", [None, 0.05])
def test_a_clients_update_does_not_depend_on_its_batch(name, clip_norm, stacked):
    model = _model(name)
    theta = get_flat(model)
    xs, ys = _clients([10] * 9, seed=1)
    kw = dict(epochs=1, batch_size=5, lr=0.1, clip_norm=clip_norm, stacked=stacked)

    def update_of_client_0(ids, max_clients=64, fixed_shape=None):
        out = _batched(model, theta, [xs[i] for i in ids], [ys[i] for i in ids], ids, max_clients, fixed_shape,
                       **kw)
        return out[ids.index(0)]

    alone = update_of_client_0([0])
    for ids, max_clients, fixed in [([0, 1], 64, None), ([4, 2, 0], 64, None), (list(range(9)), 64, None),
                                    ([8, 7, 6, 5, 0], 2, None), (list(range(9)), 4, None),
                                    ([3, 0], 4, True), (list(range(9)), 4, True)]:
        assert np.array_equal(update_of_client_0(ids, max_clients, fixed), alone), (ids, max_clients, fixed)
    for k in range(3, 10):  # every stack size, client 0 last
        assert np.array_equal(update_of_client_0(list(range(k - 1, 0, -1)) + [0]), alone), k


AVX2_ONLY = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


@pytest.mark.skipif(all(os.environ.get(k) == v for k, v in AVX2_ONLY.items()), reason="already AVX2-only")
def test_batch_invariance_holds_with_avx2_only_kernels():
    """The same invariance on the kernels an AVX2-only CPU gets (as some CI hosts and AMD EPYC
    machines do): torch, oneDNN and MKL are told so before they load, in a fresh process."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, **AVX2_ONLY}
    tests = ["test_a_clients_update_does_not_depend_on_its_batch", "test_sequential_path_runs_the_pools",
             "test_warm_up_leaves_the_model", "test_evaluation_runs_the_cnns_pools"]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", " or ".join(tests),
                           str(Path(__file__).resolve()), str(Path(__file__).with_name("test_core.py"))],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout


def test_same_final_model_as_sequential_fedavg():
    """Three FedAvg rounds (plain mean of the updates) with either path end at the same model."""
    model = _model("cnn")
    xs, ys = _clients([10] * 6, seed=2)
    kw = dict(epochs=1, batch_size=5, lr=0.1, clip_norm=None)
    start, finals = get_flat(model), []
    for train in (_sequential, _batched):
        theta = start
        for t in range(3):
            ids = [(t + i) % 6 for i in range(4)]
            deltas = train(model, theta, [xs[i] for i in ids], [ys[i] for i in ids], ids, **kw)
            theta = (theta + np.mean(deltas, axis=0)).astype(np.float32)
        finals.append(theta)
    np.testing.assert_allclose(finals[1], finals[0], rtol=1e-4, atol=1e-6)
    assert np.abs(finals[0] - start).max() > 1e-3  # training moved the model


def test_models_with_dropout_take_the_sequential_path_exactly():
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 16), nn.Dropout(0.5), nn.ReLU(), nn.Linear(16, 10))
    assert not can_batch(model) and can_batch(_model("cnn"))
    theta = get_flat(model)
    xs, ys = _clients([8, 8, 8], seed=3)
    ids = [0, 1, 2]
    kw = dict(epochs=1, batch_size=4, lr=0.1, clip_norm=None)
    seeds = [rngmod.int_seed(SEED, "torch", 0, c) for c in ids]
    seq = [local_update(model, theta, x, y, rng=g, torch_seed=s, **kw)
           for x, y, g, s in zip(xs, ys, _rngs(ids), seeds)]
    bat = batched_local_updates(model, theta, xs, ys, rngs=_rngs(ids), torch_seeds=seeds, **kw)
    for s, b in zip(seq, bat):
        assert np.array_equal(s, b)


def test_batched_path_draws_the_same_batch_orders():
    """Both paths consume each client's generator the same way, so later draws still agree."""
    model = _model("logistic")
    theta = get_flat(model)
    xs, ys = _clients([7, 7], seed=4)
    g_seq, g_bat = _rngs([0, 1]), _rngs([0, 1])
    kw = dict(epochs=3, batch_size=3, lr=0.1, clip_norm=None)
    for x, y, g in zip(xs, ys, g_seq):
        local_update(model, theta, x, y, rng=g, torch_seed=0, **kw)
    batched_local_updates(model, theta, xs, ys, rngs=g_bat, torch_seeds=[0, 0], **kw)
    assert [g.integers(1 << 30) for g in g_seq] == [g.integers(1 << 30) for g in g_bat]


def test_clients_per_batch_fits_the_budget():
    model = _model("cnn")
    assert clients_per_batch(model, SHAPE, 10, budget_bytes=1) == 1
    small = clients_per_batch(model, SHAPE, 10, budget_bytes=10**8, max_clients=10**6)
    large = clients_per_batch(model, SHAPE, 10, budget_bytes=10**9, max_clients=10**6)
    assert 1 < small < large and abs(large / small - 10) < 0.2  # linear in the budget
    # a bigger minibatch holds more activations: fewer clients fit
    assert clients_per_batch(model, SHAPE, 50, budget_bytes=10**8, max_clients=10**6) < large
    assert clients_per_batch(model, SHAPE, 10, budget_bytes=10**12, max_clients=32) == 32


def test_mismatched_client_lists_are_refused():
    model = _model("logistic")
    xs, ys = _clients([4, 4])
    with pytest.raises(ValueError, match="one entry per client"):
        batched_local_updates(model, get_flat(model), xs, ys[:1], epochs=1, batch_size=2, lr=0.1,
                              clip_norm=None, rngs=_rngs([0, 1]), torch_seeds=[0, 0])


def test_warm_up_leaves_the_model_and_later_results_unchanged():
    model = _model("cnn")
    theta = get_flat(model)
    xs, ys = _clients([10, 10], seed=6)
    kw = dict(epochs=1, batch_size=5, lr=0.1, clip_norm=None)
    before = _batched(model, theta, xs, ys, [0, 1], **kw)
    warm_up(model, SHAPE, batch_size=5, num_classes=10)
    assert np.array_equal(get_flat(model), theta)
    after = _batched(model, theta, xs, ys, [0, 1], **kw)
    assert all(np.array_equal(a, b) for a, b in zip(before, after))


def test_channels_last_pool_gives_the_same_bits():
    """The vmapped model's max-pool runs channels-last: same maxima, same argmax on ties (ReLU zeros)."""
    model = _model("cnn")
    theta = get_flat(model)
    xs, ys = _clients([10, 10, 10], seed=7)
    kw = dict(epochs=1, batch_size=5, lr=0.1, clip_norm=None, rngs=_rngs([0, 1, 2]), torch_seeds=[0] * 3,
              stacked=False)
    fast = batched_local_updates(model, theta, xs, ys, fast_pool=True, **kw)
    kw["rngs"] = _rngs([0, 1, 2])
    own = batched_local_updates(model, theta, xs, ys, fast_pool=False, **kw)
    assert all(np.array_equal(a, b) for a, b in zip(fast, own))


def test_sequential_path_runs_the_pools_channels_last_with_the_same_bits(monkeypatch):
    """local_update drives the channels-last twin too (less time for the CNN). Every update --
    clipped or not, with a proximal term, over uneven batches -- equals the model's own
    channels-first forward to the bit: the pool hands the convolution after it channels-first
    input, for which oneDNN's AVX2 kernel (AMD EPYC, some CI hosts) rounds as the model does."""
    import dpfl_ray.training.local as local

    model = _model("cnn")
    theta = get_flat(model)
    xs, ys = _clients([23, 50, 17], seed=11)

    def updates():
        return [local_update(model, theta, x, y, epochs=2, batch_size=10, lr=0.1, clip_norm=clip,
                             rng=np.random.default_rng(i), torch_seed=i, prox_mu=mu)
                for i, (x, y, clip, mu) in enumerate(zip(xs, ys, [None, 0.5, 0.2], [0.0, 0.0, 0.01]))]

    fast = updates()
    assert all(np.array_equal(a, b) for a, b in zip(fast, updates()))
    monkeypatch.setattr(local, "pool_forward", lambda m: m)  # the model's own forward
    assert all(np.array_equal(a, b) for a, b in zip(fast, updates()))


def test_batching_pays_when_clients_share_sizes():
    cnn = _model("cnn")
    assert batching_pays(cnn, [50] * 100, cohort=10)  # W1: every client in one stack
    assert not batching_pays(cnn, [50] * 100, cohort=1)  # one client a round: nothing to share
    assert not batching_pays(cnn, list(range(1, 1001)), cohort=100)  # every size distinct
    assert batching_pays(cnn, [5, 6] * 500, cohort=100)  # two sizes, 50 clients each per round
    dropout = nn.Sequential(nn.Flatten(), nn.Dropout(0.1), nn.Linear(784, 10))
    assert not batching_pays(dropout, [50] * 100, cohort=10)


def test_the_models_run_as_one_stacked_network_with_the_vmapped_result():
    """The built-in models have a stacked form (grouped convolutions, batched matmuls); it gives
    the vmapped path's updates to float tolerance, clipped or not, over ragged groups."""
    for name in ("cnn", "mlp", "logistic"):
        model = _model(name)
        assert stacked_program(model, len(SHAPE)) is not None, name
        theta = get_flat(model)
        xs, ys = _clients([12, 12, 7, 12, 3], seed=8)
        for clip in (None, 0.05):
            kw = dict(epochs=2, batch_size=5, lr=0.1, clip_norm=clip)
            fast = _batched(model, theta, xs, ys, list(range(5)), stacked=True, **kw)
            vmapped = _batched(model, theta, xs, ys, list(range(5)), stacked=False, **kw)
            for a, b in zip(fast, vmapped):
                np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_vector_inputs_and_unknown_layers():
    """A vector-input MLP is stacked; a model without a stacked form (Tanh, a Linear on image rows, a
    circular-padded or grouped convolution, images out, a pool after the flatten) goes to vmap,
    which still matches sequential."""
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    assert stacked_program(mlp, 1) is not None
    assert stacked_program(nn.Sequential(nn.Flatten(), nn.Linear(784, 10)), 3) is not None
    assert stacked_program(nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten()), 3) is not None
    for other in (nn.Sequential(nn.Flatten(), nn.Linear(784, 8), nn.Tanh(), nn.Linear(8, 10)),
                  nn.Sequential(nn.Linear(28, 10)),
                  nn.Sequential(nn.Conv2d(1, 2, 3, groups=1, padding_mode="circular"), nn.Flatten()),
                  nn.Sequential(nn.Conv2d(2, 2, 3, groups=2), nn.Flatten()),
                  nn.Sequential(nn.Conv2d(1, 2, 3)),  # images out, not one vector per example
                  nn.Sequential(nn.Flatten(), nn.Linear(784, 16), nn.MaxPool2d(2))):
        assert stacked_program(other, 3) is None, other
    g = np.random.default_rng(9)
    xs = [g.random((6, 4), dtype=np.float32) for _ in range(3)]
    ys = [g.integers(0, 3, 6) for _ in range(3)]
    theta = get_flat(mlp)
    kw = dict(epochs=2, batch_size=4, lr=0.1, clip_norm=None)
    seq = _sequential(mlp, theta, xs, ys, [0, 1, 2], **kw)
    for stacked in (True, False):
        for s, b in zip(seq, _batched(mlp, theta, xs, ys, [0, 1, 2], stacked=stacked, **kw)):
            np.testing.assert_allclose(b, s, rtol=1e-4, atol=1e-6)
    tanh = nn.Sequential(nn.Flatten(), nn.Linear(784, 8), nn.Tanh(), nn.Linear(8, 10))
    xs, ys = _clients([6, 6], seed=10)
    theta = get_flat(tanh)
    seq = _sequential(tanh, theta, xs, ys, [0, 1], **kw)
    for s, b in zip(seq, _batched(tanh, theta, xs, ys, [0, 1], **kw)):
        np.testing.assert_allclose(b, s, rtol=1e-4, atol=1e-6)


def test_stack_padding_reports_only_the_stacks_asked_since_the_last_reset():
    """A warm worker (runtime/warm.py) serves several runs: each run's summary names the stack sizes
    it used, while the check behind them is kept for the process's life."""
    from dpfl_ray.training import local_batched as lb

    key = ("a run's model", "cpu", (1, 28, 28), 5, 3)  # the key's last field is the stack size K
    before = dict(lb._STACK_FOR)
    try:
        lb._STACK_FOR[key] = 4
        lb._USED.add(key)
        assert lb.stack_padding().get("3") == 4
        lb.reset_stack_usage()
        assert "3" not in lb.stack_padding() and lb._STACK_FOR[key] == 4
    finally:
        lb._STACK_FOR.clear()
        lb._STACK_FOR.update(before)
        lb._USED.discard(key)
