"""Convolution and linear layers whose backward pass may transport another weight.

Feedback alignment (Lillicrap et al. 2016, "Random synaptic feedback weights
support error backpropagation for deep learning") and its relatives keep the
forward computation of a layer and change one thing in its backward pass: the
input gradient is carried by a feedback tensor B instead of the forward weight
W. These layers hold an optional ``feedback`` tensor; while it is ``None`` they
are exactly torch's Conv1d/Conv2d/Linear, and when a rule sets it, the input
gradient uses B and the weight gradient stays the local correlation of the
layer's input with the gradient at its output. That one slot lets every
FA-family rule run on any model built from these layers, with no per-rule copy
of the architecture.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

_convolution_backward = torch.ops.aten.convolution_backward


class _FeedbackConv(torch.autograd.Function):
    """conv(x, W) forward; input gradient through ``feedback`` in place of W."""

    @staticmethod
    def forward(ctx, x, weight, bias, feedback, stride, padding, dims):
        conv = F.conv1d if dims == 1 else F.conv2d
        ctx.save_for_backward(x, feedback)
        ctx.conf = (stride, padding, dims, bias is not None)
        return conv(x, weight, bias, stride, padding)

    @staticmethod
    def backward(ctx, grad_out):
        x, feedback = ctx.saved_tensors
        stride, padding, dims, has_bias = ctx.conf
        ones, zeros = [1] * dims, [0] * dims
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                has_bias and ctx.needs_input_grad[2]]
        # One fused call, as backprop makes: the weight argument enters only the
        # input gradient, so passing B there gives FA's input gradient while the
        # weight gradient stays the correlation of x with grad_out.
        grad_x, grad_w, grad_b = _convolution_backward(
            grad_out, x, feedback, [feedback.shape[0]] if has_bias else None, list(stride),
            list(padding), ones, False, zeros, 1, mask)
        return grad_x, grad_w, grad_b, None, None, None, None


class _FeedbackLinear(torch.autograd.Function):
    """x W^T + b forward; input gradient ``grad_out @ feedback``."""

    @staticmethod
    def forward(ctx, x, weight, bias, feedback):
        ctx.save_for_backward(x, feedback)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, feedback = ctx.saved_tensors
        # Any leading dims (B, *, in), as nn.Linear takes: the weight's gradient sums over
        # all of them.
        g2, x2 = grad_out.reshape(-1, grad_out.shape[-1]), x.reshape(-1, x.shape[-1])
        grad_x = grad_out @ feedback if ctx.needs_input_grad[0] else None
        grad_w = g2.t() @ x2 if ctx.needs_input_grad[1] else None  # (out, in)
        grad_b = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None


class _FeedbackSlot:
    """The ``feedback`` slot, owned by the rule that set it, not by the layer.

    A copy of the model (``copy.deepcopy`` for a backprop twin, pickling) must
    not silently carry a rule's feedback tensor into a network that rule does
    not train, so the slot is left out of the layer's pickled state: the copy
    reads the class default ``None`` and computes exact gradients.
    """

    feedback: torch.Tensor | None = None

    def _checked_feedback(self) -> torch.Tensor:
        # A plain attribute, so model.to() / .double() do not move it: refused by name
        # (it failed deep in backward with "expected m1 and m2 to have the same dtype").
        b, w = self.feedback, self.weight
        if b.dtype != w.dtype or b.device != w.device:
            raise RuntimeError(
                f"{type(self).__name__}'s feedback tensor is {b.dtype} on {b.device} but its "
                f"weight is {w.dtype} on {w.device}: the model was cast or moved after its "
                "rule was attached; build the rule after model.to(...)")
        return b

    def __getstate__(self):
        state = super().__getstate__()
        state.pop("feedback", None)
        return state


class Conv(_FeedbackSlot, nn.Module):
    """Conv1d (dims=1) or Conv2d (dims=2), groups=1, dilation=1."""

    def __init__(self, dims, in_channels, out_channels, kernel_size, stride=1, padding=0,
                 bias=False):
        super().__init__()
        if dims not in (1, 2):
            raise ValueError(f"Conv dims={dims!r} is not allowed; choose 1 or 2")
        self.dims, self.stride, self.padding = dims, (stride,) * dims, (padding,) * dims
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size = (kernel_size,) * dims
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels, *self.kernel_size))
        self.bias = nn.Parameter(torch.zeros(out_channels)) if bias else None
        nn.init.kaiming_normal_(self.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):
        if self.feedback is None:
            conv = F.conv1d if self.dims == 1 else F.conv2d
            return conv(x, self.weight, self.bias, self.stride, self.padding)
        return _FeedbackConv.apply(x, self.weight, self.bias, self._checked_feedback(),
                                   self.stride, self.padding, self.dims)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, dims={self.dims}, "
                f"kernel_size={self.kernel_size[0]}, stride={self.stride[0]}, "
                f"padding={self.padding[0]}, bias={self.bias is not None}")


class Linear(_FeedbackSlot, nn.Linear):
    """nn.Linear with the feedback slot."""

    def forward(self, x):
        if self.feedback is None:
            return super().forward(x)
        return _FeedbackLinear.apply(x, self.weight, self.bias, self._checked_feedback())


def local_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, layer) for every Conv/Linear in registration (= forward) order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (Conv, Linear))]
