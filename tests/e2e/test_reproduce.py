"""`dpfl reproduce` for real: a quick run of the fu2022 folder on a small synthetic IDX set the
test writes itself, as Ray Tune trials in the test session's Ray (as `dpfl sweep` runs them), the table,
the markdown and the plot; a rerun that runs nothing; a bad paper name."""
import csv
import struct

import numpy as np
import pytest
import yaml

from .test_cli import dpfl


def write_idx(folder, train_per_class=60, test_per_class=20, seed=0):
    """Raw IDX files (MNIST's format: magic 0x00000803 / 0x00000801, big-endian int32 sizes): 10
    classes of 28x28 uint8 images, class c a bright bar in rows 2c..2c+4 over noise, so a CNN can
    learn a little."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for prefix, per in (("train", train_per_class), ("t10k", test_per_class)):
        labels = np.repeat(np.arange(10, dtype=np.uint8), per)
        rng.shuffle(labels)
        images = rng.integers(0, 60, size=(len(labels), 28, 28), dtype=np.uint8)
        for i, c in enumerate(labels):
            images[i, 2 * c + 2:2 * c + 6, 4:24] = rng.integers(180, 256, size=(4, 20), dtype=np.uint8)
        (folder / f"{prefix}-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 0x803, len(labels), 28, 28)
                                                             + images.tobytes())
        (folder / f"{prefix}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 0x801, len(labels)) + labels.tobytes())
    return folder


def test_quick_reproduction_of_fu2022_writes_its_table_and_resumes(ray_address, tmp_path):
    data, out = write_idx(tmp_path / "idx"), tmp_path / "fu2022-quick"
    args = ("reproduce", "fu2022", "--quick", "--data", data, "--only", "adap_as_published_standardized_floor",
            "--out", out, "--address", ray_address, "--set", "resources.workers=1",
            "--set", "resources.num_cpus_per_worker=0.5", "--timeout", "240")
    res = dpfl(*args)
    assert res.returncode == 0, res.stdout + res.stderr
    with open(out / "reproduction.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["run"], r["paper_final_accuracy"], r["rounds"], r["status"]) for r in rows] == \
        [("adap_as_published_standardized_floor", "0.7956", "3", "ok")]
    for r in rows:
        assert 0 <= float(r["final_accuracy"]) <= 1
        diff = float(r["final_accuracy"]) - float(r["paper_final_accuracy"])
        assert float(r["diff_final_accuracy"]) == pytest.approx(diff, abs=1e-9)
        assert float(r["epsilon_accounted"]) > 0 and float(r["epsilon_claimed"]) > 0 and r["epsilon_empirical"] == ""
    md = (out / "reproduction.md").read_text()
    assert md.startswith("## Fu et al. 2022, Adap DP-FL (`fu2022`)") and "| adap_as_published_standardized_floor | adap.yaml |" in md
    assert "`adap_within_3_points`" in md and "**SKIP** | adap_as_published was not run, adaptive_noise was not run" in md
    assert f"dpfl reproduce fu2022 --quick --data {data}" in md
    assert (out / "reproduction.png").read_bytes()[:4] == b"\x89PNG"
    ran = yaml.safe_load((out / "adap_as_published_standardized_floor" / "scenario.yaml").read_text())
    assert ran["data"]["normalize"] == [0.286, 0.353]  # the run's inputs were standardized as paper.yaml says
    assert ran["privacy"]["adap_dpfl"]["min_clip_norm"] == 0.01  # and eq. 6's threshold floored where it says
    assert "adap_within_3_points" in res.stdout and "wrote " in res.stdout

    again = dpfl(*args)  # every run finished: nothing runs again, the table is the same
    assert again.returncode == 0 and "1 run, 1 finished before" in again.stdout, again.stdout + again.stderr
    assert not (out / ".incomplete").exists()
    with open(out / "reproduction.csv") as fh:
        assert list(csv.DictReader(fh)) == rows


def test_a_bad_paper_name_is_one_line(tmp_path):
    res = dpfl("reproduce", "fu2021", "--quick", "--out", tmp_path / "never")
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and "no paper 'fu2021'" in lines[0], res.stderr
    assert "Traceback" not in res.stdout + res.stderr and not (tmp_path / "never").exists()
