"""Bounded accounting (issue #16): every accountant call has a bounded cost; 'pld' moves to a coarser
grid, takes rdp's answer where that is smaller, or falls back to rdp -- and says which."""
import json
import subprocess
import sys
from pathlib import Path

import dp_accounting as dpa
import pytest
from dp_accounting import NeighboringRelation
from dp_accounting.pld import PLDAccountant
from dp_accounting.pld import privacy_loss_distribution as pld_lib

from dpfl_ray.errors import DPFLError
from dpfl_ray.privacy.bounded_pld import (
    PLD_MAX_COMPOSED_POINTS,
    PLD_MAX_POINTS,
    _regrid,
    _single_width,
    pld_grid,
)
from dpfl_ray.privacy.calibration import EpsilonCurve, calibrate_noise, check_accounting_feasible, epsilon_for
from dpfl_ray.privacy.ledger import PrivacyLedger
from dpfl_ray.privacy.sampling import FixedSizeSampling, PoissonSampling

DELTA = 1e-5
ADD_REMOVE = NeighboringRelation.ADD_OR_REMOVE_ONE


def test_the_usual_schedules_keep_the_1e4_grid_and_dp_accountings_numbers():
    assert pld_grid(1.0, 0.01, 100) == 1e-4
    assert pld_grid(1.0, 0.01, 100_000) == 1e-4
    assert pld_grid(0.5, 0.01, 1000) == 1e-4
    stock = PLDAccountant(value_discretization_interval=1e-4).compose(
        dpa.PoissonSampledDpEvent(0.02, dpa.GaussianDpEvent(1.1)), 250).get_epsilon(DELTA)
    curve = EpsilonCurve(1.1, 0.02, DELTA, "pld")
    assert curve.epsilon(250) == pytest.approx(stock, rel=1e-12)
    assert curve.accountant_used(250) == ("pld", "")


def test_grid_is_decided_from_the_parameters_and_fits_the_point_bounds():
    grid = pld_grid(0.01, 0.01, 100)
    assert grid is not None and grid > 1e-4
    assert _single_width(0.01, 0.01, ADD_REMOVE) / grid <= PLD_MAX_POINTS
    assert pld_grid(0.01, 0.01, 100, budget=0.1) > grid  # a smaller share of the bounds: coarser
    assert pld_grid(1e-4, 0.01, 100) is None  # one round alone is wider than any grid allows
    assert pld_grid(1.0, 0.01, 10**7) > 1e-4  # 10^7 rounds: the composition is what is too wide


def test_a_tiny_noise_multiplier_is_answered_within_a_few_hundred_mb():
    # in a fresh process, so its peak resident memory is this call's (unbounded it passed 3.6 GB)
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec from the forking (pytest) process
    code = ("import json, re; from dpfl_ray.privacy.calibration import EpsilonCurve\n"
            "c = EpsilonCurve(0.01, 0.01, 1e-5, 'pld'); eps = c.epsilon(100)\n"
            "hwm = int(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1))\n"
            "print(json.dumps([eps, *c.accountant_used(100), hwm]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2], check=True)
    eps, used, note, max_rss_kib = json.loads(out.stdout)
    assert max_rss_kib * 1024 < 500e6  # the interpreter, numpy and dp_accounting take ~110 MB of it
    assert used == "pld" and "grid" in note
    assert eps <= epsilon_for(0.01, 0.01, 100, DELTA, "rdp")  # still far tighter than rdp here


def test_no_grid_fits_falls_back_to_rdp_and_says_so():
    curve = EpsilonCurve(1e-4, 0.01, DELTA, "pld")
    assert curve.epsilon(100) == epsilon_for(1e-4, 0.01, 100, DELTA, "rdp")
    used, note = curve.accountant_used(100)
    assert used == "rdp" and "fell back to rdp" in note


def test_a_coarse_grid_never_answers_worse_than_rdp():
    # 10^7 rounds on the grid the bounds allow: pld's rounding adds up, rdp is smaller and answers
    pld = EpsilonCurve(20.6, 0.01, DELTA, "pld")
    rdp = epsilon_for(20.6, 0.01, 10**7, DELTA, "rdp")
    assert pld.epsilon(10**7) <= rdp
    assert pld.accountant_used(10**7)[0] in ("pld", "rdp")


def test_huge_round_counts_of_a_small_distribution_are_fast_to_compose():
    # dp_accounting's sparse self_compose evaluates size ** rounds as an exact integer (minutes for 10^7)
    eps = epsilon_for(0.1, 0.01, 10**7, DELTA, "pld")
    assert 0 < eps <= epsilon_for(0.1, 0.01, 10**7, DELTA, "rdp")


def test_regrid_rounds_losses_up_so_epsilon_stays_an_upper_bound():
    pld = pld_lib.from_gaussian_mechanism(1.0, value_discretization_interval=1e-4, sampling_prob=0.01)
    composed = pld.self_compose(100)
    coarse = _regrid(composed, 1e-3)
    fine_eps, coarse_eps = composed.get_epsilon_for_delta(DELTA), coarse.get_epsilon_for_delta(DELTA)
    assert fine_eps <= coarse_eps <= fine_eps + 1e-3
    assert coarse.get_delta_for_epsilon(fine_eps) >= composed.get_delta_for_epsilon(fine_eps)


def test_ledger_says_which_accountant_answered():
    usual = PrivacyLedger("pld", DELTA)
    for _ in range(3):
        usual.record_round(1.0, PoissonSampling(0.01), reason="dp_fedavg")
    data = usual.to_dict()
    assert data["accountant_used"] == "pld"
    assert data["accountant_details"]["value_discretization_interval"] == 1e-4

    tiny, rdp = PrivacyLedger("pld", DELTA), PrivacyLedger("rdp", DELTA)
    for ledger in (tiny, rdp):
        ledger.record_round(1.0, PoissonSampling(0.01), reason="dp_fedavg")
        ledger.record_round(1e-4, PoissonSampling(0.01), reason="dp_fedavg")  # pld cannot take this one
    data = tiny.to_dict()
    assert data["accountant"] == "pld" and data["accountant_used"] == "rdp"
    assert data["accountant_details"]["fallback_from"] == "pld" and data["accountant_details"]["note"]
    assert data["epsilon"] == pytest.approx(rdp.epsilon(), rel=1e-12)


def test_ledger_moves_to_a_coarser_grid_when_a_round_needs_it():
    ledger = PrivacyLedger("pld", DELTA)
    ledger.record_round(1.0, PoissonSampling(0.1), reason="dp_fedavg")
    before = ledger.epsilon()
    ledger.record_round(0.01, PoissonSampling(0.1), reason="dp_fedavg, a dropout-heavy round")
    after = ledger.epsilon()
    assert after > before
    details = ledger.to_dict()["accountant_details"]
    assert ledger.to_dict()["accountant_used"] == "pld" and details["value_discretization_interval"] > 1e-4


def test_check_accounting_feasible_decides_before_a_run():
    plan = check_accounting_feasible("pld", 1.0, PoissonSampling(0.1), 40, DELTA)
    assert (plan.accountant_used, plan.value_discretization_interval, plan.note) == ("pld", 1e-4, "")
    plan = check_accounting_feasible("pld", 0.01, PoissonSampling(0.1), 2, DELTA)
    assert plan.accountant_used == "pld" and plan.value_discretization_interval > 1e-4 and "grid" in plan.note
    plan = check_accounting_feasible("pld", 1e-4, 0.1, 2, DELTA)
    assert plan.fallback and plan.accountant_used == "rdp" and "rdp" in plan.note
    assert not check_accounting_feasible("rdp", 1e-4, 0.1, 2, DELTA).fallback
    with pytest.raises(DPFLError, match="accountant"):
        check_accounting_feasible("pld", 1.0, FixedSizeSampling(10, 100), 10, DELTA)
    with pytest.raises(DPFLError, match="delta"):
        check_accounting_feasible("pld", 1.0, 0.1, 10, 1.0)


def test_calibration_of_an_absurd_target_is_bounded_and_explained():
    cal = calibrate_noise(1e6, DELTA, 0.01, 100)
    assert cal.epsilon <= 1e6 and cal.accountant_used in ("pld", "rdp") and cal.note
    assert epsilon_for(cal.noise_multiplier, 0.01, 100, DELTA, "rdp") >= cal.epsilon


def test_point_bounds_are_a_few_hundred_mb():
    # complex128 FFT arrays of the composed length, a few at a time
    assert PLD_MAX_COMPOSED_POINTS * 16 * 6 < 400e6
    assert PLD_MAX_POINTS <= PLD_MAX_COMPOSED_POINTS


def test_pld_calibration_over_ten_million_rounds_takes_few_pld_accountants(monkeypatch):
    """`dpfl privacy noise --epsilon 1 --rounds 10000000` built 42 PLD accountants (13 s) searching
    z = 135 to an absolute 1e-5; the search now starts close to rdp's answer, to 1e-5 of it."""
    from dpfl_ray.privacy import calibration

    built = []
    real = calibration._fresh_accountant

    def counting(name, *args, **kwargs):
        built.append(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(calibration, "_fresh_accountant", counting)
    res = calibration.calibrate_noise(1.0, 1e-5, 0.01, 10_000_000, "pld")
    assert res.accountant_used == "pld" and res.epsilon <= 1.0
    assert built.count("pld") <= 20, built.count("pld")  # 42 before (and 16 rdp ones, then and now)
