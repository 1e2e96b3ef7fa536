"""Batch data augmentation on tensors, vectorised and reproducible from a torch.Generator.

- ``shift``: a random circular shift per example along the last axis, the natural augmentation
  for MNIST-1D (Greydanus 2020, "Scaling down deep learning"), whose signals are translated.
- ``crop_flip``: zero-pad, random crop back to size, and horizontal flip with p = 0.5, the
  standard CIFAR-10 augmentation (Krizhevsky 2009 data; e.g. He et al. 2016).
- ``none``: the input unchanged.

Random numbers are drawn on the generator's device and then moved to the data's device, so a
CPU generator gives the same choices whether the batch sits on the CPU or on a GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lab.data import DataError

__all__ = ["AUGMENTATIONS", "augment", "random_crop_flip", "random_shift"]

AUGMENTATIONS = ("shift", "crop_flip", "none")


def augment(x: torch.Tensor, kind: str, generator: torch.Generator) -> torch.Tensor:
    """Apply augmentation `kind` (one of AUGMENTATIONS) to the batch `x`."""
    if kind == "shift":
        return random_shift(x, generator)
    if kind == "crop_flip":
        return random_crop_flip(x, generator)
    if kind == "none":
        return x
    raise DataError(
        f"unknown augmentation {kind!r}; known augmentations: {', '.join(AUGMENTATIONS)}"
    )


def random_shift(
    x: torch.Tensor, generator: torch.Generator, max_shift: int | None = None
) -> torch.Tensor:
    """Roll each example of `x` (N, ..., L) circularly along its last axis by its own offset.

    max_shift None draws offsets uniformly from [0, L); an int k draws them from [-k, k].
    Row n of the result equals ``torch.roll(x[n], s_n, dims=-1)``.
    """
    if x.dim() < 2:
        raise DataError(f"random_shift expects a batch (N, ..., L), got shape {tuple(x.shape)}")
    n, length = x.shape[0], x.shape[-1]
    if max_shift is None:
        shifts = _randint(0, max(length, 1), n, generator, x.device)  # (N,)
    else:
        if isinstance(max_shift, bool) or not isinstance(max_shift, int) or max_shift < 0:
            raise DataError(f"max_shift must be None or an integer >= 0, got {max_shift!r}")
        shifts = _randint(-max_shift, max_shift + 1, n, generator, x.device)  # (N,)
    if length == 0:
        return x.clone()
    positions = torch.arange(length, device=x.device)  # (L,)
    # roll by s: out[j] = in[(j - s) mod L]
    source = (positions[None, :] - shifts[:, None]).remainder(length)  # (N, L)
    source = source.view(n, *([1] * (x.dim() - 2)), length).expand_as(x)  # (N, ..., L)
    return torch.gather(x, -1, source)


def random_crop_flip(x: torch.Tensor, generator: torch.Generator, padding: int = 4) -> torch.Tensor:
    """Random crop after zero padding, then a horizontal flip with p = 0.5, per image of x.

    x is (N, C, H, W); each image gets its own offsets in [0, 2 * padding] and its own flip.
    """
    if x.dim() != 4:
        raise DataError(f"random_crop_flip expects images (N, C, H, W), got shape {tuple(x.shape)}")
    if isinstance(padding, bool) or not isinstance(padding, int) or padding < 0:
        raise DataError(f"padding must be an integer >= 0, got {padding!r}")
    n, c, h, w = x.shape
    # Drawn in a fixed order (rows, cols, flips) so results depend only on the generator state.
    top = _randint(0, 2 * padding + 1, n, generator, x.device)  # (N,)
    left = _randint(0, 2 * padding + 1, n, generator, x.device)  # (N,)
    flip = _rand(n, generator, x.device) < 0.5  # (N,)

    padded = F.pad(x, (padding, padding, padding, padding)) if padding else x  # (N, C, H+2p, W+2p)
    padded_w = w + 2 * padding
    rows = top[:, None] + torch.arange(h, device=x.device)  # (N, H)
    cols = torch.arange(w, device=x.device).expand(n, w)  # (N, W)
    cols = torch.where(flip[:, None], (w - 1) - cols, cols) + left[:, None]  # (N, W)
    # One gather over the flattened padded plane: index = row * padded width + col.
    flat_index = (rows[:, :, None] * padded_w + cols[:, None, :]).view(n, 1, h * w)  # (N, 1, H*W)
    out = torch.gather(padded.flatten(2), 2, flat_index.expand(n, c, h * w))  # (N, C, H*W)
    return out.view(n, c, h, w)


def _randint(low: int, high: int, n: int, generator: torch.Generator, device) -> torch.Tensor:
    drawn = torch.randint(low, high, (n,), generator=generator, device=generator.device)
    return drawn.to(device)


def _rand(n: int, generator: torch.Generator, device) -> torch.Tensor:
    return torch.rand(n, generator=generator, device=generator.device).to(device)
