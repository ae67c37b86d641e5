"""NbAFL (Wei et al. 2020) on a real local Ray, with and without secure aggregation: the same
noisy uploads give the same model, and the ledger books what dp_accounting gives for the view
the server has in each case: ``epsilon`` with the sensitivity the code enforces (2C), and
``epsilon_assumed`` with the paper's 2C/m beside it."""
import json

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting import NeighboringRelation as NR
from dp_accounting.rdp import RdpAccountant

from dpfl_ray.algorithms.nbafl import uplink_std
from dpfl_ray.data import build_federation
from dpfl_ray.runs.record import RunRecord
from dpfl_ray.runtime.driver import run_scenario
from tests.helpers import TWO_WORKERS, tiny_scenario


def _scenario(secagg: bool):
    # 20 clients of 24 examples each (480 training examples), all uploading every round: L = T = 3
    return tiny_scenario(training={"algorithm": "nbafl", "rounds": 3, "prox_mu": 0.01},
                         sampling={"mode": "fixed", "clients_per_round": 20},
                         privacy={"clipping": {"norm": 5.0}, "delta": 0.01, "accountant": "rdp",
                                  "nbafl": {"epsilon": 60}},
                         secagg={"enabled": secagg}, resources=TWO_WORKERS)


def _run(sc, path):
    summary = run_scenario(sc, build_federation(sc), RunRecord(path))
    return summary, json.loads((path / "ledger.json").read_text())


def test_nbafl_with_and_without_secagg(ray_session, tmp_path):
    plain, plain_ledger = _run(_scenario(False), tmp_path / "plain")
    secure, secure_ledger = _run(_scenario(True), tmp_path / "secure")
    assert plain["stop_reason"] == secure["stop_reason"] == "completed"
    a, b = (torch.load(tmp_path / d / "model.pt") for d in ("plain", "secure"))
    for k in a:  # the same noisy uploads, summed in the clear or securely (fixed point, 2^-40)
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-5)
    sigma_u = uplink_std(60, 0.01, 5.0, 24, 3)

    def direct(z):
        return RdpAccountant(neighboring_relation=NR.REPLACE_ONE).compose(
            dp_accounting.GaussianDpEvent(z), 3).get_epsilon(0.01)

    for ledger, summary, aggregated in ((plain_ledger, plain, 1.0), (secure_ledger, secure, 20 ** 0.5)):
        z, z_assumed = sigma_u / (2 * 5.0) * aggregated, sigma_u / (2 * 5.0 / 24) * aggregated
        assert ledger["rounds"][0]["noise_multipliers"] == pytest.approx([z])
        assert ledger["noise_multiplier_assumed"] == pytest.approx([z_assumed])
        for figures in (ledger, summary):  # summary.json carries the ledger's figures
            assert figures["epsilon"] == pytest.approx(direct(z), rel=1e-9)
            assert figures["epsilon_assumed"] == pytest.approx(direct(z_assumed), rel=1e-9)
            assert figures["epsilon_claimed"] == pytest.approx(60.0)
            assert "2C/m" in figures["assumption"]
        assert ledger["fully_covered"] and summary["dp_covered"]
        assert "outside its validity range" in ledger["rounds"][0]["claim_note"]  # epsilon / L = 20
    assert plain["nbafl_min_size"] == 24 and plain["nbafl_sensitivity"] == 10.0
    assert plain["nbafl_sensitivity_assumed"] == pytest.approx(10.0 / 24)
    assert secure["epsilon"] < plain["epsilon"]  # the server only sees the sum of 20 uploads
