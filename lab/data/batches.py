"""Mini-batches over a Split, in order or in a reproducible shuffled order.

The permutation comes from the caller's torch.Generator only (never the global RNG), so one seed
fixes the data order of a run. It is drawn on the generator's device and moved to the data's, so
a CPU generator gives the same order for data on the CPU or a GPU.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from lab.data import DataError, Split

__all__ = ["iterate_batches", "n_batches"]

Batch = tuple[torch.Tensor, torch.Tensor]  # (x, y)


def n_batches(n: int, batch_size: int, drop_last: bool = False) -> int:
    """How many batches `iterate_batches` yields for n examples."""
    return n // batch_size if drop_last else -(-n // batch_size)


def iterate_batches(
    split: Split,
    batch_size: int,
    *,
    shuffle: bool,
    generator: torch.Generator | None,
    drop_last: bool = False,
) -> Iterator[Batch]:
    """Yield (x, y) batches of `split`, each example once per pass.

    shuffle=False yields contiguous slices (views, no copy); shuffle=True indexes with
    ``torch.randperm(n, generator=generator)`` and needs a generator. drop_last drops a final
    batch smaller than batch_size. Arguments are checked, and the permutation drawn, at the
    call rather than at the first batch.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise DataError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    if shuffle and generator is None:
        raise DataError(
            "shuffle=True needs a torch.Generator: the global RNG would make the data order "
            "depend on everything else that draws from it"
        )
    n = split.x.shape[0]
    stop = n - n % batch_size if drop_last else n
    if not shuffle:
        return _slices(split, batch_size, stop)
    # Drawn now, not at the first next(): the order is fixed by the generator state at the call.
    perm = torch.randperm(n, generator=generator, device=generator.device)
    return _gathers(split, perm, batch_size, stop)


def _slices(split: Split, batch_size: int, stop: int) -> Iterator[Batch]:
    for start in range(0, stop, batch_size):
        yield split.x[start : start + batch_size], split.y[start : start + batch_size]


def _gathers(split: Split, perm: torch.Tensor, batch_size: int, stop: int) -> Iterator[Batch]:
    perm_x, perm_y = perm.to(split.x.device), perm.to(split.y.device)
    for start in range(0, stop, batch_size):
        end = start + batch_size
        yield split.x[perm_x[start:end]], split.y[perm_y[start:end]]
