"""Across nodes, on one three-node ray.cluster_utils.Cluster (declared GPUs, all on this machine):

1. `dpfl sweep --address` of three runs whose one worker wants a whole node: the Tune trials
   spread over the cluster, one on each node, and every run directory lands in the one `--out`
   (one machine: the nodes share its file system, as a cluster's nodes must share `--out`). A worker
   node is lost mid-sweep: Tune starts its trial again on a node left, and the run resumes from its
   last checkpoint (its committed rows kept to the byte, every round once); a node is added back;
2. then a run of three workers that each ask for half a GPU: they land one on every node, each
   holding a fraction of one GPU; a node is lost mid-run (faults.node_failure): the runtime kills
   one node's raylet in round 2, the round records that node's clients as node_lost, and the run
   completes on the two nodes that are left.

Both share the cluster: starting one costs more CPU than either part. The cluster and the
driver live in a child process (this pytest process never calls ray.init)."""
import csv
import json
import subprocess
import sys
import textwrap

from dpfl_ray.runtime.private_ray import stop_sessions

from .conftest import ROOT, client_env

SWEEP_ROUNDS = 100

SCRIPT = textwrap.dedent('''
    import faulthandler, json, subprocess, sys, time
    from pathlib import Path

    # A hang shows where it is: every thread's stack on stderr, then exit, before the test's own limit.
    faulthandler.dump_traceback_later(420, exit=True)
    t0 = time.monotonic()

    import psutil
    import yaml

    import ray
    from ray.cluster_utils import Cluster
    from ray._private.state import available_resources_per_node

    from dpfl_ray.data import build_federation
    from dpfl_ray.runs.record import RunRecord
    from dpfl_ray.runtime.cluster import placement_summary
    from dpfl_ray.runtime.driver import ensure_ray, run_scenario
    from dpfl_ray.runtime.checkpoint import CHECKPOINT, read_checkpoint, rows_covered
    from dpfl_ray.scenario import scenario_from_dict

    out = Path(sys.argv[1])
    SWEEP_ROUNDS = int(sys.argv[2])

    def trials_by_node(cluster):
        """{node: the run its Tune trial runs, or None}. Every node runs on this machine: a trial's
        process is a child of its node's raylet, and works in its Tune trial directory, which is
        named as its run."""
        found = {}
        for node in cluster.list_all_nodes():
            try:
                raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
                found[node] = next((Path(p.cwd()).name for p in raylet.children(recursive=True)
                                    if "ImplicitFunc" in " ".join(p.cmdline())), None)
            except (psutil.Error, KeyError, IndexError):
                found[node] = None
        return found
    # A lost raylet is noticed by the GCS's health checks: check every 0.5 s so the test stays short.
    fast = {"health_check_period_ms": 500, "health_check_timeout_ms": 500, "health_check_failure_threshold": 2}
    # Two CPUs and two GPUs per node: Ray's default placement would pack the first workers onto
    # the driver's node; SPREAD puts one on each.
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 2, "include_dashboard": False,
                                                            "_system_config": fast})
    for _ in range(2):
        cluster.add_node(num_cpus=2, num_gpus=2)
    cluster.wait_for_nodes()

    def tiny(name, **sections):
        return scenario_from_dict({
            "name": name, "seed": 2,
            "data": {"source": "synthetic", "num_clients": 12, "synthetic_examples": 240, "synthetic_features": 4},
            "model": {"name": "logistic"},
            "training": {"rounds": 3, "batch_size": 8, "lr": 0.2},
            "sampling": {"mode": "fixed", "clients_per_round": 6},
            **sections,
        })

    try:
        ensure_ray(cluster.address)  # the same door as `dpfl run --address`

        # a sweep as one command on the cluster: each run's worker takes a whole node (2 CPUs). Once
        # every node runs a trial, a worker node whose trial's run has committed rounds is lost.
        spec = out / "whole_node.yaml"
        spec.write_text(yaml.safe_dump(tiny("whole_node", resources={"workers": 1, "num_cpus_per_worker": 2},
                                            training={"rounds": SWEEP_ROUNDS, "batch_size": 8, "lr": 0.2})
                                       .model_dump(mode="json")))
        sweep_dir = out / "sweep"
        sweep = subprocess.Popen([sys.executable, "-m", "cli.main", "sweep", str(spec), "--seeds", "0,1,2",
                                  "--out", str(sweep_dir), "--timeout", "240", "--address", cluster.address],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lost, spread, rows_then = None, set(), {}
        while lost is None and sweep.poll() is None and time.monotonic() - t0 < 300:
            time.sleep(0.2)
            trials = {node: run for node, run in trials_by_node(cluster).items() if run}
            spread |= {frozenset(trials)} if len(trials) == 3 else set()
            for node, run in trials.items():
                rows = sweep_dir / run / "rounds.jsonl"
                if not spread or node is cluster.head_node or (sweep_dir / run / "summary.json").exists() \
                        or not (sweep_dir / run / CHECKPOINT).exists():
                    continue
                # the checkpoint first: rows reach rounds.jsonl before the checkpoint that covers them
                covered = rows_covered(read_checkpoint(sweep_dir / run))
                text = rows.read_text()
                if covered >= 2 and len(text.splitlines()) >= 3:
                    rows_then = {"run": run, "text": text, "covered": covered}
                    cluster.remove_node(node, allow_graceful=False)
                    lost = node.node_id
                    break
        text, _ = sweep.communicate(timeout=300)
        print("SWEEP " + json.dumps({"rc": sweep.returncode, "tail": text[-3000:], "lost": lost,
                                     "spread": [sorted(n.node_id for n in nodes) for nodes in spread],
                                     "rows_then": rows_then, "s": time.monotonic() - t0}), flush=True)
        cluster.add_node(num_cpus=2, num_gpus=2)  # three nodes again, for the node loss in a run
        cluster.wait_for_nodes()

        seen = {"gpu_free": []}

        def on_event(ev):
            if ev["event"] == "start":
                seen["pool"] = ev["pool"]
            seen["gpu_free"].append({n: r.get("GPU", 0.0) for n, r in available_resources_per_node().items()})

        sc = tiny("node_loss", faults={"node_failure": {"at_round": 2, "phase": "training"}},
                  resources={"workers": 3, "num_cpus_per_worker": 0.5, "num_gpus_per_worker": 0.5})
        before = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
        summary = run_scenario(sc, build_federation(sc), RunRecord(out / "node_loss"), on_event=on_event,
                               keep_workers=False)
        after = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
        print("LOSS " + json.dumps({"summary": summary, "before": before, "after": after, "pool": seen["pool"],
                                    "gpu_free": seen["gpu_free"], "placement": placement_summary(seen["pool"], 0.5, 0.5),
                                    "s": time.monotonic() - t0}), flush=True)
    finally:
        ray.shutdown()
        try:
            cluster.shutdown()
        except Exception:  # the lost node's processes are already gone
            pass
''')


def _result(stdout: str, tag: str) -> dict:
    lines = [ln for ln in stdout.splitlines() if ln.startswith(tag + " ")]
    assert lines, f"no {tag} line"
    return json.loads(lines[-1][len(tag) + 1:])


def test_workers_spread_over_every_node_then_a_lost_node_s_clients_are_node_lost(tmp_path):
    script = tmp_path / "nodes.py"
    script.write_text(SCRIPT)
    # A session of its own: a worker on a node the test kills can outlive its raylet, hung in Ray's exit
    # handlers with ppid 1 (private_ray.stop_sessions); whatever of the cluster is left is stopped here.
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path), str(SWEEP_ROUNDS)], cwd=ROOT,
                            env=client_env(PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=480)
    finally:
        proc.kill()
        stop_sessions({proc.pid}, grace=5.0)
    assert proc.returncode == 0, (stdout[-3000:], stderr[-3000:])

    # 1. a sweep on the cluster: one trial on each node, every run directory in --out; the node lost
    # mid-sweep costs its trial only the rounds after its run's last checkpoint
    out = _result(stdout, "SWEEP")
    assert out["rc"] == 0, out["tail"]
    assert [len(nodes) for nodes in out["spread"]] == [3], out["spread"]  # the three trials ran one on each node
    assert out["lost"] in out["spread"][0], out
    with open(tmp_path / "sweep" / "sweep.csv") as fh:
        rows = list(csv.DictReader(fh))
    rounds = str(SWEEP_ROUNDS)
    assert [(x["seed"], x["status"], x["rounds"]) for x in rows] == [("0", "ok", rounds), ("1", "ok", rounds),
                                                                     ("2", "ok", rounds)]
    hit = out["rows_then"]["run"]
    assert out["tail"].count("Tune starts it again") == 1 and f"{hit}: its trial's process ended" in out["tail"]
    # the trial started again resumed its run from its last checkpoint: the rows that checkpoint covered
    # are there to the byte (their wall-clock seconds included, which a run started afresh would not
    # repeat); rows written after it were done again, with the same figures; then every later round once
    before = out["rows_then"]["text"].splitlines()
    after = (tmp_path / "sweep" / hit / "rounds.jsonl").read_text().splitlines()
    covered = out["rows_then"]["covered"]
    assert covered >= 2 and after[:covered] == before[:covered]

    def figures(line):
        return {k: v for k, v in json.loads(line).items() if not k.endswith("seconds")}
    assert [figures(x) for x in after[:len(before) - 1]] == [figures(x) for x in before[:-1]]
    assert [json.loads(line)["round"] for line in after] == list(range(1, SWEEP_ROUNDS + 1))
    assert not (tmp_path / "sweep" / ".incomplete").exists()  # nothing was set aside: no run started afresh
    placed = [json.loads((tmp_path / "sweep" / x["run"] / "summary.json").read_text())["placement"]["nodes"]
              for x in rows]
    assert all(len(nodes) == 1 for nodes in placed)
    assert out["lost"] not in {n for nodes in placed for n in nodes}  # the trial started again ran elsewhere

    # 2. spread: one worker on each node, each holding a fraction of one GPU
    out = _result(stdout, "LOSS")
    assert len(out["before"]) == 3
    assert sorted(w["node"] for w in out["pool"]) == out["before"]  # one worker on each node
    for w in out["pool"]:
        assert len(w["gpu_ids"]) == 1  # a fraction of one GPU, not a whole set
    placement = out["placement"]
    assert set(placement["nodes"]) == set(out["before"])
    assert all(n["workers"] == 1 and len(n["gpu_ids"]) == 1 for n in placement["nodes"].values())
    # Until the node was lost, each node had exactly 2 - 0.5 of its GPUs free: the requested fraction.
    during = [snap for snap in out["gpu_free"] if set(snap) == set(out["before"])]
    assert any(all(free == 1.5 for free in snap.values()) for snap in during), out["gpu_free"]

    # then node loss: the lost node held a worker, its clients are node_lost in round 2, the run completes
    rows = [json.loads(line) for line in (tmp_path / "node_loss" / "rounds.jsonl").read_text().splitlines()]
    assert out["summary"]["stop_reason"] == "completed" and out["summary"]["rounds_completed"] == 3
    assert len(out["after"]) == 2
    (lost_node,) = set(out["before"]) - set(out["after"])
    assert lost_node in {w["node"] for w in out["pool"]}  # a node that held a worker
    lost = rows[1]["dropped_clients"]["node_lost"]
    assert lost and rows[1]["dropped"] == {"node_lost": {"training": len(lost)}}
    assert rows[1]["survived"] == 6 - len(lost) > 0
    assert rows[0]["survived"] == rows[2]["survived"] == 6  # the replacement runs on the nodes left
    model = tmp_path / "node_loss" / "model.pt"
    assert rows[2]["test_accuracy"] is not None and model.stat().st_size > 0
