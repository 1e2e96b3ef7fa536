"""The asymmetric stop-gradient lift of an auxiliary supervision path (DESIGN section 7).

A main path and an aux path read the same encoder output. The aux path always trains its own
parameters on its own loss; its gradient at the encoder output is blocked until the *lift*,
after which it is added to the main path's gradient there, in place, by ``numba_kernels.aux_add``
inside one autograd Function (:class:`AuxJoin`), so the encoder then learns from both losses.

*The lift.* After every step the aux health signals are updated (:class:`AuxHealth`): per
horizon, an EMA of the aux Huber loss and of the aux direction accuracy (the share of examples
where the heads rank long vs short as the outcomes do). The lift fires at the first step s
within the window (s < ``window``; 0: no deadline) after which, on every horizon, the Huber EMA
is below its bound and the accuracy EMA above its bound; it is irreversible and takes effect
from step s + 1. If it has not fired by the end of the window, the aux path stays blocked.

The trainer that uses it: ``lab.train.cfc_aux`` (a CfC encoder, main and aux trunks).
"""

from __future__ import annotations

import torch

import numba_kernels


def aux_add(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """dst += src in place by the fused kernel (``numba_kernels.aux_add``, CPU or CUDA)."""
    return numba_kernels.aux_add(dst, src)


class AuxJoin(torch.autograd.Function):
    """Hand the encoder output to both trunks; join their gradients per the lift.

    Forward: (e, e). Backward: the main gradient, plus the aux gradient (``aux_add``, in place
    on a fresh buffer, no atomics) when ``lifted``; before the lift the aux gradient is dropped
    here, so the encoder sees the main path's gradient exactly.
    """

    @staticmethod
    def forward(ctx, enc, lifted: bool):
        ctx.lifted = lifted
        return enc.view_as(enc), enc.view_as(enc)

    @staticmethod
    def backward(ctx, grad_main, grad_aux):
        grad = grad_main.contiguous().clone()  # (B, T, E): never write into autograd's buffer
        if ctx.lifted:
            aux_add(grad, grad_aux.contiguous())
        return grad, None


class AuxHealth:
    """Per-horizon EMAs of the aux Huber loss and direction accuracy, and the lift state.

    Update n (from 1) moves each EMA toward the new value by max(1 - decay, 1 / n): the first
    value is taken as is and the early EMAs are plain averages of what was seen (no bias
    toward an arbitrary start), after which it is the usual exponential average. A constant
    input leaves the EMA exactly at that constant.
    """

    def __init__(self, n_horizons: int, decay: float):
        self.decay, self.n = decay, n_horizons
        self.huber = [0.0] * n_horizons
        self.acc = [0.0] * n_horizons
        self.updates, self.lifted, self.lift_step = 0, False, None

    def update(self, huber: list[float], acc: list[float]) -> None:
        self.updates += 1
        rate = max(1.0 - self.decay, 1.0 / self.updates)
        self.huber = [m + rate * (v - m) for m, v in zip(self.huber, huber)]
        self.acc = [m + rate * (v - m) for m, v in zip(self.acc, acc)]

    def consider_lift(self, step: int, huber_below: float, acc_above: float,
                      window: int) -> None:
        """Lift at ``step`` if every horizon's Huber EMA is below ``huber_below`` and every
        direction-accuracy EMA above ``acc_above``, within the window (``step < window``;
        ``window = 0``: no deadline). Irreversible: a lifted path stays lifted."""
        if (not self.lifted and (window == 0 or step < window)
                and all(v < huber_below for v in self.huber)
                and all(v > acc_above for v in self.acc)):
            self.lifted, self.lift_step = True, step

    def state_dict(self) -> dict:
        return {"huber": list(self.huber), "acc": list(self.acc), "updates": self.updates,
                "lifted": self.lifted, "lift_step": self.lift_step}

    def load_state_dict(self, state: dict) -> None:
        self.huber, self.acc = list(state["huber"]), list(state["acc"])
        self.updates, self.lifted = int(state["updates"]), bool(state["lifted"])
        self.lift_step = state["lift_step"]
