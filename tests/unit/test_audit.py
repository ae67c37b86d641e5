"""Empirical epsilon from canary clients (Andrew et al. 2024) without Ray: ground truth on the
Gaussian mechanism, the threat models, streaming, checkpoints and ``dpfl audit``."""
from __future__ import annotations

import json
import math

import dp_accounting
import numpy as np
import pytest
from typer.testing import CliRunner

from dpfl_ray import rng
from dpfl_ray.errors import DPFLError
from dpfl_ray.privacy.audit import (
    AuditAccumulator, CanaryStatistics, best_linear_estimate, canary_block, canary_direction, canary_dots,
    canary_update, epsilon_of_separation, estimate_epsilon, gls_weights, statistics_from_record,
)
from dpfl_ray.privacy.dropouts import best_estimate_variance, server_view

D, K, C, DELTA, SEED = 100_000, 1000, 1.0, 1e-5, 0


def analytical_epsilon(z: float, delta: float = DELTA) -> float:
    """One unsampled Gaussian of noise multiplier z, through dp_accounting's PLD accountant."""
    acc = dp_accounting.pld.PLDAccountant()
    acc.compose(dp_accounting.GaussianDpEvent(z))
    return acc.get_epsilon(delta)


@pytest.fixture(scope="module")
def canary_sum() -> np.ndarray:
    """The k inserted canaries' updates summed: the only 'training' of the synthetic run."""
    total = np.zeros(D)
    for start in range(0, K, 100):
        total += C * canary_block(SEED, start, start + 100, D).sum(axis=0, dtype=np.float64)
    return total


BAEK_Z, BAEK_COV = 2.0, server_view("baek", 1.0, 0.7).cov  # 30% dropout: A = S + e, R = S + f


@pytest.fixture(scope="module")
def gaussian_runs(canary_sum):
    """One round, no sampling: release = sum of C u_j (j < k) + N(0, (zC)^2 I), for several z;
    and a Baek round (views A, R of the same sum, noise covariance BAEK_COV in units of (zC)^2) with
    the server's best estimate from both. Cosines of every canary with each, in one pass."""
    zs = (0.5, 1.0, 2.0, 4.0, 8.0, math.inf)
    noise = rng.generator(SEED, "noise", round_idx=0).standard_normal(D)
    releases = [canary_sum + z * C * noise if math.isfinite(z) else noise for z in zs]
    g = rng.generator(SEED, "noise", round_idx=1)
    first, released = (canary_sum + BAEK_Z * C * math.sqrt(BAEK_COV[i, i]) * g.standard_normal(D) for i in (0, 1))
    vectors = np.stack(releases + [released, best_linear_estimate([first, released], BAEK_COV)])
    cos = canary_dots(vectors, SEED, 2 * K) / np.linalg.norm(vectors, axis=1)
    names = list(zs) + ["all_iterates", "server_view"]
    return {z: CanaryStatistics("final_model" if z in zs else z, cos[:K, i], cos[K:, i], D, 1)
            for i, z in enumerate(names)}


@pytest.mark.parametrize("z", [0.5, 1.0, 2.0])
def test_ground_truth_gaussian_mechanism_within_15_percent(gaussian_runs, z):
    est = estimate_epsilon(gaussian_runs[z], DELTA, seed=SEED)
    truth = analytical_epsilon(z)
    assert est.epsilon == pytest.approx(truth, rel=0.15), (z, truth, est)
    assert est.low <= est.epsilon <= est.high
    assert est.null == "closed_form" and est.k == K and est.threat_model == "final_model"
    assert est.spread_ratio == pytest.approx(1.0, abs=0.1)  # equal spreads, as Sec. 3's limit says


@pytest.mark.parametrize("z", [4.0, 8.0])
def test_never_above_the_bound_for_larger_noise(gaussian_runs, z):
    est = estimate_epsilon(gaussian_runs[z], DELTA, seed=SEED)
    assert est.low <= analytical_epsilon(z)
    assert est.low <= est.epsilon <= est.high


def test_no_canary_in_the_release_means_no_leak(gaussian_runs):
    est = estimate_epsilon(gaussian_runs[math.inf], DELTA, seed=SEED)
    assert est.low == 0.0 and est.epsilon < 0.5


def test_held_out_canaries_follow_the_closed_form_null(gaussian_runs):
    """Independent directions have cosine mean 0 and variance 1/d: the null the estimate uses."""
    held = gaussian_runs[1.0].held_out * math.sqrt(D)
    assert abs(held.mean()) < 4 / math.sqrt(K)
    assert held.std(ddof=1) == pytest.approx(1.0, abs=0.1)


def test_conversion_is_the_exact_gaussian_one():
    """mu -> epsilon is the Gaussian mechanism's exact curve: PLD agrees, RDP is only a bound."""
    for z in (0.5, 1.0, 2.0):
        exact = epsilon_of_separation(1 / z, DELTA)
        assert exact == pytest.approx(analytical_epsilon(z), rel=1e-6)
        rdp = dp_accounting.rdp.RdpAccountant()
        rdp.compose(dp_accounting.GaussianDpEvent(z))
        assert rdp.get_epsilon(DELTA) > exact * 1.05
    assert epsilon_of_separation(0.0, DELTA) == 0.0 and epsilon_of_separation(-1.0, DELTA) == 0.0


def test_server_view_combines_the_views_like_the_ledger(gaussian_runs):
    """Baek with 30% dropout, one round: the server's best estimate from A and R is a Gaussian of
    noise multiplier z sqrt(n'/(n+n')) (docs/baek2021.md); the release alone one of z."""
    seen = estimate_epsilon(gaussian_runs["server_view"], DELTA, seed=SEED)
    z_eff = BAEK_Z * math.sqrt(best_estimate_variance(BAEK_COV))
    assert z_eff == pytest.approx(BAEK_Z * math.sqrt(0.7 / 1.7))
    assert seen.epsilon == pytest.approx(analytical_epsilon(z_eff), rel=0.15)
    released_only = estimate_epsilon(gaussian_runs["all_iterates"], DELTA, seed=SEED)
    assert released_only.epsilon == pytest.approx(analytical_epsilon(BAEK_Z), rel=0.15)
    assert seen.low > released_only.high  # the second view leaks, and the audit sees it


# --- canaries, views and streaming, at small dimension ----------------------------------------------

def test_canaries_are_seeded_unit_vectors():
    u = canary_direction(3, 5, 1000)
    assert u.dtype == np.float32 and np.linalg.norm(u) == pytest.approx(1.0, rel=1e-6)
    np.testing.assert_array_equal(u, canary_block(3, 2, 9, 1000)[3])  # same vector in any block
    np.testing.assert_array_equal(u, canary_direction(3, 5, 1000))
    assert abs(float(u @ canary_direction(3, 6, 1000))) < 0.2 and abs(float(u @ canary_direction(4, 5, 1000))) < 0.2
    np.testing.assert_allclose(canary_update(3, 5, 1000, 2.5), 2.5 * u, rtol=1e-6)


def test_canary_dots_match_explicit_products():
    v = np.random.default_rng(0).standard_normal((2, 300))
    dots = canary_dots(v, 7, 25)
    explicit = np.array([[canary_direction(7, j, 300).astype(np.float64) @ x for x in v] for j in range(25)])
    np.testing.assert_allclose(dots, explicit, rtol=1e-4, atol=1e-4)


def test_best_linear_estimate_has_the_ledgers_variance():
    cov = server_view("baek", 1.0, 0.7, w_cal_dropped=0.1).cov
    w = gls_weights(cov)
    assert w.sum() == pytest.approx(1.0)
    assert w @ cov @ w == pytest.approx(best_estimate_variance(cov))
    s, a, b = np.ones(4), np.arange(4.0), -np.arange(4.0)
    np.testing.assert_allclose(best_linear_estimate([s + a, s + b], np.eye(2)), s)


def _releases(dim: int, rounds: int, seed: int = 1) -> list[np.ndarray]:
    g = np.random.default_rng(seed)
    return [g.standard_normal(dim) for _ in range(rounds)]


def test_statistics_are_the_cosines_the_paper_uses():
    dim, k = 400, 6
    rel = _releases(dim, 3)
    acc = AuditAccumulator(dim, k, 11)
    for r in rel:
        acc.add_round(r)
    u = np.stack([canary_direction(11, j, dim).astype(np.float64) for j in range(2 * k)])
    total = np.sum(rel, axis=0)
    final = acc.statistics("final_model")
    np.testing.assert_allclose(np.r_[final.inserted, final.held_out], u @ total / np.linalg.norm(total), atol=1e-5)
    per_round = np.stack([u @ r / np.linalg.norm(r) for r in rel])
    every = acc.statistics("all_iterates")
    np.testing.assert_allclose(np.r_[every.inserted, every.held_out], per_round.max(axis=0), atol=1e-5)
    assert final.rounds == 1 and every.rounds == 3
    view = acc.statistics("server_view")  # no extra views: the server holds the releases only
    np.testing.assert_array_equal(view.inserted, every.inserted)
    first, cov = rel[0] + rel[1], np.array([[2.0, 0.5], [0.5, 1.0]])
    acc.add_round(rel[1], views=[first, rel[1]], view_cov=cov)
    best = best_linear_estimate([first, rel[1]], cov)
    per_view = np.maximum(per_round.max(axis=0), u @ best / np.linalg.norm(best))
    view = acc.statistics("server_view")
    np.testing.assert_allclose(np.r_[view.inserted, view.held_out], per_view, atol=1e-5)
    assert view.rounds == 4


def test_several_rounds_use_the_held_out_null():
    acc = AuditAccumulator(500, 50, 2)
    for r in _releases(500, 4):
        acc.add_round(r)
    assert acc.estimate(1e-5, "all_iterates").null == "held_out"
    assert acc.estimate(1e-5, "final_model").null == "closed_form"
    assert acc.estimate(1e-5, "all_iterates", null="closed_form").null == "closed_form"


def test_estimates_are_deterministic_for_a_seed():
    def run(seed):
        acc = AuditAccumulator(2000, 100, seed)
        for r in _releases(2000, 2):
            acc.add_round(r)
        return [acc.estimate(1e-5, tm).to_dict() for tm in ("final_model", "all_iterates")]

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_state_dict_round_trip_resumes_exactly():
    rel = _releases(1000, 3)
    whole = AuditAccumulator(1000, 40, 9)
    for r in rel:
        whole.add_round(r)
    first = AuditAccumulator(1000, 40, 9)
    for r in rel[:2]:
        first.add_round(r)
    state = {key: (np.array(v) if isinstance(v, np.ndarray) else v) for key, v in first.state_dict().items()}
    resumed = AuditAccumulator(1000, 40, 9)
    resumed.load_state_dict(state)
    resumed.add_round(rel[2])
    assert resumed.to_record() == whole.to_record()
    assert resumed.estimate(1e-5, "all_iterates") == whole.estimate(1e-5, "all_iterates")
    with pytest.raises(DPFLError, match="seed"):
        AuditAccumulator(1000, 40, 8).load_state_dict(state)


def test_record_recomputes_the_same_estimate():
    acc = AuditAccumulator(1500, 30, 4)
    for r in _releases(1500, 2):
        acc.add_round(r)
    stats = statistics_from_record(json.loads(json.dumps(acc.to_record())))
    for tm, s in stats.items():
        assert estimate_epsilon(s, 1e-5, seed=4) == acc.estimate(1e-5, tm)
    with pytest.raises(DPFLError):
        statistics_from_record({"format": 1, "statistics": {"final_model": {"inserted": []}}})
    # a record edited by hand: fewer held-out canaries than inserted ones would give an interval whose
    # low end is above its high one; dim and rounds are at least 1
    good = json.loads(json.dumps(acc.to_record()))
    tm = next(iter(good["statistics"]))
    for change, needle in (({"held_out": [0.1, 0.2]}, "as many held out as inserted"),
                           ({"dim": -3}, "must be at least 1"), ({"rounds": 0}, "must be at least 1")):
        bad = json.loads(json.dumps(good))
        bad["statistics"][tm].update(change)
        with pytest.raises(DPFLError, match=needle):
            statistics_from_record(bad)


@pytest.mark.parametrize("call, field", [
    (lambda a: a.add_round(np.ones(7)), "release"),
    (lambda a: a.add_round(np.full(10, np.nan)), "release"),
    (lambda a: a.add_round(np.ones(10), views=[np.ones(10)]), "view_cov"),
    (lambda a: a.add_round(np.ones(10), views=[np.ones(10)], view_cov=np.eye(2)), "view_cov"),
    (lambda a: a.statistics("final_model"), "audit"),
    (lambda a: a.statistics("everything"), "threat_model"),
])
def test_mistakes_are_one_line_errors(call, field):
    with pytest.raises(DPFLError) as err:
        call(AuditAccumulator(10, 3, 0))
    assert err.value.field == field


@pytest.mark.parametrize("kwargs, field", [
    ({"delta": 0.0}, "delta"), ({"delta": 1e-5, "confidence": 1.0}, "confidence"),
    ({"delta": 1e-5, "null": "magic"}, "null"), ({"delta": 1e-5, "bootstrap": 3}, "bootstrap"),
])
def test_bad_estimate_parameters(kwargs, field):
    stats = CanaryStatistics("final_model", np.array([0.1, 0.2]), np.array([0.0, 0.1]), 100, 1)
    with pytest.raises(DPFLError) as err:
        estimate_epsilon(stats, **kwargs)
    assert err.value.field == field


def test_statistics_near_the_float_range_are_refused_without_a_numpy_warning():
    """Sums of +-1e308 overflow: numpy's RuntimeWarning reached stderr before the one error line."""
    import warnings

    stats = CanaryStatistics("all_iterates", np.array([1e308, 1e308, -1e308]), np.array([1e308, -1e308, 1e308]), 100, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(DPFLError, match="statistics too large to compare") as err:
            estimate_epsilon(stats, 1e-5)
    assert err.value.field == "canaries"


# --- dpfl audit RUN_DIR -----------------------------------------------------------------------------

def test_cli_audit_recomputes_from_the_run_directory(tmp_path):
    from cli.main import app

    acc = AuditAccumulator(1500, 30, 4)
    for r in _releases(1500, 2):
        acc.add_round(r)
    (tmp_path / "audit.json").write_text(json.dumps(acc.to_record()))
    (tmp_path / "summary.json").write_text(json.dumps({"epsilon": 3.2, "epsilon_claimed": 2.5, "delta": 1e-5}))
    runner = CliRunner()
    res = runner.invoke(app, ["audit", str(tmp_path), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["epsilon"] == 3.2 and out["delta"] == 1e-5
    assert out["epsilon_empirical"]["final_model"] == acc.estimate(1e-5, "final_model").to_dict()
    assert set(out["epsilon_empirical"]) == {"final_model", "all_iterates", "server_view"}
    res = runner.invoke(app, ["audit", str(tmp_path), "--threat-model", "all_iterates"])
    assert res.exit_code == 0 and "all_iterates" in res.stdout and "3.200" in res.stdout
    res = runner.invoke(app, ["audit", str(tmp_path / "missing")])
    assert res.exit_code == 2 and "missing: no such run directory" in res.output
    (tmp_path / "unaudited").mkdir()
    res = runner.invoke(app, ["audit", str(tmp_path / "unaudited")])
    assert res.exit_code == 2 and "audit.json not found" in res.output
