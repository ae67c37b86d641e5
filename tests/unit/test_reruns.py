"""A round run again after a resume releases the same values or nothing (privacy/reruns.py): the
digests, the guard's comparison, and the files that carry them to the next attempt: releases.jsonl
(runs/record.py), a sweep trial set aside (runs/sweep.py, move_aside) or run on a node that does
not see the sweep's directory (runtime/trials.py, the collector's ``kept``)."""
import json
import os
import stat
from pathlib import Path

import numpy as np
import pytest

from dpfl_ray.errors import DPFLError
from dpfl_ray.privacy.reruns import RerunGuard, release_check
from dpfl_ray.runs.record import DP_SECRET, RELEASES, RunRecord, read_releases
from dpfl_ray.runs.sweep import move_aside, pack_run, unpack_run
from dpfl_ray.runtime.trials import _Collector, write_kept

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
    assert first.check("calibration", [1, 3]) is None and not first.released_before()
    before = {2: dict(first.current)}
    assert set(before[2]) == {"model", "survivors", "calibration"}

    again = RerunGuard(KEY, before)
    again.begin(2)
    assert again.check("model", theta) is None and again.check("survivors", [3, 2, 1]) is None
    assert again.check("calibration", [3, 1]) is None and again.released_before()
    assert again.nothing_now().startswith("round 2 was released before the resume and releases nothing")
    again.begin(3)  # a round the server never saw released: nothing to compare
    assert again.check("survivors", [7]) is None and not again.released_before()

    for part, value, what in [("model", theta + 1, "another model"), ("survivors", [1, 2], "other surviving clients"),
                              ("calibration", [1], "other clients' calibration terms")]:
        guard = RerunGuard(KEY, before)
        guard.begin(2)
        why = guard.check(part, value)
        assert why.startswith(f"round 2 ran again after a resume with {what}") and "nothing was released" in why
    plain = {"model": before[2]["model"], "survivors": before[2]["survivors"]}
    # a first attempt that released without calibration terms: terms now differ from it too
    guard = RerunGuard(KEY, {2: {**plain, "released": True}})
    guard.begin(2)
    assert "calibration terms" in guard.check("calibration", [1, 3])
    # one that ended before summing any (no commit listed): the terms were never released then
    guard = RerunGuard(KEY, {2: plain})
    guard.begin(2)
    assert guard.check("calibration", [1, 3]) is None and guard.released_before()
    # one that listed the round and then released nothing: only the model it sent out binds
    guard = RerunGuard(KEY, {2: {**plain, "released": False}})
    guard.begin(2)
    assert guard.check("survivors", [9]) is None and not guard.released_before()
    assert "another model" in guard.check("model", theta + 1)


def _release(r, sha="a" * 64, eps=0.1):
    return {"event": "release", "round": r, "scenario_sha256": sha, "model": f"m{r}", "survivors": f"s{r}",
            "epsilon": eps * r}


def test_releases_are_listed_as_they_come_and_the_first_of_a_round_wins(tmp_path):
    record = RunRecord(tmp_path / "run")
    for r in (1, 2, 3):
        record.add_release(_release(r))
    record.add_release({**_release(2), "model": "other"})  # a rerun's line never replaces the first
    record.close()
    with open(tmp_path / "run" / RELEASES, "a") as f:
        f.write('{"round": 4, "scen')  # cut short by a killed driver
    got = read_releases(tmp_path / "run", "a" * 64)
    assert sorted(got) == [1, 2, 3] and got[2]["model"] == "m2" and "event" not in got[2]
    assert got[3]["epsilon"] == pytest.approx(0.3)
    again = RunRecord.reopen(tmp_path / "run", 0)  # a resume cuts rows, never the releases
    assert sorted(read_releases(tmp_path / "run")) == [1, 2, 3]
    again.add_release(_release(4))  # the line cut short goes; the next is whole
    again.add_release(_release(3, eps=9.0))
    again.close()
    assert sorted(read_releases(tmp_path / "run")) == [1, 2, 3, 4]
    assert len((tmp_path / "run" / RELEASES).read_text().splitlines()) == 4


@pytest.mark.parametrize("text, needle", [
    ('{"round": 1}\n{"round": 2}\n', "line 1 is not a released round"),
    ('[1, 2]\n{}\n', "line 1 is not a released round"),
    ('{"round": true, "model": "m", "survivors": "s", "scenario_sha256": "a"}\n', "line 1"),
    ('{"round": "3", "model": "m", "survivors": "s", "scenario_sha256": "a"}\n', "line 1"),
    ('xx\n{"round": 1, "model": "m", "survivors": "s", "scenario_sha256": "a"}\n', "line 1"),
    ('{"round": 1, "model": "m", "survivors": "s", "scenario_sha256": "b"}\n', "released by a run of another scenario"),
    (b"\xff\xfe", "cannot read"),
])
def test_a_damaged_or_foreign_list_of_releases_is_one_line(tmp_path, text, needle):
    (tmp_path / RELEASES).write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(DPFLError, match=needle):
        read_releases(tmp_path, "a")


def test_a_run_set_aside_leaves_what_it_starts_again_from_and_one_replaced_whole_leaves_nothing(tmp_path):
    sweep = tmp_path / "sweep"
    run = sweep / "a"
    record = RunRecord(run)
    record.add_round({"round": 1})
    record.add_release(_release(1))
    record.close()
    (run / DP_SECRET).write_bytes(bytes(32))
    moved = move_aside(sweep, "a")
    assert (moved / "rounds.jsonl").exists() and sorted(p.name for p in run.iterdir()) == sorted([DP_SECRET, RELEASES])
    assert sorted(read_releases(run)) == [1]
    RunRecord.check_new(run)  # the run starts again in it
    assert move_aside(sweep, "a") is None  # nothing else to set aside
    # a trial on another node sends its finished directory back: it replaces what was kept here
    other = tmp_path / "other" / "a"
    done = RunRecord(other)
    done.add_round({"round": 1})
    done.write_json("summary.json", {"stop_reason": "completed"})
    done.close()
    assert unpack_run(sweep, "a", pack_run(other))
    assert sorted(p.name for p in run.iterdir()) == ["rounds.jsonl", "summary.json"]


def test_a_trial_on_a_node_without_the_sweep_directory_gets_what_it_starts_again_from(tmp_path):
    sweep = tmp_path / "sweep"
    collector = _Collector(str(sweep))
    assert collector.kept("a") == {}  # no directory
    record = RunRecord(sweep / "a")
    record.add_release(_release(1))
    record.close()
    (sweep / "a" / DP_SECRET).write_bytes(bytes(range(32)))
    files = collector.kept("a")
    assert set(files) == {DP_SECRET, RELEASES} and collector.kept("../sweep/a") is None
    there = tmp_path / "node2" / "sweep" / "a"
    write_kept(there, files)
    assert (there / DP_SECRET).read_bytes() == bytes(range(32))
    assert stat.S_IMODE(os.stat(there / DP_SECRET).st_mode) == 0o600
    assert sorted(read_releases(there)) == [1]
    # a copy an earlier attempt left on that node gains what was listed since; its own lines stay
    listed = RunRecord(sweep / "c")
    listed.add_release(_release(1))
    listed.add_release(_release(2))
    listed.close()
    stale = tmp_path / "node2" / "sweep" / "c"
    stale.mkdir()
    (stale / RELEASES).write_text(json.dumps({k: v for k, v in _release(1).items() if k != "event"}) + "\n")
    write_kept(stale, collector.kept("c"))
    assert sorted(read_releases(stale)) == [1, 2] and len((stale / RELEASES).read_text().splitlines()) == 2
    # a trial elsewhere hands over its secret and each line as it lists it; a later attempt anywhere gets them
    assert collector.keep("b", secret=bytes(32)) and collector.keep("b", _release(1))
    assert collector.keep("b", {**_release(1), "model": "other", "released": True})
    got = read_releases(sweep / "b")[1]
    assert got["model"] == "m1" and got["released"] is True and set(collector.kept("b")) == {DP_SECRET, RELEASES}
    (sweep / "a" / "summary.json").write_text(json.dumps({"stop_reason": "completed"}))
    assert collector.kept("a") is None and not collector.keep("a", _release(2))  # a finished run is not run again


def test_an_attempt_that_released_nothing_is_replaced_by_the_next_that_lists_the_round(tmp_path):
    """Attempt 1 listed round 3 and its unmask failed (released: false); attempt 2 releases it with
    other survivors: the list must hold attempt 2's release, or a third attempt could release the
    round again unchecked."""
    record = RunRecord(tmp_path / "run")
    record.add_release(_release(3))
    record.add_release({**_release(3), "released": False, "epsilon": None})
    record.close()
    assert read_releases(tmp_path / "run")[3]["released"] is False
    again = RunRecord.reopen(tmp_path / "run", 0)
    again.add_release({"event": "release", "round": 3, "scenario_sha256": "a" * 64, "model": "m3",
                       "survivors": "s3-second"})
    again.add_release({"event": "release", "round": 3, "scenario_sha256": "a" * 64, "released": True, "epsilon": 0.4})
    again.close()
    got = read_releases(tmp_path / "run")[3]
    assert got["survivors"] == "s3-second" and got["released"] is True and got["epsilon"] == 0.4
    # once released, a later attempt's "nothing" never undoes it
    third = RunRecord.reopen(tmp_path / "run", 0)
    third.add_release({"event": "release", "round": 3, "scenario_sha256": "a" * 64, "released": False})
    third.close()
    assert read_releases(tmp_path / "run")[3]["released"] is True


def test_a_directory_holding_only_what_a_fresh_start_keeps_does_not_go_on_from_a_checkpoint(tmp_path):
    from dpfl_ray.runs.load import SweepRun
    from dpfl_ray.runs.sweep import resumed

    runs = [SweepRun(name, (), None, ()) for name in ("kept", "going", "none")]
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / RELEASES).write_text("")
    (tmp_path / "going").mkdir()
    (tmp_path / "going" / "checkpoint.npz").write_bytes(b"")
    assert resumed(tmp_path, runs) == 1


def test_the_driver_writes_a_batchs_listings_then_says_so_then_hands_on_its_rows(tmp_path):
    """runtime/driver.py: every listing of a batch of events is on disk, and handed on (a sweep trial
    on another node sends it to the sweep's node), before the coordinator hears it is written; the
    rows go on after that (a sweep trial's report to Tune may wait). Up to a round, nothing from
    the next round's row on is written or acknowledged; a listing that cannot be written is
    acknowledged to nobody, and no row of its batch is written."""
    from dpfl_ray.runtime.driver import _write_events

    def listing(r, **parts):
        return {"event": "release", "round": r, "scenario_sha256": "a" * 64, **parts}

    events = [listing(1, model="m1"), listing(1, survivors="s1"), listing(1, released=True, epsilon=0.5),
              {"event": "round", "round": 1, "sampled": 3}, listing(2, model="m2"),
              {"event": "round", "round": 2, "sampled": 3}, listing(3, model="m3")]
    record = RunRecord(tmp_path / "run")
    log = []

    def on_event(ev):
        if ev["event"] == "release":  # on disk by the time it is handed on
            assert ev["round"] in read_releases(tmp_path / "run")
        log.append((ev["event"], ev["round"]))

    assert _write_events(events, 10, record, on_event, written=lambda n: log.append(("written", n))) == 17
    assert log == [("release", 1)] * 3 + [("release", 2), ("release", 3), ("written", 17), ("round", 1), ("round", 2)]
    assert [r["round"] for r in record.rounds] == [1, 2] and sorted(read_releases(tmp_path / "run")) == [1, 2, 3]

    cut, log = RunRecord(tmp_path / "cut"), []
    # up to round 1: round 2's listing came before round 1's state was read, so it is written; its row is not
    assert _write_events(events, 0, cut, on_event, up_to=1, written=lambda n: log.append(("written", n))) == 5
    assert log == [("release", 1)] * 3 + [("release", 2), ("written", 5), ("round", 1)]
    assert [r["round"] for r in cut.rounds] == [1] and sorted(read_releases(tmp_path / "cut")) == [1, 2]

    broken, log = RunRecord(tmp_path / "broken"), []
    (tmp_path / "broken" / RELEASES).mkdir()  # a list that cannot be written
    with pytest.raises(OSError):
        _write_events(events, 0, broken, None, written=lambda n: log.append(("written", n)))
    assert log == [] and broken.rounds == [] and (tmp_path / "broken" / "rounds.jsonl").read_text() == ""


def test_setting_aside_never_reuses_a_number_and_never_moves_the_kept_files(tmp_path, monkeypatch):
    """With .incomplete/a.1 deleted and a.2 kept, the next attempt counted one and moved the run into
    a.2 (as a.2/a), and then put a.2's old list and secret back in the run's place. The list and the
    secret now never leave the directory: a crash midway cannot leave it without them."""
    import shutil

    from dpfl_ray.runs import sweep as sw

    sweep_dir = tmp_path / "sweep"
    run = sweep_dir / "a"
    (sweep_dir / ".incomplete" / "a.2").mkdir(parents=True)
    (sweep_dir / ".incomplete" / "a.2" / RELEASES).write_text("an older attempt's list\n")
    record = RunRecord(run)
    record.add_round({"round": 1})
    record.add_release(_release(1))
    record.close()
    (run / DP_SECRET).write_bytes(bytes(32))
    listed, secret = (run / RELEASES).read_bytes(), (run / DP_SECRET).read_bytes()
    moves = []
    real_move = shutil.move
    monkeypatch.setattr(sw.shutil, "move", lambda src, dst: (moves.append(Path(src).name), real_move(src, dst))[1])
    moved = move_aside(sweep_dir, "a")
    assert moved == sweep_dir / ".incomplete" / "a.3" and (moved / "rounds.jsonl").exists()
    assert (run / RELEASES).read_bytes() == listed and (run / DP_SECRET).read_bytes() == secret
    assert not {RELEASES, DP_SECRET} & set(moves)  # never moved, not even and back
    assert (sweep_dir / ".incomplete" / "a.2" / RELEASES).read_text() == "an older attempt's list\n"
