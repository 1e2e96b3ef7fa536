"""Shared fixtures: a tiny conv config and an isolated data cache."""

from __future__ import annotations

import os

import pytest

# One data cache for the whole session, so MNIST-1D is generated once.
os.environ.setdefault("LAB_DATA_DIR", os.path.join(os.path.dirname(__file__), "..", "data"))

# Under pytest-xdist each worker takes its share of the cores, and so do the
# kernels and CLI processes its tests start (they inherit the variables): torch's
# default of one OpenMP thread per core in every worker put 4 spinning threads on
# 2 cores, and made small-op tests 5 - 10x slower than alone (the rrm test: 42 s
# in the suite, 3.6 s alone). Runs and sweeps that set `threads` still override it.
if os.environ.get("PYTEST_XDIST_WORKER"):
    _share = max(1, len(os.sched_getaffinity(0))
                 // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(_var, str(_share))
    import torch

    torch.set_num_threads(_share)


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
