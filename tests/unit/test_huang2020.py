"""Huang et al. 2020 building blocks (no Ray): DPAGD budgets, split updates, the Laplace arg-max."""
import math
from types import SimpleNamespace

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting.rdp import RdpAccountant

from dpfl_ray.algorithms.huang2020_core import (
    DPAGDConfig,
    HuangClientBudget,
    argmax_dp_event,
    argmax_epsilon,
    budgets_by_size,
    dpagd_update,
    gaussian_noise_multiplier,
    noisy_argmax,
    round_dp_events,
)
from dpfl_ray.errors import DPFLError
from dpfl_ray.training.local_dp import clip_and_sum, per_example_grad_fn, per_example_grads
from dpfl_ray.training.models import build_model, get_flat
from dpfl_ray.privacy.client_ledgers import ClientLedgers


def problem(n=40, seed=0):
    model = build_model(SimpleNamespace(name="logistic"), (4,), 3, seed=seed)
    g = np.random.default_rng(seed)
    y = g.integers(0, 3, n).astype(np.int64)
    x = (g.normal(size=(n, 4)) + 2.0 * np.eye(4)[y]).astype(np.float32)  # separable-ish blobs
    return model, x, y


def cfg(**kw):
    base = dict(clip_norm=1.0, step_sizes=(0.5, 1.0, 2.0), loss_clip=3.0, epsilon_gradient=0.05,
                epsilon_selection=0.05, gamma=0.1)
    return DPAGDConfig(**{**base, **kw})


def _costliest_path(c, budget) -> float:
    """The largest rho' (replace-one) of any path Alg. 1's budget rule allows in a round, whatever the
    arg-max picks: each selection may step (a new gradient follows) or not (the split moves budget
    from the gradients to the selections), found by trying both at every selection."""
    def gradient_rho(eps_g):
        return 1 / (2 * (gaussian_noise_multiplier(eps_g, c.calibration, c.delta) / 2) ** 2)

    def from_gradient(spent, k):
        eps_g, eps_n = c.epsilon_gradient * (1 - c.gamma) ** k, c.epsilon_selection * (1 + c.gamma) ** k
        if spent + eps_g + eps_n > budget * (1 + 1e-12):
            return 0.0
        return gradient_rho(eps_g) + from_selection(spent + eps_g, k)

    def from_selection(spent, k):
        eps_n = c.epsilon_selection * (1 + c.gamma) ** k
        if spent + eps_n > budget * (1 + 1e-12):
            return 0.0
        return 4 * eps_n + max(from_gradient(spent + eps_n, k), from_selection(spent + eps_n, k + 1))

    return from_gradient(0.0, 0)


@pytest.mark.parametrize("calibration, delta", [("zcdp", None), ("eq3", 1e-3)])
def test_a_round_books_its_costliest_path_not_the_one_its_picks_took(calibration, delta):
    """Which mechanisms a round runs follows from the noisy arg-max's picks (a 'no step' moves budget
    from the gradients to the selections), so a neighbour can take a costlier path than the one
    taken: the sum of what ran is an odometer, not a guarantee. The ledger books a bound on every
    path: 4 B under the zcdp reading; under eq. 3, where a gradient costs far less than its budget
    share, the selections' 4 eps_n: at the paper's eps_k = 8 over 20 rounds within 0.2% of the costliest
    path (a budget can hold a rest too small for one more mechanism: coarse costs leave more)."""
    def rho(events):
        return sum(n * (ev.rho if hasattr(ev, "rho") else 1 / (2 * ev.noise_multiplier ** 2)) for ev, n in events)

    paper = cfg(calibration=calibration, delta=delta, epsilon_gradient=0.04, epsilon_selection=0.01)
    for c in (paper, cfg(calibration=calibration, delta=delta)):
        for budget in (0.05, 0.1, 0.1375, 0.2):
            booked, worst = rho(round_dp_events(c, budget)), _costliest_path(c, budget)
            assert worst <= booked * (1 + 1e-12), (budget, worst, booked)
            if calibration == "zcdp" and booked:  # (a budget below one gradient and selection runs nothing)
                assert booked == pytest.approx(4 * budget, rel=1e-12)
    assert rho(round_dp_events(paper, 8 / 20)) <= 1.002 * _costliest_path(paper, 8 / 20)
    c = cfg(calibration=calibration, delta=delta)
    model, x, y = problem()
    ran = dpagd_update(model, get_flat(model), x, y, c, 0.2, seed=1, round_idx=0, client_id=0)
    assert 0 < rho(ran.dp_events()) <= _costliest_path(c, 0.2) * (1 + 1e-12)
    assert round_dp_events(c, c.epsilon_gradient + c.epsilon_selection / 2) == []  # it cannot run: nothing booked


def test_dpagd_never_spends_beyond_the_clients_budget_over_rounds():
    model, x, y = problem()
    c = cfg()
    budget, theta, rounds = HuangClientBudget(epsilon=1.0), get_flat(model), 8
    ledger = ClientLedgers(1e-5, num_clients=1)
    zs_ran, eps_ran = [], []
    for r in range(40):
        if budget.exhausted(c, rounds):
            break
        res = dpagd_update(model, theta, x, y, c, budget.round_budget(rounds), seed=1, round_idx=r, client_id=0)
        zs_ran += res.gradient_noise_multipliers
        eps_ran += res.argmax_epsilons
        assert res.spent <= budget.round_budget(rounds) and res.spent > 0
        # zCDP reading: what was spent is exactly the rho of the mechanisms that ran
        rho = sum(1 / (2 * z * z) for z in res.gradient_noise_multipliers) + sum(e * e / 2 for e in res.argmax_epsilons)
        assert rho == pytest.approx(res.spent, rel=1e-9)
        for ev, k in res.dp_events():
            ledger.record(0, ev, k, round=r)
        budget = budget.after(res.spent)
        theta = theta + res.update
    assert budget.exhausted(c, rounds) and budget.spent <= 1.0 + 1e-12
    assert r >= rounds  # eps_k / T per round: at least T rounds before quitting
    # Under replace-one (the size n is released) every mechanism costs twice its sensitivity, so
    # rho four times what was spent: recomputed here from the events that ran, with dp_accounting
    direct = RdpAccountant()
    for z in zs_ran:
        direct.compose(dp_accounting.GaussianDpEvent(z / 2))
    for e in eps_ran:
        direct.compose(dp_accounting.ZCDpEvent((2 * e) ** 2 / 2))
    assert ledger.epsilon(0) == pytest.approx(direct.get_epsilon(1e-5), rel=1e-9)
    same = RdpAccountant()
    same.compose(dp_accounting.ZCDpEvent(4 * budget.spent))
    assert ledger.epsilon(0) == pytest.approx(same.get_epsilon(1e-5), rel=1e-9)
    assert ledger.epsilon(0) > 2 * ledger_if_add_remove(zs_ran, eps_ran)


def ledger_if_add_remove(zs, eps) -> float:
    """The same mechanisms booked as if n were private and neighbours differed by one record."""
    acc = RdpAccountant()
    for z in zs:
        acc.compose(dp_accounting.GaussianDpEvent(z))
    for e in eps:
        acc.compose(dp_accounting.ZCDpEvent(e * e / 2))
    return acc.get_epsilon(1e-5)


def test_a_budget_of_exactly_t_rounds_lasts_t_rounds():
    # eps_k = 1 over T = 20 rounds at 0.04 + 0.01 a round (the Fig. 7 scenarios' lowest category):
    # float sums leave 0.04999999999999982 before the last round, which must still run
    model, x, y = problem()
    c = cfg(epsilon_gradient=0.04, epsilon_selection=0.01)
    budget, theta, ran = HuangClientBudget(epsilon=1.0), get_flat(model), 0
    for r in range(20):
        assert not budget.exhausted(c, 20), (r, budget)
        res = dpagd_update(model, theta, x, y, c, budget.round_budget(20), seed=2, round_idx=r, client_id=0)
        assert res.spent > 0 and len(res.gradient_noise_multipliers) == 1
        budget, theta, ran = budget.after(res.spent), theta + res.update, ran + 1
    assert ran == 20 and budget.exhausted(c, 20)
    assert budget.spent == pytest.approx(1.0, abs=1e-12) and budget.spent <= 1.0 + 1e-12


def test_split_moves_by_gamma_while_no_candidate_improves():
    model, x, y = problem()
    # step sizes so large that every move is worse than staying; eps_n large: the arg-max is exact
    c = cfg(step_sizes=(1e4,), epsilon_gradient=0.2, epsilon_selection=0.1, gamma=0.5, loss_clip=50.0)
    res = dpagd_update(model, get_flat(model), x, y, c, 1.0, seed=0, round_idx=0, client_id=0)
    # gradient 0.2, then selections of 0.1, 0.15, 0.225 (total 0.675); 0.3375 more would pass 1.0
    assert res.selections == (0, 0, 0) and res.split_updates == 3 and res.steps_taken == 0
    assert res.spent == pytest.approx(0.675)
    assert res.epsilon_selection == pytest.approx(0.3375) and res.epsilon_gradient == pytest.approx(0.025)
    assert res.argmax_epsilons == pytest.approx((math.sqrt(0.2), math.sqrt(0.3), math.sqrt(0.45)))
    assert res.gradient_noise_multipliers == pytest.approx((1 / math.sqrt(0.4),))
    assert not np.any(res.update)  # the gradient was never applied


def test_an_improving_step_applies_the_noisy_gradient_with_the_chosen_size():
    model, x, y = problem()
    c = cfg(step_sizes=(0.05,), epsilon_gradient=50.0, epsilon_selection=500.0)  # tiny noise, exact arg-max
    res = dpagd_update(model, get_flat(model), x, y, c, 550.0, seed=0, round_idx=0, client_id=0)
    assert res.selections == (1,) and res.steps_taken == 1
    params = {k: v.detach() for k, v in model.named_parameters()}
    summed, _ = clip_and_sum(per_example_grads(model, params, torch.from_numpy(x), torch.from_numpy(y)), 1.0)
    expected = -0.05 * torch.cat([s.reshape(-1) for s in summed.values()]).numpy() / len(y)
    z = res.gradient_noise_multipliers[0]  # 0.1: the noise is N(0, (0.1 * S / n)^2) per coordinate
    assert np.max(np.abs(res.update - expected)) < 0.05 * 6 * z / len(y)
    again = dpagd_update(model, get_flat(model), x, y, c, 550.0, seed=0, round_idx=0, client_id=0)
    assert np.array_equal(again.update, res.update)


def test_a_client_that_cannot_afford_one_iteration_is_exhausted():
    c = cfg(epsilon_gradient=0.1, epsilon_selection=0.1)
    assert HuangClientBudget(epsilon=4.0).round_budget(20) == pytest.approx(0.2)  # eq. 11: eps_k / T
    assert not HuangClientBudget(epsilon=4.0).exhausted(c, 20)
    assert HuangClientBudget(epsilon=3.0).exhausted(c, 20)  # 0.15 < 0.2
    assert HuangClientBudget(epsilon=4.0, spent=3.9).exhausted(c, 20)
    model, x, y = problem()
    res = dpagd_update(model, get_flat(model), x, y, c, 0.15, seed=0, round_idx=0, client_id=0)
    assert res.spent == 0 and res.selections == () and not np.any(res.update)


def test_budgets_follow_size_categories():
    sizes = [600, 100, 300, 100, 900, 300, 600, 900, 200, 200]
    eps = budgets_by_size(sizes, [1, 2.75, 4.5, 6.25, 8])
    assert list(eps) == [6.25, 1, 4.5, 1, 8, 4.5, 6.25, 8, 2.75, 2.75]
    with pytest.raises(DPFLError, match="categories"):
        budgets_by_size([1, 2], [1, 2, 3])


def test_calibrations():
    assert gaussian_noise_multiplier(0.5, "zcdp") == pytest.approx(1.0)  # rho = 1/(2 z^2)
    assert gaussian_noise_multiplier(0.5, "eq3", 1e-5) == pytest.approx(math.sqrt(2 * math.log(1.25e5)) / 0.5)
    assert argmax_epsilon(0.02) == pytest.approx(0.2)  # Alg. 1 line 12: sqrt(2 eps_n)
    with pytest.raises(DPFLError, match="delta"):
        cfg(calibration="eq3")
    with pytest.raises(DPFLError, match="gamma"):
        cfg(gamma=1.0)


def test_laplace_argmax_uses_scale_sensitivity_over_epsilon():
    # Two candidates d apart: the worse one wins iff L1 - L0 > d, which for i.i.d. Laplace(b) has
    # probability exp(-d/b)(1 + d/(2b))/2.
    sens, eps, d, n = 2.0, argmax_epsilon(0.08), 3.0, 40_000
    rng = np.random.default_rng(3)
    wins = sum(noisy_argmax(np.array([0.0, -d]), sens, eps, rng) for _ in range(n))
    b = sens / eps
    p = math.exp(-d / b) * (1 + d / (2 * b)) / 2
    assert abs(wins - n * p) / math.sqrt(n * p * (1 - p)) < 6.1  # ~1e-9 two-sided
    assert noisy_argmax(np.array([0.0, 5.0, 1.0]), 1.0, 1e9, rng) == 1


def test_laplace_argmax_accounting():
    # An eps'-DP selection is booked as rho = eps'^2 / 2 zCDP: for Huang's eps' = sqrt(2 eps_n) that is
    # exactly eps_n, and dp_accounting's epsilon of k selections is that of one rho = k * eps_n.
    eps_n, k = 0.03, 25
    ev = argmax_dp_event(argmax_epsilon(eps_n))
    assert isinstance(ev, dp_accounting.ZCDpEvent) and ev.rho == pytest.approx(eps_n) and ev.xi == 0
    led = ClientLedgers(1e-5, num_clients=1)
    led.record(0, ev, k)
    direct = RdpAccountant()
    direct.compose(dp_accounting.ZCDpEvent(k * eps_n))
    assert led.epsilon(0) == pytest.approx(direct.get_epsilon(1e-5), rel=1e-9)
    # the pure-DP view: k selections are at most k * eps' -- the zCDP booking is tighter here
    assert led.epsilon(0) < k * argmax_epsilon(eps_n)
    # a single selection's zCDP curve lies above a Laplace mechanism's at the same eps' (it must bound
    # every eps'-DP mechanism, the Laplace one included)
    lap = RdpAccountant()
    lap.compose(dp_accounting.LaplaceDpEvent(1 / argmax_epsilon(eps_n)))
    one = ClientLedgers(1e-5, num_clients=1)
    one.record(0, ev)
    assert np.all(one.rdp(0) >= lap.rdp - 1e-12)


def test_dpagd_passes_in_chunks_give_the_one_pass_sums(monkeypatch):
    """The gradient sum and the candidates' loss sums over a data set larger than a chunk equal one
    pass over it (to float rounding); a data set of at most one chunk is one pass, to the bit."""
    import dpfl_ray.algorithms.huang2020_core as core

    model, x, y = problem(n=23, seed=3)
    params = {k: v.detach() for k, v in model.named_parameters()}
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    grads_of = per_example_grad_fn(model)
    one_sum, _ = clip_and_sum(grads_of(params, xt, yt), 0.5)
    grad = {k: v / len(y) for k, v in one_sum.items()}
    one_scores = core._candidate_scores(model, params, grad, (0.0, 0.5, 2.0), xt, yt, 1.5)

    assert core.DPAGD_CHUNK >= 600  # the 100- and 1,000-user rows are one chunk a user
    same = core._clipped_gradient_sum(grads_of, params, xt, yt, 0.5)
    assert all(torch.equal(same[k], one_sum[k]) for k in one_sum)
    assert np.array_equal(core._candidate_scores(model, params, grad, (0.0, 0.5, 2.0), xt, yt, 1.5), one_scores)

    monkeypatch.setattr(core, "DPAGD_CHUNK", 5)  # 23 records: chunks of 5, 5, 5, 5, 3
    assert [(s.start, s.stop) for s in core._chunks(23)] == [(0, 5), (5, 10), (10, 15), (15, 20), (20, 23)]
    chunked = core._clipped_gradient_sum(grads_of, params, xt, yt, 0.5)
    for k in one_sum:
        torch.testing.assert_close(chunked[k], one_sum[k], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(core._candidate_scores(model, params, grad, (0.0, 0.5, 2.0), xt, yt, 1.5),
                               one_scores, rtol=1e-5)
