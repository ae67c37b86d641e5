"""Across nodes: a three-node ray.cluster_utils.Cluster (declared GPUs, all on this machine) runs a
tiny scenario; the workers land on every node, each holding the GPU fraction it asked for.

The cluster and the driver live in a child process (this pytest process never calls ray.init)."""
import json
import subprocess
import sys
import textwrap

from .conftest import ROOT, client_env

SCRIPT = textwrap.dedent('''
    import json, sys
    import ray
    from ray.cluster_utils import Cluster
    from ray._private.state import available_resources_per_node

    from dpfl_ray.data import build_federation
    from dpfl_ray.results import RunRecord
    from dpfl_ray.runtime.cluster import placement_summary
    from dpfl_ray.runtime.driver import ensure_ray, run_scenario
    from dpfl_ray.scenario import scenario_from_dict

    # Two CPUs and two GPUs per node: Ray's default placement would pack the first workers onto
    # the driver's node; SPREAD puts one on each.
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 2, "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(num_cpus=2, num_gpus=2)
    cluster.wait_for_nodes()
    try:
        ensure_ray(cluster.address)  # the same door as `dpfl run --address`
        sc = scenario_from_dict({
            "name": "spread", "seed": 1,
            "data": {"source": "synthetic", "num_clients": 12, "synthetic_examples": 240, "synthetic_features": 4},
            "model": {"name": "logistic"},
            "training": {"rounds": 3, "batch_size": 8, "lr": 0.2},
            "sampling": {"mode": "fixed", "clients_per_round": 6},
            "resources": {"workers": 3, "num_cpus_per_worker": 0.5, "num_gpus_per_worker": 0.5},
        })
        seen = {"gpu_free": []}

        def on_event(ev):
            if ev["event"] == "start":
                seen["pool"] = ev["pool"]
            seen["gpu_free"].append({n: r.get("GPU", 0.0) for n, r in available_resources_per_node().items()})

        summary = run_scenario(sc, build_federation(sc), RunRecord(sys.argv[1]), on_event=on_event)
        nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
        print("RESULT " + json.dumps({"summary": summary, "nodes": nodes, "pool": seen["pool"],
                                      "gpu_free": seen["gpu_free"], "placement": placement_summary(seen["pool"], 0.5, 0.5)}))
    finally:
        ray.shutdown()
        cluster.shutdown()
''')


def test_workers_spread_over_every_node_with_their_gpu_fraction(tmp_path):
    script = tmp_path / "spread.py"
    script.write_text(SCRIPT)
    r = subprocess.run([sys.executable, str(script), str(tmp_path / "run")], cwd=ROOT,
                       env=client_env(PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=480)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, (r.stdout[-3000:], r.stderr[-3000:])
    out = json.loads(lines[-1][len("RESULT "):])

    assert out["summary"]["rounds_completed"] == 3 and len(out["nodes"]) == 3
    assert sorted(w["node"] for w in out["pool"]) == out["nodes"]  # one worker on each node
    for w in out["pool"]:
        assert len(w["gpu_ids"]) == 1  # a fraction of one GPU, not a whole set
    placement = out["placement"]
    assert set(placement["nodes"]) == set(out["nodes"])
    assert all(n["workers"] == 1 and len(n["gpu_ids"]) == 1 for n in placement["nodes"].values())
    # While the run went, each node had exactly 2 - 0.5 of its GPUs free: the requested fraction.
    during = [snap for snap in out["gpu_free"] if set(snap) == set(out["nodes"])]
    assert any(all(free == 1.5 for free in snap.values()) for snap in during), out["gpu_free"]
