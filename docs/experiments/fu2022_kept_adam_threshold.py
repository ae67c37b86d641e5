"""Fu et al. 2022 on full Fashion-MNIST: Adap DP-FL's own local procedure, without Ray, with each
client's Adam moments kept across rounds (``optimizer_state: client``) or a new Adam every round.

It runs the project's AdapDPFL algorithm and AdapDPSGD procedure for every client in one process
(the rounds of ``dpfl run``, minus the runtime), on scenarios/papers/fu2022/adap.yaml with alpha as
given, and prints the test accuracy on 2,000 test images, client 0's threshold and its Adam moments.

    python docs/experiments/fu2022_kept_adam_threshold.py client 0.01 150
    python docs/experiments/fu2022_kept_adam_threshold.py round 0.01 150
    python docs/experiments/fu2022_kept_adam_threshold.py client null 150   # the constant C = 1

Measured 2026-11-26 (Intel Xeon, 2 cores, beside other runs): with alpha = 0.01 eq. 6 takes the
threshold from C_0 = 1.94 to the 1e-6 floor by round 5. A kept second moment remembers the first
rounds' gradients, about a million times larger than the later ones, and Adam's steps vanish:
``client``: test accuracy 0.095 at rounds 50 and 100, client 0's mean sqrt(v) 2.45e-3 and 2.39e-3
against gradients of order 1e-8. ``round``: 0.095 at both (a new Adam's first step is about lr x
sign, and learning starts near round 300 in the full run). See docs/reproductions.md (Fu et al. 2022).
"""
import sys

import numpy as np
import torch

from dpfl_ray.algorithms import make_algorithm
from dpfl_ray.algorithms.base import RoundOutcome
from dpfl_ray.data import build_federation
from dpfl_ray.scenario import load_scenario
from dpfl_ray.training.models import build_model, evaluate, get_flat, set_flat


def main(mode: str, alpha: str, rounds: int, every: int = 50) -> None:
    torch.set_num_threads(1)
    sc = load_scenario("scenarios/papers/fu2022/adap.yaml",
                       [f"privacy.adap_dpfl.optimizer_state={mode}", f"privacy.adap_dpfl.alpha={alpha}"])
    fed = build_federation(sc)
    ds = fed.dataset
    model = build_model(sc.model, ds.input_shape, ds.num_classes, sc.seed)
    alg = make_algorithm(sc, fed.weights, sizes=fed.sizes)
    theta = get_flat(model).copy()
    clients = list(range(fed.num_clients))
    for r in range(rounds):
        alg.begin_round(r, clients)
        proc = alg.client_spec().local
        out = {}
        for c in clients:
            idx = fed.client_indices(c)
            out[c] = proc.run(model, theta, ds.x_train[idx], ds.y_train[idx], seed=sc.seed, round_idx=r, client_id=c)
        total = sum(fed.weights[c] * out[c][0] for c in clients)
        agg = alg.finish(RoundOutcome(round=r, survivors=tuple(clients), total=total,
                                      reports={c: rep for c, (_, rep) in out.items()}), theta.size)
        theta = theta + agg.delta
        if (r + 1) % every == 0:
            set_flat(model, theta)
            acc, loss = evaluate(model, ds.x_test[:2000], ds.y_test[:2000])
            st = alg.adam_states.get(0)
            moments = (f" adam step {st.step} mean |m| {np.abs(st.exp_avg).mean():.3g} "
                       f"mean sqrt(v) {np.sqrt(st.exp_avg_sq).mean():.3g}") if st else ""
            print(f"{mode} alpha {alpha} round {r + 1}: test accuracy {acc:.4f} loss {loss:.4f} "
                  f"threshold {alg.clips.get(0, sc.privacy.clipping.norm):.3g}{moments}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
