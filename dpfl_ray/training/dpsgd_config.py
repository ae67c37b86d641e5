"""DP-SGD's settings and results as plain data (no torch): what a scenario check, a ledger, a
checkpoint and the coordinator read, so that the processes which never train -- the run's driver and
a sweep's trials; the coordinator unless it evaluates the model itself -- load none of torch. The
computation is :mod:`dpfl_ray.training.local_dp`, which re-exports these."""
from __future__ import annotations

import base64
import math
import numbers
from dataclasses import dataclass
from typing import Literal

import dp_accounting
import numpy as np
from dp_accounting import dp_event as dpe

from ..errors import DPFLError

__all__ = ["AdamState", "DPSGDConfig", "DPSGDResult"]


@dataclass(frozen=True)
class DPSGDConfig:
    """DP-SGD hyperparameters, named as in Abadi et al. 2016 (S, sigma, L) and Fu et al. 2022."""

    clip_norm: float                     # S: per-example L2 bound
    noise_multiplier: float              # sigma: noise std on the clipped sum is sigma * S
    lr: float                            # eta
    lot_size: int                        # L: expected lot size (Poisson) or batch size (fixed)
    sampling: Literal["poisson", "fixed"] = "poisson"
    epochs: float = 1.0                  # steps = round(epochs * n / L) unless ``steps`` is set
    steps: int | None = None
    # "none": the client takes no step and releases its noisy gradients (the server steps on them)
    optimizer: Literal["sgd", "adam", "none"] = "sgd"
    # Fu et al. 2022 eq. 6: also release sum_i min(||g_i||, S) + N(0, (sigma S)^2) per step.
    release_norm_sum: bool = False

    def __post_init__(self) -> None:
        for name in ("clip_norm", "lr"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise DPFLError(f"must be a finite number > 0, got {v!r}", field=name)
        if not (isinstance(self.noise_multiplier, (int, float)) and math.isfinite(self.noise_multiplier)
                and self.noise_multiplier >= 0):
            raise DPFLError(f"must be a finite number >= 0, got {self.noise_multiplier!r}",
                            field="noise_multiplier")
        if isinstance(self.lot_size, bool) or not isinstance(self.lot_size, numbers.Integral) or self.lot_size < 1:
            raise DPFLError(f"must be an integer >= 1, got {self.lot_size!r}", field="lot_size")
        if self.sampling not in ("poisson", "fixed"):
            raise DPFLError(f"must be 'poisson' or 'fixed', got {self.sampling!r}", field="sampling")
        if self.optimizer not in ("sgd", "adam", "none"):
            raise DPFLError(f"must be 'sgd', 'adam' or 'none', got {self.optimizer!r}", field="optimizer")
        if self.steps is not None and (not isinstance(self.steps, numbers.Integral) or self.steps < 0):
            raise DPFLError(f"must be an integer >= 0, got {self.steps!r}", field="steps")
        if self.steps is None and not (math.isfinite(self.epochs) and self.epochs > 0):
            raise DPFLError(f"must be > 0, got {self.epochs!r}", field="epochs")

    def num_steps(self, n: int) -> int:
        if self.steps is not None:
            return self.steps
        per_epoch = n / self.lot_size if self.sampling == "poisson" else math.ceil(n / self.lot_size)
        return max(1, round(self.epochs * per_epoch))


@dataclass(frozen=True)
class AdamState:
    """A client's Adam moments between its rounds: the step count and the first and second moment
    estimates, flat float32 in the model's parameter order. They are functions of the client's own
    noisy gradients only, each of which its ledger books as released, so keeping them is
    post-processing."""

    step: int
    exp_avg: np.ndarray
    exp_avg_sq: np.ndarray

    def to_dict(self) -> dict:
        """JSON-able and exact: the float32 bytes in base64."""
        return {"step": int(self.step), "exp_avg": base64.b64encode(self.exp_avg.astype("<f4").tobytes()).decode(),
                "exp_avg_sq": base64.b64encode(self.exp_avg_sq.astype("<f4").tobytes()).decode()}

    @classmethod
    def from_dict(cls, d: dict) -> "AdamState":
        def arr(text: str) -> np.ndarray:
            return np.frombuffer(base64.b64decode(text), dtype="<f4").astype(np.float32)
        return cls(step=int(d["step"]), exp_avg=arr(d["exp_avg"]), exp_avg_sq=arr(d["exp_avg_sq"]))


@dataclass(frozen=True)
class DPSGDResult:
    """One client's DP-SGD run: the update and what its ledger must book.

    ``sampling_rate`` is q = L/n for Poisson lots (``None`` for fixed batches), ``noise_multiplier``
    the sigma of every step, ``steps`` how many noisy sums were released. ``lot_sizes`` are the
    realised lot sizes (data-dependent only through n, which the server is not shown: keep them on
    the client). ``noisy_norm_sums``: Fu et al.'s released norm query per step, if asked for.
    """

    update: np.ndarray
    steps: int
    sampling: Literal["poisson", "fixed"]
    sampling_rate: float | None
    noise_multiplier: float
    clip_norm: float
    num_examples: int
    lot_size: int
    lot_sizes: tuple[int, ...]
    noisy_norm_sums: tuple[float, ...] | None = None
    adam_state: AdamState | None = None  # Adam's moments after the last step, when asked for

    def step_event(self) -> dpe.DpEvent:
        """The dp_accounting event of one step (add/remove-one-record relation).

        Poisson: ``PoissonSampled(q, Gaussian(sigma))``, with a second ``Gaussian(sigma)`` under the
        same sampling when the norm sum was released (it has sensitivity S and noise std sigma S).
        Fixed batches of a whole epoch's permutation are not amplified, and adding one record shifts
        every later batch by one (one record in, one out), so each step's sum can move by 2S: it is
        booked as ``Gaussian(sigma / 2)``; a batch that is the whole data set moves by S only.
        """
        if self.noise_multiplier == 0:
            return dp_accounting.NonPrivateDpEvent()
        gaussians = [dp_accounting.GaussianDpEvent(self.noise_multiplier)]
        if self.noisy_norm_sums is not None:
            gaussians.append(dp_accounting.GaussianDpEvent(self.noise_multiplier))
        inner = gaussians[0] if len(gaussians) == 1 else dp_accounting.ComposedDpEvent(gaussians)
        if self.sampling == "poisson":
            return dp_accounting.PoissonSampledDpEvent(self.sampling_rate, inner)
        if self.lot_size >= self.num_examples:
            return inner
        halved = [dp_accounting.GaussianDpEvent(g.noise_multiplier / 2) for g in gaussians]
        return halved[0] if len(halved) == 1 else dp_accounting.ComposedDpEvent(halved)

    def dp_event(self) -> dpe.DpEvent:
        """Every step of the run: ``SelfComposed(step_event, steps)``."""
        if self.steps == 0:
            return dp_accounting.NoOpDpEvent()
        return dp_accounting.SelfComposedDpEvent(self.step_event(), self.steps)
