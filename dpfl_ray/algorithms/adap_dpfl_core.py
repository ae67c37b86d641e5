"""Fu et al. 2022 (Adap DP-FL): the pure building blocks of Algorithm 1.

* Sample-level DP-SGD on every client (:func:`dpfl_ray.training.local_dp.dpsgd_update`): a Poisson lot of
  expected size L (line 7, q = L/|D_k|), per-example clipping to C_t^k (line 11), noise
  N(0, sigma_t^2 (C_t^k)^2) on the sum (line 13) -- :func:`client_config`.
* Adaptive clipping (eq. 6-8): C_t^k = alpha * | (sum_i min(||g_i||, C_{t-1}^k) + N(0, (C_{t-1}^k
  sigma_{t-1})^2)) / L |, the noisy mean clipped gradient norm of the client's previous lot --
  :func:`next_clip_threshold`; C_0^k is the mean per-example gradient norm on random noise
  (Sec. IV-A), which touches no data -- :func:`initial_clip_threshold`.
* Noise decay (eq. 9, Alg. 1 line 24): sigma_{t+1} = beta sigma_t when the server's validation loss
  dropped three times in a row, J(w_{t-3}) > J(w_{t-2}) > J(w_{t-1}) > J(w_t), with
  J(w_0) = J(w_1) = J(w_2) = inf -- :func:`decayed_noise_multiplier`.
* Budget stop (eq. 10, Alg. 1 lines 16-19): a client stops uploading once its epsilon would pass the
  budget -- :func:`round_events` gives what to ask its ledger
  (:meth:`dpfl_ray.privacy.client_ledgers.ClientLedgers.would_exceed`) before it trains.
* The non-IID partition (Sec. V-A): labels sorted, cut into 400 fragments, 40 random fragments per
  client -- :func:`label_sorted_fragments` (that is McMahan et al.'s shards partition with k = 40).

The clipping threshold is data-dependent: the noisy norm sum of eq. 6 is a second Gaussian query on
the same lot (sensitivity C, noise std sigma C). The paper calls it post-processing but its
Theorem 1 (eq. 10) composes one sampled Gaussian per round, so it is not accounted there. What is
booked here (``book_threshold_query=True``) is both queries under the lot's one Poisson sampling,
``PoissonSampled(q, Composed([Gaussian(sigma_t), Gaussian(sigma_t)]))``: the same as one Gaussian
of multiplier sigma_t / sqrt(2). The paper's claim (eq. 10: one ``PoissonSampled(q,
Gaussian(sigma_t))`` per round, orders 2..64, classic conversion) is :func:`claimed_ledgers`.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Sequence

import dp_accounting
import numpy as np
from dp_accounting import dp_event as dpe

from .. import rng as rngmod
from ..defaults import MIN_CLIP_NORM
from ..data import partition as P
from ..errors import DPFLError
from ..training.dpsgd_config import DPSGDConfig, DPSGDResult
from ..privacy.client_ledgers import FU_EQ10_ORDERS, ClientLedgers

if TYPE_CHECKING:  # torch is loaded where a client trains (training.local_dp), not where a scenario is read
    from torch import nn

__all__ = ["initial_clip_threshold", "next_clip_threshold", "decayed_noise_multiplier", "client_config",
           "round_events", "claimed_ledgers", "label_sorted_fragments", "MIN_CLIP_NORM"]

# MIN_CLIP_NORM, the default floor of eq. 6's threshold (privacy.adap_dpfl.min_clip_norm): eq. 6 as printed,
# at alpha < 1, shrinks the threshold about alpha-fold every round towards 0, where the clip divides by
# zero; the paper names no floor. At 1e-6 a noisy mean gradient's coordinates (~sigma C / L) come near
# Adam's epsilon (1e-8), which then shrinks Adam's steps (docs/reproductions.md, Fu et al., experiment 11).


def _positive(v, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise DPFLError(f"must be a finite number > 0, got {v!r}", field=name)
    return float(v)


def initial_clip_threshold(model: nn.Module, theta: np.ndarray, input_shape: Sequence[int], num_classes: int,
                           lot_size: int, *, seed: int, client_id: int, floor: float = MIN_CLIP_NORM,
                           alpha: float = 1.0) -> float:
    """C_0^k: ``alpha`` times the mean per-example gradient norm at ``theta`` on a lot of random noise
    (uniform inputs, uniform labels; Fu et al. 2022, Sec. IV-A), never under ``floor``. The paper says
    'extracting the mean l2-norm' (``alpha`` 1) after 'a similar adaptive procedure' to eq. 6's,
    which multiplies by alpha (``privacy.adap_dpfl.initial_clip: eq6``); at alpha = 1 the two agree.
    No record of the client is read, so it costs no privacy."""
    from ..training.local_dp import per_example_grad_norms

    g = rngmod.generator(seed, "fu_initial_clip", -1, client_id)
    x = g.random((int(lot_size), *input_shape), dtype=np.float32)
    y = g.integers(0, num_classes, int(lot_size)).astype(np.int64)
    return max(_positive(alpha, "alpha") * float(per_example_grad_norms(model, theta, x, y).mean()), floor)


def next_clip_threshold(result: DPSGDResult, alpha: float, floor: float = MIN_CLIP_NORM) -> float:
    """C_{t+1}^k from round t's released norm sums (eq. 6-8): alpha * |noisy sum / L|, averaged over
    the round's steps when there are several, and never under ``floor``."""
    alpha = _positive(alpha, "alpha")
    if result.noisy_norm_sums is None:
        raise DPFLError("the local update did not release the norm sum (release_norm_sum=False)",
                        field="release_norm_sum")
    if not result.noisy_norm_sums:
        return result.clip_norm  # no step ran: nothing new was learned about the norms
    mean = float(np.mean(result.noisy_norm_sums)) / result.lot_size
    return max(alpha * abs(mean), floor)


def decayed_noise_multiplier(sigma: float, validation_losses: Sequence[float], beta: float) -> float:
    """sigma_{t+1} (eq. 9): beta * sigma if the last four validation losses strictly decrease, else sigma.

    ``validation_losses`` is J(w) after each round so far; the history starts with three infinite
    losses (J(w_0) = J(w_1) = J(w_2) = inf), so the first decay can come after three real losses.
    """
    sigma = _positive(sigma, "sigma")
    if not (isinstance(beta, (int, float)) and 0 < beta < 1):
        raise DPFLError(f"must be in (0, 1), got {beta!r}", field="beta")
    window = ([math.inf] * 3 + [float(v) for v in validation_losses])[-4:]
    dropped = all(a > b for a, b in zip(window, window[1:]))
    return beta * sigma if dropped else sigma


def client_config(clip_norm: float, noise_multiplier: float, lr: float, lot_size: int, *, steps: int = 1,
                  optimizer: str = "adam") -> DPSGDConfig:
    """Alg. 1 lines 6-15 for one client and round: ``steps`` Poisson lots (the paper: one), Adam as in
    Sec. V-A, and the norm sum of eq. 6 released for the next threshold."""
    return DPSGDConfig(clip_norm=_positive(clip_norm, "clip_norm"), noise_multiplier=noise_multiplier, lr=lr,
                       lot_size=lot_size, sampling="poisson", steps=steps, optimizer=optimizer,
                       release_norm_sum=True)


def round_events(sampling_rate: float, noise_multiplier: float, *, book_threshold_query: bool = True
                 ) -> tuple[dpe.DpEvent, dpe.DpEvent]:
    """(effective, claimed) events of one lot: the claim (eq. 10) counts the gradient only; the
    effective event adds eq. 6's norm query under the same sampling (module docstring)."""
    g = dp_accounting.GaussianDpEvent(_positive(noise_multiplier, "noise_multiplier"))
    claimed = dp_accounting.PoissonSampledDpEvent(sampling_rate, g)
    if not book_threshold_query:
        return claimed, claimed
    return dp_accounting.PoissonSampledDpEvent(sampling_rate, dp_accounting.ComposedDpEvent([g, g])), claimed


def claimed_ledgers(delta: float, num_clients: int) -> ClientLedgers:
    """Ledgers that compute Fu et al.'s Theorem 1 (eq. 10): integer orders 2..64, classic conversion."""
    return ClientLedgers(delta, num_clients=num_clients, orders=FU_EQ10_ORDERS, conversion="classic")


def label_sorted_fragments(labels: np.ndarray, rng: np.random.Generator, num_clients: int = 10,
                           num_fragments: int = 400) -> list[np.ndarray]:
    """Fu et al. 2022, Sec. V-A: sort by label, cut into ``num_fragments`` equal fragments, give each
    client ``num_fragments / num_clients`` random ones."""
    if num_fragments % num_clients:
        raise DPFLError(f"{num_fragments} fragments do not split evenly over {num_clients} clients",
                        field="data.partition.num_fragments")
    return P.shards(labels, num_clients, num_fragments // num_clients, rng)
