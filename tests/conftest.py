"""Shared fixtures: a tiny conv config and an isolated data cache."""

from __future__ import annotations

import os

import pytest

# One data cache for the whole session, so MNIST-1D is generated once.
os.environ.setdefault("LAB_DATA_DIR", os.path.join(os.path.dirname(__file__), "..", "data"))


@pytest.fixture
def train_steps(monkeypatch):
    """``train_steps(module, stop_at=None, delay=0.0)``: ``module.train_step`` raising
    KeyboardInterrupt at step ``stop_at`` (a kill mid-run) and ``delay`` seconds slower
    per step; call again (without ``stop_at``) to resume. For the trainers' resume tests."""
    import time

    real = {}

    def patch(module, stop_at=None, delay=0.0):
        step_fn = real.setdefault(module, module.train_step)

        def step(run, index):
            if index == stop_at:
                raise KeyboardInterrupt
            time.sleep(delay)
            return step_fn(run, index)

        monkeypatch.setattr(module, "train_step", step)

    return patch


@pytest.fixture
def tiny():
    """Keyword arguments for a conv run that takes about a second."""
    return dict(dataset="mnist1d", n_train=256, depth=8, width=4, epochs=3, batch_size=64,
                progress=False, eval_batch_size=500)
