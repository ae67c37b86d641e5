"""NbAFL (Wei et al. 2020) without Ray: the noise calibration, parameter clipping, the proximal
term, the uplink noise's variance, and claimed vs accounted epsilon against dp_accounting."""
import math

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting import NeighboringRelation as NR
from dp_accounting.rdp import RdpAccountant
from scipy import stats

from dpfl_ray.algorithms import NbAFL, RoundOutcome
from dpfl_ray.algorithms.nbafl import classic_c, downlink_std, uplink_std
from dpfl_ray.local import local_update
from dpfl_ray.models import build_model, get_flat
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
    sent = spec.plain_value(update, theta, 3)
    noise = sent - clipped
    assert np.array_equal(sent, spec.plain_value(update, theta, 3))  # seeded per (round, client)
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
    sc = _scenario(per_round=10, secagg=secagg, threat=threat)
    alg = NbAFL(sc, np.ones(50), sizes=np.full(50, 80))
    mech = alg.planned_mechanism()
    delta_s = 2 * 20.0 / 80
    if threat == "broadcast":  # uploads averaged over 10 equal shares, plus the downlink noise
        z = math.sqrt(alg.sigma_u ** 2 / 10 + alg.sigma_d ** 2) / (delta_s / 10)
    else:
        z = alg.sigma_u / delta_s * (math.sqrt(10) if secagg else 1.0)
    assert mech.noise_multipliers == pytest.approx((z,))
    ledger = PrivacyLedger("rdp", 0.01)
    for _ in range(25):
        ledger.record_round(mech.noise_multipliers, mech.sampling, reason=mech.description,
                            paper_epsilon=mech.paper_epsilon, claim_note=mech.claim_note)
    direct = RdpAccountant(neighboring_relation=NR.REPLACE_ONE).compose(dp_accounting.GaussianDpEvent(z), 25)
    assert ledger.epsilon() == pytest.approx(direct.get_epsilon(0.01), rel=1e-12)
    assert ledger.claimed_epsilon() == pytest.approx(60.0)  # the paper: (epsilon, delta) after the T rounds
    # epsilon / L = 12 per upload: the classic bound's epsilon < 1 does not hold, and the ledger says so
    assert "outside its validity range" in ledger.rounds[0].claim_note


def test_scenario_checks():
    from dpfl_ray.errors import DPFLError

    with pytest.raises(DPFLError, match="privacy.nbafl"):
        scenario_from_dict({"training": {"algorithm": "nbafl"}})
    with pytest.raises(DPFLError, match="privacy.noise_multiplier"):
        scenario_from_dict({"training": {"algorithm": "nbafl"},
                            "privacy": {"noise_multiplier": 1.0, "nbafl": {"epsilon": 6}}})


@pytest.mark.parametrize("eps,server,aggregated", [(6, 0.8110, 0.0524), (60, 17.6087, 1.2638), (100, 38.3675, 2.4366)])
def test_the_numbers_of_docs_nbafl(eps, server, aggregated):
    """docs/nbafl.md's table: delta 0.01, C 20, m 80, N 50, T = L = 25, rdp."""
    from dpfl_ray.algorithms.nbafl import round_multipliers

    shares = np.full(50, 1 / 50)
    sigma_u = uplink_std(eps, 0.01, 20, 80, 25)
    for secure, expected in ((False, server), (True, aggregated)):
        z, _ = round_multipliers(sigma_u, 0.0, 20, 80, shares, secure, "server")
        eps_acc = RdpAccountant(neighboring_relation=NR.REPLACE_ONE).compose(
            dp_accounting.GaussianDpEvent(z), 25).get_epsilon(0.01)
        assert eps_acc == pytest.approx(expected, abs=1e-4)
    # K = 10 of 50, L = 5 uploads at epsilon 60: one client's uploads account to more than the claim
    sigma_u = uplink_std(60, 0.01, 20, 80, 5)
    z, _ = round_multipliers(sigma_u, 0.0, 20, 80, np.full(10, 0.1), False, "server")
    per_client = RdpAccountant(neighboring_relation=NR.REPLACE_ONE).compose(
        dp_accounting.GaussianDpEvent(z), 5).get_epsilon(0.01)
    assert per_client == pytest.approx(61.4738, abs=1e-4) and per_client > 60
