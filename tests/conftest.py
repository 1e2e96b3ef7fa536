"""Shared fixtures: a tiny conv config and an isolated data cache."""

from __future__ import annotations

import os

import pytest

# One data cache for the whole session, so MNIST-1D is generated once.
os.environ.setdefault("LAB_DATA_DIR", os.path.join(os.path.dirname(__file__), "..", "data"))


@pytest.fixture
def slow_steps(monkeypatch):
    """``slow_steps(module, stop_at=None)``: ``module.train_step`` made 0.1 s slower per
    step, raising KeyboardInterrupt at step ``stop_at`` (a kill mid-run); call again to
    resume at the same pace. For the wall-time-across-sessions tests of each trainer."""
    import time

    real = {}

    def patch(module, stop_at=None):
        step_fn = real.setdefault(module, module.train_step)

        def slow(run, step):
            if step == stop_at:
                raise KeyboardInterrupt
            time.sleep(0.1)
            return step_fn(run, step)

        monkeypatch.setattr(module, "train_step", slow)

    return patch


@pytest.fixture
def tiny():
    """Keyword arguments for a conv run that takes about a second."""
    return dict(dataset="mnist1d", n_train=256, depth=8, width=4, epochs=3, batch_size=64,
                progress=False, eval_batch_size=500)
