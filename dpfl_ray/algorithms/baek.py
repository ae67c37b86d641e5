"""Baek et al. 2021, "Enhancing Differential Privacy for Federated Learning at Scale": DP-FL robust
to user dropouts (Algorithms 2 and 3), with an honest ledger.

Round t (Alg. 2 lines 10-24): the server samples U^t (rate q), broadcasts n = sum_{U^t} w_i and
sigma = 2Cz/n; each user clips its update to C (Alg. 1), draws e_i ~ N(0, n w_i sigma^2 I) and
sends M_i = w_i Delta_i + e_i through secure aggregation. The survivors U_A (whose M_i arrived)
have weight n'. What happens next is ``privacy.calibration``:

* ``none``: theta += sum M_i / n'. The noise left has std sqrt(n/n') sigma (Sec. IV.B).
* ``baek``: if anyone dropped, the server broadcasts n' and sigma' = 2Cz/n'; each survivor sends
  -e_i + N(0, n' w_i sigma'^2 I) and the server adds their average (Alg. 2 lines 20-24).
* ``baek-extended``: users start from the noise of a floor n_0 (Alg. 3 line 26), the server aborts
  a round whose sampled weight is below n_0, and the calibration always runs.
* ``layered``: each user's noise is a sum of layers 0..L whose seeds (1..L) are Shamir-shared in
  SecAgg; after d dropouts the server reconstructs and subtracts layers d+1..L of the survivors,
  so the released sum carries exactly (2Cz)^2 and nothing else is released (after Dordis, Jiang
  et al. EuroSys 2024). More than L dropouts abort the round.

The server's view decides the effective noise multiplier the ledger books
(:mod:`dpfl_ray.privacy.dropouts`, docs/baek2021.md); the claimed one is z.

The functions at module level are what a *client* computes (they run on the workers); the class
is the server's side.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from .. import rng as rngmod
from ..privacy.dropouts import (
    calibrates, effective_noise_multipliers, layer_variances, planned_noise_multipliers, tolerated_dropouts,
)
from .base import Aggregate
from .dp_fedavg import make_sampling


# -- the client's side ---------------------------------------------------------------------------
def _normal(generator: np.random.Generator, std: float, dim: int) -> np.ndarray:
    return generator.standard_normal(dim, dtype=np.float64) * std


def layer_seed(noise: dict, cid: int, layer: int) -> bytes:
    """32-byte PRG seed of one noise layer. Derived from the scenario seed so runs repeat; a
    deployment would draw it from os.urandom -- the server only ever uses reconstructed seeds."""
    msg = f"dpfl-layer|{noise['seed']}|{noise['round']}|{cid}|{layer}".encode()
    return hashlib.sha256(msg).digest()


def layer_noise(seed: bytes, std: float, dim: int) -> np.ndarray:
    """The layer's Gaussian vector, regenerated identically by anyone holding ``seed``."""
    return _normal(np.random.default_rng(int.from_bytes(seed, "big")), std, dim)


def client_noise(noise: dict, cid: int, weight: float, dim: int) -> np.ndarray:
    """e_i of Alg. 2 line 15 (or Alg. 3 line 26, or the layered sum), float64."""
    mode, big_t = noise["mode"], noise["T"]
    if mode == "layered":
        stds = big_t * np.sqrt(np.asarray(noise["variances"]))
        out = _normal(rngmod.generator(noise["seed"], "layers", noise["round"], cid), stds[0], dim)
        for k in range(1, len(stds)):
            out += layer_noise(layer_seed(noise, cid, k), stds[k], dim)
        return out
    first = noise["n0"] if mode == "baek-extended" else noise["n"]
    # N(0, n w_i sigma^2) with sigma = 2Cz/n, i.e. std T sqrt(w_i / n)
    return _normal(rngmod.generator(noise["seed"], "noise", noise["round"], cid), big_t * np.sqrt(weight / first), dim)


def calibration_term(noise: dict, cid: int, weight: float, dim: int, n_prime: float) -> np.ndarray:
    """-e_i + N(0, n' w_i sigma'^2 I), sigma' = 2Cz/n' (Alg. 2 line 22). The client redraws e_i from
    its stream instead of keeping it."""
    fresh = _normal(rngmod.generator(noise["seed"], "calibration", noise["round"], cid),
                    noise["T"] * np.sqrt(weight / n_prime), dim)
    return fresh - client_noise(noise, cid, weight, dim)


def client_layer_seeds(noise: dict, cid: int) -> list[bytes]:
    """Seeds of layers 1..L, to be Shamir-shared in SecAgg (empty unless layered)."""
    if noise.get("mode") != "layered":
        return []
    return [layer_seed(noise, cid, k) for k in range(1, len(noise["variances"]))]


# -- the server's side ---------------------------------------------------------------------------
@dataclass
class RoundPlan:
    round: int
    sampled: list[int]
    n: float
    noise: dict
    tolerated: int | None = None  # layered: L
    dropped: int = 0  # layered: d, sampled clients whose masked input did not arrive
    n_prime: float | None = None
    extras: dict = field(default_factory=dict)


class Baek:
    name = "baek"
    covered = True

    def __init__(self, scenario, weights: np.ndarray, noise_multiplier: float):
        p = scenario.privacy
        self.seed = scenario.seed
        self.mode = p.calibration
        self.min_fraction = p.min_weight_fraction
        self.clip_norm = float(p.clipping.norm)
        self.z = float(noise_multiplier)
        self.weights = np.asarray(weights, dtype=np.float64)
        self.sampling, frac = make_sampling(scenario.sampling, len(weights))
        self.expected_weight = frac * float(np.sum(self.weights))
        self.n0 = self.min_fraction * self.expected_weight if self.mode == "baek-extended" else None
        self.plan: RoundPlan | None = None
        self.last_effective = self.z

    # what the ledger books
    @property
    def multipliers(self) -> list[float]:
        """The planned round without dropouts, as the server's view guarantees it (z, except for
        baek-extended, which always hands the server two views): the shadow ledger's budget check."""
        return [planned_noise_multipliers(self.z, self.mode, min_weight_fraction=self.min_fraction)[1]]

    def upload_effective(self) -> float:
        """This round's effective multiplier once U_A is known, if every survivor calibrates (the
        worst case: a calibration dropout leaves its first noise in, which only adds noise)."""
        plan = self.plan
        return effective_noise_multipliers(self.z, self.mode, plan.n, plan.n_prime, 0.0, self.n0)[1]

    def round_mechanism(self) -> tuple[list[float], list[float] | None]:
        """(effective, claimed) multipliers of the round just released."""
        return [self.last_effective], [self.z]

    # phases of the round
    def begin_round(self, round_idx: int, sampled) -> str | None:
        """Alg. 2 line 12 / Alg. 3 line 17. Returns why the round is aborted, or None."""
        sampled = sorted(int(c) for c in sampled)
        n = float(self.weights[sampled].sum()) if sampled else 0.0
        noise = {"mode": self.mode, "seed": self.seed, "round": round_idx, "T": 2.0 * self.clip_norm * self.z,
                 "n": n, "n0": self.n0, "N": len(sampled)}
        self.plan = RoundPlan(round_idx, sampled, n, noise)
        if not sampled:
            return "no client sampled"
        if self.mode == "baek-extended" and n < self.n0:
            return f"sampled weight {n:.4g} is below n_0 = {self.n0:.4g} (baek-extended, Alg. 3 line 17)"
        if self.mode == "layered":
            self.plan.tolerated = tolerated_dropouts(len(sampled), self.min_fraction)
            noise["variances"] = layer_variances(len(sampled), self.plan.tolerated).tolist()
        return None

    def client_spec(self) -> dict:
        return {"clip_norm": self.clip_norm, "noise": self.plan.noise}

    def after_upload(self, survivors: list[int]) -> dict | str:
        """Once U_A is known (Alg. 2 line 18-20): what the unmask request carries -- the calibration
        broadcast n', or the layers to reveal -- or why the round is aborted."""
        plan = self.plan
        plan.n_prime = float(self.weights[survivors].sum()) if survivors else 0.0
        if self.mode == "layered":
            dropped = len(plan.sampled) - len(survivors)
            if dropped > plan.tolerated:
                return (f"{dropped} of {len(plan.sampled)} sampled clients dropped; the layers tolerate "
                        f"{plan.tolerated} (privacy.min_weight_fraction={self.min_fraction:g})")
            plan.dropped = dropped
            plan.extras = {"layers_from": dropped + 1} if dropped < plan.tolerated else {}
        elif calibrates(self.mode, plan.n, plan.n_prime):
            plan.extras = {"calibration": {"n_prime": plan.n_prime}}
        else:
            plan.extras = {}
        return plan.extras

    def release(self, total: np.ndarray, survivors: list[int], calibration: dict | None = None,
                layer_seeds: dict | None = None) -> tuple[np.ndarray, dict]:
        """The released sum (Alg. 2 line 24 times n') from the decoded SecAgg sum of M_i, the summed
        calibration terms ``{"sum", "clients"}`` and the reconstructed layer seeds
        ``{client: {layer: seed}}``; and the round's noise figures."""
        plan = self.plan
        dim = total.shape[0]
        released = np.asarray(total, dtype=np.float64).copy()
        n_prime = float(self.weights[survivors].sum())
        w_cal_dropped, info = 0.0, {}
        if "calibration" in plan.extras:
            senders = sorted((calibration or {}).get("clients", []))
            if senders:
                released += calibration["sum"]
            w_cal_dropped = n_prime - float(self.weights[senders].sum()) if senders else n_prime
            info["calibration_senders"] = len(senders)
        if self.mode == "layered":
            stds = plan.noise["T"] * np.sqrt(np.asarray(plan.noise["variances"]))
            removed = 0
            for cid, layers in sorted((layer_seeds or {}).items()):
                for k, seed in sorted(layers.items()):
                    released -= layer_noise(seed, stds[k], dim)
                    removed += 1
            expected = len(survivors) * (plan.tolerated - plan.dropped)  # layers d+1..L of each survivor
            if removed != expected:
                raise RuntimeError(f"layered: {removed} layers reconstructed, {expected} needed")
            info["layers_removed"] = removed
            info["layers_tolerated"] = plan.tolerated
        claimed, effective = effective_noise_multipliers(
            self.z, self.mode, plan.n, n_prime, max(w_cal_dropped, 0.0), self.n0)
        self.last_effective = effective
        info.update(calibration=self.mode, noise_multiplier=claimed, noise_multiplier_effective=effective,
                    weight_sampled=plan.n, weight_survived=n_prime, clip_norm=self.clip_norm)
        return released, info

    def from_secagg(self, out: dict, dim: int) -> Aggregate:
        """Theta's step from the SecAgg round's output (theta^{t+1} - theta^t = released / n')."""
        survivors = out["survivors"]
        released, info = self.release(out["sum"], survivors, out.get("calibration"), out.get("layer_seeds"))
        n_prime = info["weight_survived"]
        delta = released / n_prime if n_prime > 0 else np.zeros(dim)
        return Aggregate(delta.astype(np.float32), n_prime, info)

    def aggregate(self, updates, weights, dim, round_idx):  # pragma: no cover - the scenario forbids it
        raise RuntimeError("baek runs only with secure aggregation (secagg.enabled: true)")
