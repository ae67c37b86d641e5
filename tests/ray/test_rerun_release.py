"""On a real local Ray: a run that starts where an earlier attempt released rounds (the digests a
resume keeps in released_rounds.json) releases them again when they come out alike, and stops
before releasing one that would not -- under central noise (no SecAgg) and under Baek's
calibration through SecAgg. The earlier release is a real run's rows; "would not" is that run's
digest of one part changed, which is what a worker that really crashed in one attempt alone
leaves (docs/sensitivity.md)."""
import json

import pytest

from dpfl_ray.data import build_federation
from dpfl_ray.errors import DPFLError
from dpfl_ray.runs.record import RELEASED, RunRecord, keep_released
from dpfl_ray.runtime.driver import run_scenario
from tests.helpers import tiny_scenario


def _rows(path):
    return [json.loads(line) for line in (path / "rounds.jsonl").read_text().splitlines()]


def _figures(rows):
    return [{k: v for k, v in r.items() if not k.endswith("seconds")} for r in rows]


def _again(sc, path, first_rows, change: dict | None = None):
    """A run in ``path`` after an attempt that released ``first_rows``; ``change``: round -> part
    whose digest that attempt had otherwise."""
    path.mkdir()
    keep_released(path, first_rows)
    if change:
        kept = json.loads((path / RELEASED).read_text())
        for r, part in change.items():
            kept[str(r)][part] = "0" * 32
        (path / RELEASED).write_text(json.dumps(kept))
    return run_scenario(sc, build_federation(sc), RunRecord(path))


def test_central_noise_releases_a_round_again_only_with_the_same_model_and_survivors(ray_session, tmp_path):
    def scenario():
        return tiny_scenario(training={"algorithm": "dp_fedavg", "rounds": 4},
                             sampling={"mode": "poisson", "rate": 0.4, "clients_per_round": None},
                             privacy={"noise_multiplier": 1.0, "accountant": "rdp", "clipping": {"norm": 0.5}})

    first = run_scenario(scenario(), build_federation(scenario()), RunRecord(tmp_path / "first"))
    rows = _rows(tmp_path / "first")
    assert first["stop_reason"] == "completed" and all(set(r["release_check"]) == {"model", "survivors"} for r in rows)

    # the same releases: the run goes through, row for row the first one's
    alike = _again(scenario(), tmp_path / "alike", rows)
    assert alike["stop_reason"] == "completed" and _figures(_rows(tmp_path / "alike")) == _figures(rows)
    assert "released_before_resume" not in alike

    with pytest.raises(DPFLError, match=r"run failed after 2 rounds .*round 3 ran again after a resume with other "
                                        r"surviving clients .*nothing was released.*dpfl run --resume "):
        _again(scenario(), tmp_path / "survivors", rows, {3: "survivors"})
    summary = json.loads((tmp_path / "survivors" / "summary.json").read_text())
    assert summary["stop_reason"] == "error" and summary["rounds_completed"] == 2
    assert _figures(_rows(tmp_path / "survivors")) == _figures(rows[:2])  # round 3 released nothing
    # what the server saw before and this run has not released again is in the summary, with its epsilon
    assert summary["released_before_resume"]["rounds"] == [3, 4]
    assert summary["released_before_resume"]["epsilon"] == rows[3]["epsilon"] > summary["epsilon"]

    with pytest.raises(DPFLError, match=r"run failed after 1 rounds .*round 2 ran again after a resume with another "
                                        r"model"):
        _again(scenario(), tmp_path / "model", rows, {2: "model"})


def test_baek_calibration_is_summed_again_only_from_the_same_clients(ray_session, tmp_path):
    def scenario():
        # 40 clients, 10 sampled, 3 drop before uploading, 2 of the 7 survivors before calibrating
        return tiny_scenario(data={"num_clients": 40}, training={"algorithm": "baek", "rounds": 2},
                             sampling={"mode": "fixed", "clients_per_round": 10},
                             privacy={"noise_multiplier": 1.0, "clipping": {"norm": 0.5}, "accountant": "rdp",
                                      "calibration": "baek"},
                             secagg={"enabled": True, "threshold": "majority"},
                             faults={"dropout": [{"model": "tail", "rate": 0.3, "phase": "upload"},
                                                 {"model": "tail", "rate": 0.3, "phase": "calibration"}]})

    run_scenario(scenario(), build_federation(scenario()), RunRecord(tmp_path / "first"))
    rows = _rows(tmp_path / "first")
    assert all(set(r["release_check"]) == {"model", "survivors", "calibration"} for r in rows)
    assert all(r["dropped_by_phase"].get("calibration") for r in rows)
    with pytest.raises(DPFLError, match=r"run failed after 1 rounds .*round 2 ran again after a resume with other "
                                        r"clients' calibration terms"):
        _again(scenario(), tmp_path / "calibration", rows, {2: "calibration"})
    assert _figures(_rows(tmp_path / "calibration")) == _figures(rows[:1])
