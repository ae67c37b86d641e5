"""NbAFL (Wei et al. 2020) without Ray: the noise calibration, parameter clipping, the proximal
term, the uplink noise's variance, the accounted epsilon (sensitivity 2C, what the code enforces)
and the assumed one (the paper's 2C/m) against dp_accounting, the paper's claim beside them, and a
distinguishing test of the real local procedure against the booked multiplier."""
import math

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting import NeighboringRelation as NR
from dp_accounting.rdp import RdpAccountant
from scipy import stats

from dpfl_ray.algorithms import NbAFL, RoundOutcome
from dpfl_ray import rng as rngmod
from dpfl_ray.algorithms.nbafl import ASSUMPTION, classic_c, downlink_std, uplink_std
from dpfl_ray.training.local import local_update
from dpfl_ray.training.models import build_model, get_flat
from dpfl_ray.privacy import PrivacyLedger
from dpfl_ray.scenario import ModelConfig, scenario_from_dict


def _scenario(epsilon=60.0, rounds=25, per_round=50, secagg=False, threat="server", **nbafl):
    return scenario_from_dict({
        "seed": 1, "data": {"source": "synthetic", "num_clients": 50},
        "training": {"algorithm": "nbafl", "rounds": rounds, "prox_mu": 0.01},
        "sampling": {"mode": "fixed", "clients_per_round": per_round},
        "privacy": {"clipping": {"norm": 20.0}, "delta": 0.01, "accountant": "rdp",
                    "nbafl": {"epsilon": epsilon, "threat_model": threat, **nbafl}},
        "secagg": {"enabled": secagg}})


def test_noise_calibration_by_hand():
    c = math.sqrt(2 * math.log(1.25 / 0.01))
    assert classic_c(0.01) == pytest.approx(c)
    # sigma_U = c L (2C/m) / eps: C=20, m=80, L=25, eps=60
    assert uplink_std(60, 0.01, 20, 80, 25) == pytest.approx(c * 25 * 0.5 / 60)
    # T <= L sqrt(N): no downlink noise (every client uploads every round)
    assert downlink_std(60, 0.01, 20, 80, exposures=25, clients=50, rounds=25) == 0.0
    # K-of-N scheduling: N=10 aggregated per round, L=5 of T=25 rounds; T=25 > 5*sqrt(10)=15.8
    expected = 2 * c * 20 * math.sqrt(25 ** 2 - 25 * 10) / (80 * 10 * 60)
    assert downlink_std(60, 0.01, 20, 80, exposures=5, clients=10, rounds=25) == pytest.approx(expected)
    assert downlink_std(60, 0.01, 20, 80, exposures=8, clients=10, rounds=25) == 0.0  # 25 <= 8 sqrt(10)


def test_algorithm_derives_m_l_and_the_downlink_switch():
    alg = NbAFL(_scenario(), np.ones(50), sizes=np.full(50, 80))
    assert (alg.min_size, alg.exposures, alg.sigma_d) == (80, 25, 0.0)
    scheduled = NbAFL(_scenario(per_round=10), np.ones(50), sizes=np.r_[np.full(49, 80), [60]])
    assert (scheduled.min_size, scheduled.exposures) == (60, 5)  # ceil(25 * 10 / 50)
    assert scheduled.sigma_d == pytest.approx(downlink_std(60, 0.01, 20, 60, 5, 10, 25)) and scheduled.sigma_d > 0


def test_clients_send_clipped_parameters_with_uplink_noise():
    alg = NbAFL(_scenario(), np.ones(50), sizes=np.full(50, 80))
    alg.begin_round(0, list(range(50)))
    spec = alg.client_spec()
    theta, update = np.full(4, 10.0, np.float32), np.full(4, 5.0, np.float32)
    clipped = spec.prepare(update, theta)  # ||(15,15,15,15)|| = 30 > C = 20
    np.testing.assert_allclose(clipped, np.full(4, 10.0), rtol=1e-6)
    assert np.linalg.norm(spec.prepare(np.zeros(4, np.float32), np.ones(4, np.float32))) == pytest.approx(2.0)
    sent = spec.plain_value(spec.prepare(update, theta), 3)
    noise = sent - clipped
    assert np.array_equal(sent, spec.plain_value(spec.prepare(update, theta), 3))  # seeded per (round, client)
    assert not np.allclose(noise, 0)


def test_uplink_noise_has_sigma_u():
    alg = NbAFL(_scenario(epsilon=6.0), np.ones(50), sizes=np.full(50, 80))
    alg.begin_round(2, list(range(50)))
    noise = alg.client_spec().noise.sample(7, 1.0, 1_000_000)
    chi2 = float(np.sum(noise ** 2)) / alg.sigma_u ** 2
    n = noise.size
    assert stats.chi2.sf(chi2, n) > 1e-9 and stats.chi2.cdf(chi2, n) > 1e-9
    assert abs(noise.mean()) * math.sqrt(n) / alg.sigma_u < 6.1


def test_server_averages_the_uploads_and_adds_downlink_noise():
    alg = NbAFL(_scenario(per_round=10), np.r_[np.ones(25), np.full(25, 0.5)], sizes=np.full(50, 80))
    uploads = {0: np.full(3, 2.0, np.float32), 30: np.full(3, 8.0, np.float32)}  # weights 1 and 0.5
    theta = np.zeros(3, np.float32)
    agg = alg.finish(RoundOutcome(0, (0, 30), updates=uploads, theta=theta), 3)
    noise = agg.delta - (2.0 * 1 + 8.0 * 0.5) / 1.5
    assert 0 < np.abs(noise).max() < 8 * alg.sigma_d  # the downlink noise, of std sigma_D


def test_the_proximal_term_pulls_towards_theta():
    """One SGD step at w = theta + d: the proximal gradient adds mu * (w - theta)."""
    model = build_model(ModelConfig(name="logistic"), (1, 2, 2), 3, seed=0)
    theta = get_flat(model)
    x = np.random.default_rng(0).normal(size=(8, 1, 2, 2)).astype(np.float32)
    y = np.array([0, 1, 2, 0, 1, 2, 0, 1])

    def two_steps(mu):
        return local_update(model, theta, x, y, epochs=2, batch_size=8, lr=0.5, clip_norm=None,
                            rng=np.random.default_rng(1), torch_seed=0, prox_mu=mu)

    plain, prox, mu = two_steps(0.0), two_steps(2.0), 2.0
    # reference: the same two full-batch steps by hand, with the proximal gradient
    w = torch.tensor(theta, requires_grad=False)
    ref = torch.nn.functional.cross_entropy
    for _ in range(2):
        w = w.detach().requires_grad_(True)
        weight, bias = w[:12].view(3, 4), w[12:]
        loss = ref(torch.from_numpy(x).view(8, 4) @ weight.T + bias, torch.from_numpy(y)) \
            + mu / 2 * ((w - torch.from_numpy(theta)) ** 2).sum()
        loss.backward()
        w = w - 0.5 * w.grad
    np.testing.assert_allclose(prox, (w.detach().numpy() - theta), rtol=1e-5, atol=1e-6)
    assert np.linalg.norm(prox) < np.linalg.norm(plain)


@pytest.mark.parametrize("secagg,threat", [(False, "server"), (True, "server"), (False, "broadcast")])
def test_accounted_epsilon_is_dp_accounting_of_the_same_noise(secagg, threat):
    """epsilon books the sensitivity the code enforces, 2C (parameters clipped to C, any record set);
    epsilon_assumed the paper's 2C/m, with the same noise."""
    sc = _scenario(per_round=10, secagg=secagg, threat=threat)
    alg = NbAFL(sc, np.ones(50), sizes=np.full(50, 80))
    mech = alg.planned_mechanism()
    ledgers = {}
    for name, delta_s in (("enforced", 2 * 20.0), ("assumed", 2 * 20.0 / 80)):
        if threat == "broadcast":  # uploads averaged over 10 equal shares, plus the downlink noise
            z = math.sqrt(alg.sigma_u ** 2 / 10 + alg.sigma_d ** 2) / (delta_s / 10)
        else:
            z = alg.sigma_u / delta_s * (math.sqrt(10) if secagg else 1.0)
        booked = mech.noise_multipliers if name == "enforced" else mech.assumed_noise_multipliers
        assert booked == pytest.approx((z,))
        ledger = ledgers[name] = PrivacyLedger("rdp", 0.01)
        for _ in range(25):
            ledger.record_round(booked, mech.sampling, reason=mech.description,
                                paper_epsilon=mech.paper_epsilon, claim_note=mech.claim_note)
        direct = RdpAccountant(neighboring_relation=NR.REPLACE_ONE).compose(dp_accounting.GaussianDpEvent(z), 25)
        assert ledger.epsilon() == pytest.approx(direct.get_epsilon(0.01), rel=1e-12)
        assert ledger.claimed_epsilon() == pytest.approx(60.0)  # the paper: (epsilon, delta) after the T rounds
    assert mech.covered and mech.assumption == ASSUMPTION and "2C/m" in ASSUMPTION
    assert mech.noise_multipliers[0] == pytest.approx(mech.assumed_noise_multipliers[0] / 80)  # m = 80
    assert ledgers["enforced"].epsilon() > ledgers["assumed"].epsilon()
    # epsilon / L = 12 per upload: the classic bound's epsilon < 1 does not hold, and the ledger says so
    assert "outside its validity range" in ledgers["enforced"].rounds[0].claim_note
    assert alg.canary_norm() == 20.0  # the audit probes the bound that is booked, not C/m


def test_run_privacy_keeps_the_assumed_figure_beside_the_enforced_one():
    """What ledger.json, the rows and summary.json get: epsilon under 2C, epsilon_assumed under 2C/m,
    both composed by dp_accounting from the rounds that ran (a round that released nothing adds
    nothing to either), and kept across a checkpoint."""
    from dpfl_ray.runtime.privacy import RunPrivacy

    sc = _scenario(rounds=3)
    alg, run = NbAFL(sc, np.ones(50), sizes=np.full(50, 80)), RunPrivacy(sc, np.ones(50), np.full(50, 80))
    run.bind(alg)
    theta = np.zeros(3, np.float32)
    rows = [run.account(0, RoundOutcome(0, tuple(range(50)), theta=theta), "")]
    rows.append(run.account(1, RoundOutcome(1, aborted="everyone dropped"), "everyone dropped"))
    mech = alg.planned_mechanism()

    def direct(z, rounds):
        return RdpAccountant(neighboring_relation=NR.REPLACE_ONE).compose(
            dp_accounting.GaussianDpEvent(z), rounds).get_epsilon(0.01)

    for row in rows:
        assert row["epsilon"] == pytest.approx(direct(mech.noise_multipliers[0], 1), rel=1e-12)
        assert row["epsilon_assumed"] == pytest.approx(direct(mech.assumed_noise_multipliers[0], 1), rel=1e-12)
        assert row["dp_covered"] and row["epsilon_claimed"] == pytest.approx(20.0)  # 60 / T per round
    resumed = RunPrivacy(sc, np.ones(50), np.full(50, 80))
    resumed.bind(alg)
    resumed.load_state_dict(run.state_dict(2))
    for r in (run, resumed):
        r.account(2, RoundOutcome(2, tuple(range(50)), theta=theta), "")
        out = r.to_dict()
        assert out["epsilon"] == pytest.approx(direct(mech.noise_multipliers[0], 2), rel=1e-12)
        assert out["epsilon_assumed"] == pytest.approx(direct(mech.assumed_noise_multipliers[0], 2), rel=1e-12)
        assert out["assumption"] == ASSUMPTION and out["fully_covered"]
        assert out["noise_multiplier_assumed"] == [mech.assumed_noise_multipliers[0]]


def test_scenario_checks():
    from dpfl_ray.errors import DPFLError

    with pytest.raises(DPFLError, match="privacy.nbafl"):
        scenario_from_dict({"training": {"algorithm": "nbafl"}})
    with pytest.raises(DPFLError, match="privacy.noise_multiplier"):
        scenario_from_dict({"training": {"algorithm": "nbafl"},
                            "privacy": {"noise_multiplier": 1.0, "nbafl": {"epsilon": 6}}})
    # the bounded pld accountant composes Poisson-sampled Gaussians only: refused before a run starts
    with pytest.raises(DPFLError, match="privacy.accountant: nbafl's rounds are unsampled"):
        scenario_from_dict({"training": {"algorithm": "nbafl"},
                            "privacy": {"accountant": "pld", "nbafl": {"epsilon": 6}}})


@pytest.mark.parametrize("eps,server,aggregated,server_assumed,aggregated_assumed", [
    (6, 567.6045, 21.1578, 0.8110, 0.0524), (60, 52533.0760, 1092.5082, 17.6087, 1.2638),
    (100, 145849.2987, 2958.8327, 38.3675, 2.4366)])
def test_the_numbers_of_docs_nbafl(eps, server, aggregated, server_assumed, aggregated_assumed):
    """docs/nbafl.md's table: delta 0.01, C 20, m 80, N 50, T = L = 25, rdp; sensitivity 2C (enforced)
    and 2C/m (the paper's assumption)."""
    from dpfl_ray.algorithms.nbafl import assumed_bound, enforced_bound, round_multipliers

    def accounted(z, rounds=25):
        return RdpAccountant(neighboring_relation=NR.REPLACE_ONE).compose(
            dp_accounting.GaussianDpEvent(z), rounds).get_epsilon(0.01)

    shares = np.full(50, 1 / 50)
    sigma_u = uplink_std(eps, 0.01, 20, 80, 25)
    for bound, figures in ((enforced_bound(20), (server, aggregated)),
                           (assumed_bound(20, 80), (server_assumed, aggregated_assumed))):
        for secure, expected in zip((False, True), figures):
            z, _ = round_multipliers(sigma_u, 0.0, bound, shares, secure, "server")
            assert accounted(z) == pytest.approx(expected, abs=1e-4)
    # K = 10 of 50, L = 5 uploads at epsilon 60: even under the assumption one client's uploads
    # account to more than the claim; the 8 uploads client 15 made in a run of wei2020_n50_eps60_k10
    sigma_u = uplink_std(60, 0.01, 20, 80, 5)
    z, _ = round_multipliers(sigma_u, 0.0, assumed_bound(20, 80), np.full(10, 0.1), False, "server")
    assert accounted(z, 5) == pytest.approx(61.4738, abs=1e-4) and accounted(z, 8) == pytest.approx(90.5523, abs=1e-4)
    z, _ = round_multipliers(sigma_u, 0.0, enforced_bound(20), np.full(10, 0.1), False, "server")
    assert accounted(z, 8) == pytest.approx(419965.7029, rel=1e-6)


@pytest.fixture
def one_thread():
    # as a worker trains (resources.torch_threads); two threads on a loaded 2-core machine are 10x slower
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_replacing_one_record_separates_releases_within_the_booked_multiplier(one_thread):
    """Issue 32, distinguishing test. One client, two data sets that differ in one record (an
    outlier replaced by an ordinary digit-like record), m = 10. The real local procedure (the
    worker's local_update with the scenario's epochs, batches, lr and proximal term, seeded as the
    worker seeds it), the parameter clipping and the uplink noise run 150 times on each. The
    releases, projected on the direction between their noise-free means (the best linear test of
    two Gaussians), separate by mu; a Gaussian mechanism booked at multiplier z allows mu <= 1/z.
    The booked (enforced, 2C) multiplier allows it; the paper's 2C/m is exceeded by many standard
    errors, so a ledger that booked 2C/m would report less than the truth."""
    m, n = 10, 150
    sc = scenario_from_dict({
        "seed": 5, "data": {"source": "synthetic", "num_clients": 2},
        "training": {"algorithm": "nbafl", "rounds": 1, "local_epochs": 1, "batch_size": 5, "lr": 0.5,
                     "prox_mu": 0.01},
        "sampling": {"mode": "fixed", "clients_per_round": 2},
        "privacy": {"clipping": {"norm": 1.0}, "delta": 0.01, "accountant": "rdp", "nbafl": {"epsilon": 1.25}}})
    alg = NbAFL(sc, np.ones(2), sizes=np.full(2, m))
    model = build_model(ModelConfig(name="logistic"), (1, 2, 2), 3, seed=0)
    theta = np.zeros(15, np.float32)  # a broadcast model inside the C-ball
    data = np.random.default_rng(0)
    x, y = data.normal(size=(m, 1, 2, 2)).astype(np.float32), data.integers(0, 3, size=m)
    neighbour = x.copy()
    neighbour[0] = 30.0  # the one record replaced
    tr = sc.training
    clean, released = {0: [], 1: []}, {0: [], 1: []}
    for s in range(n):  # each seed a fresh round: fresh batches and, per client id, fresh noise
        alg.begin_round(s, [0, 1])
        spec = alg.client_spec()
        for cid, records in ((0, x), (1, neighbour)):
            update = local_update(model, theta, records, y, epochs=tr.local_epochs, batch_size=tr.batch_size,
                                  lr=tr.lr, clip_norm=tr.clip_norm, rng=rngmod.generator(s, "batches", 0, 0),
                                  torch_seed=rngmod.int_seed(s, "torch", 0, 0), prox_mu=spec.prox_mu)
            clean[cid].append(spec.prepare(update, theta))
            released[cid].append(spec.plain_value(spec.prepare(update, theta), cid))
    assert max(np.linalg.norm(v) for v in clean[1]) <= 1.0 + 1e-6  # clipped to C
    direction = np.mean(clean[1], axis=0) - np.mean(clean[0], axis=0)
    a, b = (np.asarray(released[c], dtype=np.float64) @ (direction / np.linalg.norm(direction)) for c in (0, 1))
    mu = (b.mean() - a.mean()) / math.sqrt((a.var(ddof=1) + b.var(ddof=1)) / 2)
    stderr = math.sqrt(2 / n + mu ** 2 / (4 * n))
    mech = alg.planned_mechanism()
    assert mu - 3 * stderr <= 1 / mech.noise_multipliers[0], (mu, stderr, mech.noise_multipliers)
    assert mu - 3 * stderr > 1 / mech.assumed_noise_multipliers[0], (mu, stderr, mech.assumed_noise_multipliers)
