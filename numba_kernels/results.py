"""What the kernels return: the used signal and the population's sums of squares.

Sums of squares are 0-d float64 tensors on the inputs' device (no host sync on a
GPU; ``float(x)`` when a python number is wanted). They are sums over the whole
population (every example and unit), so ``RMS = sqrt(ss / numel)``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class MixedApical(NamedTuple):
    """One population's mixed apical compartment (DESIGN section 5)."""

    used: torch.Tensor  # (B, *U) the signal the rule trains with
    ss_used: torch.Tensor
    ss_instruction: torch.Tensor
    ss_raw: torch.Tensor
    ss_innovation: torch.Tensor
    ss_traffic: torch.Tensor


class PredictorStats(NamedTuple):
    """Residual r = T - (P*h + b) before the update, and the traffic it predicts."""

    ss_residual: torch.Tensor
    ss_traffic: torch.Tensor


class MixedLocal(NamedTuple):
    """The used signal of one population carried to its producing layer's output."""

    grad: torch.Tensor  # (B, *U) base + the correction (used - instruction) at the output
    dgamma: torch.Tensor | None  # (channels,) the correction's share of the norm's weight grad
    dbeta: torch.Tensor | None  # (channels,) ... and of its bias grad
    ss_used: torch.Tensor
    ss_instruction: torch.Tensor
    ss_raw: torch.Tensor
    ss_innovation: torch.Tensor
    ss_traffic: torch.Tensor
