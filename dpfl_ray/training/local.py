"""Local update procedures run by a client on its own data."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from .models import pool_forward, set_flat


def clip_factor(norm: float, clip_norm: float | None) -> float:
    """min(1, C / ||Delta||) (Baek et al. 2021, Alg. 1 line 4)."""
    if clip_norm is None or norm <= clip_norm:
        return 1.0
    return clip_norm / norm


def local_update(model: nn.Module, theta: np.ndarray, x: np.ndarray, y: np.ndarray, *,
                 epochs: int, batch_size: int, lr: float, clip_norm: float | None,
                 rng: np.random.Generator, torch_seed: int, prox_mu: float = 0.0) -> np.ndarray:
    """Baek et al. 2021, Algorithm 1: E epochs of minibatch SGD from theta, the update clipped to C
    after every step (line 11); returns Delta = w - theta as float32. ``prox_mu`` > 0 adds the
    proximal term mu/2 ||w - theta||^2 to the loss (Wei et al. 2020, Alg. 1 line 6; FedProx).

    ``rng`` shuffles the batches and ``torch_seed`` drives any stochastic layer, both derived
    from (seed, round, client) so the result does not depend on which worker runs it.
    """
    set_flat(model, theta)
    model.train()
    device = next(model.parameters()).device
    params = list(model.parameters())
    forward = pool_forward(model)  # max-pools channels-last: less time, the same bits
    theta_t = [p.detach().clone() for p in params]
    xt, yt = torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)
    torch.manual_seed(torch_seed)
    loss_fn = nn.CrossEntropyLoss()
    for _ in range(epochs):
        order = torch.from_numpy(rng.permutation(len(y))).to(device)
        for start in range(0, len(y), batch_size):
            batch = order[start:start + batch_size]
            model.zero_grad(set_to_none=True)
            loss_fn(forward(xt[batch]), yt[batch]).backward()
            with torch.no_grad():
                if prox_mu:  # gradient of mu/2 ||w - theta||^2
                    for p, t in zip(params, theta_t):
                        p.grad.add_(p - t, alpha=prox_mu)
                for p in params:
                    p.add_(p.grad, alpha=-lr)
                if clip_norm is not None:
                    # Alg. 1 line 11: w <- theta + Clip(w - theta)
                    norm = torch.sqrt(sum(((p - t) ** 2).sum() for p, t in zip(params, theta_t))).item()
                    f = clip_factor(norm, clip_norm)
                    if f < 1.0:
                        for p, t in zip(params, theta_t):
                            p.copy_(t + (p - t) * f)
    with torch.no_grad():
        delta = torch.cat([(p - t).reshape(-1) for p, t in zip(params, theta_t)])
    return delta.cpu().numpy().astype(np.float32)
