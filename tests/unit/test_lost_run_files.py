"""The files of a run whose coordinator was lost before its first checkpoint (``finish`` with no
committed state), without Ray: the rows stay, and a private run's summary keeps what was spent."""
import json

from dpfl_ray.data import build_federation
from dpfl_ray.runs.record import RunRecord
from dpfl_ray.runtime.driver import finish
from tests.helpers import tiny_scenario


def _lost(tmp_path, sc, rows):
    record = RunRecord(tmp_path / "run")
    for row in rows:
        record.add_round(row)
    summary = finish(sc, build_federation(sc), record, None, "error", "the coordinator was lost", 1.0)
    return summary, json.loads((tmp_path / "run" / "summary.json").read_text())


def test_a_private_run_lost_before_any_checkpoint_keeps_the_last_committed_epsilon(tmp_path):
    sc = tiny_scenario(training={"algorithm": "dp_fedavg"}, privacy={"noise_multiplier": 1.0, "accountant": "rdp"},
                       output={"checkpoint_every": 0})
    rows = [{"round": r, "sampled": 10, "survived": 10, "test_accuracy": 0.5, "test_loss": 1.0,
             "epsilon": 0.4 * r, "epsilon_claimed": 0.3 * r} for r in (1, 2)]
    summary, on_disk = _lost(tmp_path, sc, rows)
    assert summary == on_disk
    assert (on_disk["rounds_completed"], on_disk["stop_reason"]) == (2, "error")
    assert (on_disk["epsilon"], on_disk["epsilon_claimed"], on_disk["delta"]) == (0.8, 0.6, sc.privacy.delta)
    assert on_disk["ledger"].startswith("unavailable") and on_disk["model"].startswith("unavailable")
    assert not (tmp_path / "run" / "ledger.json").exists() and not (tmp_path / "run" / "model.pt").exists()
    assert len((tmp_path / "run" / "rounds.jsonl").read_text().splitlines()) == 2


def test_a_non_private_run_lost_so_has_no_epsilon(tmp_path):
    rows = [{"round": 1, "sampled": 10, "survived": 10, "test_accuracy": 0.5, "test_loss": 1.0}]
    _, on_disk = _lost(tmp_path, tiny_scenario(), rows)
    assert "epsilon" not in on_disk and "ledger" not in on_disk and on_disk["rounds_completed"] == 1
