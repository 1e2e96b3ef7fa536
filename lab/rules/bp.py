"""Backpropagation (Rumelhart, Hinton & Williams 1986): autograd's gradients."""

from __future__ import annotations

import torch.nn.functional as F

from .base import Rule, StepResult
from .registry import register


@register
class Backprop(Rule):
    name = "bp"

    def compute_gradients(self, x, y, step):
        logits = self.model(x)  # (B, n_classes)
        loss = F.cross_entropy(logits, y)
        loss.backward()
        return StepResult(loss.detach(), logits.detach())
