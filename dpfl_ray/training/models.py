"""Model registry. Every model is built deterministically from the run seed.

``cnn`` is the MNIST CNN of the TF-Privacy tutorial that Baek et al. 2021 (Sec. VI) use: two
convolutions (16 8x8 stride 2 'same', 32 4x4 stride 2 'valid'), each followed by a 2x2 max-pool of
stride 1, then dense 32 and dense 10.
"""
from __future__ import annotations

import contextlib
import copy
import math
import tempfile
import warnings
import weakref
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.func import functional_call

from ..errors import DPFLError
from .evaluation import EVAL_SHARD_ROWS, combine_shards, eval_shards  # noqa: F401 - re-exported
from .model_inputs import check_model_input


class TFPrivacyCNN(nn.Module):
    def __init__(self, in_channels: int, height: int, width: int, num_classes: int):
        super().__init__()
        # TF's 'same' padding for kernel 8, stride 2 on 28x28 pads 3 on each side.
        self.features = nn.Sequential(
            nn.ZeroPad2d(3), nn.Conv2d(in_channels, 16, 8, stride=2), nn.ReLU(), nn.MaxPool2d(2, 1),
            nn.Conv2d(16, 32, 4, stride=2), nn.ReLU(), nn.MaxPool2d(2, 1), nn.Flatten())
        flat = _flat_size(self.features, in_channels, height, width)
        self.classifier = nn.Sequential(nn.Linear(flat, 32), nn.ReLU(), nn.Linear(32, num_classes))

    def forward(self, x):
        return self.classifier(self.features(x))


def _flat_size(features: nn.Sequential, channels: int, height: int, width: int) -> int:
    """The number of values ``features`` gives for one image, from its layers' sizes. Not by a forward
    pass: on the meta device (model_file_bytes) one loads torch's compiler, about a second of CPU."""
    def side(n, kernel, stride, padding, dilation=1):
        return (n + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1

    for layer in features:
        if isinstance(layer, nn.ZeroPad2d):
            left, right, top, bottom = layer.padding
            height, width = height + top + bottom, width + left + right
        elif isinstance(layer, (nn.Conv2d, nn.MaxPool2d)) and not getattr(layer, "ceil_mode", False) \
                and not isinstance(layer.padding, str):
            sizes = [getattr(layer, k) for k in ("kernel_size", "stride", "padding", "dilation")]
            sizes = [s if isinstance(s, tuple) else (s, s) for s in sizes]
            height, width = (side(n, *(s[i] for s in sizes)) for i, n in enumerate((height, width)))
            channels = getattr(layer, "out_channels", channels)
        elif not isinstance(layer, (nn.ReLU, nn.Flatten)):
            raise TypeError(f"no size rule for {layer!r}")
    return channels * height * width


def _mlp(in_features: int, hidden: list[int], num_classes: int) -> nn.Module:
    layers: list[nn.Module] = [nn.Flatten()]
    prev = in_features
    for h in hidden:
        layers += [nn.Linear(prev, h), nn.ReLU()]
        prev = h
    layers.append(nn.Linear(prev, num_classes))
    return nn.Sequential(*layers)


MODEL_NAMES = ("cnn", "mlp", "logistic")


def build_model(model_cfg, input_shape: tuple[int, ...], num_classes: int, seed: int) -> nn.Module:
    """Build the model named in the scenario; the same seed gives the same initial weights."""
    check_model_input(model_cfg, input_shape)  # the check `dpfl run` makes before Ray starts
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _layers(model_cfg, input_shape, num_classes)


def _layers(model_cfg, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """The model's layers, initialised from torch's global generator (or on the meta device, without it)."""
    name = model_cfg.name
    if name == "cnn":
        return TFPrivacyCNN(*input_shape, num_classes)
    flat = int(math.prod(input_shape))
    if name == "mlp":
        return _mlp(flat, list(model_cfg.hidden), num_classes)
    if name == "logistic":
        return _mlp(flat, [], num_classes)
    raise DPFLError(f"unknown model {name!r} (choose from {', '.join(MODEL_NAMES)})", field="model.name")


def get_flat(model: nn.Module) -> np.ndarray:
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().cpu().numpy().astype(np.float32)


def initial_theta(model_cfg, input_shape: tuple[int, ...], num_classes: int, seed: int) -> np.ndarray:
    """A run's initial model, flat: built from the scenario's model and seed alone."""
    return get_flat(build_model(model_cfg, tuple(input_shape), num_classes, seed))


def model_file(state_dict) -> bytes:
    """The bytes of model.pt for ``state_dict``, the same in any process. torch.save names the
    archive's folder after the file it writes: this is the temporary name runs.record writes
    model.pt under, so the bytes are those a direct save there made."""
    with tempfile.TemporaryDirectory(prefix="dpfl-model-") as tmp:
        path = Path(tmp) / ".model.pt.tmp"
        torch.save(state_dict, path)
        return path.read_bytes()


def model_file_bytes(model_cfg, input_shape: tuple[int, ...], num_classes: int, theta: np.ndarray) -> bytes:
    """model.pt's bytes (model_file) for the flat model ``theta``.

    Every parameter comes from ``theta``, so the layers are made on the meta device and their state dict
    filled from ``theta``: nothing is drawn from (or seeds) torch's global generator, and a worker can answer this
    from a second thread while its training thread uses that generator (workers.ClientWorker.model_file).
    A model with buffers is refused: ``theta`` does not hold them, and making them would mean seeding
    the global generator under the training thread."""
    check_model_input(model_cfg, tuple(input_shape))
    with torch.device("meta"):
        model = _layers(model_cfg, tuple(input_shape), num_classes)
    buffers = [name for name, _ in model.named_buffers()]
    if buffers:
        raise DPFLError(f"model {model_cfg.name!r} has buffers ({', '.join(buffers)}) that the flat "
                        "model does not hold: model.pt cannot be written from it", field="model.name")
    size = sum(p.numel() for p in model.parameters())
    if np.size(theta) != size:  # a model of another scenario: a checkpoint's, edited or foreign
        raise DPFLError(f"a flat model of {np.size(theta)} values does not fit this scenario's {model_cfg.name} "
                        f"({size} values): a checkpoint of another model?", field="model")
    # the state dict of the meta model (its keys, in order, and torch's _metadata) with each parameter's
    # values from theta, each in a storage of its own as a model's are; not model.to_empty, which on
    # the meta device loads sympy (a third of a second of CPU)
    state = model.state_dict()
    flat = torch.from_numpy(np.array(theta, dtype=np.float32, copy=True))
    offset = 0
    for name, p in model.named_parameters():
        state[name] = flat[offset:offset + p.numel()].clone().reshape(p.shape)
        offset += p.numel()
    return model_file(state)


@torch.no_grad()
def set_flat(model: nn.Module, flat: np.ndarray) -> None:
    """Copy a flat vector into the parameters. Copy, never alias: ``flat`` is often a read-only
    object-store buffer shared by every worker on the node (vector_to_parameters would alias it)."""
    vec = torch.from_numpy(np.array(flat, dtype=np.float32, copy=True))
    offset = 0
    for p in model.parameters():
        n = p.numel()
        p.copy_(vec[offset:offset + n].view_as(p))
        offset += n
    if offset != vec.numel():
        raise ValueError(f"flat vector has {vec.numel()} values, the model {offset}")


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


class _ChannelsLastMaxPool2d(nn.MaxPool2d):
    """The same max-pool (same values, same argmax on ties, so the same gradients) computed on a
    channels-last copy: PyTorch's CPU kernel for channels-first input is ~10x slower, and vmap
    cannot be asked for a memory format, so the layout is made by permuting. The output goes back
    to channels-first, so the layer after the pool runs the same kernel as in the model itself:
    oneDNN's AVX2 convolution rounds channels-last input differently in the last bits."""

    def forward(self, x):
        if not torch.is_grad_enabled() and self._two_by_two_stride_one():
            return _max_of_four_shifts(x)
        return super().forward(x.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)).contiguous()

    def _two_by_two_stride_one(self) -> bool:
        return (self.kernel_size in (2, (2, 2)) and self.stride in (1, (1, 1)) and self.padding in (0, (0, 0))
                and self.dilation in (1, (1, 1)) and not self.ceil_mode and not self.return_indices)


def _max_of_four_shifts(x: torch.Tensor) -> torch.Tensor:
    """A 2x2 max-pool of stride 1 as the maximum of the input's four shifted views: the same values
    (a maximum is exact, and NaN propagates as in the pool), channels-first like the pool's output,
    in about half the time of the channels-last kernel on CPU. Only where no gradient is taken
    (evaluation, DPAGD's step-size arg-max): on ties ``torch.maximum`` splits the gradient, where
    the pool sends it to one input."""
    return torch.maximum(torch.maximum(x[..., :-1, :-1], x[..., 1:, :-1]),
                         torch.maximum(x[..., :-1, 1:], x[..., 1:, 1:]))


_TWINS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def pool_twin(model: nn.Module) -> nn.Module:
    """``model`` with its 2-d max-pools run channels-last: a copy whose parameters keep their names,
    so ``functional_call`` drives it with the model's own (or stacked) parameters. A model without
    a max-pool is its own twin. Used by batched and sequential training and by evaluation (the
    CNN's test-set pass takes half the time, with the same logits)."""
    if model not in _TWINS:
        if not any(type(m) is nn.MaxPool2d for m in model.modules()):
            _TWINS[model] = model
        else:
            twin = copy.deepcopy(model)
            for parent in twin.modules():
                for name, child in parent.named_children():
                    if type(child) is nn.MaxPool2d:
                        fast = _ChannelsLastMaxPool2d(child.kernel_size, child.stride, child.padding, child.dilation,
                                                      child.return_indices, child.ceil_mode)
                        setattr(parent, name, fast)
            _TWINS[model] = twin
    return _TWINS[model]


def pool_forward(model: nn.Module):
    """``model``'s forward in its current mode and with its current parameters, run through
    :func:`pool_twin`: the same outputs and gradients to the bit, in less time."""
    twin = pool_twin(model)
    if twin is model:
        return model
    twin.train(model.training)
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    return lambda xb: functional_call(twin, state, (xb,))


def shard_sums(model: nn.Module, x: np.ndarray, y: np.ndarray,
               shards: list[tuple[int, int]]) -> list[tuple[int, float]]:
    """(correct predictions, summed cross-entropy) of ``model`` on each row range of (x, y)."""
    model.eval()
    forward = pool_forward(model)
    device = next(model.parameters()).device
    out = []
    with torch.no_grad():
        for lo, hi in shards:
            xb = torch.from_numpy(x[lo:hi]).to(device)
            logits = forward(xb)
            yb = torch.from_numpy(y[lo:hi]).to(device)
            out.append((int((logits.argmax(1) == yb).sum().item()),
                        float(nn.functional.cross_entropy(logits, yb, reduction="sum").item())))
    return out


def allow_read_only_arrays() -> None:
    """Silence torch's warning that a tensor made from a read-only NumPy array must not be written,
    in the process that calls this (the actors). Ray's object store hands them the data as
    read-only views, and nothing here writes into a tensor made from one (training and evaluation
    index, copy and read them); torch would print the warning once into every worker's log."""
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)


@contextlib.contextmanager
def one_thread():
    """torch on one thread for the block, then as before: evaluation's figures must not depend on
    how many threads the process that computes them runs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def evaluate(model: nn.Module, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Test accuracy and mean cross-entropy loss."""
    return combine_shards(shard_sums(model, x, y, eval_shards(len(y))), len(y))
