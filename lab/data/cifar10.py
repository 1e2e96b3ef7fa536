"""CIFAR-10 (Krizhevsky 2009, "Learning multiple layers of features from tiny images") read from a
local copy of the official python version, ``cifar-10-batches-py``.

That directory holds ``data_batch_1`` .. ``data_batch_5`` (training) and ``test_batch``, each a
pickled dict with b"data", a uint8 array (n, 3072) of 32x32 RGB images stored channel-major, and
b"labels", n ints in 0..9; ``batches.meta`` carries the class names. Only numpy is used
(torchvision cannot sit beside the CPU torch build). The unpickler accepts only the few numpy
globals these files contain, so a stray pickle cannot run code. Every fault is reported as one
DataError naming the file and what was expected.

`write_fake_cifar10` writes a small random file set in the same format for tests.
"""

from __future__ import annotations

import codecs
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from lab.data import DataError

__all__ = [
    "BATCH_DIR",
    "CLASS_NAMES",
    "DATA_BATCHES",
    "TEST_BATCH",
    "fit_scaler",
    "find_batch_dir",
    "load_arrays",
    "read_batch",
    "write_fake_cifar10",
]

BATCH_DIR = "cifar-10-batches-py"
DATA_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_BATCH = "test_batch"
META = "batches.meta"
CLASS_NAMES = (
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
)
N_CLASSES = 10
IMAGE_SHAPE = (3, 32, 32)
ROW_SIZE = 3 * 32 * 32

_EXPECTED = (
    f"the official CIFAR-10 python version '{BATCH_DIR}' "
    f"(data_batch_1..5 and {TEST_BATCH}), given either as that directory "
    "or as its parent"
)
_WHERE = " (pass data_dir= to load_dataset, or set LAB_DATA_DIR)."


def load_arrays(data_dir: Path) -> tuple[np.ndarray, ...]:
    """(x_train (N, 3, 32, 32) uint8, y_train (N,) int64, x_test, y_test) from `data_dir`."""
    batch_dir = find_batch_dir(data_dir)
    train = [read_batch(batch_dir / name) for name in DATA_BATCHES]
    x_test, y_test = read_batch(batch_dir / TEST_BATCH)
    x_train = np.concatenate([x for x, _ in train])
    y_train = np.concatenate([y for _, y in train])
    return x_train, y_train, x_test, y_test


def fit_scaler(x_train: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """Per-channel standardisation with the mean/std of `x_train` (N, 3, H, W) uint8."""
    mean, std = _channel_stats(x_train)
    mean32 = mean.astype(np.float32)[None, :, None, None]
    inv_std32 = (1.0 / std).astype(np.float32)[None, :, None, None]

    def to_float(x: np.ndarray) -> np.ndarray:
        out = x.astype(np.float32)  # (N, 3, 32, 32)
        out -= mean32
        out *= inv_std32
        return out

    return to_float


def _channel_stats(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Exact per-channel mean and std of uint8 images via value histograms.

    Histograms avoid a float64 copy of the whole training set (~1 GB for CIFAR-10).
    """
    values = np.arange(256, dtype=np.float64)
    mean = np.empty(x.shape[1])
    std = np.empty(x.shape[1])
    for c in range(x.shape[1]):
        counts = np.bincount(x[:, c].ravel(), minlength=256).astype(np.float64)
        total = counts.sum()
        if total == 0:
            mean[c], std[c] = 0.0, 1.0
            continue
        mean[c] = counts @ values / total
        var = counts @ (values - mean[c]) ** 2 / total
        std[c] = np.sqrt(var) if var > 0 else 1.0  # a constant channel is left unscaled
    return mean, std


def find_batch_dir(data_dir: Path | str) -> Path:
    """The directory holding the batches: `data_dir` itself or ``data_dir/cifar-10-batches-py``."""
    root = Path(data_dir).expanduser()
    nested = root / BATCH_DIR
    batch_dir = nested if nested.is_dir() else root
    if not batch_dir.is_dir():
        raise DataError(f"CIFAR-10 directory not found: {root}. Expected {_EXPECTED}{_WHERE}")
    expected = (*DATA_BATCHES, TEST_BATCH)
    missing = [name for name in expected if not (batch_dir / name).is_file()]
    if batch_dir == root and len(missing) == len(expected):
        raise DataError(
            f"no CIFAR-10 batch files in {root} and no '{BATCH_DIR}' inside it. "
            f"Expected {_EXPECTED}{_WHERE}"
        )
    if missing:
        paths = ", ".join(str(batch_dir / name) for name in missing)
        raise DataError(f"CIFAR-10 batch file(s) missing: {paths}. Expected {_EXPECTED}.")
    return batch_dir


def read_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One batch file as (x (n, 3, 32, 32) uint8, y (n,) int64), validated."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"CIFAR-10 batch file missing: {path}. Expected {_EXPECTED}.")
    batch = _unpickle(path)
    if not isinstance(batch, dict):
        raise DataError(
            f"CIFAR-10 batch {path} holds a {type(batch).__name__}; expected a dict with keys "
            "b'data' and b'labels'"
        )
    missing = [repr(key) for key in (b"data", b"labels") if key not in batch]
    if missing:
        found = ", ".join(repr(k) for k in list(batch)[:8])
        raise DataError(
            f"CIFAR-10 batch {path} lacks key(s) {', '.join(missing)}; expected b'data' and "
            f"b'labels' (found: {found or 'no keys'})"
        )
    x = _check_data(path, batch[b"data"])
    y = _check_labels(path, batch[b"labels"], n=x.shape[0])
    return x.reshape(-1, *IMAGE_SHAPE), y  # rows are channel-major: R plane, G plane, B plane


def _check_data(path: Path, data: Any) -> np.ndarray:
    if not isinstance(data, np.ndarray):
        raise DataError(
            f"CIFAR-10 batch {path}: b'data' is a {type(data).__name__}; "
            f"expected a numpy array of shape (n, {ROW_SIZE}) and dtype uint8"
        )
    if data.ndim != 2 or data.shape[1] != ROW_SIZE or data.dtype != np.uint8:
        raise DataError(
            f"CIFAR-10 batch {path}: b'data' has shape {data.shape} and dtype {data.dtype}; "
            f"expected shape (n, {ROW_SIZE}) and dtype uint8"
        )
    if len(data) == 0:
        raise DataError(f"CIFAR-10 batch {path}: b'data' holds 0 images; expected at least "
                        f"1 (shape (n, {ROW_SIZE}), n >= 1)")
    return data


def _check_labels(path: Path, labels: Any, n: int) -> np.ndarray:
    try:
        y = np.asarray(labels)
    except (TypeError, ValueError):  # ragged or otherwise not array-like
        y = np.asarray([], dtype=object)
    if y.ndim != 1 or (y.size and y.dtype.kind not in "iu"):
        raise DataError(
            f"CIFAR-10 batch {path}: b'labels' must be a flat list of ints in 0..{N_CLASSES - 1}, "
            f"got {type(labels).__name__} with dtype {y.dtype} and shape {y.shape}"
        )
    if len(y) != n:
        raise DataError(
            f"CIFAR-10 batch {path}: {len(y)} labels for {n} images in b'data'; "
            "expected one label per image"
        )
    bad = (y < 0) | (y >= N_CLASSES)
    if bad.any():
        first = int(np.flatnonzero(bad)[0])
        raise DataError(
            f"CIFAR-10 batch {path}: labels outside 0..{N_CLASSES - 1}, "
            f"e.g. {int(y[first])} at index {first} ({int(bad.sum())} in all)"
        )
    return y.astype(np.int64)


class _ForeignObject(pickle.UnpicklingError):
    """The pickle names a global that no CIFAR-10 batch contains."""


class _BatchUnpickler(pickle.Unpickler):
    """Resolves only the globals that pickled numpy arrays (and py2 bytes) need."""

    _reconstruct = np.ndarray.__reduce__(np.zeros(1))[0]
    _scalar = np.float64(0).__reduce__()[0]
    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
        ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
        ("numpy.core.multiarray", "scalar"): _scalar,
        ("numpy._core.multiarray", "scalar"): _scalar,
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
        ("_codecs", "encode"): codecs.encode,  # how protocol-2 pickles from python 3 hold bytes
        ("__builtin__", "bytes"): bytes,  # ... and empty bytes (an array of 0 images)
        ("builtins", "bytes"): bytes,
    }

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._ALLOWED[(module, name)]
        except KeyError:
            raise _ForeignObject(f"{module}.{name}") from None


def _unpickle(path: Path) -> Any:
    try:
        with open(path, "rb") as f:
            return _BatchUnpickler(f, encoding="bytes").load()
    except OSError as exc:
        raise DataError(f"cannot read CIFAR-10 batch {path}: {exc.strerror or exc}") from None
    except _ForeignObject as exc:
        raise DataError(
            f"CIFAR-10 batch {path} refers to {exc}, which no CIFAR-10 batch contains; expected "
            "a pickled dict of numpy data and labels. Not loaded: unpickling it could run code"
        ) from None
    except Exception as exc:  # a damaged pickle can fail with almost any exception type
        raise DataError(
            f"CIFAR-10 batch {path} is truncated or corrupt ({type(exc).__name__}: {exc}); "
            "expected a pickled dict as in the official python version; re-extract "
            "cifar-10-python.tar.gz"
        ) from None


def write_fake_cifar10(path: Path | str, n_per_batch: int = 20, seed: int = 0) -> Path:
    """Write random images in the official format under ``path/cifar-10-batches-py``.

    Five data batches and a test batch of `n_per_batch` images each, plus ``batches.meta``.
    Returns the batch directory; `load_dataset("cifar10", data_dir=...)` accepts it or `path`.
    """
    rng = np.random.default_rng(seed)
    batch_dir = Path(path) / BATCH_DIR
    batch_dir.mkdir(parents=True, exist_ok=True)
    for name in (*DATA_BATCHES, TEST_BATCH):
        batch = {
            b"batch_label": f"fake {name}".encode(),
            b"labels": [int(v) for v in rng.integers(0, N_CLASSES, n_per_batch)],
            b"data": rng.integers(0, 256, (n_per_batch, ROW_SIZE), dtype=np.uint8),
            b"filenames": [f"fake_{name}_{i}.png".encode() for i in range(n_per_batch)],
        }
        _dump(batch_dir / name, batch)
    meta = {
        b"label_names": [c.encode() for c in CLASS_NAMES],
        b"num_cases_per_batch": n_per_batch,
        b"num_vis": ROW_SIZE,
    }
    _dump(batch_dir / META, meta)
    return batch_dir


def _dump(path: Path, obj: Any) -> None:
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=2)  # protocol 2, as the official (python 2) files
