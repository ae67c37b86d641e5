"""The run directory's files are replaced whole: a write that fails half-way leaves the previous
file as it was and no temporary file behind (issue #16: files that agree after an interruption)."""
import json

import pytest
import torch

from dpfl_ray.runs.record import RunRecord


class Unserialisable:
    """Fails half-way through any serialisation: pickling, str() or repr()."""

    def __reduce__(self):
        raise RuntimeError("disk full")

    __str__ = __repr__ = __float__ = __reduce__


def test_a_failed_json_write_keeps_the_previous_file(tmp_path):
    record = RunRecord(tmp_path / "run")
    record.write_json("summary.json", {"rounds_completed": 3})
    with pytest.raises(RuntimeError):
        record.write_json("summary.json", {"rounds_completed": 4, "bad": Unserialisable()})
    assert json.loads((tmp_path / "run" / "summary.json").read_text()) == {"rounds_completed": 3}
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["rounds.jsonl", "summary.json"]
    record.close()


def test_a_failed_model_write_keeps_the_previous_model(tmp_path):
    from dpfl_ray.training.models import model_file

    record = RunRecord(tmp_path / "run")
    record.write_model_file(model_file({"w": torch.ones(3)}))
    with pytest.raises(RuntimeError):
        record.write_model_file(model_file({"w": Unserialisable()}))
    assert torch.equal(torch.load(tmp_path / "run" / "model.pt")["w"], torch.ones(3))
    assert not list((tmp_path / "run").glob(".*.tmp"))
    record.close()


def test_client_accuracy_summary_groups_by_label_in_numeric_order():
    from dpfl_ray.runs.record import client_accuracy_summary

    acc = {3: 0.5, 1: 0.9, 7: 0.7, 2: 0.6}
    out = client_accuracy_summary(acc, {1: "eps_k=8", 2: "eps_k=1", 3: "eps_k=1", 7: "eps_k=2.75"})
    assert out["clients"] == 4 and out["min"] == 0.5 and out["max"] == 0.9
    assert out["median"] == pytest.approx(0.65) and out["mean"] == pytest.approx(0.675)
    assert list(out["by_group"]) == ["eps_k=1", "eps_k=2.75", "eps_k=8"]  # 8 after 2.75: numbers, not text
    assert out["by_group"]["eps_k=1"] == pytest.approx({"clients": 2, "mean": 0.55, "min": 0.5, "median": 0.55,
                                                       "max": 0.6})
    assert list(out["per_client"]) == ["1", "2", "3", "7"]
    assert client_accuracy_summary({}) == {"clients": 0}
    assert "by_group" not in client_accuracy_summary(acc)
