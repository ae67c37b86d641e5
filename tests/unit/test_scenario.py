from pathlib import Path

import numpy as np
import pytest

from dpfl_ray.errors import DPFLError
from dpfl_ray.scenario import load_scenario, scenario_from_dict

ROOT = Path(__file__).resolve().parents[2]


def test_quickstart_matches_the_issue():
    sc = load_scenario(ROOT / "scenarios" / "quickstart.yaml")
    assert (sc.data.source, sc.data.num_clients, sc.data.examples_per_client) == ("mnist5k", 100, 40)
    assert (sc.sampling.clients_per_round, sc.training.rounds, sc.model.name) == (10, 50, "cnn")
    assert (sc.training.local_epochs, sc.training.batch_size, sc.training.lr) == (1, 10, 0.15)


@pytest.mark.parametrize("raw, field", [
    ({"data": {"sorce": "mnist5k"}}, "data.sorce: unknown key"),
    ({"training": {"rounds": "many"}}, "training.rounds"),
    ({"sampling": {"mode": "poisson"}}, "sampling.rate"),
    ({"resources": {"num_gpus_per_worker": -1}}, "resources.num_gpus_per_worker"),
    ({"faults": {"dropout": {"rate": 1.5}}}, "faults.dropout.rate"),
    ({"sampling": {"clients_per_round": 500}}, "sampling.clients_per_round"),
    ({"privacy": {"enabled": True}}, "privacy.enabled"),
    ({"privacy": {"noise_multiplier": 1.0}}, "training.algorithm: dp_fedavg"),
    ({"data": {"path": "/data/fmnist"}}, "data.source 'mnist5k' is embedded and reads no folder given in data.path"),
    ({"training": {"algorithm": "dp_fedavg"}, "sampling": {"mode": "poisson", "rate": 0.1},
      "privacy": {"noise_multiplier": 1.0, "clipping": {"norm": 1.0}}, "faults": {"max_update_norm": 0.5}},
     "faults.max_update_norm=0.5 is below privacy.clipping.norm=1"),
])
def test_errors_name_the_field(raw, field):
    with pytest.raises(DPFLError) as err:
        scenario_from_dict(raw)
    assert field in str(err.value)
    assert "\n" not in str(err.value)


def test_overrides_are_typed_and_checked():
    sc = scenario_from_dict({}, ["training.rounds=7", "faults.dropout.model=tail", "faults.dropout.rate=0.3",
                                 "resources.workers=2", "data.repeat=true"])
    assert sc.training.rounds == 7 and sc.faults.dropout.rate == 0.3 and sc.resources.workers == 2
    assert sc.data.repeat is True
    with pytest.raises(DPFLError, match="training.rounds"):
        scenario_from_dict({}, ["training.rounds=abc"])
    with pytest.raises(DPFLError, match="--set"):
        scenario_from_dict({}, ["training.rounds"])
    with pytest.raises(DPFLError, match="training.nope: unknown key"):
        scenario_from_dict({}, ["training.nope=1"])


def test_resolved_yaml_round_trips():
    import yaml

    sc = scenario_from_dict({"name": "x", "training": {"rounds": 4}})
    assert scenario_from_dict(yaml.safe_load(sc.to_yaml())) == sc


def test_bad_yaml_is_one_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("data: [unclosed\n")
    with pytest.raises(DPFLError, match="not valid YAML"):
        load_scenario(p)
    with pytest.raises(DPFLError, match="no scenario file"):
        load_scenario(tmp_path / "missing.yaml")


@pytest.mark.parametrize("override, field", [
    ("training.lr=.inf", "training.lr: Input should be a finite number"),
    ("training.lr=1e400", "training.lr: Input should be a finite number"),
    ("training.lr=.nan", "training.lr"),
    ("privacy.delta=-.inf", "privacy.delta"),
    ("training.rounds=true", "training.rounds: Input should be a valid integer"),
    ("training.rounds='3'", "training.rounds: Input should be a valid integer"),
    ("training.rounds=3.0", "training.rounds"),
    ("data.repeat=1", "data.repeat: Input should be a valid boolean"),
    ("data.repeat='true'", "data.repeat"),
    ("seed=-1", "seed: Input should be greater than or equal to 0"),
    (f"seed={2**64}", "seed: Input should be less than or equal to"),
    ("model.hidden=[-5]", "model.hidden.0: Input should be greater than or equal to 1"),
    ("model.hidden=[0]", "model.hidden.0"),
    ("name=../escaped", "name: must be 1-100 letters"),
    ("name=a/b", "name"),
    ("name=.hidden", "name"),
    ("name=''", "name"),
])
def test_strict_types_and_ranges(override, field):
    with pytest.raises(DPFLError) as err:
        scenario_from_dict({}, [override])
    assert str(err.value).startswith(field) and "\n" not in str(err.value)


def test_strict_types_keep_what_yaml_means():
    sc = scenario_from_dict({}, ["training.lr=1e-2", "training.server_lr=2e0", "training.rounds=3",
                                 "seed=" + str(2**63 - 1), "name=paper-fig2_v1.3", "data.repeat=false", "data.n_max=5"])
    assert sc.training.lr == 0.01 and sc.training.server_lr == 2.0 and sc.training.rounds == 3 and sc.seed == 2**63 - 1
    assert sc.name == "paper-fig2_v1.3" and sc.data.repeat is False and sc.data.n_max == 5.0


@pytest.mark.parametrize("override", ["training..rounds=2", ".training.rounds=2", "training.rounds.=2",
                                      "training. .rounds=2", " =2"])
def test_override_paths_have_no_empty_segments(override):
    with pytest.raises(DPFLError, match="--set: override .* empty"):
        scenario_from_dict({}, [override])


@pytest.mark.parametrize("text, message", [
    ("name: a\ntraining:\n  rounds: 3\n  rounds: 4\n", "line 4: key 'rounds' is given twice"),
    ("name: a\nname: b\n", "line 2: key 'name' is given twice"),
    ("", "the scenario is empty"),
    ("# only a comment\n", "the scenario is empty"),
    ("{}\n", "the scenario is empty"),
    ("training:\n  rounds: '3'\n", "training.rounds: Input should be a valid integer"),
    ("- a\n- b\n", "a scenario must be a YAML mapping"),
])
def test_scenario_files_are_read_strictly(tmp_path, text, message):
    p = tmp_path / "s.yaml"
    p.write_text(text)
    with pytest.raises(DPFLError, match=message):
        load_scenario(p)


def test_a_binary_scenario_file_is_one_line(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(DPFLError, match="not a text .UTF-8. file") as err:
        load_scenario(p)
    assert "\n" not in str(err.value)
    p.write_bytes(b"name: a\x00b\n")  # valid UTF-8, but not YAML
    with pytest.raises(DPFLError, match="not valid YAML"):
        load_scenario(p)


def test_yaml_aliases_and_deep_nesting_are_refused_at_once(tmp_path):
    """Issue 37: an alias bomb (9 nested aliases of 9 items, 9^9 strings once walked) and a nesting
    100,000 levels deep, in a file and in --set, are one line each, in well under a second and a
    few MB (tracemalloc's peak of what Python allocated meanwhile)."""
    import time
    import tracemalloc

    from tests.e2e.test_hostile_inputs import ALIAS_BOMB, ALIAS_BOMB_VALUE

    deep = "[" * 100_000 + "]" * 100_000
    cases = [(ALIAS_BOMB, None, "YAML anchors and aliases (&a) are not allowed"),
             ("name: x\n", f"description={ALIAS_BOMB_VALUE}", "--set description: YAML anchors and aliases"),
             ("other: &x 1\nname: *x\n", None, "(&x)"),
             (f"description: {deep}\n", None, "nested more than 32 levels deep"),
             ("".join(" " * i + "a:\n" for i in range(1000)), None, "line 32: nested more than 32 levels"),
             ("name: x\n", f"description={deep}", "--set description: nested more than 32 levels"),
             ("name: x\n", "." .join(["a"] * 100_000) + "=1", "nested more than 32 levels"),
             ("description: '" + "x" * (2 << 20) + "'\n", None, "a scenario is at most 1048576 bytes")]
    for i, (text, override, needle) in enumerate(cases):
        path = tmp_path / f"s{i}.yaml"
        path.write_text(text)
        tracemalloc.start()
        t0 = time.perf_counter()
        with pytest.raises(DPFLError) as err:
            load_scenario(path, [override] if override else None)
        seconds, (_, peak) = time.perf_counter() - t0, tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)
        assert seconds < 1.0 and peak < 50 * 2**20, (needle, seconds, peak)


def test_a_hang_timeout_beside_a_planned_deadline_is_refused_and_a_dumped_scenario_loads_again():
    """With a planned round deadline the runtime waits deadline + max(10 s, deadline), whatever
    hang_timeout_s says: a hang timeout given beside it would be ignored, so it is refused. The
    default that every dumped scenario.yaml carries is not a choice, and loads again."""
    with pytest.raises(DPFLError, match="training.hang_timeout_s is for runs without training.round_deadline_s"):
        scenario_from_dict({"name": "a", "training": {"round_deadline_s": 5.0, "hang_timeout_s": 30.0}})
    planned = scenario_from_dict({"name": "a", "training": {"round_deadline_s": 5.0}})
    assert scenario_from_dict(planned.model_dump(mode="json")).training == planned.training
    assert scenario_from_dict({"name": "a", "training": {"hang_timeout_s": 30.0}}).training.hang_timeout_s == 30.0


def test_every_shipped_scenario_loads_and_reading_one_loads_no_torch():
    """Reading a scenario checks it against its algorithm (algorithms/<name>.py), and the processes
    that only read one -- `dpfl run`'s driver, a sweep's trials, `dpfl reproduce` -- must not pay for
    torch's import (seconds of CPU each): the algorithms load torch where a client trains. In a
    fresh interpreter, every scenario the project ships."""
    import json
    import subprocess
    import sys

    code = ("import glob, json, sys\n"
            "from dpfl_ray.scenario import load_scenario\n"
            "files = sorted(f for f in glob.glob('scenarios/**/*.yaml', recursive=True) if not f.endswith('paper.yaml'))\n"
            "algorithms = sorted({load_scenario(f).training.algorithm for f in files})\n"
            "print(json.dumps({'files': len(files), 'algorithms': algorithms, 'torch': 'torch' in sys.modules}))\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout)
    assert out["files"] >= 70 and not out["torch"], out
    assert {"adap_dpfl", "huang2020", "nbafl", "baek", "dp_fedavg"} <= set(out["algorithms"]), out


def test_the_readme_s_scenario_block_is_a_valid_scenario_naming_every_field():
    """README, "A scenario, field by field": the block loads as a scenario, and every field of every
    section the block spells out is in it (a new field with no line there fails here)."""
    import yaml
    from pydantic import BaseModel

    from dpfl_ray.scenario import Scenario

    text = (ROOT / "README.md").read_text()
    block = text[text.index("## A scenario, field by field"):].split("```yaml\n", 1)[1].split("```", 1)[0]
    raw = yaml.safe_load(block)
    scenario_from_dict(raw)

    def missing(model, section: dict, path: str = "") -> list[str]:
        out = []
        for name, field in model.model_fields.items():
            key = field.alias or name
            if key not in section:
                out.append(path + key)
            elif isinstance(section[key], dict) and isinstance(field.annotation, type) \
                    and issubclass(field.annotation, BaseModel):
                out += missing(field.annotation, section[key], f"{path}{key}.")
        return out

    assert missing(Scenario, raw) == []


def test_client_accuracy_is_refused_where_each_client_s_model_is_not_covered():
    """A client-level algorithm adds its noise after the local training: each client's own model, and
    so its accuracy, is a function of that client's data alone."""
    base = load_scenario(ROOT / "scenarios" / "huang2020_clfl_mnist_u10.yaml").model_dump(mode="json")
    with pytest.raises(DPFLError, match="^output.client_accuracy: dp_fedavg adds its noise after the local "
                                        "training"):
        scenario_from_dict(base, ["output.client_accuracy=true"])
    for name in ("huang2020_mnist_u10.yaml", "quickstart.yaml"):  # record-level, and no privacy at all
        raw = load_scenario(ROOT / "scenarios" / name).model_dump(mode="json")
        assert scenario_from_dict(raw, ["output.client_accuracy=true"]).output.client_accuracy


@pytest.mark.parametrize("data, needle", [
    # 10 examples in 50 classes: every class's test fifth rounds to 0 (the run divided by zero after 0 rounds)
    ({"source": "synthetic", "synthetic_examples": 10, "synthetic_classes": 50, "num_clients": 2},
     "data.synthetic_examples: 10 examples in 50 classes leave the test split empty"),
    # a fraction that rounds to no example in any class: Fu's noise decay would never read a loss
    ({"source": "synthetic", "synthetic_examples": 200, "num_clients": 4, "validation_fraction": 0.001},
     "data.validation_fraction: 0.001 of 160 training examples in 2 classes holds none out"),
])
def test_data_that_would_leave_a_split_empty_is_one_line(data, needle):
    from dpfl_ray.data import build_federation

    sc = scenario_from_dict({"data": data, "sampling": {"mode": "fixed", "clients_per_round": 2}})
    with pytest.raises(DPFLError) as err:
        build_federation(sc)
    assert str(err.value).startswith(needle), str(err.value)


def test_a_validation_split_from_the_test_split_leaves_every_training_example_dealt():
    """``validation_from: test`` (a paper that deals the whole training set, Fu et al.'s 400 fragments):
    the clients hold every training example, the validation split is a stratified part of the test
    split, and test accuracy is measured on the disjoint rest; ``train`` holds it out of the clients."""
    from dpfl_ray.data import build_federation
    from dpfl_ray.data.sources import load_source

    raw = {"seed": 5, "data": {"source": "digits", "num_clients": 10, "validation_fraction": 0.3,
                               "partition": {"kind": "shards", "shards_per_client": 4}},
           "sampling": {"mode": "fixed", "clients_per_round": 10}}
    full = load_source(scenario_from_dict(raw).data, 5)
    fed = build_federation(scenario_from_dict(raw, ["data.validation_from=test"]))
    dealt = build_federation(scenario_from_dict(raw, ["data.validation_fraction=0"]))  # no split held out
    assert np.array_equal(fed.indices, dealt.indices) and np.array_equal(fed.offsets, dealt.offsets)
    x_val, y_val = fed.validation_split()
    rows = {r.tobytes(): i for i, r in enumerate(full.x_test)}  # digits' test images are distinct
    assert len(rows) == len(full.x_test)
    held = sorted(rows[r.tobytes()] for r in x_val)
    kept = sorted(rows[r.tobytes()] for r in fed.dataset.x_test)
    assert not set(held) & set(kept) and len(held) + len(kept) == len(full.y_test)
    assert np.array_equal(y_val, full.y_test[held]) and np.array_equal(fed.dataset.y_test, full.y_test[kept])
    for label in np.unique(full.y_test):  # 30% of each class, rounded
        assert (y_val == label).sum() == round(0.3 * (full.y_test == label).sum())
    assert np.array_equal(fed.dataset.x_train, full.x_train)

    train = build_federation(scenario_from_dict(raw))  # the default: out of the training examples
    assert len(train.validation) and int(train.sizes.sum()) < int(dealt.sizes.sum())
    assert not set(train.validation) & set(train.indices) and len(train.dataset.y_test) == len(full.y_test)
    x_tv, y_tv = train.validation_split()
    assert np.array_equal(x_tv, full.x_train[train.validation]) and np.array_equal(y_tv, full.y_train[train.validation])

    with pytest.raises(DPFLError, match=r"^data\.validation_fraction: 0\.001 of \d+ test examples in 10 classes "
                                        "holds none out"):
        build_federation(scenario_from_dict(raw, ["data.validation_from=test", "data.validation_fraction=0.001"]))
    with pytest.raises(DPFLError, match=r"data\.validation_from"):
        scenario_from_dict(raw, ["data.validation_from=val"])
    with pytest.raises(DPFLError, match=r"data\.validation_from: test holds nothing out while "
                                        r"data\.validation_fraction is 0"):
        scenario_from_dict(raw, ["data.validation_from=test", "data.validation_fraction=0"])
