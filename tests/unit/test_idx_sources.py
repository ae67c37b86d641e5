"""The fashion_mnist and mnist sources (issue #34): where they find their four IDX files, the one-line
answer when they are nowhere, and the .npy cache that spares every run the parse. Small IDX files are
written here, raw and gzipped, so nothing needs Debian's dataset-fashion-mnist."""
import gzip
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import yaml

from dpfl_ray.data import sources
from dpfl_ray.data.sources import load_source
from dpfl_ray.errors import DPFLError
from dpfl_ray.scenario import DataConfig
from tests.e2e.test_hostile_inputs import TINY, assert_one_error_line, dpfl

STEMS = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def write_idx(path: Path, array: np.ndarray, gz: bool = False) -> Path:
    """The IDX format exactly: two zero bytes, the type (0x08 = unsigned byte), the number of dims,
    each dim as a big-endian uint32, then the values (magic 0x00000803 for images, 0x00000801 for labels)."""
    assert array.dtype == np.uint8
    body = struct.pack(">I", 0x0800 | array.ndim) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()
    with (gzip.open if gz else open)(path, "wb") as f:
        f.write(body)
    return path


def idx_folder(folder: Path, seed: int = 0, gz: bool = False, n_train: int = 20, n_test: int = 10) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    ext = ".gz" if gz else ""
    write_idx(folder / f"{STEMS[0]}{ext}", rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8), gz)
    write_idx(folder / f"{STEMS[1]}{ext}", ((np.arange(n_train) + seed) % 10).astype(np.uint8), gz)
    write_idx(folder / f"{STEMS[2]}{ext}", rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8), gz)
    write_idx(folder / f"{STEMS[3]}{ext}", (np.arange(n_test) % 10).astype(np.uint8), gz)
    return folder


def raw_train_images(folder: Path) -> np.ndarray:
    return np.frombuffer((folder / STEMS[0]).read_bytes()[16:], dtype=np.uint8).reshape(-1, 28, 28)


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """No real DPFL_DATA, no real ~/.cache, and system folders that do not exist: what this machine has
    installed never decides a test."""
    monkeypatch.delenv("DPFL_DATA", raising=False)
    monkeypatch.setenv("DPFL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(sources, "_NAMED", {
        name: (label, subdirs, tmp_path / "system" / subdirs[0])
        for name, (label, subdirs, _) in sources._NAMED.items()})


def cache_files(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.npy")) if folder.exists() else []


def test_dpfl_data_itself_is_not_taken_for_either_set(tmp_path, monkeypatch):
    """The two sets share file names and shapes: only a folder named after its set is read."""
    idx_folder(tmp_path / "data")
    monkeypatch.setenv("DPFL_DATA", str(tmp_path / "data"))
    for source in ("fashion_mnist", "mnist"):
        with pytest.raises(DPFLError, match="not found"):
            load_source(DataConfig(source=source), 0)


@pytest.mark.parametrize("subdir", ["fashion-mnist", "fashion_mnist"])
@pytest.mark.parametrize("gz", [False, True])
def test_fashion_mnist_found_through_dpfl_data(tmp_path, monkeypatch, subdir, gz):
    folder = idx_folder(tmp_path / "data" / subdir, gz=gz)
    monkeypatch.setenv("DPFL_DATA", str(tmp_path / "data"))
    ds = load_source(DataConfig(source="fashion_mnist"), 0)
    assert ds.name == "fashion_mnist" and ds.num_classes == 10
    assert ds.x_train.shape == (20, 1, 28, 28) and ds.x_test.shape == (10, 1, 28, 28)
    assert ds.x_train.dtype == np.float32 and 0.0 <= ds.x_train.min() and ds.x_train.max() <= 1.0
    assert ds.y_train.dtype == np.int64 and ds.y_train.tolist() == [i % 10 for i in range(20)]
    expected = np.frombuffer(gzip.decompress((folder / f"{STEMS[0]}.gz").read_bytes())[16:], np.uint8) if gz \
        else raw_train_images(folder).ravel()
    assert np.array_equal(ds.x_train.ravel(), expected.astype(np.float32) / 255.0)


def test_mnist_found_through_dpfl_data_and_system_folder(tmp_path, monkeypatch):
    idx_folder(tmp_path / "system" / "mnist", seed=3)
    ds = load_source(DataConfig(source="mnist"), 0)
    assert ds.name == "mnist" and ds.y_train[0] == 3
    idx_folder(tmp_path / "data" / "mnist", seed=5)
    monkeypatch.setenv("DPFL_DATA", str(tmp_path / "data"))
    assert load_source(DataConfig(source="mnist"), 0).y_train[0] == 5  # $DPFL_DATA/mnist before the system's


def test_a_dpfl_data_folder_of_the_set_missing_a_file_is_not_passed_over(tmp_path, monkeypatch):
    """$DPFL_DATA/fashion-mnist without one of its files fell back to the system's copy in silence:
    the user's folder is named after the set, so what it lacks is said."""
    idx_folder(tmp_path / "system" / "fashion-mnist", seed=2)
    folder = idx_folder(tmp_path / "data" / "fashion-mnist", seed=1)
    (folder / STEMS[3]).unlink()
    monkeypatch.setenv("DPFL_DATA", str(tmp_path / "data"))
    with pytest.raises(DPFLError) as err:
        load_source(DataConfig(source="fashion_mnist"), 0)
    assert err.value.field == "data.source" and str(err.value).startswith(f"data.source: {folder} lacks {STEMS[3]}[.gz]")


def test_data_path_comes_first_and_is_never_replaced(tmp_path, monkeypatch):
    idx_folder(tmp_path / "data" / "fashion-mnist", seed=1)
    idx_folder(tmp_path / "system" / "fashion-mnist", seed=2)
    monkeypatch.setenv("DPFL_DATA", str(tmp_path / "data"))
    assert load_source(DataConfig(source="fashion_mnist"), 0).y_train[0] == 1
    mine = idx_folder(tmp_path / "mine", seed=4)
    assert load_source(DataConfig(source="fashion_mnist", path=str(mine)), 0).y_train[0] == 4
    (tmp_path / "empty").mkdir()
    with pytest.raises(DPFLError) as err:  # a folder named on purpose: no silent fall-back to $DPFL_DATA
        load_source(DataConfig(source="fashion_mnist", path=str(tmp_path / "empty")), 0)
    assert err.value.field == "data.path" and "\n" not in str(err.value)
    assert "apt-get install dataset-fashion-mnist" in str(err.value) and STEMS[3] in str(err.value)


def test_missing_data_is_one_line_that_says_how_to_get_it(tmp_path, monkeypatch):
    with pytest.raises(DPFLError) as err:
        load_source(DataConfig(source="fashion_mnist"), 0)
    msg = str(err.value)
    assert err.value.field == "data.source" and len(msg.splitlines()) == 1
    assert "apt-get install dataset-fashion-mnist" in msg and "DPFL_DATA" in msg and "data.path" in msg
    assert str(tmp_path / "system" / "fashion-mnist") in msg  # where it looked
    monkeypatch.setenv("DPFL_DATA", str(tmp_path / "data"))
    with pytest.raises(DPFLError) as err:
        load_source(DataConfig(source="mnist"), 0)
    msg = str(err.value)
    assert len(msg.splitlines()) == 1 and str(tmp_path / "data" / "mnist") in msg and "$DPFL_DATA/mnist" in msg
    assert all(stem in msg for stem in STEMS) and "apt-get" not in msg


def test_an_idx_folder_that_is_not_there_is_one_line_naming_where_and_what(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DPFLError) as err:
        load_source(DataConfig(source="idx", path="fashion-mnist"), 0)
    msg = str(err.value)
    assert err.value.field == "data.path" and len(msg.splitlines()) == 1
    assert str(tmp_path / "fashion-mnist") in msg and all(stem in msg for stem in STEMS)
    assert "data.source: fashion_mnist" in msg


def test_a_folder_of_other_images_is_not_fashion_mnist(tmp_path):
    folder = idx_folder(tmp_path / "small")
    write_idx(folder / STEMS[0], np.zeros((20, 8, 8), dtype=np.uint8))
    with pytest.raises(DPFLError, match="28x28"):
        load_source(DataConfig(source="fashion_mnist", path=str(folder)), 0)


@pytest.mark.parametrize("source", ["fashion_mnist", "idx"])
def test_cache_hit_gives_equal_arrays_without_parsing(tmp_path, monkeypatch, source):
    folder = idx_folder(tmp_path / "data", gz=True)
    cfg = DataConfig(source=source, path=str(folder))
    first = load_source(cfg, 0)
    assert len(cache_files(tmp_path / "cache")) == 4
    assert all(np.load(f).dtype == np.uint8 for f in cache_files(tmp_path / "cache"))

    def no_parse(path):
        raise AssertionError(f"{path} parsed again")

    monkeypatch.setattr(sources, "read_idx", no_parse)
    again = load_source(cfg, 0)
    for name in ("x_train", "y_train", "x_test", "y_test"):
        a, b = getattr(first, name), getattr(again, name)
        assert a.dtype == b.dtype and np.array_equal(a, b)


def test_a_changed_file_is_parsed_again(tmp_path):
    folder = idx_folder(tmp_path / "data")
    cfg = DataConfig(source="fashion_mnist", path=str(folder))
    load_source(cfg, 0)
    st = (folder / STEMS[0]).stat()
    write_idx(folder / STEMS[0], np.full((20, 28, 28), 255, dtype=np.uint8))  # same size, new values
    os.utime(folder / STEMS[0], ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert np.all(load_source(cfg, 0).x_train == 1.0)
    assert len(cache_files(tmp_path / "cache")) == 4  # the stale copy was replaced, not kept beside


def test_a_file_rewritten_with_its_old_mtime_is_parsed_again(tmp_path):
    """``cp -p`` or ``tar x`` put the old mtime back on a rewritten file of the same size: the cache
    keyed on size and mtime alone served the old labels."""
    folder = idx_folder(tmp_path / "data")
    cfg = DataConfig(source="fashion_mnist", path=str(folder))
    load_source(cfg, 0)
    st = (folder / STEMS[0]).stat()
    write_idx(folder / STEMS[0], np.full((20, 28, 28), 255, dtype=np.uint8))  # same size, new values
    os.utime(folder / STEMS[0], ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (folder / STEMS[0]).stat().st_mtime_ns == st.st_mtime_ns
    assert np.all(load_source(cfg, 0).x_train == 1.0)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "other_shape"])
def test_a_corrupt_cache_is_rebuilt(tmp_path, damage):
    folder = idx_folder(tmp_path / "data")
    cfg = DataConfig(source="fashion_mnist", path=str(folder))
    load_source(cfg, 0)
    cached = next(f for f in cache_files(tmp_path / "cache") if f.name.startswith(STEMS[0]))
    if damage == "garbage":
        cached.write_bytes(b"not an npy file at all")
    elif damage == "truncated":
        cached.write_bytes(cached.read_bytes()[:-100])
    else:
        np.save(cached, np.zeros((3, 28, 28), dtype=np.uint8))
    ds = load_source(cfg, 0)
    assert np.array_equal(ds.x_train[:, 0], raw_train_images(folder).astype(np.float32) / 255.0)
    assert np.array_equal(np.load(cached), raw_train_images(folder))  # rewritten whole


def test_a_failed_write_leaves_no_half_cache(tmp_path, monkeypatch):
    folder = idx_folder(tmp_path / "data")

    def dies_half_way(f, arr, allow_pickle=False):
        f.write(b"\x93NUMPY half")
        raise OSError("disk full")

    monkeypatch.setattr(sources.np, "save", dies_half_way)
    ds = load_source(DataConfig(source="fashion_mnist", path=str(folder)), 0)
    assert ds.x_train.shape == (20, 1, 28, 28)
    assert not (tmp_path / "cache").exists() or list((tmp_path / "cache").iterdir()) == []


def test_default_cache_beside_the_data_then_home(tmp_path, monkeypatch):
    monkeypatch.delenv("DPFL_CACHE")
    folder = idx_folder(tmp_path / "data")
    load_source(DataConfig(source="fashion_mnist", path=str(folder)), 0)
    assert len(cache_files(folder / ".dpfl-cache")) == 4
    other = idx_folder(tmp_path / "other")
    (other / ".dpfl-cache").write_text("a file, not a folder")  # the folder beside cannot be made
    load_source(DataConfig(source="idx", path=str(other)), 0)
    assert len(cache_files(tmp_path / "home" / ".cache" / "dpfl")) == 4
    idx_folder(tmp_path / "system" / "fashion-mnist")  # a distribution's folder is never written in
    load_source(DataConfig(source="fashion_mnist"), 0)
    load_source(DataConfig(source="idx", path=str(tmp_path / "system" / "fashion-mnist")), 0)  # named, too
    assert not (tmp_path / "system" / "fashion-mnist" / ".dpfl-cache").exists()
    assert len(cache_files(tmp_path / "home" / ".cache" / "dpfl")) == 8


def test_cache_never_inside_the_package(tmp_path, monkeypatch):
    package = Path(sources.__file__).resolve().parents[1]
    before = cache_files(package)
    monkeypatch.setenv("DPFL_CACHE", str(package / "cache"))  # pointed into the package: counts as unset
    load_source(DataConfig(source="fashion_mnist", path=str(idx_folder(tmp_path / "data"))), 0)
    assert cache_files(package) == before and not (package / "cache").exists()
    assert len(cache_files(tmp_path / "data" / ".dpfl-cache")) == 4
    # data that lives inside the package is cached in ~/.cache, not beside it
    monkeypatch.delenv("DPFL_CACHE")
    monkeypatch.setattr(sources, "_PACKAGE_DIR", tmp_path / "pkg")
    load_source(DataConfig(source="fashion_mnist", path=str(idx_folder(tmp_path / "pkg" / "data"))), 0)
    assert cache_files(tmp_path / "pkg") == [] and not (tmp_path / "pkg" / "data" / ".dpfl-cache").exists()
    assert len(cache_files(tmp_path / "home" / ".cache" / "dpfl")) == 4


def test_cli_run_without_the_files_is_one_error_line(tmp_path):
    scenario = tmp_path / "tiny.yaml"
    scenario.write_text(yaml.safe_dump(dict(TINY, output={"dir": str(tmp_path / "runs")})))
    (tmp_path / "empty").mkdir()
    res = dpfl("run", scenario, "--set", "data.source=fashion_mnist", "--set", f"data.path={tmp_path / 'empty'}")
    line = assert_one_error_line(res, "data.path")
    assert "apt-get install dataset-fashion-mnist" in line and not (tmp_path / "runs").exists()


def test_normalize_maps_train_and_test_through_the_stated_constants_and_nothing_else(tmp_path):
    folder = idx_folder(tmp_path / "data")
    plain = load_source(DataConfig(source="idx", path=str(folder)), 0)
    scaled = load_source(DataConfig(source="idx", path=str(folder), normalize=[0.25, 0.5]), 0)
    for name in ("x_train", "x_test"):
        a, b = getattr(plain, name), getattr(scaled, name)
        assert b.dtype == np.float32 and b.shape == a.shape
        assert np.array_equal(b, (a - np.float32(0.25)) / np.float32(0.5))
    assert float(scaled.x_train.min()) == -0.5 and float(scaled.x_train.max()) == 1.5  # pixel 0 and 255
    assert np.array_equal(plain.y_train, scaled.y_train) and np.array_equal(plain.y_test, scaled.y_test)
    again = load_source(DataConfig(source="idx", path=str(folder)), 0)  # the cache holds the raw bytes
    assert np.array_equal(plain.x_train, again.x_train)


def test_a_normalize_that_divides_by_zero_is_one_error_line(tmp_path):
    scenario = tmp_path / "tiny.yaml"
    scenario.write_text(yaml.safe_dump(dict(TINY, output={"dir": str(tmp_path / "runs")})))
    res = dpfl("run", scenario, "--set", "data.normalize=[0.5, 0]")
    assert_one_error_line(res, "data.normalize")
    assert not (tmp_path / "runs").exists()


def write_raw_idx(path: Path, array: np.ndarray, type_code: int) -> Path:
    """Any IDX element type (0x08 unsigned byte, 0x09 signed byte, 0x0D float32), values big-endian."""
    body = struct.pack(">BBBB", 0, 0, type_code, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(body + array.astype(array.dtype.newbyteorder(">")).tobytes())
    return path


def _damage(folder: Path, kind: str) -> str:
    """Break one file of a good IDX folder as ``kind`` says; the file's stem, which the error must name."""
    images, labels, test_images = folder / STEMS[0], folder / STEMS[1], folder / STEMS[2]
    if kind == "empty_training_set":
        write_idx(images, np.zeros((0, 28, 28), np.uint8)), write_idx(labels, np.zeros(0, np.uint8))
        return STEMS[0]
    if kind == "255_dimensions":
        images.write_bytes(b"\x00\x00\x08\xff" + bytes(10))
        return STEMS[0]
    if kind == "negative_label":
        write_raw_idx(labels, np.full(20, -1, np.int8), 0x09)
        return STEMS[1]
    if kind == "a_label_of_2_to_the_31":
        write_raw_idx(labels, np.full(20, 2 ** 31 - 1, np.int32), 0x0C)
        return STEMS[1]
    if kind == "dims_whose_product_overflows":
        images.write_bytes(struct.pack(">BBBBIII", 0, 0, 8, 3, 2 ** 22, 2 ** 21, 2 ** 21))
        return STEMS[0]
    if kind == "two_labels_per_image":
        write_idx(labels, np.zeros((20, 2), np.uint8))
        return STEMS[1]
    if kind == "float_images_with_nan":
        write_raw_idx(images, np.full((20, 28, 28), np.nan, np.float32), 0x0D)
        return STEMS[0]
    if kind == "a_stray_label":  # 255 among 0-9: a 256-class model
        write_idx(labels, np.array([255] + [i % 10 for i in range(19)], np.uint8))
        return STEMS[1]
    if kind == "a_header_cut_short":  # the header stops after the first of three dimensions
        images.write_bytes(images.read_bytes()[:8])
        return STEMS[0]
    if kind == "zero_pixel_images":
        images.write_bytes(struct.pack(">BBBBIII", 0, 0, 8, 3, 20, 0, 0))
        return STEMS[0]
    if kind == "other_test_image_size":
        write_idx(test_images, np.zeros((10, 27, 27), np.uint8))
        return STEMS[2]
    raise AssertionError(kind)


@pytest.mark.parametrize("kind, needle", [
    ("empty_training_set", "holds no image"),
    ("255_dimensions", "its header declares 255 dimensions"),
    ("negative_label", "a label is negative (-1)"),
    ("a_label_of_2_to_the_31", "a label is 2147483647; at most 9,999 (10,000 classes)"),
    ("dims_whose_product_overflows", "header says 18446744073709551616 data bytes, file has 0"),
    ("two_labels_per_image", "labels must be one integer per image, the file holds uint8 of shape (20, 2)"),
    ("float_images_with_nan", "images must be unsigned bytes"),
    ("other_test_image_size", "27x27 images, but the training images"),
    ("a_header_cut_short", "its header is cut short (8 bytes; 3 dimensions need 16)"),
    ("a_stray_label", "the labels run to 255, but 245 of the classes below never label a training image (10, 11,"),
    ("zero_pixel_images", "its header declares an empty dimension [20, 0, 0]"),
])
def test_idx_files_the_loader_cannot_take_are_one_line_naming_the_file(tmp_path, kind, needle):
    """Each was an internal error or a run that failed in torch (or trained on NaN) without naming
    data.path: now refused as the data is read, before any client exists."""
    folder = idx_folder(tmp_path / "data")
    stem = _damage(folder, kind)
    with pytest.raises(DPFLError) as err:
        load_source(DataConfig(source="idx", path=str(folder)), 0)
    assert err.value.field == "data.path" and needle in str(err.value) and str(folder / stem) in str(err.value)
