"""Offline datasets for the credit-assignment experiments, behind one loader.

`load_dataset(name)` returns a `Dataset` of CPU tensors: train / val / test splits, inputs
standardised per dataset, labels int64. Three datasets, all usable without a network:

- ``mnist1d``: MNIST-1D, generated procedurally (Greydanus 2020, "Scaling down deep learning").
- ``digits``: scikit-learn's bundled 8x8 handwritten digits.
- ``cifar10``: CIFAR-10 (Krizhevsky 2009) read from a local copy of the official python batches.

The validation split is carved out of the *training* set by a permutation drawn from
`split_seed`; the test split is never touched by it, so test numbers are comparable across seeds.
Per-dataset loading lives in the submodules; augmentation in `lab.data.augment`, mini-batching in
`lab.data.batches`.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

# The facts a config checks, torch-free; torch is imported where a split is made, so a
# config (lab.train.configs) can refuse a bad value without it.
from .specs import DATA_SPECS, DATASETS, DataError

if TYPE_CHECKING:
    import torch

__all__ = ["DATASETS", "DATA_SPECS", "DataError", "Dataset", "Split", "content_identity",
           "default_data_dir", "load_dataset", "sha256_bytes", "train_size"]

_MAX_VAL_FRACTION = 0.9


@dataclass(frozen=True)
class Split:
    """One split of a dataset: inputs `x` (float32) and labels `y` (int64), same first dim.

    Only the shared first dimension is checked, so other parts of `lab` may reuse the type.
    """

    x: torch.Tensor
    y: torch.Tensor

    def __post_init__(self) -> None:
        # Checked here so that a mismatch surfaces where the split is built, not in a trainer.
        if self.x.shape[0] != self.y.shape[0]:
            raise DataError(
                f"Split has {self.x.shape[0]} inputs but {self.y.shape[0]} labels; "
                "x and y must share their first dimension"
            )

    def __len__(self) -> int:
        return int(self.y.shape[0])


@dataclass(frozen=True)
class Dataset:
    """A loaded dataset. dims 1: x is (N, C, L); dims 2: x is (N, C, H, W)."""

    name: str
    train: Split
    val: Split
    test: Split
    in_channels: int
    n_classes: int
    dims: int
    augment: str  # the natural augmentation, a kind understood by lab.data.augment.augment
    # What identifies the data (``content_identity`` plus the split sizes): a run records
    # it, a resume on other data is refused, a finished run on changed data is stale.
    identity: dict | None = None


def default_data_dir() -> Path:
    """`$LAB_DATA_DIR` if set, else ``~/.cache/lab``."""
    return Path(os.environ.get("LAB_DATA_DIR") or Path.home() / ".cache" / "lab").expanduser()


def load_dataset(
    name: str,
    *,
    data_dir: str | os.PathLike[str] | None = None,
    val_fraction: float = 0.1,
    split_seed: int = 0,
    n_train: int = 0,
) -> Dataset:
    """Load `name` (one of DATASETS) as CPU tensors with a validation split held out of train.

    val_fraction: share of the training set held out as validation, in [0, 0.9]; 0 gives an
        empty val split with the right trailing shape.
    split_seed: seeds the (local) permutation that picks the validation examples.
    n_train: if > 0, keep only the first n_train training examples after the split (for tiny
        runs); a value above the number available is refused (DataError naming the count),
        since a record saying n_train=100000 must not describe a run on 3,600 examples.
    """
    if name not in DATA_SPECS:
        raise DataError(f"unknown dataset {name!r}; known datasets: {', '.join(DATASETS)}")
    _check_args(val_fraction, n_train)
    spec = DATA_SPECS[name]
    root = Path(data_dir).expanduser() if data_dir is not None else default_data_dir()
    if name != "digits" and root.exists() and not root.is_dir():  # digits is bundled
        where = "data_dir" if data_dir is not None else "$LAB_DATA_DIR"
        raise DataError(f"the data directory {root} ({where}) is a file, not a directory; "
                        f"give the directory {name} is (or is to be) cached in")

    x_train, y_train, x_test, y_test, scale = _load_raw(name, root)
    identity = _content(name, root, (x_train, y_train, x_test, y_test))
    # The input scale is fitted on the whole official training set, before the validation
    # holdout and the n_train cut: an example's values then depend neither on split_seed nor on
    # run size, and test tensors are identical across seeds. (The val examples inform only the
    # per-channel mean/std, a negligible leak.)
    to_float = scale(x_train)
    train_idx, val_idx = _val_split(len(y_train), val_fraction, split_seed, name)
    _check_n_train(name, n_train, len(train_idx), val_fraction)
    if n_train > 0:
        train_idx = train_idx[:n_train]

    return Dataset(
        name=name,
        train=_split(x_train[train_idx], y_train[train_idx], to_float),
        val=_split(x_train[val_idx], y_train[val_idx], to_float),
        test=_split(x_test, y_test, to_float),
        in_channels=spec.in_channels,
        n_classes=spec.n_classes,
        dims=spec.dims,
        augment=spec.augment,
        identity={**identity, "split": {"train": len(train_idx), "val": len(val_idx),
                                        "test": len(y_test)}},
    )


def sha256_bytes(data: bytes) -> str:
    """The sha256 (hex) of data held in memory: a source's identity when it has no file of
    its own to hash (the bundled text, the vega prices)."""
    return hashlib.sha256(data).hexdigest()


def _content(name: str, root: Path, arrays) -> dict:
    # The hash is of the arrays as read (before scaling), not of the files: MNIST-1D's
    # cache is rewritten with new zip timestamps whenever it is regenerated, and the
    # arrays are what a run learns from.
    digest = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        digest.update(f"{a.dtype.str}{a.shape};".encode())
        # (a view with a zero in its shape cannot be cast to bytes)
        digest.update(a.tobytes() if a.size == 0 else memoryview(a).cast("B"))
    return {"dataset": name, "dir": str(root.resolve()), "sha256": digest.hexdigest()}


def content_identity(name: str, data_dir) -> dict:
    """{"dataset", "dir" (absolute), "sha256" of the raw arrays} of ``name`` as read now
    from ``data_dir``; ``load_dataset`` records the same in ``Dataset.identity``. DataError
    if it cannot be read."""
    if name not in DATA_SPECS:
        raise DataError(f"unknown dataset {name!r}; known datasets: {', '.join(DATASETS)}")
    root = Path(data_dir).expanduser().resolve()
    return dict(_cached_content(name, root, _file_stamps(name, root)))


@functools.lru_cache(maxsize=16)
def _cached_content(name: str, root: Path, stamps: tuple) -> tuple:
    # Keyed by the files' (path, size, mtime): a sweep's stale check over many runs of one
    # dataset reads it once, and a file changed since is read again.
    del stamps
    return tuple(_content(name, root, _load_raw(name, root)[:4]).items())


def _file_stamps(name: str, root: Path) -> tuple:
    # (the per-dataset modules lazily, as in _load_raw)
    if name == "mnist1d":
        from lab.data.mnist1d import cache_path
        files = [cache_path(root)]
    elif name == "cifar10":
        from lab.data.cifar10 import DATA_BATCHES, TEST_BATCH, find_batch_dir
        try:
            batch_dir = find_batch_dir(root)
        except DataError:
            return ()
        files = [batch_dir / f for f in (*DATA_BATCHES, TEST_BATCH)]
    else:  # digits: bundled with scikit-learn
        files = []
    stamps = []
    for f in files:
        try:
            st = f.stat()
        except OSError:
            continue
        stamps.append((str(f), st.st_size, st.st_mtime_ns))
    return tuple(stamps)


def _check_args(val_fraction: float, n_train: int) -> None:
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)):
        raise DataError(
            f"val_fraction must be a number in [0, {_MAX_VAL_FRACTION}], got {val_fraction!r}"
        )
    if not (0.0 <= val_fraction <= _MAX_VAL_FRACTION):  # also rejects NaN
        raise DataError(
            f"val_fraction={val_fraction!r} is out of range; allowed: [0, {_MAX_VAL_FRACTION}] "
            "(the share of the training set held out as validation)"
        )
    if isinstance(n_train, bool) or not isinstance(n_train, (int, np.integer)):
        raise DataError(f"n_train must be an integer >= 0 (0 = all), got {n_train!r}")
    if n_train < 0:
        raise DataError(f"n_train={n_train} is negative; allowed: an integer >= 0 (0 = all)")


def _check_n_train(name: str, n_train: int, available: int, val_fraction: float) -> None:
    # A record saying n_train=100000 must not describe a run on 3,600 examples.
    if n_train > available:
        raise DataError(
            f"n_train={n_train} but {name} has only {available} training examples "
            f"available (after holding out val_fraction={val_fraction} for validation); "
            f"allowed: 0 (all of them) or 1 to {available}"
        )


@functools.lru_cache(maxsize=16)
def _official_train_size(name: str, root: Path) -> int:
    if name == "mnist1d":  # without generating it, or writing its cache
        from lab.data import mnist1d

        return mnist1d.train_count(root)
    return len(_load_raw(name, root)[1])


def train_size(name: str, *, data_dir=None, val_fraction: float = 0.1, n_train: int = 0) -> int:
    """How many training examples ``load_dataset`` with these arguments gives, or the
    DataError it would raise: the check a run makes before it starts (sizes cached
    per process, so a sweep's pre-check loads each dataset once)."""
    if name not in DATA_SPECS:
        raise DataError(f"unknown dataset {name!r}; known datasets: {', '.join(DATASETS)}")
    _check_args(val_fraction, n_train)
    root = Path(data_dir).expanduser() if data_dir is not None else default_data_dir()
    if name != "digits" and root.exists() and not root.is_dir():  # digits is bundled
        where = "data_dir" if data_dir is not None else "$LAB_DATA_DIR"
        raise DataError(f"the data directory {root} ({where}) is a file, not a directory; "
                        f"give the directory {name} is (or is to be) cached in")
    n = _official_train_size(name, root)
    available = n - int(math.floor(val_fraction * n + 0.5))  # as _val_split holds out
    if available < 1:
        raise DataError(f"{name}: val_fraction={val_fraction} of {n} training examples leaves "
                        "no training examples; lower val_fraction or provide more data")
    _check_n_train(name, n_train, available, val_fraction)
    return n_train or available


def _load_raw(name: str, root: Path):
    """(x_train, y_train, x_test, y_test, scale) as numpy arrays plus the dataset's scaler.

    Imported lazily so that `import lab.data` needs none of the per-dataset dependencies.
    """
    if name == "mnist1d":
        from lab.data import mnist1d as module
    elif name == "digits":
        from lab.data import digits as module
    else:
        from lab.data import cifar10 as module
    x_train, y_train, x_test, y_test = module.load_arrays(root)
    return x_train, y_train, x_test, y_test, module.fit_scaler


def _val_split(n: int, val_fraction: float, seed: int, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Index arrays (train, val), each in ascending order, from a permutation seeded by `seed`."""
    n_val = int(math.floor(val_fraction * n + 0.5))
    if n - n_val < 1:
        raise DataError(
            f"{name}: val_fraction={val_fraction} of {n} training examples leaves no training "
            "examples; lower val_fraction or provide more data"
        )
    import torch

    # A local generator: the split must neither depend on nor disturb the global torch RNG.
    generator = torch.Generator().manual_seed(int(seed))
    perm = torch.randperm(n, generator=generator).numpy()
    # Sorted, so the split is a set: the training order is the data's, shuffling is the batcher's.
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


def _split(x: np.ndarray, y: np.ndarray, to_float) -> Split:
    import torch

    x_t = torch.from_numpy(np.ascontiguousarray(to_float(x), dtype=np.float32))
    y_t = torch.from_numpy(np.ascontiguousarray(y, dtype=np.int64))
    return Split(x=x_t, y=y_t)
