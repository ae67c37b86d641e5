"""Private runs end to end on a real local Ray: the run's epsilon is the ledger's, budgets stop a
run before the round that would break them, and SecAgg does not change DP-FedAvg's model."""
import json

import numpy as np
import pytest
import torch

from dpfl_ray.data import build_federation
from dpfl_ray.privacy import FixedSizeSampling, delta_for, epsilon_for, rounds_within_budget
from dpfl_ray.runs.record import RunRecord
from dpfl_ray.runtime.driver import run_scenario
from tests.helpers import TWO_WORKERS, tiny_scenario

DP = {"algorithm": "dp_fedavg", "rounds": 6}
POISSON = {"mode": "poisson", "rate": 0.5, "clients_per_round": None}


def _run(sc, path):
    summary = run_scenario(sc, build_federation(sc), RunRecord(path))
    rounds = [json.loads(line) for line in (path / "rounds.jsonl").read_text().splitlines()]
    return summary, rounds


def test_reported_epsilon_is_what_the_accountant_gives(ray_session, tmp_path):
    sc = tiny_scenario(training=DP, sampling=POISSON,
                       privacy={"noise_multiplier": 1.5, "clipping": {"norm": 0.5}, "accountant": "pld"})
    summary, rounds = _run(sc, tmp_path / "dp")
    for r in rounds:
        assert abs(r["epsilon"] - epsilon_for(1.5, 0.5, r["round"], 1e-5, "pld")) < 1e-6
        assert 0 < r["account_seconds"] < r["seconds"]  # the ledger's share of the round, for dpfl bench
    assert summary["epsilon"] == rounds[-1]["epsilon"] and summary["stop_reason"] == "completed"
    ledger = json.loads((tmp_path / "dp" / "ledger.json").read_text())
    assert ledger["accountant"] == "pld" and len(ledger["rounds"]) == 6 and ledger["fully_covered"]
    assert summary["accountant_used"] == ledger["accountant_used"] == "pld"
    assert (tmp_path / "dp" / "privacy.png").read_bytes()[:4] == b"\x89PNG"


def test_budget_stops_before_the_round_that_would_exceed_it(ray_session, tmp_path):
    target = 3.0
    sc = tiny_scenario(training={**DP, "rounds": 50}, sampling=POISSON,
                       privacy={"noise_multiplier": 1.5, "target_epsilon": target, "accountant": "rdp"})
    summary, rounds = _run(sc, tmp_path / "budget")
    allowed = rounds_within_budget(1.5, 0.5, target, 1e-5, "rdp")
    assert summary["stop_reason"] == "privacy_budget_exhausted"
    assert len(rounds) == allowed < 50
    assert rounds[-1]["epsilon"] <= target < epsilon_for(1.5, 0.5, allowed + 1, 1e-5, "rdp")


def test_geyer_rule_with_median_clipping(ray_session, tmp_path):
    # fixed-size cohorts are replace-one: sensitivity 2S, so z = 2 is booked as 1.0
    sc = tiny_scenario(training={**DP, "rounds": 40}, sampling={"mode": "fixed", "clients_per_round": 10},
                       privacy={"noise_multiplier": 2.0, "clipping": {"mode": "median"}, "accountant": "rdp",
                                "denominator": "actual", "geyer": {"epsilon": 4.0, "delta_threshold": 1e-3}})
    summary, rounds = _run(sc, tmp_path / "geyer")
    sampling = FixedSizeSampling(10, 20)
    assert summary["stop_reason"] == "privacy_budget_exhausted"
    t = len(rounds)
    assert delta_for(1.0, sampling, t, 4.0, "rdp") <= 1e-3 < delta_for(1.0, sampling, t + 1, 4.0, "rdp")
    # the median of the clients' norms is not private: the ledger refuses to call it covered
    assert all(r["epsilon"] is None and r["dp_covered"] is False for r in rounds)
    assert summary["dp_covered"] is False and summary["epsilon_nominal"] > 0


def test_noise_is_calibrated_to_the_target_when_not_given(ray_session, tmp_path):
    sc = tiny_scenario(training={**DP, "rounds": 4}, sampling=POISSON,
                       privacy={"target_epsilon": 5.0, "accountant": "rdp"})
    summary, rounds = _run(sc, tmp_path / "calibrated")
    assert summary["stop_reason"] == "completed" and len(rounds) == 4
    assert rounds[-1]["epsilon"] <= 5.0 < epsilon_for(summary["noise_multiplier"] - 1e-3, 0.5, 4, 1e-5, "rdp")


def test_dp_fedavg_same_model_with_and_without_secagg(ray_session, tmp_path):
    common = dict(training=DP, sampling=POISSON,
                  privacy={"noise_multiplier": 1.0, "clipping": {"mode": "adaptive", "norm": 0.3}, "accountant": "pld"},
                  faults={"dropout": {"model": "tail", "rate": 0.2, "phase": "upload"}}, resources=TWO_WORKERS)
    _, plain = _run(tiny_scenario(**common), tmp_path / "plain")
    _, secure = _run(tiny_scenario(secagg={"enabled": True, "scale": 2.0 ** 40}, **common), tmp_path / "sa")
    assert [r["survived"] for r in plain] == [r["survived"] for r in secure]
    for a, b in zip(plain, secure):
        assert abs(a["clip_norm"] - b["clip_norm"]) < 1e-9 and a["epsilon"] == b["epsilon"]
    m1, m2 = (torch.load(tmp_path / d / "model.pt") for d in ("plain", "sa"))
    diff = max(float((m1[k] - m2[k]).abs().max()) for k in m1)
    assert diff < 1e-5
    assert np.isclose(plain[-1]["test_accuracy"], secure[-1]["test_accuracy"])


def test_fixed_size_run_is_booked_at_half_of_z(ray_session, tmp_path):
    """Issue #9: fixed-size cohorts are replace-one, so the run books z/2 -- checked against a
    direct dp_accounting computation, not against the ledger's own helpers."""
    import dp_accounting
    from dp_accounting import NeighboringRelation
    from dp_accounting.rdp import RdpAccountant

    sc = tiny_scenario(training={**DP, "rounds": 4}, sampling={"mode": "fixed", "clients_per_round": 5},
                       privacy={"noise_multiplier": 1.0, "clipping": {"norm": 0.5}, "accountant": "rdp"})
    summary, rounds = _run(sc, tmp_path / "fixed")
    event = dp_accounting.SampledWithoutReplacementDpEvent(20, 5, dp_accounting.GaussianDpEvent(0.5))
    for r in rounds:
        direct = RdpAccountant(neighboring_relation=NeighboringRelation.REPLACE_ONE).compose(event, r["round"])
        assert r["epsilon"] == pytest.approx(direct.get_epsilon(1e-5), rel=1e-9)
    ledger = json.loads((tmp_path / "fixed" / "ledger.json").read_text())
    assert summary["noise_multiplier"] == 1.0 and summary["noise_multiplier_booked"] == [0.5]
    assert all(r["noise_multipliers"] == [0.5] for r in ledger["rounds"])
    # central DP: the server sees every clipped update before it adds the noise
    assert summary["epsilon_vs_server"] is None and "central" in summary["epsilon_vs_server_note"]
    assert summary["randomness"] == "reproducible"


def test_os_randomness_is_recorded_and_not_repeatable(ray_session, tmp_path):
    common = dict(training={**DP, "rounds": 2}, sampling=POISSON,
                  privacy={"noise_multiplier": 1.0, "clipping": {"norm": 0.5}, "accountant": "rdp",
                           "randomness": "os"})
    first, _ = _run(tiny_scenario(**common), tmp_path / "a")
    _run(tiny_scenario(**common), tmp_path / "b")
    assert first["randomness"] == "os"
    a, b = (torch.load(tmp_path / d / "model.pt") for d in ("a", "b"))
    assert any(not torch.equal(a[k], b[k]) for k in a)
