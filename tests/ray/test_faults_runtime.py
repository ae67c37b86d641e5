"""Faults carried out for real on a local Ray (issue #12, acceptance): a planned crash kills a worker
mid-round, a hung worker is cut off by the round's deadline, corrupt updates never reach the model,
and a chaos scenario gives the same faults and the same results twice."""
import json
import time

import numpy as np
import pytest
import torch

from dpfl_ray.data import build_federation
from dpfl_ray.errors import DPFLError
from dpfl_ray.runs.record import RunRecord
from dpfl_ray.runtime.coordinator import make_coordinator
from dpfl_ray.runtime.driver import put_federation, run_scenario
from dpfl_ray.training.models import model_file_bytes
from tests.helpers import TWO_WORKERS, tiny_scenario

DP_FEDAVG = {"algorithm": "dp_fedavg", "rounds": 3}
POISSON = {"mode": "poisson", "rate": 0.5, "clients_per_round": None}
PRIVACY = {"noise_multiplier": 1.0, "clipping": {"norm": 0.5}, "accountant": "rdp"}


def _run(sc, path):
    summary = run_scenario(sc, build_federation(sc), RunRecord(path))
    rows = [json.loads(line) for line in (path / "rounds.jsonl").read_text().splitlines()]
    return summary, rows, torch.load(path / "model.pt")


def _untimed(rows):
    return [{k: v for k, v in r.items() if "seconds" not in k} for r in rows]


def _flat(state):
    return torch.cat([v.flatten() for v in state.values()])


def _accounted(row):
    """sampled == survived + every dropout the row counts (docs/faults.md)."""
    return row["survived"] + sum(n for phases in row["dropped"].values() for n in phases.values())


def test_a_planned_crash_mid_round_is_survived_and_booked(ray_session, tmp_path):
    # worker 0 is killed after it was handed its clients (round 2), worker 1 while uploading (round 3)
    sc = tiny_scenario(training=DP_FEDAVG, sampling=POISSON, privacy=PRIVACY, resources=TWO_WORKERS,
                       faults={"crash": {"at": [[2, "training", 0], [3, "upload", 1]]}})
    summary, rows, state = _run(sc, tmp_path / "crash")
    assert summary["stop_reason"] == "completed" and [r["round"] for r in rows] == [1, 2, 3]
    assert "crash" not in rows[0]["dropped"]
    for row, phase in ((rows[1], "training"), (rows[2], "upload")):
        crashed = row["dropped_clients"]["crash"]
        assert crashed and row["dropped"]["crash"] == {phase: len(crashed)}
        assert row["dropped_by_phase"][phase] >= len(crashed)
        assert _accounted(row) == row["sampled"] and row["survived"] > 0
    assert set(rows[1]["dropped_clients"]["crash"]).isdisjoint(rows[1].get("rejected", {}))
    # the ledger books the same rounds with the same dropouts and gives the rows' epsilon
    ledger = json.loads((tmp_path / "crash" / "ledger.json").read_text())
    assert [r["round"] for r in ledger["rounds"]] == [1, 2, 3]
    assert [r["dropped"] for r in ledger["rounds"]] == [r["dropped"] for r in rows]
    assert all(r["released"] for r in ledger["rounds"])
    assert ledger["epsilon"] == rows[-1]["epsilon"] == summary["epsilon"] > 0
    assert torch.isfinite(_flat(state)).all()


def test_planned_crashes_under_secagg_are_recorded_in_their_planned_phase(ray_session, tmp_path):
    sc = tiny_scenario(secagg={"enabled": True}, training={"rounds": 2},
                       resources={"workers": 4, "num_cpus_per_worker": 0.25},
                       faults={"crash": {"at": [[1, "training", 0], [2, "unmask", 1]]}})
    summary, rows, _ = _run(sc, tmp_path / "secagg")
    assert summary["stop_reason"] == "completed" and not any("secagg_aborted" in r for r in rows)
    before, after = (r["dropped_clients"]["crash"] for r in rows)
    assert rows[0]["dropped"] == {"crash": {"training": len(before)}} and rows[0]["survived"] == 10 - len(before)
    # lost after their masked input arrived: SecAgg recovers their masks and their updates count
    assert rows[1]["dropped"] == {"crash": {"unmask": len(after)}} and rows[1]["survived"] == 10


def test_a_crash_planned_at_calibration_comes_after_the_unmask(ray_session, tmp_path):
    """Baek et al.: a worker crashed in the calibration phase has unmasked (its clients' updates
    count) and sends no calibration term; the server sums the others'. With no calibration phase in
    the round (calibration: none) the crash still comes after the unmask, and the round releases."""
    base = {"training": {"algorithm": "baek", "rounds": 1}, "secagg": {"enabled": True},
            "resources": {"workers": 2, "num_cpus_per_worker": 0.5},
            "faults": {"dropout": [{"model": "tail", "rate": 0.3, "phase": "upload"}],
                       "crash": {"at": [[1, "calibration", 1]]}}}
    summary, (row,), _ = _run(tiny_scenario(**base, privacy={**PRIVACY, "calibration": "baek"}), tmp_path / "baek")
    crashed = row["dropped_clients"]["crash"]
    assert summary["stop_reason"] == "completed" and crashed and "secagg_aborted" not in row
    assert row["dropped"]["crash"] == {"calibration": len(crashed)} and row["survived"] == 7
    assert row["epsilon"] > 0
    summary, (row,), _ = _run(tiny_scenario(**base, privacy={**PRIVACY, "calibration": "none"}), tmp_path / "none")
    assert summary["stop_reason"] == "completed" and "crash" not in row["dropped"] and row["survived"] == 7
    assert "secagg_aborted" not in row and row["epsilon"] > 0


def test_a_node_loss_planned_on_one_node_is_reported_as_not_carried_out(ray_session, tmp_path, capsys):
    """The session Ray has one node, the coordinator's: a planned node loss has nothing to remove.
    The run goes on losing no client, and says so in the rows, the summary and its last lines."""
    from types import SimpleNamespace

    from cli.run import _print_summary

    sc = tiny_scenario(training={"rounds": 3}, faults={"node_failure": {"at_round": [1, 3], "phase": "upload"}})
    summary, rows, _ = _run(sc, tmp_path / "one_node")
    assert summary["stop_reason"] == "completed" and [r["survived"] for r in rows] == [10, 10, 10]
    assert [r.get("faults_not_carried_out") for r in rows] == [["node_failure@upload"], None, ["node_failure@upload"]]
    assert all(r["dropped"] == {} for r in rows)
    assert summary["faults_not_carried_out"] == {"node_failure@upload": [1, 3]}
    _print_summary(summary, SimpleNamespace(path=tmp_path / "one_node"))
    out = " ".join(capsys.readouterr().out.split())
    assert "note: faults.node_failure@upload was planned in rounds 1, 3 and not carried out" in out, out


def _hang_run_clients(worker):
    # the worker's local training never returns: its run_clients hangs, while info() still answers
    return worker.__ray_call__.remote(lambda self: setattr(self, "_train", lambda *a, **k: time.sleep(600)))


def test_a_worker_in_a_round_that_never_ends_still_answers_for_the_model_file(ray_session, tmp_path):
    """A stopped run asks its first worker for model.pt while that worker may still train the round
    in flight (driver.finish): the answer comes from the worker's own thread, not after the round.
    Here the round never ends, so any answer at all is one given beside it."""
    sc = tiny_scenario()
    fed = build_federation(sc)
    coord = make_coordinator(sc, put_federation(fed))
    ray_session.get(coord.start_pool.remote())
    worker = ray_session.get(coord.worker_handle.remote(0))
    inside = tmp_path / "training"
    ray_session.get(worker.__ray_call__.remote(
        lambda self: setattr(self, "_train", lambda *a, **k: (inside.touch(), time.sleep(600)))))
    run = coord.run.remote()
    end = time.monotonic() + 120
    while not inside.exists():
        assert time.monotonic() < end, "the round never reached the worker"
        time.sleep(0.05)
    theta = np.linspace(-1, 1, 3 * 9, dtype=np.float32)  # logistic: 8 features and a bias, 3 classes
    blob = ray_session.get(worker.model_file.remote(theta), timeout=60)
    assert ray_session.wait([run], timeout=0)[0] == []  # the round is still in the worker
    assert blob == model_file_bytes(sc.model, fed.dataset.input_shape, fed.dataset.num_classes, theta)
    ray_session.kill(worker)
    ray_session.kill(coord)


def test_a_hung_worker_is_cut_off_by_the_deadline_in_plain_fedavg(ray_session):
    sc = tiny_scenario(training={"rounds": 3, "round_deadline_s": 1.0}, resources=TWO_WORKERS)
    coord = make_coordinator(sc, put_federation(build_federation(sc)))
    ray_session.get(coord.start_pool.remote())
    before = [i["pid"] for i in ray_session.get(coord.worker_info.remote())]
    ray_session.get(_hang_run_clients(ray_session.get(coord.worker_handle.remote(1))))
    # the hang lasts 600 s; the run must be done long before (deadline 1 s + the 10 s backstop)
    assert ray_session.get(coord.run.remote(), timeout=180) == {"stop_reason": "completed"}
    rows = [e for e in ray_session.get(coord.events.remote(0)) if e["event"] == "round"]
    late = rows[0]["dropped_clients"]["straggler"]
    assert late and rows[0]["dropped"] == {"straggler": {"upload": len(late)}}
    assert rows[0]["survived"] == 10 - len(late) > 0
    assert all(r["survived"] == 10 and r["dropped"] == {} for r in rows[1:])  # the replacement serves
    after = [i["pid"] for i in ray_session.get(coord.worker_info.remote())]
    assert after[0] == before[0] and after[1] != before[1]
    ray_session.kill(coord)


@pytest.mark.parametrize("secagg", [False, True])
def test_without_a_planned_deadline_a_slow_round_stops_the_run_and_drops_no_client(ray_session, tmp_path, secagg):
    # every client sleeps 4 s for real and no deadline is planned: the 1 s wait is not a deadline, so
    # the run must stop with the field to raise, never record the clients as stragglers
    sc = tiny_scenario(training={"rounds": 2, "hang_timeout_s": 1.0}, secagg={"enabled": secagg},
                       faults={"stragglers": {"fraction": 1.0, "latency": {"distribution": "fixed", "seconds": 4.0}}})
    with pytest.raises(DPFLError) as err:
        run_scenario(sc, build_federation(sc), RunRecord(tmp_path / "slow"))
    message = str(err.value)
    assert "\n" not in message and "training.hang_timeout_s" in message and "round 1:" in message, message
    assert "run failed after 0 rounds" in message
    summary = json.loads((tmp_path / "slow" / "summary.json").read_text())
    assert summary["stop_reason"] == "error" and summary["rounds_completed"] == 0
    assert (tmp_path / "slow" / "rounds.jsonl").read_text() == ""


def test_the_update_check_sees_what_a_client_sends_and_its_reason_names_no_figure_of_it(ray_session, tmp_path):
    """DP-FedAvg clips each update to C = 0.5; the check (a validity proof's stand-in) sees the
    clipped vector: at lr 5 every raw update is far above max_update_norm 0.6, and none is refused;
    the two faulty clients' broken uploads are, and the reason reaching rounds.jsonl names no norm."""
    full = {"mode": "fixed", "clients_per_round": 20}
    sc = tiny_scenario(sampling=full, training={"algorithm": "dp_fedavg", "lr": 5.0},
                       privacy={"noise_multiplier": 1.0, "accountant": "rdp", "clipping": {"norm": 0.5}},
                       faults={"corrupt": {"kind": ["norm"], "clients": [2, 7]}, "max_update_norm": 0.6})
    _, rows, state = _run(sc, tmp_path / "clipped")
    assert [r["rejected"] for r in rows] == [{"2": "norm: above faults.max_update_norm=0.6",
                                              "7": "norm: above faults.max_update_norm=0.6"}] * 3
    assert all(r["survived"] == 18 for r in rows) and torch.isfinite(_flat(state)).all()


def test_nan_inf_and_wrong_shape_updates_never_reach_the_model(ray_session, tmp_path):
    corrupt = [1, 5, 9, 13]
    full = {"mode": "fixed", "clients_per_round": 20}  # every client, every round
    sc = tiny_scenario(sampling=full, faults={"corrupt": {"kind": ["nan", "inf", "shape"], "clients": corrupt}})
    _, rows, state = _run(sc, tmp_path / "corrupt")
    reasons = [why for r in rows for why in r["rejected"].values()]
    assert {why.split(":")[0] for why in reasons} == {"nan", "inf", "shape"}, reasons
    assert all(r["dropped_clients"] == {"rejected": corrupt} and r["dropped"] == {"rejected": {"upload": 4}}
               for r in rows)
    # the same run where those clients simply never showed up (an availability trace)
    trace = tmp_path / "trace.csv"
    trace.write_text("client_id,round,available\n" + "".join(f"{c},{t},0\n" for t in (1, 2, 3) for c in corrupt))
    absent = tiny_scenario(sampling=full, faults={"availability": {"trace": str(trace)}})
    _, rows_absent, state_absent = _run(absent, tmp_path / "absent")
    assert all(r["dropped_clients"] == {"unavailable": corrupt} for r in rows_absent)
    assert torch.isfinite(_flat(state)).all()
    assert all(torch.equal(state[k], state_absent[k]) for k in state)
    assert [r["test_accuracy"] for r in rows] == [r["test_accuracy"] for r in rows_absent]


CHAOS = {
    "crash": {"rate": 0.2, "at": [[2, "training"]]},
    "stragglers": {"fraction": 0.4, "latency": {"distribution": "uniform", "low_s": 0.0, "high_s": 0.4}},
    "corrupt": {"kind": ["nan", "shape"], "fraction": 0.15},
}


def test_the_same_chaos_scenario_and_seed_give_the_same_faults_and_results(ray_session, tmp_path):
    sc = tiny_scenario(training={**DP_FEDAVG, "rounds": 4, "round_deadline_s": 0.2}, sampling=POISSON,
                       privacy=PRIVACY, faults=CHAOS, resources=TWO_WORKERS)
    _, rows_a, state_a = _run(sc, tmp_path / "a")
    _, rows_b, state_b = _run(sc, tmp_path / "b")
    causes = {c for r in rows_a for c in r["dropped"]}
    assert {"crash", "straggler", "rejected"} <= causes, [r["dropped"] for r in rows_a]
    assert _untimed(rows_a) == _untimed(rows_b)
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    ledgers = [json.loads((tmp_path / d / "ledger.json").read_text()) for d in ("a", "b")]
    assert ledgers[0]["rounds"] == ledgers[1]["rounds"] and ledgers[0]["epsilon"] == ledgers[1]["epsilon"]
    assert np.isfinite(rows_a[-1]["test_accuracy"])
