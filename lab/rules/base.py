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
    # Per population, the rule's estimate of d(sum loss)/dh; only when asked to record.
    teaching: list[torch.Tensor] | None = None


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

    def compute_gradients(self, x: torch.Tensor, y: torch.Tensor, step: int | None,
                          record: bool = False) -> StepResult:
        """Write ``.grad`` for one batch (gradients are zeroed by the caller).

        ``step`` is the optimizer step about to be taken; ``None`` marks a
        diagnostic call, which must not change the rule's state (no mirror
        or probe updates). ``record`` asks for the teaching signals.
        """
        raise NotImplementedError

    def prepare(self, x: torch.Tensor) -> None:
        """Hook run once before the first step, with a batch of inputs (shapes, warm-ups)."""

    def work(self, forward_macs: int, examples: int) -> dict[str, int]:
        """Multiply-accumulates per component for ``examples`` training examples.

        ``forward_macs`` is one example's forward pass. The default is a local
        rule: the ordinary forward plus one weight correlation per layer (the
        same MAC count as the forward); rules add their feedback, probe and
        perturbation passes.
        """
        return {"forward": forward_macs * examples,
                "local_correlation": forward_macs * examples}

    def elementwise(self, examples: int) -> dict[str, int]:
        """Element-wise operations the rule adds, reported apart from MACs."""
        return {}

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
