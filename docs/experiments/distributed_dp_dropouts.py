"""What Baek's calibrations (Alg. 2, and Alg. 3's baek-extended) and the layered (Dordis XNoise) mode
cost with integer noise, against
the continuous Gaussian, at 10% and 30% dropout (docs/distributed_dp.md):
python docs/experiments/distributed_dp_dropouts.py

Baek et al.'s setting, booked as the runs book it: 5,000 users, q = 0.01, the same 50 sampled
every round and the first 45 or 35 of them delivering, z = 1, C = 0.5, F = 0.5 (layered tolerates
25 dropouts), 100 rounds, delta = 1e-5, the CNN's 26,010 values; Skellam and discrete Gaussian
shares at 20 bits (the discrete Gaussian's layers made of equal draws). Every survivor calibrates. Each figure is the project's own ledger (algorithms/baek.py,
runtime/privacy.py): the public epsilon under Poisson sampling and the epsilon against the
server, which picks the sample (unamplified, worst-off client).
"""
import numpy as np

from dpfl_ray.algorithms import CalibrationSum, RoundOutcome
from dpfl_ray.algorithms.baek import Baek
from dpfl_ray.runtime.privacy import RunPrivacy
from dpfl_ray.scenario import scenario_from_dict

USERS, Q, SAMPLED, Z, C, ROUNDS, DIM = 5000, 0.01, 50, 1.0, 0.5, 100, 26010


def ledger(noise: str, mode: str, dropout: float) -> dict:
    sc = scenario_from_dict({
        "seed": 0, "data": {"source": "synthetic", "num_clients": USERS}, "training": {"algorithm": "baek"},
        "sampling": {"mode": "poisson", "rate": Q, "clients_per_round": None},
        "privacy": {"noise_multiplier": Z, "clipping": {"norm": C}, "accountant": "rdp", "calibration": mode,
                    "min_weight_fraction": 0.5, "distributed_noise": noise},
        "secagg": {"enabled": True, "bits": 32 if noise == "gaussian" else 20}})
    alg, run = Baek(sc, np.ones(USERS), Z), RunPrivacy(sc, np.ones(USERS))
    alg.bind_model(DIM)
    run.bind(alg)
    sampled = list(range(SAMPLED))
    survivors = sampled[:round(SAMPLED * (1 - dropout))]
    for t in range(ROUNDS):
        assert alg.begin_round(t, sampled) is None
        alg.after_upload(survivors)
        if mode in ("baek", "baek-extended"):  # every survivor's calibration term arrives
            alg.release(RoundOutcome(t, tuple(survivors), total=np.zeros(DIM),
                                     calibration=CalibrationSum(np.zeros(DIM), tuple(survivors))))
        run.account(t, RoundOutcome(t, tuple(survivors), theta=np.zeros(DIM, np.float32)), "")
    return run.to_dict()


def main() -> None:
    noises = ("gaussian", "skellam", "discrete_gaussian")
    print("| dropout | calibration | epsilon, Gaussian | epsilon, Skellam 20 bits | epsilon, discrete Gaussian 20 bits "
          "| against the server, Gaussian | against the server, Skellam 20 bits | against the server, discrete "
          "Gaussian 20 bits |")
    print("|--:|---|--:|--:|--:|--:|--:|--:|")
    for dropout in (0.1, 0.3):
        for mode in ("none", "baek", "baek-extended", "layered"):
            books = [ledger(noise, mode, dropout) for noise in noises]
            print(f"| {dropout:.0%} | {mode} | " + " | ".join(f"{b['epsilon']:.4f}" for b in books) + " | "
                  + " | ".join(f"{b['epsilon_vs_server']:.3f}" for b in books) + " |")


if __name__ == "__main__":
    main()
