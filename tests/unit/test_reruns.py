"""A round run again after a resume releases the same values or nothing (privacy/reruns.py): the
digests, the guard's comparison, and the files that carry a cut-back row's digests to the resumed
run (runs/record.py, released_rounds.json; runs/sweep.py, move_aside)."""
import json

import numpy as np
import pytest

from dpfl_ray.errors import DPFLError
from dpfl_ray.privacy.reruns import RerunGuard, release_check
from dpfl_ray.runs.record import DP_SECRET, RELEASED, RunRecord, keep_released, released_rounds
from dpfl_ray.runs.sweep import move_aside

KEY = bytes(range(32))


def test_a_digest_tells_apart_every_part_round_key_and_bit_of_the_model():
    theta = np.linspace(-1, 1, 50, dtype=np.float32)
    base = release_check(KEY, 3, "model", theta)
    flipped = theta.copy()
    flipped.view(np.uint32)[7] ^= 1  # one bit of one weight
    assert release_check(KEY, 3, "model", theta.copy()) == base and len(base) == 32
    assert len({base, release_check(KEY, 4, "model", theta), release_check(bytes(32), 3, "model", theta),
                release_check(KEY, 3, "model", flipped)}) == 4
    ids = release_check(KEY, 3, "survivors", [5, 1, 9])
    assert release_check(KEY, 3, "survivors", (9, 5, 1)) == ids  # a set: order aside
    assert len({ids, release_check(KEY, 3, "calibration", [1, 5, 9]), release_check(KEY, 3, "survivors", [1, 5]),
                release_check(KEY, 3, "survivors", [1, 5, 9, 10])}) == 4
    with pytest.raises(ValueError, match="unknown release part"):
        release_check(KEY, 3, "noise", [1])


def test_the_guard_passes_a_round_released_alike_and_names_what_differs():
    theta = np.ones(4, dtype=np.float32)
    first = RerunGuard(KEY)
    first.begin(2)
    assert first.check("model", theta) is None and first.check("survivors", [1, 2, 3]) is None
    assert first.check("calibration", [1, 3]) is None
    before = {2: first.row()["release_check"]}
    assert set(before[2]) == {"model", "survivors", "calibration"}

    again = RerunGuard(KEY, before)
    again.begin(2)
    assert again.check("model", theta) is None and again.check("survivors", [3, 2, 1]) is None
    assert again.check("calibration", [3, 1]) is None
    again.begin(3)  # a round the server never saw released: nothing to compare
    assert again.check("survivors", [7]) is None

    for part, value, what in [("model", theta + 1, "another model"), ("survivors", [1, 2], "other surviving clients"),
                              ("calibration", [1], "other clients' calibration terms")]:
        guard = RerunGuard(KEY, before)
        guard.begin(2)
        why = guard.check(part, value)
        assert why.startswith(f"round 2 ran again after a resume with {what}") and "nothing was released" in why
    # a first release without calibration terms: terms now differ from it too
    guard = RerunGuard(KEY, {2: {"model": before[2]["model"], "survivors": before[2]["survivors"]}})
    guard.begin(2)
    assert "calibration terms" in guard.check("calibration", [1, 3])


def _row(r, eps, check=True):
    return {"round": r, "epsilon": eps, **({"release_check": {"model": f"m{r}", "survivors": f"s{r}"}} if check else {})}


def test_a_resume_keeps_the_digests_of_the_rows_it_cuts_back_and_the_first_release_wins(tmp_path):
    run = tmp_path / "run"
    record = RunRecord(run)
    for r in range(1, 6):
        record.add_round(_row(r, 0.1 * r, check=r != 4))  # round 4 released nothing
    record.close()
    with open(run / "rounds.jsonl", "a") as f:
        f.write('{"round": 6, "epsi')  # a row cut short by a killed driver
    RunRecord.reopen(run, 2).close()
    assert [json.loads(x)["round"] for x in (run / "rounds.jsonl").read_text().splitlines()] == [1, 2]
    kept = released_rounds(run)
    assert sorted(kept) == [3, 5] and kept[3] == {"model": "m3", "survivors": "s3", "epsilon": pytest.approx(0.3)}
    # a second resume cuts rows of a rerun: a round already kept keeps its first release's digests
    keep_released(run, [{"round": 3, "epsilon": 9.0, "release_check": {"model": "x", "survivors": "y"}},
                        _row(7, 0.7)])
    kept = released_rounds(run)
    assert kept[3]["model"] == "m3" and sorted(kept) == [3, 5, 7]


def test_a_damaged_list_of_released_rounds_is_one_line(tmp_path):
    (tmp_path / RELEASED).write_text("[1, 2")
    with pytest.raises(DPFLError, match=f"cannot read .*{RELEASED}"):
        released_rounds(tmp_path)
    (tmp_path / RELEASED).write_text('{"3": 1}')
    with pytest.raises(DPFLError, match="not a map of round"):
        released_rounds(tmp_path)


def test_a_run_set_aside_leaves_its_digests_and_secret_where_it_starts_again(tmp_path):
    run = tmp_path / "sweep" / "a"
    record = RunRecord(run)
    record.add_round(_row(1, 0.5))
    record.add_round(_row(2, 0.6))
    record.close()
    (run / DP_SECRET).write_bytes(bytes(32))
    moved = move_aside(tmp_path / "sweep", "a")
    assert (moved / "rounds.jsonl").exists() and sorted(p.name for p in run.iterdir()) == sorted([DP_SECRET, RELEASED])
    assert sorted(released_rounds(run)) == [1, 2]
    RunRecord.check_new(run)  # the run starts again in it
    assert move_aside(tmp_path / "sweep", "a") is None  # nothing else to set aside
