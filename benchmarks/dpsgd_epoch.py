"""One DP-SGD epoch vs one plain SGD epoch of the MNIST CNN on a client's 600 examples (issue 13).

Both run in this process, single-threaded, after a warm-up; each figure is the median of
``--repeats`` epochs. The ratio DP / plain is the number to watch (goal: <= 2 on CPU at the same
batch size); the plain seconds are printed too, so the figure can be re-measured on another machine.

    PYTHONPATH=$PWD python benchmarks/dpsgd_epoch.py [--examples 600] [--batch-size 60] [--repeats 7]
"""
from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import numpy as np
import torch

from dpfl_ray.training.local import local_update
from dpfl_ray.training.local_dp import DPSGDConfig, dpsgd_update
from dpfl_ray.training.models import build_model, get_flat


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _paired(plain, dp, repeats: int) -> tuple[float, float, float]:
    """Median plain and DP seconds and the median of per-pair ratios.

    The two run alternately so that load from other processes hits both alike; the ratio of each
    pair is then steadier than the ratio of two medians.
    """
    plain(), dp()  # warm-up: first-call dispatch and allocator costs are not part of an epoch
    pairs = [(_seconds(plain), _seconds(dp)) for _ in range(repeats)]
    return (statistics.median(p for p, _ in pairs), statistics.median(d for _, d in pairs),
            statistics.median(d / p for p, d in pairs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=600)
    ap.add_argument("--batch-size", type=int, nargs="+", default=[10, 60, 100])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    model = build_model(SimpleNamespace(name="cnn"), (1, 28, 28), 10, seed=0).to(args.device)
    theta = get_flat(model)
    g = np.random.default_rng(0)
    x = g.random((args.examples, 1, 28, 28), dtype=np.float32)
    y = g.integers(0, 10, args.examples).astype(np.int64)
    print(f"MNIST CNN ({theta.size} params), {args.examples} examples, {args.threads} thread(s), "
          f"device {args.device}, median of {args.repeats}")
    for b in args.batch_size:
        def plain():
            local_update(model, theta, x, y, epochs=1, batch_size=b, lr=0.1, clip_norm=None,
                         rng=np.random.default_rng(1), torch_seed=1)
        for sampling in ("fixed", "poisson"):
            cfg = DPSGDConfig(clip_norm=1.0, noise_multiplier=1.1, lr=0.1, lot_size=b, sampling=sampling)

            def dp():
                dpsgd_update(model, theta, x, y, cfg, seed=0, round_idx=0, client_id=0)
            p, d, ratio = _paired(plain, dp, args.repeats)
            print(f"batch {b:4d}  dp-{sampling:7s}  plain {p:7.4f} s  dp {d:7.4f} s  ratio {ratio:4.2f}",
                  flush=True)


if __name__ == "__main__":
    main()
