"""Atomic per-epoch checkpoints that refuse to resume a different config."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed: unreadable, or from another config."""


def save_checkpoint(path: Path, state: dict) -> None:
    """Write to a temp file beside ``path`` and rename: a kill leaves the old one whole."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_checkpoint(path: Path, config: dict) -> dict:
    """Load ``path``; its config must equal ``config`` key for key."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for a damaged file
        raise CheckpointError(f"checkpoint {path} cannot be read ({type(exc).__name__}: "
                              f"{exc}); delete it to start the run afresh") from None
    saved = state.get("config", {})
    differ = sorted(k for k in set(saved) | set(config) if saved.get(k) != config.get(k))
    if differ:
        detail = ", ".join(f"{k}: {saved.get(k)!r} there vs {config.get(k)!r} now" for k in differ)
        raise CheckpointError(f"checkpoint {path} was written by a different config ({detail}); "
                              "use another output directory or delete the checkpoint")
    return state
