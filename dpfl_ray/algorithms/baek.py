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

:class:`BaekNoise` is what a *client* computes (it runs on the workers); :class:`Baek` is the
server's side.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import attr
import numpy as np

from ..privacy.discrete import draw
from ..privacy.dropouts import (
    LAYER_QUANTA, calibrates, effective_noise_multipliers, layer_quanta, layer_variances, planned_noise_multipliers,
    server_view, tolerated_dropouts,
)
from ..privacy.randomness import ChaChaNormal, DPRandomness
from ..privacy.sampling import FixedSizeSampling, sampling_of
from ..privacy.sensitivity import booked_noise_multiplier, l2_sensitivity
from .base import (
    Abort, Aggregate, Algorithm, ClientNoise, ClientSpec, Mechanism, RingEncoding, RoundOutcome, UnmaskPlan,
    require_public_weight_cap,
)

# Conditional randomized rounding redraws a rounding whose norm passes the bound at this beta
# (Kairouz et al. 2021, Prop. 22; their experiments' exp(-0.5)).
ROUNDING_BETA = math.exp(-0.5)

# The sampled weight n (and the survivors' n') are broadcast to the clients: the analysis treats
# them as public (Prop. 2 conditions the sensitivity on them).
PUBLIC = ("n", "n_prime")
# What "claimed" means without calibration: the multiplier the clients were told, not a claim of
# the paper's about the release, which it puts at z * sqrt(1 - R) after a dropout rate R.
UNCALIBRATED_CLAIM = ("uncalibrated: the claimed figure is z's, as if no client dropped; Baek et al. 2021 "
                      "(Sec. IV.B) put the uncalibrated release at z * sqrt(1 - R) for a dropout rate R, "
                      "which the effective epsilon books")


def _normal(generator, std: float, dim: int) -> np.ndarray:
    return generator.standard_normal(dim, dtype=np.float64) * std


def calibration_share_variance(ring, first_shares: float, survivors: int) -> float:
    """Each calibrating survivor's fresh share when ``survivors`` clients delivered: the cohort's total
    noise variance over the survivors (integer units), so that their fresh shares sum to it (Alg. 2
    line 22 with a share per client); the discrete Gaussian's rounded up to an integer.
    ``first_shares``: how many first shares make the total (the cohort for ``baek``; n_0, the floor's
    count, for ``baek-extended``, whose first shares each carry total / n_0). ``ring``: the clients'
    RingEncoding or the server's RingPlan (its ``mechanism`` and ``local_variance``)."""
    share = ring.local_variance * first_shares / survivors
    return float(math.ceil(share)) if ring.mechanism == "discrete_gaussian" else share


def booked_multiplier(z_view: float, clip_norm: float = 1.0) -> float:
    """What the ledger books for a view carrying noise std 2C z_view on the weighted sum. Baek et
    al. (Prop. 2) state the replace-one sensitivity 2C with n public; under Poisson sampling's
    add/remove relation the sensitivity is C, so booking 2C keeps an upper bound under both."""
    from dp_accounting import NeighboringRelation  # here, not at the top: see privacy/sampling.py

    return booked_noise_multiplier(2.0 * clip_norm * z_view, l2_sensitivity(clip_norm, NeighboringRelation.REPLACE_ONE))


# How many noise std beyond the clip a client's fixed-point words must hold (Baek._fixed_point_unfit)
ENCODING_TAIL = 10.0


# -- the client's side ---------------------------------------------------------------------------
@dataclass(frozen=True)
class BaekNoise(ClientNoise):
    """The public parameters of one round's distributed noise (Alg. 2 lines 12-15), and the
    randomness each client draws its share from."""

    mode: str
    randomness: DPRandomness
    round: int
    T: float  # 2Cz: the noise std the mechanism targets on the weighted sum
    n: float  # the sampled weight, broadcast
    n0: float | None = None  # baek-extended's floor
    variances: tuple[float, ...] = ()  # layered: variances of layers 0..L, in units of T^2
    ring: RingEncoding | None = None  # integer noise inside SecAgg's ring (privacy.distributed_noise)
    cohort: int = 0  # the number of sampled clients (integer noise: every client's share is the same)
    first_shares: float = 0.0  # integer noise: how many first shares make the cohort's total (cohort, or n_0)
    quantum: int = 0  # layered discrete Gaussian: each layer sums draws of N_Z(0, quantum) ...
    quanta: tuple[int, ...] = ()  # ... layer k holds quanta[k] of them (privacy.dropouts.layer_quanta)

    def layer_seed(self, client_id: int, layer: int) -> bytes:
        """32-byte PRG seed of one noise layer; the server only ever uses reconstructed seeds."""
        return self.randomness.secret("layer", self.round, client_id, layer)

    def _layer_stream(self, seed: bytes):
        if self.randomness.mode == "reproducible":
            return np.random.default_rng(int.from_bytes(seed, "big"))
        return ChaChaNormal(seed)

    def layer_vector(self, seed: bytes, layer: int, dim: int) -> np.ndarray:
        """The layer's Gaussian vector, regenerated identically by anyone holding ``seed``."""
        return _normal(self._layer_stream(seed), self.T * np.sqrt(self.variances[layer]), dim)

    def layer_ints(self, seed: bytes, layer: int) -> np.ndarray:
        """With integer noise: the layer's vector in the ring's rotated domain, regenerated identically
        by anyone holding ``seed``: a Skellam of the layer's share of the cohort's total variance, or
        the sum of the layer's draws of N_Z(0, quantum)."""
        return self._layer_draw(self._layer_stream(seed), layer)

    def _layer_draw(self, generator, layer: int) -> np.ndarray:
        dim = self.ring.dim
        if self.quanta:
            draws = draw(self.ring.mechanism, generator, self.quantum, self.quanta[layer] * dim)
            return draws.reshape(self.quanta[layer], dim).sum(axis=0)
        total = self.ring.local_variance * self.cohort
        return draw(self.ring.mechanism, generator, self.variances[layer] * total, dim)

    def sample(self, client_id: int, weight: float, dim: int) -> np.ndarray:
        """e_i of Alg. 2 line 15 (or Alg. 3 line 26, or the layered sum), float64."""
        if self.mode == "layered":
            stds = self.T * np.sqrt(np.asarray(self.variances))
            out = _normal(self.randomness.generator("layers", self.round, client_id), stds[0], dim)
            for k in range(1, len(stds)):
                out += self.layer_vector(self.layer_seed(client_id, k), k, dim)
            return out
        return _normal(self.randomness.generator("noise", self.round, client_id), self.share_std(weight), dim)

    def share_std(self, weight: float) -> float:
        """The std of one coordinate of e_i for a client of ``weight``: N(0, n w_i sigma^2) with
        sigma = 2Cz/n, i.e. T sqrt(w_i / n) (n_0 for baek-extended); the layered sum's, every layer's."""
        if self.mode == "layered":
            return self.T * math.sqrt(sum(self.variances))
        return self.T * math.sqrt(weight / (self.n0 if self.mode == "baek-extended" else self.n))

    def calibration_term(self, client_id: int, weight: float, dim: int, n_prime: float) -> np.ndarray:
        """-e_i + N(0, n' w_i sigma'^2 I), sigma' = 2Cz/n' (Alg. 2 line 22). The client redraws e_i
        from its stream instead of keeping it. With integer noise, shares are per client, not per
        weight: the broadcast ``n_prime`` is the survivors' count k, and the term is -e_i plus a fresh
        integer share of k-th of the cohort's total variance, as ring words (what the client sends)."""
        if self.ring is not None:
            from ..secagg.config import word_dtype
            from ..secagg.ring import to_ring

            share = calibration_share_variance(self.ring, self.first_shares, int(round(n_prime)))
            fresh = draw(self.ring.mechanism, self.randomness.generator("calibration", self.round, client_id),
                         share, self.ring.dim)
            return to_ring(fresh - self.integer_share(client_id, self.ring), self.ring.bits).astype(
                word_dtype(self.ring.bits))
        fresh = _normal(self.randomness.generator("calibration", self.round, client_id),
                        self.T * np.sqrt(weight / n_prime), dim)
        return fresh - self.sample(client_id, weight, dim)

    def integer_share(self, client_id: int, ring: RingEncoding) -> np.ndarray:
        """The client's integer noise share in the rotated, scaled domain: every sampled client the
        same variance, so that the survivors' shares sum to one Skellam (or to a sum of equal discrete
        Gaussians) of the variance the ledger books. ``layered``: layer 0 plus the seeded layers
        1..L, of the cohort's total variance over N, ..., over N - L (Skellams add up to one; the
        discrete Gaussian's layers are sums of equal draws, :func:`~dpfl_ray.privacy.dropouts.layer_quanta`)."""
        if self.mode == "layered":
            out = self._layer_draw(self.randomness.generator("layers", self.round, client_id), 0)
            for k in range(1, len(self.variances)):
                out += self.layer_ints(self.layer_seed(client_id, k), k)
            return out
        return draw(ring.mechanism, self.randomness.generator("noise", self.round, client_id),
                    ring.local_variance, ring.dim)

    def rounding_generator(self, client_id: int):
        return self.randomness.generator("rounding", self.round, client_id)

    def shared_seeds(self, client_id: int) -> list[bytes]:
        """Seeds of layers 1..L, Shamir-shared in SecAgg (none unless layered)."""
        if self.mode != "layered":
            return []
        return [self.layer_seed(client_id, k) for k in range(1, len(self.variances))]


# -- the server's side ---------------------------------------------------------------------------
@dataclass
class RoundPlan:
    round: int
    sampled: list[int]
    n: float
    noise: BaekNoise
    tolerated: int | None = None  # layered: L
    dropped: int = 0  # layered: d, sampled clients whose masked input did not arrive
    n_prime: float | None = None
    unmask: UnmaskPlan = UnmaskPlan()
    calibration_skipped: str | None = None  # integer noise: why a calibration that was due did not run
    target_variance: float = 0.0  # layered discrete Gaussian: the cohort's total noise variance (integer units)


class Baek(Algorithm):
    reports_claimed_epsilon = True
    has_calibration_phase = True
    integer_noise = True

    @classmethod
    def adjacencies(cls, sc) -> dict[str, tuple[str, ...]]:
        """Baek et al. 2021, Prop. 2: one client replaced, its update moving the sum by 2C, with the
        sampled weight n and the survivors' n' (the denominator) public."""
        return {"replace_one": ("the sampled weight n", "the survivors' weight n' (the denominator)")}

    @classmethod
    def check_scenario(cls, sc) -> None:
        super().check_scenario(sc)
        p = sc.privacy
        if not sc.secagg.enabled:
            raise ValueError("secagg.enabled: baek sends noisy updates that only secure aggregation keeps "
                             "private; set secagg.enabled: true")
        if p.clipping.mode != "fixed":
            raise ValueError("privacy.clipping.mode: baek clips to a fixed bound C (privacy.clipping.norm)")
        if p.denominator in ("expected", "bounded"):
            raise ValueError("privacy.denominator: baek divides by the survivors' weight n' (Alg. 2 line 24); "
                             "leave it unset or set 'actual'")
        if p.geyer is not None:
            raise ValueError("privacy.geyer: Geyer's stopping rule belongs to dp_fedavg")
        if sc.secagg.overflow == "clip":
            raise ValueError("secagg.overflow: clipping w_i Delta_i + e_i would cut the noise the analysis "
                             "relies on; use 'error' (the default) with baek")
        if p.distributed_noise != "gaussian":
            if p.accountant == "pld":
                raise ValueError(f"privacy.accountant: {p.distributed_noise} noise is booked by its RDP; use rdp or "
                                 "rdp-classic")

    def __init__(self, scenario, weights: np.ndarray, noise_multiplier: float, sizes=None,
                 randomness: DPRandomness | None = None):
        require_public_weight_cap(scenario, weights)
        p = scenario.privacy
        self.randomness = DPRandomness.for_run(scenario, randomness)
        self.mode = p.calibration
        self.min_fraction = p.min_weight_fraction
        self.clip_norm = float(p.clipping.norm)
        self.z = float(noise_multiplier)
        self.weights = np.asarray(weights, dtype=np.float64)
        # Baek's 2C already covers an overcommitted cohort's displacement (one in, one out); after
        # the rounding of integer noise it does not (plan_ring's replace_one)
        self.sampling, frac, displacement = sampling_of(scenario.sampling, len(weights))
        self.one_in_one_out = isinstance(self.sampling, FixedSizeSampling) or displacement > 1
        # n_0 sets every client's noise and the abort rule, so it is a constant of the scenario: the declared
        # population weight W (default the scenario's clients and an audit's canaries, weight 1 each), never
        # the sum of the weights, which a replaced client would move
        canaries = p.audit.canaries if p.audit is not None else 0
        population_weight = float(p.population_weight or scenario.data.num_clients + canaries)
        self.n0 = p.min_weight_fraction * frac * population_weight if self.mode == "baek-extended" else None
        self.plan: RoundPlan | None = None
        self._current: Mechanism | None = None
        self._views = None
        # integer noise inside SecAgg (privacy.distributed_noise): the ring and the model's size
        self.integer = None if p.distributed_noise == "gaussian" else p.distributed_noise
        self.bits, self.max_wrap = int(scenario.secagg.bits), float(scenario.secagg.max_wrap_probability)
        self.fixed_point_scale = float(scenario.secagg.resolved_scale)
        self.seed = int(scenario.seed)
        self.expected_count = frac * len(self.weights)
        # baek-extended with integer shares counts clients, as the shares do: n_0 = F * expected cohort
        self.n0_count = (self.min_fraction * self.expected_count
                         if self.mode == "baek-extended" and self.integer is not None else None)
        self.dim: int | None = None
        self._ring = None  # this round's privacy.discrete_rdp.RingPlan
        self._planned_event = None

    def bind_model(self, dim: int) -> None:
        self.dim = int(dim)

    @property
    def _quantised_layers(self) -> bool:
        """``layered`` with discrete Gaussian layers, made of equal draws (privacy.dropouts.layer_quanta)."""
        return self.mode == "layered" and self.integer == "discrete_gaussian"

    def _layer_quanta(self, plan, cohort: int) -> tuple[float, int, tuple[int, ...]]:
        """The cohort's total noise variance at ``plan``'s scale, the draws' variance u and each layer's
        count: the total is what the ring plan was asked for, before the margin the draws need."""
        total = (plan.scale * 2.0 * self.clip_norm * self.z) ** 2
        return (total, *layer_quanta(total, cohort, tolerated_dropouts(cohort, self.min_fraction)))

    def _draws_kept(self, survived: int) -> int:
        """Discrete Gaussian layers: the draws of N_Z(0, u) that ``survived`` of the N sampled clients
        keep in layers 0..d, d = N - survived, which the release carries."""
        return survived * sum(self.plan.noise.quanta[:len(self.plan.sampled) - survived + 1])

    def _first_shares(self, cohort: int) -> float:
        """How many first shares make the cohort's total variance: the cohort, or baek-extended's n_0
        (Alg. 3 line 26: each user starts from the noise of the floor, more than its part)."""
        return self.n0_count if self.n0_count is not None else float(cohort)

    def _ring_plan(self, shares: int):
        """The round's ring for ``shares`` sampled clients, each first share carrying the cohort's
        total over :meth:`_first_shares`: the first aggregate then holds shares / n_0 times the total,
        which the wrap bound must cover."""
        from ..privacy.discrete_rdp import plan_ring

        spread = math.sqrt(shares / self._first_shares(shares))
        if self._quantised_layers:  # the survivors' draws carry up to (1 + 1/Q) total + N: covered once total >= N Q
            spread *= math.sqrt(1.0 + 2.0 / LAYER_QUANTA)
        return plan_ring(self.integer, self.bits, shares, self.dim, self.clip_norm,
                         2.0 * self.clip_norm * self.z * spread, 2.0 * self.clip_norm, self.max_wrap, ROUNDING_BETA,
                         replace_one=self.one_in_one_out)

    def _released_event(self, survived: int, calibrated: bool = False, senders: int | None = None):
        """What the round hands the server. Without a calibration: the sum of the survivors' shares (a
        dropout's share is simply missing). With one: the first aggregate A and the release R
        (privacy.discrete_rdp.CalibratedViewsDpEvent), for ``senders`` survivors that sent a term;
        None: the worst case over their number, before the calibration phase."""
        if self._ring is None or survived < 1:
            return None
        if self._quantised_layers:  # the survivors' draws of N_Z(0, u) in layers 0..d
            return self._ring.event.with_shares(self._draws_kept(survived), self.plan.noise.quantum)
        if self.mode == "layered":  # the survivors keep layers 0..d: the cohort's whole total, exactly
            return attr.evolve(self._ring.event, variance=float(self._ring.local_variance * len(self.plan.sampled)),
                               shares=int(survived))
        if not calibrated or senders == 0:  # no calibration term: R = A, one view of the survivors' shares
            return self._ring.event.with_shares(survived, self._ring.local_variance)
        from ..privacy.discrete_rdp import CalibratedViewsDpEvent

        fresh = calibration_share_variance(self.plan.noise.ring, self.plan.noise.first_shares, survived)
        return CalibratedViewsDpEvent(self._ring.event.with_shares(1, self._ring.local_variance), fresh, int(survived),
                                      senders)

    # -- what the ledger books -------------------------------------------------------------------
    def _mechanism(self, z_effective: float, event=None) -> Mechanism:
        booked = booked_multiplier(z_effective, self.clip_norm)
        # the server picks the sample, so against it the same multiplier holds unamplified
        description = f"baek, calibration={self.mode}" + (f", {self.integer} noise" if event is not None else "")
        return Mechanism((booked,), self.sampling, description,
                         claimed_noise_multipliers=(booked_multiplier(self.z, self.clip_norm),),
                         server_noise_multipliers=(booked,), public=PUBLIC,
                         claim_note=UNCALIBRATED_CLAIM if self.mode == "none" else "", event=event)

    def planned_mechanism(self) -> Mechanism:
        """The planned round without dropouts, as the server's view guarantees it (z, except for
        baek-extended, which always hands the server two views): the shadow ledger's budget check.
        With integer noise, its event at the expected cohort, once the model's size is known."""
        z = planned_noise_multipliers(self.z, self.mode, min_weight_fraction=self.min_fraction)[1]
        if self.integer is None or self.dim is None:
            return self._mechanism(z)
        if self._planned_event is None:
            shares = max(1, round(self.expected_count))
            plan = self._ring_plan(shares)
            self._planned_event = plan.event
            if self._quantised_layers:  # nobody drops: N c_0 draws of N_Z(0, u)
                _, u, quanta = self._layer_quanta(plan, shares)
                self._planned_event = plan.event.with_shares(shares * quanta[0], u)
            if self.mode == "baek-extended":  # it always calibrates: the server's two views, every client sending
                from ..privacy.discrete_rdp import CalibratedViewsDpEvent

                fresh = calibration_share_variance(plan, self._first_shares(shares), shares)
                self._planned_event = CalibratedViewsDpEvent(plan.event.with_shares(1, plan.local_variance), fresh,
                                                             shares, shares)
        return self._mechanism(z, event=self._planned_event)

    def mechanism(self) -> Mechanism:
        return self._current or self.planned_mechanism()

    def summary_fields(self) -> dict:
        return {"calibration": self.mode}

    def canary_norm(self) -> float:
        return self.clip_norm

    def server_views(self):
        """The first aggregate A beside the release R when a calibration ran (docs/baek2021.md)."""
        return self._views

    # -- phases of the round ---------------------------------------------------------------------
    def begin_round(self, round_idx: int, sampled) -> Abort | None:
        """Alg. 2 line 12 / Alg. 3 line 17."""
        sampled = sorted(int(c) for c in sampled)
        n = float(self.weights[sampled].sum()) if sampled else 0.0
        self._current = None
        tolerated, variances = None, ()
        if self.mode == "layered" and sampled:
            tolerated = tolerated_dropouts(len(sampled), self.min_fraction)
            variances = tuple(layer_variances(len(sampled), tolerated).tolist())
        ring, self._ring, refusal = None, None, None
        if self.integer is not None and sampled:
            from ..errors import DPFLError
            from ..privacy.discrete_rdp import rounded_l2_bound

            try:  # the ring is sized for this cohort; one it cannot hold is refused before anyone trains
                self._ring = self._ring_plan(len(sampled))
            except DPFLError as err:
                refusal = str(err)
            else:
                ring = RingEncoding(self.integer, self.bits, self._ring.scale, self._ring.local_variance,
                                    hashlib.sha256(f"dpfl-rotation|{self.seed}|{round_idx}".encode()).digest(),
                                    rounded_l2_bound(self.clip_norm * self._ring.scale, self._ring.event.dim,
                                                     ROUNDING_BETA), self._ring.event.dim)
        target, quantum, quanta = 0.0, 0, ()
        if ring is not None and self._quantised_layers:
            target, quantum, quanta = self._layer_quanta(self._ring, len(sampled))
            refusal = self._layers_unfit(len(sampled), quantum, quanta)
        noise = BaekNoise(self.mode, self.randomness, round_idx, 2.0 * self.clip_norm * self.z, n, self.n0, variances,
                          ring, cohort=len(sampled), first_shares=self._first_shares(len(sampled)) if ring else 0.0,
                          quantum=quantum, quanta=quanta)
        self.plan = RoundPlan(round_idx, sampled, n, noise, tolerated=tolerated, target_variance=target)
        if not sampled:
            return Abort("no client sampled")
        if refusal is None and ring is None:
            refusal = self._fixed_point_unfit(sampled, noise)
        if refusal is not None:
            return Abort(refusal)
        if self.n0_count is not None and len(sampled) < self.n0_count:
            return Abort(f"{len(sampled)} clients sampled, below n_0 = {self.n0_count:.4g} (baek-extended with integer "
                         "shares counts clients; Alg. 3 line 17)")
        if self.mode == "baek-extended" and self.n0_count is None and n < self.n0:
            return Abort(f"sampled weight {n:.4g} is below n_0 = {self.n0:.4g} (baek-extended, Alg. 3 line 17)")
        return None

    def _fixed_point_unfit(self, sampled: list[int], noise: "BaekNoise") -> str | None:
        """Why the fixed-point words cannot carry this cohort's w_i Delta_i + e_i, or None. A word
        past the encoder's limit aborts the round naming its client (secagg/encoding.py): whether it
        happens would follow from one client's update, a bit of its data nobody books. So the round
        is refused before anyone trains unless C w_max plus ENCODING_TAIL times the largest share's
        std fits, which public quantities decide (past 10 std a Gaussian coordinate lies with
        probability 1.5e-23)."""
        from ..secagg.encoding import max_abs_value

        w_max = float(self.weights[sampled].max())
        need = self.clip_norm * w_max + ENCODING_TAIL * noise.share_std(w_max)
        limit = max_abs_value(self.bits, self.fixed_point_scale, len(sampled))
        if need <= limit:
            return None
        return (f"secagg: {len(sampled)} clients' words of {self.bits} bits at scale {self.fixed_point_scale:g} hold "
                f"{limit:.4g} a coordinate, an update clipped to {self.clip_norm:g} with its noise share up to "
                f"{ENCODING_TAIL:g} std needs {need:.4g}; use secagg.bits 64 or a smaller secagg.scale")

    def _layers_unfit(self, cohort: int, quantum: int, quanta: tuple[int, ...]) -> str | None:
        """Why the discrete Gaussian's layers cannot carry this round, or None: the survivors' draws
        must keep to the ring's wrap bound after any number of tolerated dropouts (the plan's margin
        covers them once the total reaches N Q), and u to the exact sampler's range."""
        from ..privacy.discrete import MAX_SHARE_VARIANCE
        from ..secagg.ring import wrap_probability

        if quantum > MAX_SHARE_VARIANCE:
            return (f"the discrete Gaussian layers' draws would need variance {quantum}, past the exact sampler's "
                    "2^30; use fewer bits")
        held = np.cumsum(quanta)
        most = max((cohort - d) * int(c) for d, c in enumerate(held)) * quantum
        bound = wrap_probability(self.bits, self._ring.event.dim, cohort * self.clip_norm * self._ring.scale, cohort,
                                 dg_variance=most / cohort)
        if bound > self.max_wrap:
            return (f"the discrete Gaussian layers of {cohort} clients wrap a {self.bits}-bit ring with probability up "
                    f"to {bound:.3g}, above secagg.max_wrap_probability {self.max_wrap:g}; use more bits")
        return None

    def client_spec(self) -> ClientSpec:
        return ClientSpec(clip_norm=self.clip_norm, noise=self.plan.noise)

    def after_upload(self, survivors: list[int]) -> UnmaskPlan | Abort:
        """Once U_A is known (Alg. 2 line 18-20): the calibration broadcast n', or the layers to
        reveal -- or why the round is aborted. Also books what releasing would cost if every
        survivor calibrates (a calibration dropout leaves its first noise in, which only adds)."""
        plan = self.plan
        plan.n_prime = float(self.weights[survivors].sum()) if survivors else 0.0
        if self.mode == "layered":
            dropped = len(plan.sampled) - len(survivors)
            if dropped > plan.tolerated:
                return Abort(f"{dropped} of {len(plan.sampled)} sampled clients dropped; the layers tolerate "
                             f"{plan.tolerated} (privacy.min_weight_fraction={self.min_fraction:g})")
            plan.dropped = dropped
            plan.unmask = UnmaskPlan(layers_from=dropped + 1) if dropped < plan.tolerated else UnmaskPlan()
        elif self.integer is not None and calibrates(self.mode, len(plan.sampled), len(survivors)):
            if self._calibration_fits(len(survivors)):  # shares are per client: the broadcast is the count
                plan.unmask = UnmaskPlan(calibration_n_prime=float(len(survivors)))
            else:
                plan.unmask, plan.calibration_skipped = UnmaskPlan(), (
                    f"the {self.integer} fresh shares would pass what their sampler draws exactly or "
                    "secagg.max_wrap_probability: released uncalibrated")
        elif self.integer is None and calibrates(self.mode, plan.n, plan.n_prime):
            plan.unmask = UnmaskPlan(calibration_n_prime=plan.n_prime)
        else:
            plan.unmask = UnmaskPlan()
        if plan.n_prime > 0:  # what releasing can cost, whoever of the survivors calibrates
            self._current = self._mechanism(self._effective(plan.n, plan.n_prime, 0.0, len(survivors)),
                                            event=self._released_event(
                                                len(survivors), plan.unmask.calibration_n_prime is not None))
        return plan.unmask

    def _calibration_fits(self, survived: int) -> bool:
        """Can the fresh integer shares be drawn exactly, and does the calibrated release keep to the
        ring's wrap bound? Skellam's sum to the cohort's total, within the plan's bound, and are drawn
        in pieces of up to 2^30 (privacy/discrete.py); the discrete Gaussian's, rounded up to integers,
        carry a little more than the total, and its exact sampler takes variances up to 2^30. When
        either fails the round is released uncalibrated instead."""
        from ..privacy.discrete import MAX_SHARE_VARIANCE, MAX_SKELLAM_PIECES
        from ..secagg.ring import wrap_probability

        fresh = calibration_share_variance(self.plan.noise.ring, self.plan.noise.first_shares, survived)
        if self.integer == "skellam":
            return fresh <= MAX_SHARE_VARIANCE * MAX_SKELLAM_PIECES
        if fresh > MAX_SHARE_VARIANCE:
            return False
        bound = wrap_probability(self.bits, self._ring.event.dim, survived * self.clip_norm * self._ring.scale,
                                 survived, dg_variance=fresh)
        return bound <= self.max_wrap

    def _effective(self, n: float, n_prime: float, w_cal_dropped: float, survived: int) -> float:
        """The multiplier that protects the release: Baek's by weight (docs/baek2021.md); with integer
        noise, whose shares are equal per client, the same by count (``w_cal_dropped`` then counts the
        survivors that sent no calibration term): the Gaussian analogue the rows report beside the
        discrete event the ledger books."""
        mode = "none" if self.plan.calibration_skipped else self.mode
        if self._quantised_layers:  # the survivors' draws carry a little more than the target
            return self.z * math.sqrt(self._draws_kept(survived) * self.plan.noise.quantum / self.plan.target_variance)
        if self.integer is not None:
            if mode == "none":  # the survivors' first shares alone
                return self.z * math.sqrt(survived / self._first_shares(len(self.plan.sampled)))
            n, n_prime = float(len(self.plan.sampled)), float(survived)
            return effective_noise_multipliers(self.z, mode, n, n_prime, w_cal_dropped, self.n0_count)[1]
        return effective_noise_multipliers(self.z, mode, n, n_prime, w_cal_dropped, self.n0)[1]

    def release(self, outcome: RoundOutcome) -> tuple[np.ndarray, dict]:
        """The released sum (Alg. 2 line 24 times n') from the decoded SecAgg sum of M_i, the
        survivors' calibration terms and the reconstructed layer seeds; and the round's figures."""
        plan = self.plan
        total = outcome.total
        dim = total.shape[0]
        released = np.asarray(total, dtype=np.float64).copy()
        n_prime = float(self.weights[list(outcome.survivors)].sum())
        w_cal_dropped, info, senders = 0.0, {}, None
        self._views = None
        if plan.unmask.calibration_n_prime is not None:
            senders = sorted(outcome.calibration.clients) if outcome.calibration else []
            if senders and outcome.calibration.release is not None:
                released = np.asarray(outcome.calibration.release, dtype=np.float64).copy()
            elif senders:
                released += outcome.calibration.total
            if self.integer is not None:  # by count, as the shares are
                w_cal_dropped = float(len(outcome.survivors) - len(senders))
            else:
                w_cal_dropped = n_prime - float(self.weights[senders].sum()) if senders else n_prime
            info["calibration_senders"] = len(senders)
        if plan.calibration_skipped:
            info["calibration_skipped"] = plan.calibration_skipped
        if self.mode == "layered":
            from ..secagg.ring import decode_sum, ring_sum, to_ring

            removed, ring = 0, plan.noise.ring
            words = None if ring is None else np.asarray(outcome.words, dtype=np.uint64)
            for cid, layers in sorted((outcome.layer_seeds or {}).items()):
                for k, seed in sorted(layers.items()):
                    if ring is None:
                        released -= plan.noise.layer_vector(seed, k, dim)
                    else:  # in the ring, before decoding: a first aggregate that wrapped comes back whole
                        words = ring_sum([words, to_ring(-plan.noise.layer_ints(seed, k), ring.bits)], ring.bits)
                    removed += 1
            if ring is not None:
                released = decode_sum(words, ring.bits, ring.scale, ring.rotation_seed, dim)
            expected = len(outcome.survivors) * (plan.tolerated - plan.dropped)  # layers d+1..L of each survivor
            if removed != expected:
                raise RuntimeError(f"layered: {removed} layers reconstructed, {expected} needed")
            info["layers_removed"] = removed
            info["layers_tolerated"] = plan.tolerated
            if plan.noise.quanta:
                info.update(layer_draw_variance=plan.noise.quantum,
                            layer_draws_released=self._draws_kept(len(outcome.survivors)))
        claimed = self.z
        effective = self._effective(plan.n, n_prime, max(w_cal_dropped, 0.0), len(outcome.survivors))
        self._current = self._mechanism(effective, event=self._released_event(
            len(outcome.survivors), senders is not None, None if senders is None else len(senders)))
        if self._ring is not None:
            info.update(ring_bits=self.bits, ring_scale=self._ring.scale, ring_noise_variance=self._ring.local_variance,
                        ring_wrap_bound=self._ring.wrap_probability)
        counted = (float(len(plan.sampled)), float(len(outcome.survivors))) if self.integer else (plan.n, n_prime)
        view = server_view("none" if plan.calibration_skipped else self.mode, *counted, max(w_cal_dropped, 0.0),
                           self.n0 if self.n0_count is None else self.n0_count)
        if view.cov.shape[0] == 2:  # the server also saw the first aggregate
            self._views = ([np.asarray(total, dtype=np.float64) / n_prime, released / n_prime], view.cov)
        info.update(calibration=self.mode, noise_multiplier=claimed, noise_multiplier_effective=effective,
                    weight_sampled=plan.n, weight_survived=n_prime, clip_norm=self.clip_norm)
        return released, info

    def finish(self, outcome: RoundOutcome, dim: int) -> Aggregate:
        """Theta's step from the SecAgg round's output (theta^{t+1} - theta^t = released / n')."""
        released, info = self.release(outcome)
        n_prime = info["weight_survived"]
        delta = released / n_prime if n_prime > 0 else np.zeros(dim)
        return Aggregate(delta.astype(np.float32), n_prime, info)
