"""Alignment of a rule's credit with the true gradient, at one state.

Per population: the mean over examples of cos(teaching signal, autograd's
d(sum loss)/dh). Per layer: cos(the rule's weight update, backprop's weight
update). Both are measured on the same batch in training mode (batch
statistics, as the step itself uses them) with BN running statistics, the
rule's state (feedback tensors, generators) and the gradients restored
afterwards, so a diagnostic leaves the run exactly where it found it.

A cosine with an all-zero side is 0/0: undefined, recorded as NaN, never as a
fake 0 that would read as "orthogonal to backprop". That happens at a silent
layer: its input is all zero, so both weight updates are; or a population whose
true gradient is zero on every probe example. Both means (over populations,
over layers) are over the entries where the cosine is defined, as
``analysis.mt1`` does for the signal alignments, and ``teaching_defined`` /
``update_defined`` count those entries, so a collapsed network's mean is read
with how little it covers; a mean over none is NaN.
"""

from __future__ import annotations

import contextlib
import copy
import math

import torch

from ..models.layers import local_layers
from ..models.state import preserved_norm_stats
from ..rules.base import check_step_result
from ..rules.common import backprop_reference, cosine_per_example

__all__ = ["alignment", "backprop_reference", "cosine_per_example"]


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


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """cos(a, b) over all entries; NaN where either is all zero (0/0 is undefined)."""
    a, b = a.flatten().double(), b.flatten().double()
    norms = a.norm() * b.norm()
    if not norms > 0:
        return float("nan")
    return float(torch.dot(a, b) / norms)


def _defined_mean(values) -> tuple[float, int]:
    """(mean over the finite values, how many there are); NaN over none."""
    defined = [v for v in values if math.isfinite(v)]
    return (sum(defined) / len(defined) if defined else float("nan")), len(defined)


def _norm_ratio(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a|| / ||b|| over all entries; NaN where b is all zero."""
    bottom = b.double().norm()
    return float(a.double().norm() / bottom) if bottom > 0 else float("nan")


def alignment(model, rule, x, y, population_names=None) -> dict:
    """{"teaching_cos": {population: cos}, "update_cos": {layer: cos}, their means over
    the defined (finite) cosines, and how many those are (see the module docstring); and
    the scale beside the direction: "teaching_norm" {population: ||teaching|| /
    ||true gradient||} and "update_norm" {layer: ||rule's update|| / ||backprop's||}
    over the whole batch, with their means over the defined entries. A cosine near 1 at a
    norm ratio of 0.05 is a step twenty times shorter than backprop's at the same rate.}"""
    layers = local_layers(model)
    names = population_names or getattr(model, "population_names", None)
    with _untouched(model, rule):
        model.train()
        _zero(_all_params(model, rule))
        out = check_step_result(rule, rule.compute_gradients(x, y, None, record=True))
        rule_grads = _weight_grads(layers)
        true_teaching, true_grads = backprop_reference(model, x, y)
    names = names or [f"population{i}" for i in range(len(true_teaching))]
    teaching = {n: cosine_per_example(t, g)
                for n, t, g in zip(names, out.teaching, true_teaching)}
    update = {n: _cosine(rule_grads[n], true_grads[n]) for n, _ in layers}
    teaching_norm = {n: _norm_ratio(t, g) for n, t, g in zip(names, out.teaching, true_teaching)}
    update_norm = {n: _norm_ratio(rule_grads[n], true_grads[n]) for n, _ in layers}
    mean_teaching, teaching_defined = _defined_mean(teaching.values())
    mean_update, update_defined = _defined_mean(update.values())
    return {"teaching_cos": teaching, "update_cos": update,
            "mean_teaching_cos": mean_teaching, "teaching_defined": teaching_defined,
            "mean_update_cos": mean_update, "update_defined": update_defined,
            "teaching_norm": teaching_norm, "update_norm": update_norm,
            "mean_teaching_norm": _defined_mean(teaching_norm.values())[0],
            "mean_update_norm": _defined_mean(update_norm.values())[0]}
