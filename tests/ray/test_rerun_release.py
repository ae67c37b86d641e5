"""On a real local Ray: a run that starts where an earlier attempt released rounds (releases.jsonl)
releases them again when they come out alike, and stops before releasing one that would not --
under central noise (no SecAgg) and under Baek's calibration through SecAgg -- or that released
before and would release nothing now. The earlier release is a real run's list; "would not" is
that run's digest of one part changed, which is what a worker that really crashed in one attempt
alone leaves (docs/sensitivity.md)."""
import json
import time

import pytest

from dpfl_ray.data import build_federation
from dpfl_ray.errors import DPFLError
from dpfl_ray.privacy.randomness import DPRandomness
from dpfl_ray.privacy.reruns import release_check, rerun_key
from dpfl_ray.runs.record import RELEASES, RunRecord, read_releases
from dpfl_ray.runtime.checkpoint import scenario_fingerprint
from dpfl_ray.runtime.coordinator import make_coordinator
from dpfl_ray.runtime.driver import put_federation, run_scenario
from dpfl_ray.training.models import initial_theta
from tests.helpers import tiny_scenario


def _spy_on_evaluations(self):
    """Run in a Coordinator (``__ray_call__``): each evaluation's split and whether it ran here (in
    the coordinator) rather than on the workers, in ``evaluated_here``."""
    calls, evaluate = [], self._evaluate
    self.evaluated_here = calls
    self._evaluate = lambda theta, split="test", here=False: calls.append((split, here)) or evaluate(theta, split, here)


def _rows(path):
    return [json.loads(line) for line in (path / "rounds.jsonl").read_text().splitlines()]


def _figures(rows):
    return [{k: v for k, v in r.items() if not k.endswith("seconds")} for r in rows]


def _again(sc, path, releases: dict, change: dict | None = None):
    """A run in ``path`` after an attempt that listed ``releases`` (round -> its entry); ``change``:
    round -> part whose digest that attempt had otherwise."""
    path.mkdir()
    lines = [{**e, **({change[r]: "0" * 32} if change and r in change else {})} for r, e in releases.items()]
    (path / RELEASES).write_text("".join(json.dumps(e) + "\n" for e in lines))
    return run_scenario(sc, build_federation(sc), RunRecord(path))


def test_central_noise_releases_a_round_again_only_with_the_same_model_and_survivors(ray_session, tmp_path):
    def scenario():
        return tiny_scenario(training={"algorithm": "dp_fedavg", "rounds": 4},
                             sampling={"mode": "poisson", "rate": 0.4, "clients_per_round": None},
                             privacy={"noise_multiplier": 1.0, "accountant": "rdp", "clipping": {"norm": 0.5}})

    first = run_scenario(scenario(), build_federation(scenario()), RunRecord(tmp_path / "first"))
    rows, releases = _rows(tmp_path / "first"), read_releases(tmp_path / "first")
    assert first["stop_reason"] == "completed" and sorted(releases) == [1, 2, 3, 4]
    sha = scenario_fingerprint(scenario())["scenario_sha256"]
    # without SecAgg each round is listed before its model goes out, then its survivors, then how it ended
    lines = [json.loads(x) for x in (tmp_path / "first" / RELEASES).read_text().splitlines()]
    assert [(x["round"], sorted(set(x) - {"round", "scenario_sha256"})) for x in lines[:3]] == [
        (1, ["model"]), (1, ["survivors"]), (1, ["epsilon", "released"])]
    assert all(e["scenario_sha256"] == sha and e["released"] and e["epsilon"] == rows[r - 1]["epsilon"]
               for r, e in releases.items())

    # the same releases: the run goes through, row for row the first one's
    alike = _again(scenario(), tmp_path / "alike", releases)
    assert alike["stop_reason"] == "completed" and _figures(_rows(tmp_path / "alike")) == _figures(rows)
    assert "released_before_resume" not in alike and read_releases(tmp_path / "alike") == releases

    with pytest.raises(DPFLError, match=r"run failed after 2 rounds .*round 3 ran again after a resume with other "
                                        r"surviving clients .*nothing was released.*dpfl run --resume "):
        _again(scenario(), tmp_path / "survivors", releases, {3: "survivors"})
    summary = json.loads((tmp_path / "survivors" / "summary.json").read_text())
    assert summary["stop_reason"] == "error" and summary["rounds_completed"] == 2
    assert _figures(_rows(tmp_path / "survivors")) == _figures(rows[:2])  # round 3 released nothing
    # what the server saw before and this run has not released again is in the summary, with its epsilon
    assert summary["released_before_resume"]["rounds"] == [3, 4]
    assert summary["released_before_resume"]["epsilon"] == rows[3]["epsilon"] > summary["epsilon"]
    # the second attempt listed nothing new of rounds 1-2 (alike) and nothing of round 3 (not released)
    listed = dict(releases)
    listed[3] = {**releases[3], "survivors": "0" * 32}
    assert read_releases(tmp_path / "survivors") == listed

    # checked before the model goes out
    with pytest.raises(DPFLError, match=r"run failed after 1 rounds .*round 2 ran again after a resume with another "
                                        r"model"):
        _again(scenario(), tmp_path / "model", releases, {2: "model"})
    # a list another scenario left is refused before anything runs
    with pytest.raises(DPFLError, match="released by a run of another scenario"):
        _again(tiny_scenario(training={"algorithm": "dp_fedavg", "rounds": 4, "lr": 0.3},
                             privacy={"noise_multiplier": 1.0, "accountant": "rdp", "clipping": {"norm": 0.5}}),
               tmp_path / "other", releases)


def test_the_final_read_publishes_no_model_whose_listing_cannot_be_written(ray_session, tmp_path):
    """driver._committed, a run's last read of its coordinator: a listing the driver has not written
    yet (a round the stop caught after its listing) is written, and handed to ``on_event``, before
    the committed model may be published; if either fails the model is given up (None), never
    published beside an unlisted release. A stand-in actor plays the coordinator whose run is over."""
    from dpfl_ray.runtime.driver import _committed

    listing = {"event": "release", "round": 2, "scenario_sha256": "ab" * 32, "model": "1" * 32}

    @ray_session.remote(num_cpus=0)
    class Over:
        def committed(self):
            return {"rounds": 1, "theta": [0.5], "summary": {}}

        def events(self, since, wait_s=0.0):
            return [listing][since:]

    coord, sc = Over.remote(), tiny_scenario()
    handed = []
    record = RunRecord(tmp_path / "ok")
    assert _committed(coord, sc, None, 0, record, handed.append) == {"rounds": 1, "theta": [0.5], "summary": {}}
    assert read_releases(tmp_path / "ok") == {2: {k: v for k, v in listing.items() if k != "event"}}
    assert handed == [listing]

    unwritable = RunRecord(tmp_path / "unwritable")
    (tmp_path / "unwritable" / RELEASES).mkdir()  # reading or appending to it fails
    assert _committed(coord, sc, None, 0, unwritable) is None

    def unreachable(event):
        raise ConnectionError("the sweep's node does not answer")

    not_handed = RunRecord(tmp_path / "not_handed")
    assert _committed(coord, sc, None, 0, not_handed, unreachable) is None
    for r in (record, unwritable, not_handed):
        r.close()
    ray_session.kill(coord)


def test_a_coordinator_is_parked_only_once_every_acknowledgement_sent_to_it_has_run(ray_session):
    """driver._Sent: the driver's ``written`` calls await no reply, and a threaded actor may run
    them out of order; one still pending must not land in the next run a parked coordinator serves.
    A slow call stands for it: not done within 0.2 s, done once it has run; the list keeps only
    the calls still pending."""
    from dpfl_ray.runtime.driver import _Sent

    @ray_session.remote(num_cpus=0, max_concurrency=4)
    class Slow:
        def written(self, seconds):
            time.sleep(seconds)

    actor, sent = Slow.remote(), _Sent()
    sent(actor.written.remote(1.5))
    assert not sent.done(0.2)
    assert sent.done(30)
    for _ in range(64):
        sent(actor.written.remote(0.0))
    assert len(sent.refs) < 65 and sent.done(30)
    ray_session.kill(actor)


def test_a_run_stopped_mid_round_lists_every_round_it_may_have_released(ray_session, tmp_path):
    """Ctrl-C mid-run: the round in flight either was listed before its release (and is then in the
    rows or in the summary's released_before_resume) or stops before releasing; none is left out."""
    import signal

    from dpfl_ray.runtime.shutdown import Shutdown

    sc = tiny_scenario(training={"algorithm": "dp_fedavg", "rounds": 8},
                       privacy={"noise_multiplier": 1.0, "accountant": "rdp", "clipping": {"norm": 0.5}},
                       faults={"stragglers": {"tiers": [{"share": 1.0, "latency": {"distribution": "fixed",
                                                                                   "seconds": 0.3}}]}})
    shutdown = Shutdown()

    def on_event(ev):
        if ev.get("event") == "round" and ev["round"] == 2:
            shutdown.received.append(signal.SIGINT)

    summary = run_scenario(sc, build_federation(sc), RunRecord(tmp_path / "stopped"), on_event=on_event,
                           shutdown=shutdown)
    assert summary["stop_reason"] == "interrupted" and 2 <= summary["rounds_completed"] < 8
    listed = {r for r, e in read_releases(tmp_path / "stopped").items() if e.get("released") is not False}
    again = set(summary.get("released_before_resume", {}).get("rounds", []))
    assert listed == set(range(1, summary["rounds_completed"] + 1)) | again and len(again) <= 1


def _baek(**faults):
    return tiny_scenario(data={"num_clients": 40}, training={"algorithm": "baek", "rounds": 2},
                         sampling={"mode": "fixed", "clients_per_round": 10},
                         privacy={"noise_multiplier": 1.0, "clipping": {"norm": 0.5}, "accountant": "rdp"},
                         secagg={"enabled": True, "threshold": "majority"}, faults=faults)


def _released_before_round_1(sc) -> dict:
    """What an earlier attempt listed of round 1, released from the same initial model."""
    fed = build_federation(sc)
    key = rerun_key(DPRandomness.create("reproducible", sc.seed))
    theta0 = initial_theta(sc.model, fed.dataset.input_shape, fed.dataset.num_classes, sc.seed)
    return {"round": 1, "scenario_sha256": scenario_fingerprint(sc)["scenario_sha256"], "epsilon": 0.5,
            "model": release_check(key, 1, "model", theta0), "survivors": "0" * 32}


def test_a_round_released_before_that_releases_nothing_now_stops_the_run(ray_session, tmp_path):
    """Every sampled client drops before training, so under Baek no round releases; an earlier
    attempt that released round 1 (its digest of the same initial model) stops the run at once."""
    sc = _baek(dropout=[{"model": "tail", "rate": 1.0, "phase": "training"}])
    before = _released_before_round_1(sc)
    with pytest.raises(DPFLError, match=r"run failed after 0 rounds .*round 1 was released before the resume and "
                                        r"releases nothing this time"):
        _again(sc, tmp_path / "again", {1: before})
    summary = json.loads((tmp_path / "again" / "summary.json").read_text())
    assert summary["released_before_resume"]["rounds"] == [1] and summary["released_before_resume"]["epsilon"] == 0.5
    assert read_releases(tmp_path / "again") == {1: before}


def test_the_actors_of_a_run_its_coordinator_stopped_with_an_error_serve_the_next_run_as_fresh_ones(
        ray_session, tmp_path):
    """runtime/warm.py: a run that the coordinator itself ends with an error (here: a round released
    before that releases nothing now) leaves its worker and coordinator idle; they are parked, and
    the driver's next run on them is, to the bit, the run they served before the error."""
    from dpfl_ray.runtime import warm

    def parked():
        return ([h._actor_id.hex() for handles in warm._parked.values() for h in handles],
                [h._actor_id.hex() for h in warm._coordinators.values()])

    warm.clear()
    run_scenario(_baek(), build_federation(_baek()), RunRecord(tmp_path / "first"))
    first = parked()
    assert [len(ids) for ids in first] == [1, 1]
    failing = _baek(dropout=[{"model": "tail", "rate": 1.0, "phase": "training"}])
    with pytest.raises(DPFLError, match="releases nothing this time"):
        _again(failing, tmp_path / "failed", {1: _released_before_round_1(failing)})
    assert parked() == first  # the failed run ran on them, and they were parked again
    run_scenario(_baek(), build_federation(_baek()), RunRecord(tmp_path / "after"))
    assert parked() == first
    assert _figures(_rows(tmp_path / "after")) == _figures(_rows(tmp_path / "first"))
    assert (tmp_path / "after" / "model.pt").read_bytes() == (tmp_path / "first" / "model.pt").read_bytes()
    assert (tmp_path / "after" / "ledger.json").read_bytes() == (tmp_path / "first" / "ledger.json").read_bytes()


def _spy_on_phases(self):
    """Run in a Coordinator (``__ray_call__``): the name of each SecAgg phase it calls, in ``phases_called``."""
    from dpfl_ray.runtime import secagg_round

    calls, call = [], secagg_round._Phases.call
    self.phases_called = calls
    secagg_round._Phases.call = lambda phases, phase, make_call: calls.append(phase) or call(phases, phase, make_call)


def _kill_the_worker_before_the_terms(self):
    """Run in a Coordinator (``__ray_call__``): its worker is killed (for real) just before the
    calibration terms are asked for, after their senders were listed."""
    import ray

    from dpfl_ray.runtime import secagg_round

    call = secagg_round._Phases.call

    def killing(phases, phase, make_call):
        if phase == "calibration":
            for w in phases.live:
                ray.kill(w, no_restart=True)
                for _ in range(60):  # ray.kill returns before the actor is gone
                    try:
                        ray.get(w.__ray_ready__.remote(), timeout=1)
                    except ray.exceptions.RayActorError:
                        break
                    time.sleep(0.5)
        return call(phases, phase, make_call)
    secagg_round._Phases.call = killing


def _baek_with_calibration_dropouts(rounds: int):
    # 40 clients, 10 sampled, 3 drop before uploading, 2 of the 7 survivors before calibrating
    return tiny_scenario(data={"num_clients": 40}, training={"algorithm": "baek", "rounds": rounds},
                         sampling={"mode": "fixed", "clients_per_round": 10},
                         privacy={"noise_multiplier": 1.0, "clipping": {"norm": 0.5}, "accountant": "rdp",
                                  "calibration": "baek"},
                         secagg={"enabled": True, "threshold": "majority"},
                         faults={"dropout": [{"model": "tail", "rate": 0.3, "phase": "upload"},
                                             {"model": "tail", "rate": 0.3, "phase": "calibration"}]})


def test_baek_calibration_is_summed_again_only_from_the_same_clients(ray_session, tmp_path):
    def scenario():
        return _baek_with_calibration_dropouts(rounds=2)

    run_scenario(scenario(), build_federation(scenario()), RunRecord(tmp_path / "first"))
    rows, releases = _rows(tmp_path / "first"), read_releases(tmp_path / "first")
    assert all({"model", "survivors", "calibration"} <= set(e) for e in releases.values())
    assert all(r["dropped_by_phase"].get("calibration") for r in rows)
    with pytest.raises(DPFLError, match=r"run failed after 1 rounds .*round 2 ran again after a resume with other "
                                        r"clients' calibration terms"):
        _again(scenario(), tmp_path / "calibration", releases, {2: "calibration"})
    assert _figures(_rows(tmp_path / "calibration")) == _figures(rows[:1])


def test_baek_calibration_terms_lost_after_their_listing_are_not_summed(ray_session, tmp_path):
    """A worker lost between the listing of the calibration senders and their terms: a sum over the
    others would be a release of other senders than listed, which a rerun with all of them would
    pass the check against. The round is not summed or booked, the run stops, and the round is
    listed as possibly released: a resume releases it from the listed senders."""
    sc = _baek_with_calibration_dropouts(rounds=1)
    coord = make_coordinator(sc, put_federation(build_federation(sc)))
    try:
        ray_session.get(coord.__ray_call__.remote(_kill_the_worker_before_the_terms), timeout=60)
        run, read, end = coord.run.remote(), 0, time.monotonic() + 120
        events = []
        while not ray_session.wait([run], timeout=0)[0]:  # the driver: every listing acknowledged as read
            events += ray_session.get(coord.events.remote(read, 0.2), timeout=60)
            read = len(events)
            assert time.monotonic() < end, "the round did not end"
        result = ray_session.get(run, timeout=60)
        assert result["stop_reason"] == "error" and result["error"].startswith(
            "round 1: the worker of 5 listed calibration sender(s) was lost before their terms came"), result
        events += ray_session.get(coord.events.remote(read), timeout=60)
        assert not [e for e in events if e["event"] == "round"]
        (listing,) = [e for e in events if e["event"] == "release" and "calibration" in e]
        assert listing["round"] == 1 and not [e for e in events if e["event"] == "release" and "released" in e]
    finally:
        ray_session.kill(coord)


def test_baek_calibration_terms_are_asked_for_only_once_their_senders_are_listed(ray_session):
    """The server learns who calibrates (ids only), checks them against an earlier release of the
    round and lists them; only once the driver has written that listing does it ask for the terms.
    (A term that came first would be in the server's hands even where the check then refuses to sum
    it: a rerun round with other senders.) Here the test is the driver and holds the listing back."""
    sc = _baek_with_calibration_dropouts(rounds=1)
    coord = make_coordinator(sc, put_federation(build_federation(sc)))
    try:
        ray_session.get(coord.__ray_call__.remote(_spy_on_phases), timeout=60)
        run = coord.run.remote()
        end, written = time.monotonic() + 120, 0
        while True:  # every listing acknowledged until the calibration senders' appears
            events = ray_session.get(coord.events.remote(0, 0.2), timeout=60)
            if [e for e in events if e["event"] == "release" and "calibration" in e]:
                break
            if len(events) > written:
                written = len(events)
                coord.written.remote(written)
            assert time.monotonic() < end, "round 1 listed no calibration senders"
        time.sleep(2.0)  # far longer than a phase takes here
        called = ray_session.get(coord.__ray_call__.remote(lambda self: list(self.phases_called)), timeout=60)
        assert called == ["advertise", "share", "masked_input", "unmask", "calibrating"], called
        coord.written.remote(len(events))
        assert ray_session.get(run, timeout=120)["stop_reason"] == "completed"
        called = ray_session.get(coord.__ray_call__.remote(lambda self: list(self.phases_called)), timeout=60)
        assert called[-2:] == ["calibrating", "calibration"]
        (row,) = [e for e in ray_session.get(coord.events.remote(0), timeout=60) if e["event"] == "round"]
        assert row["dropped_by_phase"].get("calibration") and row["epsilon"] > 0
        assert {"calibrating", "calibration"} <= set(row["secagg_seconds"])
    finally:
        ray_session.kill(coord)


def test_a_release_waits_until_the_driver_has_written_its_listing(ray_session, tmp_path):
    """A coordinator makes a release only once the driver has written what it lists of it (the
    driver says so by asking for the events after it, or by ``written``). Here the test is the
    driver: round 1 lists its model and reads no upload until that listing is acknowledged (its
    survivors, listed once the uploads are read, are not); acknowledged, the round commits; round
    1's survivors, never acknowledged, hold round 2 until the driver says it writes no more
    (``abandon``, as a stopped run's driver does after its grace): round 2 then releases nothing, and
    round 1's model is evaluated in the coordinator rather than sent to the workers."""
    sc = tiny_scenario(training={"algorithm": "dp_fedavg", "rounds": 3},
                       privacy={"noise_multiplier": 1.0, "accountant": "rdp", "clipping": {"norm": 0.5}})
    coord = make_coordinator(sc, put_federation(build_federation(sc)))
    try:
        ray_session.get(coord.__ray_call__.remote(_spy_on_evaluations), timeout=60)
        run = coord.run.remote()
        end = time.monotonic() + 120
        while not [e for e in ray_session.get(coord.events.remote(0, 0.2), timeout=60) if e["event"] == "release"]:
            assert time.monotonic() < end, "round 1 listed nothing"
        time.sleep(3.0)  # far longer than the round's training takes
        events = ray_session.get(coord.events.remote(0), timeout=60)
        assert [sorted(set(e) - {"event", "scenario_sha256"}) for e in events if e["event"] == "release"] == [
            ["model", "round"]]
        assert not [e for e in events if e["event"] == "round"] and ray_session.wait([run], timeout=0)[0] == []

        # the model's listing acknowledged, nothing after it; once round 1 has committed, the driver gives up
        coord.written.remote(len(events))
        while not [e for e in ray_session.get(coord.events.remote(0, 0.2), timeout=60)
                   if e["event"] == "release" and "released" in e]:
            assert time.monotonic() < end, "round 1 did not commit once its model's listing was written"
        coord.abandon.remote()
        result = ray_session.get(run, timeout=30)  # not the 60 s a listing may take
        assert result == {"stop_reason": "error", "error": "the driver stopped writing the release list "
                                                          "(releases.jsonl): round 2 released nothing"}
        events = ray_session.get(coord.events.remote(0), timeout=60)
        rows = [e for e in events if e["event"] == "round"]
        assert [r["round"] for r in rows] == [1] and rows[0]["test_accuracy"] is not None
        assert ray_session.get(coord.__ray_call__.remote(lambda self: self.evaluated_here), timeout=60) == [
            ("test", True)]
        assert rows[0]["listing_seconds"] > 2.0  # round 1 waited for its model's listing, then read the uploads
        assert [(e["round"], sorted(set(e) - {"event", "round", "scenario_sha256"})) for e in events
                if e["event"] == "release"] == [(1, ["model"]), (1, ["survivors"]), (1, ["epsilon", "released"])]
    finally:
        ray_session.kill(coord)


def test_a_listing_late_after_the_release_has_the_model_evaluated_here_and_the_round_booked(ray_session, tmp_path):
    """A round whose uploads were read (its release made) and whose survivors' listing is then late
    is not undone: its new model is evaluated in the coordinator, on the test and the validation
    split, rather than sent to the workers; the round commits, booked; and the run stops with an
    error that says so (here the last round: no next round to stop at)."""
    sc = tiny_scenario(data={"validation_fraction": 0.2}, training={"algorithm": "dp_fedavg", "rounds": 1},
                       privacy={"noise_multiplier": 1.0, "accountant": "rdp", "clipping": {"norm": 0.5}})
    coord = make_coordinator(sc, put_federation(build_federation(sc)))
    try:
        ray_session.get(coord.__ray_call__.remote(_spy_on_evaluations), timeout=60)
        ray_session.get(coord.__ray_call__.remote(lambda self: setattr(
            __import__("dpfl_ray.runtime.coordinator", fromlist=["_"]), "LISTING_TIMEOUT_SECONDS", 1.0)), timeout=60)
        run = coord.run.remote()
        end = time.monotonic() + 120
        while True:  # the model's listing is written (acknowledged while the clients train); no later one is
            events = ray_session.get(coord.events.remote(0, 0.2), timeout=60)
            if [e for e in events if e["event"] == "release"]:
                break
            assert time.monotonic() < end, "round 1 listed nothing"
        coord.written.remote(len(events))
        result = ray_session.get(run, timeout=120)
        assert result == {"stop_reason": "error", "error": "the driver did not write the release list (releases.jsonl) "
                                                          "within 1 s: round 1 was released, evaluated here and "
                                                          "committed, and the run stopped"}
        events = ray_session.get(coord.events.remote(0), timeout=60)
        rows = [e for e in events if e["event"] == "round"]
        assert [r["round"] for r in rows] == [1] and rows[0]["epsilon"] > 0 and rows[0]["listing_seconds"] >= 1.0
        assert rows[0]["test_accuracy"] is not None and rows[0]["validation_loss"] is not None
        assert ray_session.get(coord.__ray_call__.remote(lambda self: self.evaluated_here), timeout=60) == [
            ("test", True), ("validation", True)]
        assert [(e["round"], sorted(set(e) - {"event", "round", "scenario_sha256"})) for e in events
                if e["event"] == "release"] == [(1, ["model"]), (1, ["survivors"]), (1, ["epsilon", "released"])]
    finally:
        ray_session.kill(coord)
