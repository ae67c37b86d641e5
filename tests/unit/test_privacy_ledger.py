"""PrivacyLedger against direct dp_accounting calls."""
import itertools
import json
import math

import dp_accounting as dpa
import numpy as np
import pytest
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant

from dpfl_ray.errors import DPFLError
from dpfl_ray.privacy import ledger as ledger_mod
from dpfl_ray.privacy.ledger import (
    CLASSIC_RDP_ORDERS,
    FixedSizeSampling,
    PoissonSampling,
    PrivacyLedger,
)

DELTA = 1e-5
MIXED = [(1.0, 0.01), (1.3, 0.05), (0.8, 0.01), (1.0, 0.01), (2.0, 0.1), (1.0, 0.01)]


def _poisson(z, q):
    return dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z))


def _classic_epsilon(rdp, delta):
    orders = np.array(CLASSIC_RDP_ORDERS)
    return float(np.min(rdp + math.log(1 / delta) / (orders - 1)))


def _direct(accountant, events, relation=dpa.NeighboringRelation.ADD_OR_REMOVE_ONE, delta=DELTA):
    if accountant == "pld":
        acc = PLDAccountant(relation, value_discretization_interval=1e-4)
    elif accountant == "rdp":
        acc = RdpAccountant(neighboring_relation=relation)
    else:
        acc = RdpAccountant(orders=CLASSIC_RDP_ORDERS, neighboring_relation=relation)
    for ev, group in itertools.groupby(events):
        acc.compose(ev, len(list(group)))
    if accountant == "rdp-classic":
        return _classic_epsilon(acc.rdp, delta)
    return acc.get_epsilon(delta)


@pytest.mark.parametrize("accountant", ["pld", "rdp", "rdp-classic"])
def test_heterogeneous_poisson_rounds_match_dp_accounting(accountant):
    # pld builds a distribution per distinct (z, q) -- ~0.4 s each -- so it gets a shorter mix
    rounds = [(1.0, 0.01), (1.3, 0.05), (1.0, 0.01), (1.0, 0.01)] if accountant == "pld" else MIXED
    led = PrivacyLedger(accountant, DELTA)
    for z, q in rounds:
        led.record_round(z, q, reason="fedavg")
    expected = _direct(accountant, [_poisson(z, q) for z, q in rounds])
    assert led.epsilon() == pytest.approx(expected, rel=1e-9)
    assert led.fully_covered and led.uncovered_rounds == []
    assert led.neighboring_relation is dpa.NeighboringRelation.ADD_OR_REMOVE_ONE


def test_history_matches_prefixes_and_is_monotone():
    led = PrivacyLedger("rdp", DELTA)
    for z, q in MIXED:
        led.record_round(z, q, reason="r")
    hist = led.history()
    assert len(hist) == len(MIXED)
    for i in range(len(MIXED)):
        assert hist[i] == pytest.approx(_direct("rdp", [_poisson(z, q) for z, q in MIXED[: i + 1]]), rel=1e-9)
    assert hist == sorted(hist)
    assert hist[-1] == pytest.approx(led.epsilon(), rel=1e-12)
    other = led.history(1e-3)
    assert other[-1] == pytest.approx(led.epsilon(1e-3), rel=1e-12)
    assert all(o < h for o, h in zip(other, hist))


def test_history_is_incremental(monkeypatch):
    calls = []
    real = dpa.PrivacyAccountant.compose

    def counting(self, event, count=1):
        calls.append(count)
        return real(self, event, count)

    monkeypatch.setattr(dpa.PrivacyAccountant, "compose", counting)
    led = PrivacyLedger("rdp-classic", DELTA)
    n = 40
    for i in range(n):
        led.record_round(1.0 + 0.01 * i, 0.01, reason="r")
        led.epsilon()  # a run that logs epsilon every round
    assert len(calls) == n
    hist = led.history()  # already built while the rounds came in
    assert len(calls) == n and len(hist) == n
    led.record_round(1.0, 0.01, reason="r")
    assert len(led.history()) == n + 1
    assert len(calls) == n + 1


def test_fixed_size_rounds_under_rdp_match_dp_accounting():
    rounds = [(1.0, 10, 1000), (1.2, 20, 1000), (0.9, 10, 1000)]
    for accountant in ("rdp", "rdp-classic"):
        led = PrivacyLedger(accountant, DELTA)
        for z, m, k in rounds:
            led.record_round(z, FixedSizeSampling(m, k), reason="cohort")
        events = [dpa.SampledWithoutReplacementDpEvent(k, m, dpa.GaussianDpEvent(z)) for z, m, k in rounds]
        expected = _direct(accountant, events, dpa.NeighboringRelation.REPLACE_ONE)
        assert led.epsilon() == pytest.approx(expected, rel=1e-9)
        assert led.neighboring_relation is dpa.NeighboringRelation.REPLACE_ONE


def test_pld_refuses_fixed_size_with_accountant_field():
    led = PrivacyLedger("pld", DELTA)
    with pytest.raises(DPFLError) as err:
        led.record_round(1.0, FixedSizeSampling(10, 100), reason="cohort")
    assert err.value.field == "accountant"
    assert "\n" not in str(err.value) and str(err.value).startswith("accountant: ")
    assert len(led) == 0


def test_mixing_neighbouring_relations_is_refused():
    led = PrivacyLedger("rdp", DELTA)
    led.record_round(1.0, 0.01, reason="poisson")
    with pytest.raises(DPFLError) as err:
        led.record_round(1.0, FixedSizeSampling(10, 100), reason="cohort")
    assert err.value.field == "sampling"
    assert len(led) == 1


def test_no_release_rounds_are_noops():
    led = PrivacyLedger("rdp", DELTA)
    led.record_round(1.0, 0.01, reason="r")
    led.record_no_release("no client survived")
    led.record_round(None, 0.01, reason="noise multiplier unavailable")
    led.record_round(1.0, None, reason="nobody sampled")
    assert len(led) == 4
    assert all(isinstance(r.accounted_event, dpa.NoOpDpEvent) for r in led.rounds[1:])
    assert not any(r.released for r in led.rounds[1:])
    assert led.epsilon() == pytest.approx(_direct("rdp", [_poisson(1.0, 0.01)]), rel=1e-12)
    hist = led.history()
    assert hist[1:] == [hist[0]] * 3
    assert [r.round for r in led.rounds] == [1, 2, 3, 4]
    empty = PrivacyLedger("rdp-classic", DELTA)
    empty.record_no_release("skipped")
    assert empty.epsilon() == 0.0 and empty.delta_for_epsilon(1.0) == 0.0


def test_uncovered_flag_on_a_round_without_release_is_ignored():
    led = PrivacyLedger("rdp", DELTA)
    led.record_round(1.0, 0.01, reason="r")
    led.record_round(None, 0.01, reason="everyone dropped", covered=False)
    assert led.fully_covered and led.rounds[1].covered
    assert math.isfinite(led.epsilon())


def test_fixed_size_cohort_of_zero_is_a_noop():
    led = PrivacyLedger("rdp", DELTA)
    led.record_round(1.0, FixedSizeSampling(0, 100), reason="nobody sampled")
    assert isinstance(led.rounds[0].event, dpa.NoOpDpEvent)
    assert led.epsilon() == 0.0


@pytest.mark.parametrize("accountant", ["rdp", "rdp-classic"])
def test_adaptive_clipping_round_composes_two_gaussians_under_one_sampling(accountant):
    led = PrivacyLedger(accountant, DELTA)
    led.record_round([1.0, 5], 0.01, reason="update + noised clipped count")  # int on purpose
    led.record_round(1.0, 0.01, reason="plain")
    composed = dpa.PoissonSampledDpEvent(0.01, dpa.ComposedDpEvent([dpa.GaussianDpEvent(1.0), dpa.GaussianDpEvent(5.0)]))
    assert led.rounds[0].event == composed
    expected = _direct(accountant, [composed, _poisson(1.0, 0.01)])
    assert led.epsilon() == pytest.approx(expected, rel=1e-9)
    # the count's Gaussian costs something: strictly more than the update alone
    assert led.epsilon() > _direct(accountant, [_poisson(1.0, 0.01)] * 2)


def test_adaptive_clipping_round_under_pld_uses_the_equivalent_gaussian():
    led = PrivacyLedger("pld", DELTA)
    led.record_round([1.0, 5.0], 0.01, reason="update + count")
    z_eq = (1.0 ** -2 + 5.0 ** -2) ** -0.5
    acc = led.rounds[0].accounted_event
    assert isinstance(acc, dpa.PoissonSampledDpEvent) and acc.event.noise_multiplier == pytest.approx(z_eq, rel=1e-12)
    assert led.epsilon() == pytest.approx(_direct("pld", [_poisson(z_eq, 0.01)]), rel=1e-9)
    # and dp_accounting's own RDP accountant agrees that the two descriptions are the same mechanism
    rdp_composed = RdpAccountant().compose(led.rounds[0].event).get_epsilon(DELTA)
    assert rdp_composed == pytest.approx(RdpAccountant().compose(_poisson(z_eq, 0.01)).get_epsilon(DELTA), rel=1e-9)


def test_claimed_versus_effective():
    led = PrivacyLedger("rdp", DELTA)
    for _ in range(3):
        # the paper claims z=1.0, but dropouts left 0.8 of it
        led.record_round(0.8, 0.01, reason="dropouts", claimed_noise_multiplier=1.0)
    led.record_round(1.0, 0.01, reason="no dropouts")
    assert led.epsilon() == pytest.approx(_direct("rdp", [_poisson(0.8, 0.01)] * 3 + [_poisson(1.0, 0.01)]), rel=1e-9)
    assert led.claimed_epsilon() == pytest.approx(_direct("rdp", [_poisson(1.0, 0.01)] * 4), rel=1e-9)
    assert led.claimed_epsilon() < led.epsilon()
    with pytest.raises(DPFLError) as err:
        led.record_round([1.0, 2.0], 0.01, reason="x", claimed_noise_multiplier=1.0)
    assert err.value.field == "claimed_noise_multiplier"


@pytest.mark.parametrize("accountant", ["pld", "rdp-classic"])
def test_uncovered_rounds(accountant):
    led = PrivacyLedger(accountant, DELTA)
    led.record_round(1.0, 0.01, reason="fixed clipping")
    led.record_round(1.0, 0.01, reason="median-norm clipping (Geyer et al.)", covered=False)
    led.record_round(1.0, 0.01, reason="fixed clipping")
    assert not led.fully_covered
    assert led.uncovered_rounds == [2]
    assert isinstance(led.rounds[1].accounted_event, dpa.NonPrivateDpEvent)
    assert led.rounds[1].event == _poisson(1.0, 0.01)
    assert led.epsilon() == math.inf
    assert led.delta_for_epsilon(5.0) == 1.0
    covered = _direct(accountant, [_poisson(1.0, 0.01)] * 2)
    assert led.epsilon(covered_only=True) == pytest.approx(covered, rel=1e-9)
    assert led.claimed_epsilon() == pytest.approx(_direct(accountant, [_poisson(1.0, 0.01)] * 3), rel=1e-9)
    hist = led.history()
    assert math.isfinite(hist[0]) and hist[1] == math.inf and hist[2] == math.inf
    assert "not covered" in led.summary()
    d = led.to_dict()
    json.dumps(d, allow_nan=False)
    assert d["epsilon"] is None and d["fully_covered"] is False and d["uncovered_rounds"] == [2]
    assert d["epsilon_covered_rounds"] == pytest.approx(covered, rel=1e-9)


def test_delta_for_epsilon_is_consistent():
    for accountant in ("pld", "rdp", "rdp-classic"):
        led = PrivacyLedger(accountant, DELTA)
        for z, q in MIXED[:3]:
            led.record_round(z, q, reason="r")
        eps = led.epsilon()
        assert led.delta_for_epsilon(eps) == pytest.approx(DELTA, rel=1e-4)
        assert led.delta_for_epsilon(eps * 1.5) < DELTA < led.delta_for_epsilon(eps * 0.7)
        assert led.epsilon(1e-3) < eps < led.epsilon(1e-7)


def test_to_dict_is_json_and_round_trips():
    led = PrivacyLedger("rdp", DELTA)
    led.record_round(1.0, 0.01, reason="a", claimed_noise_multiplier=1.2)
    led.record_round([1.0, 3.0], PoissonSampling(0.02), reason="adaptive clipping")
    led.record_no_release("skip")
    text = json.dumps(led.to_dict(), allow_nan=False)
    data = json.loads(text)
    assert data["accountant"] == "rdp" and data["delta"] == DELTA and data["num_rounds"] == 3
    assert data["accountant_details"]["orders"][0] == pytest.approx(1.1)
    assert data["rounds"][1]["event"]["type"] == "PoissonSampledDpEvent"
    assert [e["noise_multiplier"] for e in data["rounds"][1]["event"]["event"]["events"]] == [1.0, 3.0]
    assert data["rounds"][2]["event"]["type"] == "NoOpDpEvent"
    assert data["rounds"][0]["reason"] == "a" and data["rounds"][0]["claimed_noise_multipliers"] == [1.2]
    assert data["epsilon"] == pytest.approx(led.epsilon(), rel=1e-12)
    again = PrivacyLedger.from_dict(data)
    assert again.epsilon() == pytest.approx(led.epsilon(), rel=1e-12)
    assert again.claimed_epsilon() == pytest.approx(led.claimed_epsilon(), rel=1e-12)
    assert [r.round for r in again.rounds] == [1, 2, 3]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"noise_multiplier": 0.0}, "noise_multiplier"),
        ({"noise_multiplier": -1.0}, "noise_multiplier"),
        ({"noise_multiplier": float("nan")}, "noise_multiplier"),
        ({"sampling": 0.0}, "sampling_rate"),
        ({"sampling": 1.5}, "sampling_rate"),
        ({"reason": None}, "reason"),
        ({"covered": "yes"}, "covered"),
        ({"round": -1}, "round"),
        ({"claimed_noise_multiplier": 0}, "claimed_noise_multiplier"),
    ],
)
def test_record_round_validation(kwargs, field):
    led = PrivacyLedger("rdp", DELTA)
    args = {"noise_multiplier": 1.0, "sampling": 0.01, "reason": "r"} | kwargs
    z, s = args.pop("noise_multiplier"), args.pop("sampling")
    with pytest.raises(DPFLError) as err:
        led.record_round(z, s, **args)
    assert err.value.field == field
    assert str(err.value).startswith(f"{field}: ")
    assert len(led) == 0


@pytest.mark.parametrize(
    "kwargs, field",
    [({"accountant": "moments"}, "accountant"), ({"delta": 0.0}, "delta"), ({"delta": 1.0}, "delta")],
)
def test_ledger_construction_validation(kwargs, field):
    with pytest.raises(DPFLError) as err:
        PrivacyLedger(**kwargs)
    assert err.value.field == field


def test_ledger_query_validation():
    led = PrivacyLedger("rdp", DELTA)
    led.record_round(1.0, 0.01, reason="r")
    with pytest.raises(DPFLError) as err:
        led.epsilon(2.0)
    assert err.value.field == "delta"
    with pytest.raises(DPFLError) as err:
        led.delta_for_epsilon(0.0)
    assert err.value.field == "epsilon"


def test_classic_orders_are_tf_privacy_2019():
    assert CLASSIC_RDP_ORDERS[:3] == (1.1, 1.2, 1.3)
    assert CLASSIC_RDP_ORDERS[98] == pytest.approx(10.9)
    assert CLASSIC_RDP_ORDERS[99:] == tuple(range(12, 64))
    assert ledger_mod.PLD_VALUE_DISCRETIZATION_INTERVAL == 1e-4


def _live_rounds(ledger, schedule, first_round):
    """Record each (z, q) and ask both epsilons after it, as the runtime does every round."""
    out = []
    for i, (z, q) in enumerate(schedule):
        ledger.record_round(z, PoissonSampling(q), reason="r", claimed_noise_multiplier=1.5 * z,
                            round=first_round + i)
        out.append((ledger.epsilon(), ledger.claimed_epsilon(), ledger.delta_for_epsilon(1.0)))
    return out


@pytest.mark.parametrize("accountant, schedule", [
    ("pld", MIXED),  # dense distributions on the usual grid
    ("pld", [(40.0, 0.001)] * 3 + [(30.0, 0.002)] * 2),  # sparse ones: a few hundred losses each
    ("pld", [(0.1, 0.2)] * 2),  # a coarse grid (1e-3), answered with rdp beside it
    ("rdp", MIXED),
    ("rdp-classic", MIXED),
])
def test_a_ledger_restored_with_its_accountants_goes_on_to_the_bit_without_composing_again(accountant, schedule,
                                                                                          monkeypatch):
    """A checkpoint keeps each accountant as it stands (tracks_state): the ledger rebuilt from it
    composes none of the past rounds, and every later round answers with the uninterrupted
    ledger's floats."""
    live = PrivacyLedger(accountant=accountant, delta=DELTA)
    _live_rounds(live, schedule, 1)
    metas, arrays = live.tracks_state()
    # as a checkpoint holds them: JSON, and arrays through an .npz
    saved, metas = json.loads(json.dumps(live.to_dict(include_epsilon=False))), json.loads(json.dumps(metas))
    restored = PrivacyLedger.from_dict(saved)
    restored.restore_tracks(metas, {k: np.array(v) for k, v in arrays.items()})
    assert [(m["kind"], m["n"]) for m in metas] == [("effective", len(schedule)), ("claimed", len(schedule))]

    def no_composition(*_):
        raise AssertionError("a restored accountant composed a past round again")

    with monkeypatch.context() as m:
        m.setattr(dpa.PrivacyAccountant, "compose", no_composition)
        assert restored.epsilon() == live.epsilon() and restored.claimed_epsilon() == live.claimed_epsilon()
    more = schedule[::-1]
    assert _live_rounds(restored, more, len(schedule) + 1) == _live_rounds(live, more, len(schedule) + 1)
    assert restored.history() == live.history()
    assert restored.to_dict() == live.to_dict()


def test_saved_accountants_that_cover_rounds_the_ledger_does_not_hold_are_refused():
    live = PrivacyLedger(accountant="rdp", delta=DELTA)
    _live_rounds(live, MIXED, 1)
    metas, arrays = live.tracks_state()
    short = PrivacyLedger.from_dict({**live.to_dict(include_epsilon=False), "rounds": live.to_dict()["rounds"][:3]})
    with pytest.raises(DPFLError, match="^checkpoint: a saved accountant covers 6 rounds"):
        short.restore_tracks(metas, arrays)
