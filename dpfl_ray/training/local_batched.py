"""Batched multi-client local training: K clients' SGD as one vectorised computation.

When several clients share the model and the local hyperparameters, their local updates
(Baek et al. 2021, Alg. 1, as :func:`dpfl_ray.training.local.local_update` runs it for one client) are the
same program on different data. Stacking the K parameter copies along a leading axis, one
backward pass of the summed per-client losses gives every client its own gradient: K small
forward/backward passes become one larger one, which removes the per-client Python and dispatch
overhead that dominates small clients. The forward is one of two programs:

- the *stacked network* (:func:`stacked_program`), for models built from convolutions, linear
  layers, ReLU, zero-padding, max-pools and a flatten, as the built-in CNN, MLP and logistic
  models are: K convolutions become one grouped convolution over the K inputs laid side by side
  on the channel axis (channels-last), K linear layers one batched matmul. On the CNN it takes
  0.56x vmap's time for 5 clients of 5 steps, 0.77x for 50 clients of one (benchmarks/RESULTS.md);
- otherwise ``vmap(functional_call(model, ...))``, whose 2-d max-pools run channels-last (same
  values and gradients, a faster CPU kernel).

Determinism: a client's update must not depend on which other clients share its batch (the
worker pool size changes that). Clients are grouped by size, so every client in a group has the
same batch shapes; within a group each slot runs the same kernels on its own data. oneDNN and MKL
choose kernels by shape, and K is part of the shape: a lone client is padded to a stack of two with
a copy of itself, and each other K is checked once per process against that stack of two
(:func:`_invariant_stack`): a K whose kernels give a slot other bits (K = 3 for the CNN on AMD EPYC
with AVX2) is padded to the next K that does not (:func:`stack_padding` says which; summary.json
records it). cuBLAS/cuDNN choose kernels by shape too, so on CUDA every stack is padded to one
fixed K. The batched result equals the sequential path to float tolerance, not bitwise in general:
the batched kernels may sum in a different order.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, vmap

from .local import local_update
from .models import TFPrivacyCNN, set_flat
from .models import pool_twin as _twin

# Layers whose forward depends on state or randomness that vmap would have to split per client.
_UNBATCHABLE = (nn.modules.batchnorm._NormBase, nn.modules.dropout._DropoutNd)

DEFAULT_MAX_CLIENTS = 64


def can_batch(model: nn.Module) -> bool:
    """True when the model is a pure function of its parameters (no buffers, no dropout), so
    K copies of it can be vmapped without sharing state between clients."""
    return not any(True for _ in model.buffers()) and not any(isinstance(m, _UNBATCHABLE) for m in model.modules())


def batching_pays(model: nn.Module, client_sizes: Sequence[int], cohort: float) -> bool:
    """Whether a run should train batched: the model can be vmapped and a client expects to share
    its stack (clients of its size in the same round) with at least one other. With sizes p_s the
    fraction of clients of size s, that expected stack is cohort * sum_s p_s^2. Decided once per
    scenario, never per round, so the choice cannot depend on the worker pool."""
    if not can_batch(model) or len(client_sizes) == 0:
        return False
    _, counts = np.unique(np.asarray(client_sizes), return_counts=True)
    shares = counts / counts.sum()
    return float(cohort * np.sum(shares ** 2)) >= 2.0


def clients_per_batch(model: nn.Module, input_shape: Sequence[int], batch_size: int,
                      budget_bytes: int, max_clients: int = DEFAULT_MAX_CLIENTS) -> int:
    """The largest K whose vmapped step fits ``budget_bytes``.

    Per client the step holds the parameters, the start point theta, the gradients and one
    temporary (4 copies of the model), plus each layer's activations for one minibatch kept for
    the backward pass and their gradients (2x the forward activations, counted with hooks).
    """
    params = sum(p.numel() for p in model.parameters())
    sizes: list[int] = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: sizes.append(out.numel()))
             for m in model.modules() if not list(m.children())]
    try:
        with torch.no_grad():
            model(torch.zeros(batch_size, *input_shape, device=next(model.parameters()).device))
    finally:
        for h in hooks:
            h.remove()
    per_client = 4 * (4 * params + 2 * sum(sizes))
    return int(max(1, min(max_clients, budget_bytes // per_client)))


def warm_up(model: nn.Module, input_shape: Sequence[int], batch_size: int, num_classes: int) -> None:
    """One throw-away batched step on two blank clients, for a worker's start: the first batched
    call of a process loads torch.func's machinery (0.04 s on the 2-core machine, 0.3 s on the
    GPU host), which otherwise lands in the first round's time. The model is left as it was."""
    if not can_batch(model):
        return
    theta = torch.nn.utils.parameters_to_vector(model.parameters()).detach().cpu().numpy()
    x = np.zeros((batch_size, *input_shape), np.float32)
    y = np.arange(batch_size, dtype=np.int64) % num_classes
    g = np.random.default_rng(0)
    batched_local_updates(model, theta, [x, x], [y, y], epochs=1, batch_size=batch_size, lr=0.0, clip_norm=None,
                          rngs=[g, g], torch_seeds=[0, 0])
    set_flat(model, theta)


def batched_local_updates(model: nn.Module, theta: np.ndarray, xs: Sequence[np.ndarray], ys: Sequence[np.ndarray],
                          *, epochs: int, batch_size: int, lr: float, clip_norm: float | None,
                          rngs: Sequence[np.random.Generator], torch_seeds: Sequence[int],
                          max_clients: int = DEFAULT_MAX_CLIENTS, fixed_shape: bool | None = None,
                          fast_pool: bool = True, stacked: bool = True) -> list[np.ndarray]:
    """Baek et al. 2021, Alg. 1 for each client i of ``xs``/``ys``/``rngs``: E epochs of minibatch
    SGD from theta in the order ``rngs[i]`` draws, the update clipped to C after every step
    (line 11). Returns each client's Delta_i = w_i - theta (float32), in input order.

    Same result as :func:`local_update` per client, to float tolerance. Models that cannot be
    vmapped (:func:`can_batch`) take the sequential path, with ``torch_seeds`` for their
    stochastic layers; at most ``max_clients`` are stacked at once (:func:`clients_per_batch`).
    ``fixed_shape`` pads every stack to ``max_clients`` (default: on CUDA, whose libraries pick
    kernels by shape); otherwise only a lone client is padded, to 2 (see the module docstring).
    Models made of the layers :func:`stacked_program` knows run as one grouped network;
    ``stacked=False`` vmaps them instead, and ``fast_pool=False`` keeps the vmapped model's own
    max-pool kernel (both for tests and benchmarks).
    """
    if not (len(xs) == len(ys) == len(rngs) == len(torch_seeds)):
        raise ValueError("xs, ys, rngs and torch_seeds must have one entry per client")
    if not can_batch(model):
        return [local_update(model, theta, x, y, epochs=epochs, batch_size=batch_size, lr=lr,
                             clip_norm=clip_norm, rng=g, torch_seed=s)
                for x, y, g, s in zip(xs, ys, rngs, torch_seeds)]
    set_flat(model, theta)
    start = {name: p.detach().clone() for name, p in model.named_parameters()}
    by_size: dict[int, list[int]] = defaultdict(list)
    for i, y in enumerate(ys):
        by_size[len(y)].append(i)
    out: list[np.ndarray | None] = [None] * len(ys)
    chunk = max(2, int(max_clients))
    if fixed_shape is None:
        fixed_shape = next(model.parameters()).device.type == "cuda"
    stack = chunk if fixed_shape else 2
    program = stacked_program(model, np.asarray(xs[0]).ndim - 1) if stacked and len(xs) else None
    for members in by_size.values():
        for lo in range(0, len(members), chunk):
            part = members[lo:lo + chunk]
            # Each client's batch order, drawn epoch by epoch as the sequential path draws it.
            orders = [np.stack([rngs[i].permutation(len(ys[i])) for _ in range(epochs)]) for i in part]
            deltas = _train_group(model, start, [xs[i] for i in part], [ys[i] for i in part], orders,
                                  batch_size=batch_size, lr=lr, clip_norm=clip_norm, min_stack=stack,
                                  checked=not fixed_shape, fast_pool=fast_pool, program=program)
            for i, d in zip(part, deltas):
                out[i] = d
    return out  # type: ignore[return-value]


def _train_group(model: nn.Module, start: dict[str, torch.Tensor], xs, ys, orders, *, batch_size: int,
                 lr: float, clip_norm: float | None, min_stack: int, checked: bool, fast_pool: bool,
                 program=None) -> list[np.ndarray]:
    """Local SGD of clients of equal size, stacked on a leading axis of K parameter copies. With
    ``checked`` (stacks of varying size), K is one that gives every client the result it would get
    in a stack of two (:func:`_invariant_stack`)."""
    loss = _per_client_loss(model, program, fast_pool)
    k = max(len(xs), min_stack)
    if checked:
        n = len(ys[0])
        sizes = tuple(sorted({min(batch_size, n - lo) for lo in range(0, n, batch_size)}))
        key = (str(model), program is None, fast_pool, tuple(xs[0].shape[1:]), k, sizes,
               next(iter(start.values())).device.type)
        k = _invariant_stack(key, loss, start, xs[0], ys[0], k, sizes)
    if k == 0:  # no padded size gave the reference's bits here: each client alone in a stack of two
        return [d for i in range(len(xs))
                for d in _train_stack(loss, start, xs[i:i + 1], ys[i:i + 1], orders[i:i + 1], batch_size=batch_size,
                                      lr=lr, clip_norm=clip_norm, stack=2)]
    return _train_stack(loss, start, xs, ys, orders, batch_size=batch_size, lr=lr, clip_norm=clip_norm, stack=k)


def _per_client_loss(model: nn.Module, program, fast_pool: bool):
    """(stacked parameters, xb (K, B, ...), yb (K, B)) -> each client's mean loss, shape (K,)."""
    if program is None:
        net = _twin(model) if fast_pool else model
        return vmap(lambda p, xb, yb: _mean_nll(functional_call(net, p, (xb,)), yb))
    return lambda ps, xb, yb: _mean_nll(_stacked_forward(program, ps, xb), yb)


def _grads(loss, ps: dict[str, torch.Tensor], xb, yb) -> dict[str, torch.Tensor]:
    # Client k's loss depends only on its own slice of the stack, so the gradient of the sum is
    # every client's own gradient. Plain autograd here rather than vmap(grad(...)):
    # torch.func.grad imports torch._dynamo on its first call, 2-5 s of every worker's start.
    names = list(ps)
    with torch.enable_grad():
        grads = torch.autograd.grad(loss(ps, xb, yb).sum(), [ps[nm] for nm in names])
    return dict(zip(names, grads))


# Stack sizes this process has checked: (model, program, input shape, K, batch sizes, device) -> the
# K to run (K itself, a larger K, or 0 for one client at a time in a stack of two).
_STACK_FOR: dict[tuple, int] = {}
_USED: set[tuple] = set()  # the keys asked since reset_stack_usage(): one run's, on a reused worker
MAX_STACK_PADDING = 8


def stack_padding() -> dict[str, int]:
    """The stack sizes this process could not run as they were since the last
    :func:`reset_stack_usage`, ``{"K": K'}``: padded to K' clients, or K' = 0, trained one client at a
    time in a stack of two. The check itself is kept for the process's life (a property of its CPU)."""
    used = sorted((key for key in _USED if key in _STACK_FOR), key=lambda key: key[4])
    return {str(key[4]): _STACK_FOR[key] for key in used if _STACK_FOR[key] != key[4]}


def reset_stack_usage() -> None:
    """A worker starts serving another run (runtime/warm.py): report only that run's stack sizes."""
    _USED.clear()


def _invariant_stack(key: tuple, loss, start, x0: np.ndarray, y0: np.ndarray, k: int, sizes: tuple[int, ...]) -> int:
    """The smallest K' >= k whose stacked step gives every slot the bits a stack of two gives.

    oneDNN and MKL pick kernels by shape, and a grouped convolution's shape includes K: on AMD EPYC
    (AVX2) a first convolution whose K groups total 3 input channels takes oneDNN's special
    3-channel weight-gradient kernel, which sums in another order than every other K. Which K are
    affected depends on the CPU and the library build, so it is measured here, once per process
    and shape: one gradient step of the first client's first examples copied into all K slots,
    for each batch size the client's epoch uses, against the same step in a stack of two."""
    device = next(iter(start.values())).device
    _USED.add(key)
    if key in _STACK_FOR:
        return _STACK_FOR[key]
    probes = [(torch.from_numpy(np.ascontiguousarray(x0[:b])).to(device), torch.from_numpy(y0[:b]).to(device))
              for b in sizes]

    def slot_grads(width: int) -> list[torch.Tensor]:
        out = []
        for xb, yb in probes:
            ps = {nm: t.unsqueeze(0).expand(width, *t.shape).clone().requires_grad_(True) for nm, t in start.items()}
            g = _grads(loss, ps, xb.expand(width, *xb.shape).contiguous(), yb.expand(width, *yb.shape).contiguous())
            out += [v.reshape(width, -1) for v in g.values()]
        return out

    reference = [g[0] for g in slot_grads(2)]
    chosen = 0
    for width in range(k, k + MAX_STACK_PADDING + 1):
        if width == 2 or all(torch.equal(g, r.expand_as(g)) for g, r in zip(slot_grads(width), reference)):
            chosen = width
            break
    _STACK_FOR[key] = chosen
    return chosen


def _train_stack(loss, start: dict[str, torch.Tensor], xs, ys, orders, *, batch_size: int, lr: float,
                 clip_norm: float | None, stack: int) -> list[np.ndarray]:
    """Local SGD of the clients ``xs`` in a stack of ``stack`` parameter copies."""
    k_real = len(xs)
    if k_real < stack:
        # Copies of the first client fill the stack: kernels chosen by K never see another K.
        pad = stack - k_real
        xs, ys, orders = xs + xs[:1] * pad, ys + ys[:1] * pad, orders + orders[:1] * pad
    device = next(iter(start.values())).device
    x = torch.from_numpy(np.stack(xs)).to(device)
    y = torch.from_numpy(np.stack(ys)).to(device)
    order = torch.from_numpy(np.stack(orders)).to(device)  # (K, epochs, n)
    k, n = order.shape[0], order.shape[2]
    rows = torch.arange(k, device=device).unsqueeze(1)
    theta = {name: t.unsqueeze(0).expand(k, *t.shape) for name, t in start.items()}
    params = {name: t.clone() for name, t in theta.items()}
    for p in params.values():
        p.requires_grad_(True)

    for epoch in range(order.shape[1]):
        for lo in range(0, n, batch_size):
            batch = order[:, epoch, lo:lo + batch_size]
            grads = _grads(loss, params, x[rows, batch], y[rows, batch])
            with torch.no_grad():
                for name, p in params.items():
                    p.add_(grads[name], alpha=-lr)
                if clip_norm is not None:
                    _clip_to(params, theta, clip_norm)
    with torch.no_grad():
        delta = torch.cat([(params[name] - theta[name]).reshape(k, -1) for name in start], dim=1)
    return list(delta[:k_real].cpu().numpy().astype(np.float32))


def _mean_nll(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the batch axis (the one before the classes), per leading index.
    Spelled out: vmap runs F.cross_entropy through a Python decomposition that imports sympy (a
    third of a second at a worker's first call)."""
    logp = nn.functional.log_softmax(logits, dim=-1)
    return -logp.gather(-1, y.unsqueeze(-1)).squeeze(-1).mean(dim=-1)


def _clip_to(params: dict, theta: dict, clip_norm: float) -> None:
    """Alg. 1 line 11 for every stacked client: w_i <- theta + (w_i - theta) * min(1, C / ||w_i - theta||)."""
    k = next(iter(params.values())).shape[0]
    sq = sum(((p - theta[name]) ** 2).reshape(k, -1).sum(dim=1) for name, p in params.items())
    norm = torch.sqrt(sq).double()
    clipped = norm > clip_norm
    # The factor in float64, then float32, as the sequential path's Python-float factor reaches the tensor.
    factor = torch.where(clipped, clip_norm / norm, torch.ones_like(norm)).float()
    for name, p in params.items():
        t = theta[name]
        shape = (k, *([1] * (p.dim() - 1)))
        # An unclipped client keeps w exactly: t + (w - t) * 1 would round w.
        p.copy_(torch.where(clipped.view(shape), t + (p - t) * factor.view(shape), p))


# --- The stacked program: K clients' forward as one grouped network, without vmap. ---------------
#
# For the layer types below, K copies of a network are themselves one network: K convolutions
# over K inputs are one grouped convolution (groups=K) over the inputs laid side by side on the
# channel axis, and K linear layers are one batched matmul. Images travel as (B, K*C, H, W) in
# channels-last memory (the fast CPU layout for convolution and max-pool), vectors as (K, B, F).
# This skips vmap's batching rules and the layout copies they make (see the module docstring).
# Any other layer makes the model take the vmap path.

_IMAGE, _FLAT, _RAW = "image", "flat", "raw"


def _leaves(module: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]] | None:
    """``module``'s layers in forward order, with their parameter-name prefixes, when its forward
    is known to be their composition: an nn.Sequential, or the models' CNN (features then
    classifier). None for anything else."""
    if type(module) is nn.Sequential:
        parts = [(f"{prefix}{name}.", child) for name, child in module.named_children()]
    elif type(module) is TFPrivacyCNN:
        parts = [(f"{prefix}features.", module.features), (f"{prefix}classifier.", module.classifier)]
    else:
        return [(prefix, module)]
    out: list[tuple[str, nn.Module]] = []
    for pre, child in parts:
        sub = _leaves(child, pre)
        if sub is None:
            return None
        out += sub
    return out


def stacked_program(model: nn.Module, input_ndim: int) -> list[tuple[str, nn.Module]] | None:
    """The model's layers when every one has a stacked form for examples of ``input_ndim``
    dimensions (a vector, or a (C, H, W) image) and the output is a vector per example; None when
    the model must be vmapped instead."""
    leaves = _leaves(model)
    if leaves is None or input_ndim not in (1, 3):
        return None
    layout = _FLAT if input_ndim == 1 else _RAW
    for _, m in leaves:
        t = type(m)
        if (t is nn.Conv2d and m.groups == 1 and m.padding_mode == "zeros") or t is nn.ZeroPad2d \
                or (t is nn.MaxPool2d and not m.return_indices):
            if layout == _FLAT:
                return None
            layout = _IMAGE
        elif t is nn.Flatten and m.start_dim == 1 and m.end_dim == -1:
            layout = _FLAT
        elif not (t is nn.ReLU or (t is nn.Linear and layout == _FLAT)):
            return None
    return leaves if layout == _FLAT else None


def _stacked_forward(program, ps: dict[str, torch.Tensor], xb: torch.Tensor) -> torch.Tensor:
    """Logits (K, B, classes) of K stacked clients on their batches ``xb`` (K, B, *input_shape)."""
    F = nn.functional
    k, b = xb.shape[0], xb.shape[1]
    h, layout = xb, (_FLAT if xb.dim() == 3 else _RAW)
    for prefix, m in program:
        t = type(m)
        if t is nn.Flatten:
            h = h.contiguous().view(b, k, -1).transpose(0, 1) if layout == _IMAGE else h.reshape(k, b, -1)
            layout = _FLAT
            continue
        if t is nn.ReLU:
            h = F.relu(h)
            continue
        if layout == _RAW:  # an image layer (stacked_program allows no Linear before a Flatten here)
            # (K, B, C, H, W) -> (B, K*C, H, W): client k's channels are block k of the channel axis.
            h = h.transpose(0, 1).reshape(b, -1, *h.shape[3:]).contiguous(memory_format=torch.channels_last)
            layout = _IMAGE
        if t is nn.ZeroPad2d:
            h = F.pad(h, m.padding).contiguous(memory_format=torch.channels_last)
        elif t is nn.MaxPool2d:
            h = F.max_pool2d(h, m.kernel_size, m.stride, m.padding, m.dilation, m.ceil_mode)
        elif t is nn.Conv2d:
            w = ps[prefix + "weight"]
            w = w.reshape(-1, *w.shape[2:]).contiguous(memory_format=torch.channels_last)
            bias = ps[prefix + "bias"].reshape(-1) if m.bias is not None else None
            h = F.conv2d(h, w, bias, m.stride, m.padding, m.dilation, groups=k)
        else:  # nn.Linear on (K, B, F)
            w = ps[prefix + "weight"].transpose(1, 2)
            h = torch.baddbmm(ps[prefix + "bias"].unsqueeze(1), h, w) if m.bias is not None else torch.bmm(h, w)
    return h
