"""Fu et al. 2022 on full Fashion-MNIST: per-example gradient norms at the initial model, inputs in
[0, 1] against standardized ((x - 0.2860) / 0.3530, ``data.normalize``), for 200 training images.

    python docs/experiments/fu2022_input_norms.py

Measured 2026-12-02 (AMD EPYC): 10th / 50th / 90th percentile 1.46 / 1.76 / 2.07 in [0, 1], 2.37 /
3.23 / 4.10 standardized: both above the threshold C = 1 of the constant-sigma runs.
See docs/reproductions.md (Fu et al. 2022, experiment 10).
"""
import numpy as np
import torch

from dpfl_ray.data import build_federation
from dpfl_ray.scenario import load_scenario
from dpfl_ray.training.local_dp import per_example_grad_fn
from dpfl_ray.training.models import build_model


def main() -> None:
    torch.set_num_threads(1)
    for label, overrides in (("[0, 1]", []), ("standardized", ["data.normalize=[0.2860, 0.3530]"])):
        sc = load_scenario("scenarios/papers/fu2022/const_sigma.yaml", overrides)
        ds = build_federation(sc).dataset
        model = build_model(sc.model, ds.input_shape, ds.num_classes, sc.seed)
        params = {k: v.detach() for k, v in model.named_parameters()}
        idx = np.random.default_rng(0).choice(len(ds.y_train), 200, replace=False)
        grads = per_example_grad_fn(model)(params, torch.from_numpy(ds.x_train[idx]), torch.from_numpy(ds.y_train[idx]))
        norms = torch.sqrt(sum((g.reshape(len(idx), -1) ** 2).sum(1) for g in grads.values())).numpy()
        print(f"{label}: per-example gradient norm, 10th / 50th / 90th percentile",
              " / ".join(f"{q:.2f}" for q in np.quantile(norms, [0.1, 0.5, 0.9])))


if __name__ == "__main__":
    main()
