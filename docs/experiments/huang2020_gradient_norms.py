"""Per-example gradient norms of Huang et al.'s u100 model on Fashion-MNIST, against the paper's clip
S = 0.01: at the initial model and after non-private SGD steps (batches of 64, lr 0.05), on 1,000
training images, with the test accuracy at each point.

    python docs/experiments/huang2020_gradient_norms.py

Measured 2026-11-28 (quantiles 1 / 10 / 50 / 90 / 99%): at the initial model 1.29 / 1.47 / 1.75 /
2.09 / 2.32; after 100 steps (test accuracy 0.481) 4.69 / 6.97 / 11.1 / 15.8 / 19.9; after 400
(0.707) 0.0329 / 0.372 / 7.42 / 21 / 39.1. Every gradient is above 0.01 until the model fits some
records (99.8% after 400 steps). See docs/reproductions.md (Huang et al. 2020).
"""
from pathlib import Path

import numpy as np
import torch

from dpfl_ray.data import build_federation
from dpfl_ray.scenario import load_scenario
from dpfl_ray.training.local_dp import clip_and_sum, per_example_grad_fn
from dpfl_ray.training.models import build_model

SCENARIO = Path(__file__).resolve().parents[2] / "scenarios" / "papers" / "huang2020" / "dpfl.yaml"


def main() -> None:
    torch.set_num_threads(1)
    sc = load_scenario(SCENARIO)
    ds = build_federation(sc).dataset
    model = build_model(sc.model, ds.input_shape, ds.num_classes, sc.seed)
    rng = np.random.default_rng(0)
    idx = rng.choice(len(ds.y_train), 1000, replace=False)
    x, y = torch.from_numpy(ds.x_train[idx]), torch.from_numpy(ds.y_train[idx])
    x_test, y_test = torch.from_numpy(ds.x_test[:2000]), torch.from_numpy(ds.y_test[:2000])
    x_all, y_all = torch.from_numpy(ds.x_train), torch.from_numpy(ds.y_train)
    grads_of = per_example_grad_fn(model)

    def report(steps: int) -> None:
        params = {k: v.detach().clone() for k, v in model.named_parameters()}
        norms = torch.cat([clip_and_sum(grads_of(params, x[i:i + 250], y[i:i + 250]), 1.0)[1]
                           for i in range(0, len(y), 250)]).numpy()
        with torch.no_grad():
            accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
        quantiles = " / ".join(f"{v:.3g}" for v in np.quantile(norms, [0.01, 0.1, 0.5, 0.9, 0.99]))
        print(f"after {steps} SGD steps: test accuracy {accuracy:.3f}; per-example gradient norms, quantiles "
              f"1/10/50/90/99%: {quantiles}; above 0.01: {(norms > 0.01).mean():.3f}, above 0.1: "
              f"{(norms > 0.1).mean():.3f}", flush=True)

    report(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loss_fn = torch.nn.CrossEntropyLoss()
    steps = 0
    for target in (20, 100, 400):
        while steps < target:
            batch = torch.from_numpy(rng.choice(len(y_all), 64, replace=False))
            opt.zero_grad()
            loss_fn(model(x_all[batch]), y_all[batch]).backward()
            opt.step()
            steps += 1
        report(steps)


if __name__ == "__main__":
    main()
