"""A run directory through a job's log and back (dpfl_ray/runs/bundle.py)."""
import io
import json
import random
import tarfile

import pytest

from dpfl_ray.runs.bundle import BEGIN, DATA, Bundle, bundle_lines, find_bundle, unpack, without_bundle
from dpfl_ray.errors import DPFLError


def _run_dir(tmp_path, name="run"):
    d = tmp_path / name
    (d / "sub").mkdir(parents=True)
    (d / "summary.json").write_text(json.dumps({"rounds_completed": 2}))
    (d / "rounds.jsonl").write_text('{"round": 1}\n{"round": 2}\n')
    (d / "model.pt").write_bytes(random.Random(0).randbytes(20000))  # incompressible: several chunks
    (d / "sub" / "plot.png").write_bytes(b"\x89PNG" + b"\0" * 5000)
    return d


def _log(lines, before="starting\n", after="done\n"):
    return before + "\n".join(lines) + "\n" + after


def test_round_trip_brings_back_every_byte(tmp_path):
    src = _run_dir(tmp_path)
    lines = bundle_lines(src, "quickstart")
    assert max(len(ln) for ln in lines[1:-1]) <= 4096 + 20
    bundle = find_bundle(_log(lines))
    assert bundle.name == "quickstart"
    assert bundle.files == ["model.pt", "rounds.jsonl", "sub/plot.png", "summary.json"]
    dest = tmp_path / "back"
    unpack(bundle, dest)
    for rel in bundle.files:
        assert (dest / rel).read_bytes() == (src / rel).read_bytes()


def test_the_last_intact_block_wins(tmp_path):
    first = bundle_lines(_run_dir(tmp_path, "a"), "first")
    second = bundle_lines(_run_dir(tmp_path, "b"), "second")
    assert find_bundle(_log(first + second)).name == "second"
    assert find_bundle(_log(first + second[:-2])).name == "first"  # a cut-off later block is skipped


def test_a_damaged_block_is_refused(tmp_path):
    lines = bundle_lines(_run_dir(tmp_path), "x")
    i = next(k for k, ln in enumerate(lines) if ln.startswith(DATA + " 1 "))
    tag, idx, chunk = lines[i].split(" ", 2)
    lines[i] = f"{tag} {idx} {'A' if chunk[0] != 'A' else 'B'}{chunk[1:]}"
    with pytest.raises(DPFLError, match="damaged: the checksum does not match"):
        find_bundle(_log(lines))
    with pytest.raises(DPFLError, match="damaged: .*missing"):
        find_bundle(_log(lines[:i] + lines[i + 1:]))


def test_no_block_and_too_large_say_why(tmp_path):
    with pytest.raises(DPFLError, match="holds no run directory"):
        find_bundle("just a log\n")
    lines = bundle_lines(_run_dir(tmp_path), "x", max_bytes=100)
    assert len(lines) == 1
    with pytest.raises(DPFLError, match="over the 100 bytes .* stays on the cluster at"):
        find_bundle(_log(lines))


def test_unpack_refuses_paths_that_leave_the_destination(tmp_path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo("../evil.txt")
        info.size = 4
        tar.addfile(info, io.BytesIO(b"evil"))
    with pytest.raises(DPFLError, match="refused to unpack"):
        unpack(Bundle("x", buf.getvalue(), ["../evil.txt"]), tmp_path / "dest")
    assert not (tmp_path / "evil.txt").exists()


def test_people_see_one_line_instead_of_the_block(tmp_path):
    text = without_bundle(_log(bundle_lines(_run_dir(tmp_path), "x")))
    assert text.startswith("starting\n") and text.endswith("done\n")
    assert len(text.splitlines()) == 3 and "4 files" in text and BEGIN not in text
