"""Fu et al. 2022 building blocks (no Ray): clipping recursion, noise decay, budget stop, partition."""
import math
from dataclasses import replace
from types import SimpleNamespace

import dp_accounting
import numpy as np
import pytest
from dp_accounting.rdp import RdpAccountant
from scipy import stats

from dpfl_ray import rng as rngmod
from dpfl_ray.algorithms.adap_dpfl_core import (
    MIN_CLIP_NORM,
    claimed_ledgers,
    client_config,
    decayed_noise_multiplier,
    initial_clip_threshold,
    label_sorted_fragments,
    next_clip_threshold,
    round_events,
)
from dpfl_ray.errors import DPFLError
from dpfl_ray.training.local_dp import dpsgd_update, per_example_grad_norms
from dpfl_ray.training.models import build_model, get_flat
from dpfl_ray.privacy.client_ledgers import ClientLedgers


def problem(n=30, seed=0):
    model = build_model(SimpleNamespace(name="mlp", hidden=[8]), (6,), 3, seed=seed)
    g = np.random.default_rng(seed)
    return model, g.normal(size=(n, 6)).astype(np.float32), g.integers(0, 3, n).astype(np.int64)


def test_clipping_recursion_eq6_without_noise():
    # q = 1 (L = n): the lot is the whole data, so eq. 6 can be checked against the loop norms.
    model, x, y = problem()
    theta, alpha, c = get_flat(model), 0.8, None
    c = float(np.median(per_example_grad_norms(model, theta, x, y)))
    for t in range(3):
        norms = per_example_grad_norms(model, theta, x, y)
        res = dpsgd_update(model, theta, x, y, replace(client_config(c, 1.0, 0.01, len(y), optimizer="sgd"),
                                                          noise_multiplier=0.0),
                           seed=0, round_idx=t, client_id=0)
        assert res.sampling_rate == 1.0 and res.lot_sizes == (len(y),)
        expected = alpha * np.minimum(norms, c).sum() / len(y)
        c_next = next_clip_threshold(res, alpha)
        assert c_next == pytest.approx(expected, rel=1e-4)
        assert c_next <= alpha * c * (1 + 1e-6)  # a mean of values clipped to C, times alpha
        theta, c = theta + res.update, c_next


def test_clipping_recursion_takes_the_absolute_noisy_mean_and_never_reaches_zero():
    model, x, y = problem()
    res = dpsgd_update(model, get_flat(model), x, y, client_config(1.0, 2.0, 0.01, 10), seed=0, round_idx=0,
                       client_id=0)
    neg = replace(res, noisy_norm_sums=(-12.0,))
    assert next_clip_threshold(neg, 0.5) == pytest.approx(0.5 * 12.0 / 10)
    assert next_clip_threshold(replace(res, noisy_norm_sums=(0.0,)), 0.5) == MIN_CLIP_NORM
    assert next_clip_threshold(replace(res, noisy_norm_sums=(4.0, 8.0)), 1.0) == pytest.approx(0.6)
    # privacy.adap_dpfl.min_clip_norm: the floor is a stated setting; above it, the recursion is unchanged
    assert next_clip_threshold(replace(res, noisy_norm_sums=(0.0,)), 0.5, floor=1e-2) == 1e-2
    assert next_clip_threshold(neg, 0.5, floor=1e-2) == next_clip_threshold(neg, 0.5)
    with pytest.raises(DPFLError, match="release_norm_sum"):
        next_clip_threshold(replace(res, noisy_norm_sums=None), 1.0)


def test_norm_query_noise_has_std_sigma_times_c():
    model = build_model(SimpleNamespace(name="logistic"), (2,), 2, seed=0)
    x, y = np.zeros((3, 2), np.float32), np.zeros(3, np.int64)
    c, sigma = 0.7, 1.5
    theta = get_flat(model)
    cfg = client_config(c, sigma, 0.01, 3, optimizer="sgd")
    clean = dpsgd_update(model, theta, x, y, replace(cfg, noise_multiplier=0.0), seed=0, round_idx=0, client_id=0)
    noise = np.array([dpsgd_update(model, theta, x, y, cfg, seed=0, round_idx=0, client_id=k).noisy_norm_sums[0]
                      - clean.noisy_norm_sums[0] for k in range(200)])  # q = 1: the same lot each time
    chi2 = (noise ** 2).sum() / (sigma * c) ** 2
    assert stats.chi2.sf(chi2, len(noise)) > 1e-9 and stats.chi2.cdf(chi2, len(noise)) > 1e-9


def test_initial_threshold_is_the_mean_norm_on_noise():
    model, _, _ = problem()
    c0 = initial_clip_threshold(model, get_flat(model), (6,), 3, 50, seed=4, client_id=2)
    g = rngmod.generator(4, "fu_initial_clip", -1, 2)
    x = g.random((50, 6), dtype=np.float32)
    y = g.integers(0, 3, 50).astype(np.int64)
    assert c0 == pytest.approx(per_example_grad_norms(model, get_flat(model), x, y).mean())
    assert c0 > 0 and c0 == initial_clip_threshold(model, get_flat(model), (6,), 3, 50, seed=4, client_id=2)


@pytest.mark.parametrize("losses, decays", [
    ([], False), ([5.0], False), ([5.0, 4.0], False),
    ([5.0, 4.0, 3.0], True),              # inf > 5 > 4 > 3: the padded history counts as the first drop
    ([5.0, 4.0, 3.0, 3.0], False),        # equal is not a drop
    ([5.0, 4.0, 3.0, 2.0], True),         # a sliding window: every further drop decays again
    ([5.0, 4.0, 6.0, 5.0, 4.0], False),   # only two drops since the rise
    ([5.0, 4.0, 6.0, 5.0, 4.0, 3.0], True),
    ([1.0, 2.0, 3.0, 4.0], False),
])
def test_three_consecutive_drops_rule(losses, decays):
    assert decayed_noise_multiplier(6.0, losses, 0.5) == (3.0 if decays else 6.0)


def test_noise_decay_over_a_loss_trace():
    losses = [9, 8, 7, 6, 7, 6, 5, 4, 4, 3, 2, 1]
    sigma, trace = 6.0, []
    for t in range(1, len(losses) + 1):
        sigma = decayed_noise_multiplier(sigma, losses[:t], 0.9)
        trace.append(sigma)
    # decays after 7 (inf>9>8>7), 6, then 4 (6>5>4 after the rise to 7), then 1 (3>2>1)
    assert trace == pytest.approx([6, 6, 5.4, 4.86, 4.86, 4.86, 4.86, 4.374, 4.374, 4.374, 4.374, 3.9366])
    with pytest.raises(DPFLError, match="beta"):
        decayed_noise_multiplier(1.0, [], 1.0)


def test_budget_stop_through_the_clients_ledger():
    q, budget, sigma = 0.05, 1.0, 2.0
    eff, claimed = ClientLedgers(1e-5, num_clients=1), claimed_ledgers(1e-5, 1)
    rounds = 0
    while True:
        effective_event, claimed_event = round_events(q, sigma)
        if eff.would_exceed(0, effective_event, budget):
            break
        eff.record(0, effective_event, round=rounds)
        claimed.record(0, claimed_event, round=rounds)
        sigma = decayed_noise_multiplier(sigma, list(range(100, 100 - rounds - 1, -1)), 0.99)
        rounds += 1
    assert eff.epsilon(0) <= budget < eff.epsilon_after(0, round_events(q, sigma)[0])
    # the effective event (gradient + norm query under one lot) is one Gaussian of sigma / sqrt(2)
    direct = RdpAccountant()
    for ev, n in eff.events(0):
        inner = ev.event.events[0].noise_multiplier
        direct.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(inner / math.sqrt(2))), n)
    assert eff.epsilon(0) == pytest.approx(direct.get_epsilon(1e-5), rel=1e-6)
    # the paper's claim (eq. 10, gradient only) is smaller than what was actually released
    assert claimed.epsilon(0) < eff.epsilon(0)
    same, _ = round_events(q, 2.0, book_threshold_query=False)
    assert same == dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(2.0))


def test_label_sorted_fragments():
    labels = np.repeat(np.arange(10), 120)  # 1200 examples: 400 fragments of 3
    parts = label_sorted_fragments(labels, np.random.default_rng(0))
    assert len(parts) == 10 and all(len(p) == 120 for p in parts)
    assert len(np.unique(np.concatenate(parts))) == 1200  # disjoint, all used
    for p in parts:  # 40 fragments, each of one label (120 per label = 40 whole fragments)
        frags = p.reshape(40, 3)
        assert all(len(np.unique(labels[f])) == 1 for f in frags)
    with pytest.raises(DPFLError, match="fragments"):
        label_sorted_fragments(labels, np.random.default_rng(0), num_clients=7)


def test_a_client_that_keeps_its_adam_state_takes_over_two_rounds_the_two_steps_of_one_round():
    from dpfl_ray.training.local_dp import AdamState, DPSGDConfig

    model, x, y = problem()
    theta = get_flat(model).copy()
    # the whole data set as every lot and no noise: each step's gradient depends on the parameters only
    cfg = DPSGDConfig(clip_norm=1.0, noise_multiplier=0.0, lr=0.01, lot_size=len(y), sampling="fixed", steps=1,
                      optimizer="adam")
    both = dpsgd_update(model, theta, x, y, replace(cfg, steps=2), seed=0, round_idx=0, client_id=0)
    first = dpsgd_update(model, theta, x, y, cfg, seed=0, round_idx=0, client_id=0, keep_adam_state=True)
    assert first.adam_state.step == 1 and first.adam_state.exp_avg.shape == theta.shape
    kept = AdamState.from_dict(first.adam_state.to_dict())  # as a checkpoint stores it: exact
    assert np.array_equal(kept.exp_avg, first.adam_state.exp_avg) and kept.step == 1
    theta1 = theta + first.update
    second = dpsgd_update(model, theta1, x, y, cfg, seed=0, round_idx=1, client_id=0, adam_state=kept,
                          keep_adam_state=True)
    fresh = dpsgd_update(model, theta1, x, y, cfg, seed=0, round_idx=1, client_id=0)
    assert second.adam_state.step == 2
    np.testing.assert_allclose(theta1 + second.update, theta + both.update, rtol=0, atol=1e-6)
    # a new optimizer's first step moves every parameter by about lr; the kept one does not
    assert np.abs(fresh.update - second.update).max() > 1e-3


def test_adap_dpfl_hands_each_client_its_own_adam_state_and_checkpoints_it():
    from dpfl_ray.algorithms.adap_dpfl import AdapDPFL
    from dpfl_ray.algorithms.base import RoundOutcome
    from dpfl_ray.scenario import load_scenario

    sc = load_scenario("scenarios/papers/fu2022/adap.yaml",
                       ["privacy.adap_dpfl.optimizer_state=client", "data.source=mnist5k"])
    model, x, y = problem()
    alg = AdapDPFL(sc, weights=[1.0, 1.0], sizes=[len(y), len(y)])
    theta = get_flat(model).copy()
    for r in range(2):
        alg.begin_round(r, [0, 1])
        proc = alg.client_spec().local
        assert proc.keep_adam_state and [c for c, _ in proc.adam_states] == ([] if r == 0 else [0, 1])
        out = {c: proc.run(model, theta, x, y, seed=0, round_idx=r, client_id=c) for c in (0, 1)}
        alg.finish(RoundOutcome(round=r, survivors=(0, 1), total=out[0][0] + out[1][0],
                                reports={c: rep for c, (_, rep) in out.items()}), theta.size)
    assert {c: s.step for c, s in alg.adam_states.items()} == {0: 2, 1: 2}
    again = AdapDPFL(sc, weights=[1.0, 1.0], sizes=[len(y), len(y)])
    again.load_state_dict(alg.state_dict())
    assert all(np.array_equal(again.adam_states[c].exp_avg_sq, alg.adam_states[c].exp_avg_sq) for c in (0, 1))
    plain = AdapDPFL(load_scenario("scenarios/papers/fu2022/adap.yaml", ["data.source=mnist5k"]),
                     weights=[1.0, 1.0], sizes=[len(y), len(y)])
    plain.begin_round(0, [0, 1])
    assert not plain.client_spec().local.keep_adam_state


def test_a_client_that_takes_no_step_releases_the_noisy_gradient_an_sgd_step_of_lr_1_descends_by():
    from dpfl_ray.training.local_dp import DPSGDConfig

    model, x, y = problem()
    theta = get_flat(model).copy()
    cfg = DPSGDConfig(clip_norm=0.5, noise_multiplier=1.3, lr=1.0, lot_size=8, sampling="poisson", steps=1,
                      optimizer="sgd")
    sgd = dpsgd_update(model, theta, x, y, cfg, seed=3, round_idx=2, client_id=1)
    none = dpsgd_update(model, theta, x, y, replace(cfg, optimizer="none"), seed=3, round_idx=2, client_id=1)
    assert none.lot_sizes == sgd.lot_sizes and np.abs(none.update).max() > 0.01  # the same lot and noise
    np.testing.assert_allclose(none.update, sgd.update, rtol=0, atol=1e-6)


def test_a_server_adam_steps_on_the_weighted_mean_noisy_gradient_and_is_checkpointed():
    import torch

    from dpfl_ray.algorithms.adap_dpfl import AdapDPFL
    from dpfl_ray.algorithms.base import RoundOutcome
    from dpfl_ray.scenario import load_scenario

    sc = load_scenario("scenarios/papers/fu2022/adap.yaml",
                       ["privacy.adap_dpfl.optimizer_state=server", "data.source=mnist5k"])
    model, x, y = problem()
    weights = [1.0, 3.0]
    alg = AdapDPFL(sc, weights=weights, sizes=[len(y), len(y)])
    theta = get_flat(model).copy()
    # the reference: torch's own Adam on the model's parameters, fed the same mean gradients
    ref = torch.from_numpy(theta.copy())
    ref_opt = torch.optim.Adam([ref], lr=sc.privacy.adap_dpfl.lr)

    def one_round(algorithm, r, theta):
        algorithm.begin_round(r, [0, 1])
        proc = algorithm.client_spec().local
        assert proc.optimizer == "none" and not proc.keep_adam_state
        out = {c: proc.run(model, theta, x, y, seed=0, round_idx=r, client_id=c) for c in (0, 1)}
        agg = algorithm.finish(RoundOutcome(round=r, survivors=(0, 1), updates={c: u for c, (u, _) in out.items()},
                                            reports={c: rep for c, (_, rep) in out.items()}), theta.size)
        return agg, {c: -u for c, (u, _) in out.items()}

    for r in range(2):
        agg, grads = one_round(alg, r, theta)
        ref.grad = torch.from_numpy(((weights[0] * grads[0] + weights[1] * grads[1]) / sum(weights)).astype(np.float32))
        ref_opt.step()
        theta = (theta + agg.delta).astype(np.float32)
        np.testing.assert_allclose(theta, ref.detach().numpy(), rtol=0, atol=1e-6)
    assert alg.server_adam.step == 2 and not alg.adam_states
    # Adam's steps, not the gradients: every parameter moved by about lr in the first step
    assert abs(np.abs(agg.delta).max() - sc.privacy.adap_dpfl.lr) < 0.5 * sc.privacy.adap_dpfl.lr

    again = AdapDPFL(sc, weights=weights, sizes=[len(y), len(y)])
    again.load_state_dict(alg.state_dict())
    assert again.server_adam.step == 2 and np.array_equal(again.server_adam.exp_avg_sq, alg.server_adam.exp_avg_sq)
    a, _ = one_round(alg, 2, theta)
    b, _ = one_round(again, 2, theta)
    assert np.array_equal(a.delta, b.delta)


def test_eq6_s_reading_of_the_noise_round_scales_the_first_threshold_by_alpha_and_only_the_first():
    from dpfl_ray.algorithms.adap_dpfl import AdapDPFL
    from dpfl_ray.algorithms.base import RoundOutcome
    from dpfl_ray.scenario import load_scenario

    model, x, y = problem()
    theta = get_flat(model).copy()
    used, released = {}, {}
    for reading in ("noise", "eq6"):
        sc = load_scenario("scenarios/papers/fu2022/adap.yaml",
                           ["data.source=mnist5k", f"privacy.adap_dpfl.initial_clip={reading}"])
        alg = AdapDPFL(sc, weights=[1.0], sizes=[len(y)])
        for r in range(2):
            alg.begin_round(r, [0])
            update, rep = alg.client_spec().local.run(model, theta, x, y, seed=0, round_idx=r, client_id=0)
            alg.finish(RoundOutcome(round=r, survivors=(0,), total=update, reports={0: rep}), theta.size)
            used[reading, r], released[reading, r] = rep.values["clip_used"], rep.values["clip_norm"]
    measured = initial_clip_threshold(model, theta, (6,), 3, 78, seed=0, client_id=0)
    assert measured > 0.1  # the mean norm on noise, far above the floor
    assert used["noise", 0] == pytest.approx(measured) and used["eq6", 0] == pytest.approx(0.01 * measured)
    # from the second round on, eq. 6 on the first round's release, whichever C_0 it clipped at
    assert used["noise", 1] == released["noise", 0] and used["eq6", 1] == released["eq6", 0]
    assert initial_clip_threshold(model, theta, (6,), 3, 78, seed=0, client_id=0, alpha=1e-9, floor=0.02) == 0.02
    with pytest.raises(DPFLError, match="initial_clip"):
        load_scenario("scenarios/papers/fu2022/adap.yaml", ["privacy.adap_dpfl.initial_clip=0.01"])


def test_a_server_adam_wants_one_lot_per_client_round():
    from dpfl_ray.scenario import load_scenario

    with pytest.raises(DPFLError, match=r"^privacy.adap_dpfl.optimizer_state: 'server' .*\.steps: 1 \(it is 2\)$"):
        load_scenario("scenarios/papers/fu2022/adap.yaml", ["privacy.adap_dpfl.optimizer_state=server",
                                                            "privacy.adap_dpfl.steps=2", "data.source=mnist5k"])


def test_adap_dpfl_is_booked_under_zero_out_whose_rdp_is_add_remove_s_for_its_events():
    """The run releases each client's record count (q = L/n, eq. 1's weights), so its neighbours keep
    it: zero-out, not the paper's add/remove. For every event its clients book (one Poisson lot, with
    or without the norm query, over several steps), dp_accounting's RDP under zero-out (its
    REPLACE_SPECIAL) is the add/remove curve the ledgers compute, to the bit."""
    from pathlib import Path

    from dpfl_ray.algorithms.adap_dpfl import AdapDPFL
    from dpfl_ray.scenario import load_scenario

    sc = load_scenario(Path(__file__).resolve().parents[2] / "scenarios" / "papers" / "fu2022" / "adap.yaml")
    relation, public = AdapDPFL.adjacency(sc)
    assert relation == "zero_out" and "record count n" in public[0]
    with pytest.raises(ValueError, match="only zero_out"):
        AdapDPFL.adjacency(sc.model_copy(update={"privacy": sc.privacy.model_copy(update={"adjacency": "add_remove"})}))
    for with_query in (False, True):
        event = dp_accounting.SelfComposedDpEvent(round_events(78 / 5400, 3.7, book_threshold_query=with_query)[0], 3)
        curves = []
        for rel in (dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE, dp_accounting.NeighboringRelation.REPLACE_SPECIAL):
            acc = RdpAccountant(neighboring_relation=rel)
            acc.compose(event)
            curves.append(acc._rdp)
        assert np.array_equal(*curves) and curves[0].any()
