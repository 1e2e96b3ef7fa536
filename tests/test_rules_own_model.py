"""The rules on a researcher's own model: the contract (``forward(x, tap=None)``, lab
layers), and every way a model outside it was trained with a wrong gradient, silently,
or failed deep inside torch (a new user's trial). Oracles: torch.autograd on a copy, and
feedback set to the forward weights (FA == backprop exactly)."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from lab.config import ConfigError
from lab.models.layers import Linear, local_layers
from lab.rules import make_rule

FEEDBACK_RULES = ["fa", "kp", "usf", "brsf", "frsf", "wm", "rrm"]
ON_ANY_MODEL = ["bp", "dfa", *FEEDBACK_RULES]


class Net(nn.Module):
    """Three lab Linear layers, tapped after each hidden one; (B, *, 6) -> (B, 3)."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.out = Linear(6, 8), Linear(8, 8), Linear(8, 3)

    def forward(self, x, tap=None):
        h = F.relu(self.l1(x))
        h = tap(0, h) if tap else h
        h = F.relu(self.l2(h))
        h = tap(1, h) if tap else h
        logits = self.out(h)
        return logits if logits.ndim == 2 else logits.mean(1)  # (B, T, 3) -> (B, 3)


def _batch(*shape):
    g = torch.Generator().manual_seed(0)
    return torch.randn(*shape, 6, generator=g), torch.randint(0, 3, shape[:1], generator=g)


def _autograd(model, x, y) -> dict:
    twin = copy.deepcopy(model)  # (copies drop the feedback slot: exact gradients)
    F.cross_entropy(twin(x), y).backward()
    return {n: p.grad for n, p in twin.named_parameters()}


def _grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _as_weights(rule) -> None:
    with torch.no_grad():  # feedback = the forward weights: every FA rule is backprop
        for (_, module), b in zip(rule.layers, rule.feedback):
            b.copy_(module.weight)


def test_a_forward_without_tap_is_refused_at_attach():
    # nn.Sequential was accepted and failed at the first step inside torch ("unexpected
    # keyword argument 'tap'").
    for model in (nn.Sequential(Linear(6, 8), nn.ReLU(), Linear(8, 3)),
                  nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))):
        for name in ON_ANY_MODEL:
            with pytest.raises(ValueError, match=re.escape(
                    f"rule {name!r} cannot train Sequential: its forward(input) takes no tap; "
                    "the rules need forward(x, tap=None) that calls h = tap(i, h) on each "
                    "hidden population in forward order, with its Conv/Linear layers from "
                    "lab.models.layers")):
                make_rule(name, model)
    with pytest.raises(TypeError, match=r"^rule 'fa': model must be a torch nn.Module with "
                                        r"forward\(x, tap=None\) .*; got NoneType$"):
        make_rule("fa", None)


def test_dfa_refuses_a_forward_that_taps_nothing():
    # Nothing cut: the loss's backward reached every layer, and "dfa" was exact backprop.
    class Untapped(Net):
        def forward(self, x, tap=None):
            return super().forward(x)

    x, y = _batch(16)
    rule = make_rule("dfa", Untapped())
    with pytest.raises(ValueError, match=r"^rule 'dfa': Untapped.forward called tap on no "
                                         r"population, so no error would be projected"):
        rule.compute_gradients(x, y, 0)


@pytest.mark.parametrize("name", FEEDBACK_RULES)
def test_layers_registered_out_of_forward_order_are_refused(name):
    # The read-out registered first got no feedback: the layer below it then had
    # backprop's exact gradient (max |fa - bp| = 0.0), silently.
    class Reordered(Net):
        def __init__(self):
            nn.Module.__init__(self)
            self.out, self.l2, self.l1 = Linear(8, 3), Linear(8, 8), Linear(6, 8)

    x, y = _batch(16)
    rule = make_rule(name, Reordered())
    with pytest.raises(ValueError, match=re.escape(
            f"rule {name!r}: Reordered.forward calls layer 'l1' first, but 'out' is registered "
            "first; the rules take the first registered Conv/Linear as the layer that reads "
            "the data")):
        rule.compute_gradients(x, y, 0)
    good = make_rule(name, Net())  # the right order
    good.compute_gradients(x, y, 0)
    good.compute_gradients(x, y, 1)  # checked once; later steps do not ask again
    assert good._order_checked


@pytest.mark.parametrize("name", ["fa", "kp", "usf", "wm"])
def test_a_copy_of_a_rule_trains_its_copy_with_its_own_feedback(name):
    # The copy's layers dropped their feedback slot (copies of models must), while the copied
    # rule kept and reported its tensors: it computed exact backprop.
    x, y = _batch(16)
    model = Net()
    rule = make_rule(name, model, seed=3)
    twin = copy.deepcopy(rule)
    assert all(m.feedback is b for (_, m), b in zip(twin.layers, twin.feedback, strict=True))
    assert all(m.feedback is b for (_, m), b in zip(rule.layers, rule.feedback, strict=True))
    exact = _autograd(model, x, y)
    rule.compute_gradients(x, y, None)
    twin.compute_gradients(x, y, None)
    ours, theirs = _grads(rule.model), _grads(twin.model)
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
    assert (ours["l1.weight"] - exact["l1.weight"]).abs().max() > 1e-3  # not backprop


def test_a_second_rule_on_one_model_is_refused_and_detach_gives_backprop_back():
    x, y = _batch(16)
    model = Net()
    first = make_rule("fa", model, seed=0)
    with pytest.raises(ConfigError, match=r"^rule 'fa': the model's layers l2, out hold another "
                                          r"rule's feedback tensors"):
        make_rule("fa", model, seed=7)
    first.detach()
    assert all(m.feedback is None for _, m in local_layers(model))
    F.cross_entropy(model(x), y).backward()  # a plain backward is backprop again
    exact = _autograd(model, x, y)
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, exact[n]), n
    second = make_rule("kp", model)  # and another rule may take the model
    assert model.l2.feedback is second.feedback[0]
    first.detach()  # a detached rule leaves the other's tensors alone
    assert model.l2.feedback is second.feedback[0]


@pytest.mark.parametrize("name", ON_ANY_MODEL)
@pytest.mark.parametrize("y", [torch.randn(16, 3), torch.randn(16),
                               torch.randint(0, 3, (16,), dtype=torch.int32),
                               torch.randint(0, 3, (8,))])
def test_targets_that_are_not_class_indices_are_refused(name, y):
    # Float targets were read as soft labels by bp / fa / kp / wm (a silent other loss) and
    # failed deep inside dfa ("one_hot is only applicable to index tensor").
    x, _ = _batch(16)
    rule = make_rule(name, Net())
    with pytest.raises(ValueError, match=re.escape(
            "targets y must be class indices: an int64 tensor of shape (16,), one per example; "
            f"got {y.dtype} of shape {tuple(y.shape)}. The rules' loss is the batch-mean "
            "cross-entropy of the logits")):
        rule.compute_gradients(x, y, 0)


def test_kp_with_a_frozen_layer_leaves_its_feedback_alone():
    # 'NoneType' object has no attribute 'clone', at the first step.
    x, y = _batch(16)
    model = Net()
    model.l2.weight.requires_grad_(False)
    rule = make_rule("kp", model)
    _as_weights(rule)
    rule.compute_gradients(x, y, 0)
    frozen, out = rule.feedback  # l2's B, the read-out's B
    assert frozen.grad is None and model.l2.weight.grad is None
    assert torch.equal(out.grad, model.out.weight.grad)
    exact = _autograd(model, x, y)  # with B = W, the other layers' gradients are backprop's
    for n in ("l1.weight", "l1.bias", "l2.bias", "out.weight"):
        torch.testing.assert_close(dict(model.named_parameters())[n].grad, exact[n])


@pytest.mark.parametrize("change, found", [
    (lambda m: m.double(), "is torch.float32 on cpu but its weight is torch.float64 on cpu")])
def test_a_model_cast_after_its_rule_was_attached_is_named(change, found):
    # "expected m1 and m2 to have the same dtype", deep in backward.
    x, y = _batch(16)
    model = Net()
    rule = make_rule("fa", model)
    change(model)
    with pytest.raises(RuntimeError, match=re.escape(
            f"Linear's feedback tensor {found}: the model was cast or moved after its rule "
            "was attached; build the rule after model.to(...)")):
        rule.compute_gradients(x.double(), y, 0)


@pytest.mark.parametrize("name", FEEDBACK_RULES)
def test_linear_layers_on_sequences_train_and_match_backprop_with_feedback_at_w(name):
    # (B, T, D) into a lab Linear: fa/kp/usf failed in backward ("t() expects a tensor with
    # <= 2 dimensions"), wm/rrm took the probes for a convolution's.
    x, y = _batch(4, 5)
    model = Net()
    rule = make_rule(name, model, {"mirror_warmup_steps": 0} if name in ("wm", "rrm") else None)
    exact = _autograd(model, x, y)
    rule.compute_gradients(x, y, 0)  # runs (mirrors: one mirror event on (B, in) probes)
    assert all(torch.isfinite(g).all() for g in _grads(model).values())
    if name in ("fa", "kp"):  # and with B = W it is backprop, to rounding
        model.zero_grad()
        _as_weights(rule)
        rule.compute_gradients(x, y, None)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, exact[n], rtol=1e-5, atol=1e-7)


def test_a_parameter_on_the_model_itself_is_named():
    class WithScale(Net):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(()))

    with pytest.raises(ValueError, match=r"cannot handle <the model itself> \(WithScale\)\."):
        make_rule("fa", WithScale())
