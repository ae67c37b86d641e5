"""The run directory's files are replaced whole: a write that fails half-way leaves the previous
file as it was and no temporary file behind (issue #16: files that agree after an interruption)."""
import json

import pytest
import torch

from dpfl_ray.results import RunRecord


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
    record = RunRecord(tmp_path / "run")
    record.write_model({"w": torch.ones(3)})
    with pytest.raises(RuntimeError):
        record.write_model({"w": Unserialisable()})
    assert torch.equal(torch.load(tmp_path / "run" / "model.pt")["w"], torch.ones(3))
    assert not list((tmp_path / "run").glob(".*.tmp"))
    record.close()
