"""Backpropagation (Rumelhart, Hinton & Williams 1986): autograd's gradients."""

from __future__ import annotations

import torch.nn.functional as F

from .base import Rule, StepResult
from .common import Recorder
from .registry import register


@register
class Backprop(Rule):
    name = "bp"

    def compute_gradients(self, x, y, step, record=False):
        return autograd_step(self.model, x, y, record)

    def work(self, forward_macs, examples):
        # Reverse pass: a weight-gradient and an input-gradient product per forward one.
        return {"forward": forward_macs * examples, "bp_reverse": 2 * forward_macs * examples}


def autograd_step(model, x, y, record: bool) -> StepResult:
    """Forward, batch-mean cross-entropy, backward through whatever the layers transport."""
    recorder = Recorder(len(y)) if record else None
    logits = model(x, tap=recorder)  # (B, n_classes)
    loss = F.cross_entropy(logits, y)
    loss.backward()
    return StepResult(loss.detach(), logits.detach(), recorder.teaching() if record else None)
