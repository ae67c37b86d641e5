"""Record-level DP-SGD on one client (Abadi et al. 2016, Alg. 1), pure torch.

Per-example gradients come from ``torch.func``: ``vmap`` over ``grad`` of a ``functional_call`` of
the model, so a lot of B examples costs one batched forward/backward, not B of them. Each example's
gradient is clipped to L2 norm ``clip_norm`` (S), the clipped gradients are summed, Gaussian noise
N(0, sigma^2 S^2) is added to the sum, and the sum is divided by the *expected* lot size L (dividing
by the realised size would make the sensitivity data-dependent).

Lots are Poisson (each example independently with probability q = L/n: the sampled Gaussian
mechanism that dp_accounting's ``PoissonSampledDpEvent`` describes) or fixed batches of a fresh
permutation per epoch. :meth:`DPSGDResult.dp_event` is what the caller books on the client's own
ledger (:mod:`dpfl_ray.privacy.client_ledgers`), computed under add/remove one record of this
client; for Poisson lots that is also the zero-out curve, the relation under which a run that
publishes n (Fu et al.'s q = L/n) is booked (docs/sensitivity.md).

Randomness: the lots and the noise are the (purpose, round, client) streams of the run's
:class:`~dpfl_ray.privacy.randomness.DPRandomness` ("dpsgd_lots", "dpsgd_noise"), so a client's update
does not depend on which worker computed it. Under ``reproducible`` the lots come from
``rng.generator(seed, "dpsgd_lots", round, client)`` and the noise from a ``torch.Generator`` on the
model's device seeded with ``rng.int_seed(seed, "dpsgd_noise", round, client)``; under ``os`` both
come from the run's secret ChaCha20 streams (:class:`TorchNormal`).
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from .. import rng as rngmod
from ..errors import DPFLError
from .models import set_flat
from ..privacy.randomness import DPRandomness
from .dpsgd_config import AdamState, DPSGDConfig, DPSGDResult

__all__ = ["AdamState", "DPSGDConfig", "DPSGDResult", "dpsgd_update", "per_example_grads", "per_example_grad_fn",
           "clip_and_sum", "per_example_grad_norms", "noise_generator", "TorchNormal", "poisson_lots",
           "fixed_batches"]

# Clipping scales by S / (norm * (1 + _CLIP_MARGIN)): float32 rounding could otherwise leave a
# clipped gradient a few ulps above S, and the accountant relies on ||clip(g)|| <= S exactly.
_CLIP_MARGIN = 1e-5


# --- per-example gradients -----------------------------------------------------------------------

def _loss_fn(model: nn.Module) -> Callable:
    def loss(params, buffers, x, y):
        out = functional_call(model, (params, buffers), (x.unsqueeze(0),))
        return nn.functional.cross_entropy(out, y.unsqueeze(0))
    return loss


def per_example_grad_fn(model: nn.Module) -> Callable[[dict, torch.Tensor, torch.Tensor], dict]:
    """``f(params, x, y) -> {name: (B, *shape)}``, built once per local update (not per step)."""
    buffers = dict(model.named_buffers())
    batched = vmap(grad(_loss_fn(model)), in_dims=(None, None, 0, 0))
    return lambda params, x, y: batched(params, buffers, x, y)


def per_example_grads(model: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor,
                      y: torch.Tensor) -> dict[str, torch.Tensor]:
    """{name: (B, *shape)}: the gradient of each example's cross-entropy at ``params``."""
    return per_example_grad_fn(model)(params, x, y)


def clip_and_sum(grads: dict[str, torch.Tensor], clip_norm: float
                 ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """sum_i g_i / max(1, ||g_i|| / S) (Abadi et al. 2016, Alg. 1 'clip gradient') and the norms.

    The norm is over all parameters of one example; scaling and summing is one contraction per
    parameter tensor, so the clipped per-example gradients are never materialised.
    """
    norms = _norms(grads)
    factor = (clip_norm / (norms * (1 + _CLIP_MARGIN))).clamp(max=1.0)
    summed = {k: torch.tensordot(factor, g, dims=1) for k, g in grads.items()}
    return summed, norms


def _norms(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    # vector_norm per tensor then over tensors: no (B, d) temporaries (pow().sum() made one per tensor).
    per_tensor = [torch.linalg.vector_norm(g.reshape(g.shape[0], -1), dim=1) for g in grads.values()]
    return torch.linalg.vector_norm(torch.stack(per_tensor), dim=0)


def per_example_grad_norms(model: nn.Module, theta: np.ndarray, x: np.ndarray, y: np.ndarray,
                           batch_size: int = 256) -> np.ndarray:
    """||grad loss(theta; x_i, y_i)||_2 for every example (no clipping, no noise)."""
    set_flat(model, theta)
    device = next(model.parameters()).device
    params = {k: v.detach() for k, v in model.named_parameters()}
    out = []
    for start in range(0, len(y), batch_size):
        xb = torch.from_numpy(np.ascontiguousarray(x[start:start + batch_size])).to(device)
        yb = torch.from_numpy(np.ascontiguousarray(y[start:start + batch_size])).to(device)
        g = per_example_grads(model, params, xb, yb)
        out.append(_norms(g))
    return torch.cat(out).cpu().numpy().astype(np.float64) if out else np.zeros(0)


# --- lots and noise ------------------------------------------------------------------------------

def poisson_lots(n: int, sampling_rate: float, steps: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Each step's lot: every example independently with probability q (lots may be empty)."""
    return [np.flatnonzero(rng.random(n) < sampling_rate) for _ in range(steps)]


def fixed_batches(n: int, batch_size: int, steps: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Consecutive batches of a fresh permutation per epoch (the last batch of an epoch may be short)."""
    lots: list[np.ndarray] = []
    while len(lots) < steps:
        order = rng.permutation(n)
        lots.extend(order[s:s + batch_size] for s in range(0, n, batch_size))
    return lots[:steps]


def noise_generator(device: torch.device | str, seed: int, round_idx: int, client_id: int,
                    purpose: str = "dpsgd_noise") -> torch.Generator:
    """A torch.Generator on ``device`` seeded from (seed, round, client, purpose)."""
    g = torch.Generator(device=device)
    g.manual_seed(rngmod.int_seed(seed, purpose, round_idx, client_id))
    return g


class TorchNormal:
    """Standard normal tensors on ``device`` from one stream of the run's DP randomness.

    ``reproducible``: :func:`noise_generator`'s seeded ``torch.Generator``, drawn on the device.
    ``os``: the stream's ChaCha20 draws (torch has no cryptographic generator), made on the CPU and
    moved to the device in the default float dtype.
    """

    def __init__(self, device: torch.device | str, randomness: DPRandomness, purpose: str, round_idx: int,
                 client_id: int):
        self.device = torch.device(device)
        if randomness.mode == "reproducible":
            self._torch, self._chacha = noise_generator(device, randomness.seed, round_idx, client_id, purpose), None
        else:
            self._torch, self._chacha = None, randomness.generator(purpose, round_idx, client_id)

    def randn(self, shape) -> torch.Tensor:
        if self._torch is not None:
            return torch.randn(shape, generator=self._torch, device=self.device)
        draws = self._chacha.standard_normal((shape,) if isinstance(shape, int) else tuple(shape))
        return torch.from_numpy(draws).to(device=self.device, dtype=torch.get_default_dtype())


# --- the local update ----------------------------------------------------------------------------

def dpsgd_update(model: nn.Module, theta: np.ndarray, x: np.ndarray, y: np.ndarray, cfg: DPSGDConfig, *,
                 seed: int, round_idx: int, client_id: int, randomness: DPRandomness | None = None,
                 adam_state: AdamState | None = None, keep_adam_state: bool = False) -> DPSGDResult:
    """Abadi et al. 2016, Alg. 1 on one client from ``theta``; returns Delta = w - theta (float32).
    With ``optimizer: none`` the client does not descend: Delta is minus the sum of its steps' noisy
    gradients, each taken at ``theta``, for a server that steps on them.

    ``randomness`` draws the lots and the noise (None: the reproducible streams of ``seed``).
    Adam starts from ``adam_state`` (None: a new optimizer) and, with ``keep_adam_state``, the
    result carries its moments after the last step, for the client's next round.

    Each step: take a lot (line 'take a random sample'), per-example gradients, clip to S, add
    N(0, sigma^2 S^2 I) to the sum, divide by L, descend (SGD, or Adam as Fu et al. 2022 use --
    either is post-processing of the noisy gradient).
    """
    n = len(y)
    if n == 0:
        raise DPFLError("a client with no examples cannot run DP-SGD", field="data")
    set_flat(model, theta)
    device = next(model.parameters()).device
    names = [k for k, _ in model.named_parameters()]
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    start = {k: v.clone() for k, v in params.items()}
    xt, yt = torch.from_numpy(np.ascontiguousarray(x)).to(device), torch.from_numpy(np.ascontiguousarray(y)).to(device)

    steps = cfg.num_steps(n)
    randomness = randomness or DPRandomness("reproducible", int(seed))
    lot_rng = randomness.generator("dpsgd_lots", round_idx, client_id)
    if cfg.sampling == "poisson":
        q = min(1.0, cfg.lot_size / n)
        lots = poisson_lots(n, q, steps, lot_rng)
    else:
        q = None
        lots = fixed_batches(n, cfg.lot_size, steps, lot_rng)
    gen = TorchNormal(device, randomness, "dpsgd_noise", round_idx, client_id)
    dim = sum(params[k].numel() for k in names)
    std = cfg.noise_multiplier * cfg.clip_norm
    opt = torch.optim.Adam([params[k] for k in names], lr=cfg.lr) if cfg.optimizer == "adam" else None
    if adam_state is not None:
        if opt is None:
            raise DPFLError("an Adam state was given to an SGD client", field="optimizer")
        _load_adam_state(opt, params, names, dim, adam_state)
    norm_sums: list[torch.Tensor] = []
    released = torch.zeros(dim, device=device) if cfg.optimizer == "none" else None
    grads_of = per_example_grad_fn(model)

    for lot in lots:
        idx = torch.from_numpy(lot).to(device)
        if len(lot):
            summed, norms = clip_and_sum(grads_of(params, xt[idx], yt[idx]), cfg.clip_norm)
            flat = torch.cat([summed[k].reshape(-1) for k in names])
        else:  # an empty Poisson lot still releases its noise
            flat = torch.zeros(dim, device=device)
            norms = torch.zeros(0, device=device)
        noise = gen.randn(dim + cfg.release_norm_sum)
        flat = (flat + std * noise[:dim]) / cfg.lot_size
        if cfg.release_norm_sum:
            norm_sums.append(norms.clamp(max=cfg.clip_norm).sum() + std * noise[dim])
        if released is None:
            _descend(params, names, flat, cfg.lr, opt)
        else:
            released += flat

    with torch.no_grad():
        delta = -released if released is not None else torch.cat([(params[k] - start[k]).reshape(-1) for k in names])
    # one transfer for all steps' norm sums, not one .item() sync per step
    sums = tuple(torch.stack(norm_sums).cpu().tolist()) if norm_sums else ()
    sums = sums if cfg.release_norm_sum else None
    return DPSGDResult(update=delta.cpu().numpy().astype(np.float32), steps=steps, sampling=cfg.sampling,
                       sampling_rate=q, noise_multiplier=float(cfg.noise_multiplier),
                       clip_norm=float(cfg.clip_norm), num_examples=n, lot_size=cfg.lot_size,
                       lot_sizes=tuple(len(lot) for lot in lots), noisy_norm_sums=sums,
                       adam_state=_read_adam_state(opt, params, names, adam_state) if keep_adam_state and opt else None)


def _load_adam_state(opt: torch.optim.Adam, params: dict[str, torch.Tensor], names: list[str], dim: int,
                     state: AdamState) -> None:
    if state.exp_avg.shape != (dim,) or state.exp_avg_sq.shape != (dim,):
        raise DPFLError(f"an Adam state of {state.exp_avg.size} values for a model of {dim} parameters",
                        field="optimizer")
    if state.step == 0:
        return
    offset = 0
    for k in names:
        p = params[k]
        n = p.numel()
        opt.state[p] = {  # torch.optim.Adam's own per-parameter state (non-capturable: step on the CPU)
            "step": torch.tensor(float(state.step), dtype=torch.float32),
            "exp_avg": torch.from_numpy(state.exp_avg[offset:offset + n].copy()).view_as(p).to(p.device),
            "exp_avg_sq": torch.from_numpy(state.exp_avg_sq[offset:offset + n].copy()).view_as(p).to(p.device)}
        offset += n


def _read_adam_state(opt: torch.optim.Adam, params: dict[str, torch.Tensor], names: list[str],
                     before: AdamState | None) -> AdamState | None:
    states = [opt.state.get(params[k]) for k in names]
    if not all(states):  # no step taken (a client round of zero steps): the moments are as they came
        return before
    flat = {key: torch.cat([st[key].detach().reshape(-1) for st in states]).cpu().numpy().astype(np.float32)
            for key in ("exp_avg", "exp_avg_sq")}
    return AdamState(step=int(states[0]["step"].item()), **flat)


def adam_step(gradient: np.ndarray, lr: float, state: AdamState | None) -> tuple[np.ndarray, AdamState]:
    """One step of torch.optim.Adam on a flat parameter vector, from ``state`` (None: a new optimizer):
    the step to add to the parameters (float32) and the moments after it. Adam's step does not depend
    on the parameters' values, so the vector stepped is a zero one and the step is what it becomes."""
    flat = torch.zeros(gradient.shape, dtype=torch.float32)
    params = {"flat": flat}
    opt = torch.optim.Adam([flat], lr=lr)
    if state is not None:
        _load_adam_state(opt, params, ["flat"], flat.numel(), state)
    flat.grad = torch.from_numpy(np.ascontiguousarray(gradient, dtype=np.float32))
    opt.step()
    return flat.detach().numpy().copy(), _read_adam_state(opt, params, ["flat"], state)


@torch.no_grad()
def _descend(params: dict[str, torch.Tensor], names: list[str], flat_grad: torch.Tensor, lr: float,
             opt: torch.optim.Optimizer | None) -> None:
    offset = 0
    for k in names:
        p = params[k]
        g = flat_grad[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
        if opt is None:
            p.sub_(g, alpha=lr)
        else:
            p.grad = g.clone()
    if opt is not None:
        opt.step()
