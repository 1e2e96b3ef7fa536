"""The learning-rule interface: a rule turns a batch into ``.grad`` tensors.

A rule owns whatever it learns or fixes beside the forward weights (feedback
tensors, probe generators) and writes gradients for the model's parameters and
for its own learnable tensors; a stock ``torch.optim`` optimizer then steps all
of them, so momentum, weight decay, schedules and clipping come from torch and
are the same for every rule. Gradient convention (DESIGN section 3): the loss
is the batch-mean cross-entropy, so ``.grad`` holds batch-mean updates, while a
teaching signal at a population estimates d(sum of the batch's losses)/dh.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn

from ..config import validate


@dataclass(frozen=True)
class NoParams:
    """A rule without hyper-parameters."""

    def __post_init__(self):
        validate(self)


@dataclass(frozen=True)
class StepResult:
    loss: torch.Tensor  # () batch-mean loss, detached
    logits: torch.Tensor  # (B, n_classes), detached


class Rule:
    """Base class; subclasses set ``name``, ``Params`` and ``compute_gradients``."""

    name: ClassVar[str] = ""
    Params: ClassVar[type] = NoParams

    def __init__(self, model: nn.Module, params=None, *, seed: int = 0):
        self.model = model
        self.params = params if params is not None else self.Params()
        self.seed = seed

    def parameters(self) -> list[torch.Tensor]:
        """Learnable tensors the rule owns; the optimizer steps them with the model's."""
        return []

    def compute_gradients(self, x: torch.Tensor, y: torch.Tensor, step: int) -> StepResult:
        """Write ``.grad`` for one batch (gradients are zeroed by the caller)."""
        raise NotImplementedError

    def epoch_metrics(self) -> dict:
        """Per-epoch diagnostics of the rule's own state (e.g. feedback tracking)."""
        return {}

    def state_dict(self) -> dict:
        """Everything needed to resume the rule exactly (tensors, generator states)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            raise ValueError(f"rule {self.name!r} keeps no state, got keys {sorted(state)}")

    def describe(self) -> dict:
        return {"name": self.name, **dataclasses.asdict(self.params)}
