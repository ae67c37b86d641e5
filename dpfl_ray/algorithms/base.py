"""The Algorithm interface: what a paper's algorithm plugs into the coordinator's round
(ARCHITECTURE.md, principle 2).

The coordinator owns the loop and calls the same hooks, in phase order, for every algorithm:

    begin_round(round, sampled)   -> None to go on, or an Abort (before anyone trains)
    client_spec()                 -> ClientSpec: what a worker does to each client's update
    after_upload(survivors)       -> UnmaskPlan (what SecAgg's unmask request carries), or an Abort
    finish(outcome)               -> Aggregate: the server's step from the RoundOutcome
    mechanism()                   -> Mechanism: what the ledger books for the round just finished

Everything that crosses the Ray boundary is a frozen dataclass defined here; the runtime never
asks an algorithm for its name or type.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Mapping

import numpy as np

if TYPE_CHECKING:  # dp_accounting (and scipy) stay out of processes that only train: the workers
    from ..privacy.sampling import Sampling


@dataclass
class Aggregate:
    delta: np.ndarray  # the server's step, added to the model (after server_lr)
    weight_sum: float  # sum of the survivors' weights
    info: dict = field(default_factory=dict)  # extra per-round figures for rounds.jsonl


@dataclass(frozen=True)
class Abort:
    """The round releases nothing; the model stays. ``reason`` goes into the round's record."""

    reason: str


class ClientNoise(ABC):
    """Noise a client adds to its own vector before it leaves (distributed or local DP). Runs on
    workers: subclasses are frozen dataclasses holding only public round parameters and seeds."""

    #: True: the noise is one share of noise on the weighted sum and is added to w_i * vector
    #: (Baek et al.: it needs secure aggregation). False: it is the client's own vector's noise,
    #: added before weighting (NbAFL's uplink noise).
    on_weighted_sum: ClassVar[bool] = True

    @abstractmethod
    def sample(self, client_id: int, weight: float, dim: int) -> np.ndarray:
        """The client's noise vector (float64)."""

    def shared_seeds(self, client_id: int) -> list[bytes]:
        """PRG seeds to Shamir-share in SecAgg next to b_u (none by default)."""
        return []

    def calibration_term(self, client_id: int, weight: float, dim: int, n_prime: float) -> np.ndarray:
        """What a survivor sends when the server asks for calibration (see UnmaskPlan)."""
        raise NotImplementedError(f"{type(self).__name__} has no calibration phase")

    def integer_share(self, client_id: int, ring: "RingEncoding") -> np.ndarray:
        """The client's integer noise inside SecAgg's ring (int64, ``ring.dim`` long)."""
        raise NotImplementedError(f"{type(self).__name__} adds no integer noise")

    def rounding_generator(self, client_id: int):
        """The stream that rounds the client's scaled vector to integers (part of the mechanism)."""
        raise NotImplementedError(f"{type(self).__name__} adds no integer noise")


@dataclass(frozen=True)
class RingEncoding:
    """One round's public encoding of integer noise inside SecAgg (secagg/ring.py, issue #36): the
    ring Z_(2^bits), the scale (integer steps per model unit), each client's noise variance, the
    seed of the rotation's signs, the norm bound of the conditional rounding, and the rotated length."""

    mechanism: str
    bits: int
    scale: float
    local_variance: float
    rotation_seed: bytes
    rounding_bound: float
    dim: int


@dataclass(frozen=True)
class ClientReport:
    """What a client's local procedure reports beside its update (record-level DP): the
    dp_accounting events its own ledger books, as (event, count) pairs; what the paper's own
    accounting books (``claimed_events``) or spends in its units (``spent``); named values the
    algorithm keeps for the client (e.g. its next clipping threshold); and ``client_state``, what
    the client itself keeps for its next round (e.g. its optimizer's moments). The simulation holds
    that state between rounds; the aggregate never depends on it."""

    events: tuple = ()
    claimed_events: tuple = ()
    spent: float | None = None
    values: Mapping[str, float] = field(default_factory=dict)
    client_state: object | None = None


class LocalProcedure(ABC):
    """A client's local training other than Baek et al.'s Alg. 1 SGD (per-example DP-SGD, DPAGD).
    Runs on workers: subclasses are frozen dataclasses of public settings (per client if need be)."""

    @abstractmethod
    def run(self, model, theta: np.ndarray, x: np.ndarray, y: np.ndarray, *, seed: int, round_idx: int,
            client_id: int) -> tuple[np.ndarray, ClientReport]:
        """The client's update Delta = w - theta (float32) and its report."""


@dataclass(frozen=True)
class ClientSpec:
    """What a worker does with a client's local update before it leaves, for one round.

    ``clip_norm``: clip what is sent to this L2 norm (None: send it as it is). ``indicator``:
    append the clipped-count bit b_i - 1/2 (Andrew et al. 2019). ``noise``: noise the client adds
    (Baek et al. 2021, Alg. 2 line 15; NbAFL's uplink noise). ``send_parameters``: send the local
    parameters theta + Delta instead of the update (NbAFL, Wei et al. 2020 Alg. 1 lines 8-9).
    ``prox_mu``: local training minimises F_i(w) + mu/2 ||w - theta||^2 (Alg. 1 line 6).
    ``per_client``: the server needs each client's upload (e.g. the median of their norms); by
    default workers send only partial sums of w_i * upload (the aggregation tree).
    ``local``: the client trains with this procedure instead of Alg. 1 SGD, and reports.
    ``evaluate_local``: also evaluate each client's own model theta + Delta (before clipping or
    noise) on the test split, reported as ``local_test_accuracy`` / ``local_test_loss`` in its
    ClientReport; the coordinator sets it (``output.client_accuracy``), never an algorithm.
    """

    clip_norm: float | None = None
    indicator: bool = False
    noise: ClientNoise | None = None
    send_parameters: bool = False
    prox_mu: float = 0.0
    per_client: bool = False
    local: LocalProcedure | None = None
    evaluate_local: bool = False

    @property
    def extra_dims(self) -> int:
        return 1 if self.indicator else 0

    @property
    def ring(self) -> RingEncoding | None:
        """The round's integer-noise encoding, when the client's noise lives in SecAgg's ring."""
        return getattr(self.noise, "ring", None)

    def ring_words(self, prepared: np.ndarray, client_id: int, weight: float) -> np.ndarray:
        """w_i times the client's upload (``prepared``: what :meth:`prepare` gave), scaled, rotated,
        rounded to integers within the round's norm bound, plus its integer noise share, mod 2^bits:
        its uint32 summand in secure aggregation."""
        from ..secagg.ring import conditional_round, rotate, rotation_signs, to_ring

        ring = self.ring
        value = prepared.astype(np.float64) * float(weight)
        signs = rotation_signs(ring.rotation_seed, value.size)
        ints = conditional_round(rotate(value * ring.scale, signs), self.noise.rounding_generator(client_id),
                                 ring.rounding_bound)
        return to_ring(ints + self.noise.integer_share(client_id, ring), ring.bits).astype(np.uint32)

    def prepare(self, update: np.ndarray, theta: np.ndarray) -> np.ndarray:
        """What leaves the client, before weighting: the (clipped) update or parameters."""
        return self.vector(theta + update if self.send_parameters else update)

    def prepared_dim(self, dim: int) -> int:
        """The length of :meth:`prepare`'s vector for a model of ``dim`` values."""
        return dim + (1 if self.clip_norm and self.indicator else 0)

    def plain_value(self, prepared: np.ndarray, client_id: int) -> np.ndarray:
        """The client's upload when the server sees it alone (no secure aggregation), from what
        :meth:`prepare` gave."""
        value = prepared
        if self.noise is None:
            return value
        if self.noise.on_weighted_sum:
            raise ValueError("noise shared over the weighted sum needs secure aggregation")
        return (value.astype(np.float64) + self.noise.sample(client_id, 1.0, value.size)).astype(np.float32)

    def weighted_value(self, prepared: np.ndarray, client_id: int, weight: float) -> np.ndarray:
        """w_i times the client's upload (what :meth:`prepare` gave), with its noise: its summand in
        secure aggregation."""
        value = prepared * np.float32(weight)
        if self.noise is None:
            return value
        if self.noise.on_weighted_sum:
            return value.astype(np.float64) + self.noise.sample(client_id, weight, value.size)
        return value.astype(np.float64) + weight * self.noise.sample(client_id, 1.0, value.size)

    def vector(self, update: np.ndarray) -> np.ndarray:
        """``update`` clipped to ``clip_norm``, with the indicator appended if asked."""
        if not self.clip_norm:
            return update
        from ..privacy.mechanisms import clip_by_l2

        clipped, norm = clip_by_l2(update, self.clip_norm)
        if self.indicator:
            return np.append(clipped, np.float32(0.5 if norm <= self.clip_norm else -0.5))
        return clipped


@dataclass(frozen=True)
class UnmaskPlan:
    """What the SecAgg unmask request carries after the uploads (Baek et al. Alg. 2 lines 18-20):
    a calibration broadcast of the survivors' weight n', and/or a request for noise layers
    ``layers_from``..L of every survivor. The default asks for nothing beyond the unmasking."""

    calibration_n_prime: float | None = None
    layers_from: int | None = None


@dataclass(frozen=True)
class CalibrationSum:
    """The survivors' calibration terms, summed in client-id order, and who sent one. ``release``:
    where the released sum is decoded whole (integer noise: from A plus the terms' secure sum, mod
    2^bits), that sum; ``total`` is then its difference from the first aggregate."""

    total: np.ndarray | None
    clients: tuple[int, ...]
    release: np.ndarray | None = None


@dataclass(frozen=True)
class RoundOutcome:
    """What reached the server in one round, for every kind of round.

    ``updates``: each survivor's upload, when ClientSpec.per_client asked for them. Otherwise
    ``total``: sum_i w_i * upload_i over the survivors -- the workers' partial sums (plain rounds)
    or the decoded secure sum (SecAgg rounds, where the uploads carry their noise).
    ``aborted``: why nothing was released (then the rest is empty). ``theta``: the model the
    round broadcast (the step of an algorithm whose clients send parameters is relative to it).
    ``words``: with integer noise inside SecAgg, the secure sum as it came, mod 2^bits (noise the
    algorithm removes is removed there, before decoding).
    """

    round: int
    survivors: tuple[int, ...] = ()
    updates: Mapping[int, np.ndarray] | None = None
    total: np.ndarray | None = None
    calibration: CalibrationSum | None = None
    layer_seeds: Mapping[int, Mapping[int, bytes]] | None = None
    aborted: str | None = None
    theta: np.ndarray | None = None
    reports: Mapping[int, ClientReport] = field(default_factory=dict)
    words: np.ndarray | None = None

    @property
    def released(self) -> bool:
        return self.aborted is None


@dataclass(frozen=True)
class Mechanism:
    """What the ledger books for one round, in dp_accounting's shape.

    ``noise_multipliers``: the booked multipliers (noise std / sensitivity under the sampling's
    relation, :mod:`dpfl_ray.privacy.sensitivity`) that protect the release after the round's
    dropouts. ``claimed_noise_multipliers``: what the paper claims (None: the same).
    ``server_noise_multipliers``: what protects a participant against the server itself, which
    knows the sample (None: the server sees un-noised client data, as in central DP).
    ``public``: data-dependent quantities the analysis treats as public. ``paper_epsilon``: the
    epsilon the paper claims for the round by its own analysis, where that is no multiplier
    (``claim_note``: where the claim is outside its validity range). ``assumed_noise_multipliers``:
    the multipliers under a sensitivity the paper assumes and the code does not enforce, booked
    apart as ``epsilon_assumed`` (never as the run's epsilon); ``assumption`` says what is assumed.
    ``event``: what the round releases under its sampling when that is not Gaussian noise (integer
    noise inside SecAgg: a privacy.discrete_rdp.DiscreteNoiseSumDpEvent, or CalibratedViewsDpEvent for
    a calibrated round); the ledger books it, and
    ``noise_multipliers`` are then the Gaussian of the same variance's, for the rows and the
    epsilon against the server.
    """

    noise_multipliers: tuple[float, ...]
    sampling: Sampling
    description: str
    claimed_noise_multipliers: tuple[float, ...] | None = None
    covered: bool = True
    server_noise_multipliers: tuple[float, ...] | None = None
    public: tuple[str, ...] = ()
    paper_epsilon: float | None = None
    claim_note: str = ""
    assumed_noise_multipliers: tuple[float, ...] | None = None
    assumption: str = ""
    event: object | None = None  # a dp_accounting DpEvent, when the release is not Gaussian noise


#: The neighbouring relations a run can declare (``privacy.adjacency``): one protected unit (a client,
#: or a record of a client) added or removed; replaced by another; or replaced by one that
#: contributes nothing (zero-out: the population and everything sized by it stay as they are).
ADJACENCIES = ("add_remove", "replace_one", "zero_out")


class Algorithm(ABC):
    """One paper's algorithm. Subclasses live in their own module under ``algorithms/`` and are
    listed in ``algorithms.REGISTRY`` under the scenario's ``training.algorithm`` name."""

    #: the algorithm has a privacy mechanism: the run keeps a ledger
    private: ClassVar[bool] = True
    #: its clients can add integer noise inside SecAgg's ring (privacy.distributed_noise)
    integer_noise: ClassVar[bool] = False
    #: the ledger reports the paper's claim next to the effective epsilon on every round
    reports_claimed_epsilon: ClassVar[bool] = False
    #: the round has a calibration phase after unmasking (a dropout phase of the fault plan)
    has_calibration_phase: ClassVar[bool] = False
    #: privacy is per record of each client, booked on one ledger per client from ClientReports
    record_level: ClassVar[bool] = False

    @classmethod
    def client_level(cls) -> bool:
        """A client-level mechanism, booked on one run-wide ledger: private and not record-level
        (what the accounting preflight, the planned mechanism and the audit's canaries need)."""
        return cls.private and not cls.record_level

    @classmethod
    def adjacencies(cls, sc) -> dict[str, tuple[str, ...]]:
        """The neighbouring relations under which what this algorithm releases in ``sc`` is booked
        truly, strictest first (the first is the default), each with the data-dependent quantities
        the run publishes and takes as public by declaration under it (docs/sensitivity.md)."""
        return {"add_remove": ()}

    @classmethod
    def adjacency(cls, sc) -> tuple[str, tuple[str, ...]]:
        """The run's relation (``privacy.adjacency``, or the default) and what it takes as public."""
        options = cls.adjacencies(sc)
        chosen = sc.privacy.adjacency or next(iter(options))
        if chosen not in options:
            raise ValueError(f"privacy.adjacency: {sc.training.algorithm} as configured releases what only "
                             f"{' or '.join(options)} adjacency covers, not {chosen}")
        return chosen, options[chosen]

    @classmethod
    def check_scenario(cls, sc) -> None:
        """Raise ValueError (message starting with the field path) if ``sc`` cannot run this
        algorithm. The default holds for every private algorithm."""
        p, name = sc.privacy, sc.training.algorithm
        if p.distributed_noise != "gaussian" and not cls.integer_noise:
            raise ValueError(f"privacy.distributed_noise: {name} adds no integer noise inside SecAgg; "
                             f"{p.distributed_noise} is for baek (docs/distributed_dp.md)")
        cls.adjacency(sc)
        if p.noise_multiplier is None and p.target_epsilon is None:
            raise ValueError(f"privacy.noise_multiplier: {name} needs a noise multiplier "
                             "(or privacy.target_epsilon to calibrate one)")
        if sc.sampling.mode == "fixed" and p.accountant == "pld":
            raise ValueError("privacy.accountant: pld cannot account fixed-size cohorts (sampling without "
                             "replacement); use rdp or rdp-classic, or sampling.mode: poisson")
        if not cls.has_calibration_phase and any(d.phase == "calibration" and d.model != "none"
                                                 for d in sc.faults.dropouts):
            raise ValueError(f"faults.dropout.phase: {name} has no calibration phase")

    def bind_model(self, dim: int) -> None:
        """The model's number of values, told once before the first round (the ring of integer
        noise is sized by it)."""

    def begin_round(self, round_idx: int, sampled) -> Abort | None:
        return None

    def withdrawals(self, round_idx: int, sampled) -> dict[int, str]:
        """Sampled clients that will not take part this round, with the dropout cause
        (dpfl_ray.faults.plan vocabulary), e.g. 'exhausted' once a client's budget is spent."""
        return {}

    def client_spec(self) -> ClientSpec:
        return ClientSpec()

    def after_upload(self, survivors: list[int]) -> UnmaskPlan | Abort:
        return UnmaskPlan()

    @abstractmethod
    def finish(self, outcome: RoundOutcome, dim: int) -> Aggregate:
        """The server's step (theta^{t+1} - theta^t before server_lr) from what reached it."""

    def planned_mechanism(self) -> Mechanism | None:
        """The next round as planned (no dropouts yet): the budget checks book it ahead. None for
        an algorithm without a privacy mechanism, or a record-level one (its clients' procedures
        report their mechanisms, per client, in ClientReport.events)."""
        return None

    def mechanism(self) -> Mechanism | None:
        """The round in progress as it stands (after ``after_upload``: what releasing it would
        cost; after ``finish``: what it cost)."""
        return self.planned_mechanism()

    def summary_fields(self) -> dict:
        """Scenario facts worth a column in summary.json and ``dpfl report``."""
        return {}

    def client_groups(self) -> Mapping[int, str] | None:
        """A label per client by which per-client results are grouped (e.g. Huang et al.'s
        budget categories, Fig. 7); None: one group."""
        return None

    def canary_norm(self) -> float | None:
        """How far one protected unit can move what it sends when it is added (the add/remove
        contribution bound this round): the norm of an audit canary's update. None: the
        algorithm cannot be audited with canary clients."""
        return None

    def server_views(self) -> tuple[list[np.ndarray], np.ndarray] | None:
        """Every view of the last released round's sum the server holds beyond the release (on the
        release's scale), with their noise covariance; None when the release is its only view."""
        return None

    def observe(self, round_idx: int, metrics: Mapping[str, float | None]) -> None:
        """The round's evaluation once the model is updated: test_loss, test_accuracy and, when the
        scenario holds out a validation split, validation_loss (Fu et al.'s noise decay reads it)."""

    def reads_evaluation(self) -> bool:
        """Whether :meth:`observe` uses the metrics it is given. If not, the runtime may evaluate
        round t's model inside round t+1's training calls (its figures are round t's all the same)
        and call :meth:`observe` with none."""
        return False

    def reads_validation_every_round(self) -> bool:
        """Whether :meth:`observe` needs validation_loss after every round. Otherwise the runtime
        evaluates the validation split with the test split (every ``output.eval_every`` rounds),
        so a run whose algorithm never reads it does not pay a full pass over it every round."""
        return False

    def state_dict(self) -> dict:
        """What the algorithm carries from round to round (JSON-able), for checkpoints."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} keeps no state across rounds, got {sorted(state)}")


def weighted_sum(updates: Mapping[int, np.ndarray], weights) -> tuple[np.ndarray | None, float]:
    """sum_i w_i Delta_i over clients in id order, accumulated in float64.

    A fixed order makes the sum independent of which worker computed which client and of the
    order replies arrived (ARCHITECTURE.md, principle 5).
    """
    total, wsum = None, 0.0
    for cid in sorted(updates):
        w = float(weights[cid])
        term = updates[cid].astype(np.float64) * w
        total = term if total is None else total + term
        wsum += w
    return total, wsum


def require_public_weight_cap(scenario, weights) -> None:
    """Private algorithms bound one client's weight by w_i = min(n_i / n_max, 1) <= 1. With the
    default n_max (the largest client's size) a new, larger client would rescale every weight, so
    the sensitivity bound would depend on the data: ask for n_max explicitly."""
    from ..errors import DPFLError

    w = np.asarray(weights, dtype=np.float64)
    if scenario.data.n_max is None and w.size and not np.all(w == w[0]):
        raise DPFLError("clients differ in size, so a private algorithm needs a public weight cap: set "
                        "data.n_max (weights min(n_i / n_max, 1)); the default, the largest client's size, "
                        "depends on the data and breaks the sensitivity bound", field="data.n_max")
