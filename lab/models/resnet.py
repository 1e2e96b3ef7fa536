"""CIFAR-style residual network, in 2-D (images) and 1-D (sequence images).

He et al. 2016, "Deep residual learning for image recognition", section 4.2:
depth 6n+2 = a 3x3 stem, three stages of n basic blocks with widths
w, 2w, 4w (stride 2 entering stages 2 and 3), global average pooling and a
linear read-out; shortcuts are parameter-free (option A: subsample and
zero-pad channels), so every weight a learning rule must credit sits in a
Conv or Linear layer. ResNet-20 is depth 20, width 16. With ``dims=1`` the same
network runs on (N, C, L) sequences such as MNIST-1D (Greydanus 2020).

A *population* is a post-activation tensor that later layers read: the stem
output and each block's inner and outer activation. ``forward(x, tap=...)``
passes every population through ``tap(index, h)``, which is how learning
rules and diagnostics read or replace the signal there without a copy of the
model.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from .layers import Conv, Linear, local_layers

Tap = Callable[[int, torch.Tensor], torch.Tensor]


def _norm(kind: str, dims: int, channels: int) -> nn.Module:
    if kind == "none":
        return nn.Identity()
    return (nn.BatchNorm1d if dims == 1 else nn.BatchNorm2d)(channels)


class BasicBlock(nn.Module):
    """conv-norm-relu (inner population) -> conv-norm, + shortcut, relu (outer)."""

    def __init__(self, dims, c_in, c_out, stride, normalization, residual_scale):
        super().__init__()
        bias = normalization == "none"  # a bias is redundant before BatchNorm
        self.conv1 = Conv(dims, c_in, c_out, 3, stride, 1, bias=bias)
        self.norm1 = _norm(normalization, dims, c_out)
        self.conv2 = Conv(dims, c_out, c_out, 3, 1, 1, bias=bias)
        self.norm2 = _norm(normalization, dims, c_out)
        self.dims, self.stride, self.pad_channels = dims, stride, c_out - c_in
        self.residual_scale = residual_scale

    def shortcut(self, x):
        if self.stride > 1:
            s = self.stride
            x = x[:, :, ::s] if self.dims == 1 else x[:, :, ::s, ::s]
        if self.pad_channels:
            # F.pad pads trailing dims first: skip the spatial dims, pad channels at the end.
            x = F.pad(x, [0, 0] * self.dims + [0, self.pad_channels])
        return x

    def forward(self, x, tap: Tap, index: int):
        h = tap(index, F.relu(self.norm1(self.conv1(x))))
        out = self.residual_scale * self.norm2(self.conv2(h)) + self.shortcut(x)
        return tap(index + 1, F.relu(out))


def _identity_tap(index: int, h: torch.Tensor) -> torch.Tensor:
    return h


class ResNet(nn.Module):
    """CIFAR ResNet of depth 6n+2 and base width w; see the module docstring."""

    def __init__(self, depth: int = 20, width: int = 16, dims: int = 2, in_channels: int = 3,
                 n_classes: int = 10, normalization: str = "batchnorm",
                 residual_scale: float = 1.0, dtype: torch.dtype = torch.float32):
        super().__init__()
        if depth < 8 or (depth - 2) % 6:
            raise ValueError(f"ResNet depth={depth} is not allowed; use 6n+2 with n >= 1 "
                             "(8, 14, 20, 32, 44, 56, 110)")
        if dims not in (1, 2):
            raise ValueError(f"ResNet dims={dims!r} is not allowed; choose 1 or 2")
        if normalization not in ("batchnorm", "none"):
            raise ValueError(f"ResNet normalization={normalization!r} is not allowed; "
                             "choose 'batchnorm' or 'none'")
        n = (depth - 2) // 6
        self.depth, self.width, self.dims = depth, width, dims
        self.stem = Conv(dims, in_channels, width, 3, 1, 1, bias=normalization == "none")
        self.stem_norm = _norm(normalization, dims, width)
        blocks, c_in = [], width
        for stage, c_out in enumerate((width, 2 * width, 4 * width)):
            for i in range(n):
                stride = 2 if stage > 0 and i == 0 else 1
                blocks.append(BasicBlock(dims, c_in, c_out, stride, normalization,
                                         residual_scale))
                c_in = c_out
        self.blocks = nn.ModuleList(blocks)
        self.fc = Linear(c_in, n_classes)
        self.population_names = ["stem"] + [
            f"block{b}.{part}" for b in range(len(blocks)) for part in ("inner", "outer")
        ]
        self.to(dtype)

    def forward(self, x: torch.Tensor, tap: Tap | None = None) -> torch.Tensor:
        tap = tap or _identity_tap
        h = tap(0, F.relu(self.stem_norm(self.stem(x))))  # (B, w, *spatial)
        for b, block in enumerate(self.blocks):
            h = block(h, tap, 1 + 2 * b)
        pooled = h.mean(dim=tuple(range(2, h.ndim)))  # (B, 4w)
        return self.fc(pooled)  # (B, n_classes)

    @staticmethod
    def weight_count(depth: int, width: int, dims: int, in_channels: int,
                     n_classes: int) -> int:
        """Conv and Linear weights of this architecture, from its sizes alone (python ints:
        exact for any size): what a run checks before it builds a model that cannot fit."""
        n, k = (depth - 2) // 6, 3 ** dims
        count = k * in_channels * width  # stem
        c_in = width
        for c_out in (width, 2 * width, 4 * width):
            count += k * c_in * c_out + k * c_out * c_out  # the first block of the stage
            count += (n - 1) * 2 * k * c_out * c_out  # the others
            c_in = c_out
        return count + c_in * n_classes + n_classes  # read-out

    def layer_macs(self, example_shape: tuple[int, ...]) -> dict[str, int]:
        """Multiply-accumulates of each Conv/Linear for one example of ``example_shape``
        (C, *spatial), from the architecture alone (no forward pass)."""
        spatial = list(example_shape[1:])
        k = 3 ** self.dims
        macs = {"stem": self.stem.out_channels * math.prod(spatial) * self.stem.in_channels * k}
        for b, block in enumerate(self.blocks):
            # padding 1, kernel 3: out = ceil(in / stride)
            spatial = [-(-n // block.stride) for n in spatial]
            c_in, c_out = block.conv1.in_channels, block.conv1.out_channels
            macs[f"blocks.{b}.conv1"] = c_out * math.prod(spatial) * c_in * k
            macs[f"blocks.{b}.conv2"] = c_out * math.prod(spatial) * c_out * k
        macs["fc"] = self.fc.in_features * self.fc.out_features
        return macs

    @property
    def layers(self) -> list[tuple[str, nn.Module]]:
        """Conv/Linear layers in forward order: what a learning rule credits."""
        return local_layers(self)
