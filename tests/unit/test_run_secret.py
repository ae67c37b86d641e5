"""privacy.randomness: os across a resume. The rounds after a run's last checkpoint were committed
(the server may have seen them); a resumed run runs them again, so it must draw their noise and
their client sample from the same secret root, kept in the run directory while the run can go on
(runtime/checkpoint.py). Without Ray: the secret's file, its derivation, and the refusal to resume
an 'os' run whose secret is gone. tests/ray/test_runtime.py resumes a real run from it."""
import json
import stat

import numpy as np
import pytest

from dpfl_ray.algorithms import make_algorithm
from dpfl_ray.errors import DPFLError
from dpfl_ray.privacy.randomness import DPRandomness
from dpfl_ray.runtime.checkpoint import (DP_SECRET, forget_run_secret, open_for_resume, run_secret,
                                         scenario_fingerprint, write_checkpoint)
from tests.helpers import tiny_scenario


def _draws(source: DPRandomness) -> np.ndarray:
    return source.generator("noise", 4, 2).standard_normal(6)


def test_one_root_gives_the_same_draws_and_its_children_are_apart():
    root = bytes(range(32))
    a, b = DPRandomness.create("os", 3, root), DPRandomness.create("os", 3, root)
    assert np.array_equal(_draws(a), _draws(b))
    assert np.array_equal(_draws(a.child("sample")), _draws(b.child("sample")))
    draws = [_draws(x) for x in (a, a.child("sample"), a.child("algorithm"), DPRandomness.create("os", 3))]
    assert all(not np.array_equal(draws[i], draws[j]) for i in range(4) for j in range(i))
    assert a.child("sample").secret("layer", 1, 2, 0) == b.child("sample").secret("layer", 1, 2, 0)
    # reproducible streams are told apart by their purpose already: a child is the source itself
    rep = DPRandomness.create("reproducible", 3)
    assert rep.child("sample") is rep and rep.root is None
    with pytest.raises(ValueError, match="31 bytes"):
        DPRandomness.create("os", 3, bytes(31))


def test_an_algorithm_draws_from_the_randomness_it_is_given():
    sc = tiny_scenario(training={"algorithm": "dp_fedavg"}, sampling={"mode": "poisson", "rate": 0.3},
                       privacy={"noise_multiplier": 1.0, "randomness": "os", "clipping": {"norm": 0.5}})
    given = DPRandomness.create("os", sc.seed, bytes(32)).child("algorithm")
    alg = make_algorithm(sc, np.ones(20), sizes=np.full(20, 30), randomness=given)
    assert alg.randomness is given
    assert make_algorithm(sc, np.ones(20), sizes=np.full(20, 30)).randomness.root not in (None, given.root)


def test_the_run_secret_is_kept_owner_only_read_back_and_forgotten(tmp_path):
    assert run_secret(tmp_path, "reproducible") is None and not (tmp_path / DP_SECRET).exists()
    secret = run_secret(tmp_path, "os")
    path = tmp_path / DP_SECRET
    assert len(secret) == 32 and path.read_bytes() == secret
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert run_secret(tmp_path, "os") == secret  # a resume, or a sweep trial's next attempt
    forget_run_secret(tmp_path)
    assert not path.exists()
    forget_run_secret(tmp_path)  # nothing to forget: no error
    assert run_secret(tmp_path, "os") != secret
    path.write_bytes(b"short")
    with pytest.raises(DPFLError, match=f"{DP_SECRET} holds 5 bytes"):
        run_secret(tmp_path, "os")


def test_an_os_run_without_its_secret_is_not_resumed(tmp_path):
    """Fresh noise for the rounds after the checkpoint would be a second, unbooked release of them."""
    for randomness in ("os", "reproducible"):
        sc = tiny_scenario(training={"algorithm": "dp_fedavg"}, sampling={"mode": "poisson", "rate": 0.3},
                           privacy={"noise_multiplier": 1.0, "randomness": randomness, "clipping": {"norm": 0.5}})
        run = tmp_path / randomness
        run.mkdir()
        (run / "scenario.yaml").write_text(sc.to_yaml())
        (run / "rounds.jsonl").write_text(json.dumps({"round": 1, "test_accuracy": 0.5}) + "\n")
        write_checkpoint(run, {"round": 1, **scenario_fingerprint(sc), "arrays": {"theta": np.zeros(3)}})
        if randomness == "reproducible":
            assert open_for_resume(run)[0]["round"] == 1  # nothing secret to keep
            continue
        with pytest.raises(DPFLError, match=f"has no {DP_SECRET}, the secret its DP noise came from") as err:
            open_for_resume(run)
        assert "\n" not in str(err.value)
        secret = run_secret(run, "os")
        assert open_for_resume(run)[0]["round"] == 1 and run_secret(run, "os") == secret


def test_the_secret_stays_on_the_cluster_and_where_the_run_starts_again(tmp_path):
    """A job's bundle goes into its log: no secret in it. A sweep's trial whose earlier attempt left no
    checkpoint starts again in its own directory, from the secret of the rounds that attempt committed."""
    from dpfl_ray.runs.bundle import pack
    from dpfl_ray.runs.record import RunRecord
    from dpfl_ray.runs.sweep import move_aside

    run = tmp_path / "sweep" / "lr=0.1_seed=0"
    run.mkdir(parents=True)
    (run / "rounds.jsonl").write_text(json.dumps({"round": 1, "test_accuracy": 0.5}) + "\n")
    secret = run_secret(run, "os")
    assert pack(run)[1] == ["rounds.jsonl"]
    with pytest.raises(DPFLError, match="already holds files"):
        RunRecord.check_new(run)
    moved = move_aside(tmp_path / "sweep", run.name)
    assert (moved / "rounds.jsonl").exists() and not (moved / DP_SECRET).exists()
    assert [p.name for p in run.iterdir()] == [DP_SECRET]
    assert move_aside(tmp_path / "sweep", run.name) is None  # nothing to set aside but the secret
    RunRecord(run).close()  # a directory holding only the secret takes a new run
    assert run_secret(run, "os") == secret
