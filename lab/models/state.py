"""Context managers over model state that diagnostics and probes must not change."""

from __future__ import annotations

import contextlib

import torch.nn as nn


@contextlib.contextmanager
def preserved_norm_stats(model: nn.Module):
    """Train-mode passes inside use batch statistics and leave running statistics alone.

    Turning off ``track_running_stats`` (rather than restoring a copy afterwards)
    matters: a graph built before may have saved the running buffers for its
    backward pass, and an in-place update would invalidate it.
    """
    norms = [m for m in model.modules()
             if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    try:
        for m in norms:
            m.track_running_stats = False
        yield
    finally:
        for m in norms:
            m.track_running_stats = True
