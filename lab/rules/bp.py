"""Backpropagation (Rumelhart, Hinton & Williams 1986): autograd's gradients."""

from __future__ import annotations

import torch.nn.functional as F

from ..models.layers import local_layers
from .base import Rule, StepResult
from .common import Recorder, check_no_feedback, check_targets
from .registry import register


@register
class Backprop(Rule):
    name = "bp"

    def __init__(self, model, params=None, *, seed: int = 0):
        super().__init__(model, params, seed=seed)
        # A layer still holding another rule's feedback tensor transports through it:
        # "bp" would silently be that rule (fa's teaching, billed as backprop).
        check_no_feedback(model, self.name)

    def compute_gradients(self, x, y, step, record=False):
        return autograd_step(self.model, x, y, record)

    def work(self, layer_macs, examples):
        # Reverse pass: a weight-gradient product per forward one, and an
        # input-gradient product for every layer but the first, whose input
        # (the data) needs no gradient.
        forward = sum(layer_macs.values())
        first = local_layers(self.model)[0][0]
        return {"forward": forward * examples,
                "bp_reverse": (2 * forward - layer_macs[first]) * examples}


def autograd_step(model, x, y, record: bool, tap=None) -> StepResult:
    """Forward, batch-mean cross-entropy, backward through whatever the layers transport.

    ``tap`` is a rule's own tap (see ``lab.models.resnet``); with ``record``
    the recorder reads each population after it, i.e. the tensor later
    layers actually read.
    """
    recorder = Recorder(len(y)) if record else None
    if recorder and tap:
        def both(index, h):
            return recorder(index, tap(index, h))
    else:
        both = recorder or tap
    logits = model(x, tap=both)  # (B, n_classes)
    check_targets(y, logits)
    loss = F.cross_entropy(logits, y)
    loss.backward()
    return StepResult(loss.detach(), logits.detach(), recorder.teaching() if record else None)
