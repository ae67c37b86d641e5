"""Carrying a round's planned faults out for real (ARCHITECTURE.md, principle 4): worker crashes
are ``ray.kill``, a lost node is a node whose raylet is killed, stragglers sleep on their worker
(workers.py). The plan itself is pure (dpfl_ray/faults/plan.py); this module only acts on it.
"""
from __future__ import annotations

import os
import signal
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..faults.plan import CRASH, NODE_LOST

# How long a node loss waits for the GCS to notice: its health checks (Ray's defaults: every 3 s,
# dead after 5 failures) take up to about 20 s.
NOTICED_SECONDS = 60.0


@ray.remote(num_cpus=0)
def _kill_own_raylet() -> None:  # pragma: no cover - runs on the node that is lost
    # a worker process is the raylet's child: killing the raylet takes the node and its workers down
    os.kill(os.getppid(), signal.SIGKILL)


def removable_nodes(keep: set[str]) -> list[str]:
    """Alive nodes, by id, that are neither the head nor in ``keep`` (the coordinator's node)."""
    out = []
    for node in ray.nodes():
        if node.get("Alive") and "node:__internal_head__" not in node.get("Resources", {}) \
                and node["NodeID"] not in keep:
            out.append(node["NodeID"])
    return sorted(out)


def _alive(node_id: str) -> bool:
    return any(n["NodeID"] == node_id and n.get("Alive") for n in ray.nodes())


def lose_node(node_id: str, timeout: float = 30.0, noticed_within: float = NOTICED_SECONDS) -> None:
    """Kill the node's raylet, then wait (at most ``noticed_within`` s) until the GCS lists the node
    as dead, as it does after a real node loss before any actor of it is reported dead. Until then
    the GCS still counts the node's freed CPUs as free and may place a replacement worker there,
    where it cannot start and would surface in the next round as a crash."""
    ref = _kill_own_raylet.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)).remote()
    try:
        ray.get(ref, timeout=timeout)
    except Exception:  # the node dies under the task: that is the point
        pass
    end = time.monotonic() + noticed_within
    while _alive(node_id) and time.monotonic() < end:
        time.sleep(0.1)


def strike(workers: list, nodes: dict, faults, phase: str, keep: set[str], missed: list | None = None) -> dict:
    """Carry out the crashes and node losses ``faults`` plans for ``phase``. ``nodes`` maps a
    worker handle to its node id. Returns {worker handle: cause} for the workers taken down; a
    node loss with no removable node (a one-node cluster) takes nothing down, and is appended to
    ``missed`` as ``node_failure@PHASE``, so that the run says which planned faults did not happen."""
    struck = {}
    for crash in faults.crashes:
        if crash.phase == phase and crash.worker < len(workers):
            ray.kill(workers[crash.worker], no_restart=True)
            struck[workers[crash.worker]] = CRASH
    for loss in faults.nodes_lost:
        if loss.phase != phase:
            continue
        candidates = removable_nodes(keep)
        if not candidates:
            if missed is not None:
                missed.append(f"node_failure@{phase}")
            continue
        node = candidates[loss.pick % len(candidates)]
        lose_node(node)
        struck.update({w: NODE_LOST for w in workers if nodes.get(w) == node})
    return struck
