"""Integer noise for distributed DP (issue #36): the exact samplers against their pmfs, the RDP
functions against closed forms and dp_accounting, and the ring pipeline's exactness."""
import math
from pathlib import Path

import dp_accounting
import numpy as np
import pytest
from dp_accounting.rdp import RdpAccountant
from scipy import stats

from dpfl_ray.errors import DPFLError
from dpfl_ray.privacy import discrete
from dpfl_ray.privacy import discrete_rdp as rdp
from dpfl_ray.privacy.randomness import ChaChaNormal
from dpfl_ray.secagg import ring
from dpfl_ray.secagg.errors import EncodingError


def _chi_square_p(draws: np.ndarray, pmf, lo: int, hi: int) -> float:
    """p-value of a chi-square test of ``draws`` against ``pmf``: one cell per value of lo..hi whose
    expected count is at least 5, every other value (the tails included) pooled in one more cell."""
    n = len(draws)
    support = np.arange(lo, hi + 1)
    expected = np.array([pmf(k) for k in support]) * n
    observed = np.array([np.sum(draws == k) for k in support], dtype=float)
    keep = expected >= 5
    expected, observed = expected[keep], observed[keep]
    rest_expected, rest_observed = n - expected.sum(), n - observed.sum()
    if rest_expected >= 5:
        expected, observed = np.append(expected, rest_expected), np.append(observed, rest_observed)
    else:
        expected = expected * observed.sum() / expected.sum()
    return float(stats.chisquare(observed, expected).pvalue)


def _discrete_gaussian_pmf(variance: int):
    support = np.arange(-60 * math.isqrt(variance) - 60, 60 * math.isqrt(variance) + 61)
    weights = np.exp(-support.astype(float) ** 2 / (2.0 * variance))
    norm = weights.sum()
    return lambda k: math.exp(-k * k / (2.0 * variance)) / norm


@pytest.mark.parametrize("variance", [1, 2, 7, 50])
@pytest.mark.parametrize("source", ["numpy", "chacha"])
def test_the_discrete_gaussian_follows_its_exact_pmf(variance, source):
    gen = np.random.default_rng(variance) if source == "numpy" else ChaChaNormal(bytes([variance]) * 32)
    draws = discrete.discrete_gaussian(gen, variance, 40_000)
    sigma = math.sqrt(variance)
    p = _chi_square_p(draws, _discrete_gaussian_pmf(variance), -int(4 * sigma) - 1, int(4 * sigma) + 1)
    assert p > 1e-4, p
    assert abs(draws.mean()) < 5 * sigma / math.sqrt(len(draws))
    # the discrete Gaussian's variance is a little below sigma^2 for small sigma, never above
    assert draws.var() < variance * (1 + 5 * math.sqrt(2 / len(draws)))


def test_bernoulli_exp_is_exact_in_frequency_on_both_sides_of_one():
    gen = np.random.default_rng(5)
    for num, den in ((1, 3), (3, 3), (7, 2), (0, 4)):
        hits = discrete.bernoulli_exp(gen, np.full(100_000, num), den)
        p = math.exp(-num / den)
        assert abs(hits.mean() - p) < 5 * math.sqrt(p * (1 - p) / 100_000) + 1e-12, (num, den, hits.mean(), p)


@pytest.mark.parametrize("source", ["numpy", "chacha"])
def test_one_bound_draws_the_stream_the_per_element_bounds_draw(source):
    # the samplers draw with one bound where every element has the same: the same integers as the
    # per-element form, so a run's discrete noise is the same to the bit whichever form drew it
    def gen():
        return np.random.default_rng(11) if source == "numpy" else ChaChaNormal(bytes(range(32)))

    for bound in (1, 2, 7, 1001, 2 ** 40, 2 ** 61):
        a, b = gen(), gen()
        per_element = [discrete._below(a, np.full(n, bound, dtype=np.int64)) for n in (500, 3, 64)]
        one_bound = [discrete._below(b, bound, n) for n in (500, 3, 64)]
        assert all(np.array_equal(x, y) for x, y in zip(per_element, one_bound)), bound


def test_a_discrete_gaussian_draw_beyond_int64_squares_takes_the_exact_tail_path():
    # at variance 2^30 the acceptance numerator (|Y| t - s2)^2 passes int64 for |Y| past ~3 t:
    # those draws go through Python integers, the rest through int64; the law stays the exact one
    draws = discrete.discrete_gaussian(np.random.default_rng(5), 2 ** 30, 200_000)
    t = math.isqrt(2 ** 30) + 1
    assert np.any(np.abs(draws) > (3_037_000_499 + 2 ** 30) // t)  # the tail path ran
    assert abs(draws.var() / 2 ** 30 - 1) < 0.02 and abs(draws.mean()) < 5 * 2 ** 15 / math.sqrt(200_000)


def test_the_discrete_laplace_follows_its_pmf():
    t = 3
    draws = discrete.discrete_laplace(np.random.default_rng(2), t, 40_000)
    norm = (1 - math.exp(-1 / t)) / (1 + math.exp(-1 / t))
    assert _chi_square_p(draws, lambda k: norm * math.exp(-abs(k) / t), -15, 15) > 1e-4


@pytest.mark.parametrize("variance", [3.0, 40.0])
def test_the_skellam_follows_its_pmf(variance):
    draws = discrete.skellam(ChaChaNormal(b"s" * 32), variance, 40_000)
    sd = math.sqrt(variance)
    p = _chi_square_p(draws, lambda k: stats.skellam.pmf(k, variance / 2, variance / 2), -int(4 * sd), int(4 * sd))
    assert p > 1e-4, p


def test_a_skellam_share_past_the_samplers_range_is_drawn_in_pieces_and_keeps_its_law():
    """numpy's Poisson sampler works in doubles: at a mean past 2^53 its draws are all even, so a share
    of variance 2^57 drawn at once would send the sum's lowest bit out without noise. Past 2^30 the
    share is drawn as a sum of Skellams of at most 2^30 each (Poisson is additive); within it, as the
    difference of two Poissons, the stream unchanged."""
    once = np.random.default_rng(3)
    assert np.array_equal(discrete.skellam(np.random.default_rng(3), 2.0 ** 30, 1000),
                          once.poisson(2.0 ** 29, 1000) - once.poisson(2.0 ** 29, 1000))
    for variance in (2.0 ** 33, 1000 * 2.0 ** 30):
        draws = discrete.skellam(np.random.default_rng(4), variance, 100_000).astype(float)
        assert abs(draws.var() / variance - 1) < 0.03
        assert abs(np.mean(draws % 2 == 1) - 0.5) < 0.01 and abs(np.mean(draws % 16 == 0) - 1 / 16) < 0.005
    with pytest.raises(DPFLError, match=r"^variance: a Skellam share of variance 2.199e\+12 is past what is drawn in"):
        discrete.skellam(np.random.default_rng(0), 2.0 ** 41, 3)


def test_impossible_noise_parameters_are_one_line_errors():
    with pytest.raises(DPFLError, match="integer in"):
        discrete.discrete_gaussian(np.random.default_rng(0), 2.5, 3)
    with pytest.raises(DPFLError, match="integer in"):
        discrete.discrete_gaussian(np.random.default_rng(0), 2 ** 31, 3)
    with pytest.raises(DPFLError, match="positive"):
        discrete.skellam(np.random.default_rng(0), 0.0, 3)


# -- RDP ---------------------------------------------------------------------------------------------
def test_one_discrete_gaussian_has_the_gaussian_rdp():
    # a single share: tau = 0, and Prop. 14's first term is the Gaussian's a D^2 / (2 s2)
    for order in (2, 7, 64):
        assert rdp.ddgauss_rdp(order, l1=30.0, l2=5.0, local_variance=100.0, shares=1, dim=1000) == \
            pytest.approx(order * 25.0 / 200.0)


def test_the_sum_of_discrete_gaussians_costs_a_little_more_than_one_of_the_total_variance():
    # 10 shares of variance 4: tau = 10 sum exp(-8 pi^2 k/(k+1)) is tiny but positive
    tau = rdp.ddgauss_tau(4.0, 10)
    assert 0 < tau < 1e-15
    assert rdp.ddgauss_rdp(5, 10.0, 4.0, 4.0, 10, 100) >= 5 * 16.0 / (2 * 40.0)
    # with variance 0.05 per share the sum is far from a discrete Gaussian: the bound grows
    assert rdp.ddgauss_rdp(5, 10.0, 4.0, 0.05, 10, 100) > 10 * 5 * 16.0 / (2 * 0.5)


def test_skellam_rdp_tends_to_the_gaussian_one_as_the_variance_grows():
    for mu in (1e2, 1e4, 1e6):
        gauss = 8 * 10.0 ** 2 / (2 * mu)
        cost = rdp.skellam_rdp(8, l1=300.0, l2=10.0, variance=mu)
        assert cost > gauss
        if mu >= 1e4:
            assert cost / gauss < 1.01


def test_poisson_subsampling_bound_covers_dp_accountings_sampled_gaussian_and_stays_near_it():
    q, z = 0.01, 1.0
    acc = RdpAccountant(orders=list(rdp.ORDERS))
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)))
    exact = np.array(acc._rdp)  # noqa: SLF001 - the accountant's own curve, per order
    bound = rdp.rdp_curve(lambda a: a / (2 * z * z), rate=q)
    assert np.all(bound >= exact * (1 - 1e-9))
    # and it is an amplification: far below the unsampled Gaussian at the orders that matter
    assert bound[rdp.ORDERS.index(8)] < 0.05 * 8 / 2
    # over 1,000 rounds: at least dp_accounting's epsilon, and within 30% of it
    many = RdpAccountant(orders=list(rdp.ORDERS))
    many.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), 1000))
    eps_bound, eps_exact = rdp.epsilon(bound * 1000, 1e-5), many.get_epsilon(1e-5)
    assert eps_exact * (1 - 1e-9) <= eps_bound < 1.3 * eps_exact, (eps_bound, eps_exact)


@pytest.mark.parametrize("q, z", [(0.01, 1.0), (0.1, 1.0), (0.05, 0.7)])
def test_without_the_generic_factor_3_the_bound_is_dp_accountings_exact_sampled_gaussian(q, z):
    # docs/distributed_dp.md: the integer mechanisms' premium under Poisson sampling is all Thm. 5's
    # factor 3; the exact form Zhu & Wang prove for the Gaussian is dp_accounting's curve
    acc = RdpAccountant(orders=list(rdp.ORDERS))
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)))
    exact = np.array(acc._rdp)  # noqa: SLF001 - the accountant's own curve, per order
    tight = rdp.rdp_curve(lambda a: a / (2 * z * z), rate=q,
                          bound=lambda a, g, f: rdp.poisson_subsampled_rdp(a, g, f, generic=False))
    np.testing.assert_allclose(tight, exact, rtol=1e-9)
    generic = rdp.rdp_curve(lambda a: a / (2 * z * z), rate=q)
    assert np.all(generic >= tight) and np.any(generic > tight * 1.01)


def test_epsilon_is_dp_accountings_conversion():
    z = 2.0
    acc = RdpAccountant(orders=list(rdp.ORDERS))
    acc.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(z), 50))
    curve = 50 * rdp.rdp_curve(lambda a: a / (2 * z * z))
    assert rdp.epsilon(curve, 1e-6) == pytest.approx(acc.get_epsilon(1e-6), rel=1e-12)


def test_rounding_inflates_the_sensitivity_by_at_most_sqrt_dim():
    assert rdp.rounded_l2_bound(100.0, 400) == pytest.approx(120.0)
    conditional = rdp.rounded_l2_bound(100.0, 400, beta=math.exp(-0.5))
    assert 100.0 < conditional < 120.0
    assert rdp.rounded_l1_bound(3.0, 100) == 9.0 and rdp.rounded_l1_bound(30.0, 100) == 300.0


# -- the ring pipeline -------------------------------------------------------------------------------
def test_the_rotation_is_orthonormal_and_undone():
    rng = np.random.default_rng(0)
    x = rng.normal(size=300)
    signs = ring.rotation_signs(b"round-7", 300)
    y = ring.rotate(x, signs)
    assert y.shape == (512,) and np.linalg.norm(y) == pytest.approx(np.linalg.norm(x))
    np.testing.assert_allclose(ring.unrotate(y, signs, 300), x, atol=1e-12)
    # a spike is spread evenly: every coordinate 1/sqrt(512) of it
    spike = ring.rotate(np.eye(300)[4] * 512.0, signs)
    np.testing.assert_allclose(np.abs(spike), np.full(512, 512.0 / math.sqrt(512)))


def test_conditional_rounding_is_unbiased_and_respects_its_bound():
    rng = np.random.default_rng(1)
    x = np.full(1000, 0.3)
    mean = np.mean([ring.conditional_round(x, rng).mean() for _ in range(200)])
    assert mean == pytest.approx(0.3, abs=0.01)
    bound = rdp.rounded_l2_bound(float(np.linalg.norm(x)), 1000, beta=math.exp(-0.5))
    assert all(np.linalg.norm(ring.conditional_round(x, rng, bound)) <= bound for _ in range(20))
    with pytest.raises(EncodingError, match="no rounding within"):
        ring.conditional_round(x, rng, bound=1.0, max_tries=5)


@pytest.mark.parametrize("bits", [12, 16, 20])
def test_the_ring_sum_decodes_to_the_integer_sum_when_nothing_wraps(bits):
    rng = np.random.default_rng(bits)
    dim, clients = 200, 8
    signs = ring.rotation_signs(b"seed", dim)
    updates = [rng.normal(size=dim) * 0.05 for _ in range(clients)]
    scale = 2.0 ** (bits - 8)
    shares = [ring.conditional_round(ring.rotate(u * scale, signs), rng)
              + discrete.discrete_gaussian(rng, 4, signs.size) for u in updates]
    total = ring.from_ring(ring.ring_sum([ring.to_ring(s, bits) for s in shares], bits), bits)
    np.testing.assert_array_equal(total, np.sum(shares, axis=0))  # exact: no wrap at these sizes
    decoded = ring.unrotate(total.astype(float), signs, dim) / scale
    noise_bound = 6 * math.sqrt(clients * (4 + 0.25)) / scale
    assert np.max(np.abs(decoded - np.sum(updates, axis=0))) < noise_bound


def test_a_sum_past_the_ring_wraps_and_the_bound_says_so():
    bits = 8
    shares = [np.full(4, 100, dtype=np.int64)] * 2  # 200 > 127: every coordinate wraps
    total = ring.from_ring(ring.ring_sum([ring.to_ring(s, bits) for s in shares], bits), bits)
    np.testing.assert_array_equal(total, np.full(4, 200 - 256))
    assert ring.wrap_probability(bits, 4, signal_l2=400.0, shares=2) == 1.0
    # 20 bits, 100 shares of variance 100^2 and a signal of norm 1e5 over 2^15 coordinates: negligible
    small = ring.wrap_probability(20, 2 ** 15, signal_l2=1e5, shares=100, dg_variance=1e4)
    assert small < 1e-6
    assert ring.wrap_probability(20, 2 ** 15, signal_l2=1e5, shares=100, skellam_variance=1e4) < 1e-6
    # a wider noise makes a wrap more likely, never less
    assert ring.wrap_probability(14, 2 ** 15, 1e4, 100, dg_variance=100.0) <= \
        ring.wrap_probability(14, 2 ** 15, 1e4, 100, dg_variance=400.0)


def test_bad_ring_parameters_are_one_line_errors():
    with pytest.raises(EncodingError, match="bits must be"):
        ring.to_ring(np.zeros(3, dtype=np.int64), 64)
    with pytest.raises(EncodingError, match="power-of-two"):
        ring.hadamard(np.zeros(3))


# -- the ledger ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("accountant", ["rdp", "rdp-classic"])
def test_the_ledger_books_a_sampled_discrete_sum_and_reads_it_back(accountant):
    from dpfl_ray.privacy.ledger import PrivacyLedger
    from dpfl_ray.privacy.sampling import PoissonSampling

    event = rdp.DiscreteNoiseSumDpEvent("skellam", l1=4000.0, l2=180.0, variance=1.6e5, shares=50, dim=2 ** 14)
    ledger = PrivacyLedger(accountant=accountant, delta=1e-5)
    for t in range(1, 101):
        ledger.record_round(1.0, PoissonSampling(0.01), reason="baek", round=t, mechanism=event)
    eps = ledger.epsilon()
    # Where it stands against the continuous Gaussian of the same variance and sensitivity
    # (z = sqrt(1.6e5) / 180 = 2.22): the Skellam's own RDP is the Gaussian's within 1e-5 here, but
    # its amplification by sampling is Zhu & Wang's generic bound, not dp_accounting's exact one for
    # the sampled Gaussian; that bound applied to the Gaussian itself gives the same epsilon, about
    # 40% above the exact one at q = 0.01 and 100 rounds.
    z = math.sqrt(1.6e5) / 180.0
    gauss = PrivacyLedger(accountant=accountant, delta=1e-5)
    for t in range(1, 101):
        gauss.record_round(z, PoissonSampling(0.01), reason="baek", round=t)
    assert eps > gauss.epsilon()
    generic = rdp.epsilon(100 * rdp.rdp_curve(lambda a: a / (2 * z * z), rate=0.01), 1e-5)
    if accountant == "rdp":
        assert eps == pytest.approx(generic, rel=1e-3), (eps, generic)
    # the claim books the continuous z = 1 the scenario named
    assert ledger.claimed_epsilon() > eps
    again = PrivacyLedger.from_dict(ledger.to_dict())
    assert again.epsilon() == eps and again.rounds[0].mechanism == event


@pytest.mark.parametrize("sigma", [0.8, 1.0, 2.0, 5.0])
@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.1, 0.5])
def test_the_fixed_size_bound_covers_dp_accountings_fixed_size_gaussian(sigma, ratio):
    """Wang et al.'s Thm. 9 with the Gaussian's RDP plugged in: dp_accounting takes, term by term, the
    smaller of that theorem's term and its Thm. 27 term for the Gaussian, so the generic bound is
    never below dp_accounting's (unless capped by the mechanism's own RDP, which no subsampling
    exceeds), equals it where the Thm. 9 terms are the smaller ones (sigma <= 1 here), and is
    never above the unsampled RDP."""
    from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

    orders = [2, 3, 4, 8, 16, 32, 64]
    own = [a / (2 * sigma ** 2) for a in orders]
    mine = [rdp.wor_subsampled_rdp(a, ratio, lambda o: o / (2 * sigma ** 2)) for a in orders]
    ref = rdp_lib._compute_rdp_sample_wor_gaussian(ratio, sigma, orders)
    for m, r, o in zip(mine, ref, own):
        assert min(r, o) * (1 - 1e-12) <= m <= o
        if sigma <= 1.0:
            assert m == pytest.approx(min(r, o), rel=1e-9)
    # order 2 by hand: log(1 + g^2 min(4 (e^eps2 - 1), 2 e^eps2))
    e2 = 1 / sigma ** 2
    assert mine[0] == pytest.approx(min(math.log1p(ratio ** 2 * min(4 * math.expm1(e2), 2 * math.exp(e2))), e2),
                                    rel=1e-12)
    assert rdp.wor_subsampled_rdp(8, 1.0, lambda o: o / (2 * sigma ** 2)) == own[3]


def test_a_fixed_size_cohort_books_a_discrete_sum_as_its_gaussian_and_refuses_the_other_relation():
    """A fixed-size cohort (m of n, replace-one): the Skellam sum of the Gaussian's variance and
    sensitivity books, through Wang et al.'s bound, the epsilon dp_accounting gives the fixed-size
    Gaussian: to 1e-4 at z = 1 (1.48254 against 1.48253), where the generic bound's terms are the
    ones dp_accounting takes; at z = 2.22 dp_accounting's tighter Thm. 27 terms for the Gaussian
    win (0.4325 against 0.3797). Under Poisson's add/remove relation it is refused."""
    from dpfl_ray.privacy.ledger import PrivacyLedger
    from dpfl_ray.privacy.sampling import FixedSizeSampling

    for variance, near in ((180.0 ** 2, True), (1.6e5, False)):
        event = rdp.DiscreteNoiseSumDpEvent("skellam", l1=4000.0, l2=180.0, variance=variance, shares=50, dim=2 ** 14)
        ledger, gauss = PrivacyLedger(accountant="rdp", delta=1e-5), PrivacyLedger(accountant="rdp", delta=1e-5)
        z = math.sqrt(variance) / 180.0
        for t in range(1, 101):
            ledger.record_round(1.0, FixedSizeSampling(50, 5000), reason="baek", round=t, mechanism=event)
            gauss.record_round(z, FixedSizeSampling(50, 5000), reason="baek", round=t)
        assert ledger.neighboring_relation.name == "REPLACE_ONE"
        assert ledger.epsilon() >= gauss.epsilon()
        if near:
            assert ledger.epsilon() == pytest.approx(gauss.epsilon(), rel=1e-4), (ledger.epsilon(), gauss.epsilon())
        else:
            assert ledger.epsilon() < 1.2 * gauss.epsilon()
        again = PrivacyLedger.from_dict(ledger.to_dict())
        assert again.epsilon() == ledger.epsilon()
    sampled = dp_accounting.SampledWithoutReplacementDpEvent(5000, 50, event)
    with pytest.raises(DPFLError, match="replace-one relation only"):
        rdp.event_rdp_curve(sampled, rdp.ORDERS, dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    assert not rdp.event_rdp_curve(dp_accounting.SampledWithoutReplacementDpEvent(5000, 0, event), rdp.ORDERS,
                                   dp_accounting.NeighboringRelation.REPLACE_ONE).any()  # nobody sampled


def test_pld_refuses_a_discrete_sum_in_one_line():
    from dpfl_ray.privacy.ledger import PrivacyLedger
    from dpfl_ray.privacy.sampling import PoissonSampling

    event = rdp.DiscreteNoiseSumDpEvent("discrete_gaussian", 100.0, 10.0, 400.0, 10, 64)
    with pytest.raises(DPFLError, match="use accountant 'rdp' or 'rdp-classic'"):
        PrivacyLedger(accountant="pld").record_round(1.0, PoissonSampling(0.1), reason="x", mechanism=event)


# -- a round's ring plan, at Baek's CI setting (z = 1, C = 1, 50 shares, q = 0.01, 100 rounds) ------------
def _baek_epsilon(plan) -> float:
    return rdp.epsilon(100 * rdp.rdp_curve(plan.event.rdp, rate=0.01), 1e-5)


@pytest.mark.parametrize("mechanism", rdp.MECHANISMS)
def test_the_ring_plan_keeps_wraps_rare_and_costs_what_its_bits_allow(mechanism):
    plans = {b: rdp.plan_ring(mechanism, b, 50, 26010, 1.0, 2.0, 2.0) for b in (12, 16, 20)}
    assert all(p.wrap_probability <= 1e-4 for p in plans.values())
    assert plans[12].scale < plans[16].scale < plans[20].scale  # more bits, finer steps
    if mechanism == "discrete_gaussian":
        assert all(p.local_variance == int(p.local_variance) for p in plans.values())
    # at 20 bits the rounding is negligible: the round costs what Zhu & Wang's amplification of the
    # continuous Gaussian (z = 1) costs; at 12 bits the rounding inflates the sensitivity by 4%
    generic = rdp.epsilon(100 * rdp.rdp_curve(lambda a: a / 2.0, rate=0.01), 1e-5)
    assert _baek_epsilon(plans[20]) == pytest.approx(generic, rel=1e-3)
    assert _baek_epsilon(plans[12]) > 1.05 * generic


@pytest.mark.parametrize("mechanism", rdp.MECHANISMS)
def test_a_wide_ring_keeps_every_share_where_its_sampler_is_exact(mechanism):
    """At 28 and 32 bits the finest scale would ask for shares of variance up to 3e17 (Skellam's then
    drawn all even); the plan keeps the scale where a share's variance is 2^30, and its wrap bound
    far below the target. Below that width the plan is the finest scale, as before."""
    for bits in (24, 28, 32):
        for shares in (1, 8, 100):
            plan = rdp.plan_ring(mechanism, bits, shares, 26010, 0.5, 1.0, 1.0)
            assert 2 ** 29 < plan.local_variance <= discrete.MAX_SHARE_VARIANCE
            assert plan.wrap_probability < 1e-10
    assert rdp.plan_ring(mechanism, 20, 100, 26010, 0.5, 1.0, 1.0).wrap_probability == pytest.approx(1e-4, rel=1e-3)


def test_a_baek_round_in_a_32_bit_ring_draws_the_skellam_shares_it_books():
    """Baek's own round at 32 bits: each client's share has the booked variance and odd values half
    the time, so the released sum's lowest bit is not the noiseless sum's."""
    from dpfl_ray.algorithms.baek import Baek
    from dpfl_ray.privacy.randomness import DPRandomness
    from dpfl_ray.scenario import load_scenario

    root = Path(__file__).resolve().parents[2]
    sc = load_scenario(root / "scenarios" / "baek2021_ci_z1_drop30_skellam.yaml", ["secagg.bits=32"])
    baek = Baek(sc, np.ones(sc.data.num_clients), sc.privacy.noise_multiplier,
                randomness=DPRandomness.create("reproducible", 0))
    baek.bind_model(26010)
    assert baek.begin_round(0, list(range(8))) is None
    spec = baek.client_spec()
    shares = np.stack([spec.noise.integer_share(c, spec.ring) for c in range(8)])
    assert spec.ring.local_variance <= discrete.MAX_SHARE_VARIANCE
    assert abs(shares.astype(float).var() / spec.ring.local_variance - 1) < 0.02
    assert abs(np.mean(shares % 2 == 1) - 0.5) < 0.01
    assert 0.4 < np.mean(shares.sum(axis=0) % 2 == 1) < 0.6


def test_under_replace_one_the_plan_books_two_clients_rounded_vectors():
    """A fixed-size cohort's neighbour swaps one client for another, each vector rounded on its own:
    the sum moves by up to 2 B(C s), which exceeds B(2 C s) by the rounding's sqrt(d) term (at 12
    bits 11% more sensitivity here)."""
    from dpfl_ray.secagg.ring import padded_dim

    clip, beta = 0.5, math.exp(-0.5)
    add = rdp.plan_ring("skellam", 12, 100, 26010, clip, 2 * clip, 2 * clip)
    swap = rdp.plan_ring("skellam", 12, 100, 26010, clip, 2 * clip, 2 * clip, replace_one=True)
    assert swap.scale == add.scale and swap.event.variance == add.event.variance  # the same ring and noise
    one = rdp.rounded_l2_bound(clip * swap.scale, padded_dim(26010), beta)
    assert swap.event.l2 == 2 * one and add.event.l2 == rdp.rounded_l2_bound(2 * clip * add.scale, padded_dim(26010), beta)
    assert swap.event.l2 > 1.1 * add.event.l2
    assert swap.event.l1 >= 2 * one * min(math.sqrt(padded_dim(26010)), one)  # each of the two, at most


def test_a_ring_too_small_for_the_cohort_is_one_line_naming_bits():
    with pytest.raises(DPFLError, match="^bits: a 4-bit ring cannot hold"):
        rdp.plan_ring("skellam", 4, 500, 26010, 1.0, 2.0, 2.0)


def test_docs_distributed_dp_shows_what_its_script_prints(capsys):
    """Every line docs/experiments/distributed_dp_bits.py prints stands in docs/distributed_dp.md."""
    import importlib.util

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("bits", root / "docs" / "experiments" / "distributed_dp_bits.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main()
    doc = (root / "docs" / "distributed_dp.md").read_text()
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 16  # two references, the header, its rule, 12 rows
    for line in printed[:2]:  # the two continuous references, as the page words them
        assert f"epsilon {line.split('epsilon ')[1]}" in doc.replace("**", ""), line
    for line in printed[2:]:
        assert line in doc, line


def test_docs_distributed_dp_shows_the_dropout_table_its_script_prints(capsys):
    """Every line docs/experiments/distributed_dp_dropouts.py prints (Baek's calibrations and the
    layered mode with Skellam and discrete Gaussian shares against the Gaussian, at 10% and 30%
    dropout) stands in docs/distributed_dp.md. The layered mode's epsilon does not move with the
    dropout for the Gaussian and Skellam layers, which release exactly the cohort's total; the
    discrete Gaussian's equal draws carry a little more, so it books no more than Skellam's."""
    import importlib.util

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location(
        "dropouts", root / "docs" / "experiments" / "distributed_dp_dropouts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main()
    doc = (root / "docs" / "distributed_dp.md").read_text()
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 10  # the header, its rule, 2 dropout rates x 4 modes
    for line in printed:
        assert line in doc, line
    layered = [[float(cell) for cell in line.split("|")[3:9]] for line in printed if "| layered |" in line]
    assert len(layered) == 2
    for row in layered:  # Gaussian, Skellam, discrete Gaussian; the same against the server
        assert row[0] == layered[0][0] and row[1] == layered[0][1] and row[3] == layered[0][3] and row[4] == layered[0][4]
        assert row[2] <= row[1] and row[5] <= row[4]


def test_neighbouring_cohorts_through_the_whole_ring_pipeline_separate_no_more_than_booked():
    """Ten clients against the same ten less one (add/remove), each release the real pipeline:
    scale, rotate, round conditionally, a Skellam share each, mod 2^16, the sum, decode, rotate back.
    Along the removed client's update the two releases are Gaussian-like with separation
    C / (2Cz) = 0.5; the booked event allows l2 / sqrt(variance) = 1 / z (Baek's 2C). A pipeline
    that lost noise, or mis-scaled it, would separate them further (after tests/unit/test_distinguishing.py)."""
    from tests.unit.test_distinguishing import SEEDS, SLACK, separation

    dim, bits, z, clip = 200, 16, 1.0, 1.0
    g = np.random.default_rng(11)
    updates = [u / np.linalg.norm(u) * clip for u in g.normal(size=(10, dim))]
    plan = rdp.plan_ring("skellam", bits, 10, dim, clip, 2 * clip * z, 2 * clip)
    allowed = plan.event.l2 / math.sqrt(plan.event.variance)

    def release(clients, seed: int) -> float:
        rng = np.random.default_rng(seed)
        signs = ring.rotation_signs(seed.to_bytes(8, "big"), dim)
        bound = rdp.rounded_l2_bound(clip * plan.scale, signs.size, math.exp(-0.5))
        words = [ring.to_ring(ring.conditional_round(ring.rotate(u * plan.scale, signs), rng, bound)
                              + discrete.skellam(rng, plan.local_variance, signs.size), bits) for u in clients]
        total = ring.from_ring(ring.ring_sum(words, bits), bits).astype(float)
        return float(ring.unrotate(total, signs, dim) @ updates[0]) / plan.scale

    with_it = [release(updates, s) for s in range(SEEDS)]
    without = [release(updates[1:], s) for s in range(SEEDS, 2 * SEEDS)]
    mu_hat = separation(with_it, without)
    assert allowed == pytest.approx(1 / z, rel=1e-3)
    assert 0.25 < mu_hat <= allowed + SLACK, (mu_hat, allowed)  # 0.57 here (C / 2Cz = 0.5)


def test_bench_secagg_times_a_round_of_integer_noise_beside_the_gaussian():
    """`dpfl bench secagg --bits 16 --noise skellam`: the whole round (encode, secure sum in Z_2^16,
    decode) beside the continuous Gaussian at 32 bits, both carrying the planned noise; the integer
    round's masked input takes 16 bits a padded coordinate on the wire, the Gaussian's 32."""
    import json

    import typer
    from typer.testing import CliRunner

    from cli import bench

    root = typer.Typer()
    root.add_typer(bench.app, name="bench")
    res = CliRunner().invoke(root, ["bench", "secagg", "--clients", "12", "--dim", "300", "--bits", "16",
                                    "--noise", "skellam", "--dropout", "0.25", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    integer, gaussian = out["rows"]
    assert (integer["noise"], integer["bits"], gaussian["noise"], gaussian["bits"]) == ("skellam", 16, "gaussian", 32)
    assert out["padded_dim"] == 512 and integer["survivors"] == gaussian["survivors"] == 9
    assert gaussian["bytes_per_surviving_client"] - integer["bytes_per_surviving_client"] == 300 * 4 - 512 * 2
    planned = 2.0 * math.sqrt(9 / 12)  # 2Cz on the survivors' share of the sum
    for row in (integer, gaussian):
        assert row["noise_std_per_coordinate"] == pytest.approx(planned, rel=0.15), row
    for args, needle in ((["--bits", "64", "--noise", "skellam"], "--bits: integer noise needs a ring of 8-32 bits"),
                         (["--noise", "gauss"], "--noise: 'gauss' is not none"), (["--bits", "7"], "--bits: 7")):
        res = CliRunner().invoke(root, ["bench", "secagg", "--clients", "4", "--dim", "10", *args])
        assert res.exit_code == 2 and needle in res.output, res.output


def test_the_noise_floor_script_groups_os_runs_by_their_noise_and_bounds_the_difference_as_welch_does(tmp_path):
    """docs/experiments/distributed_dp_noise_floor.py, on hand-made run directories: grouped by each
    scenario.yaml's noise, the pairs within 0.02 counted, the difference from the Gaussian's mean and
    its 95% interval those of scipy's Welch t-test (marked where it lies inside +-0.02), for the final
    round, the last five and every round; a run without OS randomness is refused."""
    import importlib.util
    import json

    import yaml

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location(
        "floor", root / "docs" / "experiments" / "distributed_dp_noise_floor.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def run(name, noise, bits, acc, randomness="os"):
        d = tmp_path / name
        d.mkdir()
        (d / "scenario.yaml").write_text(yaml.safe_dump({"privacy": {"distributed_noise": noise, "randomness": randomness},
                                                         "secagg": {"bits": bits}}))
        (d / "summary.json").write_text(json.dumps({"final_accuracy": acc, "stop_reason": "completed"}))
        # rounds 1-6: the last five average to acc - 0.05, all six to acc - 0.055
        (d / "rounds.jsonl").write_text("".join(json.dumps({"round": t, "test_accuracy": acc - 0.05 + 0.01 * (t - 4)})
                                                + "\n" for t in range(1, 7)))
        return d

    def interval(a, b):
        low, high = stats.ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
        return f"{sum(a) / len(a) - sum(b) / len(b):+.3f} ({low:+.3f} to {high:+.3f})"

    gauss, skellam = [0.5, 0.6, 0.7, 0.613], [0.55, 0.65, 0.64]
    runs = [run(f"g{i}", "gaussian", 32, a) for i, a in enumerate(gauss)]
    runs += [run(f"s{i}", "skellam", 16, a) for i, a in enumerate(skellam)]
    lines = module.table(runs)
    assert lines[2] == ("| gaussian | 4 | 0.603 | 0.082 | 0.500 - 0.700 | 1 of 6 | - | 0.553 (0.082) | - "
                        "| 0.548 (0.082) | - |")  # 0.6, 0.613 within 0.02
    assert lines[3] == (f"| skellam, 16 bits | 3 | 0.613 | 0.055 | 0.550 - 0.650 | 1 of 3 | {interval(skellam, gauss)} "
                        f"| 0.563 (0.055) | {interval([a - 0.05 for a in skellam], [a - 0.05 for a in gauss])} "
                        f"| 0.558 (0.055) | {interval([a - 0.055 for a in skellam], [a - 0.055 for a in gauss])} |")
    assert "within" not in lines[3]
    close = module._versus([0.600, 0.604, 0.602, 0.601], [0.600, 0.603, 0.601, 0.602])
    assert close == f"{interval([0.600, 0.604, 0.602, 0.601], [0.600, 0.603, 0.601, 0.602])[:-1]}, within 0.02)"
    with pytest.raises(SystemExit, match="not a run with privacy.randomness: os"):
        module.table(runs + [run("fixed", "gaussian", 32, 0.6, randomness="reproducible")])
    broken = run("broken", "skellam", 16, 0.6)
    (broken / "rounds.jsonl").write_text('{"round": 1, "test_accuracy": 1.7}\n')  # runs.load's checks
    with pytest.raises(SystemExit, match=r"rounds.jsonl line 1: test_accuracy must be in \[0, 1\]"):
        module.table(runs + [broken])
