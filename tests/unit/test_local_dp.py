"""Per-example DP-SGD (no Ray): vmap gradients against a Python loop, clipping, noise, lots, events."""
from types import SimpleNamespace

import dp_accounting
import numpy as np
import pytest
import torch
from scipy import stats

from dpfl_ray.errors import DPFLError
from dpfl_ray.training.local_dp import (
    DPSGDConfig,
    clip_and_sum,
    dpsgd_update,
    fixed_batches,
    per_example_grad_norms,
    per_example_grads,
    poisson_lots,
)
from dpfl_ray.training.models import build_model, get_flat

MODELS = {"cnn": ((1, 28, 28), SimpleNamespace(name="cnn")),
          "mlp": ((1, 8, 8), SimpleNamespace(name="mlp", hidden=[16, 8])),
          "logistic": ((4,), SimpleNamespace(name="logistic"))}


def model_and_data(name, n=12, seed=0):
    shape, cfg = MODELS[name]
    model = build_model(cfg, shape, 10, seed=seed)
    g = np.random.default_rng(seed)
    x = g.random((n, *shape), dtype=np.float32)
    y = g.integers(0, 10, n).astype(np.int64)
    return model, x, y


def loop_grads(model, x, y):
    """Reference: one forward/backward per example."""
    out = []
    for i in range(len(y)):
        model.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(x[i:i + 1])), torch.from_numpy(y[i:i + 1]))
        loss.backward()
        out.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone())
    return torch.stack(out)


def flat_params(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


@pytest.mark.parametrize("name", ["cnn", "mlp", "logistic"])
def test_per_example_grads_equal_a_python_loop(name):
    model, x, y = model_and_data(name, n=8)
    ref = loop_grads(model, x, y)
    got = per_example_grads(model, flat_params(model), torch.from_numpy(x), torch.from_numpy(y))
    got = torch.cat([g.reshape(len(y), -1) for g in got.values()], dim=1)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-6)
    norms = per_example_grad_norms(model, get_flat(model), x, y, batch_size=5)  # two chunks
    np.testing.assert_allclose(norms, ref.norm(dim=1).numpy(), rtol=1e-4)


@pytest.mark.parametrize("name", ["cnn", "mlp"])
def test_clipped_sum_equals_a_python_loop_and_respects_the_bound(name):
    model, x, y = model_and_data(name, n=16)
    ref = loop_grads(model, x, y)
    clip = float(ref.norm(dim=1).median())  # half the examples are clipped, half are not
    ref_sum = sum(g * min(1.0, clip / float(g.norm())) for g in ref)
    grads = per_example_grads(model, flat_params(model), torch.from_numpy(x), torch.from_numpy(y))
    summed, norms = clip_and_sum(grads, clip)
    got = torch.cat([summed[k].reshape(-1) for k in grads])
    # the clip leaves a 1e-5 relative margin below S: each clipped example may differ by 1e-5 * S
    assert float((got - ref_sum).norm()) <= len(y) * clip * 2e-5
    torch.testing.assert_close(norms, ref.norm(dim=1), rtol=1e-4, atol=1e-7)
    # every clipped example, alone, stays within S (the accountant relies on it exactly)
    for i in range(len(y)):
        one, _ = clip_and_sum({k: g[i:i + 1] for k, g in grads.items()}, clip)
        assert float(torch.linalg.vector_norm(torch.cat([v.reshape(-1) for v in one.values()]))) <= clip


def test_noiseless_full_batch_step_is_minus_lr_times_clipped_mean():
    model, x, y = model_and_data("mlp", n=10)
    ref = loop_grads(model, x, y)
    clip, lr = 0.05, 0.3
    cfg = DPSGDConfig(clip_norm=clip, noise_multiplier=0.0, lr=lr, lot_size=10, sampling="fixed", steps=1)
    res = dpsgd_update(model, get_flat(model), x, y, cfg, seed=1, round_idx=0, client_id=0)
    expected = -lr / 10 * sum(g * min(1.0, clip / float(g.norm())) for g in ref)
    np.testing.assert_allclose(res.update, expected.numpy(), rtol=1e-4, atol=1e-7)
    assert res.update.dtype == np.float32 and res.steps == 1 and res.lot_sizes == (10,)
    assert isinstance(res.step_event(), dp_accounting.NonPrivateDpEvent)  # sigma = 0 is no DP at all


def test_noise_on_the_sum_has_std_sigma_times_s():
    # One SGD step with and without noise on the same lot: the difference is -lr/L * sigma*S*xi.
    model, x, y = model_and_data("cnn", n=20)
    theta = get_flat(model)
    sigma, clip, lr, lot = 1.7, 0.4, 0.5, 8
    noise = []
    for client in range(12):  # 12 independent streams x 26010 coordinates
        kw = dict(seed=5, round_idx=3, client_id=client)
        noisy = dpsgd_update(model, theta, x, y, DPSGDConfig(clip, sigma, lr, lot, steps=1), **kw)
        clean = dpsgd_update(model, theta, x, y, DPSGDConfig(clip, 0.0, lr, lot, steps=1), **kw)
        assert noisy.lot_sizes == clean.lot_sizes  # the lots do not depend on the noise
        noise.append((noisy.update.astype(np.float64) - clean.update) * (-lot / lr))
    z = np.concatenate(noise)
    n, std = len(z), sigma * clip
    chi2 = (n - 1) * z.var(ddof=1) / std ** 2
    assert stats.chi2.sf(chi2, n - 1) > 1e-9 and stats.chi2.cdf(chi2, n - 1) > 1e-9
    assert abs(z.mean()) / (std / np.sqrt(n)) < 6.1  # two-sided z-test at ~1e-9
    again = dpsgd_update(model, theta, x, y, DPSGDConfig(clip, sigma, lr, lot, steps=1), seed=5, round_idx=3,
                         client_id=0)
    first = dpsgd_update(model, theta, x, y, DPSGDConfig(clip, sigma, lr, lot, steps=1), seed=5, round_idx=3,
                         client_id=0)
    assert np.array_equal(again.update, first.update)  # seeded by (seed, round, client)
    other = dpsgd_update(model, theta, x, y, DPSGDConfig(clip, sigma, lr, lot, steps=1), seed=5, round_idx=4,
                         client_id=0)
    assert not np.array_equal(other.update, first.update)


def test_poisson_lots_include_each_example_with_probability_q():
    n, q, steps = 500, 0.04, 600
    lots = poisson_lots(n, q, steps, np.random.default_rng(11))
    counts = np.zeros(n)
    for lot in lots:
        counts[lot] += 1
    total, trials = counts.sum(), n * steps
    assert abs(total - trials * q) / np.sqrt(trials * q * (1 - q)) < 6.1
    # each example's count is Binomial(steps, q): chi-square of the counts' dispersion
    disp = ((counts - steps * q) ** 2).sum() / (steps * q * (1 - q))
    assert stats.chi2.sf(disp, n) > 1e-9 and stats.chi2.cdf(disp, n) > 1e-9
    sizes = np.array([len(lot) for lot in lots])
    assert stats.chi2.sf(((sizes - n * q) ** 2).sum() / (n * q * (1 - q)), steps) > 1e-9


def test_dpsgd_poisson_run_books_q_sigma_and_steps():
    model, x, y = model_and_data("logistic", n=200)
    cfg = DPSGDConfig(clip_norm=1.0, noise_multiplier=1.1, lr=0.1, lot_size=20, epochs=2)
    res = dpsgd_update(model, get_flat(model), x, y, cfg, seed=0, round_idx=1, client_id=4)
    assert res.steps == 20 and res.sampling_rate == pytest.approx(0.1) and res.noise_multiplier == 1.1
    assert res.dp_event() == dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(1.1)), 20)
    assert len(res.lot_sizes) == 20 and 0 < np.mean(res.lot_sizes) < 40


def test_fixed_batches_cover_each_epoch_once_and_book_the_shift():
    lots = fixed_batches(23, 5, 10, np.random.default_rng(0))
    assert [len(b) for b in lots] == [5, 5, 5, 5, 3, 5, 5, 5, 5, 3]
    assert sorted(np.concatenate(lots[:5])) == list(range(23))
    model, x, y = model_and_data("logistic", n=23)
    res = dpsgd_update(model, get_flat(model), x, y, DPSGDConfig(1.0, 2.0, 0.1, 5, sampling="fixed"),
                       seed=0, round_idx=0, client_id=0)
    assert res.steps == 5 and res.sampling_rate is None
    assert res.step_event() == dp_accounting.GaussianDpEvent(1.0)  # sensitivity 2S: sigma / 2
    full = dpsgd_update(model, get_flat(model), x, y, DPSGDConfig(1.0, 2.0, 0.1, 23, sampling="fixed"),
                        seed=0, round_idx=0, client_id=0)
    assert full.step_event() == dp_accounting.GaussianDpEvent(2.0)


def test_norm_sum_release_is_the_clipped_norm_sum_and_is_booked():
    model, x, y = model_and_data("mlp", n=10)
    norms = loop_grads(model, x, y).norm(dim=1).numpy()
    clip = float(np.median(norms))
    cfg = DPSGDConfig(clip, 0.0, 0.1, 10, sampling="fixed", steps=1, release_norm_sum=True)
    res = dpsgd_update(model, get_flat(model), x, y, cfg, seed=0, round_idx=0, client_id=0)
    assert res.noisy_norm_sums[0] == pytest.approx(np.minimum(norms, clip).sum(), rel=1e-4)
    cfg = DPSGDConfig(clip, 3.0, 0.1, 5, steps=2, release_norm_sum=True)
    res = dpsgd_update(model, get_flat(model), x, y, cfg, seed=0, round_idx=0, client_id=0)
    g = dp_accounting.GaussianDpEvent(3.0)
    assert res.step_event() == dp_accounting.PoissonSampledDpEvent(0.5, dp_accounting.ComposedDpEvent([g, g]))


def test_an_empty_poisson_lot_still_releases_noise():
    model, x, y = model_and_data("logistic", n=5)
    cfg = DPSGDConfig(clip_norm=1.0, noise_multiplier=1.0, lr=1.0, lot_size=1, steps=1)
    for client in range(50):
        res = dpsgd_update(model, get_flat(model), x, y, cfg, seed=2, round_idx=0, client_id=client)
        if res.lot_sizes == (0,):
            assert np.all(res.update != 0)  # pure noise, not a silent skip
            return
    pytest.fail("no empty lot in 50 draws at q=0.2")  # (0.8^5)^-50: does not happen


def test_adam_first_step_moves_each_coordinate_by_about_lr():
    model, x, y = model_and_data("mlp", n=20)
    cfg = DPSGDConfig(clip_norm=1.0, noise_multiplier=0.5, lr=0.002, lot_size=10, steps=1, optimizer="adam")
    res = dpsgd_update(model, get_flat(model), x, y, cfg, seed=0, round_idx=0, client_id=0)
    assert np.median(np.abs(res.update)) == pytest.approx(0.002, rel=1e-3)


def test_zero_steps_release_nothing():
    model, x, y = model_and_data("logistic", n=5)
    cfg = DPSGDConfig(1.0, 1.0, 0.1, 2, steps=0, release_norm_sum=True)
    res = dpsgd_update(model, get_flat(model), x, y, cfg, seed=0, round_idx=0, client_id=0)
    assert not np.any(res.update) and res.noisy_norm_sums == () and res.lot_sizes == ()
    assert isinstance(res.dp_event(), dp_accounting.NoOpDpEvent)


def test_bad_configs_are_user_errors():
    with pytest.raises(DPFLError, match="clip_norm"):
        DPSGDConfig(clip_norm=0.0, noise_multiplier=1.0, lr=0.1, lot_size=4)
    with pytest.raises(DPFLError, match="noise_multiplier"):
        DPSGDConfig(clip_norm=1.0, noise_multiplier=-1.0, lr=0.1, lot_size=4)
    with pytest.raises(DPFLError, match="sampling"):
        DPSGDConfig(clip_norm=1.0, noise_multiplier=1.0, lr=0.1, lot_size=4, sampling="shuffle")
    model, _, _ = model_and_data("logistic")
    with pytest.raises(DPFLError, match="no examples"):
        dpsgd_update(model, get_flat(model), np.zeros((0, 4), np.float32), np.zeros(0, np.int64),
                     DPSGDConfig(1.0, 1.0, 0.1, 4), seed=0, round_idx=0, client_id=0)
