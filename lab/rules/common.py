"""Pieces shared by the learning rules: seeds, feedback scales, population taps.

Two ways a rule produces its teaching signals, both through the model's
``tap`` hook (see ``lab.models.resnet``):

- *Recording*: autograd runs end to end (backprop and the FA family, whose
  layers transport feedback tensors); a hook on each population stores the
  gradient arriving there.
- *Local segments*: the tap cuts the graph at every population, so the
  backward pass from a population reaches only the layer (and its norm) that
  produced it; the rule then injects its own signal at each population
  (DFA's projected error, node perturbation's estimate) and autograd computes
  the local weight correlation through the true local derivative.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F


def derive_seed(seed: int, *tags: int | str) -> int:
    """An independent 63-bit seed for (run seed, purpose): one run seed fixes everything."""
    words = [seed] + [t if isinstance(t, int) else int.from_bytes(t.encode(), "little")
                      for t in tags]
    return int(np.random.SeedSequence(words).generate_state(1, dtype=np.uint64)[0] >> 1)


def kaiming_std(weight: torch.Tensor) -> float:
    """He et al. 2015 scale sqrt(2 / fan_in) for a conv or linear weight."""
    fan_in = weight[0].numel()
    return math.sqrt(2.0 / fan_in)


def population_scale(batch: int) -> float:
    """Autograd gives d(mean loss)/dh; teaching signals are d(sum loss)/dh."""
    return float(batch)


class Recorder:
    """A tap that stores d(sum loss)/dh at every population during backward."""

    def __init__(self, batch: int):
        self.batch = batch
        self.grads: dict[int, torch.Tensor] = {}

    def __call__(self, index: int, h: torch.Tensor) -> torch.Tensor:
        if h.requires_grad:
            h.register_hook(lambda g, i=index: self.grads.__setitem__(i, g.detach() * self.batch))
        return h

    def teaching(self) -> list[torch.Tensor]:
        return [self.grads[i] for i in sorted(self.grads)]


class Segments:
    """A tap that cuts the graph at each population, keeping both sides.

    ``outputs[i]`` is the population as its own layer computed it (its graph
    reaches back only to the previous cut); the next layer reads a detached
    copy, so no gradient crosses between segments.
    """

    def __init__(self):
        self.outputs: list[torch.Tensor] = []

    def __call__(self, index: int, h: torch.Tensor) -> torch.Tensor:
        self.outputs.append(h)
        return h.detach().requires_grad_(h.requires_grad)

    def inject(self, signals: list[torch.Tensor], batch: int) -> None:
        """Backward each population's signal (d sum-loss/dh) into its own segment."""
        pairs = [(h, s / batch) for h, s in zip(self.outputs, signals) if h.requires_grad]
        if pairs:
            torch.autograd.backward([h for h, _ in pairs], [s for _, s in pairs])


def output_error(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """e = softmax(logits) - onehot(y): d(sum cross-entropy)/d logits. (B, K)"""
    return torch.softmax(logits, dim=1) - F.one_hot(y, logits.shape[1]).to(logits.dtype)
