"""Distinguishing tests: two neighbouring data sets under the run's declared relation, the real
release run a few hundred times each, and the empirical separation of what is released checked
against what the booked multiplier allows.

The separation of two release distributions along a statistic is measured as
mu_hat = |mean_a - mean_b| / pooled std: a Gaussian mechanism of multiplier z separates
neighbours by at most mu = 1/z (Dong, Roth & Su 2019, mu-GDP), whatever is done with its output.
A booking that under-states the sensitivity shows up as mu_hat well above 1/z_booked.
"""
from __future__ import annotations

import numpy as np
import pytest

from dpfl_ray.algorithms.base import RoundOutcome
from dpfl_ray.algorithms.dp_fedavg import DPFedAvg
from dpfl_ray.scenario import scenario_from_dict

SEEDS = 300
# mu_hat from 300 + 300 draws has a standard error of about sqrt(2 / 300) = 0.08
SLACK = 0.3


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def separation(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return abs(a.mean() - b.mean()) / np.sqrt((a.var(ddof=1) + b.var(ddof=1)) / 2)


def _dp_fedavg(denominator: str, num_clients: int = 20, **privacy):
    return scenario_from_dict({
        "seed": 5, "data": {"source": "synthetic", "num_clients": num_clients},
        "training": {"algorithm": "dp_fedavg"}, "sampling": {"mode": "poisson", "rate": 0.1, "clients_per_round": None},
        "privacy": {"noise_multiplier": 1.0, "clipping": {"mode": "fixed", "norm": 1.0}, "accountant": "rdp",
                    "denominator": denominator, **privacy}})


@pytest.mark.parametrize("denominator", ["expected", "bounded"])
def test_dp_fedavg_denominators_do_not_reveal_the_population(denominator):
    """Add/remove one client, which this round does not sample: the sums are equal, so the release
    may differ only through what the run derives from the population. With W the population's
    own weight, every round's scale reveals K = 20 vs 21 (mu_hat ~ 3 at d = 2,000 in one round)."""
    sc = _dp_fedavg(denominator)
    dim, survivors = 2000, (0, 1)
    g = np.random.default_rng(0)
    updates = {c: (u / np.linalg.norm(u)).astype(np.float32) for c, u in ((c, g.normal(size=dim)) for c in survivors)}
    norms = {}
    for k in (20, 21):
        alg = DPFedAvg(sc, np.ones(k), 1.0)
        z_booked = alg.planned_mechanism().noise_multipliers[0]
        norms[k] = [np.linalg.norm(alg.finish(RoundOutcome(t, survivors, updates=updates), dim).delta)
                    for t in range(SEEDS)]
    assert separation(norms[20], norms[21]) <= 1.0 / z_booked + SLACK


def test_dp_fedavg_actual_denominator_under_zero_out_keeps_the_population():
    """Zero-out: the neighbour keeps the population and replaces one survivor's update by nothing.
    The release moves along that update by at most S / W' against noise z S / W'."""
    sc = _dp_fedavg("actual")
    dim = 200
    g = np.random.default_rng(1)
    u = (lambda v: (v / np.linalg.norm(v)).astype(np.float32))(g.normal(size=dim))
    alg = DPFedAvg(sc, np.ones(20), 1.0)
    z_booked = alg.planned_mechanism().noise_multipliers[0]
    with_u = {0: u, 1: u}
    zeroed = {0: u, 1: np.zeros(dim, np.float32)}
    proj = {name: [float(alg.finish(RoundOutcome(t, (0, 1), updates=ups), dim).delta @ u) for t in range(SEEDS)]
            for name, ups in (("with", with_u), ("zeroed", zeroed))}
    mu = separation(proj["with"], proj["zeroed"])
    assert 0.5 < mu <= 1.0 / z_booked + SLACK  # the bound is tight: the test can see a release


def test_huang_dpagd_release_stays_within_its_replace_one_booking():
    """Huang et al.'s DPAGD, one gradient and one selection, on two data sets of 40 records that
    differ in one record's label (replace-one: the size n, the gradient's divisor, is the same).
    The two records' clipped gradients are sqrt(3) S apart (three classes), so the noised sum moves
    by more than S: the released update separates the data sets by more than the add/remove
    booking (z) allows, and within the replace-one booking (z/2, 2 eps').

    The selection's eps' is tiny, so it steps about half the time, nearly independently of the
    data; the statistic is the update's projection when it stepped (then it is minus the noised
    gradient itself)."""
    from types import SimpleNamespace

    from dpfl_ray.algorithms.huang2020_core import DPAGDConfig, dpagd_update

    HUANG_SEEDS = 200  # noqa: N806 - about 100 steps each; mu_hat's standard error ~0.3 at mu ~5
    from dpfl_ray.training.models import build_model, get_flat

    model = build_model(SimpleNamespace(name="logistic", hidden=[]), (4,), 3, 0)
    theta = get_flat(model)
    g = np.random.default_rng(3)
    x = g.normal(size=(40, 4)).astype(np.float32)
    y = g.integers(0, 3, 40).astype(np.int64)
    y_a, y_b = y.copy(), y.copy()
    y_a[0], y_b[0] = 0, 1
    # z = 1/sqrt(2 * 4.5) = 1/3: one gradient and one selection fit the round budget
    cfg = DPAGDConfig(clip_norm=0.01, step_sizes=(1.0,), loss_clip=3.0, epsilon_gradient=4.5,
                      epsilon_selection=1e-4, gamma=0.1)

    def stepped(labels):
        out = [dpagd_update(model, theta, x, labels, cfg, 4.5 + 1e-4, seed=1, round_idx=r, client_id=0)
               for r in range(HUANG_SEEDS)]
        return np.stack([o.update for o in out if o.steps_taken]), out[0]

    a, res = stepped(y_a)
    b, _ = stepped(y_b)
    assert min(len(a), len(b)) > HUANG_SEEDS // 4
    u = a.mean(0) - b.mean(0)
    mu = separation(a @ u, b @ u)
    rho = sum(n * (1 / (2 * ev.noise_multiplier ** 2) if hasattr(ev, "noise_multiplier") else ev.rho)
              for ev, n in res.dp_events())
    mu_booked = np.sqrt(2 * rho)  # rho-zCDP of Gaussians: mu-GDP with mu = sqrt(2 rho)
    mu_add_remove = np.sqrt(2 * (1 / (2 * (1 / 3) ** 2) + 2e-4 / 2 * 2))  # z and eps' booked as they are
    assert mu_add_remove + 2 * SLACK < mu <= mu_booked, (mu, mu_add_remove, mu_booked)
