"""The compute bill: forward MACs from the architecture vs hooks, per-rule components."""

from __future__ import annotations

import pytest
import torch

from lab.diagnostics.work import bill, forward_macs, hook_macs
from lab.models import ResNet
from lab.models.mlp import MLP
from lab.rules import RULES, make_rule

CASES = [
    (dict(depth=8, width=4, dims=1, in_channels=1), (1, 40)),
    (dict(depth=20, width=16, dims=1, in_channels=1), (1, 40)),
    (dict(depth=14, width=8, dims=2, in_channels=3), (3, 32, 32)),
    (dict(depth=8, width=4, dims=2, in_channels=3), (3, 7, 9)),  # odd sizes: ceil on stride
]


@pytest.mark.parametrize("kwargs, shape", CASES)
def test_forward_count_equals_hook_count(kwargs, shape):
    model = ResNet(**kwargs)
    analytic = model.layer_macs(shape)
    hooked = hook_macs(model, torch.randn(2, *shape))
    assert analytic == hooked
    assert forward_macs(model, shape) == sum(hooked.values())


def test_mlp_count_equals_hook_count():
    model = MLP(12, (10, 8), 4)
    assert model.layer_macs((12,)) == hook_macs(model, torch.randn(2, 12))


def test_resnet20_forward_macs_independent_formula():
    # 1-D ResNet-20, width 16, length 40: stem + 3 stages of 3 blocks (2 convs each) + fc.
    expected = 16 * 40 * 1 * 3
    for c_in, c_out, length in [(16, 16, 40), (16, 32, 20), (32, 64, 10)]:
        expected += c_out * length * c_in * 3 + 5 * c_out * length * c_out * 3
    expected += 64 * 10
    assert forward_macs(ResNet(20, 16, dims=1, in_channels=1), (1, 40)) == expected


def _bill(name, **params):
    model = ResNet(8, 4, dims=1, in_channels=1)
    rule = make_rule(name, model, params, seed=0)
    x, y = torch.randn(4, 1, 16), torch.tensor([0, 1, 2, 3])
    rule.compute_gradients(x, y, 0)
    return bill(rule, model, (1, 16), examples=100), forward_macs(model, (1, 16))


def test_bp_reverse_is_twice_forward():
    work, f = _bill("bp")
    assert work["macs"] == {"forward": 100 * f, "bp_reverse": 200 * f}


def test_kp_extra_over_fa_is_only_the_feedback_update():
    kp, f = _bill("kp")
    fa, _ = _bill("fa")
    extra = {k: v - fa["macs"].get(k, 0) for k, v in kp["macs"].items()}
    assert {k: v for k, v in extra.items() if v} == {"feedback_update": 100 * f}


def test_mirror_bill_counts_probe_passes():
    wm, f = _bill("wm", mirror_batch_size=8)
    rrm, _ = _bill("rrm", mirror_batch_size=8)
    assert wm["macs"]["mirror"] == 2 * 8 * f  # one event: response + correlation
    assert rrm["macs"]["mirror"] == 3 * 8 * f  # plus the prediction B x


def test_nodepert_bill_counts_perturbed_passes_and_elementwise_apart():
    work, f = _bill("nodepert", pert_directions=3)
    assert work["macs"]["perturbation"] == 3 * 100 * f
    assert work["elementwise"]["perturbation"] > 0
    assert "perturbation" not in work["macs"] or work["total_macs"] == sum(work["macs"].values())


@pytest.mark.parametrize("name", sorted(RULES))
def test_every_rule_bills_the_forward_pass(name):
    work, f = _bill(name)
    assert work["macs"]["forward"] == 100 * f
    assert work["total_macs"] == sum(work["macs"].values())
