"""A Fu et al. 2022 run's final model on the Fashion-MNIST test split: accuracy per class, the labels
each client holds, and each client's accuracy on test images weighted by its own label mix (a reading
of the paper's "average test accuracy" as an average over clients' test sets).

    python docs/experiments/fu2022_per_class.py RUN_DIR

Measured 2026-11-26 on the published Adap DP-FL run (0.6177): per class 0.651 / 0.934 / 0.404 / 0.47 /
0.413 / 0.487 / 0.14 / 0.792 / 0.934 / 0.952; every client holds 9 or 10 labels (more than 2% of its
records); per client 0.565-0.694, mean 0.6177. See docs/reproductions.md (Fu et al. 2022).
"""
import sys
from pathlib import Path

import numpy as np
import torch

from dpfl_ray.data import build_federation
from dpfl_ray.scenario import load_scenario
from dpfl_ray.training.models import build_model


def main(run_dir: Path) -> None:
    torch.set_num_threads(1)
    sc = load_scenario(run_dir / "scenario.yaml")
    fed = build_federation(sc)
    ds = fed.dataset
    model = build_model(sc.model, ds.input_shape, ds.num_classes, sc.seed)
    model.load_state_dict(torch.load(run_dir / "model.pt", map_location="cpu"))
    model.eval()
    with torch.no_grad():
        pred = model(torch.from_numpy(ds.x_test)).argmax(1).numpy()
    y = ds.y_test
    per_class = np.array([(pred[y == k] == k).mean() for k in range(ds.num_classes)])
    print(f"overall {np.mean(pred == y):.4f}; per class", np.round(per_class, 3).tolist())
    matched = []
    for c in range(fed.num_clients):
        mix = np.bincount(ds.y_train[fed.client_indices(c)], minlength=ds.num_classes) / len(fed.client_indices(c))
        matched.append(float(mix @ per_class))
        print(f"client {c}: labels {np.flatnonzero(mix > 0.02).tolist()}, accuracy on its label mix {matched[-1]:.3f}")
    print(f"mean over clients {np.mean(matched):.4f}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
