"""scikit-learn's bundled 8x8 handwritten digits (the UCI optical-recognition test set; ships
with sklearn, so it loads offline).

1797 grey images with pixel counts 0..16 in 10 classes. The dataset has no official test split,
so a fixed 20 % is set aside by a permutation with seed 0, independent of the caller's
`split_seed`: every run, whatever its seed, is scored on the same test images.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

__all__ = ["TEST_FRACTION", "fit_scaler", "load_arrays"]

TEST_FRACTION = 0.2
_TEST_SEED = 0
_MAX_PIXEL = 16.0  # pixel values are counts of set bits in 4x4 blocks: 0..16


def load_arrays(data_dir: Path | None = None) -> tuple[np.ndarray, ...]:
    """(x_train (N, 1, 8, 8), y_train (N,), x_test, y_test) as raw pixel counts."""
    del data_dir  # bundled with sklearn; nothing to read from disk
    from sklearn.datasets import load_digits  # scikit-learn is slow to import: only here

    bunch = load_digits()
    x = np.asarray(bunch.images, dtype=np.float64)[:, None, :, :]  # (N, 1, 8, 8)
    y = np.asarray(bunch.target, dtype=np.int64)
    train_idx, test_idx = _fixed_test_split(len(y))
    return x[train_idx], y[train_idx], x[test_idx], y[test_idx]


def fit_scaler(x_train: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """A fixed scale to [0, 1]; nothing is fitted, so train and test scale identically."""
    del x_train
    return lambda x: (x / _MAX_PIXEL).astype(np.float32)


def _fixed_test_split(n: int) -> tuple[np.ndarray, np.ndarray]:
    generator = torch.Generator().manual_seed(_TEST_SEED)
    perm = torch.randperm(n, generator=generator).numpy()
    n_test = int(round(TEST_FRACTION * n))
    return np.sort(perm[n_test:]), np.sort(perm[:n_test])
