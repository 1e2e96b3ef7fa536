"""The learning-rule interface: a rule turns a batch into ``.grad`` tensors.

A rule owns whatever it learns or fixes beside the forward weights (feedback
tensors, probe generators) and writes gradients for the model's parameters and
for its own learnable tensors; a stock ``torch.optim`` optimizer then steps all
of them, so momentum, weight decay, schedules and clipping come from torch and
are the same for every rule. Gradient convention (DESIGN section 3): the loss
is the batch-mean cross-entropy, so ``.grad`` holds batch-mean updates, while a
teaching signal at a population estimates d(sum of the batch's losses)/dh.

What a trainer does with a rule, in order (``lab.train``):

- builds the optimizer as ``[{"params": model params + rule.parameters()}]
  + rule.param_groups()``, so tensors in ``parameters()`` get the model's
  learning rate and weight decay (KP's B must), and a group may set its own;
- calls ``rule.prepare(x, y)`` once before the first step of a fresh run;
- per step: zero grads, ``compute_gradients(x, y, step)``, optionally
  ``clip_gradients(max_norm)``, optimizer step;
- per epoch stores ``epoch_metrics()`` under the row key ``"rule"``;
- checkpoints ``state_dict()``; bills ``work()`` and ``elementwise()``.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn

from ..config import ConfigError, configclass
from .common import check_model


@configclass
class NoParams:
    """A rule without hyper-parameters."""


def check_example_needs(rule: str, needs: dict[str, int], available: int) -> None:
    """ConfigError naming the first of ``needs`` (field -> examples) beyond ``available``."""
    for key, size in needs.items():
        if size > available:
            raise ConfigError(f"{rule}: rule_params.{key}={size} but the training set has only "
                              f"{available} examples; allowed: 1 to {available} (or a larger "
                              "n_train)")


@dataclass(frozen=True)
class StepResult:
    loss: torch.Tensor  # () batch-mean loss, detached
    logits: torch.Tensor  # (B, n_classes), detached
    # Per population, the rule's estimate of d(sum loss)/dh; only when asked to record.
    teaching: list[torch.Tensor] | None = None


def check_step_result(rule, out) -> StepResult:
    """``out`` if it is what ``compute_gradients`` must return, else a TypeError naming the
    rule: a custom rule returning None failed later on "'NoneType' has no attribute 'loss'"."""
    if not isinstance(out, StepResult):
        raise TypeError(f"rule {rule.name!r}: {type(rule).__name__}.compute_gradients returned "
                        f"{type(out).__name__}; it must write .grad and return a "
                        "StepResult(loss, logits) (see lab/rules/base.py)")
    return out


class Rule:
    """Base class; subclasses set ``name``, ``Params`` and ``compute_gradients``."""

    name: ClassVar[str] = ""
    Params: ClassVar[type] = NoParams

    def __init__(self, model: nn.Module, params=None, *, seed: int = 0):
        check_model(model, self.name)
        self.model = model
        self.params = params if params is not None else self.Params()
        self.seed = seed

    def parameters(self) -> list[torch.Tensor]:
        """Learnable tensors the rule owns, stepped with the model's own hyper-parameters."""
        return []

    def detach(self) -> None:
        """Take the rule off its model: what it set on the layers (feedback tensors) is
        removed, so the model computes exact gradients again and another rule may train
        it. The rule keeps its state; it computes nothing afterwards."""

    @staticmethod
    def example_needs(params) -> dict[str, int]:
        """Params field -> how many training examples ``prepare`` draws for it (only
        the fields in use). Checked against the training set before a run starts
        (``check_example_needs``), so a too-small set is a ConfigError, not a failed run."""
        return {}

    def param_groups(self) -> list[dict]:
        """Extra optimizer groups for tensors with their own settings.

        torch parameter-group dicts: ``"params"`` and, as needed, ``"lr"``,
        ``"weight_decay"``. (A feedback learning rate, for example.) Tensors a
        rule updates itself, outside the optimizer, belong in neither list:
        they change inside ``compute_gradients`` when ``step is not None``
        and are saved by ``state_dict``.
        """
        return []

    @contextlib.contextmanager
    def keeping_state(self, step: int | None):
        """Around a ``compute_gradients`` body that draws or counts: a diagnostic call
        (``step is None``) leaves the rule's state (generators, counters, B) as it was."""
        if step is not None:
            yield
            return
        saved = copy.deepcopy(self.state_dict())
        try:
            yield
        finally:
            self.load_state_dict(saved)

    def compute_gradients(self, x: torch.Tensor, y: torch.Tensor, step: int | None,
                          record: bool = False) -> StepResult:
        """Write ``.grad`` for one batch (gradients are zeroed by the caller).

        ``step`` is the optimizer step about to be taken; ``None`` marks a
        diagnostic call, which must not change the rule's state (no mirror
        or probe updates). ``record`` asks for the teaching signals.
        """
        raise NotImplementedError(f"rule {self.name!r} ({type(self).__name__}) does not "
                                  "define compute_gradients")

    def prepare(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Run once before the first step of a fresh run (not on resume).

        ``x``, ``y`` are the training split's examples in order, unaugmented,
        on the model's device and in its dtype (a rule uses a prefix of them).
        A rule that calibrates or warms up from data (a predictor, a probe
        scale) does it here;
        whatever it learns must go into ``state_dict``, because a resumed run
        restores it instead of calling ``prepare`` again.
        """

    def clip_gradients(self, max_norm: float) -> float:
        """Scale every gradient the rule wrote so the model's grad norm is at most ``max_norm``.

        The norm is over the model's parameters only, as for backprop: a
        rule's own tensors (KP's B, whose gradient equals W's) must not make
        the same ``grad_clip`` clip one rule harder than another. The same
        coefficient then scales the rule's tensors, so B still gets exactly
        W's clipped update. Returns the norm before clipping (as
        ``torch.nn.utils.clip_grad_norm_`` does, with its 1e-6 guard).
        """
        model_grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if not model_grads:
            return 0.0
        norm = torch.nn.utils.get_total_norm(model_grads)
        coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        extra = self.parameters() + [p for g in self.param_groups() for p in g["params"]]
        grads = model_grads + [p.grad for p in extra if p.grad is not None]
        for g in grads:
            g.mul_(coefficient.to(g.device, g.dtype))
        return float(norm)

    def work(self, layer_macs: dict[str, int], examples: int) -> dict[str, int]:
        """Multiply-accumulates per component for ``examples`` training examples.

        ``layer_macs`` is one example's forward MACs per Conv/Linear layer
        (``model.layer_macs``). The default is a local rule: the ordinary
        forward plus one weight correlation per layer (the same MAC count as
        the forward); rules add their feedback, probe and perturbation passes.
        """
        forward = sum(layer_macs.values())
        return {"forward": forward * examples, "local_correlation": forward * examples}

    def elementwise(self, examples: int) -> dict[str, int]:
        """Element-wise operations the rule adds, reported apart from MACs."""
        return {}

    def final_metrics(self, x: torch.Tensor, y: torch.Tensor) -> dict:
        """Diagnostics at the end of a run, on a probe batch; stored under final ``"rule"``."""
        return {}

    def epoch_metrics(self) -> dict:
        """Per-epoch diagnostics of the rule's own state, e.g. ``{"feedback": {...}}``.

        Unprefixed: the trainer stores them under the row key ``"rule"``.
        """
        return {}

    def state_dict(self) -> dict:
        """Everything needed to resume the rule exactly (tensors, generator states)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            raise ValueError(f"rule {self.name!r} keeps no state, got keys {sorted(state)}")
