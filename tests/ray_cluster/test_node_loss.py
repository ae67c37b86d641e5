"""A node lost mid-run (faults.node_failure) on a three-node ray.cluster_utils.Cluster, all on this
machine: the runtime kills one node's raylet in round 2, the round records that node's clients as
node_lost, and the run completes on the two nodes that are left.

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

    from dpfl_ray.data import build_federation
    from dpfl_ray.results import RunRecord
    from dpfl_ray.runtime.driver import ensure_ray, run_scenario
    from dpfl_ray.scenario import scenario_from_dict

    # A lost raylet is noticed by the GCS's health checks: check every 0.5 s so the test stays short.
    fast = {"health_check_period_ms": 500, "health_check_timeout_ms": 500, "health_check_failure_threshold": 2}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False,
                                                            "_system_config": fast})
    for _ in range(2):
        cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    try:
        ensure_ray(cluster.address)
        sc = scenario_from_dict({
            "name": "node_loss", "seed": 2,
            "data": {"source": "synthetic", "num_clients": 12, "synthetic_examples": 240, "synthetic_features": 4},
            "model": {"name": "logistic"},
            "training": {"rounds": 3, "batch_size": 8, "lr": 0.2},
            "sampling": {"mode": "fixed", "clients_per_round": 6},
            "faults": {"node_failure": {"at_round": 2, "phase": "training"}},
            "resources": {"workers": 3, "num_cpus_per_worker": 0.5},
        })
        seen = {}

        def on_event(ev):
            if ev["event"] == "start":
                seen["pool"] = ev["pool"]

        before = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
        summary = run_scenario(sc, build_federation(sc), RunRecord(sys.argv[1]), on_event=on_event)
        after = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
        print("RESULT " + json.dumps({"summary": summary, "before": before, "after": after, "pool": seen["pool"]}))
    finally:
        ray.shutdown()
        try:
            cluster.shutdown()
        except Exception:  # the lost node's processes are already gone
            pass
''')


def test_a_lost_node_s_clients_are_node_lost_and_the_run_completes(tmp_path):
    script = tmp_path / "node_loss.py"
    script.write_text(SCRIPT)
    r = subprocess.run([sys.executable, str(script), str(tmp_path / "run")], cwd=ROOT,
                       env=client_env(PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=300)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, (r.stdout[-3000:], r.stderr[-3000:])
    out = json.loads(lines[-1][len("RESULT "):])
    rows = [json.loads(line) for line in (tmp_path / "run" / "rounds.jsonl").read_text().splitlines()]

    assert out["summary"]["stop_reason"] == "completed" and out["summary"]["rounds_completed"] == 3
    assert len(out["before"]) == 3 and len(out["after"]) == 2
    (lost_node,) = set(out["before"]) - set(out["after"])
    assert lost_node in {w["node"] for w in out["pool"]}  # a node that held a worker
    lost = rows[1]["dropped_clients"]["node_lost"]
    assert lost and rows[1]["dropped"] == {"node_lost": {"training": len(lost)}}
    assert rows[1]["survived"] == 6 - len(lost) > 0
    assert rows[0]["survived"] == rows[2]["survived"] == 6  # the replacement runs on the nodes left
    assert rows[2]["test_accuracy"] is not None and (tmp_path / "run" / "model.pt").stat().st_size > 0
