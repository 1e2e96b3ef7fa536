"""Atomic per-epoch checkpoints that refuse to resume a different config."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..records import atomic_write


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed: unreadable, or from another config."""


def save_checkpoint(path: Path, state: dict) -> None:
    """Write to a temp file beside ``path`` and rename: a kill leaves the old one whole."""
    atomic_write(Path(path), lambda tmp: _save_synced(state, tmp))


def _save_synced(state: dict, tmp: Path) -> None:
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())  # on disk before the rename makes it the checkpoint


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
