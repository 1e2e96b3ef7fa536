"""Direct feedback alignment (Nokland 2016, "Direct feedback alignment provides
learning in deep neural networks", NeurIPS).

The output error e = softmax(logits) - onehot(y) is projected straight to
every population by a fixed random matrix D_l: teaching_l = e . D_l. Each layer
then updates from the correlation of its input with that signal, gated by its
own local derivative (BN and ReLU); no signal travels between layers. The
read-out layer sees e itself.

D_l's entries are N(0, (feedback_scale / sqrt(K))^2), so every unit receives
about e's norm whatever its depth and width; backprop's signal there is far
smaller (issue 9 measured dfa's teaching norms at initialisation at 67-280x
backprop's below the read-out of the CIFAR ResNet-20). ``projection_norm="gradient"`` rescales each
D_l once, on the first batch the rule sees, so that ||e . D_l|| over that
batch equals feedback_scale x ||d(sum loss)/dh_l||, backprop's norm there.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..config import SEED_MAX, bounded, choice, configclass
from ..models.state import preserved_norm_stats
from .base import Rule, StepResult
from .common import MODEL_CONTRACT, Segments, check_targets, derive_seed, output_error
from .feedback import check_supported
from .registry import register


@configclass
class DFAParams:
    feedback_scale: float = bounded(1.0, 0.0, lo_open=True)  # D std = scale / sqrt(K)
    feedback_seed: int = bounded(0, 0, SEED_MAX)
    # "fixed": Nokland's scale; "gradient": each D_l matched to backprop's norm once.
    projection_norm: str = choice("fixed", ("fixed", "gradient"))


@register
class DirectFeedbackAlignment(Rule):
    name = "dfa"
    Params = DFAParams

    def __init__(self, model, params=None, *, seed=0):
        super().__init__(model, params, seed=seed)
        self.layers = check_supported(model, self.name)
        self.generator = torch.Generator().manual_seed(
            derive_seed(seed, "dfa", self.params.feedback_seed))
        self.projections: list[torch.Tensor] | None = None  # D_l: (K, units of population l)
        self.matched_examples = 0  # projection_norm "gradient": the one backprop pass's batch

    def _make_projections(self, populations, n_classes):
        std = self.params.feedback_scale / math.sqrt(n_classes)
        self.projections = [
            (torch.randn((n_classes, h[0].numel()), generator=self.generator,
                         dtype=torch.float64) * std).to(h)
            for h in populations]

    def _match_gradient_norms(self, x, y) -> None:
        """Rescale each D_l so ||e . D_l|| = feedback_scale x backprop's ||dL/dh_l|| on (x, y).

        Backprop's population gradients come from ``torch.autograd.grad``
        (no ``.grad`` written) in a training-mode pass that leaves BN's
        running statistics alone.
        """
        populations = []

        def keep(index, h):
            populations.append(h)
            return h
        with preserved_norm_stats(self.model):
            logits = self.model(x, tap=keep)  # (B, K)
            loss = F.cross_entropy(logits, y, reduction="sum")
            true = torch.autograd.grad(loss, populations)
        e = output_error(logits.detach(), y)  # (B, K)
        with torch.no_grad():
            for d, g in zip(self.projections, true):
                d.mul_(self.params.feedback_scale * g.norm() / (e @ d).norm())
        self.matched_examples = len(y)

    def teaching(self, e: torch.Tensor, populations) -> list[torch.Tensor]:
        """e . D_l reshaped to each population. e: (B, K) -> [(B, *unit shape)]"""
        return [(e @ d).view_as(h) for d, h in zip(self.projections, populations)]

    def compute_gradients(self, x, y, step, record=False):
        segments = Segments()
        logits = self.model(x, tap=segments)  # (B, K)
        check_targets(y, logits)
        if not segments.outputs:
            # Nothing cut: the loss's backward would reach every layer, as backprop's.
            raise ValueError(f"rule {self.name!r}: {type(self.model).__name__}.forward called "
                             "tap on no population, so no error would be projected and the "
                             f"backward would be backprop's; the rules need {MODEL_CONTRACT}")
        if self.projections is None:
            self._make_projections(segments.outputs, logits.shape[1])
            if self.params.projection_norm == "gradient":
                self._match_gradient_norms(x, y)
        loss = F.cross_entropy(logits, y)
        loss.backward()  # the read-out only: populations are cut from it
        signals = self.teaching(output_error(logits.detach(), y), segments.outputs)
        segments.inject(signals, len(y))
        return StepResult(loss.detach(), logits.detach(), signals if record else None)

    def state_dict(self):
        return {"projections": self.projections, "generator": self.generator.get_state(),
                "matched_examples": self.matched_examples}

    def load_state_dict(self, state):
        like = next(self.model.parameters())
        self.projections = (None if state["projections"] is None
                            else [d.to(like) for d in state["projections"]])
        self.generator.set_state(state["generator"])
        self.matched_examples = state.get("matched_examples", 0)  # (older checkpoints: none)

    def work(self, layer_macs, examples):
        # Projection e . D_l: K x units MACs per population.
        units = sum(d.shape[1] for d in self.projections or [])
        k = self.projections[0].shape[0] if self.projections else 0
        out = {**super().work(layer_macs, examples),
               "feedback_propagation": k * units * examples}
        if self.matched_examples:
            # projection_norm "gradient": one forward and the input-gradient products of
            # backprop (every layer but the first) on the first batch, before training.
            forward = sum(layer_macs.values())
            first = self.layers[0][0]
            out["gradient_matching"] = self.matched_examples * (2 * forward
                                                                - layer_macs[first])
        return out
