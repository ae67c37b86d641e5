"""cluster.yaml passes Ray's own cluster-launcher schema check, and broken copies fail with Ray's
message (ray.autoscaler._private.util: prepare_config, then validate_config)."""
import copy

import pytest
import yaml

from .conftest import ROOT


def ray_check(config: dict) -> dict:
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


@pytest.fixture(scope="module")
def config() -> dict:
    return yaml.safe_load((ROOT / "cluster.yaml").read_text())


def test_cluster_yaml_passes_rays_schema(config):
    prepared = ray_check(config)
    types = prepared["available_node_types"]
    head, gpu = types[prepared["head_node_type"]], types["worker.gpu"]
    assert head["node_config"]["InstanceType"].startswith("m5")  # CPU only
    assert gpu["node_config"]["InstanceType"].startswith("g5")
    assert 0 <= gpu["min_workers"] <= gpu["max_workers"] <= prepared["max_workers"]
    setup = "\n".join(prepared["setup_commands"])
    assert 'torch==2.13.0' in setup and "pip install -q -e ~/dpfl_ray" in setup
    assert setup.index("torch==2.13.0") < setup.index("-e ~/dpfl_ray")  # pinned before the project pulls torch
    assert {".venv", "runs", ".git"} <= set(prepared["rsync_exclude"])


@pytest.mark.parametrize("breakage, rays_message", [
    (lambda c: c["available_node_types"]["worker.gpu"].__setitem__("min_workers", "two"),
     "'two' is not of type 'integer'"),
    (lambda c: c.__setitem__("head_node_type", "head.gpu"),
     "`head_node_type` must be one of `available_node_types`"),
    (lambda c: c["available_node_types"]["worker.gpu"].__setitem__("max_nodes", 3),
     "Additional properties are not allowed ('max_nodes' was unexpected)"),
], ids=["wrong-type", "unknown-head-type", "unknown-field"])
def test_a_broken_copy_fails_with_rays_message(config, breakage, rays_message):
    broken = copy.deepcopy(config)
    breakage(broken)
    with pytest.raises(Exception) as err:
        ray_check(broken)
    print(f"[ray] {type(err.value).__name__}: {str(err.value).splitlines()[0]}")
    assert rays_message in str(err.value)


def test_the_local_provider_variant_in_the_comments_is_valid(config):
    local = {k: v for k, v in config.items() if k not in ("available_node_types", "head_node_type")}
    local.update(provider={"type": "local", "head_ip": "10.0.0.1", "worker_ips": ["10.0.0.2", "10.0.0.3"]},
                 auth={"ssh_user": "me", "ssh_private_key": "~/.ssh/id_rsa"}, max_workers=2)
    assert "local" in ray_check(local)["provider"]["type"]
