"""MNIST-1D: a procedurally generated 1-D analogue of MNIST (Greydanus 2020, "Scaling down deep
learning", arXiv:2011.14439).

The `mnist1d` package generates the dataset from ten hand-drawn templates with random padding,
shear, translation and noise. Only its generator is used here: `get_dataset`/download would reach
for the network. The package's default arguments give 4000 train / 1000 test signals of length
40 in 10 classes, already centred and scaled to unit standard deviation.

The generator reseeds Python's `random` and numpy's global generator, so every call is wrapped
to restore the caller's RNG states (torch's too, defensively) whatever happens. Generated arrays
are cached as ``<data_dir>/mnist1d/mnist1d_v<package version>_seed<seed>.npz``.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import random
import tempfile
import warnings
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from lab.data import DataError

__all__ = ["DEFAULT_SEED", "TRAIN_EXAMPLES", "cache_path", "fit_scaler", "generate",
           "load_arrays", "train_count"]

DEFAULT_SEED = 42  # the mnist1d package's own default, so our data matches the paper's
_KEYS = ("x_train", "y_train", "x_test", "y_test")

Arrays = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
# What generate() gives with the package defaults (a test holds the two together).
TRAIN_EXAMPLES = 4000
SIGNAL_LENGTH = 40
N_CLASSES = 10


def load_arrays(data_dir: Path, seed: int = DEFAULT_SEED) -> Arrays:
    """(x_train (N, 1, 40), y_train (N,), x_test, y_test), from the cache or freshly generated."""
    path = cache_path(data_dir, seed)
    arrays = _read_cache(path)
    if arrays is None:
        arrays = generate(seed)
        _write_cache(path, arrays)
    x_train, y_train, x_test, y_test = arrays
    return x_train[:, None, :], y_train, x_test[:, None, :], y_test  # (N, 1, L): one channel


def train_count(data_dir: Path, seed: int = DEFAULT_SEED) -> int:
    """How many training examples ``load_arrays`` gives, generating and writing nothing: the
    cache's count, else the generator's. A run's pre-check asks this, and a refused run
    must leave no cache (nor the directories for one) in a data_dir it was given."""
    # Checked as load_arrays checks it (a DataError names what is wrong); an unreadable
    # one is regenerated there, with a warning.
    arrays = _read_cache(cache_path(data_dir, seed))
    return len(arrays[1]) if arrays is not None else TRAIN_EXAMPLES


def fit_scaler(x_train: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """The generator already centres the data and scales it to unit std: only cast."""
    del x_train
    return lambda x: x.astype(np.float32)


def cache_path(data_dir: Path, seed: int = DEFAULT_SEED) -> Path:
    version = importlib.metadata.version("mnist1d")
    return Path(data_dir) / "mnist1d" / f"mnist1d_v{version}_seed{seed}.npz"


def generate(seed: int = DEFAULT_SEED) -> Arrays:
    """Generate (x_train (N, L), y_train, x_test, y_test) without touching the caller's RNGs."""
    try:
        from mnist1d.data import get_dataset_args, make_dataset
    except ImportError as exc:
        raise DataError(
            f"mnist1d needs the 'mnist1d' package (pip install mnist1d); import failed: {exc}"
        ) from None
    args = get_dataset_args()  # the package defaults: 5000 samples, 80 % train, length 40
    args.seed = int(seed)
    with _isolated_rngs():
        data = make_dataset(args)
    return (
        np.asarray(data["x"]),
        np.asarray(data["y"], dtype=np.int64),
        np.asarray(data["x_test"]),
        np.asarray(data["y_test"], dtype=np.int64),
    )


@contextlib.contextmanager
def _isolated_rngs() -> Iterator[None]:
    """Restore Python's, numpy's and torch's global RNG states on exit, even on error."""
    py_state = random.getstate()
    np_state = np.random.get_state()
    torch_state = torch.random.get_rng_state()
    try:
        yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.random.set_rng_state(torch_state)


def _read_cache(path: Path) -> Arrays | None:
    """The cached arrays, or None if absent; a damaged cache is reported and regenerated."""
    if not path.exists():
        return None
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = tuple(np.array(npz[key]) for key in _KEYS)
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
        # The cache is disposable: a damaged one must not block a run.
        warnings.warn(
            f"ignoring unreadable MNIST-1D cache {path} ({exc}); regenerating", stacklevel=3
        )
        return None
    problem = _problem(arrays)
    if problem:
        # Readable but not what the generator writes (edited, or another program's): not
        # overwritten, and not trained on (a label of 12 failed inside the loss; signals
        # cut to 30 samples trained and tested on other lengths without a word).
        raise DataError(f"MNIST-1D cache {path}: {problem}; delete the file and it is "
                        "generated afresh (it holds the mnist1d generator's arrays)")
    return arrays


def _problem(arrays: Arrays) -> str | None:
    """What is wrong with cached arrays, or None: shapes, dtypes, label range, finiteness."""
    for split, x, y in (("train", *arrays[:2]), ("test", *arrays[2:])):
        if x.ndim != 2 or x.shape[1] != SIGNAL_LENGTH or len(x) == 0:
            return (f"x_{split} has shape {x.shape}; expected (examples >= 1, "
                    f"{SIGNAL_LENGTH})")
        if x.dtype.kind != "f":
            return f"x_{split} has dtype {x.dtype}; expected floats"
        if not np.isfinite(x).all():
            where = tuple(int(i) for i in np.argwhere(~np.isfinite(x))[0])
            return f"x_{split} holds {x[where]} at index {where}; expected finite values"
        if y.shape != (len(x),):
            return f"y_{split} has shape {y.shape} for {len(x)} signals; expected ({len(x)},)"
        if y.dtype.kind not in "iu":
            return f"y_{split} has dtype {y.dtype}; expected integer class labels"
        bad = np.flatnonzero((y < 0) | (y >= N_CLASSES))
        if len(bad):
            return (f"y_{split} holds label {y[bad[0]]} at index {bad[0]}; expected 0 to "
                    f"{N_CLASSES - 1}")
    return None


def _write_cache(path: Path, arrays: Arrays) -> None:
    """Write atomically (temp file + os.replace) so a concurrent reader never sees half a file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        # A read-only data dir costs regeneration next time, nothing more.
        warnings.warn(f"could not cache MNIST-1D at {path}: {exc}", stacklevel=3)
        return
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **dict(zip(_KEYS, arrays, strict=True)))
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache may be shared
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if not isinstance(exc, OSError):
            raise
        warnings.warn(f"could not cache MNIST-1D at {path}: {exc}", stacklevel=3)
