"""What the kernels return: the used signal and the population's sums of squares.

Sums of squares are float64 tensors on the inputs' device (no host sync on a GPU;
``float(x)``, or ``.sums.tolist()`` for ``MixedApical``, when python numbers are
wanted): 0-d fields, except ``MixedApical``'s, which are 0-d views of one (5,)
vector. They are sums over the whole population (every example and unit), so
``RMS = sqrt(ss / numel)``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class MixedApical(NamedTuple):
    """One population's mixed apical compartment (DESIGN section 5).

    The five sums of squares travel as one float64 vector ``sums`` (the kernels write
    them so); ``ss_used`` and the rest are 0-d views of it, made when read (views:
    an in-place ``+=`` on one changes ``sums``). Why: five 0-d tensors made on every
    call cost the CPU path up to a tenth of a small population's kernel time, and a
    caller that logs them wants ``sums.tolist()``. (``MixedLocal`` keeps separate
    fields: its sums are formed from per-channel partials after the kernel, and the
    tensors it returns dwarf them.)
    """

    used: torch.Tensor  # (B, *U) the signal the rule trains with
    sums: torch.Tensor  # (5,) float64, in SUMS order

    SUMS = ("instruction", "traffic", "raw", "innovation", "used")

    @property
    def ss_instruction(self) -> torch.Tensor:
        return self.sums[0]

    @property
    def ss_traffic(self) -> torch.Tensor:
        return self.sums[1]

    @property
    def ss_raw(self) -> torch.Tensor:
        return self.sums[2]

    @property
    def ss_innovation(self) -> torch.Tensor:
        return self.sums[3]

    @property
    def ss_used(self) -> torch.Tensor:
        return self.sums[4]


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
