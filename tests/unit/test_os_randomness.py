"""``privacy.randomness: os`` reaches every DP draw (no Ray): each private algorithm's release is
fresh in two runs of one seed and repeats under ``reproducible``; the record-level procedures
draw their lots, Gaussian and Laplace noise from the randomness they are given and nothing from
the seed; the client sample and the ChaCha20 uniforms, Laplace draws and permutations."""
import pickle
from types import SimpleNamespace

import numpy as np
import pytest
from scipy import stats

from dpfl_ray.algorithms import CalibrationSum, RoundOutcome, make_algorithm
from dpfl_ray.algorithms.huang2020_core import DPAGDConfig, dpagd_update, noisy_argmax
from dpfl_ray.training.local_dp import DPSGDConfig, dpsgd_update
from dpfl_ray.training.models import build_model, get_flat
from dpfl_ray.privacy.randomness import ChaChaNormal, DPRandomness
from dpfl_ray.privacy.client_sampling import sample_clients
from dpfl_ray.scenario import scenario_from_dict

LEVEL = 1e-6  # level of every statistical test here
K = 10  # clients of every scenario below


def _problem(n=30):
    model = build_model(SimpleNamespace(name="logistic"), (4,), 3, seed=0)
    g = np.random.default_rng(0)
    y = g.integers(0, 3, n).astype(np.int64)
    x = (g.normal(size=(n, 4)) + 2.0 * np.eye(4)[y]).astype(np.float32)
    return model, x, y


def _algorithm(randomness, training, privacy, sampling=None, secagg=False):
    sc = scenario_from_dict({
        "seed": 4, "data": {"source": "synthetic", "num_clients": K, "validation_fraction": 0.0},
        "training": {"rounds": 5, **training},
        "sampling": sampling or {"mode": "fixed", "clients_per_round": K},
        "privacy": {"accountant": "rdp", "randomness": randomness, **privacy},
        "secagg": {"enabled": secagg}})
    return sc, make_algorithm(sc, np.ones(K), sizes=np.full(K, 30))


def _updates(dim):
    g = np.random.default_rng(1)
    return {c: (0.1 * g.normal(size=dim)).astype(np.float32) for c in range(K)}


def _dp_fedavg(randomness):
    _, alg = _algorithm(randomness, {"algorithm": "dp_fedavg"}, {"noise_multiplier": 1.0, "clipping": {"norm": 1.0}})
    assert alg.begin_round(0, list(range(K))) is None
    spec = alg.client_spec()
    ups = {c: spec.plain_value(spec.prepare(u, np.zeros_like(u)), c) for c, u in _updates(6).items()}
    return alg.finish(RoundOutcome(0, tuple(ups), updates=ups), 6).delta


def _baek(randomness):
    _, alg = _algorithm(randomness, {"algorithm": "baek"},
                        {"noise_multiplier": 1.0, "clipping": {"norm": 1.0}, "calibration": "baek"},
                        sampling={"mode": "poisson", "rate": 0.5}, secagg=True)
    survivors = tuple(range(K - 2))  # two drop: the calibration terms are drawn too
    assert alg.begin_round(0, list(range(K))) is None
    noise, ups = alg.client_spec().noise, _updates(6)
    total = sum(ups[c] + noise.sample(c, 1.0, 6) for c in survivors)
    n_prime = alg.after_upload(list(survivors)).calibration_n_prime
    calibration = CalibrationSum(sum(noise.calibration_term(c, 1.0, 6, n_prime) for c in survivors), survivors)
    return alg.finish(RoundOutcome(0, survivors, total=total, calibration=calibration), 6).delta


def _nbafl(randomness):
    # 2 of 10 clients in each of 25 rounds: the downlink noise is on too (Wei et al. 2020, Theorem 2)
    _, alg = _algorithm(randomness, {"algorithm": "nbafl", "rounds": 25},
                        {"clipping": {"norm": 20.0}, "delta": 0.01, "nbafl": {"epsilon": 60.0}},
                        sampling={"mode": "fixed", "clients_per_round": 2})
    assert alg.sigma_d > 0
    cohort = (3, 7)
    assert alg.begin_round(0, list(cohort)) is None
    spec, theta, ups = alg.client_spec(), np.zeros(6, np.float32), _updates(6)
    uploads = {c: spec.plain_value(spec.prepare(ups[c], theta), c) for c in cohort}
    return alg.finish(RoundOutcome(0, cohort, updates=uploads, theta=theta), 6).delta


def _local(alg):
    """What a worker does with the round's local procedure for client 0."""
    assert alg.begin_round(0, list(range(K))) is None
    model, x, y = _problem()
    update, _ = alg.client_spec().local.run(model, get_flat(model), x, y, seed=4, round_idx=0, client_id=0)
    return update


def _huang2020(randomness):
    # a budget that always steps: at 0.1 a quarter of the releases were "no step", a zero update
    return _local(_algorithm(randomness, {"algorithm": "huang2020"}, {
        "clipping": {"norm": 1.0}, "huang2020": {"category_budgets": [20.0], "step_sizes": [0.5, 2.0]}})[1])


def _adap_dpfl(randomness):
    return _local(_algorithm(randomness, {"algorithm": "adap_dpfl"}, {
        "noise_multiplier": 1.0, "clipping": {"norm": 1.0},
        "adap_dpfl": {"epsilon": 10.0, "lot_size": 10, "lr": 0.1, "alpha": 1.0, "beta": None}})[1])


RELEASES = {"dp_fedavg": _dp_fedavg, "baek": _baek, "nbafl": _nbafl, "huang2020": _huang2020,
            "adap_dpfl": _adap_dpfl}


@pytest.mark.parametrize("name", RELEASES)
def test_two_os_runs_of_one_seed_release_different_models(name):
    release = RELEASES[name]
    first, second = release("os"), release("os")
    assert np.all(np.isfinite(first)) and first.shape == second.shape
    assert not np.array_equal(first, second)
    assert np.array_equal(release("reproducible"), release("reproducible"))


@pytest.mark.parametrize("name", ["huang2020", "adap_dpfl"])
def test_the_local_procedure_carries_the_runs_secret_to_the_workers(name):
    """Ray pickles the round's ClientSpec to the workers: the os root must cross with it, so the
    workers draw from the run's secret (not from the seed, nor from a secret of their own)."""
    privacy = {"huang2020": {"huang2020": {"category_budgets": [0.1], "step_sizes": [0.5]}},
               "adap_dpfl": {"noise_multiplier": 1.0, "adap_dpfl": {"epsilon": 10.0, "lot_size": 10, "lr": 0.1,
                                                                    "beta": None}}}[name]
    _, alg = _algorithm("os", {"algorithm": name}, {"clipping": {"norm": 1.0}, **privacy})
    assert alg.begin_round(0, list(range(K))) is None
    local = alg.client_spec().local
    shipped = pickle.loads(pickle.dumps(alg.client_spec())).local
    assert shipped.randomness.mode == "os" and shipped.randomness == local.randomness
    assert np.array_equal(shipped.randomness.generator("dpsgd_noise", 0, 3).standard_normal(4),
                          local.randomness.generator("dpsgd_noise", 0, 3).standard_normal(4))


# --- the record-level procedures draw only from the randomness they are given ------------------

SEEDED = DPRandomness("reproducible", 5)


@pytest.mark.parametrize("sampling", ["poisson", "fixed"])
def test_dpsgd_draws_its_lots_and_noise_from_its_randomness_only(sampling):
    model, x, y = _problem()
    theta = get_flat(model)
    cfg = DPSGDConfig(clip_norm=1.0, noise_multiplier=1.0, lr=0.1, lot_size=8, sampling=sampling, steps=4)

    def run(**kw):
        return dpsgd_update(model, theta, x, y, cfg, round_idx=2, client_id=1, **kw)
    given, by_seed = run(seed=0, randomness=SEEDED), run(seed=5)
    assert np.array_equal(given.update, by_seed.update) and given.lot_sizes == by_seed.lot_sizes
    assert not np.array_equal(given.update, run(seed=0).update)
    # the lots alone, without noise: fresh in every os run too
    quiet = DPSGDConfig(clip_norm=1.0, noise_multiplier=0.0, lr=0.1, lot_size=8, sampling=sampling, steps=4)
    a, b = (dpsgd_update(model, theta, x, y, quiet, seed=0, round_idx=2, client_id=1,
                         randomness=DPRandomness.create("os", 0)) for _ in range(2))
    assert not np.array_equal(a.update, b.update)


def test_dpagd_draws_its_gradient_and_argmax_noise_from_its_randomness_only():
    model, x, y = _problem()
    theta = get_flat(model)
    cfg = DPAGDConfig(clip_norm=1.0, step_sizes=(0.5, 2.0), loss_clip=3.0, epsilon_gradient=0.05,
                      epsilon_selection=0.05)

    def run(**kw):
        return dpagd_update(model, theta, x, y, cfg, 1.0, round_idx=2, client_id=1, **kw)
    given, by_seed = run(seed=0, randomness=SEEDED), run(seed=5)
    assert np.array_equal(given.update, by_seed.update) and given.selections == by_seed.selections
    assert not np.array_equal(given.update, run(seed=0).update)


def test_the_laplace_argmax_over_chacha_picks_tied_candidates_uniformly():
    g = DPRandomness.create("os", 0).generator("dpagd_argmax", 0, 0)
    picks = np.bincount([noisy_argmax(np.zeros(3), 1.0, 1.0, g) for _ in range(3000)], minlength=3)
    assert stats.chisquare(picks).pvalue > LEVEL


# --- the client sample --------------------------------------------------------------------------

@pytest.mark.parametrize("sampling", [SimpleNamespace(mode="poisson", rate=0.3),
                                      SimpleNamespace(mode="fixed", clients_per_round=30)])
def test_the_client_sample_comes_from_the_runs_randomness(sampling):
    seeded = [sample_clients(sampling, 100, 4, t) for t in range(3)]
    assert all(np.array_equal(s, sample_clients(sampling, 100, 4, t, DPRandomness.create("reproducible", 4)))
               for t, s in enumerate(seeded))
    a, b = DPRandomness.create("os", 4), DPRandomness.create("os", 4)
    drawn = sample_clients(sampling, 100, 4, 0, a)
    assert np.array_equal(drawn, np.unique(drawn)) and drawn.min() >= 0 and drawn.max() < 100
    if sampling.mode == "fixed":
        assert len(drawn) == 30
    assert np.array_equal(drawn, sample_clients(sampling, 100, 4, 0, a))  # one stream per round
    assert not np.array_equal(drawn, sample_clients(sampling, 100, 4, 0, b))


# --- what ChaCha20 draws besides normals ---------------------------------------------------------

def test_chacha_uniforms_laplace_draws_and_permutations_have_their_laws():
    g = ChaChaNormal(bytes(range(32)))
    u = g.random(200_000)
    assert u.min() >= 0 and u.max() < 1 and stats.kstest(u, "uniform").pvalue > LEVEL
    assert isinstance(g.random(), float) and g.random((2, 3)).shape == (2, 3)
    lap = g.laplace(1.0, 2.0, size=200_000)
    assert stats.kstest(lap, "laplace", args=(1.0, 2.0)).pvalue > LEVEL
    first = np.array([g.permutation(5) for _ in range(5000)])
    assert all(sorted(p) == list(range(5)) for p in first[:50])
    assert stats.chisquare(np.bincount(first[:, 0], minlength=5)).pvalue > LEVEL
