"""Empirical epsilon from below: random canary clients in the same training run.

Andrew, Kairouz, Oh, Oprea, McMahan, Suriyakumar, "One-shot Empirical Privacy Estimation for
Federated Learning" (ICLR 2024, arXiv 2302.03098); derivation and limits in docs/audit.md.

* 2k canary directions u_j, uniform on the unit sphere of R^d, regenerated on demand from
  ``(seed, j)``: j < k are inserted (canary client j sends C u_j), j >= k are held out.
* A statistic per canary: the cosine of u_j with what the adversary sees.
  ``final_model``: theta_T - theta_0 (Alg. 2). ``all_iterates``: the largest cosine with a
  round's release theta_t - theta_{t-1} (Alg. 3). ``server_view``: the same maximum over the best
  linear (generalised-least-squares) estimate of each round's sum from every view the server
  holds (docs/baek2021.md).
* Fit: the cosine of a direction independent of the release has mean 0 and variance 1/d exactly,
  and tends to N(0, 1/d); for an inserted canary it tends to N(mu/sqrt(d), 1/d) under the
  Gaussian mechanism (Sec. 3). The separation ``mu`` = (mean inserted - mean null) / std null is
  the Gaussian-DP parameter of the test, and epsilon(delta) = that of a Gaussian mechanism with
  noise multiplier 1/mu, from ``dp_accounting.get_epsilon_gaussian`` (Balle & Wang's exact
  analytic conversion). The null is the closed form when the statistic is one cosine, else the
  held-out canaries (a maximum over rounds has no closed form here).
* The paper fits the inserted spread separately; at delta = 1e-5 a 2% error in that spread moves
  epsilon by up to 20%, so we use the null's spread (equal variances, as the limit has) and report
  the ratio as ``spread_ratio``. The interval is a percentile bootstrap over canaries.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

import dp_accounting
import numpy as np

from dpfl_ray import rng
from dpfl_ray.errors import DPFLError
from dpfl_ray.privacy.validation import _check_delta, _check_int, _check_real

THREAT_MODELS = ("final_model", "all_iterates", "server_view")
NULLS = ("auto", "closed_form", "held_out")
CANARY_PURPOSE = "audit-canary"
BOOTSTRAP_PURPOSE = "audit-bootstrap"
RECORD_FORMAT = 1
_CHUNK_BYTES = 32 << 20  # canaries generated per block: bounded memory at d = 1e6


# --- canary directions ---------------------------------------------------------------------------

def _raw_direction(seed: int, j: int, dim: int) -> np.ndarray:
    return rng.generator(seed, CANARY_PURPOSE, client_id=j).standard_normal(dim, dtype=np.float32)


def canary_block(seed: int, start: int, stop: int, dim: int) -> np.ndarray:
    """Rows u_start..u_{stop-1}, float32, each a uniform unit vector (a normalised Gaussian)."""
    block = np.empty((stop - start, dim), dtype=np.float32)
    for row, j in enumerate(range(start, stop)):
        block[row] = _raw_direction(seed, j, dim)
    norms = np.sqrt(np.einsum("ij,ij->i", block, block, dtype=np.float64))
    block /= norms.astype(np.float32)[:, None]
    return block


def canary_direction(seed: int, j: int, dim: int) -> np.ndarray:
    """u_j: the same vector whichever block it is generated in."""
    return canary_block(seed, j, j + 1, dim)[0]


def canary_update(seed: int, j: int, dim: int, clip_norm: float) -> np.ndarray:
    """What canary client j sends: C u_j, exactly at the clip norm (Alg. 2, canary clients)."""
    return canary_direction(seed, j, dim) * np.float32(clip_norm)


def canary_dots(vectors: np.ndarray, seed: int, count: int) -> np.ndarray:
    """<u_j, v> for j < count and each row v of ``vectors``: shape (count, len(vectors))."""
    vectors = np.atleast_2d(np.asarray(vectors, dtype=np.float32))
    dim = vectors.shape[1]
    rows = max(1, min(count, _CHUNK_BYTES // (4 * dim)))
    out = np.empty((count, vectors.shape[0]), dtype=np.float64)
    for start in range(0, count, rows):
        stop = min(count, start + rows)
        out[start:stop] = canary_block(seed, start, stop, dim) @ vectors.T
    return out


# --- several views of one sum --------------------------------------------------------------------

def gls_weights(cov) -> np.ndarray:
    """Weights of the best linear unbiased estimate of S from views S + N(0, cov):
    Sigma^-1 1 / (1' Sigma^-1 1); its error variance is dropouts.best_estimate_variance(cov)."""
    cov = np.atleast_2d(np.asarray(cov, dtype=np.float64))
    if cov.shape[0] != cov.shape[1] or not np.all(np.isfinite(cov)):
        raise DPFLError(f"must be a finite square matrix, got shape {cov.shape}", field="view_cov")
    w = np.linalg.solve(cov, np.ones(cov.shape[0]))
    return w / w.sum()


def best_linear_estimate(views: Sequence[np.ndarray], cov) -> np.ndarray:
    """The server's best estimate of the round's sum from all its views (docs/baek2021.md lemma)."""
    w = gls_weights(cov)
    if len(views) != len(w):
        raise DPFLError(f"{len(views)} views but a {len(w)}x{len(w)} covariance", field="view_cov")
    return sum(wi * np.asarray(v, dtype=np.float64) for wi, v in zip(w, views))


# --- the estimate --------------------------------------------------------------------------------

@dataclass(frozen=True)
class CanaryStatistics:
    """Per-canary statistics of one threat model: ``rounds`` = 1 means one cosine per canary."""

    threat_model: str
    inserted: np.ndarray
    held_out: np.ndarray
    dim: int
    rounds: int

    def to_dict(self) -> dict:
        return {"threat_model": self.threat_model, "dim": self.dim, "rounds": self.rounds,
                "inserted": self.inserted.tolist(), "held_out": self.held_out.tolist()}


@dataclass(frozen=True)
class EmpiricalEpsilon:
    """epsilon at ``delta`` estimated from ``k`` inserted canaries, with a ``confidence`` bootstrap
    interval [low, high]; ``mu`` the fitted Gaussian separation; ``null`` how the null was fitted."""

    epsilon: float
    low: float
    high: float
    threat_model: str
    k: int
    delta: float
    confidence: float
    mu: float
    mu_low: float
    mu_high: float
    null: str
    dim: int
    rounds: int
    spread_ratio: float

    def to_dict(self) -> dict:
        return {key: (None if isinstance(v, float) and not math.isfinite(v) else v)
                for key, v in asdict(self).items()}


def epsilon_of_separation(mu: float, delta: float) -> float:
    """epsilon(delta) of mu-Gaussian DP: the Gaussian mechanism with noise multiplier 1/mu."""
    if not mu > 0:
        return 0.0
    return float(dp_accounting.get_epsilon_gaussian(1.0 / mu, delta))


def _null_kind(stats: CanaryStatistics, null: str) -> str:
    if null not in NULLS:
        raise DPFLError(f"unknown null {null!r}; choose one of {', '.join(NULLS)}", field="null")
    if null == "auto":
        return "closed_form" if stats.rounds == 1 else "held_out"
    return null


def _separations(inserted: np.ndarray, held_out: np.ndarray, dim: int, kind: str) -> np.ndarray:
    """mu for each row (a bootstrap resample) of the statistics."""
    # statistics near the float range overflow in the sums: a non-finite mu, which the caller refuses
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        if kind == "closed_form":  # null N(0, 1/d): mean 0 and variance 1/d of an independent direction
            return inserted.mean(axis=-1) * math.sqrt(dim)
        spread = held_out.std(axis=-1, ddof=1)
        return (inserted.mean(axis=-1) - held_out.mean(axis=-1)) / spread


def estimate_epsilon(stats: CanaryStatistics, delta: float, *, confidence: float = 0.95,
                     null: str = "auto", bootstrap: int = 1000, seed: int = 0) -> EmpiricalEpsilon:
    """Fit the inserted and null statistics and turn their separation into epsilon at ``delta``."""
    delta = _check_delta(delta)
    confidence = _check_real(confidence, "confidence")
    if not 0 < confidence < 1:
        raise DPFLError(f"must be in (0, 1), got {confidence:g}", field="confidence")
    bootstrap = _check_int(bootstrap, "bootstrap", 10)
    kind = _null_kind(stats, null)
    ins, out = np.asarray(stats.inserted, np.float64), np.asarray(stats.held_out, np.float64)
    if ins.size < 2 or (kind == "held_out" and out.size < 2):
        raise DPFLError(f"needs at least 2 inserted and 2 held-out canaries, got {ins.size} and {out.size}",
                        field="canaries")
    if not (np.all(np.isfinite(ins)) and np.all(np.isfinite(out))):
        raise DPFLError("canary statistics must be finite (was any round recorded?)", field="canaries")
    mu = float(_separations(ins, out, stats.dim, kind))
    if not math.isfinite(mu):
        raise DPFLError("the held-out canaries have no spread, or statistics too large to compare; nothing to "
                        "compare with", field="canaries")
    g = rng.generator(seed, BOOTSTRAP_PURPOSE)
    mus = []
    for start in range(0, bootstrap, 100):  # bounded memory for large k
        b = min(100, bootstrap - start)
        ins_b = ins[g.integers(0, ins.size, size=(b, ins.size))]
        out_b = out[g.integers(0, out.size, size=(b, out.size))] if kind == "held_out" else out[None]
        mus.append(_separations(ins_b, out_b, stats.dim, kind))
    # epsilon grows with mu, so the interval of epsilon is that of mu mapped through it
    mu_low, mu_high = np.nanquantile(np.concatenate(mus), [(1 - confidence) / 2, (1 + confidence) / 2])
    null_spread = 1 / math.sqrt(stats.dim) if kind == "closed_form" else float(out.std(ddof=1))
    return EmpiricalEpsilon(
        epsilon=epsilon_of_separation(mu, delta), low=epsilon_of_separation(mu_low, delta),
        high=epsilon_of_separation(mu_high, delta), threat_model=stats.threat_model, k=int(ins.size),
        delta=delta, confidence=confidence, mu=mu, mu_low=float(mu_low), mu_high=float(mu_high), null=kind,
        dim=stats.dim, rounds=stats.rounds, spread_ratio=float(ins.std(ddof=1) / null_spread))


# --- streaming accumulation ----------------------------------------------------------------------

class AuditAccumulator:
    """Per-round canary statistics, without keeping any round's aggregate.

    ``add_round(release)`` takes theta_t - theta_{t-1}, the model's move in a released round,
    oriented so that an inserted canary pushes it along +u_j (our servers add the aggregate).
    One pass over the 2k canaries per round; memory: one d-vector (the sum of the releases, whose
    cosines are the final model's) and a few 2k-vectors.
    """

    def __init__(self, dim: int, canaries: int, seed: int):
        self.dim = _check_int(dim, "dim", 2)
        self.k = _check_int(canaries, "canaries", 2)
        self.seed = _check_int(seed, "seed", 0)
        self.rounds = 0
        self._release_sum = np.zeros(self.dim, dtype=np.float64)
        self._final_dots = np.zeros(2 * self.k, dtype=np.float64)
        self._max_release = np.full(2 * self.k, -np.inf)
        self._max_view = np.full(2 * self.k, -np.inf)

    def _vector(self, v, field: str) -> np.ndarray:
        v = np.asarray(v, dtype=np.float64).ravel()
        if v.size != self.dim or not np.all(np.isfinite(v)):
            raise DPFLError(f"must be a finite vector of {self.dim} numbers, got {v.size}", field=field)
        return v

    def add_round(self, release, *, views: Sequence[np.ndarray] | None = None, view_cov=None) -> None:
        """Record one released round. ``views``: every unbiased view of the round's sum the server
        holds (e.g. Baek's first aggregate A and released sum R, on one scale), with their noise
        covariance ``view_cov`` (any units); without them the server's view is the release."""
        release = self._vector(release, "release")
        vectors = [release]
        if views is not None:
            if view_cov is None:
                raise DPFLError("views need their covariance", field="view_cov")
            vectors.append(best_linear_estimate([self._vector(v, "views") for v in views], view_cov))
        dots = canary_dots(np.stack(vectors), self.seed, 2 * self.k)
        norms = np.array([np.linalg.norm(v) for v in vectors])
        with np.errstate(divide="ignore", invalid="ignore"):  # a zero move has cosine 0 with everything
            cos = np.where(norms > 0, dots / norms, 0.0)
        self._release_sum += release
        self._final_dots += dots[:, 0]
        self._max_release = np.maximum(self._max_release, cos[:, 0])
        self._max_view = np.maximum(self._max_view, cos[:, -1])
        self.rounds += 1

    def statistics(self, threat_model: str) -> CanaryStatistics:
        if threat_model not in THREAT_MODELS:
            raise DPFLError(f"unknown threat model {threat_model!r}; choose one of {', '.join(THREAT_MODELS)}",
                            field="threat_model")
        if self.rounds == 0:
            raise DPFLError("no round was recorded", field="audit")
        if threat_model == "final_model":
            norm = np.linalg.norm(self._release_sum)
            values = self._final_dots / norm if norm > 0 else np.zeros_like(self._final_dots)
            rounds = 1
        else:
            values = self._max_release if threat_model == "all_iterates" else self._max_view
            rounds = self.rounds
        return CanaryStatistics(threat_model, values[: self.k].copy(), values[self.k:].copy(), self.dim, rounds)

    def estimate(self, delta: float, threat_model: str = "final_model", **kwargs) -> EmpiricalEpsilon:
        """:func:`estimate_epsilon` of one threat model; the bootstrap is seeded from the run's seed."""
        kwargs.setdefault("seed", self.seed)
        return estimate_epsilon(self.statistics(threat_model), delta, **kwargs)

    def to_record(self, delta: float | None = None) -> dict:
        """JSON-able: what ``dpfl audit RUN_DIR`` needs to recompute every estimate (no d-vector)."""
        record = {"format": RECORD_FORMAT, "method": "Andrew et al. 2024, one-shot canary clients",
                  "seed": self.seed, "canaries": self.k, "dim": self.dim, "rounds": self.rounds,
                  "statistics": {tm: self.statistics(tm).to_dict() for tm in THREAT_MODELS}}
        if delta is not None:
            record["delta"] = _check_delta(delta)
        return record

    def state_dict(self) -> dict:
        """Everything needed to resume after a checkpoint (numpy arrays; one d-vector)."""
        return {"dim": self.dim, "canaries": self.k, "seed": self.seed, "rounds": self.rounds,
                "release_sum": self._release_sum.copy(), "final_dots": self._final_dots.copy(),
                "max_release": self._max_release.copy(), "max_view": self._max_view.copy()}

    def load_state_dict(self, state: dict) -> None:
        for key in ("dim", "canaries", "seed"):
            if int(state[key]) != getattr(self, "k" if key == "canaries" else key):
                raise DPFLError(f"checkpoint has {key}={state[key]}, this audit {key}="
                                f"{getattr(self, 'k' if key == 'canaries' else key)}", field="audit")
        self.rounds = int(state["rounds"])
        self._release_sum = np.array(state["release_sum"], dtype=np.float64).reshape(self.dim)
        for key in ("final_dots", "max_release", "max_view"):
            setattr(self, "_" + key, np.array(state[key], dtype=np.float64).reshape(2 * self.k))


def statistics_from_record(record: dict) -> dict[str, CanaryStatistics]:
    """The per-threat-model statistics of an :meth:`AuditAccumulator.to_record` dict (audit.json)."""
    try:
        if record.get("format") != RECORD_FORMAT:
            raise DPFLError(f"unknown audit record format {record.get('format')!r}", field="format")
        stats = {tm: CanaryStatistics(tm, np.asarray(s["inserted"], np.float64),
                                      np.asarray(s["held_out"], np.float64), int(s["dim"]), int(s["rounds"]))
                 for tm, s in record["statistics"].items() if tm in THREAT_MODELS}
        for tm, s in stats.items():  # as AuditAccumulator.to_record writes them
            if s.inserted.ndim != 1 or s.held_out.ndim != 1 or s.held_out.size not in (0, s.inserted.size):
                raise DPFLError(f"{tm}: {s.inserted.size} inserted and {s.held_out.size} held-out canaries; a record "
                                "holds one statistic per canary, as many held out as inserted (or none)",
                                field="audit")
            if s.dim < 1 or s.rounds < 1:
                raise DPFLError(f"{tm}: dim {s.dim} and rounds {s.rounds} must be at least 1", field="audit")
        return stats
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        if isinstance(err, DPFLError):
            raise
        raise DPFLError(f"malformed audit record ({type(err).__name__}: {err})", field="audit") from None
