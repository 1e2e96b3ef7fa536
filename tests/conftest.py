"""Shared fixtures: a tiny conv config and an isolated data cache."""

from __future__ import annotations

import os

import pytest

# One data cache for the whole session, so MNIST-1D is generated once.
os.environ.setdefault("LAB_DATA_DIR", os.path.join(os.path.dirname(__file__), "..", "data"))


@pytest.fixture
def tiny():
    """Keyword arguments for a conv run that takes about a second."""
    return dict(dataset="mnist1d", n_train=256, depth=8, width=4, epochs=3, batch_size=64,
                progress=False, eval_batch_size=500)
