"""Device, thread and allocator settings shared by every trainer."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import platform
import warnings

import torch

from .config import ConfigError

DEVICES = ("auto", "cpu", "cuda")
# Threads beyond this many per usable core are refused at run start (more than the
# cores is only slower, and warns; this far beyond them the run stalls).
MAX_THREADS_PER_CORE = 4


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


def check_threads(threads: int) -> None:
    """ConfigError when ``threads`` is more than ``MAX_THREADS_PER_CORE`` times the
    cores this process may use: part of every trainer's preflight (before a kernel
    starts or a run directory is made) and of :func:`set_threads`."""
    from .sweep import usable_cores

    cores = usable_cores()
    if threads > MAX_THREADS_PER_CORE * cores:
        # Refused at run start, not in the config: a record written on a big machine must
        # still load on a laptop. Far beyond the cores, the thread pools spend the run on
        # setup and contention (1000 threads on 2 cores: no step in ten minutes), which
        # looks like a hang rather than an error.
        raise ConfigError(
            f"threads={threads} is more than {MAX_THREADS_PER_CORE} x the {cores} core(s) "
            f"this process may use (at most {MAX_THREADS_PER_CORE * cores} allowed here): "
            f"so many threads would stall the run; use threads={cores} (or 0, torch's "
            "default)")


def set_threads(threads: int) -> int:
    """0 keeps torch's default; returns the thread count in force.

    More threads than usable cores warns; more than ``MAX_THREADS_PER_CORE`` times
    the cores raises ConfigError.

    Numba's parallel kernels (``numba_kernels``) get the same count, so the two
    thread pools do not oversubscribe the cores (thread-local: call it in the
    thread that trains).
    """
    if threads > 0:
        import numba

        from .sweep import usable_cores  # (torch-free, so `lab runs` stays quick)

        cores = usable_cores()
        check_threads(threads)
        if threads > cores:
            # Not refused: a config may be written on one machine and run on a larger one.
            warnings.warn(f"threads={threads} is more than the {cores} core(s) this process "
                          "may use: the threads will share the cores and the run will be "
                          f"slower; threads={cores} (or 0, torch's default) fits this machine",
                          stacklevel=2)

        # Numba first: its first call starts its OpenMP pool (a second libgomp), and
        # torch's thread count read after that start would not be the one set before.
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def memory_bytes() -> int | None:
    """This machine's memory in bytes, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_fits(owner: str, need: int, what: str, advice: str) -> None:
    """ConfigError if ``need`` bytes (a lower bound: weights and their optimizer state,
    the activations a step must hold) exceed this machine's memory. Found before a run
    starts: a model that cannot fit otherwise dies in torch's allocator after the kernel
    started ("can't allocate memory: you tried to allocate 452998790643712 bytes"), or
    hangs while it is built, leaving a failed run behind."""
    memory = memory_bytes()
    if memory is not None and need > memory:
        raise ConfigError(f"{owner}: {what} need at least {need / 2**30:.3g} GiB, more than "
                          f"this machine's {memory / 2**30:.3g} GiB; {advice}")


# glibc's mallopt parameters (malloc.h) and the largest mmap threshold it accepts.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_MAX = 32 << 20


def keep_freed_memory() -> bool:
    """Let glibc's malloc keep freed blocks for reuse instead of returning them to the OS.

    A training step allocates and frees the same few-megabyte tensors every
    step. By default glibc serves large blocks with fresh ``mmap``s and trims
    freed heap, so each step touches new pages: on a virtual machine a page
    fault costs microseconds, and a step of the 2-D ResNet-20 at batch 128 can
    spend tens of milliseconds faulting, more for rules that allocate more, which
    would bill allocator noise as compute. With blocks up to 32 MiB on the heap and
    no trimming, the process keeps its high-water mark and reuses it (the effect
    PyTorch's CPU tuning guide gets from jemalloc or tcmalloc). Every trainer
    calls this through ``configure_process``; benchmarks too, so they time what
    runs do. Returns whether it applied (glibc only; elsewhere a no-op).
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)
                and libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30))


def keeps_threads(train):
    """Decorate a trainer so that torch's and numba's thread counts are, after the call,
    what they were before it (returned, raised or interrupted).

    A run sets both to its ``threads``; left so, a Jupyter session that trained one run
    at ``threads=1`` ran everything after it on one thread, and a later run with
    ``threads=0`` (the process's count) took 1 from it, not the machine's cores.
    """
    @functools.wraps(train)
    def wrapper(*args, **kwargs):
        import numba

        import numba_kernels

        before = torch.get_num_threads()
        numba_kernels.start_pool()  # (reading numba's count would start it, resetting torch's)
        numba_before = numba.get_num_threads()
        try:
            return train(*args, **kwargs)
        finally:
            numba.set_num_threads(numba_before)
            torch.set_num_threads(before)

    return wrapper


def configure_process(threads: int) -> int:
    """What every run sets before training: thread counts and the allocator policy."""
    keep_freed_memory()
    return set_threads(threads)


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
