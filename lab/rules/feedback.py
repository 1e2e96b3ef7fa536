"""Feedback alignment and the rules that shape its feedback tensors.

Every rule here propagates the output error layer by layer through the real
graph (BN, ReLU, residual adds and pooling use their true derivatives), except
that each Conv/Linear input gradient uses a feedback tensor B_l in place of
W_l (hierarchical FA). They differ only in how B_l is made:

- ``fa``  fixed random B at W's own scale (Lillicrap et al. 2016, Nature
  Communications 7:13276);
- ``kp``  Kolen-Pollack: B receives W's update, the same correlation and the same
  weight decay, so W - B decays geometrically (Kolen & Pollack 1994; Akrout et
  al. 2019, "Deep learning without weight transport");
- ``usf`` / ``brsf`` / ``frsf``  sign symmetry: B = sign(W) times a uniform
  scale, fresh random magnitudes each step, or fixed random magnitudes (Liao,
  Leibo & Poggio 2016, "How important is weight symmetry in backpropagation?";
  Moskovitz et al. 2018).

The weight update of every layer is the local correlation of its input with
the teaching signal at its output, exactly what autograd computes for it. The
first layer reads the data: nothing needs its input gradient, so it has no B
(not tracked, not billed).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from ..config import SEED_MAX, bounded, configclass
from ..models.layers import local_layers
from .base import Rule
from .bp import autograd_step
from .common import (
    check_first_layer,
    check_no_feedback,
    derive_seed,
    feedback_layer_names,
    forward_order,
    initial_scale,
)
from .registry import register


@configclass
class FeedbackParams:
    feedback_scale: float = bounded(1.0, 0.0, lo_open=True)  # ||B|| / ||W|| at initialisation
    feedback_seed: int = bounded(0, 0, SEED_MAX)  # mixed with the run seed


def unsupported_layers(model: nn.Module) -> list[str]:
    """Parametrised modules no local rule can credit (not lab Conv/Linear or a norm)."""
    allowed = tuple(type(m) for _, m in local_layers(model)) + (
        nn.BatchNorm1d, nn.BatchNorm2d, nn.LayerNorm, nn.GroupNorm)
    return [f"{name or '<the model itself>'} ({type(m).__name__})"
            for name, m in model.named_modules()
            if any(True for _ in m.parameters(recurse=False)) and not isinstance(m, allowed)]


def check_supported(model: nn.Module, rule: str) -> list[tuple[str, nn.Module]]:
    layers = local_layers(model)
    bad = unsupported_layers(model)
    if bad or not layers:
        detail = ", ".join(bad) if bad else "it has no lab.models Conv/Linear layer"
        raise ValueError(f"rule {rule!r} cannot train {type(model).__name__}: it cannot handle "
                         f"{detail}. Build the model from lab.models.layers.Conv/Linear "
                         "(and BatchNorm/LayerNorm/GroupNorm).")
    return layers


@register
class FeedbackAlignment(Rule):
    """Fixed random feedback tensors (``fa``).

    B_l ~ N(0, (feedback_scale x rms(W_l))^2), with rms(W_l) the root-mean-square
    entry of the layer's weight when the rule is built (see
    ``common.initial_scale`` for why not a fan-in std). The first layer reads
    the data and needs no B; ``self.layers`` lists the layers that carry one.
    """

    name = "fa"
    Params = FeedbackParams

    _order_checked = False  # (a class default: rules unpickled from older states too)

    def __init__(self, model, params=None, *, seed=0):
        super().__init__(model, params, seed=seed)
        check_supported(model, self.name)
        check_no_feedback(model, self.name)
        names = set(feedback_layer_names(model))
        self.layers = [(n, m) for n, m in local_layers(model) if n in names]
        self.generator = torch.Generator().manual_seed(
            derive_seed(seed, "feedback", self.params.feedback_seed))
        # Per layer, the std of B's entries (fixed from W at construction).
        self.scales = [self.params.feedback_scale * initial_scale(m.weight)
                       for _, m in self.layers]
        self.feedback = [self._draw(i) for i in range(len(self.layers))]
        self._attach()
        self.steps = 0

    def _attach(self) -> None:
        for (_, module), b in zip(self.layers, self.feedback):
            module.feedback = b

    def detach(self) -> None:
        for (_, module), b in zip(self.layers, self.feedback):
            if module.feedback is b:  # (not another's, set since)
                module.feedback = None

    def __setstate__(self, state: dict) -> None:
        # A copy of the rule (copy.deepcopy, pickling) copies its model, whose layers drop
        # their feedback slot (see lab.models.layers): without this the copy computed exact
        # backprop while holding, and reporting, its own feedback tensors.
        self.__dict__.update(state)
        self._attach()

    def _draw(self, index: int) -> torch.Tensor:
        """A fresh N(0, scale^2) tensor shaped like layer ``index``'s weight."""
        weight = self.layers[index][1].weight
        b = torch.randn(weight.shape, generator=self.generator, dtype=torch.float64)
        # A plain tensor, not an nn.Parameter: attached to a layer it must not join
        # the model's parameters or state_dict (the rule saves it).
        return (b * self.scales[index]).to(weight)

    def refresh(self) -> None:
        """Recompute B from W before a step (sign-symmetry rules)."""

    def compute_gradients(self, x, y, step, record=False):
        # At the first call, which layer forward reads the data with (see check_first_layer).
        with self.keeping_state(step), (contextlib.nullcontext() if self._order_checked
                                        else forward_order(self.model)) as order:
            self.refresh()  # brsf's refresh draws from the generator
            out = autograd_step(self.model, x, y, record)
        if order is not None:
            check_first_layer(self.model, order, self.name)
            self._order_checked = True
        if step is not None:
            self.steps += 1
        return out

    def epoch_metrics(self):
        return {"feedback": feedback_tracking(self.layers, self.feedback)} if self.layers else {}

    def state_dict(self):
        return {"feedback": [b.detach().clone() for b in self.feedback],
                "scales": list(self.scales),
                "generator": self.generator.get_state(), "steps": self.steps}

    def load_state_dict(self, state):
        if len(state["feedback"]) != len(self.feedback) or "scales" not in state:
            raise ValueError(
                f"rule {self.name!r}: the saved state holds {len(state['feedback'])} feedback "
                f"tensors{'' if 'scales' in state else ' and no scales'}; this model needs "
                f"{len(self.feedback)} (one per layer after the first) with their scales. "
                "States saved before feedback tensors matched each layer's scale (and the "
                "first layer's B was dropped) cannot be resumed: rerun the run afresh.")
        with torch.no_grad():
            for b, saved in zip(self.feedback, state["feedback"]):
                b.copy_(saved)
        self.scales = list(state["scales"])
        self.generator.set_state(state["generator"])
        self.steps = state["steps"]

    def feedback_macs(self, layer_macs: dict[str, int]) -> int:
        """One example's MACs summed over the layers that carry a B."""
        return sum(layer_macs[name] for name, _ in self.layers)

    def work(self, layer_macs, examples):
        # One input-gradient product through B per layer that has one.
        return {**super().work(layer_macs, examples),
                "feedback_propagation": self.feedback_macs(layer_macs) * examples}


@register
class KolenPollack(FeedbackAlignment):
    """B is learned: it gets W's gradient, and the optimizer gives it W's decay.

    B sits in ``parameters()`` (the model's optimizer group, never a group of
    its own): W - B then follows the optimizer's weight-decay law alone, e.g.
    (1 - lr wd)^t under plain SGD and under AdamW's decoupled decay. Under an
    L2 penalty inside Adam's moments it would not.
    """

    name = "kp"

    def parameters(self):
        return list(self.feedback)

    def compute_gradients(self, x, y, step, record=False):
        out = super().compute_gradients(x, y, step, record)
        for (_, module), b in zip(self.layers, self.feedback):
            if module.weight.grad is not None:  # (a frozen layer's B stays as it is)
                b.grad = module.weight.grad.clone()
        return out

    def work(self, layer_macs, examples):
        # The feedback update is the same correlation, formed at B's synapses too: billed
        # (the algorithm's cost; see lab.diagnostics.work), though computed once here.
        return {**super().work(layer_macs, examples),
                "feedback_update": self.feedback_macs(layer_macs) * examples}


@register
class UniformSignSymmetry(FeedbackAlignment):
    """B = sign(W) x feedback_scale x rms(W at construction) (``usf``).

    The uniform magnitude is fa's std, so ||B|| / ||W|| = feedback_scale at
    initialisation, as for fa.
    """

    name = "usf"

    def magnitude(self, index: int, weight: torch.Tensor):
        """|B| for layer ``index``; the sign always comes from W."""
        return self.scales[index]

    def refresh(self):
        with torch.no_grad():
            for i, ((_, module), b) in enumerate(zip(self.layers, self.feedback)):
                b.copy_(torch.sign(module.weight) * self.magnitude(i, module.weight))

    def elementwise(self, examples):
        # sign and scale of every weight, once per step (not per example).
        return {"feedback_refresh": 2 * self.steps * sum(b.numel() for b in self.feedback)}


@register
class BatchRandomSignSymmetry(UniformSignSymmetry):
    """B = sign(W) x |R|, R ~ fa's distribution drawn afresh every step (``brsf``)."""

    name = "brsf"

    def magnitude(self, index, weight):
        return self._draw(index).abs()

    def elementwise(self, examples):
        # Beyond usf's sign and scale: a fresh normal draw, its scale and |.| per weight
        # and step (a generator call is billed as one operation per element, as for
        # node perturbation's noise).
        drawn = 3 * self.steps * sum(b.numel() for b in self.feedback)
        return {**super().elementwise(examples), "feedback_draw": drawn}


@register
class FixedRandomSignSymmetry(UniformSignSymmetry):
    """B = sign(W) x |R|, R ~ fa's distribution drawn once (``frsf``)."""

    name = "frsf"

    def __init__(self, model, params=None, *, seed=0):
        super().__init__(model, params, seed=seed)
        self.magnitudes = [b.detach().abs().clone() for b in self.feedback]

    def magnitude(self, index, weight):
        return self.magnitudes[index]

    def state_dict(self):
        return {**super().state_dict(), "magnitudes": [r.clone() for r in self.magnitudes]}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.magnitudes = [r.to(b) for r, b in zip(state["magnitudes"], self.feedback)]


@torch.no_grad()
def feedback_tracking(layers, feedback) -> dict:
    """Per layer cos(B, W), ||B - W|| / ||W||, ||B|| / ||W||, and their summaries."""
    cos, rel, ratio = {}, {}, {}
    for (name, module), b in zip(layers, feedback):
        w, bf = module.weight.flatten().double(), b.flatten().double()
        w_norm = w.norm()
        cos[name] = float(torch.dot(w, bf) / (w_norm * bf.norm()).clamp_min(1e-300))
        rel[name] = float((bf - w).norm() / w_norm)
        ratio[name] = float(bf.norm() / w_norm)
    return {"cos": cos, "rel_err": rel, "norm_ratio": ratio,
            "mean_cos": sum(cos.values()) / len(cos), "min_cos": min(cos.values()),
            "mean_rel_err": sum(rel.values()) / len(rel), "max_rel_err": max(rel.values())}
