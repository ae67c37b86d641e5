"""Workers per GPU: the ClientWorker's training path in 1, 2, 4, 8 processes sharing one GPU.

Ray cannot be installed on the lent GPU machines (no registry, and its wheel is larger than what
travels there), so this measures what a ClientWorker does each round -- local training of its
share of the round's clients, sequentially (dpfl_ray.training.local) or batched (dpfl_ray.training.local_batched) --
in k concurrent processes on one device, the round's clients split between them as the runtime
splits them. Data are random tensors of the workload's shapes (throughput does not depend on the
values). Prints one JSON object per configuration.

    python benchmarks/gpu_workers.py --device cuda --workload W1 --workers 1,2,4,8 --path batched
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time

import numpy as np

WORKLOADS = {  # clients, examples each, per round, rounds, batch size (issue #14)
    "W1": (100, 50, 10, 30, 10),
    "W2": (1000, 5, 100, 10, 5),
}


def _worker(rank, k, workload, device, path, barrier, out):
    import torch

    from types import SimpleNamespace

    from dpfl_ray.training.local import local_update
    from dpfl_ray.training.models import build_model, get_flat

    torch.set_num_threads(1)
    clients, n, per_round, rounds, batch = WORKLOADS[workload]
    model = build_model(SimpleNamespace(name="cnn", hidden=[]), (1, 28, 28), 10, seed=0).to(device)
    theta = get_flat(model)
    g = np.random.default_rng(rank)
    x = g.random((clients, n, 1, 28, 28), dtype=np.float32)
    y = g.integers(0, 10, (clients, n))
    batched = None
    if path == "batched":
        from dpfl_ray.training import local_batched

        batched = local_batched
        local_batched.warm_up(model, (1, 28, 28), batch, 10)
    else:  # the first step pays CUDA's kernel selection: not part of a round
        local_update(model, theta, x[0], y[0], epochs=1, batch_size=batch, lr=0.15, clip_norm=None,
                     rng=np.random.default_rng(0), torch_seed=0)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    barrier.wait()
    start = time.perf_counter()
    updates = 0
    for t in range(rounds):
        mine = [c for i, c in enumerate(g.choice(clients, per_round, replace=False)) if i % k == rank]
        if batched is not None:
            batched.batched_local_updates(model, theta, [x[c] for c in mine], [y[c] for c in mine],
                                          epochs=1, batch_size=batch, lr=0.15, clip_norm=None,
                                          rngs=[np.random.default_rng([t, c]) for c in mine],
                                          torch_seeds=[int(c) for c in mine])
        else:
            for c in mine:
                local_update(model, theta, x[c], y[c], epochs=1, batch_size=batch, lr=0.15, clip_norm=None,
                             rng=np.random.default_rng([t, c]), torch_seed=int(c))
        updates += len(mine)
        barrier.wait()  # a round ends when its slowest worker is done
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    out.put((rank, time.perf_counter() - start, updates))


def measure(workload: str, k: int, device: str, path: str) -> dict:
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(k), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, k, workload, device, path, barrier, out)) for r in range(k)]
    for p in procs:
        p.start()
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    seconds = max(r[1] for r in results)
    updates = sum(r[2] for r in results)
    return {"workload": workload, "workers": k, "device": device, "path": path, "train_seconds": round(seconds, 3),
            "client_updates_per_second": round(updates / seconds, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--workload", default="W1,W2")
    ap.add_argument("--workers", default="1,2,4,8")
    ap.add_argument("--path", default="sequential,batched")
    args = ap.parse_args()
    for workload in args.workload.split(","):
        for path in args.path.split(","):
            for k in map(int, args.workers.split(",")):
                print(json.dumps(measure(workload, k, args.device, path)), flush=True)


if __name__ == "__main__":
    main()
