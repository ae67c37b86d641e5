"""Baek et al. 2021 without Ray: the distributed noise, its calibration after dropouts, and the
server's view that the ledger books (docs/baek2021.md)."""
from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from dpfl_ray.algorithms import Abort, CalibrationSum, RoundOutcome, UnmaskPlan
from dpfl_ray.algorithms.baek import ROUNDING_BETA, Baek
from dpfl_ray.errors import DPFLError
from dpfl_ray.faults.plan import plan_round
from dpfl_ray.privacy.dropouts import (
    best_estimate_variance, effective_noise_multipliers, layer_variances, planned_noise_multipliers, server_view,
    tolerated_dropouts,
)
from dpfl_ray.scenario import DropoutConfig, scenario_from_dict

LEVEL = 1e-6  # two-sided level of every statistical test here
Z, C = 1.0, 0.5
T = 2 * C * Z


def _scenario(mode: str, **privacy):
    return scenario_from_dict({
        "data": {"source": "synthetic", "num_clients": 40, "n_max": 100},  # the tests pass weights directly
        "training": {"algorithm": "baek"},
        "sampling": {"mode": "poisson", "rate": 0.5},
        "privacy": {"noise_multiplier": Z, "clipping": {"norm": C}, "calibration": mode, "accountant": "rdp",
                    **privacy},
        "secagg": {"enabled": True},
    })


def _check_noise(samples: np.ndarray, variance: float) -> None:
    """Zero mean (z-test) and the given variance (chi-square on the sum of squares), both at LEVEL."""
    m = samples.size
    z = samples.mean() / math.sqrt(variance / m)
    assert 2 * stats.norm.sf(abs(z)) > LEVEL, f"mean {samples.mean():.3g} is not 0"
    chi = float(np.sum(samples.astype(np.float64) ** 2)) / variance
    p = 2 * min(stats.chi2.cdf(chi, m), stats.chi2.sf(chi, m))
    assert p > LEVEL, f"variance {chi / m * variance:.6g} is not {variance:.6g} (p={p:.2g})"


def _released_noise(mode: str, rounds: int, dim: int, n_sampled: int, n_drop: int, n_cal_drop: int = 0,
                    seed: int = 0):
    """Run ``rounds`` rounds of the pure mechanism with a fixed dropout pattern; return the noise in
    the released average (released / n' minus the noiseless weighted average) and the plan."""
    g = np.random.default_rng(seed)
    weights = np.r_[g.uniform(0.3, 1.0, n_sampled), np.ones(40 - n_sampled)]
    alg = Baek(_scenario(mode), weights, Z)
    sampled = list(range(n_sampled))
    survivors = sampled[: n_sampled - n_drop]
    senders = survivors[: len(survivors) - n_cal_drop]
    updates = {c: g.normal(size=dim) for c in sampled}
    for c in sampled:  # Alg. 1 clipping to C
        updates[c] *= min(1.0, C / np.linalg.norm(updates[c]))
    out = []
    for t in range(rounds):
        assert alg.begin_round(t, sampled) is None
        noise = alg.client_spec().noise
        total = sum(weights[c] * updates[c] + noise.sample(c, weights[c], dim) for c in survivors)
        extras = alg.after_upload(survivors)
        calibration = layers = None
        if extras.calibration_n_prime is not None:
            n_prime = extras.calibration_n_prime
            calibration = {"clients": senders,
                           "sum": sum(noise.calibration_term(c, weights[c], dim, n_prime) for c in senders)}
            calibration = CalibrationSum(calibration["sum"], tuple(calibration["clients"]))
        if extras.layers_from is not None:  # what SecAgg reconstructs: layers d+1..L of each survivor
            layers = {c: {k: noise.layer_seed(c, k) for k in range(extras.layers_from, len(noise.variances))}
                      for c in survivors}
        released, info = alg.release(RoundOutcome(t, tuple(survivors), total=total, calibration=calibration,
                                                  layer_seeds=layers))
        n_prime = info["weight_survived"]
        clean = sum(weights[c] * updates[c] for c in survivors)
        out.append((released - clean) / n_prime)
    n = float(weights[:n_sampled].sum())
    n_prime = float(weights[survivors].sum())
    w_d = n_prime - float(weights[senders].sum())
    return np.concatenate(out), n, n_prime, w_d, alg


@pytest.mark.parametrize("mode", ["none", "baek", "baek-extended", "layered"])
def test_released_noise_has_the_variance_the_mode_intends(mode):
    """30% of 20 weighted clients drop before their masked input, every round."""
    noise, n, n_prime, _, alg = _released_noise(mode, rounds=25, dim=4000, n_sampled=20, n_drop=6)
    sigma, sigma_prime = T / n, T / n_prime
    intended = {"none": n / n_prime * sigma ** 2,  # Sec. IV.B: std sqrt(n/n') sigma
                "baek": sigma_prime ** 2, "baek-extended": sigma_prime ** 2, "layered": sigma_prime ** 2}[mode]
    _check_noise(noise, intended)
    # and the test can tell the modes apart: none's variance is 30% off the calibrated one
    assert abs(n / n_prime * sigma ** 2 / sigma_prime ** 2 - 1) > 0.25


def test_calibration_dropouts_leave_their_first_noise_in():
    """2 of the 14 survivors never send their calibration term: their e_i (variance w T^2/n) stays."""
    noise, n, n_prime, w_d, _ = _released_noise("baek", rounds=25, dim=4000, n_sampled=20, n_drop=6, n_cal_drop=2)
    _check_noise(noise, T ** 2 * (w_d / n + (n_prime - w_d) / n_prime) / n_prime ** 2)


def test_no_dropout_baek_skips_the_calibration_and_keeps_sigma():
    noise, n, _, _, alg = _released_noise("baek", rounds=10, dim=4000, n_sampled=20, n_drop=0)
    assert alg.plan.unmask == UnmaskPlan()
    _check_noise(noise, (T / n) ** 2)
    mech = alg.mechanism()
    assert (mech.noise_multipliers, mech.claimed_noise_multipliers) == ((Z,), (Z,))


@pytest.mark.parametrize("mode,n_cal_drop", [("baek", 0), ("baek", 3), ("baek-extended", 0), ("baek-extended", 3)])
def test_best_estimate_from_the_servers_view_has_the_predicted_variance(mode, n_cal_drop):
    """The server holds A = sum M_i and the calibration terms. Combining the two views (generalised
    least squares with the covariance of docs/baek2021.md) estimates the data sum with the error
    variance the ledger books -- below the released model's."""
    g = np.random.default_rng(7)
    n_sampled, n_drop, dim, rounds = 20, 6, 3000, 20
    weights = np.r_[g.uniform(0.3, 1.0, n_sampled), np.ones(20)]
    alg = Baek(_scenario(mode), weights, Z)
    sampled = list(range(n_sampled))
    survivors = sampled[: n_sampled - n_drop]
    senders = survivors[: len(survivors) - n_cal_drop]
    n, n_prime = float(weights[:n_sampled].sum()), float(weights[survivors].sum())
    view = server_view(mode, n, n_prime, n_prime - float(weights[senders].sum()), alg.n0)
    solve = np.linalg.solve(view.cov, np.ones(2))
    errors_best, errors_released = [], []
    for t in range(rounds):
        alg.begin_round(t, sampled)
        noise = alg.client_spec().noise
        data = g.normal(size=dim)  # the weighted sum S; any value: the estimate is unbiased
        first = data + sum(noise.sample(c, weights[c], dim) for c in survivors)
        released = first + sum(noise.calibration_term(c, weights[c], dim, n_prime) for c in senders)
        estimate = (solve[0] * first + solve[1] * released) / solve.sum()
        errors_best.append(estimate - data)
        errors_released.append(released - data)
    best = np.concatenate(errors_best)
    _check_noise(best, T ** 2 * view.effective_variance)
    _check_noise(np.concatenate(errors_released), T ** 2 * view.released_variance)
    assert view.effective_variance < 0.9 * view.released_variance
    _, z_eff = effective_noise_multipliers(Z, mode, n, n_prime, n_prime - float(weights[senders].sum()), alg.n0)
    assert z_eff == pytest.approx(Z * math.sqrt(view.effective_variance))


def test_effective_multipliers_at_thirty_percent_dropout():
    """n' = 0.7 n, F = 0.5: the closed forms of docs/baek2021.md."""
    got = {m: planned_noise_multipliers(1.0, m, 0.3) for m in ("none", "baek", "baek-extended", "layered")}
    assert got["none"] == pytest.approx((1.0, math.sqrt(0.7)))
    assert got["baek"] == pytest.approx((1.0, math.sqrt(0.7 / 1.7)))
    assert got["baek-extended"] == pytest.approx((1.0, math.sqrt(0.7 / 1.2)))
    assert got["layered"] == (1.0, 1.0)
    # without dropouts nothing is lost, except by baek-extended, which always calibrates
    assert planned_noise_multipliers(1.0, "baek", 0.0) == (1.0, 1.0)
    assert planned_noise_multipliers(1.0, "baek-extended", 0.0)[1] == pytest.approx(math.sqrt(1 / 1.5))
    with pytest.raises(DPFLError, match="layered tolerates"):
        planned_noise_multipliers(1.0, "layered", 0.6, min_weight_fraction=0.5)


def test_best_estimate_variance_of_independent_views_is_harmonic():
    assert best_estimate_variance([[2.0, 0.0], [0.0, 3.0]]) == pytest.approx(6 / 5)
    assert best_estimate_variance([[4.0]]) == 4.0


@pytest.mark.parametrize("n_sampled,fraction", [(1, 0.5), (10, 0.5), (50, 0.7), (51, 0.5), (7, 1.0)])
def test_kept_layers_add_up_to_the_target(n_sampled, fraction):
    tolerated = tolerated_dropouts(n_sampled, fraction)
    v = layer_variances(n_sampled, tolerated)
    assert len(v) == tolerated + 1 and np.all(v > 0)
    for d in range(tolerated + 1):
        assert (n_sampled - d) * v[: d + 1].sum() == pytest.approx(1.0, rel=1e-12)
    assert n_sampled - tolerated >= max(1, math.ceil(fraction * n_sampled - 1e-9))


def test_layer_seeds_and_noise_repeat_and_differ():
    alg = Baek(_scenario("layered"), np.ones(40), Z)
    alg.begin_round(3, list(range(10)))
    noise = alg.client_spec().noise
    seeds = noise.shared_seeds(4)
    assert len(seeds) == len(noise.variances) - 1 == tolerated_dropouts(10, 0.5)
    assert len(set(seeds)) == len(seeds) and seeds != noise.shared_seeds(5)
    assert np.array_equal(noise.sample(4, 1.0, 50), noise.sample(4, 1.0, 50))


def test_layered_aborts_beyond_its_tolerance_and_extended_below_n0():
    alg = Baek(_scenario("layered", min_weight_fraction=0.8), np.ones(40), Z)
    assert alg.begin_round(0, list(range(10))) is None
    assert "tolerate 2" in alg.after_upload(list(range(7))).reason
    assert alg.after_upload(list(range(8))) == UnmaskPlan()  # d = L: every layer stays
    assert alg.after_upload(list(range(9))) == UnmaskPlan(layers_from=2)
    assert alg.after_upload(list(range(10))) == UnmaskPlan(layers_from=1)
    ext = Baek(_scenario("baek-extended", min_weight_fraction=0.5), np.ones(40), Z)
    assert ext.n0 == pytest.approx(10.0)  # F * q * W = 0.5 * 0.5 * 40, W = data.num_clients
    assert "below n_0" in ext.begin_round(0, list(range(9))).reason
    assert ext.begin_round(0, list(range(10))) is None
    # n_0 is the scenario's, not the data's: clients of other weights leave it, a declared W moves it
    assert Baek(_scenario("baek-extended"), np.r_[np.ones(20), np.full(20, 0.25)], Z).n0 == pytest.approx(10.0)
    assert Baek(_scenario("baek-extended", population_weight=25.0), np.ones(40), Z).n0 == pytest.approx(6.25)


def test_dropouts_in_several_phases_of_one_round():
    specs = [DropoutConfig(model="tail", rate=0.3, phase="upload"),
             DropoutConfig(model="tail", rate=0.5, phase="calibration")]
    f = plan_round(specs, np.arange(20), seed=1, round_idx=0)
    phases = list(f.dropped.values())
    assert phases.count("upload") == 6 and phases.count("calibration") == 7  # half of the 14 left
    assert all(f.delivers(c) for c, p in f.dropped.items() if p == "calibration")
    # the tail of the report order goes first: upload dropouts report last
    order = [c for c in f.report_order]
    assert set(order[-6:]) == {c for c, p in f.dropped.items() if p == "upload"}
    # one model alone draws exactly what it drew before multi-phase plans existed
    one = plan_round(specs[0], np.arange(20), seed=1, round_idx=0)
    assert one.dropped == {c: p for c, p in f.dropped.items() if p == "upload"}


@pytest.mark.parametrize("raw,field", [
    ({"training": {"algorithm": "baek"}, "privacy": {"noise_multiplier": 1.0}}, "secagg.enabled"),
    ({"training": {"algorithm": "dp_fedavg"}, "privacy": {"noise_multiplier": 1.0, "calibration": "baek"}},
     "privacy.calibration"),
    ({"training": {"algorithm": "baek"}, "secagg": {"enabled": True},
      "privacy": {"noise_multiplier": 1.0, "denominator": "expected"}}, "privacy.denominator"),
    ({"training": {"algorithm": "dp_fedavg"}, "privacy": {"noise_multiplier": 1.0},
      "faults": {"dropout": {"model": "tail", "rate": 0.1, "phase": "calibration"}}}, "faults.dropout.phase"),
    ({"training": {"algorithm": "baek"}, "secagg": {"enabled": True},
      "privacy": {"noise_multiplier": 1.0, "min_weight_fraction": 0}}, "privacy.min_weight_fraction"),
    ({"training": {"algorithm": "baek"}, "secagg": {"enabled": True, "overflow": "clip"},
      "privacy": {"noise_multiplier": 1.0}}, "secagg.overflow"),
    ({"training": {"algorithm": "baek"}, "secagg": {"enabled": True, "threshold": "majorty"},
      "privacy": {"noise_multiplier": 1.0}}, "secagg.threshold: must be an integer >= 1, 'majority'"),
    ({"secagg": {"threshold": True}, "privacy": {}}, "secagg.threshold"),
])
def test_bad_baek_settings_name_the_field(raw, field):
    if raw["privacy"]:
        raw["privacy"]["accountant"] = "rdp"
    with pytest.raises(DPFLError) as err:
        scenario_from_dict(raw)
    assert str(err.value).startswith(field)


def test_integer_noise_in_a_ring_too_narrow_for_the_cohort_is_refused_before_anyone_trains():
    """3,000 clients' rounding alone (variance 1/4 each) passes an 8-bit ring at any scale: the round
    is aborted with the ring's one-line reason; 16 bits hold the same cohort."""
    for bits, refused in ((8, True), (16, False)):
        sc = scenario_from_dict({
            "seed": 1, "data": {"source": "synthetic", "num_clients": 4000},
            "training": {"algorithm": "baek"}, "sampling": {"mode": "poisson", "rate": 0.75, "clients_per_round": None},
            "privacy": {"noise_multiplier": 1.0, "clipping": {"norm": 1.0}, "accountant": "rdp",
                        "distributed_noise": "skellam"},
            "secagg": {"enabled": True, "bits": bits}})
        alg = Baek(sc, np.ones(4000), 1.0)
        alg.bind_model(10_000)
        out = alg.begin_round(1, range(3000))
        if refused:
            assert isinstance(out, Abort) and out.reason.startswith("bits: a 8-bit ring cannot hold"), out
        else:
            assert out is None and alg.client_spec().ring.bits == 16


def _integer_scenario(calibration, noise, clients=40, bits=20):
    """Baek with ``noise`` shares inside a ring of ``bits`` bits: ``clients`` synthetic clients, q = 0.25,
    z = 1, C = 1, rdp, F = 0.5."""
    return scenario_from_dict({
        "seed": 1, "data": {"source": "synthetic", "num_clients": clients}, "training": {"algorithm": "baek"},
        "sampling": {"mode": "poisson", "rate": 0.25, "clients_per_round": None},
        "privacy": {"noise_multiplier": 1.0, "clipping": {"norm": 1.0}, "accountant": "rdp", "calibration": calibration,
                    "min_weight_fraction": 0.5, "distributed_noise": noise},
        "secagg": {"enabled": True, "bits": bits}})


@pytest.mark.parametrize("change, field", [
    ({"privacy": {"accountant": "pld"}}, "privacy.accountant"),
    ({"secagg": {"enabled": True, "bits": 64}}, "secagg.bits"),
])
def test_integer_noise_settings_it_cannot_honour_are_one_line(change, field):
    raw = {"seed": 1, "data": {"source": "synthetic", "num_clients": 40},
           "training": {"algorithm": "baek"}, "sampling": {"mode": "poisson", "rate": 0.25, "clients_per_round": None},
           "privacy": {"noise_multiplier": 1.0, "clipping": {"norm": 1.0}, "accountant": "rdp",
                       "distributed_noise": "skellam"},
           "secagg": {"enabled": True, "bits": 16}}
    for key, value in change.items():
        raw[key] = {**raw[key], **value}
    with pytest.raises(DPFLError, match=f"^{field}: "):
        scenario_from_dict(raw)


def test_epsilon_against_the_server_composes_each_client_s_integer_releases_unsampled():
    """The server picks the sample, so against it nothing is amplified; with integer noise what it
    sees is each round's sum of the survivors' shares (the round's DiscreteNoiseSumDpEvent), not a
    Gaussian. Each client's rounds compose by adding their unsampled RDP curves; the worst-off
    client's epsilon comes from dp_accounting's conversion, and a checkpoint keeps it."""
    from dpfl_ray.privacy.discrete_rdp import ORDERS, epsilon, event_rdp_curve
    from dpfl_ray.runtime.privacy import RunPrivacy

    sc = _integer_scenario("none", "skellam")
    alg, run = Baek(sc, np.ones(40), 1.0), RunPrivacy(sc, np.ones(40))
    alg.bind_model(50)
    run.bind(alg)
    rounds = [(range(0, 10), range(0, 7)), (range(5, 15), range(5, 13))]  # clients 5 and 6 survive both
    for t, (sampled, survivors) in enumerate(rounds):
        assert alg.begin_round(t, list(sampled)) is None
        alg.after_upload(list(survivors))
        run.account(t, RoundOutcome(t, tuple(survivors), theta=np.zeros(50, np.float32)), "")
    curves = [event_rdp_curve(r.mechanism, ORDERS, run.ledger.neighboring_relation) for r in run.ledger.rounds]
    assert [r.mechanism.shares for r in run.ledger.rounds] == [7, 8]
    both = epsilon(curves[0] + curves[1], sc.privacy.delta)
    out = run.to_dict()
    assert out["epsilon_vs_server"] == pytest.approx(both, rel=1e-12) and out["epsilon_vs_server"] > out["epsilon"]
    assert out["epsilon_vs_server_note"].startswith("client 5: the integer-noise sums")
    resumed = RunPrivacy(sc, np.ones(40))
    resumed.bind(alg)
    resumed.load_state_dict(run.state_dict(2))
    assert resumed.to_dict()["epsilon_vs_server"] == out["epsilon_vs_server"]


@pytest.mark.parametrize("mechanism", ["skellam", "discrete_gaussian"])
def test_baek_calibration_with_integer_shares_releases_the_fresh_shares_and_books_both_views(mechanism):
    """Alg. 2 lines 17-24 with integer shares: 7 of 10 sampled clients deliver, each survivor sends
    -e_i plus a fresh share of 1/7 of the cohort's total variance, as ring words. The release decoded
    from A + sum c_i mod 2^b carries exactly the survivors' rounded updates and their fresh shares
    (no first share left in it). The ledger books the server's two views of the sum, A and R, whose
    noises are independent: their RDP curves add, and against the server the epsilon is that sum's."""
    import attr

    from dpfl_ray.algorithms.baek import calibration_share_variance
    from dpfl_ray.privacy.discrete import draw
    from dpfl_ray.privacy.discrete_rdp import ORDERS, CalibratedViewsDpEvent, epsilon, event_rdp_curve
    from dpfl_ray.runtime.privacy import RunPrivacy
    from dpfl_ray.secagg.ring import from_ring, ring_sum, rotation_signs, unrotate

    sc = _integer_scenario("baek", mechanism)
    dim = 50
    alg, run = Baek(sc, np.ones(40), 1.0), RunPrivacy(sc, np.ones(40))
    alg.bind_model(dim)
    run.bind(alg)
    sampled, survivors = list(range(10)), list(range(7))
    assert alg.begin_round(0, sampled) is None
    assert alg.after_upload(survivors) == UnmaskPlan(calibration_n_prime=7.0)  # the survivors' count
    spec = alg.client_spec()
    ring, noise = spec.ring, spec.noise
    rng = np.random.default_rng(0)
    updates = {c: rng.normal(0, 0.05, dim).astype(np.float32) for c in survivors}
    words = {c: spec.ring_words(spec.prepare(updates[c], np.zeros(dim, np.float32)), c, 1.0) for c in survivors}
    terms = {c: noise.calibration_term(c, 1.0, ring.dim, 7.0) for c in survivors}
    first = {c: noise.integer_share(c, ring) for c in survivors}
    fresh_var = calibration_share_variance(ring, 10, 7)
    assert fresh_var == (ring.local_variance * 10 / 7 if mechanism == "skellam"
                         else math.ceil(ring.local_variance * 10 / 7))
    fresh = {c: draw(mechanism, noise.randomness.generator("calibration", 0, c), fresh_var, ring.dim)
             for c in survivors}
    a = ring_sum([words[c] for c in survivors], ring.bits)
    r = ring_sum([a, *(terms[c] for c in survivors)], ring.bits)
    rounded = sum(from_ring(words[c], ring.bits) - first[c] for c in survivors)
    assert np.array_equal(from_ring(r, ring.bits), rounded + sum(fresh[c] for c in survivors))
    assert all(terms[c].dtype == np.uint32 for c in survivors)

    signs = rotation_signs(ring.rotation_seed, dim)

    def decoded(w):
        return unrotate(from_ring(w, ring.bits).astype(np.float64), signs, dim) / ring.scale
    released, info = alg.release(RoundOutcome(0, tuple(survivors), total=decoded(a),
                                              calibration=CalibrationSum(decoded(r) - decoded(a), tuple(survivors))))
    assert np.allclose(released, decoded(r), rtol=0, atol=1e-9)
    assert info["calibration_senders"] == 7
    assert info["noise_multiplier_effective"] == pytest.approx(math.sqrt(7 / 17))  # z sqrt(n'/(n+n')), by count

    run.account(0, RoundOutcome(0, tuple(survivors), theta=np.zeros(dim, np.float32)), "")
    event = run.ledger.rounds[0].mechanism
    assert isinstance(event, CalibratedViewsDpEvent) and (event.survivors, event.senders) == (7, 7)
    if mechanism == "skellam":  # the shares' sum is one Skellam: A holds 7 of 10 first shares, R the whole total
        view_a = attr.evolve(alg._ring.event, variance=ring.local_variance * 7, shares=7)
        view_r = attr.evolve(alg._ring.event, variance=fresh_var * 7, shares=7)
        assert view_r.variance == pytest.approx(ring.local_variance * 10)
    else:
        view_a = attr.evolve(alg._ring.event, variance=ring.local_variance, shares=7)
        view_r = attr.evolve(alg._ring.event, variance=fresh_var, shares=7)
    curves = [event_rdp_curve(v, ORDERS, run.ledger.neighboring_relation) for v in (view_a, view_r)]
    both = event_rdp_curve(event, ORDERS, run.ledger.neighboring_relation)
    assert np.allclose(both, curves[0] + curves[1], rtol=1e-12)
    out = run.to_dict()
    assert out["epsilon_vs_server"] == pytest.approx(epsilon(both, sc.privacy.delta), rel=1e-12)
    # the ledger round survives its JSON form
    from dpfl_ray.privacy.ledger import PrivacyLedger
    again = PrivacyLedger.from_dict(run.ledger.to_dict())
    assert again.rounds[0].mechanism == event and again.epsilon() == pytest.approx(run.ledger.epsilon(), rel=1e-12)


@pytest.mark.parametrize("mechanism", ["skellam", "discrete_gaussian"])
def test_baek_extended_with_integer_shares_starts_from_the_floor_and_always_calibrates(mechanism):
    """Alg. 3 with integer shares, by count: q = 0.25 of 40 clients expects 10, so n_0 = F * 10 = 5.
    Each first share carries the cohort's total over n_0 (twice a baek share's, at the same scale),
    and the ring is sized for the first aggregate's 10 / 5 times the total; every survivor's fresh
    share is the total over the survivors. A round of 10 that nobody leaves still calibrates and
    books both views; a round of 4 sampled, below n_0, is aborted before anyone trains."""
    from dpfl_ray.algorithms.base import Abort
    from dpfl_ray.algorithms.baek import calibration_share_variance
    from dpfl_ray.privacy.discrete import draw
    from dpfl_ray.privacy.discrete_rdp import CalibratedViewsDpEvent
    from dpfl_ray.runtime.privacy import RunPrivacy
    from dpfl_ray.secagg.ring import from_ring, ring_sum

    dim, total = 50, lambda alg: (alg._ring.scale * 2.0) ** 2  # (scale * 2 C z)^2, C = z = 1
    base = Baek(_integer_scenario("baek", mechanism), np.ones(40), 1.0)
    sc = _integer_scenario("baek-extended", mechanism)
    alg, run = Baek(sc, np.ones(40), 1.0), RunPrivacy(sc, np.ones(40))
    for a in (base, alg):
        a.bind_model(dim)
    run.bind(alg)
    assert alg.n0_count == pytest.approx(5.0)
    assert base.begin_round(0, list(range(10))) is None and alg.begin_round(0, list(range(10))) is None
    local = alg._ring.local_variance
    if mechanism == "skellam":
        assert local == pytest.approx(total(alg) / 5) and base._ring.local_variance == pytest.approx(total(base) / 10)
    else:
        assert local == math.ceil(total(alg) / 5)
    assert alg._ring.scale < base._ring.scale  # twice the first aggregate's noise in the same ring

    survivors = list(range(10))  # nobody drops: the calibration runs all the same
    assert alg.after_upload(survivors) == UnmaskPlan(calibration_n_prime=10.0)
    spec = alg.client_spec()
    ring, noise = spec.ring, spec.noise
    fresh_var = calibration_share_variance(ring, noise.first_shares, 10)
    assert noise.first_shares == pytest.approx(5.0) and fresh_var == pytest.approx(
        local * 5 / 10 if mechanism == "skellam" else math.ceil(local * 5 / 10))
    rng = np.random.default_rng(1)
    words = {c: spec.ring_words(spec.prepare(rng.normal(0, 0.05, dim).astype(np.float32), np.zeros(dim, np.float32)),
                                c, 1.0) for c in survivors}
    first = {c: noise.integer_share(c, ring) for c in survivors}
    fresh = {c: draw(mechanism, noise.randomness.generator("calibration", 0, c), fresh_var, ring.dim) for c in survivors}
    a = ring_sum(list(words.values()), ring.bits)
    r = ring_sum([a, *(noise.calibration_term(c, 1.0, ring.dim, 10.0) for c in survivors)], ring.bits)
    assert np.array_equal(from_ring(r, ring.bits),
                          sum(from_ring(words[c], ring.bits) - first[c] + fresh[c] for c in survivors))
    alg.release(RoundOutcome(0, tuple(survivors), total=np.zeros(dim),
                             calibration=CalibrationSum(np.zeros(dim), tuple(survivors))))
    run.account(0, RoundOutcome(0, tuple(survivors), theta=np.zeros(dim, np.float32)), "")
    event = run.ledger.rounds[0].mechanism
    assert isinstance(event, CalibratedViewsDpEvent) and (event.survivors, event.senders) == (10, 10)
    assert event.fresh_variance == fresh_var and event.first.shares == 1
    assert isinstance(alg.planned_mechanism().event, CalibratedViewsDpEvent)  # the budget check books both views too

    aborted = Baek(sc, np.ones(40), 1.0)
    aborted.bind_model(dim)
    refusal = aborted.begin_round(1, list(range(4)))
    assert isinstance(refusal, Abort) and "below n_0 = 5" in refusal.reason


def test_integer_calibration_against_the_server_costs_about_the_gaussian_s_two_views():
    """Against the server, one Skellam calibrated round at 20 bits (100 sampled, 70 deliver) costs
    within 1% of the continuous Gaussian's bivariate view (docs/baek2021.md: z sqrt(n'/(n+n'))), and
    more than the uncalibrated release of the survivors' first shares alone (5.82): the second view
    is not free."""

    def server_eps(mode: str, noise: str) -> float:
        from dpfl_ray.runtime.privacy import RunPrivacy

        sc = _integer_scenario(mode, noise, clients=400, bits=32 if noise == "gaussian" else 20)
        alg, run = Baek(sc, np.ones(400), 1.0), RunPrivacy(sc, np.ones(400))
        alg.bind_model(1000)
        run.bind(alg)
        assert alg.begin_round(0, list(range(100))) is None
        alg.after_upload(list(range(70)))
        if mode == "baek":
            alg.release(RoundOutcome(0, tuple(range(70)), total=np.zeros(1000),
                                     calibration=CalibrationSum(np.zeros(1000), tuple(range(70)))))
        run.account(0, RoundOutcome(0, tuple(range(70)), theta=np.zeros(1000, np.float32)), "")
        return run.to_dict()["epsilon_vs_server"]
    calibrated, gaussian, alone = server_eps("baek", "skellam"), server_eps("baek", "gaussian"), \
        server_eps("none", "skellam")
    assert gaussian < calibrated < 1.01 * gaussian  # 7.945 against 7.940
    assert calibrated > alone


def _layered_round_of_ten(mechanism):
    """A layered round with integer layers: 10 of 40 sampled, F = 0.5 tolerates L = 5 dropouts, 7
    deliver (d = 3), so layers 4..5 of each survivor are to be removed."""
    dim = 50
    alg = Baek(_integer_scenario("layered", mechanism), np.ones(40), 1.0)
    alg.bind_model(dim)
    survivors = list(range(7))
    assert alg.begin_round(0, list(range(10))) is None
    assert alg.after_upload(survivors) == UnmaskPlan(layers_from=4)
    return alg, alg.client_spec(), survivors, dim


def _layers_removed_in_the_ring(alg, spec, survivors, removed, dim):
    """The survivors' words summed mod 2^b; the server's release with ``removed`` layers of each rebuilt
    from their seeds equals the decoded sum of what each survivor keeps. Returns the release's figures."""
    from dpfl_ray.secagg.ring import decode_sum, from_ring, ring_sum, to_ring

    ring, noise = spec.ring, spec.noise
    rng = np.random.default_rng(0)
    words = {c: spec.ring_words(spec.prepare(rng.normal(0, 0.05, dim).astype(np.float32), np.zeros(dim, np.float32)),
                                c, 1.0) for c in survivors}
    seeds = {c: {k: noise.layer_seed(c, k) for k in removed} for c in survivors}
    a = ring_sum([words[c] for c in survivors], ring.bits)
    kept = sum(from_ring(words[c], ring.bits) - sum(noise.layer_ints(seeds[c][k], k) for k in removed)
               for c in survivors)
    first = decode_sum(a, ring.bits, ring.scale, ring.rotation_seed, dim)
    released, info = alg.release(RoundOutcome(0, tuple(survivors), total=first, layer_seeds=seeds, words=a))
    assert np.array_equal(released, decode_sum(to_ring(kept, ring.bits), ring.bits, ring.scale, ring.rotation_seed, dim))
    return info


def test_layered_with_skellam_layers_removes_them_in_the_ring_and_releases_the_cohort_s_total():
    """Dordis's add-then-remove with integer layers: 10 sampled, F = 0.5 tolerates L = 5 dropouts; 7
    deliver (d = 3), so layers 4..5 of every survivor are rebuilt from their seeds and subtracted mod
    2^b before decoding. The survivors keep layers 0..3: (N - d) / (N - d) of the total, one Skellam
    of the cohort's variance, which is the single view the ledger books (the removed layers are
    known to the server exactly)."""
    alg, spec, survivors, dim = _layered_round_of_ten("skellam")
    ring, noise = spec.ring, spec.noise
    assert math.isclose(sum(noise.variances[:4]) * 7, 1.0)  # layers 0..d of N - d survivors: the whole total
    info = _layers_removed_in_the_ring(alg, spec, survivors, (4, 5), dim)
    assert info["layers_removed"] == 14 and info["noise_multiplier_effective"] == pytest.approx(1.0)
    event = alg.mechanism().event
    assert (event.mechanism, event.shares) == ("skellam", 7)
    assert event.variance == pytest.approx(ring.local_variance * 10)


@pytest.mark.parametrize("total, n, tolerated", [(2.5e5, 10, 5), (1.3e8, 100, 50), (4000.0, 50, 49), (80.0, 10, 5)])
def test_discrete_gaussian_layers_are_equal_draws_whose_survivors_carry_at_least_the_total(total, n, tolerated):
    """layer_quanta: after any d <= L dropouts the N - d survivors' layers 0..d hold (N - d) c_d draws of
    N_Z(0, u), whose variance is at least the cohort's total and less than total + (N - d) u, which is
    at most (1 + 1/Q) total + N; every layer holds a whole number of draws, none negative."""
    from dpfl_ray.privacy.dropouts import LAYER_QUANTA, layer_quanta

    u, counts = layer_quanta(total, n, tolerated)
    assert isinstance(u, int) and u >= 1 and len(counts) == tolerated + 1 and min(counts) >= 0
    held = np.cumsum(counts)
    for d in range(tolerated + 1):
        released = (n - d) * int(held[d]) * u
        assert total <= released < total + (n - d) * u <= (1 + 1 / LAYER_QUANTA) * total + n
    assert held[0] <= LAYER_QUANTA


def test_layered_with_discrete_gaussian_layers_removes_them_in_the_ring_and_books_the_survivors_draws():
    """The discrete Gaussian's layers are sums of equal draws of N_Z(0, u): 10 sampled, L = 5, 7
    deliver (d = 3). Layers 4..5 of every survivor are rebuilt from their seeds and subtracted mod
    2^b before decoding; the ledger books the 7 c_3 draws the survivors keep, one sum of equal
    discrete Gaussians (Kairouz et al. 2021, Thm. 1), at least the cohort's total variance; the
    planned round (nobody drops) books the cohort's N c_0 draws."""
    from dpfl_ray.privacy.discrete_rdp import DiscreteNoiseSumDpEvent

    alg, spec, survivors, dim = _layered_round_of_ten("discrete_gaussian")
    noise = spec.noise
    total = (alg._ring.scale * 2.0) ** 2
    held = np.cumsum(noise.quanta)
    assert len(noise.quanta) == 6 and noise.quantum == math.ceil(total / (10 * 8))
    assert total <= 7 * held[3] * noise.quantum < total + 7 * noise.quantum
    seed = noise.layer_seed(3, 5)
    assert np.array_equal(noise.layer_ints(seed, 5), noise.layer_ints(seed, 5))  # anyone with the seed
    info = _layers_removed_in_the_ring(alg, spec, survivors, (4, 5), dim)
    assert info["layers_removed"] == 14 and info["layer_draws_released"] == 7 * held[3]
    assert info["noise_multiplier_effective"] == pytest.approx(math.sqrt(7 * held[3] * noise.quantum / total))
    assert 1.0 <= info["noise_multiplier_effective"] < 1.07
    event = alg.mechanism().event
    assert isinstance(event, DiscreteNoiseSumDpEvent) and event.mechanism == "discrete_gaussian"
    assert (event.shares, event.variance) == (7 * held[3], noise.quantum)
    planned = alg.planned_mechanism().event
    assert planned.variance * planned.shares >= (alg._ring_plan(10).scale * 2.0) ** 2


def test_discrete_gaussian_layers_book_what_skellam_layers_book_to_a_few_percent():
    """The same layered round with Skellam layers (one Skellam of exactly the total) and with equal
    discrete Gaussian draws (at least the total, on a ring with the draws' margin): at 20 bits the
    epsilons differ by a few percent at most, the discrete Gaussian's by its extra variance."""
    from dpfl_ray.runtime.privacy import RunPrivacy

    def eps(noise):
        sc = _integer_scenario("layered", noise, clients=400)
        alg, run = Baek(sc, np.ones(400), 1.0), RunPrivacy(sc, np.ones(400))
        alg.bind_model(1000)
        run.bind(alg)
        assert alg.begin_round(0, list(range(100))) is None
        alg.after_upload(list(range(70)))
        run.account(0, RoundOutcome(0, tuple(range(70)), theta=np.zeros(1000, np.float32)), "")
        return run.to_dict()["epsilon_vs_server"]
    skellam, dgauss = eps("skellam"), eps("discrete_gaussian")
    assert abs(dgauss - skellam) < 0.05 * skellam, (skellam, dgauss)


def test_a_calibration_the_ring_cannot_hold_is_skipped_and_the_round_books_the_first_aggregate_alone():
    """Where the discrete Gaussian's fresh shares, rounded up, would pass the wrap bound (the ring
    plan's margin normally covers them), the round is released uncalibrated: no calibration phase,
    the reason in the row, and the ledger books the survivors' first shares, one view."""
    class Tight(Baek):
        def _calibration_fits(self, survived: int) -> bool:
            return False

    sc = _integer_scenario("baek", "discrete_gaussian")
    alg = Tight(sc, np.ones(40), 1.0)
    alg.bind_model(50)
    assert alg.begin_round(0, list(range(10))) is None
    assert alg.after_upload(list(range(7))) == UnmaskPlan()
    _, info = alg.release(RoundOutcome(0, tuple(range(7)), total=np.zeros(50)))
    assert "released uncalibrated" in info["calibration_skipped"] and "calibration_senders" not in info
    assert info["noise_multiplier_effective"] == pytest.approx(math.sqrt(0.7))
    event = alg.mechanism().event
    assert event.shares == 7 and event.variance == alg.client_spec().ring.local_variance
    assert alg.server_views() is None


def test_survivors_that_send_no_calibration_term_never_cost_more_than_the_round_was_booked_for():
    """Survivors that drop before their calibration term leave their first shares D in both views.
    Given D, the views are X + E and X + F over the senders; given E and F, one view X + D: the
    ledger books the smaller at each order. So one sender of 70 costs about what no calibration
    costs (not the two views of one share each), and before the calibration phase the round is
    booked for the worst number of senders, which none exceeds."""
    def server_eps(senders):
        from dpfl_ray.runtime.privacy import RunPrivacy

        sc = _integer_scenario("baek", "skellam", clients=400)
        alg, run = Baek(sc, np.ones(400), 1.0), RunPrivacy(sc, np.ones(400))
        alg.bind_model(1000)
        run.bind(alg)
        assert alg.begin_round(0, list(range(100))) is None
        alg.after_upload(list(range(70)))
        planned = alg.mechanism().event
        if senders is not None:
            alg.release(RoundOutcome(0, tuple(range(70)), total=np.zeros(1000),
                                     calibration=CalibrationSum(np.zeros(1000), tuple(range(senders)))))
        run.account(0, RoundOutcome(0, tuple(range(70)), theta=np.zeros(1000, np.float32)), "")
        return run.to_dict()["epsilon_vs_server"], planned
    eps = {s: server_eps(s)[0] for s in (0, 1, 35, 69, 70)}
    worst, planned = server_eps(None)
    assert planned.senders is None and planned.survivors == 70
    assert eps[0] == pytest.approx(5.8242, abs=1e-3) and eps[70] == pytest.approx(7.9451, abs=1e-3)
    assert eps[1] < eps[70] and eps[69] < 1.1 * eps[70]
    assert all(e <= worst + 1e-9 for e in eps.values()), (eps, worst)


@pytest.mark.parametrize("sampling, one_in_one_out", [
    ({"mode": "poisson", "rate": 0.25, "clients_per_round": None}, False),
    ({"mode": "poisson", "rate": 0.25, "clients_per_round": None, "overcommit": 1.5}, True),  # one in, one out
    ({"mode": "fixed", "clients_per_round": 10, "rate": None}, True),
])
def test_integer_noise_books_two_rounded_vectors_where_a_neighbour_swaps_a_client(sampling, one_in_one_out):
    """Each client's vector is rounded on its own: where a neighbour puts one client in and another
    out (a fixed-size cohort, or Poisson with overcommit), the sum moves by twice one rounded bound."""
    from dpfl_ray.privacy import discrete_rdp as rdp
    from dpfl_ray.secagg.ring import padded_dim

    raw = _integer_scenario("none", "skellam", bits=14).model_dump(mode="json")
    raw["sampling"] = {**raw["sampling"], **sampling}
    sc = scenario_from_dict(raw)
    alg = Baek(sc, np.ones(40), 1.0)
    alg.bind_model(26010)
    assert alg.one_in_one_out is one_in_one_out
    plan = alg._ring_plan(10)
    d, beta = padded_dim(alg.dim), ROUNDING_BETA
    single = rdp.rounded_l2_bound(alg.clip_norm * plan.scale, d, beta)
    expected = 2 * single if one_in_one_out else rdp.rounded_l2_bound(2 * alg.clip_norm * plan.scale, d, beta)
    assert plan.event.l2 == expected


def test_the_late_gap_script_pairs_runs_by_seed_and_averages_the_window(tmp_path):
    """docs/experiments/baek2021_late_gap.py (docs/reproductions.md, experiment 8), on hand-made run
    directories: runs paired by seed and told apart by their scenario.yaml, each seed's mean gap over
    the window, the seeds' mean with scipy's t interval, and a seed without both runs over the window
    listed and not counted; a run of another configuration is refused."""
    import importlib.util
    import json
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("late_gap", root / "docs" / "experiments" / "baek2021_late_gap.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def run(name, seed, z, rate, accuracy, rounds=102):
        d = tmp_path / name
        d.mkdir()
        dropout = {"model": "tail" if rate else "none", "rate": rate}
        (d / "scenario.yaml").write_text(yaml.safe_dump({"seed": seed, "faults": {"dropout": dropout},
                                                         "privacy": {"noise_multiplier": z, "calibration": "baek"}}))
        (d / "summary.json").write_text(json.dumps({"final_accuracy": accuracy(rounds), "stop_reason": "completed"}))
        (d / "rounds.jsonl").write_text("".join(json.dumps({"round": t, "test_accuracy": accuracy(t)}) + "\n"
                                                for t in range(1, rounds + 1)))
        return d

    # seed 1: the z / 0.9 run leads by 0.01 in even rounds and 0.03 in odd ones; seed 2 by 0.02 in round 100 only
    runs = [run("cal1", 1, 1.5, 0.1, lambda t: 0.5), run("z1", 1, 1.6667, 0.0, lambda t: 0.51 + 0.02 * (t % 2)),
            run("cal2", 2, 1.5, 0.1, lambda t: 0.6), run("z2", 2, 1.6667, 0.0, lambda t: 0.62 if t == 100 else 0.6),
            run("cal3", 3, 1.5, 0.1, lambda t: 0.7, rounds=100), run("z3", 3, 1.6667, 0.0, lambda t: 0.7)]
    lines = module.table(99, 102, runs)
    assert lines[2:5] == ["| 1 | +0.0200 | +0.0300 | +0.0100 | +0.0100 |",
                          "| 2 | +0.0050 | +0.0000 | +0.0200 | +0.0000 |",
                          "| 3 | not counted: its two runs do not both cover rounds 99-102 | | | |"]
    low, high = stats.t.interval(0.95, 1, loc=0.0125, scale=stats.sem([0.02, 0.005]))
    assert lines[6] == f"D = +0.0125 over 2 seeds (SE 0.0075, 95% {low:+.4f} to {high:+.4f})"
    assert lines[7:] == ["round 100 alone: +0.0150 (SE 0.0050)", "round 102 alone: +0.0050 (SE 0.0050)"]
    with pytest.raises(SystemExit, match="neither the calibrated"):
        module.table(99, 102, runs + [run("z1_drop30", 4, 1.0, 0.3, lambda t: 0.5)])

    # experiment 9 adds the no-dropout run at z = 1.5: the claim's loss L and z / 0.9's cost C, with L = C + D
    both = runs + [run("n1", 1, 1.5, 0.0, lambda t: 0.53), run("n2", 2, 1.5, 0.0, lambda t: 0.61)]
    lines = module.tables(99, 102, both)
    assert lines[0] == "D = z/0.9 minus calibrated:" and lines[8].startswith("D = +0.0125 over 2 seeds")
    at = lines.index("L = z=1.5 minus calibrated:")
    assert lines[at + 4:at + 7] == ["| 1 | +0.0300 | +0.0300 | +0.0300 | +0.0300 |",
                                    "| 2 | +0.0100 | +0.0100 | +0.0100 | +0.0100 |",
                                    "| 3 | not counted: its two runs do not both cover rounds 99-102 | | | |"]
    assert lines[at + 8].startswith("L = +0.0200 over 2 seeds (SE 0.0100")
    at = lines.index("C = z=1.5 minus z/0.9:")
    assert lines[at + 4:at + 6] == ["| 1 | +0.0100 | +0.0000 | +0.0200 | +0.0200 |",
                                    "| 2 | +0.0050 | +0.0100 | -0.0100 | +0.0100 |"]
    assert lines[at + 8].startswith("C = +0.0075 over 2 seeds (SE 0.0025")
    assert module.tables(99, 102, runs) == ["D = z/0.9 minus calibrated:", ""] + module.table(99, 102, runs)
    # experiment 10's second look: a 97.5% interval
    low, high = stats.t.interval(0.975, 1, loc=0.02, scale=0.01)
    assert f"L = +0.0200 over 2 seeds (SE 0.0100, 97.5% {low:+.4f} to {high:+.4f})" in module.tables(99, 102, both, 0.975)


def test_a_cohort_whose_fixed_point_words_cannot_hold_clip_and_noise_is_refused_before_anyone_trains():
    """A word past the encoder's limit aborted the round naming its client: whether it did followed
    from one client's update (a peaked update overflowed, a spread one did not), a bit of its data
    nobody booked. Now the round is refused up front by public quantities alone: C, the cohort, the
    noise's std, the ring. 100 clients at C = 10 in 32-bit words at scale 2^22 hold 5.12 a coordinate."""
    from dpfl_ray.scenario import load_scenario
    from dpfl_ray.privacy.randomness import DPRandomness
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scenarios" / "baek2021_ci_z1_drop30_calibrated.yaml"
    for scale, refused in ((2.0 ** 22, True), (2.0 ** 16, False)):
        sc = load_scenario(path, ["secagg.bits=32", f"secagg.scale={scale:g}", "privacy.clipping.norm=10"])
        baek = Baek(sc, np.ones(sc.data.num_clients), sc.privacy.noise_multiplier,
                    randomness=DPRandomness.create("reproducible", 0))
        out = baek.begin_round(0, list(range(100)))
        if refused:
            assert isinstance(out, Abort) and out.reason == (
                "secagg: 100 clients' words of 32 bits at scale 4.1943e+06 hold 5.12 a coordinate, an update "
                "clipped to 10 with its noise share up to 10 std needs 30; use secagg.bits 64 or a smaller "
                "secagg.scale"), out
        else:  # 2^16: 327.7 a coordinate
            assert out is None
