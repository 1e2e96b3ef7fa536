"""Tests for lab.data: loaders, splits, the MNIST-1D cache and RNG isolation, CIFAR-10 faults,
augmentation and mini-batching. CIFAR-10 runs on a small fake file set in the official format.
"""

from __future__ import annotations

import pickle
import random
import re
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch

from lab.data import (
    DATASETS,
    DataError,
    Dataset,
    Split,
    default_data_dir,
    load_dataset,
    train_size,
)
from lab.data import mnist1d as mnist1d_module
from lab.data.augment import AUGMENTATIONS, augment, random_crop_flip, random_shift
from lab.data.batches import iterate_batches, n_batches
from lab.data.cifar10 import DATA_BATCHES, TEST_BATCH, write_fake_cifar10

N_FAKE = 20  # images per fake CIFAR-10 batch

# name -> (trailing shape, in_channels, dims, augment, n train+val, n test)
EXPECTED = {
    "mnist1d": ((1, 40), 1, 1, "shift", 4000, 1000),
    "digits": ((1, 8, 8), 1, 2, "none", 1797 - 359, 359),
    "cifar10": ((3, 32, 32), 3, 2, "crop_flip", 5 * N_FAKE, N_FAKE),
}


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """One data dir per module: MNIST-1D is generated (and cached) here once; fake CIFAR-10 too."""
    root = tmp_path_factory.mktemp("lab_data")
    write_fake_cifar10(root, n_per_batch=N_FAKE, seed=0)
    return root


@pytest.fixture(scope="module")
def fresh_mnist1d(data_dir) -> Dataset:
    """MNIST-1D as first generated, which also writes the cache in data_dir."""
    assert not mnist1d_module.cache_path(data_dir).exists()
    return load_dataset("mnist1d", data_dir=data_dir)


@pytest.fixture(scope="module")
def datasets(data_dir, fresh_mnist1d) -> dict[str, Dataset]:
    return {
        "mnist1d": fresh_mnist1d,
        "digits": load_dataset("digits", data_dir=data_dir),
        "cifar10": load_dataset("cifar10", data_dir=data_dir),
    }


def rows(x: torch.Tensor) -> list[bytes]:
    """Each example as bytes, to compare splits by content."""
    return [r.numpy().tobytes() for r in x.reshape(x.shape[0], -1)]


# ---------------------------------------------------------------------------- loaders


@pytest.mark.parametrize("name", DATASETS)
def test_shapes_dtypes_and_metadata(datasets, name):
    ds = datasets[name]
    trailing, in_channels, dims, aug, n_train_val, n_test = EXPECTED[name]
    assert (ds.name, ds.in_channels, ds.n_classes, ds.dims, ds.augment) == (
        name,
        in_channels,
        10,
        dims,
        aug,
    )
    assert ds.augment in AUGMENTATIONS
    for split in (ds.train, ds.val, ds.test):
        assert split.x.dtype == torch.float32 and split.y.dtype == torch.int64
        assert split.x.device.type == "cpu" and split.y.device.type == "cpu"
        assert tuple(split.x.shape[1:]) == trailing
        assert split.x.dim() == dims + 2
        assert split.x.shape[0] == split.y.shape[0]
        assert int(split.y.min()) >= 0 and int(split.y.max()) < ds.n_classes
        assert torch.isfinite(split.x).all()
    assert len(ds.train) + len(ds.val) == n_train_val
    assert len(ds.val) == round(0.1 * n_train_val)
    assert len(ds.test) == n_test


@pytest.mark.parametrize("name", ["mnist1d", "digits"])
def test_all_classes_present(datasets, name):
    assert set(datasets[name].train.y.tolist()) == set(range(10))


def test_standardisation(datasets):
    mnist = datasets["mnist1d"].train.x
    assert abs(float(mnist.mean())) < 0.05 and 0.9 < float(mnist.std()) < 1.1
    digits = datasets["digits"]
    for split in (digits.train, digits.val, digits.test):
        assert float(split.x.min()) >= 0.0 and float(split.x.max()) <= 1.0
    assert float(digits.train.x.max()) == 1.0  # /16, not /max
    cifar = datasets["cifar10"]
    # Statistics come from the whole training set (train + val), so that is standardised exactly.
    train_val = torch.cat([cifar.train.x, cifar.val.x]).double()
    mean = train_val.mean(dim=(0, 2, 3))
    std = train_val.std(dim=(0, 2, 3), unbiased=False)
    torch.testing.assert_close(mean, torch.zeros(3, dtype=torch.float64), atol=1e-5, rtol=0)
    torch.testing.assert_close(std, torch.ones(3, dtype=torch.float64), atol=1e-5, rtol=0)
    assert abs(float(cifar.test.x.mean())) > 1e-4  # test is scaled with train's statistics


@pytest.mark.parametrize("name", DATASETS)
def test_val_split_disjoint_and_complete(data_dir, datasets, name):
    ds = datasets[name]
    full = load_dataset(name, data_dir=data_dir, val_fraction=0.0)
    train_rows, val_rows = rows(ds.train.x), rows(ds.val.x)
    assert not set(train_rows) & set(val_rows)
    assert sorted(train_rows + val_rows) == sorted(rows(full.train.x))
    # Labels travel with their inputs.
    label_of = dict(zip(rows(full.train.x), full.train.y.tolist(), strict=True))
    assert [label_of[r] for r in val_rows] == ds.val.y.tolist()


@pytest.mark.parametrize("name", ["digits", "cifar10"])
def test_val_split_deterministic_in_split_seed(data_dir, name):
    a = load_dataset(name, data_dir=data_dir, split_seed=3)
    b = load_dataset(name, data_dir=data_dir, split_seed=3)
    c = load_dataset(name, data_dir=data_dir, split_seed=4)
    assert torch.equal(a.val.x, b.val.x) and torch.equal(a.train.y, b.train.y)
    assert not torch.equal(a.val.x, c.val.x)
    # The test split never depends on the validation split.
    assert torch.equal(a.test.x, c.test.x) and torch.equal(a.test.y, c.test.y)


@pytest.mark.parametrize("name", ["digits", "cifar10"])
def test_val_fraction_zero_gives_empty_val(data_dir, name):
    ds = load_dataset(name, data_dir=data_dir, val_fraction=0)
    assert ds.val.x.shape == (0, *EXPECTED[name][0])
    assert ds.val.x.dtype == torch.float32 and ds.val.y.shape == (0,)
    assert len(ds.train) == EXPECTED[name][4]


def test_global_torch_rng_untouched_by_split(data_dir):
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    load_dataset("digits", data_dir=data_dir, split_seed=11)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("name", ["digits", "cifar10"])
def test_n_train_keeps_first_examples(data_dir, name):
    full = load_dataset(name, data_dir=data_dir, split_seed=2)
    small = load_dataset(name, data_dir=data_dir, split_seed=2, n_train=7)
    assert small.train.x.shape == (7, *EXPECTED[name][0])
    assert torch.equal(small.train.x, full.train.x[:7])
    assert torch.equal(small.train.y, full.train.y[:7])
    assert torch.equal(small.val.x, full.val.x) and torch.equal(small.test.x, full.test.x)


def test_n_train_above_available_is_refused(data_dir):
    with pytest.raises(DataError, match=rf"n_train=1000000 but cifar10 has only {5 * N_FAKE} "
                                        "training examples"):
        load_dataset("cifar10", data_dir=data_dir, val_fraction=0, n_train=10**6)
    ds = load_dataset("cifar10", data_dir=data_dir, val_fraction=0, n_train=5 * N_FAKE)
    assert len(ds.train) == 5 * N_FAKE


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"name": "mnist"}, r"unknown dataset 'mnist'; known datasets: mnist1d, digits, cifar10"),
        ({"name": "digits", "val_fraction": -0.1}, r"val_fraction=-0\.1 .*\[0, 0\.9\]"),
        ({"name": "digits", "val_fraction": 0.95}, r"val_fraction=0\.95 .*\[0, 0\.9\]"),
        ({"name": "digits", "val_fraction": float("nan")}, r"val_fraction=nan .*\[0, 0\.9\]"),
        ({"name": "digits", "val_fraction": "0.1"}, r"val_fraction .*\[0, 0\.9\].*'0\.1'"),
        ({"name": "digits", "n_train": -1}, r"n_train=-1 .*>= 0"),
        ({"name": "digits", "n_train": 2.5}, r"n_train .*>= 0.*2\.5"),
    ],
    ids=["name", "val-neg", "val-high", "val-nan", "val-str", "n_train-neg", "n_train-float"],
)
def test_bad_arguments(data_dir, kwargs, pattern):
    kwargs = dict(kwargs)
    name = kwargs.pop("name")
    with pytest.raises(DataError, match=pattern):
        load_dataset(name, data_dir=data_dir, **kwargs)


def test_data_error_is_value_error():
    assert issubclass(DataError, ValueError)


def test_split_checks_first_dim():
    with pytest.raises(DataError, match="3 inputs but 2 labels"):
        Split(x=torch.zeros(3, 1, 4), y=torch.zeros(2, dtype=torch.int64))


def test_default_data_dir_from_environment(monkeypatch, data_dir):
    monkeypatch.setenv("LAB_DATA_DIR", str(data_dir))
    assert default_data_dir() == data_dir
    assert len(load_dataset("cifar10", val_fraction=0).train) == 5 * N_FAKE
    monkeypatch.delenv("LAB_DATA_DIR")
    assert default_data_dir() == Path.home() / ".cache" / "lab"


# ---------------------------------------------------------------------------- MNIST-1D


def _global_draws() -> tuple:
    return (random.random(), float(np.random.rand()), float(torch.rand(1)))


def _seed_globals() -> None:
    random.seed(123)
    np.random.seed(123)
    torch.manual_seed(123)


def test_mnist1d_generation_leaves_global_rngs_alone(tmp_path):
    _seed_globals()
    expected = _global_draws()
    _seed_globals()
    load_dataset("mnist1d", data_dir=tmp_path)  # generates: the package reseeds the globals
    assert _global_draws() == expected


def test_mnist1d_rngs_restored_when_generation_fails(tmp_path, monkeypatch):
    import mnist1d.data

    def reseed_and_fail(args):
        random.seed(0)
        np.random.seed(0)
        torch.manual_seed(0)
        raise RuntimeError("generator failed")

    monkeypatch.setattr(mnist1d.data, "make_dataset", reseed_and_fail)
    _seed_globals()
    expected = _global_draws()
    _seed_globals()
    with pytest.raises(RuntimeError, match="generator failed"):
        load_dataset("mnist1d", data_dir=tmp_path)
    assert _global_draws() == expected


def _forbid_generation(monkeypatch):
    import mnist1d.data

    def fail(args):
        raise AssertionError("make_dataset called: the cache was not used")

    monkeypatch.setattr(mnist1d.data, "make_dataset", fail)


def _assert_same(a: Dataset, b: Dataset) -> None:
    for sa, sb in ((a.train, b.train), (a.val, b.val), (a.test, b.test)):
        assert torch.equal(sa.x, sb.x) and torch.equal(sa.y, sb.y)


def test_mnist1d_cache_round_trip(data_dir, fresh_mnist1d, monkeypatch):
    version = mnist1d_module.importlib.metadata.version("mnist1d")
    path = data_dir / "mnist1d" / f"mnist1d_v{version}_seed42.npz"
    assert path.is_file()
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left behind
    _forbid_generation(monkeypatch)
    _assert_same(load_dataset("mnist1d", data_dir=data_dir), fresh_mnist1d)


def test_mnist1d_train_count_is_what_loads_and_generates_nothing(tmp_path, fresh_mnist1d,
                                                                  monkeypatch):
    # A run's pre-check counts the training set; a refused run wrote the cache (and made the
    # directories) in the data_dir it was given.
    assert len(fresh_mnist1d.train.y) + len(fresh_mnist1d.val.y) == mnist1d_module.TRAIN_EXAMPLES
    _forbid_generation(monkeypatch)
    new = tmp_path / "new"
    assert mnist1d_module.train_count(new) == mnist1d_module.TRAIN_EXAMPLES
    assert train_size("mnist1d", data_dir=new, val_fraction=0.25) == 3000
    assert not new.exists()
    path = mnist1d_module.cache_path(tmp_path)  # a cache is counted as it is
    path.parent.mkdir(parents=True)
    np.savez(path, x_train=np.zeros((7, 40)), y_train=np.zeros(7, dtype=np.int64),
             x_test=np.zeros((2, 40)), y_test=np.zeros(2, dtype=np.int64))
    assert mnist1d_module.train_count(tmp_path) == 7
    path.write_bytes(b"damaged")  # load_arrays regenerates a damaged cache: its count
    with pytest.warns(UserWarning, match="unreadable MNIST-1D cache"):
        assert mnist1d_module.train_count(tmp_path) == mnist1d_module.TRAIN_EXAMPLES


def _with(arrays, key, value):
    out = dict(zip(("x_train", "y_train", "x_test", "y_test"), arrays, strict=True))
    out[key] = value
    return out


def _set_at(a, index, value):
    a = a.copy()
    a[index] = value
    return a


@pytest.mark.parametrize("name, edit, problem", [
    ("label 12", lambda a: _with(a, "y_train", _set_at(a[1], 7, 12)),
     "y_train holds label 12 at index 7; expected 0 to 9"),
    ("label -1", lambda a: _with(a, "y_test", _set_at(a[3], 3, -1)),
     "y_test holds label -1 at index 3; expected 0 to 9"),
    ("channel axis", lambda a: _with(a, "x_train", a[0][:, None, :]),
     "x_train has shape (4000, 1, 40); expected (examples >= 1, 40)"),
    ("cut to 30", lambda a: _with(a, "x_train", a[0][:, :30]),
     "x_train has shape (4000, 30); expected (examples >= 1, 40)"),
    ("100 labels", lambda a: _with(a, "y_train", a[1][:100]),
     "y_train has shape (100,) for 4000 signals; expected (4000,)"),
    ("float labels", lambda a: _with(a, "y_train", a[1] + 0.5),
     "y_train has dtype float64; expected integer class labels"),
    ("string labels", lambda a: _with(a, "y_train", a[1].astype("U1")),
     "y_train has dtype <U1; expected integer class labels"),
    ("nan", lambda a: _with(a, "x_test", _set_at(a[2], (5, 7), np.nan)),
     "x_test holds nan at index (5, 7); expected finite values"),
])
def test_a_wrong_mnist1d_cache_is_refused_naming_the_file(tmp_path, data_dir, fresh_mnist1d,
                                                         name, edit, problem):
    # The cache was trusted as it stood: label 12 failed inside the loss, signals cut to 30
    # samples trained without a word, a NaN diverged without saying where.
    del fresh_mnist1d  # (it wrote the generated cache: the edit starts from real arrays)
    with np.load(mnist1d_module.cache_path(data_dir)) as npz:
        arrays = tuple(npz[k] for k in ("x_train", "y_train", "x_test", "y_test"))
    path = mnist1d_module.cache_path(tmp_path)
    path.parent.mkdir(parents=True)
    np.savez(path, **edit(arrays))
    before = path.read_bytes()
    message = (f"MNIST-1D cache {path}: {problem}; delete the file and it is generated afresh "
               "(it holds the mnist1d generator's arrays)")
    for load in (lambda: load_dataset("mnist1d", data_dir=tmp_path),
                 lambda: train_size("mnist1d", data_dir=tmp_path)):
        with pytest.raises(DataError) as err:
            load()
        assert str(err.value) == message
    assert path.read_bytes() == before  # not overwritten


def test_mnist1d_damaged_cache_is_regenerated(tmp_path, fresh_mnist1d):
    path = mnist1d_module.cache_path(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not an npz file")
    with pytest.warns(UserWarning, match="unreadable MNIST-1D cache"):
        ds = load_dataset("mnist1d", data_dir=tmp_path)
    _assert_same(ds, fresh_mnist1d)
    with np.load(path) as npz:  # and rewritten
        assert npz["x_train"].shape == (4000, 40)


# ---------------------------------------------------------------------------- CIFAR-10


def test_cifar10_accepts_batch_dir_or_parent(data_dir, datasets):
    direct = load_dataset("cifar10", data_dir=data_dir / "cifar-10-batches-py")
    _assert_same(direct, datasets["cifar10"])


def test_a_cifar10_batch_of_zero_images_is_refused_as_such(tmp_path):
    # Python 3 pickles empty bytes (protocol 2) through builtins.bytes: the batch was
    # refused as unsafe code, and an empty split never reached a size check.
    from lab.data.cifar10 import _dump

    batch_dir = write_fake_cifar10(tmp_path, n_per_batch=4)
    _dump(batch_dir / TEST_BATCH, {b"data": np.zeros((0, 3072), np.uint8), b"labels": []})
    with pytest.raises(DataError, match=re.escape(
            f"CIFAR-10 batch {batch_dir / TEST_BATCH}: b'data' holds 0 images; expected at "
            "least 1 (shape (n, 3072), n >= 1)")):
        load_dataset("cifar10", data_dir=tmp_path)


def test_write_fake_cifar10_format(tmp_path):
    batch_dir = write_fake_cifar10(tmp_path, n_per_batch=5, seed=1)
    assert batch_dir == tmp_path / "cifar-10-batches-py"
    names = {p.name for p in batch_dir.iterdir()}
    assert names == {*DATA_BATCHES, TEST_BATCH, "batches.meta"}
    with open(batch_dir / "data_batch_1", "rb") as f:
        batch = pickle.load(f, encoding="bytes")
    assert batch[b"data"].dtype == np.uint8 and batch[b"data"].shape == (5, 3072)
    assert len(batch[b"labels"]) == 5 and all(isinstance(v, int) for v in batch[b"labels"])
    with open(batch_dir / "batches.meta", "rb") as f:
        meta = pickle.load(f, encoding="bytes")
    assert meta[b"label_names"][0] == b"airplane" and len(meta[b"label_names"]) == 10


def _dump(path: Path, obj) -> None:
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=2)


def _good_batch(n: int = 4) -> dict:
    return {b"data": np.zeros((n, 3072), dtype=np.uint8), b"labels": [0] * n}


def _replace(key, value):
    def mutate(path: Path) -> None:
        batch = _good_batch()
        batch[key] = value
        _dump(path, batch)

    return mutate


def _drop(key):
    def mutate(path: Path) -> None:
        batch = _good_batch()
        del batch[key]
        _dump(path, batch)

    return mutate


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


# Each case: (batch file to damage or None, how, expected message pattern after the path).
CIFAR_FAULTS = {
    "batch-missing": (
        "data_batch_3",
        lambda p: p.unlink(),
        r"missing: \S*data_batch_3\. Expected .*cifar-10-batches-py",
    ),
    "truncated": ("data_batch_2", _truncate, r"truncated or corrupt.*expected a pickled dict"),
    "garbage": ("test_batch", lambda p: p.write_bytes(b"\x00garbage"), r"truncated or corrupt"),
    "empty-file": ("data_batch_1", lambda p: p.write_bytes(b""), r"truncated or corrupt"),
    "foreign-global": (
        "data_batch_4",
        lambda p: _dump(p, OrderedDict(_good_batch())),
        r"refers to collections\.OrderedDict, which no CIFAR-10 batch contains; expected",
    ),
    "not-a-dict": ("data_batch_5", lambda p: _dump(p, [1, 2, 3]), r"holds a list; expected a dict"),
    "no-data-key": ("data_batch_1", _drop(b"data"), r"lacks key\(s\) b'data'"),
    "no-labels-key": ("test_batch", _drop(b"labels"), r"lacks key\(s\) b'labels'"),
    "data-not-array": (
        "data_batch_2",
        _replace(b"data", [[0] * 3072] * 4),
        r"b'data' is a list; expected a numpy array of shape \(n, 3072\) and dtype uint8",
    ),
    "data-dtype": (
        "data_batch_2",
        _replace(b"data", np.zeros((4, 3072), dtype=np.float32)),
        r"shape \(4, 3072\) and dtype float32; expected shape \(n, 3072\) and dtype uint8",
    ),
    "data-shape": (
        "data_batch_3",
        _replace(b"data", np.zeros((4, 32, 32, 3), dtype=np.uint8)),
        r"shape \(4, 32, 32, 3\) and dtype uint8; expected shape \(n, 3072\)",
    ),
    "labels-length": ("test_batch", _replace(b"labels", [0] * 3), r"3 labels for 4 images"),
    "labels-high": (
        "data_batch_1",
        _replace(b"labels", [0, 1, 10, 2]),
        r"outside 0\.\.9, e\.g\. 10 at index 2",
    ),
    "labels-negative": ("data_batch_1", _replace(b"labels", [0, -1, 0, 0]), r"outside 0\.\.9"),
    "labels-float": (
        "data_batch_1",
        _replace(b"labels", [0.5] * 4),
        r"b'labels' must be a flat list of ints in 0\.\.9",
    ),
}


@pytest.mark.parametrize("case", list(CIFAR_FAULTS))
def test_cifar10_faults(tmp_path, case):
    batch_dir = write_fake_cifar10(tmp_path, n_per_batch=4)
    filename, damage, pattern = CIFAR_FAULTS[case]
    path = batch_dir / filename
    damage(path)
    with pytest.raises(DataError, match=pattern) as info:
        load_dataset("cifar10", data_dir=tmp_path)
    assert str(path) in str(info.value)  # names the file at fault
    # The message must stand on its own: no chained numpy/pickle traceback.
    assert info.value.__cause__ is None
    assert info.value.__context__ is None or info.value.__suppress_context__


@pytest.mark.parametrize("what", ["missing", "empty"])
def test_cifar10_directory_faults(tmp_path, what):
    root = tmp_path / "nowhere"
    if what == "empty":
        root.mkdir()
    expected = r"cifar-10-batches-py.*data_batch_1\.\.5 and test_batch"
    with pytest.raises(DataError, match=re.escape(str(root)) + ".*" + expected):
        load_dataset("cifar10", data_dir=root)


# ---------------------------------------------------------------------------- augmentation


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("shape", [(16, 40), (16, 1, 40), (16, 3, 7)])
def test_random_shift_rows_are_rolls(shape):
    x = torch.randn(shape)
    out = random_shift(x, _gen())
    assert out.shape == x.shape and out.dtype == x.dtype
    length = shape[-1]
    shifts = []
    for n in range(shape[0]):
        matches = [s for s in range(length) if torch.equal(out[n], torch.roll(x[n], s, dims=-1))]
        assert len(matches) == 1, f"row {n} is not a circular roll of its input"
        shifts.append(matches[0])
    assert len(set(shifts)) > 1  # per-example offsets, not one shift for the batch


def test_random_shift_max_shift_bounds():
    x = torch.randn(64, 1, 40)
    out = random_shift(x, _gen(), max_shift=2)
    allowed = [torch.roll(x, s, dims=-1) for s in range(-2, 3)]
    for n in range(x.shape[0]):
        assert any(torch.equal(out[n], a[n]) for a in allowed)
    assert torch.equal(random_shift(x, _gen(), max_shift=0), x)


def test_crop_flip_without_padding_is_identity_or_flip():
    x = torch.randn(64, 3, 6, 5)
    out = random_crop_flip(x, _gen(), padding=0)
    assert out.shape == x.shape
    flipped = torch.tensor(
        [not torch.equal(out[n], x[n]) for n in range(x.shape[0])], dtype=torch.bool
    )
    torch.testing.assert_close(out[~flipped], x[~flipped], rtol=0, atol=0)
    torch.testing.assert_close(out[flipped], torch.flip(x[flipped], dims=[-1]), rtol=0, atol=0)
    assert 0 < int(flipped.sum()) < x.shape[0]  # both happen with p = 0.5


def test_crop_flip_rows_are_padded_crops():
    padding, (h, w) = 2, (5, 6)
    x = torch.rand(12, 2, h, w) + 1.0  # nonzero, so padding zeros are recognisable
    out = random_crop_flip(x, _gen(3), padding=padding)
    padded = torch.nn.functional.pad(x, (padding,) * 4)
    offsets = range(2 * padding + 1)
    for n in range(x.shape[0]):
        crops = [
            padded[n, :, top : top + h, left : left + w] for top in offsets for left in offsets
        ]
        candidates = crops + [crop.flip(-1) for crop in crops]
        assert any(torch.equal(out[n], c) for c in candidates), f"image {n} is not a crop"


@pytest.mark.parametrize(
    ("kind", "shape"), [("shift", (8, 1, 40)), ("crop_flip", (8, 3, 32, 32)), ("none", (8, 2, 4))]
)
def test_augment_dispatch_shapes_and_determinism(kind, shape):
    x = torch.randn(shape)
    a = augment(x, kind, _gen(7))
    b = augment(x, kind, _gen(7))
    assert a.shape == x.shape and a.dtype == x.dtype
    assert torch.equal(a, b)
    if kind == "none":
        assert torch.equal(a, x)
    else:
        assert not torch.equal(augment(x, kind, _gen(8)), a)


def test_augment_leaves_global_rng_alone():
    x = torch.randn(4, 3, 8, 8)
    torch.manual_seed(1)
    expected = torch.rand(2)
    torch.manual_seed(1)
    augment(x, "crop_flip", _gen())
    assert torch.equal(torch.rand(2), expected)


@pytest.mark.parametrize(
    ("call", "pattern"),
    [
        (
            lambda: augment(torch.zeros(2, 1, 4), "mixup", _gen()),
            r"'mixup'.*shift, crop_flip, none",
        ),
        (lambda: random_crop_flip(torch.zeros(2, 4, 4), _gen()), r"\(N, C, H, W\).*\(2, 4, 4\)"),
        (lambda: random_crop_flip(torch.zeros(2, 1, 4, 4), _gen(), padding=-1), r"padding"),
        (lambda: random_shift(torch.zeros(5), _gen()), r"\(N, \.\.\., L\)"),
        (lambda: random_shift(torch.zeros(2, 5), _gen(), max_shift=-1), r"max_shift.*-1"),
    ],
    ids=["unknown-kind", "crop-rank", "crop-padding", "shift-rank", "shift-max"],
)
def test_augment_errors(call, pattern):
    with pytest.raises(DataError, match=pattern):
        call()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["shift", "crop_flip"])
def test_augment_cpu_generator_same_on_cuda(kind):
    x = torch.randn(16, 3, 8, 8)
    on_cpu = augment(x, kind, _gen(5))
    on_cuda = augment(x.cuda(), kind, _gen(5))
    assert torch.equal(on_cuda.cpu(), on_cpu)


# ---------------------------------------------------------------------------- batches


def _indexed_split(n: int) -> Split:
    """x[i] holds i, so batches show which examples they carry."""
    y = torch.arange(n, dtype=torch.int64)
    return Split(x=y.to(torch.float32)[:, None, None].expand(n, 2, 3).contiguous(), y=y)


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("batch_size", [1, 7, 23, 100])
def test_iterate_batches_covers_each_example_once(shuffle, batch_size):
    n = 23
    split = _indexed_split(n)
    batches = list(iterate_batches(split, batch_size, shuffle=shuffle, generator=_gen()))
    assert len(batches) == n_batches(n, batch_size)
    seen = torch.cat([y for _, y in batches])
    assert sorted(seen.tolist()) == list(range(n))
    for x, y in batches:
        assert torch.equal(x[:, 0, 0].long(), y)  # inputs stay with their labels
    if not shuffle:
        assert seen.tolist() == list(range(n))


@pytest.mark.parametrize("batch_size", [4, 5, 23, 30])
def test_iterate_batches_drop_last(batch_size):
    n = 23
    batches = list(
        iterate_batches(
            _indexed_split(n), batch_size, shuffle=True, generator=_gen(), drop_last=True
        )
    )
    assert len(batches) == n_batches(n, batch_size, drop_last=True) == n // batch_size
    assert all(len(y) == batch_size for _, y in batches)
    seen = torch.cat([y for _, y in batches]).tolist() if batches else []
    assert len(set(seen)) == len(seen) == (n // batch_size) * batch_size


def test_iterate_batches_deterministic_per_generator_state():
    split = _indexed_split(50)

    def epoch(generator):
        return torch.cat(
            [y for _, y in iterate_batches(split, 8, shuffle=True, generator=generator)]
        )

    g1, g2 = _gen(9), _gen(9)
    first = epoch(g1)
    assert torch.equal(epoch(g2), first)
    assert not torch.equal(first, torch.arange(50))
    assert not torch.equal(epoch(g1), first)  # the next epoch draws a new order
    # The order is a function of the generator state alone.
    assert torch.equal(epoch(g1), epoch(_gen_after(9, epochs=2)))


def _gen_after(seed: int, epochs: int, n: int = 50) -> torch.Generator:
    """A generator advanced as if `epochs` shuffled epochs of n examples had been drawn."""
    g = _gen(seed)
    for _ in range(epochs):
        torch.randperm(n, generator=g)
    return g


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"batch_size": 0, "shuffle": False, "generator": None}, r"batch_size.*>= 1, got 0"),
        ({"batch_size": 2.0, "shuffle": False, "generator": None}, r"batch_size.*got 2\.0"),
        ({"batch_size": 4, "shuffle": True, "generator": None}, r"shuffle=True needs a"),
    ],
    ids=["zero", "float", "no-generator"],
)
def test_iterate_batches_errors_at_call(kwargs, pattern):
    with pytest.raises(DataError, match=pattern):
        iterate_batches(_indexed_split(5), **kwargs)  # raised at the call, before iteration


def test_a_data_directory_that_is_a_file_is_refused(tmp_path, monkeypatch):
    # It was accepted with a cache warning and MNIST-1D regenerated on every run.
    from lab.data import DataError, load_dataset

    afile = tmp_path / "data.txt"
    afile.write_text("not a directory")
    with pytest.raises(DataError, match=rf"^the data directory {afile} \(data_dir\) is a file, "
                                        r"not a directory; give the directory mnist1d is"):
        load_dataset("mnist1d", data_dir=afile)
    monkeypatch.setenv("LAB_DATA_DIR", str(afile))
    with pytest.raises(DataError, match=r"\(\$LAB_DATA_DIR\) is a file"):
        load_dataset("mnist1d")
    assert len(load_dataset("digits").train.y) > 0  # bundled: the directory is never read
