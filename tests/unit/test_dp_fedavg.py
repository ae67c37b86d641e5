"""DP-FedAvg arithmetic and noise (no Ray): clipping, noise scale, denominators, adaptive clipping."""
import numpy as np
import pytest
from scipy import stats

from dpfl_ray.algorithms import ClientSpec, DPFedAvg, RoundOutcome
from dpfl_ray.algorithms.dp_fedavg import split_noise_multiplier
from dpfl_ray.errors import DPFLError
from dpfl_ray.scenario import scenario_from_dict


def scenario(**privacy):
    clipping = privacy.pop("clipping", {"mode": "fixed", "norm": 1.0})
    return scenario_from_dict({
        "seed": 7, "data": {"num_clients": 100},
        "training": {"algorithm": "dp_fedavg"},
        "sampling": {"mode": "poisson", "rate": 0.1, "clients_per_round": None},
        "privacy": {"noise_multiplier": 1.0, "clipping": clipping, **privacy}})


def _uploads(algo, updates):
    """What the workers send: each update prepared as the round's ClientSpec says."""
    spec = algo.client_spec()
    return {c: spec.plain_value(spec.prepare(u, np.zeros_like(u)), c) for c, u in updates.items()}


def test_clipping_and_expected_denominator_without_noise_effect():
    algo = DPFedAvg(scenario(), np.ones(100), noise_multiplier=1.0)
    ups = {0: np.full(4, 10.0, np.float32), 1: np.array([0.1, 0, 0, 0], np.float32)}
    agg = algo.finish(RoundOutcome(0, tuple(ups), updates=_uploads(algo, ups)), 4)
    noise = agg.delta * 10.0 - (ups[0] / 20.0 + ups[1])  # expected weight q*W = 10
    assert np.linalg.norm(ups[0] / 20.0) == pytest.approx(1.0)
    assert agg.info["noise_std"] == 1.0 and agg.info["clip_norm"] == 1.0
    assert np.all(np.abs(noise) < 6)  # noise is N(0, 1) per coordinate before the division


def test_noise_on_the_sum_has_the_configured_std_and_zero_mean():
    # chi-square on the sample variance over 10^6 coordinates; level 1e-9 so it cannot flake.
    z, s, dim = 1.3, 0.5, 1_000_000
    sc = scenario(noise_multiplier=z, clipping={"mode": "fixed", "norm": s}, denominator="actual")
    algo = DPFedAvg(sc, np.ones(100), noise_multiplier=z)
    agg = algo._noised_step(np.zeros(dim), 1.0, dim, round_idx=3)  # actual weight 1: delta is the noise
    x = agg.delta.astype(np.float64)
    n, sigma = len(x), z * s
    chi2 = (n - 1) * x.var(ddof=1) / sigma ** 2
    assert stats.chi2.sf(chi2, n - 1) > 1e-9 and stats.chi2.cdf(chi2, n - 1) > 1e-9
    assert abs(x.mean()) / (sigma / np.sqrt(n)) < 6.1  # two-sided z-test at ~1e-9
    again = DPFedAvg(sc, np.ones(100), noise_multiplier=z)._noised_step(np.zeros(dim), 1.0, dim, round_idx=3)
    assert np.array_equal(again.delta, agg.delta)  # seeded per round


def test_median_clipping_is_not_covered():
    algo = DPFedAvg(scenario(clipping={"mode": "median"}), np.ones(100), 1.0)
    ups = {i: np.full(2, float(i + 1), np.float32) for i in range(5)}
    agg = algo.finish(RoundOutcome(0, tuple(ups), updates=_uploads(algo, ups)), 2)
    assert agg.info["clip_norm"] == pytest.approx(np.linalg.norm([3.0, 3.0]))
    assert algo.planned_mechanism().covered is False and algo.client_spec() == ClientSpec(per_client=True)


def test_adaptive_clipping_splits_the_budget_and_tracks_the_quantile():
    sc = scenario(clipping={"mode": "adaptive", "norm": 0.1, "target_quantile": 0.5, "learning_rate": 0.5,
                            "count_noise_multiplier": 5.0})
    algo = DPFedAvg(sc, np.ones(100), noise_multiplier=1.0)
    assert algo.planned_mechanism().noise_multipliers[1] == 10.0
    assert 1 / algo.planned_mechanism().noise_multipliers[0] ** 2 + 1 / algo.planned_mechanism().noise_multipliers[1] ** 2 == pytest.approx(1.0)
    rng = np.random.default_rng(0)
    for t in range(60):  # norms ~ 2: S must climb from 0.1 towards the median
        ups = {i: rng.normal(size=4).astype(np.float32) for i in range(10)}
        algo.finish(RoundOutcome(t, tuple(ups), updates=_uploads(algo, ups)), 4)
    assert 1.0 < algo.clip_norm < 3.0
    with pytest.raises(DPFLError, match="count_noise_multiplier"):
        split_noise_multiplier(1.0, 0.4)


def test_client_vector_appends_the_indicator():
    v = ClientSpec(clip_norm=1.0, indicator=True).vector(np.array([3.0, 4.0], np.float32))
    np.testing.assert_allclose(v, [0.6, 0.8, -0.5], rtol=1e-6)
    v = ClientSpec(clip_norm=1.0, indicator=True).vector(np.array([0.3, 0.4], np.float32))
    np.testing.assert_allclose(v, [0.3, 0.4, 0.5], rtol=1e-6)


def test_scenario_rejects_impossible_privacy_setups():
    with pytest.raises(DPFLError, match="privacy.accountant"):
        scenario_from_dict({"training": {"algorithm": "dp_fedavg"}, "privacy": {"noise_multiplier": 1.0}})
    with pytest.raises(DPFLError, match="privacy.noise_multiplier"):
        scenario_from_dict({"training": {"algorithm": "dp_fedavg"}, "privacy": {"accountant": "rdp"}})
    with pytest.raises(DPFLError, match="privacy.delta"):
        scenario_from_dict({"privacy": {"delta": 2}})
