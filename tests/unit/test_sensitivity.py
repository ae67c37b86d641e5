"""Issue #9: the one rule from noise and sensitivity to the booked multiplier, checked against direct
dp_accounting calls; the bounded and actual denominators; the public weight cap; randomness modes."""
import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting import NeighboringRelation as NR
from dp_accounting.rdp import RdpAccountant
from scipy import stats

from dpfl_ray.algorithms import DPFedAvg, RoundOutcome
from dpfl_ray.algorithms.baek import Baek
from dpfl_ray.errors import DPFLError
from dpfl_ray.privacy import PrivacyLedger
from dpfl_ray.privacy.randomness import ChaChaNormal, DPRandomness
from dpfl_ray.privacy.sensitivity import booked_noise_multiplier, l2_sensitivity
from dpfl_ray.rng import generator
from dpfl_ray.scenario import scenario_from_dict


def _dp_fedavg(sampling, clipping=None, num_clients=100, **privacy):
    accountant = "rdp"
    return scenario_from_dict({
        "seed": 5, "data": {"source": "synthetic", "num_clients": num_clients},
        "training": {"algorithm": "dp_fedavg"}, "sampling": sampling,
        "privacy": {"noise_multiplier": 1.0, "clipping": clipping or {"mode": "fixed", "norm": 1.0},
                    "accountant": accountant, **privacy}})


FIXED = {"mode": "fixed", "clients_per_round": 10}
POISSON = {"mode": "poisson", "rate": 0.1, "clients_per_round": None}


def _ledger_epsilon(mech, rounds=100, delta=1e-5, accountant="rdp"):
    led = PrivacyLedger(accountant, delta)
    for _ in range(rounds):
        led.record_round(mech.noise_multipliers, mech.sampling, reason=mech.description)
    return led.epsilon()


def _direct(event, relation, rounds=100, delta=1e-5):
    return RdpAccountant(neighboring_relation=relation).compose(event, rounds).get_epsilon(delta)


def test_the_rule():
    assert l2_sensitivity(0.5, NR.ADD_OR_REMOVE_ONE) == 0.5
    assert l2_sensitivity(0.5, NR.REPLACE_ONE) == 1.0
    assert booked_noise_multiplier(0.5, l2_sensitivity(0.5, NR.REPLACE_ONE)) == 0.5


def test_poisson_dp_fedavg_books_z_under_add_remove():
    mech = DPFedAvg(_dp_fedavg(POISSON), np.ones(100), 1.0).planned_mechanism()
    assert mech.noise_multipliers == (1.0,)
    direct = _direct(dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(1.0)), NR.ADD_OR_REMOVE_ONE)
    assert _ledger_epsilon(mech) == pytest.approx(direct, rel=1e-12)


@pytest.mark.parametrize("m,expected", [(10, 83.94), (50, 344.4)])
def test_fixed_size_dp_fedavg_books_half_of_z(m, expected):
    """Replace-one: two S-clipped updates differ by up to 2S, so noise z*S books z/2 (issue #9:
    m of K=100, z=1, 100 rounds, rdp: 14.05 was booked where 83.94 is right; 95.96 vs 344.4)."""
    mech = DPFedAvg(_dp_fedavg({"mode": "fixed", "clients_per_round": m}), np.ones(100), 1.0).planned_mechanism()
    assert mech.noise_multipliers == (0.5,)
    direct = _direct(dp_accounting.SampledWithoutReplacementDpEvent(100, m, dp_accounting.GaussianDpEvent(0.5)),
                     NR.REPLACE_ONE)
    eps = _ledger_epsilon(mech)
    assert eps == pytest.approx(direct, rel=1e-12)
    assert eps == pytest.approx(expected, abs=0.01)


@pytest.mark.parametrize("sampling,relation,factor", [(POISSON, NR.ADD_OR_REMOVE_ONE, 1.0), (FIXED, NR.REPLACE_ONE, 2.0)])
def test_adaptive_clipping_count_is_booked_by_the_same_rule(sampling, relation, factor):
    """The count's indicator moves it by 1/2 (add/remove) or 1 (replace one)."""
    clipping = {"mode": "adaptive", "norm": 0.5, "count_noise_multiplier": 5.0}
    alg = DPFedAvg(_dp_fedavg(sampling, clipping), np.ones(100), 1.0)
    mech = alg.planned_mechanism()
    assert mech.noise_multipliers == pytest.approx((alg.update_z / factor, 10.0 / factor))
    inner = dp_accounting.ComposedDpEvent([dp_accounting.GaussianDpEvent(alg.update_z / factor),
                                           dp_accounting.GaussianDpEvent(10.0 / factor)])
    event = (dp_accounting.PoissonSampledDpEvent(0.1, inner) if relation is NR.ADD_OR_REMOVE_ONE
             else dp_accounting.SampledWithoutReplacementDpEvent(100, 10, inner))
    assert _ledger_epsilon(mech) == pytest.approx(_direct(event, relation), rel=1e-12)
    # Andrew et al.'s split: update and count together are exactly one Gaussian of z / factor
    assert sum(z ** -2 for z in mech.noise_multipliers) == pytest.approx((1.0 / factor) ** -2)


def test_baek_books_z_under_either_sampling():
    for sampling in (POISSON, FIXED):
        sc = scenario_from_dict({
            "data": {"source": "synthetic", "num_clients": 100}, "training": {"algorithm": "baek"},
            "sampling": sampling, "secagg": {"enabled": True},
            "privacy": {"noise_multiplier": 1.3, "clipping": {"norm": 0.5}, "accountant": "rdp"}})
        mech = Baek(sc, np.ones(100), 1.3).planned_mechanism()
        assert mech.noise_multipliers == pytest.approx((1.3,))  # noise 2Cz over Prop. 2's 2C
        assert mech.public == ("n", "n_prime")


def _noise_of_step(alg, weight_sum, dim, round_idx=0):
    agg = alg._noised_step(np.zeros(dim), weight_sum, dim, round_idx)
    return agg.delta.astype(np.float64)


def _check_std(x, sigma):
    n = len(x)
    chi2 = float(np.sum(x ** 2)) / sigma ** 2
    assert stats.chi2.sf(chi2, n) > 1e-9 and stats.chi2.cdf(chi2, n) > 1e-9, (np.std(x), sigma)


def test_bounded_denominator_noise_matches_its_sensitivity_and_is_covered():
    """McMahan et al. 2018's f_c: divide by max(F qW, W'), noise z * 2S / (F qW) on the average."""
    z, s, f, dim = 1.2, 0.5, 0.5, 400_000
    sc = _dp_fedavg(POISSON, {"mode": "fixed", "norm": s}, denominator="bounded", min_weight_fraction=f)
    alg = DPFedAvg(sc, np.ones(100), z)
    floor = f * 0.1 * 100
    for weight_sum in (1.0, 30.0):  # below and above the floor: the noise on the average is the same
        _check_std(_noise_of_step(alg, weight_sum, dim), z * 2 * s / floor)
    mech = alg.planned_mechanism()
    assert mech.covered and mech.noise_multipliers == pytest.approx((z,))
    # the clean part is divided by max(floor, W'): one survivor of weight 1 is divided by the floor 5
    quiet = DPFedAvg(sc, np.ones(100), 1e-9)
    agg = quiet.finish(RoundOutcome(0, (0,), updates={0: np.full(4, 0.1, np.float32)}), 4)
    np.testing.assert_allclose(agg.delta, 0.1 / floor, rtol=1e-6)
    many = {c: np.full(4, 0.1, np.float32) for c in range(10)}
    agg = quiet.finish(RoundOutcome(0, tuple(many), updates=many), 4)
    np.testing.assert_allclose(agg.delta, 0.1, rtol=1e-6)  # W' = 10 > 5: the plain average


def test_actual_denominator_is_covered_only_under_zero_out():
    """W' depends on the population: it is public (and the round covered) only when neighbours keep
    the population, i.e. zero-out adjacency, which is therefore actual's default and only relation."""
    alg = DPFedAvg(_dp_fedavg(POISSON, denominator="actual"), np.ones(100), 1.0)
    mech = alg.planned_mechanism()
    assert alg.relation == "zero_out" and mech.covered is True and mech.noise_multipliers == (1.0,)
    led = PrivacyLedger("rdp", 1e-5)
    led.record_round(mech.noise_multipliers, mech.sampling, reason=mech.description, covered=mech.covered)
    assert math.isfinite(led.epsilon()) and led.fully_covered
    for relation in ("add_remove", "replace_one"):
        with pytest.raises(DPFLError, match="privacy.adjacency: .*only zero_out"):
            _dp_fedavg(POISSON, denominator="actual", adjacency=relation)


def test_expected_denominators_use_the_declared_population_weight_not_the_data():
    """Under add/remove the population differs between neighbours: q * W must be a constant of the
    scenario (privacy.population_weight, default data.num_clients), not the sum of the weights."""
    sc = _dp_fedavg(POISSON, population_weight=80.0)
    assert DPFedAvg(sc, np.ones(100), 1.0).expected_weight == pytest.approx(0.1 * 80.0)
    assert DPFedAvg(_dp_fedavg(POISSON), np.ones(100), 1.0).expected_weight == pytest.approx(10.0)
    zero = DPFedAvg(_dp_fedavg(POISSON, adjacency="zero_out"), np.full(100, 0.5), 1.0, sizes=None)
    assert zero.expected_weight == pytest.approx(0.1 * 50.0)  # zero-out: the actual population's W
    with pytest.raises(DPFLError, match="privacy.population_weight"):
        _dp_fedavg(POISSON, adjacency="zero_out", population_weight=80.0)


def test_private_runs_with_unequal_sizes_need_a_public_weight_cap():
    sc = _dp_fedavg(POISSON)
    with pytest.raises(DPFLError, match="data.n_max"):
        DPFedAvg(sc, np.r_[np.ones(50), np.full(50, 0.5)], 1.0)
    capped = _dp_fedavg(POISSON)
    capped.data.n_max = 40.0
    DPFedAvg(capped, np.r_[np.ones(50), np.full(50, 0.5)], 1.0)


def test_reproducible_randomness_is_the_seeded_stream_and_os_is_fresh_each_run():
    rep = DPRandomness.create("reproducible", 7)
    assert np.array_equal(rep.generator("noise", 3).standard_normal(5), generator(7, "noise", 3).standard_normal(5))
    a, b = DPRandomness.create("os", 7), DPRandomness.create("os", 7)
    assert "root" not in repr(a)
    assert not np.array_equal(a.generator("noise", 3).standard_normal(5), b.generator("noise", 3).standard_normal(5))
    assert np.array_equal(a.generator("noise", 3).standard_normal(5), a.generator("noise", 3).standard_normal(5))
    assert a.secret("layer", 0, 1, 1) != b.secret("layer", 0, 1, 1) and len(a.secret("layer", 0, 1, 1)) == 32


def test_chacha_normals_are_standard_normal():
    x = ChaChaNormal(bytes(range(32))).standard_normal(1_000_001)
    assert x.shape == (1_000_001,)
    _check_std(x, 1.0)
    assert abs(x.mean()) * math.sqrt(len(x)) < 6.1
    assert stats.kstest(x[:200_000], "norm").pvalue > 1e-9


def test_overcommitted_cohorts_book_the_larger_sampling_and_the_displacement():
    """Bonawitz et al. 2019's overcommit: oc * q sampled, the first q K kept. The kept set never
    depends on the data, but under add/remove an added client can push another out: 2S."""
    poisson = DPFedAvg(_dp_fedavg({**POISSON, "overcommit": 1.5}), np.ones(100), 1.0).planned_mechanism()
    assert poisson.sampling.rate == pytest.approx(0.15) and poisson.noise_multipliers == (0.5,)
    fixed = DPFedAvg(_dp_fedavg({**FIXED, "overcommit": 1.3}), np.ones(100), 1.0).planned_mechanism()
    assert fixed.sampling.clients_per_round == 13 and fixed.noise_multipliers == (0.5,)  # replace-one: 2S already
    expected_weight = DPFedAvg(_dp_fedavg({**POISSON, "overcommit": 1.5}), np.ones(100), 1.0).expected_weight
    assert expected_weight == pytest.approx(10.0)  # the kept cohort, q K, divides the sum
