"""epsilon_for / delta_for / calibrate_noise_multiplier / rounds_within_budget."""
import math

import dp_accounting as dpa
import pytest
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant

from dpfl_ray.errors import DPFLError
from dpfl_ray.privacy import (
    EpsilonCurve,
    FixedSizeSampling,
    PoissonSampling,
    calibrate_noise_multiplier,
    delta_for,
    effective_noise_multiplier,
    epsilon_for,
    rounds_within_budget,
)

DELTA = 1e-5


def test_baek_table2_figure_and_accountant_order():
    classic = epsilon_for(1.0, 0.01, 100, DELTA, accountant="rdp-classic")
    assert round(classic, 2) == 1.61
    assert classic == pytest.approx(1.6118, abs=1e-4)
    rdp = epsilon_for(1.0, 0.01, 100, DELTA, accountant="rdp")
    pld = epsilon_for(1.0, 0.01, 100, DELTA)  # pld is the default
    assert pld < rdp < classic


def test_epsilon_for_matches_dp_accounting():
    ev = dpa.PoissonSampledDpEvent(0.02, dpa.GaussianDpEvent(1.1))
    assert epsilon_for(1.1, 0.02, 250, DELTA, "rdp") == pytest.approx(
        RdpAccountant().compose(ev, 250).get_epsilon(DELTA), rel=1e-12)
    assert epsilon_for(1.1, PoissonSampling(0.02), 250, DELTA, "pld") == pytest.approx(
        PLDAccountant(value_discretization_interval=1e-4).compose(ev, 250).get_epsilon(DELTA), rel=1e-9)
    wor = dpa.SampledWithoutReplacementDpEvent(500, 25, dpa.GaussianDpEvent(1.1))
    rel = dpa.NeighboringRelation.REPLACE_ONE
    assert epsilon_for(1.1, FixedSizeSampling(25, 500), 50, DELTA, "rdp") == pytest.approx(
        RdpAccountant(neighboring_relation=rel).compose(wor, 50).get_epsilon(DELTA), rel=1e-12)


def test_fixed_size_under_pld_is_refused():
    with pytest.raises(DPFLError) as err:
        epsilon_for(1.0, FixedSizeSampling(10, 100), 10, DELTA, "pld")
    assert err.value.field == "accountant"


@pytest.mark.parametrize("accountant", ["rdp", "rdp-classic"])
def test_dropout_rate_effect(accountant):
    z, q, T = 1.0, 0.01, 300
    eps = [epsilon_for(z, q, T, DELTA, accountant, dropout_rate=r) for r in (0.0, 0.1, 0.3, 0.5)]
    assert eps == sorted(eps) and len(set(eps)) == 4
    for r in (0.1, 0.3, 0.5):
        assert epsilon_for(z, q, T, DELTA, accountant, dropout_rate=r) == pytest.approx(
            epsilon_for(z * math.sqrt(1 - r), q, T, DELTA, accountant), rel=1e-12)
    assert effective_noise_multiplier(2.0, 0.19) == pytest.approx(1.8)


def test_dropout_rate_effect_pld():
    a = epsilon_for(1.0, 0.01, 50, DELTA, "pld", dropout_rate=0.2)
    b = epsilon_for(1.0 * math.sqrt(0.8), 0.01, 50, DELTA, "pld")
    assert a == pytest.approx(b, rel=1e-12)
    assert a > epsilon_for(1.0, 0.01, 50, DELTA, "pld")


@pytest.mark.parametrize("accountant", ["pld", "rdp", "rdp-classic"])
def test_delta_for_is_consistent_with_epsilon_for(accountant):
    eps = epsilon_for(1.0, 0.01, 100, DELTA, accountant)
    assert delta_for(1.0, 0.01, 100, eps, accountant) == pytest.approx(DELTA, rel=1e-4)
    assert delta_for(1.0, 0.01, 100, eps * 1.2, accountant) < DELTA


@pytest.mark.parametrize("accountant, target", [("rdp-classic", 2.0), ("rdp", 1.0), ("pld", 2.0)])
def test_calibration_is_tight_and_never_exceeds(accountant, target):
    q, T = 0.01, 100
    z = calibrate_noise_multiplier(target, DELTA, q, T, accountant)
    assert epsilon_for(z, q, T, DELTA, accountant) <= target
    assert epsilon_for(z - 1e-3, q, T, DELTA, accountant) > target


def test_calibration_fixed_size_under_rdp():
    s = FixedSizeSampling(20, 1000)
    z = calibrate_noise_multiplier(3.0, DELTA, s, 200, "rdp")
    assert epsilon_for(z, s, 200, DELTA, "rdp") <= 3.0 < epsilon_for(z - 1e-3, s, 200, DELTA, "rdp")


@pytest.mark.parametrize("accountant", ["rdp", "rdp-classic"])
def test_rounds_within_budget(accountant):
    for r in (0.0, 0.3):
        for budget in (2.0, 4.0):
            T = rounds_within_budget(1.0, 0.01, budget, DELTA, accountant, dropout_rate=r)
            assert T >= 1
            assert epsilon_for(1.0, 0.01, T, DELTA, accountant, r) <= budget
            assert epsilon_for(1.0, 0.01, T + 1, DELTA, accountant, r) > budget


def test_rounds_within_budget_edges():
    # one round of z=0.5, q=1 already costs more than 0.1
    assert rounds_within_budget(0.5, 1.0, 0.1, DELTA, "rdp") == 0
    # a huge budget is capped
    assert rounds_within_budget(50.0, 0.001, 50.0, DELTA, "rdp", max_rounds=1000) == 1000
    curve = EpsilonCurve(1.0, 0.01, DELTA, "rdp-classic")
    assert curve.max_rounds(2.0) == rounds_within_budget(1.0, 0.01, 2.0, DELTA, "rdp-classic")


@pytest.mark.parametrize(
    "call, field",
    [
        (lambda: epsilon_for(1.0, 0.0, 10, DELTA), "sampling_rate"),
        (lambda: epsilon_for(1.0, 1.01, 10, DELTA), "sampling_rate"),
        (lambda: epsilon_for(0.0, 0.01, 10, DELTA), "noise_multiplier"),
        (lambda: epsilon_for(-2.0, 0.01, 10, DELTA), "noise_multiplier"),
        (lambda: epsilon_for(1.0, 0.01, 0, DELTA), "rounds"),
        (lambda: epsilon_for(1.0, 0.01, 2.5, DELTA), "rounds"),
        (lambda: epsilon_for(1.0, 0.01, 10, 0.0), "delta"),
        (lambda: epsilon_for(1.0, 0.01, 10, 1.0), "delta"),
        (lambda: epsilon_for(1.0, 0.01, 10, DELTA, accountant="gdp"), "accountant"),
        (lambda: epsilon_for(1.0, 0.01, 10, DELTA, dropout_rate=1.0), "dropout_rate"),
        (lambda: epsilon_for(1.0, 0.01, 10, DELTA, dropout_rate=-0.1), "dropout_rate"),
        (lambda: epsilon_for(1.0, FixedSizeSampling(11, 10), 10, DELTA, "rdp"), "clients_per_round"),
        (lambda: FixedSizeSampling(1, 0), "num_clients"),
        (lambda: delta_for(1.0, 0.01, 10, 0.0), "epsilon"),
        (lambda: delta_for(1.0, 0.01, 10, -1.0), "epsilon"),
        (lambda: calibrate_noise_multiplier(0.0, DELTA, 0.01, 10), "epsilon"),
        (lambda: calibrate_noise_multiplier(1.0, 2.0, 0.01, 10), "delta"),
        (lambda: calibrate_noise_multiplier(1.0, DELTA, 0.01, 0), "rounds"),
        (lambda: calibrate_noise_multiplier(1.0, DELTA, 1.5, 10), "sampling_rate"),
        (lambda: calibrate_noise_multiplier(1.0, DELTA, 0.01, 10, "nope"), "accountant"),
        (lambda: rounds_within_budget(1.0, 0.01, 0.0, DELTA), "budget"),
    ],
)
def test_bad_parameters_raise_dpflerror_with_field(call, field):
    with pytest.raises(DPFLError) as err:
        call()
    assert err.value.field == field
    assert str(err.value).startswith(f"{field}: ")
    assert isinstance(err.value, ValueError)


@pytest.mark.parametrize("relation", [dpa.NeighboringRelation.ADD_OR_REMOVE_ONE, dpa.NeighboringRelation.REPLACE_ONE])
def test_memoised_rdp_accountant_holds_the_stock_accountants_state_to_the_bit(relation):
    """The ledger's RDP accountants compute a distinct round's curve once; composing a run of rounds
    (repeats, changes of z, composite and no-op rounds, counts) leaves the same floats as
    dp_accounting's own RdpAccountant, and the same refusals."""
    from dpfl_ray.privacy.accountants import CLASSIC_RDP_ORDERS, _ClassicRdpAccountant, _MemoRdpAccountant

    def sampled(z):
        if relation is dpa.NeighboringRelation.REPLACE_ONE:
            return dpa.SampledWithoutReplacementDpEvent(400, 40, dpa.GaussianDpEvent(z))
        return dpa.PoissonSampledDpEvent(0.1, dpa.GaussianDpEvent(z))

    rounds = [(sampled(1.0), 1)] * 5 + [(sampled(0.7), 1), (dpa.NoOpDpEvent(), 1), (sampled(1.0), 3),
                                        (dpa.GaussianDpEvent(4.0), 1),
                                        (dpa.ComposedDpEvent([sampled(1.3), dpa.GaussianDpEvent(2.0)]), 2),
                                        (dpa.SelfComposedDpEvent(sampled(0.7), 4), 1)]
    for memo, stock in [(_MemoRdpAccountant(neighboring_relation=relation), RdpAccountant(neighboring_relation=relation)),
                        (_ClassicRdpAccountant(relation), RdpAccountant(list(CLASSIC_RDP_ORDERS), relation))]:
        for event, count in rounds:
            memo.compose(event, count)
            stock.compose(event, count)
            assert memo.rdp.tobytes() == stock.rdp.tobytes()
        if type(memo) is _MemoRdpAccountant:
            assert memo.get_epsilon(DELTA) == stock.get_epsilon(DELTA)
    wrong = (dpa.PoissonSampledDpEvent(0.1, dpa.GaussianDpEvent(1.0))
             if relation is dpa.NeighboringRelation.REPLACE_ONE
             else dpa.SampledWithoutReplacementDpEvent(400, 40, dpa.GaussianDpEvent(1.0)))
    assert not _MemoRdpAccountant(neighboring_relation=relation).supports(wrong)
    with pytest.raises(dpa.UnsupportedEventError):
        _MemoRdpAccountant(neighboring_relation=relation).compose(wrong)
