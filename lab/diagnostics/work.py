"""Compute bills: multiply-accumulates per component, element-wise operations apart.

The forward count comes from the architecture (``model.layer_macs``); an
independent count from forward hooks checks it. A rule's bill for a run is
``rule.work(layer_macs, examples)`` (see ``lab.rules.base.Rule.work``):
components such as ``forward``, ``bp_reverse``, ``feedback_propagation``,
``local_correlation``, ``feedback_update``, ``mirror`` and ``perturbation``.

The rule for the bill: a product is billed when the rule needs its result, at the
synapses that need it: Kolen-Pollack's feedback weights form their own update, the same
correlation as the forward weights' (``feedback_update``), which a circuit computes twice
though this implementation copies W's result (so the bill counts the algorithm, and kp's
wall time is fa's).
Every layer's weight gradient is billed (every layer learns); an input
gradient only where a layer below reads it, so never for the first layer,
whose input is the data: bp's reverse pass is one weight-gradient product per
layer plus one input-gradient product per layer but the first, and the
feedback rules carry no B there (nothing propagated, tracked or billed). A
product computed but thrown away is a defect to fix, not a cost to bill.
Element-wise operations (noise, signs, norms) are listed separately and never
folded into MACs. Diagnostics (alignment probes) are not training work and
are not billed.
"""

from __future__ import annotations

import math

import torch

from ..models.layers import Conv, local_layers


def forward_macs(model, example_shape) -> int:
    """One example's forward multiply-accumulates, from the architecture."""
    return sum(model.layer_macs(tuple(example_shape)).values())


@torch.no_grad()
def hook_macs(model, x: torch.Tensor) -> dict[str, int]:
    """Per-layer MACs per example counted from a real forward pass (hooks)."""
    counts: dict[str, int] = {}

    def count(name):
        def hook(module, inputs, output):
            per_output = (module.in_channels * math.prod(module.kernel_size)
                          if isinstance(module, Conv) else module.in_features)
            counts[name] = output[0].numel() * per_output
        return hook

    handles = [m.register_forward_hook(count(n)) for n, m in local_layers(model)]
    was_training = model.training
    model.eval()
    try:
        model(x[:1])
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    return counts


def bill(rule, model, example_shape, examples: int) -> dict:
    """The run's compute bill: per-example forward MACs, MAC components, element-wise ops."""
    layer_macs = model.layer_macs(tuple(example_shape))
    per_example = sum(layer_macs.values())
    components = {k: int(v) for k, v in rule.work(layer_macs, examples).items()}
    return {"forward_macs_per_example": per_example, "examples": examples,
            "macs": components, "total_macs": sum(components.values()),
            "elementwise": {k: int(v) for k, v in rule.elementwise(examples).items()}}
