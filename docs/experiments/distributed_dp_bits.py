"""The accounted epsilon of Baek et al.'s CI round with integer noise inside SecAgg, by ring width
(docs/distributed_dp.md): python docs/experiments/distributed_dp_bits.py

The setting of scenarios/baek2021_ci_z1_drop30_calibrated.yaml as the paper books it without
dropouts: z = 1, C = 1, noise std 2Cz on the weighted sum, replace-one sensitivity 2C, about 50
clients a round (5,000 users, q = 0.01), 100 rounds, delta = 1e-5, and the CNN's 26,010 values.
"""
import dp_accounting
from dp_accounting.rdp import RdpAccountant

from dpfl_ray.privacy import discrete_rdp as discrete

Q, Z, C, ROUNDS, SHARES, DIM, DELTA = 0.01, 1.0, 1.0, 100, 50, 26010, 1e-5


def main() -> None:
    exact = RdpAccountant(orders=list(discrete.ORDERS))
    exact.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(Q, dp_accounting.GaussianDpEvent(Z)), ROUNDS))
    generic = discrete.epsilon(ROUNDS * discrete.rdp_curve(lambda a: a / (2 * Z * Z), rate=Q), DELTA)
    print(f"continuous Gaussian, dp_accounting's sampled-Gaussian RDP: epsilon {exact.get_epsilon(DELTA):.4f}")
    print(f"continuous Gaussian, Zhu & Wang's generic amplification:   epsilon {generic:.4f}")
    print("| bits | mechanism | scale (steps per unit) | noise variance per client | wrap bound | rounded l2 / 2C scale "
          "| epsilon | without Thm. 5's factor 3 (not proven a bound) |")
    print("|---|---|--:|--:|--:|--:|--:|--:|")
    for bits in (12, 14, 16, 18, 20, 24):
        for mechanism in discrete.MECHANISMS:
            plan = discrete.plan_ring(mechanism, bits, SHARES, DIM, C, 2 * C * Z, 2 * C)
            eps = discrete.epsilon(ROUNDS * discrete.rdp_curve(plan.event.rdp, rate=Q), DELTA)
            tight = discrete.epsilon(ROUNDS * discrete.rdp_curve(plan.event.rdp, rate=Q, bound=_without_factor_3), DELTA)
            print(f"| {bits} | {mechanism} | {plan.scale:.4g} | {plan.local_variance:.4g} | "
                  f"{plan.wrap_probability:.2g} | {plan.event.l2 / (2 * C * plan.scale):.4f} | {eps:.4f} | {tight:.4f} |")


def _without_factor_3(order, rate, rdp):
    return discrete.poisson_subsampled_rdp(order, rate, rdp, generic=False)


if __name__ == "__main__":
    main()
