"""Canary clients on a real local Ray (Andrew et al. 2024): they join the population, take part like
other clients, and the empirical epsilon they give never exceeds the ledger's."""
import json

import pytest

from dpfl_ray.data import build_federation
from dpfl_ray.runs.record import RunRecord
from dpfl_ray.runtime.driver import run_scenario
from dpfl_ray.scenario import scenario_from_dict

COMMON = {
    "seed": 4,
    "data": {"source": "mnist5k", "num_clients": 40, "partition": {"kind": "iid"}},
    "model": {"name": "logistic"},
    "resources": {"workers": 1, "num_cpus_per_worker": 0.5},
}


def _run(raw, path):
    sc = scenario_from_dict(raw)
    summary = run_scenario(sc, build_federation(sc), RunRecord(path))
    return summary, json.loads((path / "ledger.json").read_text())


@pytest.mark.parametrize("name,raw", [
    ("dp_fedavg", {"training": {"algorithm": "dp_fedavg", "rounds": 3, "lr": 0.1},
                   "sampling": {"mode": "poisson", "rate": 0.5, "clients_per_round": None},
                   "privacy": {"noise_multiplier": 0.8, "clipping": {"norm": 0.5}, "accountant": "rdp",
                               "audit": {"canaries": 60, "threat_model": "all_iterates"}}}),
    ("nbafl", {"training": {"algorithm": "nbafl", "rounds": 3, "lr": 0.05, "prox_mu": 0.01},
               "sampling": {"mode": "fixed", "clients_per_round": 100},
               "privacy": {"clipping": {"norm": 10.0}, "delta": 0.01, "accountant": "rdp",
                           "nbafl": {"epsilon": 60}, "audit": {"canaries": 60}}}),
    # Baek's calibration with Skellam shares in Z_2^20 (docs/distributed_dp.md): the server's view of
    # the first aggregate and the release, 30% of the real clients dropping before upload
    ("baek_skellam", {"training": {"algorithm": "baek", "rounds": 1, "lr": 0.1},
                      "sampling": {"mode": "poisson", "rate": 1.0, "clients_per_round": None},
                      "privacy": {"noise_multiplier": 1.0, "clipping": {"norm": 0.5}, "accountant": "rdp",
                                  "calibration": "baek", "distributed_noise": "skellam",
                                  "audit": {"canaries": 60, "threat_model": "server_view"}},
                      "secagg": {"enabled": True, "bits": 20, "threshold": "majority"},
                      "faults": {"dropout": {"model": "tail", "rate": 0.3, "phase": "upload"}}}),
])
def test_the_empirical_epsilon_never_exceeds_the_ledgers(ray_session, tmp_path, name, raw):
    summary, ledger = _run({**COMMON, "name": f"audit-{name}", **raw}, tmp_path / name)
    emp = summary["epsilon_empirical"]
    assert summary["stop_reason"] == "completed" and emp["k"] == 60 and emp["dim"] == 7850
    assert emp["low"] <= emp["epsilon"] <= emp["high"]
    assert emp["low"] <= summary["epsilon"], (emp, summary["epsilon"])
    assert ledger["epsilon_empirical"] == emp
    record = json.loads((tmp_path / name / "audit.json").read_text())
    assert record["canaries"] == 60 and set(record["statistics"]) == {"final_model", "all_iterates", "server_view"}
    rows = [json.loads(line) for line in (tmp_path / name / "rounds.jsonl").read_text().splitlines()]
    assert all(r["sampled"] >= 1 for r in rows)
