"""Per-client ledgers (no Ray): each client's epsilon is what dp_accounting gives for its events."""
import json
import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.rdp import RdpAccountant
from scipy import special

from dpfl_ray.errors import DPFLError
from dpfl_ray.privacy.client_ledgers import FU_EQ10_ORDERS, ClientLedgers, event_from_dict
from dpfl_ray.privacy.sampling import event_to_dict

G, P, L = dp_accounting.GaussianDpEvent, dp_accounting.PoissonSampledDpEvent, dp_accounting.LaplaceDpEvent


def random_events(g):
    """A mix of what the algorithms book: DP-SGD steps, Fu's two queries per lot, arg-max events."""
    pool = [P(0.01, G(1.1)), P(0.05, G(4.0)), dp_accounting.SelfComposedDpEvent(P(0.02, G(0.9)), 30),
            P(0.013, dp_accounting.ComposedDpEvent([G(6.0), G(6.0)])), L(12.5), G(40.0),
            dp_accounting.ZCDpEvent(0.004)]
    return [(pool[i], int(g.integers(1, 5))) for i in g.integers(0, len(pool), size=int(g.integers(1, 12)))]


def test_each_clients_epsilon_equals_a_direct_dp_accounting_computation():
    g = np.random.default_rng(0)
    led = ClientLedgers(1e-5, num_clients=30)
    booked = {c: random_events(g) for c in range(0, 30, 2)}  # odd clients book nothing
    for r in range(3):
        for c, evs in booked.items():
            for ev, n in evs:
                led.record(c, ev, n, round=r)
    for c in range(30):
        direct = RdpAccountant()
        for ev, n in booked.get(c, []):
            direct.compose(ev, 3 * n)  # three rounds of the same bookings
        assert led.epsilon(c) == pytest.approx(direct.get_epsilon(1e-5), rel=1e-9, abs=1e-12)
        assert led.epsilon(c, 1e-3) == pytest.approx(direct.get_epsilon(1e-3), rel=1e-9, abs=1e-12)
    assert led.epsilon(1) == 0.0 and led.rounds(2) == [0, 1, 2]


def test_summary_reports_max_median_min_over_all_clients():
    led = ClientLedgers(1e-5, num_clients=4)
    led.record(0, P(0.01, G(1.0)), 100)
    led.record(1, P(0.01, G(1.0)), 400)
    led.record(2, P(0.01, G(1.0)), 900)
    eps = [led.epsilon(c) for c in range(4)]
    s = led.summary()
    assert s["epsilon_max"] == eps[2] and s["epsilon_min"] == 0.0 and s["num_clients"] == 4
    assert s["epsilon_median"] == pytest.approx((eps[0] + eps[1]) / 2)
    assert list(led.epsilons().values()) == eps


def test_classic_conversion_is_fu_eq10_with_integer_orders():
    # Fu et al. 2022 eq. 10/14: RDP(a) = log(A_a)/(a-1), A_a = sum_k C(a,k)(1-q)^(a-k) q^k exp((k^2-k)/(2 s^2)),
    # summed over rounds, then eps = min_a RDP(a) + log(1/delta)/(a-1) over a in {2..64}.
    q, sigmas, delta = 0.013, [6.0, 5.5, 5.5, 5.0], 1e-5
    led = ClientLedgers(delta, orders=FU_EQ10_ORDERS, conversion="classic")
    for s in sigmas:
        led.record(0, P(q, G(s)))

    def log_a(a, s):
        k = np.arange(a + 1)
        terms = (special.gammaln(a + 1) - special.gammaln(k + 1) - special.gammaln(a - k + 1)
                 + (a - k) * math.log1p(-q) + k * math.log(q) + (k * k - k) / (2 * s * s))
        return special.logsumexp(terms)
    rdp = np.array([sum(log_a(a, s) for s in sigmas) / (a - 1) for a in range(2, 65)])
    np.testing.assert_allclose(led.rdp(0), rdp, rtol=1e-8)
    eq10 = min(rdp[i] + math.log(1 / delta) / (a - 1) for i, a in enumerate(range(2, 65)))
    assert led.epsilon(0) == pytest.approx(eq10, rel=1e-12)
    tight = ClientLedgers(delta)
    for s in sigmas:
        tight.record(0, P(q, G(s)))
    assert tight.epsilon(0) < led.epsilon(0)  # dp_accounting's conversion is tighter than eq. 10


def test_would_exceed_stops_a_client_exactly_at_its_budget():
    led = ClientLedgers(1e-5, num_clients=2)
    step = P(0.05, G(1.0))
    booked = 0
    while not led.would_exceed(0, step, budget=2.0):
        led.record(0, step)
        booked += 1
    assert led.epsilon(0) <= 2.0 < led.epsilon_after(0, step)
    direct = RdpAccountant()
    direct.compose(step, booked + 1)
    assert led.epsilon_after(0, step) == pytest.approx(direct.get_epsilon(1e-5), rel=1e-9)
    assert led.epsilon(1) == 0.0  # the question booked nothing


def test_many_clients_many_rounds_compute_each_distinct_event_once():
    led = ClientLedgers(1e-5, num_clients=1000)
    g = np.random.default_rng(1)
    sigmas = [1.0, 1.2, 1.5]
    for r in range(100):
        cohort = np.flatnonzero(g.random(1000) < 0.1)
        led.record_many(cohort, P(0.02, G(sigmas[r % 3])), 10, round=r)
    assert led.num_distinct_events == 3
    s = led.summary()
    assert 0 < s["epsilon_min"] <= s["epsilon_median"] <= s["epsilon_max"]
    busiest = max(range(1000), key=lambda c: len(led.rounds(c)))
    direct = RdpAccountant()
    for ev, n in led.events(busiest):
        direct.compose(ev, n)
    assert s["epsilon_max"] == pytest.approx(direct.get_epsilon(1e-5), rel=1e-9)


def test_two_ledgers_booking_one_event_compute_its_sampled_gaussian_curve_once(monkeypatch):
    """The runtime's ledgers and the algorithm's book the same events: dp_accounting computes a
    sampled Gaussian's curve once per process for both, and each holds the stock accountant's
    curve to the bit."""
    from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

    calls = []
    real = rdp_lib._compute_rdp_poisson_subsampled_gaussian
    monkeypatch.setattr(rdp_lib, "_compute_rdp_poisson_subsampled_gaussian",
                        lambda *args, **kw: calls.append((args, kw)) or real(*args, **kw))
    event = dp_accounting.SelfComposedDpEvent(P(0.0144, G(3.1734)), 2)  # a sigma no other test books
    first, second = ClientLedgers(1e-5, num_clients=2), ClientLedgers(1e-5, num_clients=2)
    first.record(0, event)
    second.record(1, event)
    assert len(calls) == 1
    direct = RdpAccountant()
    direct.compose(event)
    assert np.array_equal(first.rdp(0), direct.rdp) and np.array_equal(second.rdp(1), direct.rdp)


def test_round_trip_through_json_keeps_every_epsilon():
    g = np.random.default_rng(2)
    led = ClientLedgers(1e-4, num_clients=6)
    for c in range(5):
        for ev, n in random_events(g):
            led.record(c, ev, n, round=c)
    data = json.loads(json.dumps(led.to_dict()))
    back = ClientLedgers.from_dict(data)
    assert back.epsilons() == pytest.approx(led.epsilons(), rel=1e-12)
    assert back.rounds(3) == [3] and data["summary"]["num_clients"] == 6


def test_a_checkpointed_ledger_of_many_distinct_events_restores_its_sums_and_goes_on_to_the_bit():
    """Fu et al.'s sigma decays round by round: every round books a new event. A checkpoint's state
    keeps each client's summed curve, so a restored ledger computes no past curve and goes on
    exactly as the uninterrupted one; without the sums (an older state) every curve is recomputed."""
    def book(led, rounds):
        for r in rounds:
            sigma = 4.0 * 0.999 ** r
            led.record_many([0, 1, 2], P(0.0144, G(sigma)), round=r)
            led.record(1, P(0.0144, G(6 * sigma)), round=r)  # a second query on one client
    led = ClientLedgers(1e-5, num_clients=4, orders=FU_EQ10_ORDERS, conversion="classic")
    book(led, range(60))
    state = json.loads(json.dumps(led.to_dict(include_epsilon=False)))  # as a checkpoint keeps it
    assert sorted(state["rdp"]) == ["0", "1", "2"] and len(state["rdp"]["1"]) == len(FU_EQ10_ORDERS)
    back = ClientLedgers.from_dict(state)
    assert len(back._curves) == 0 and back.num_distinct_events == led.num_distinct_events == 120
    assert back.epsilons() == led.epsilons() and back.to_dict() == led.to_dict()
    book(led, range(60, 70)), book(back, range(60, 70))  # both go on: the same bits
    assert back.epsilons() == led.epsilons() and back.rounds(1) == list(range(70))

    older = {k: v for k, v in state.items() if k != "rdp"}  # recomputed, event by event
    assert ClientLedgers.from_dict(older).epsilons() == pytest.approx(ClientLedgers.from_dict(state).epsilons(),
                                                                       rel=1e-12)
    few = ClientLedgers(1e-5, num_clients=1000)  # fewer events than clients: nothing extra is kept
    few.record_many(range(1000), P(0.01, G(1.0)), 5)
    assert "rdp" not in few.to_dict(include_epsilon=False) and "rdp" not in led.to_dict()
    state["rdp"]["1"] = state["rdp"]["1"][:-1]
    with pytest.raises(DPFLError, match="client 1's saved RDP curve"):
        ClientLedgers.from_dict(state)


def test_events_round_trip_through_dicts():
    ev = dp_accounting.SelfComposedDpEvent(P(0.1, dp_accounting.ComposedDpEvent([G(1.0), G(2.0)])), 7)
    assert event_from_dict(json.loads(json.dumps(event_to_dict(ev)))) == ev
    with pytest.raises(DPFLError, match="unknown"):
        event_from_dict({"type": "NotAnEvent"})


def test_non_private_and_unsupported_events():
    led = ClientLedgers(1e-5, num_clients=2)
    led.record(0, dp_accounting.NonPrivateDpEvent())
    assert math.isinf(led.epsilon(0)) and led.summary()["epsilon_max"] is None
    with pytest.raises(DPFLError, match="add/remove-one-record"):
        led.record(1, dp_accounting.SampledWithoutReplacementDpEvent(100, 10, G(1.0)))
    with pytest.raises(DPFLError, match="client"):
        led.record(2, G(1.0))
    with pytest.raises(DPFLError, match="count"):
        led.record(1, G(1.0), -1)
