"""A round whose evaluation rides on the next round's training calls (Coordinator._settle) commits
before its row: a checkpoint taken in between holds its record as ``pending``. Without Ray: how many
rows such a checkpoint covers, and the row the files of a lost run get for it."""
import json

import numpy as np

from dpfl_ray.data import build_federation
from dpfl_ray.runs.record import RunRecord
from dpfl_ray.runtime.checkpoint import read_checkpoint, rows_covered, write_checkpoint
from dpfl_ray.runtime.recovery import add_pending_row
from dpfl_ray.training.models import build_model, evaluate, get_flat, set_flat
from tests.helpers import tiny_scenario


def test_a_checkpoint_covers_its_rounds_less_the_one_awaiting_its_evaluation():
    assert rows_covered({"round": 5, "pending": None}) == 5
    assert rows_covered({"round": 5}) == 5
    assert rows_covered({"round": 5, "pending": {"round": 5, "test_accuracy": None}}) == 4


def test_the_pending_round_gets_the_row_its_model_scores(tmp_path, one_torch_thread):
    sc = tiny_scenario()
    fed = build_federation(sc)
    ds = fed.dataset
    model = build_model(sc.model, ds.input_shape, ds.num_classes, sc.seed)
    theta = get_flat(model).copy() + np.float32(0.25)  # not the initial model: the checkpoint's is read
    run = tmp_path / "run"
    record = RunRecord(run)
    record.add_round({"round": 1, "sampled": 10, "test_accuracy": 0.5, "test_loss": 1.0})
    pending = {"round": 2, "sampled": 10, "survived": 10, "test_accuracy": None, "test_loss": None, "seconds": 0.1}
    record.add_round({**pending, "test_accuracy": 0.9})  # written by a driver before it died: dropped, rewritten
    record.close()
    # the coordinator keeps the round's event, whose "event" key no row carries
    write_checkpoint(run, {"round": 2, "pending": {"event": "round", **pending}, "arrays": {"theta": theta}})
    state = read_checkpoint(run)

    reopened = RunRecord.reopen(run, rows_covered(state))
    assert [r["round"] for r in reopened.rounds] == [1]
    add_pending_row(sc, fed, reopened, state)
    reopened.close()
    rows = [json.loads(line) for line in (run / "rounds.jsonl").read_text().splitlines()]
    set_flat(model, theta)
    acc, loss = evaluate(model, ds.x_test, ds.y_test)
    assert [r["round"] for r in rows] == [1, 2]
    assert rows[1] == {**pending, "test_accuracy": acc, "test_loss": loss}

    again = RunRecord.reopen(run, 2)  # a row already there is not added twice
    add_pending_row(sc, fed, again, state)
    again.close()
    assert len((run / "rounds.jsonl").read_text().splitlines()) == 2
