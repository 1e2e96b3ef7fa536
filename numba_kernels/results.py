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
    """One population's backward step to the output of the layer that made it."""

    grad: torch.Tensor  # (B, *U) the used signal's gradient at the layer's output
    instruction_grad: torch.Tensor | None  # (B, *U) the instruction's, when asked for
    masked: torch.Tensor | None  # (B, *U) I where h > 0 (the shortcut's), when asked for
    dgamma: torch.Tensor | None  # (channels,) the used signal's norm weight gradient
    dbeta: torch.Tensor | None  # (channels,) ... and norm bias gradient
    ss_used: torch.Tensor
    ss_instruction: torch.Tensor
    ss_raw: torch.Tensor
    ss_innovation: torch.Tensor
    ss_traffic: torch.Tensor
