"""Worker-pool sizing and client assignment (pure: no Ray import)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import DPFLError


@dataclass(frozen=True)
class PoolPlan:
    workers: int
    num_cpus: float
    num_gpus: float


# Workers that reserve neither CPU nor GPU all start at once, each a process with torch loaded (some
# hundred MB): beyond a few a CPU they only share it, and crowd out the coordinator.
UNRESERVED_WORKERS_PER_CPU = 4


def plan_pool(resources_cfg, cluster: dict, num_clients: int) -> PoolPlan:
    """How many ClientWorkers to start. ``auto`` fills the cluster: as many workers as the CPUs
    (and GPUs, if workers ask for them) allow, never more than there are clients."""
    cpus, gpus = resources_cfg.num_cpus_per_worker, resources_cfg.num_gpus_per_worker
    have_cpu, have_gpu = float(cluster.get("CPU", 0)), float(cluster.get("GPU", 0))
    if gpus > 0 and have_gpu < gpus:
        raise DPFLError(f"each worker asks for {gpus} GPU but the cluster has {have_gpu:g}",
                        field="resources.num_gpus_per_worker")
    if cpus > have_cpu:
        raise DPFLError(f"each worker asks for {cpus:g} CPUs but the cluster has {have_cpu:g}",
                        field="resources.num_cpus_per_worker")
    limits = []
    if cpus > 0:
        limits.append(math.floor(have_cpu / cpus + 1e-9))
    if gpus > 0:
        limits.append(math.floor(have_gpu / gpus + 1e-9))
    fits = min(limits) if limits else None
    if resources_cfg.workers != "auto":
        n = min(int(resources_cfg.workers), num_clients)
        free = max(1, math.floor(have_cpu)) * UNRESERVED_WORKERS_PER_CPU
        if fits is None and n > free:
            # nothing holds them back: Ray starts every one at once, each a process that loads torch
            raise DPFLError(f"{n} workers that reserve no CPU or GPU on a cluster of {have_cpu:g} CPUs: at most "
                            f"{free} ({UNRESERVED_WORKERS_PER_CPU} a CPU); give resources.num_cpus_per_worker or "
                            "fewer workers", field="resources.workers")
        if fits is not None and n > fits:
            # Ray would queue the extra actors forever: say so instead of hanging.
            raise DPFLError(
                f"{n} workers x ({cpus:g} CPU, {gpus:g} GPU) do not fit the cluster ({have_cpu:g} CPU, "
                f"{have_gpu:g} GPU); lower resources.num_cpus_per_worker or use workers: auto",
                field="resources.workers")
        return PoolPlan(n, cpus, gpus)
    n = fits if fits is not None else max(1, int(have_cpu))
    return PoolPlan(max(1, min(n, num_clients)), cpus, gpus)


# A sweep trial's driver loop and coordinator reserve no CPU of their own, as in `dpfl run`: Tune
# then schedules the trial's function with nothing (an empty head bundle). A placement group needs
# one bundle that is not empty, so a trial whose workers reserve nothing holds this token share.
TRIAL_HEAD_CPU = 0.01


def trial_workers(resources_cfg, num_clients: int, cluster: dict, side_by_side: int) -> int:
    """A sweep trial's pool size. ``workers: auto`` shares what ``dpfl run`` would fill (plan_pool)
    among the ``side_by_side`` trials that can run at once: one run alone gets the whole pool, eight
    runs on 2 CPUs get one worker each (a run's bits do not depend on its pool). A pool that does not
    fit the cluster is one line (plan_pool), as in ``dpfl run``: Tune would wait for it forever."""
    plan = plan_pool(resources_cfg, cluster, num_clients)
    if resources_cfg.workers != "auto":
        return plan.workers
    return max(1, plan.workers // max(1, side_by_side))


def trial_bundles(resources_cfg, workers: int) -> list[dict[str, float]]:
    """The placement group of one sweep trial (one federated run) of ``workers`` ClientWorkers: an
    empty head bundle for the trial's driver and coordinator, then one bundle per worker, sized
    from the scenario's ``resources``."""
    n = workers
    worker = {k: float(v) for k, v in (("CPU", resources_cfg.num_cpus_per_worker),
                                       ("GPU", resources_cfg.num_gpus_per_worker)) if v > 0}
    return [{}] + [worker] * n if worker else [{"CPU": TRIAL_HEAD_CPU}]


def trials_that_fit(cluster: dict, bundles: list[dict[str, float]]) -> int:
    """How many trials of these bundles the cluster's totals hold at once (at least 1: Ray then
    says what is missing). Bundles are summed per resource, which is exact on one node and an upper
    bound across nodes."""
    need = bundle_total(bundles)
    fits = [math.floor(float(cluster.get(k, 0)) / v + 1e-9) for k, v in need.items() if v > 0]
    return max(1, min(fits)) if fits else 1


def bundle_total(bundles: list[dict[str, float]]) -> dict[str, float]:
    """A placement group's bundles summed per resource."""
    need: dict[str, float] = {}
    for bundle in bundles:
        for k, v in bundle.items():
            need[k] = need.get(k, 0.0) + float(v)
    return need


def assign_clients(client_ids, sizes: np.ndarray, num_workers: int) -> list[list[int]]:
    """Split a round's clients over workers, balancing examples (largest first to the least
    loaded). Which worker runs a client never changes its result; this only balances time."""
    loads = [0] * num_workers
    out: list[list[int]] = [[] for _ in range(num_workers)]
    for cid in sorted((int(c) for c in client_ids), key=lambda c: (-int(sizes[c]), c)):
        w = min(range(num_workers), key=lambda i: (loads[i], i))
        out[w].append(cid)
        loads[w] += int(sizes[cid])
    return out


def summation_groups(dim: int, budget_bytes: int = 1 << 27) -> int:
    """How many partial sums a round keeps (the leaves of the aggregation tree): 64, halved until
    their float64 vectors fit ``budget_bytes``. It depends on the model only, never on the pool."""
    groups = 64
    while groups > 1 and groups * dim * 8 > budget_bytes:
        groups //= 2
    return groups


def assign_groups(client_ids, sizes: np.ndarray, groups: int, num_workers: int) -> list[dict[int, list[int]]]:
    """Clients in summation groups (client id mod ``groups``, each group in id order), whole groups
    to workers, balancing examples. A group's partial sum is computed in client-id order and the
    groups are added in group order, so the sum never depends on the number of workers."""
    grouped: dict[int, list[int]] = {}
    for cid in sorted(int(c) for c in client_ids):
        grouped.setdefault(cid % groups, []).append(cid)
    loads = [0] * num_workers
    out: list[dict[int, list[int]]] = [{} for _ in range(num_workers)]
    weight = {g: int(sum(int(sizes[c]) for c in ids)) for g, ids in grouped.items()}
    for g in sorted(grouped, key=lambda g: (-weight[g], g)):
        w = min(range(num_workers), key=lambda i: (loads[i], i))
        out[w][g] = grouped[g]
        loads[w] += weight[g]
    return out


def deal(items: list, k: int) -> list[list]:
    """``items`` dealt round-robin to ``k`` idle workers (fewer when there are fewer items): how the
    pool shares the server's evaluation ranges and SecAgg mask expansion."""
    return [items[i::k] for i in range(min(k, len(items)))]


def undeal(parts: list[list]) -> list:
    """Each worker's per-item results, back in item order (the inverse of ``deal``)."""
    n = sum(map(len, parts))
    return [parts[i % len(parts)][i // len(parts)] for i in range(n)]
