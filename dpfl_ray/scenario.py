"""Scenario schema: one YAML file describes one experiment, and nothing else decides what runs.

Unknown keys are errors, every field is type-checked, and every error names its field path
(``data.partition.alpha``) so the CLI can print it on one line. Types are strict: an int field takes
only an integer (not ``true``, ``'3'`` or ``3.0``), a bool only true/false, a float only a finite
number; a key given twice, an empty file and an empty ``--set`` path segment are errors.
"""
from __future__ import annotations

import copy
import math
import re
import reprlib
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .defaults import MAX_LATENCY_S, MAX_NOISE_MULTIPLIER, MIN_CLIP_NORM, MIN_NOISE_MULTIPLIER
from .errors import DPFLError


class _Section(BaseModel):
    # strict: YAML's `true` is not the int 1 and '3' is not 3; no inf/nan: a NaN learning rate
    # "completes" a run with NaN loss
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True, allow_inf_nan=False)


# seeds go to numpy's SeedSequence (no negatives) and torch.manual_seed / JSON readers (int64)
MAX_SEED = 2**63 - 1
# `name` becomes a directory under output.dir: one path component of plain characters
SAFE_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"
# Counts that size an allocation are bounded here, so a slip of the keyboard (10^9 clients, a
# hidden layer of 10^9 units) is one line naming the field, not an out-of-memory minutes later.
# Each is far above what the papers' experiments use (10^4 clients, hidden layers of 200).
MAX_CLIENTS = 1_000_000
MAX_EXAMPLES = 10_000_000  # per client, in the synthetic source, and in all (clients x examples)
MAX_SYNTHETIC_VALUES = 100_000_000  # synthetic examples x features, float32: 400 MB
MAX_HIDDEN_UNITS = 16_384
MAX_HIDDEN_LAYERS = 16
MAX_CANARIES = 10_000
# A lognormal size's sigma of 10 already puts a factor of e^20 between a typical client and one two
# deviations up; beyond that the draw overflows a float before any size exists.
MAX_SIZE_SIGMA = 10.0
# data.normalize's std: inputs are float32, and a std below this makes them overflow or divide by zero
# there (a value of 1e-320 is above 0 as a float64 and 0 as a float32).
MIN_NORMALIZE_STD = 1e-6


class PartitionConfig(_Section):
    kind: Literal["iid", "shards", "dirichlet", "unbalanced"] = "iid"
    shards_per_client: int = Field(2, ge=1, le=10_000, description="shards: label-sorted shards per client")
    alpha: float = Field(0.5, gt=0, description="dirichlet: concentration of the label mix")
    sizes: Literal["equal", "unbalanced"] = Field(
        "equal", description="dirichlet: 'unbalanced' draws client sizes like kind: unbalanced (FEMNIST-like writers)")
    size_distribution: Literal["lognormal", "uniform", "zipf"] = "lognormal"
    size_mean: float = Field(100.0, gt=0, le=MAX_EXAMPLES, description="unbalanced: mean client size")
    size_sigma: float = Field(1.0, ge=0, le=MAX_SIZE_SIGMA, description="unbalanced lognormal: sigma of log-size")
    min_size: int = Field(1, ge=1, le=MAX_EXAMPLES, description="unbalanced/dirichlet: smallest client")


class DataConfig(_Section):
    source: Literal["mnist5k", "digits", "iris", "idx", "fashion_mnist", "mnist", "synthetic"] = "mnist5k"
    path: str | None = Field(None, description="idx, fashion_mnist, mnist: folder holding the four IDX files "
                                               "(fashion_mnist and mnist also look in $DPFL_DATA and the "
                                               "system's dataset folders)")
    num_clients: int = Field(100, ge=1, le=MAX_CLIENTS)
    examples_per_client: int | None = Field(None, ge=1, le=MAX_EXAMPLES)
    repeat: bool = Field(False, description="allow reusing examples to reach examples_per_client")
    n_max: float | None = Field(None, gt=0, description="weight cap: w_i = min(n_i / n_max, 1)")
    partition: PartitionConfig = PartitionConfig()
    validation_fraction: float = Field(0.0, ge=0, lt=0.5, description="hold this fraction of validation_from's "
                                       "split out as the server's validation split")
    validation_from: Literal["train", "test"] = Field(
        "train", description="train: the validation split is held out of the training examples before they are "
                             "dealt to the clients; test: out of the test split, so every training example stays "
                             "with a client (a paper that deals the whole training set) and test accuracy is "
                             "measured on the rest of the test split")
    normalize: list[float] | None = Field(
        None, min_length=2, max_length=2,
        description="[mean, std]: every input value becomes (x - mean) / std, training and test alike; "
                    "constants stated here (taken as public), never computed at run time")
    # synthetic source only
    synthetic_examples: int = Field(2000, ge=10, le=MAX_EXAMPLES)
    synthetic_features: int = Field(20, ge=1, le=MAX_SYNTHETIC_VALUES // 10)
    synthetic_classes: int = Field(2, ge=2, le=10_000)

    @model_validator(mode="after")
    def _normalize_divides(self):
        if self.normalize is not None and not self.normalize[1] >= MIN_NORMALIZE_STD:
            raise ValueError(f"data.normalize is [mean, std]; std must be at least {MIN_NORMALIZE_STD:g} (inputs "
                             f"are float32), got {self.normalize[1]}")
        return self

    @model_validator(mode="after")
    def _needs_path(self):
        if self.source == "idx" and not self.path:
            raise ValueError("data.path is required when data.source is 'idx'")
        if self.path and self.source not in ("idx", "fashion_mnist", "mnist"):
            raise ValueError(f"data.source '{self.source}' is embedded and reads no folder given in data.path: remove "
                             "data.path, or use idx, fashion_mnist or mnist")
        return self

    @model_validator(mode="after")
    def _holds_out_something(self):
        if self.validation_from == "test" and self.validation_fraction == 0:
            raise ValueError("data.validation_from: test holds nothing out while data.validation_fraction is 0; set "
                             "the fraction of the test split to hold out (e.g. 0.3) or remove validation_from")
        return self

    @model_validator(mode="after")
    def _bounded(self):
        values = self.synthetic_examples * self.synthetic_features
        if self.source == "synthetic" and values > MAX_SYNTHETIC_VALUES:
            raise ValueError(f"data.synthetic_examples x data.synthetic_features = {values:,} values; at most "
                             f"{MAX_SYNTHETIC_VALUES:,}")
        total = self.num_clients * (self.examples_per_client or 0)
        if total > MAX_EXAMPLES:
            raise ValueError(f"data.num_clients x data.examples_per_client = {total:,} examples; at most "
                             f"{MAX_EXAMPLES:,}")
        p = self.partition
        if p.kind == "unbalanced" or (p.kind == "dirichlet" and p.sizes == "unbalanced"):
            for name, size in (("size_mean", p.size_mean), ("min_size", p.min_size)):
                if self.num_clients * size > MAX_EXAMPLES:
                    raise ValueError(f"data.num_clients x data.partition.{name} = {self.num_clients * size:,.0f} "
                                     f"examples; at most {MAX_EXAMPLES:,}")
        return self


class ModelConfig(_Section):
    name: Literal["cnn", "mlp", "logistic"] = "cnn"
    hidden: list[Annotated[int, Field(ge=1, le=MAX_HIDDEN_UNITS)]] = Field(
        default_factory=lambda: [200, 200], max_length=MAX_HIDDEN_LAYERS, description="mlp hidden sizes")


HANG_TIMEOUT_S = 600.0


class TrainingConfig(_Section):
    algorithm: Literal["fedavg", "dp_fedavg", "baek", "nbafl", "huang2020", "adap_dpfl"] = "fedavg"
    rounds: int = Field(50, ge=1)
    local_epochs: int = Field(1, ge=1)
    batch_size: int = Field(10, ge=1)
    lr: float = Field(0.15, gt=0)
    clip_norm: float | None = Field(None, gt=0, description="Baek et al. Alg. 1 update clipping C")
    server_lr: float = Field(1.0, gt=0)
    prox_mu: float = Field(0.0, ge=0, description="proximal term mu/2 ||w - theta||^2 of local training "
                                                   "(Wei et al. 2020 Alg. 1 line 6; FedProx)")
    round_deadline_s: float | None = Field(
        None, gt=0, description="local training's deadline: late workers' clients are dropped")
    hang_timeout_s: float = Field(
        HANG_TIMEOUT_S, gt=0, description="with no round_deadline_s: a phase still running after this long stops "
                                          "the run with an error (a hung worker); no client is dropped for the "
                                          "machine's speed")

    @model_validator(mode="after")
    def _one_wait(self):
        # A planned deadline sets the real wait itself (runtime/secagg_round.real_deadline): a hang
        # timeout beside it would be ignored, so it is refused (the default is what a dump carries).
        if self.round_deadline_s is not None and self.hang_timeout_s != HANG_TIMEOUT_S:
            raise ValueError("training.hang_timeout_s is for runs without training.round_deadline_s: a planned "
                             "deadline sets the wait (deadline + max(10 s, deadline)); give one of the two")
        return self


class SamplingConfig(_Section):
    mode: Literal["fixed", "poisson"] = "fixed"
    clients_per_round: int | None = Field(10, ge=1, description="fixed: m of K clients per round")
    rate: float | None = Field(None, gt=0, le=1, description="poisson: inclusion probability q")
    overcommit: float = Field(1.0, ge=1, description="Bonawitz et al. 2019: sample this many times the clients "
                                                      "needed; the round keeps the first to report (docs/faults.md)")

    @model_validator(mode="after")
    def _mode_fields(self):
        if self.mode == "poisson" and self.rate is None:
            raise ValueError("sampling.rate is required when sampling.mode is 'poisson'")
        if self.mode == "fixed" and self.clients_per_round is None:
            raise ValueError("sampling.clients_per_round is required when sampling.mode is 'fixed'")
        return self


class ClippingConfig(_Section):
    mode: Literal["fixed", "median", "adaptive"] = "fixed"
    norm: float = Field(1.0, gt=0, description="S (fixed), or the initial S (adaptive)")
    target_quantile: float = Field(0.5, gt=0, lt=1, description="adaptive: gamma (Andrew et al. 2019)")
    learning_rate: float = Field(0.2, gt=0, description="adaptive: eta_C of the geometric update")
    count_noise_multiplier: float | None = Field(
        None, gt=0, description="adaptive: sigma_b of the clipped-count query; default max(expected cohort / 20, z)")


class GeyerRuleConfig(_Section):
    """Geyer et al. 2017: fix epsilon, stop before delta(epsilon) would exceed the threshold Q."""

    epsilon: float = Field(8.0, gt=0)
    delta_threshold: float = Field(..., gt=0, lt=1)


class NbaflConfig(_Section):
    """Wei et al. 2020 (NbAFL): the paper's own privacy level and who the ledger protects against."""

    epsilon: float = Field(..., gt=0, description="the paper's epsilon for the whole training")
    exposures: int | None = Field(None, ge=1, description="L: uploads per client; default "
                                                          "ceil(rounds * clients per round / clients)")
    threat_model: Literal["server", "broadcast"] = Field(
        "server", description="server: the server sees each upload (or, with SecAgg, their sum); broadcast: "
                              "an observer of the broadcast models (uplink noise in the average + downlink noise)")


class Huang2020Config(_Section):
    """Huang et al. 2020 (DP-FL for unbalanced data): per-client budgets by data amount and DPAGD
    (docs/record_level_dp.md). The per-example clipping bound S is privacy.clipping.norm."""

    category_budgets: list[Annotated[float, Field(gt=0)]] = Field(
        default_factory=lambda: [1.0, 2.75, 4.5, 6.25, 8.0], min_length=1,
        description="eps_k of each data-amount category, smallest clients first (Fig. 7: 1 to 8)")
    step_sizes: list[Annotated[float, Field(gt=0)]] = Field(
        default_factory=lambda: [2.0, 5.0, 10.0, 20.0, 50.0], min_length=1,
        description="Theta: the step-size candidates of the noisy arg-max ('no step' is always one)")
    epsilon_gradient: float = Field(0.01, gt=0, description="initial eps_g of each noisy gradient")
    epsilon_selection: float = Field(0.005, gt=0, description="initial eps_n of each step-size selection")
    gamma: float = Field(0.1, ge=0, lt=1, description="budget increase rate after a 'no step' selection")
    loss_clip: float = Field(5.0, gt=0, description="per-example loss bound: the arg-max's sensitivity")
    calibration: Literal["zcdp", "eq3"] = Field(
        "zcdp", description="read the budgets as zCDP rho (Lee & Kifer) or calibrate the Gaussian by eq. 3")


class AdapDPFLConfig(_Section):
    """Fu et al. 2022 (Adap DP-FL): per-example DP-SGD with adaptive per-client clipping and noise
    decay; sigma_0 is privacy.noise_multiplier (docs/record_level_dp.md)."""

    epsilon: float = Field(2.0, gt=0, description="each client's budget: it stops uploading before passing it")
    lot_size: int = Field(78, ge=1, description="L: expected Poisson lot size")
    steps: int = Field(1, ge=1, description="DP-SGD steps (lots) per client and round")
    lr: float = Field(0.002, gt=0, description="Adam's learning rate")
    alpha: float | None = Field(1.0, gt=0, description="clipping factor of eq. 6-8; null: constant clipping at "
                                                        "privacy.clipping.norm")
    beta: float | None = Field(0.9999, gt=0, lt=1, description="noise decay of eq. 9; null: constant sigma")
    min_clip_norm: float = Field(MIN_CLIP_NORM, gt=0, description="the floor of eq. 6's threshold, which the paper leaves "
                                                         "unbounded below (at alpha < 1 it shrinks towards 0)")
    initial_clip: Literal["noise", "eq6"] = Field(
        "noise", description="C_0, each client's first threshold (Sec. IV-A, 'training on random noise for one "
                             "round and extracting the mean l2-norm'): 'noise' is that mean norm; 'eq6' reads the "
                             "noise round as eq. 6's previous round: alpha times that mean")
    stop_on: Literal["accounted", "claimed"] = Field(
        "accounted", description="which epsilon ends a client's uploads: 'accounted' (the norm query booked "
                                 "beside the gradient) or 'claimed' (the paper's eq. 10, gradient only: the run "
                                 "as published, whose accounted epsilon then passes the budget)")
    optimizer_state: Literal["round", "client", "server"] = Field(
        "round", description="Adam's moments: 'round' starts a new optimizer in every client round (each "
                             "one-lot round is then Adam's first step, about lr x sign of the noisy gradient); "
                             "'client' keeps each client's moments from its last round to its next, as one "
                             "optimizer per client does; 'server': clients release their noisy gradients and "
                             "one Adam at the server, kept across rounds, steps on their weighted mean")


class AuditConfig(_Section):
    """Andrew et al. 2024: canary clients whose updates are seeded random directions, and as many
    held out, measure epsilon from below in the same run (docs/audit.md)."""

    canaries: int = Field(..., ge=2, le=MAX_CANARIES,
                          description="k canary clients joining the population (k more held out)")
    threat_model: Literal["final_model", "all_iterates", "server_view"] = "final_model"
    seed: int | None = Field(None, ge=0, description="canary directions (default: the scenario seed)")
    dropouts: bool = Field(False, description="canaries drop out like other clients (default: they never do)")


class PrivacyConfig(_Section):
    """Client-level DP (training.algorithm: dp_fedavg or baek). Every epsilon comes from the ledger."""

    noise_multiplier: float | None = Field(
        None, ge=MIN_NOISE_MULTIPLIER, le=MAX_NOISE_MULTIPLIER,
        description="z: noise std = z * S on the sum (dp_fedavg), z * 2C (baek, replace-one); from 1e-9 (below "
                    "which no epsilon means anything) to 1e6, where epsilon is 0 to every printed digit")
    clipping: ClippingConfig = ClippingConfig()
    denominator: Literal["expected", "bounded", "actual"] | None = Field(
        None, description="dp_fedavg: divide by the expected cohort weight (default), by max(F qW, actual) "
                          "(bounded, McMahan et al. 2018), or by the actual one (not covered by DP); "
                          "baek always divides by the survivors' weight")
    accountant: Literal["pld", "rdp", "rdp-classic"] = "pld"
    delta: float = Field(1e-5, gt=0, lt=1)
    target_epsilon: float | None = Field(None, gt=0, description="budget: stop before exceeding it")
    geyer: GeyerRuleConfig | None = None
    nbafl: NbaflConfig | None = None
    huang2020: Huang2020Config | None = None
    adap_dpfl: AdapDPFLConfig | None = None
    audit: AuditConfig | None = None
    calibration: Literal["none", "baek", "baek-extended", "layered"] = Field(
        "none", description="baek: what happens to the distributed noise after dropouts (docs/baek2021.md)")
    min_weight_fraction: float = Field(
        0.5, gt=0, le=1, description="baek-extended: n_0 = F * expected sampled weight; layered: the round "
                                     "tolerates up to N - ceil(F * N) of its N sampled clients dropping; "
                                     "dp_fedavg denominator bounded: the floor F * expected weight")
    adjacency: Literal["add_remove", "replace_one", "zero_out"] | None = Field(
        None, description="the neighbouring relation the ledger's epsilon is under; default: the strictest the "
                          "algorithm honours as released (docs/sensitivity.md)")
    population_weight: float | None = Field(
        None, gt=0, description="dp_fedavg: W, the population's total weight, declared public; the expected and "
                                "bounded denominators are q * W (default: data.num_clients; zero_out uses the "
                                "actual population's). baek-extended: n_0 = min_weight_fraction * q * W")
    randomness: Literal["reproducible", "os"] = Field(
        "reproducible", description="DP noise and layer seeds from the scenario seed (repeatable), or from "
                                    "os.urandom expanded by ChaCha20 (not repeatable)")
    distributed_noise: Literal["gaussian", "skellam", "discrete_gaussian"] = Field(
        "gaussian", description="baek: the clients' noise shares; skellam / discrete_gaussian: integers added "
                                "inside SecAgg's ring of secagg.bits bits, booked by their own RDP "
                                "(docs/distributed_dp.md)")


class SecAggConfig(_Section):
    """Secure aggregation (Bonawitz et al. 2017; SecAgg+ of Bell et al. 2020) of the weighted updates."""

    enabled: bool = False
    protocol: Literal["secagg", "secagg+"] = "secagg"
    bits: int = Field(64, description="the ring Z_2^bits: 32 or 64 for fixed-point encoding; 8-32 for the "
                                       "integer noise of privacy.distributed_noise")
    max_wrap_probability: float = Field(
        1e-4, gt=0, lt=1, description="integer noise: the scale is the finest whose bound on a modular wrap of "
                                      "the round's sum stays below this")
    scale: float | None = Field(
        None, gt=0, description="fixed-point scale; default 2^40 for 64-bit words, 2^16 for 32-bit")
    overflow: Literal["error", "clip"] = "error"
    threshold: int | str | None = Field(
        None, description="t; default floor(2n/3)+1 (secagg); 'majority': floor(n/2)+1 of this round's n")
    degree: int | None = Field(None, ge=2, description="secagg+ neighbours; default ceil(8 log2 n), even")
    dropout_tolerance: float | None = Field(
        None, ge=0, lt=0.5, description="secagg+: fraction of a round's clients that may drop; picks degree and "
        "threshold by Bell et al. 2020's bounds (docs/secagg.md)")
    failure_log2: float = Field(
        20.0, gt=0, le=1000, description="secagg+ with dropout_tolerance: a round aborts with probability <= 2^-this")

    @property
    def resolved_scale(self) -> float:
        # 2^40 leaves 2^23 / n of headroom per summand in 64 bits and rounds far below float32's
        # resolution, so SecAgg reproduces the plain model bit for bit in practice.
        return self.scale if self.scale is not None else (2.0 ** 40 if self.bits == 64 else 2.0 ** 16)

    phase_timeout_seconds: float | None = Field(
        None, gt=0, description="a worker that misses a phase's deadline drops its clients in that phase")

    @field_validator("bits")
    @classmethod
    def _bits(cls, b):
        if not (b in (32, 64) or 8 <= b <= 31):
            raise ValueError(f"must be 32 or 64 (fixed-point encoding) or 8-31 (integer noise), got {b}")
        return b

    @field_validator("threshold", mode="before")
    @classmethod
    def _threshold(cls, t):
        if t is not None and t != "majority" and (isinstance(t, bool) or not isinstance(t, int) or t < 1):
            raise ValueError(f"must be an integer >= 1, 'majority' or unset (got {t!r})")
        return t

    @model_validator(mode="after")
    def _tolerance_needs_secagg_plus(self):
        if self.dropout_tolerance is not None and self.protocol != "secagg+":
            raise ValueError("secagg.dropout_tolerance picks the secagg+ degree; secagg uses the complete graph "
                             "(set secagg.threshold instead)")
        return self


class DropoutConfig(_Section):
    model: Literal["none", "bernoulli", "tail"] = "none"
    rate: float = Field(0.0, ge=0, le=1, description="fraction of the clients still present in this phase")
    phase: Literal["training", "advertise", "share", "upload", "unmask", "calibration"] = "upload"


_Phase = Literal["training", "advertise", "share", "upload", "unmask", "calibration"]


class LatencyConfig(_Section):
    """A straggler's extra delay before its update arrives, in seconds."""

    distribution: Literal["fixed", "lognormal", "uniform"] = "lognormal"
    seconds: float = Field(2.0, ge=0, le=MAX_LATENCY_S, description="fixed: the delay")
    median_s: float = Field(2.0, gt=0, le=MAX_LATENCY_S, description="lognormal: the median delay")
    sigma: float = Field(0.5, ge=0, le=MAX_SIZE_SIGMA, description="lognormal: sigma of the log-delay (a delay "
                                                                     f"drawn above {MAX_LATENCY_S:,.0f} s is that)")
    low_s: float = Field(0.0, ge=0, le=MAX_LATENCY_S, description="uniform: shortest delay")
    high_s: float = Field(4.0, gt=0, le=MAX_LATENCY_S, description="uniform: longest delay")

    @model_validator(mode="after")
    def _range(self):
        if self.distribution == "uniform" and self.low_s > self.high_s:
            raise ValueError(f"low_s={self.low_s} exceeds high_s={self.high_s}")
        return self


class StragglerTierConfig(_Section):
    """Slow devices: clients that straggle whenever they are sampled."""

    clients: list[int] | None = Field(None, description="these client ids")
    share: float | None = Field(None, gt=0, le=1, description="or this share of all clients, drawn from the seed")
    latency: LatencyConfig = LatencyConfig()

    @model_validator(mode="after")
    def _who(self):
        if (self.clients is None) == (self.share is None):
            raise ValueError("a straggler tier needs exactly one of clients or share")
        if self.clients is not None and any(c < 0 for c in self.clients):
            raise ValueError("clients: client ids are >= 0")
        return self


class StragglersConfig(_Section):
    fraction: float = Field(0.0, ge=0, le=1, description="each sampled client outside the tiers straggles this "
                                                          "round with this probability")
    latency: LatencyConfig = LatencyConfig()
    tiers: list[StragglerTierConfig] = Field(default_factory=list)


class CrashConfig(_Section):
    """Worker crashes: drawn per worker and round, or at listed [round, phase(, worker)] points."""

    rate: float = Field(0.0, ge=0, le=1, description="each worker crashes in a round with this probability")
    phase: _Phase = Field("training", description="the phase of a rate-drawn crash")
    at: list[list] = Field(default_factory=list, description="[[round, phase], [round, phase, worker], ...]; "
                                                             "rounds count from 1 as in rounds.jsonl")

    @field_validator("at")
    @classmethod
    def _points(cls, at):
        from .faults.plan import parse_crash_points

        parse_crash_points(at)  # raises ValueError naming the entry
        return at


class NodeFailureConfig(_Section):
    at_round: int | list[int] = Field(..., description="round(s), counted from 1, in which nodes are lost")
    nodes: int = Field(1, ge=1, description="nodes lost at each listed round")
    phase: _Phase = "training"

    @field_validator("at_round")
    @classmethod
    def _rounds(cls, at):
        if any(isinstance(r, bool) or r < 1 for r in ([at] if isinstance(at, int) else at)) or at == []:
            raise ValueError("rounds count from 1 and the list cannot be empty")
        return at

    @property
    def rounds(self) -> list[int]:
        return [self.at_round] if isinstance(self.at_round, int) else list(self.at_round)


_Corruption = Literal["nan", "inf", "shape", "norm"]


class CorruptConfig(_Section):
    kind: _Corruption | list[_Corruption] = Field("nan", description="one kind, or a list to draw from")
    clients: list[int] = Field(default_factory=list, description="these clients corrupt every update they send")
    fraction: float = Field(0.0, ge=0, le=1, description="and each other sampled client with this probability")

    @model_validator(mode="after")
    def _kinds(self):
        if self.kind == []:
            raise ValueError("kind: the list of kinds cannot be empty")
        if any(c < 0 for c in self.clients):
            raise ValueError("clients: client ids are >= 0")
        return self

    @property
    def kinds(self) -> list[str]:
        return list(self.kind) if isinstance(self.kind, list) else [self.kind]


class AvailabilityConfig(_Section):
    trace: str = Field(..., description="CSV client_id,round,available (rounds from 1; unlisted = available)")


class FaultsConfig(_Section):
    # one dropout model, or a list of them for several phases of the same round
    dropout: DropoutConfig | list[DropoutConfig] = DropoutConfig()
    stragglers: StragglersConfig | None = None
    crash: CrashConfig | None = None
    node_failure: NodeFailureConfig | None = None
    corrupt: CorruptConfig | None = None
    availability: AvailabilityConfig | None = None
    max_update_norm: float = Field(1e6, gt=0, description="an update with a larger L2 norm is rejected as corrupt")

    @property
    def dropouts(self) -> list[DropoutConfig]:
        return list(self.dropout) if isinstance(self.dropout, list) else [self.dropout]


class ResourcesConfig(_Section):
    workers: int | Literal["auto"] = "auto"
    num_cpus_per_worker: float = Field(1.0, ge=0)
    num_gpus_per_worker: float = Field(0.0, ge=0)
    torch_threads: int = Field(1, ge=1, description="intra-op threads per worker (fixed for determinism)")

    @model_validator(mode="after")
    def _workers_positive(self):
        if isinstance(self.workers, int) and self.workers < 1:
            raise ValueError("resources.workers must be >= 1 or 'auto'")
        return self


class OutputConfig(_Section):
    dir: str = "runs"
    eval_every: int = Field(1, ge=1)
    checkpoint_every: int = Field(1, ge=0, description="write checkpoint.npz every k rounds (0: never); "
                                                         "dpfl run --resume continues from it")
    client_accuracy: bool = Field(False, description="in the last planned round, evaluate each surviving "
                                  "client's own model (the broadcast model after its local training, before "
                                  "clipping or noise) on the test split: summary.json's client_accuracy "
                                  "(Huang et al. 2020, Fig. 7)")


class Scenario(_Section):
    name: str = Field("unnamed", description="letters, digits, '.', '_', '-' (it names the run's folder)")
    description: str = ""
    seed: int = Field(0, ge=0, le=MAX_SEED)
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    training: TrainingConfig = TrainingConfig()
    sampling: SamplingConfig = SamplingConfig()
    privacy: PrivacyConfig = PrivacyConfig()
    secagg: SecAggConfig = SecAggConfig()
    faults: FaultsConfig = FaultsConfig()
    resources: ResourcesConfig = ResourcesConfig()
    output: OutputConfig = OutputConfig()

    @field_validator("name")
    @classmethod
    def _safe_name(cls, name: str) -> str:
        if not re.fullmatch(SAFE_NAME, name):
            raise ValueError(f"must be 1-100 letters, digits, '.', '_' or '-', starting with a letter or digit "
                             f"(it names the run's folder; got {name!r})")
        return name

    @model_validator(mode="after")
    def _algorithm_checks(self):
        # Each algorithm states what it needs from a scenario (algorithms/<name>.py).
        from .algorithms import algorithm_class_named

        cls = algorithm_class_named(self.training.algorithm)
        cls.check_scenario(self)
        if self.privacy.audit is not None and not cls.client_level():
            raise ValueError(f"privacy.audit: canary clients audit client-level mechanisms; "
                             f"{self.training.algorithm} has none to audit")
        if cls.client_level() and self.faults.max_update_norm < self.privacy.clipping.norm:
            # an honest update clipped to C with a norm in (max_update_norm, C] would be rejected: its
            # data would decide who is summed, and its id would reach rounds.jsonl, unbooked
            raise ValueError(f"faults.max_update_norm={self.faults.max_update_norm:g} is below "
                             f"privacy.clipping.norm={self.privacy.clipping.norm:g}: the check would reject honest "
                             "clipped updates by their data; give at least the clipping norm")
        if self.output.client_accuracy and cls.client_level():
            # each client's model before its noise is a function of its data alone: its accuracy
            # would leave the run outside the client-level guarantee the ledger books
            raise ValueError(f"output.client_accuracy: {self.training.algorithm} adds its noise after the local "
                             "training, so each client's own model is not covered by its guarantee; it is for "
                             "record-level algorithms (huang2020, adap_dpfl) and runs without privacy")
        return self

    @model_validator(mode="after")
    def _ring_checks(self):
        integer = self.privacy.distributed_noise != "gaussian"
        if integer and not self.secagg.enabled:
            raise ValueError(f"privacy.distributed_noise: {self.privacy.distributed_noise} noise is added inside "
                             "secure aggregation; set secagg.enabled: true")
        if not integer and self.secagg.bits not in (32, 64):
            raise ValueError(f"secagg.bits: {self.secagg.bits} bits carry the integer noise of "
                             "privacy.distributed_noise; fixed-point encoding takes 32 or 64")
        if integer and self.secagg.bits == 64:
            raise ValueError("secagg.bits: integer noise needs a ring of 8-32 bits")
        scale, bits = self.secagg.scale, self.secagg.bits
        # fixed-point encoding: a scale of half the ring or more encodes no value of magnitude 1, and every
        # round aborts (or clips); integer noise sets its own scale and reads no secagg.scale
        if self.secagg.enabled and not integer and scale is not None and scale >= 2.0 ** (bits - 1):
            raise ValueError(f"secagg.scale={scale:g} leaves no value of magnitude 1 inside the ring of {bits} bits: "
                             f"give less than 2^{bits - 1} ({2.0 ** (bits - 1):g})")
        return self

    @model_validator(mode="after")
    def _cross_checks(self):
        canaries = self.privacy.audit.canaries if self.privacy.audit else 0  # audit canaries join the population
        population = self.data.num_clients + canaries
        if self.sampling.mode == "fixed" and self.sampling.clients_per_round > population:
            extra = f" + {canaries} audit canaries" if canaries else ""
            raise ValueError(
                f"sampling.clients_per_round={self.sampling.clients_per_round} exceeds "
                f"data.num_clients={self.data.num_clients}{extra}")
        threshold = self.secagg.threshold
        if self.secagg.enabled and isinstance(threshold, int):
            # a round's threshold is at most its cohort; one above every cohort would never be the one used
            if self.sampling.mode == "fixed":
                largest = min(population, math.ceil(self.sampling.overcommit * self.sampling.clients_per_round))
                what = "sampling.clients_per_round" + (" x sampling.overcommit" if self.sampling.overcommit > 1 else "")
            else:
                largest, what = population, "the population"
            if threshold > largest:
                raise ValueError(f"secagg.threshold={threshold} exceeds the most clients a round can have ({largest}, "
                                 f"{what}): no round could use it; set at most {largest}")
        return self

    @model_validator(mode="after")
    def _fault_checks(self, info):  # info: pydantic.ValidationInfo
        from .faults.plan import check_scenario

        # context={"read_files": False}: a process on another node, which gets the trace from the driver
        check_scenario(self, read_files=(info.context or {}).get("read_files", True))
        return self

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


_UNION_TAGS = {"DropoutConfig", "int", "str", "float", "bool"}
_TYPE_MISMATCH = ("model_type", "list_type", "dict_type", "model_attributes_type")


def _is_tag(part) -> bool:
    """Location parts that are pydantic's, not the user's: validator and union-member tags."""
    text = str(part)
    return isinstance(part, str) and (text.startswith("function-") or "[" in text or text in _UNION_TAGS)


# The offending value is quoted in the one-line error: bounded, whatever its size or depth.
_INPUT_REPR = reprlib.Repr()
_INPUT_REPR.maxlevel, _INPUT_REPR.maxlist, _INPUT_REPR.maxdict = 3, 8, 8
_INPUT_REPR.maxstring = _INPUT_REPR.maxother = 120


def _format_validation_error(err: ValidationError) -> str:
    errors = err.errors()
    # A one-or-many field reports each union member; the member of the wrong shape is noise.
    errors = [e for e in errors if e["type"] not in _TYPE_MISMATCH] or errors
    first = errors[0]
    parts = first["loc"]
    # an unknown key is the user's own text, whatever brackets it holds: never taken for a tag
    mine = len(parts) - 1 if first["type"] == "extra_forbidden" else len(parts)
    loc = ".".join(str(p) for i, p in enumerate(parts) if i >= mine or not _is_tag(p))
    msg = first["msg"]
    if first["type"] == "extra_forbidden":
        msg = "unknown key"
    elif "input" in first and first["type"] not in ("value_error", "missing"):
        msg = f"{msg} (got {_INPUT_REPR.repr(first['input'])})"
    msg = msg.removeprefix("Value error, ")
    extra = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{loc}: {msg}{extra}" if loc else f"{msg}{extra}"


# The deepest field of a scenario (faults.stragglers.tiers[i].latency.seconds) is 6 levels down; the
# composer and everything that walks the tree recurse once per level, so a cap far below Python's
# recursion limit turns a pathological nesting into one line instead of a RecursionError.
MAX_DEPTH = 32
# Larger than any scenario needs (client lists included); read into memory whole, so bounded.
MAX_SCENARIO_BYTES = 1 << 20


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader, except that a key given twice in one mapping is an error (PyYAML keeps
    the last one silently, so a scenario could say two things and mean one), anchors and aliases
    are refused, and nesting is capped at MAX_DEPTH.

    An alias shares its anchor's node, so nine nested aliases of nine items each load as a few
    hundred nodes and *walk* as 9^9 (validation, copying, error messages all expand them: 24 GB).
    A scenario has no use for them, so refusing them here, while composing, is the one place that
    bounds every later walk by the size of the text."""

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):
        event = self.peek_event()
        where = f"line {event.start_mark.line + 1}"
        if isinstance(event, yaml.AliasEvent) or event.anchor is not None:
            mark = f"*{event.anchor}" if isinstance(event, yaml.AliasEvent) else f"&{event.anchor}"
            raise DPFLError(f"{where}: YAML anchors and aliases ({mark}) are not allowed in a scenario; "
                            "write the value out")
        if self._depth >= MAX_DEPTH:
            raise DPFLError(f"{where}: nested more than {MAX_DEPTH} levels deep (a scenario needs fewer than 10)")
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def fetch_flow_collection_start(self, token_class):
        # The scanner looks ahead while a flow collection may still be a key, and pays for every
        # open bracket on each token: 100,000 of them took seconds before the composer saw one.
        if self.flow_level >= MAX_DEPTH:
            raise DPFLError(f"line {self.line + 1}: nested more than {MAX_DEPTH} levels deep "
                            "(a scenario needs fewer than 10)")
        super().fetch_flow_collection_start(token_class)


def _mapping_without_duplicates(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            duplicate = key in seen
        except TypeError:  # an unhashable key: construct_mapping reports it
            continue
        if duplicate:
            raise DPFLError(f"line {key_node.start_mark.line + 1}: key {key!r} is given twice")
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)
# YAML 1.2 reads `1e-5` as a float; PyYAML (YAML 1.1) wants a dot and would hand strict float
# fields the *string* '1e-5'. (`1e400` becomes inf, which the schema then refuses.)
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


def load_yaml(text: str) -> Any:
    """YAML as a scenario is read: no aliases or duplicate keys, bounded depth (DPFLError otherwise)."""
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass


_load_yaml = load_yaml


def _parse_value(text: str) -> Any:
    # YAML scalars give the natural types (1 -> int, 0.3 -> float, true -> bool, [1,2] -> list).
    try:
        return _load_yaml(text)
    except yaml.YAMLError:
        return text


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """A copy of a raw scenario mapping with ``a.b.c=value`` overrides applied (types are checked
    afterwards); the caller's mapping is left as it was."""
    raw = copy.deepcopy(raw) if overrides else raw
    for item in overrides:
        if "=" not in item:
            raise DPFLError(f"override {item!r} must look like key.path=value", field="--set")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        if not key.strip():
            raise DPFLError(f"override {item!r} has an empty key", field="--set")
        if any(not p.strip() for p in parts):
            raise DPFLError(f"override {item!r} has an empty path segment", field="--set")
        parts = [p.strip() for p in parts]
        if len(parts) > MAX_DEPTH:
            raise DPFLError(f"override {item[:60]!r}... is nested more than {MAX_DEPTH} levels deep", field="--set")
        node = raw
        for p in parts[:-1]:
            child = node.get(p)
            if child is None:
                child = node[p] = {}
            if not isinstance(child, dict):
                raise DPFLError(f"cannot set a key inside non-section {p!r}", field=key)
            node = child
        try:
            node[parts[-1]] = _parse_value(value)
        except DPFLError as err:  # the loader's refusals (aliases, depth) name a line of a one-line value
            raise DPFLError(str(err).removeprefix("line 1: "), field=f"--set {key.strip()}") from None
    return raw


def scenario_from_dict(raw: Any, overrides: list[str] | None = None) -> Scenario:
    if not isinstance(raw, dict):
        raise DPFLError("a scenario must be a YAML mapping of sections")
    raw = apply_overrides(raw, overrides or [])
    try:
        return Scenario.model_validate(raw)
    except ValidationError as err:
        raise DPFLError(_format_validation_error(err)) from None


def first_difference(recorded, current, path: str = ""):
    """The dotted path of the first field whose value differs between two resolved scenarios
    (``model_dump(mode="json")``), in the recorded one's order, with both values; None if none does.
    A key only one side has is a field added to or dropped from the schema since ``recorded`` was
    written, not an edit, and is passed over."""
    if isinstance(recorded, dict) and isinstance(current, dict):
        for key in recorded:
            if key in current:
                found = first_difference(recorded[key], current[key], f"{path}.{key}" if path else str(key))
                if found is not None:
                    return found
        return None
    return None if recorded == current else (path or "(the scenario)", recorded, current)


def load_scenario(path: str | Path, overrides: list[str] | None = None) -> Scenario:
    path = Path(path)
    if not path.is_file():
        raise DPFLError(f"no scenario file at {path}")
    if path.stat().st_size > MAX_SCENARIO_BYTES:
        raise DPFLError(f"{path}: {path.stat().st_size} bytes; a scenario is at most {MAX_SCENARIO_BYTES} bytes")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise DPFLError(f"{path}: not a text (UTF-8) file; a scenario is YAML") from None
    try:
        raw = _load_yaml(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark else ""
        raise DPFLError(f"{path}: not valid YAML{where}") from None
    except DPFLError as err:
        raise DPFLError(f"{path}: {err}") from None
    if raw is None or raw == {}:
        # every default would run, as 'unnamed': almost certainly the wrong file
        raise DPFLError(f"{path}: the scenario is empty")
    return scenario_from_dict(raw, overrides)
