"""The compute floor of a workload: the same SGD steps in one plain PyTorch process, one thread,
one client after another.

Same data (the workload's federation), model, clients per round (its sampling and fault plan),
batch sizes, epochs and batch orders as ``dpfl run``; FedAvg's weighted mean moves the model
between rounds; the test split is evaluated after the same rounds as dpfl evaluates it
(``output.eval_every`` and the last round), with the same evaluation code, because users want the
accuracy curve (issue #35). What it leaves out is everything a simulator adds around the steps:
privacy noise, clipping, secure aggregation, Ray. Run it in its own process for a clean
whole-process time:

    python -m benchmarks.floor W1 --json

Two workers' batched training compute, emulated without Ray (the slower share is the time):

    taskset -c 0 python -m benchmarks.floor W1 --share 0/2 --batched &
    taskset -c 1 python -m benchmarks.floor W1 --share 1/2 --batched; wait
"""
from __future__ import annotations

import argparse
import json
import time

_T0 = time.time()  # whole-process clocks start before the heavy imports below

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402


def train_floor(sc, fed, share: tuple[int, int] = (0, 1), batched: bool = False) -> dict:
    """Plain minibatch SGD (FedAvg, McMahan et al. 2017, Alg. 1 ClientUpdate) of every trained
    client of every round of ``sc``, and the test split's evaluation after every round dpfl evaluates
    (coordinator: round t when (t + 1) % eval_every == 0, and the last); returns seconds (training
    and evaluation, and the evaluation's share), SGD steps, per-round mean training loss and the
    evaluated rounds' test accuracy.

    ``share=(i, n)`` trains only every n-th client of each round from the i-th, and ``batched``
    trains them with dpfl_ray.training.local_batched: n such processes side by side emulate n workers'
    training compute without Ray (no per-step losses then). The process's heap is set as a worker's
    (dpfl_ray.training.heap), so the two compare like for like."""
    from dpfl_ray.training.heap import keep_freed_memory

    keep_freed_memory()
    if batched:
        return _train_share_batched(sc, fed, share)
    from dpfl_ray import rng as rngmod
    from dpfl_ray.training.models import build_model, evaluate

    from .workloads import trained_clients

    torch.set_num_threads(1)
    tr, every = sc.training, sc.output.eval_every
    eval_seconds, accuracy = 0.0, {}
    model = build_model(sc.model, fed.dataset.input_shape, fed.dataset.num_classes, sc.seed)
    params = list(model.parameters())
    global_w = [p.detach().clone() for p in params]
    x_all, y_all = torch.from_numpy(fed.dataset.x_train), torch.from_numpy(fed.dataset.y_train)
    loss_fn = nn.CrossEntropyLoss()
    steps, updates, round_losses = 0, 0, []
    t0 = time.perf_counter()
    for t in range(tr.rounds):
        total = [torch.zeros_like(w) for w in global_w]
        weight_sum, losses = 0.0, []
        for cid in trained_clients(sc, t)[share[0]::share[1]]:
            idx = torch.from_numpy(fed.client_indices(cid))
            x, y = x_all[idx], y_all[idx]
            with torch.no_grad():
                for p, w in zip(params, global_w):
                    p.copy_(w)
            g = rngmod.generator(sc.seed, "batches", t, cid)
            for _ in range(tr.local_epochs):
                order = torch.from_numpy(g.permutation(len(y)))
                for lo in range(0, len(y), tr.batch_size):
                    batch = order[lo:lo + tr.batch_size]
                    model.zero_grad(set_to_none=True)
                    loss = loss_fn(model(x[batch]), y[batch])
                    loss.backward()
                    with torch.no_grad():
                        for p in params:
                            p.add_(p.grad, alpha=-tr.lr)
                    steps += 1
                    losses.append(loss.item())
            weight = float(fed.weights[cid])
            with torch.no_grad():
                for acc, p, w in zip(total, params, global_w):
                    acc.add_(p - w, alpha=weight)
            weight_sum += weight
            updates += 1
        if weight_sum > 0:
            for w, acc in zip(global_w, total):
                w.add_(acc, alpha=tr.server_lr / weight_sum)
        round_losses.append(float(np.mean(losses)) if losses else None)
        if (t + 1) % every == 0 or t + 1 == tr.rounds:
            t_eval = time.perf_counter()
            with torch.no_grad():
                for p, w in zip(params, global_w):
                    p.copy_(w)
            accuracy[t + 1] = evaluate(model, fed.dataset.x_test, fed.dataset.y_test)[0]
            eval_seconds += time.perf_counter() - t_eval
    elapsed = time.perf_counter() - t0
    return {"train_seconds": elapsed, "eval_seconds": eval_seconds,
            "train_seconds_without_eval": elapsed - eval_seconds, "sgd_steps": steps,
            "client_updates": updates, "rounds": tr.rounds, "round_mean_loss": round_losses,
            "test_accuracy": accuracy}


def _train_share_batched(sc, fed, share: tuple[int, int]) -> dict:
    from dpfl_ray import rng as rngmod
    from dpfl_ray.training.local_batched import batched_local_updates, warm_up
    from dpfl_ray.training.models import build_model, get_flat

    from .workloads import trained_clients

    torch.set_num_threads(1)
    tr, ds = sc.training, fed.dataset
    model = build_model(sc.model, ds.input_shape, ds.num_classes, sc.seed)
    warm_up(model, ds.input_shape, tr.batch_size, ds.num_classes)  # a worker does this at start
    theta = get_flat(model)
    steps = updates = 0
    t0 = time.perf_counter()
    for t in range(tr.rounds):
        ids = trained_clients(sc, t)[share[0]::share[1]]
        if not ids:
            continue
        idx = [fed.client_indices(c) for c in ids]
        deltas = batched_local_updates(
            model, theta, [ds.x_train[i] for i in idx], [ds.y_train[i] for i in idx], epochs=tr.local_epochs,
            batch_size=tr.batch_size, lr=tr.lr, clip_norm=tr.clip_norm,
            rngs=[rngmod.generator(sc.seed, "batches", t, c) for c in ids],
            torch_seeds=[rngmod.int_seed(sc.seed, "torch", t, c) for c in ids])
        w = np.array([float(fed.weights[c]) for c in ids])
        theta = (theta + tr.server_lr * np.tensordot(w, np.stack(deltas), axes=1) / w.sum()).astype(np.float32)
        steps += sum(tr.local_epochs * -(-len(i) // tr.batch_size) for i in idx)
        updates += len(ids)
    return {"train_seconds": time.perf_counter() - t0, "sgd_steps": steps, "client_updates": updates,
            "rounds": tr.rounds, "round_mean_loss": []}


def run(name: str, overrides: list[str] | None = None, share: tuple[int, int] = (0, 1),
        batched: bool = False) -> dict:
    from dpfl_ray.data import build_federation

    from .workloads import scenario

    sc = scenario(name, overrides)
    fed = build_federation(sc)
    setup = time.time() - _T0
    out = train_floor(sc, fed, share, batched)
    return {"workload": name, "setup_seconds": setup, "share": list(share), "batched": batched, **out}


def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="the compute floor of a dpfl bench workload")
    ap.add_argument("workload")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="scenario override key=value")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--share", default="0/1", help="I/N: train only the I-th of N shares of each round's clients")
    ap.add_argument("--batched", action="store_true", help="train the share with dpfl_ray.training.local_batched")
    args = ap.parse_args(argv)
    i, n = (int(v) for v in args.share.split("/"))
    if not 0 <= i < n:
        ap.error(f"--share {args.share}: need 0 <= I < N")
    out = run(args.workload, args.overrides, (i, n), args.batched)
    out["peak_rss_bytes"] = peak_rss_bytes()
    out["process_seconds_before_exit"] = time.time() - _T0
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{args.workload}: {out['sgd_steps']} SGD steps of {out['client_updates']} client updates in "
              f"{out['train_seconds']:.2f}s (setup {out['setup_seconds']:.2f}s)")


if __name__ == "__main__":
    main()
