"""Alignment of a rule's credit with the true gradient, at one state.

Per population: the mean over examples of cos(teaching signal, autograd's
d(sum loss)/dh). Per layer: cos(the rule's weight update, backprop's weight
update). Both are measured on the same batch in training mode (batch
statistics, as the step itself uses them) with BN running statistics, the
rule's state (feedback tensors, generators) and the gradients restored
afterwards, so a diagnostic leaves the run exactly where it found it.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn.functional as F

from ..models.layers import local_layers
from ..models.state import preserved_norm_stats
from ..rules.common import Recorder


@contextlib.contextmanager
def _untouched(model, rule):
    params = _all_params(model, rule)
    grads = [p.grad for p in params]
    state = copy.deepcopy(rule.state_dict())
    feedback = [(m, m.feedback) for _, m in local_layers(model)]
    was_training = model.training
    try:
        with preserved_norm_stats(model):
            yield
    finally:
        for p, g in zip(params, grads):
            p.grad = g
        for m, b in feedback:
            m.feedback = b
        rule.load_state_dict(state)
        model.train(was_training)


def _all_params(model, rule):
    """Every tensor a rule may write a gradient for."""
    return (list(model.parameters()) + list(rule.parameters())
            + [p for group in rule.param_groups() for p in group["params"]])


def _weight_grads(layers):
    return {name: m.weight.grad.detach().clone() for name, m in layers}


def _zero(params):
    for p in params:
        p.grad = None


def backprop_reference(model, x, y):
    """Autograd's d(sum loss)/dh per population and weight gradients, feedback slots off."""
    layers = local_layers(model)
    for _, m in layers:
        m.feedback = None
    _zero(model.parameters())
    recorder = Recorder(len(y))
    F.cross_entropy(model(x, tap=recorder), y).backward()
    return recorder.teaching(), _weight_grads(layers)


def cosine_per_example(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over examples of cos(a_i, b_i), over the examples where both are non-zero.

    A confidently classified example can have an exactly zero gradient (the
    float32 softmax saturates); its cosine is undefined, not zero, so it is left
    out rather than turned into a NaN or a fake 0. NaN only if no example is left.
    """
    a, b = a.flatten(1).double(), b.flatten(1).double()  # (B, units)
    norms = a.norm(dim=1) * b.norm(dim=1)
    keep = norms > 0
    if not keep.any():
        return float("nan")
    return float(((a * b).sum(1)[keep] / norms[keep]).mean())


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.flatten().double(), b.flatten().double()
    return float(torch.dot(a, b) / (a.norm() * b.norm()).clamp_min(1e-300))


def alignment(model, rule, x, y, population_names=None) -> dict:
    """{"teaching_cos": {population: cos}, "update_cos": {layer: cos}, and means}."""
    layers = local_layers(model)
    names = population_names or getattr(model, "population_names", None)
    with _untouched(model, rule):
        model.train()
        _zero(_all_params(model, rule))
        out = rule.compute_gradients(x, y, None, record=True)
        rule_grads = _weight_grads(layers)
        true_teaching, true_grads = backprop_reference(model, x, y)
    names = names or [f"population{i}" for i in range(len(true_teaching))]
    teaching = {n: cosine_per_example(t, g)
                for n, t, g in zip(names, out.teaching, true_teaching)}
    update = {n: _cosine(rule_grads[n], true_grads[n]) for n, _ in layers}
    return {"teaching_cos": teaching, "update_cos": update,
            "mean_teaching_cos": sum(teaching.values()) / len(teaching),
            "mean_update_cos": sum(update.values()) / len(update)}
