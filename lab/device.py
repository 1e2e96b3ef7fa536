"""Device and thread selection shared by every trainer."""

from __future__ import annotations

import contextlib

import torch

from .config import ConfigError

DEVICES = ("auto", "cpu", "cuda")


def resolve_device(name: str) -> torch.device:
    """'auto' -> CUDA when available, else CPU; asking for absent CUDA is an error."""
    if name not in DEVICES:
        raise ConfigError(f"device={name!r} is not allowed; choose one of: {', '.join(DEVICES)}")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' was asked for but torch sees no CUDA device; "
                          "use device='cpu' or 'auto'")
    return torch.device(name)


def set_threads(threads: int) -> int:
    """0 keeps torch's default; returns the thread count in force.

    Numba's parallel kernels (``numba_kernels``) get the same count, so the two
    thread pools do not oversubscribe the cores (thread-local: call it in the
    thread that trains).
    """
    if threads > 0:
        torch.set_num_threads(threads)
        import numba

        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    return torch.get_num_threads()


@contextlib.contextmanager
def seeded(seed: int):
    """Run a block under torch's global RNG seeded with ``seed``, restoring it after.

    nn.Module initialisers draw from the global generator; forking keeps that
    draw reproducible without leaking the reseeding into the caller.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def sync(device: torch.device) -> None:
    """Wait for queued kernels, so wall-clock timings measure the work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
