from pathlib import Path

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
