"""The alignment diagnostic: cosines against a direct computation, NaN where undefined."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from lab.diagnostics.alignment import alignment
from lab.models.layers import local_layers
from lab.models.mlp import MLP
from lab.rules import make_rule


def _net(seed=0):
    torch.manual_seed(seed)
    model = MLP(10, (12, 8), 5, dtype=torch.float64)
    y = torch.randint(0, 5, (16,))
    return model, torch.randn(16, 10, dtype=torch.float64), y


def _direct_update_cos(model, rule, x, y) -> dict[str, float]:
    """cos(rule's weight gradient, autograd's) per layer, computed here from scratch."""
    rule.compute_gradients(x, y, None)
    got = {n: m.weight.grad.clone() for n, m in local_layers(model)}
    plain = copy.deepcopy(model)
    for _, m in local_layers(plain):
        m.feedback = None  # the plain network: autograd's gradient is backprop's
    plain.zero_grad(set_to_none=True)
    F.cross_entropy(plain(x), y).backward()
    true = {n: m.weight.grad for n, m in local_layers(plain)}
    return {n: float(F.cosine_similarity(got[n].flatten(), true[n].flatten(), dim=0))
            for n in got}


def test_update_cosine_is_nan_only_at_the_layer_whose_input_is_silent():
    model, x, y = _net()
    x = torch.zeros_like(x)  # the first layer's input is all zero: both its updates are
    rule = make_rule("fa", model, seed=0)
    report = alignment(model, rule, x, y)
    want = _direct_update_cos(model, rule, x, y)
    update = report["update_cos"]
    assert list(update) == ["hidden.0", "hidden.1", "fc"]
    assert math.isnan(update["hidden.0"])
    for name in ("hidden.1", "fc"):  # defined layers: the direct cosine, to rounding
        assert update[name] == pytest.approx(want[name], abs=1e-12)
    assert update["fc"] == pytest.approx(1.0, abs=1e-12)  # the read-out gets the exact error
    assert abs(update["hidden.1"]) < 0.99  # fa's random feedback: a real, non-trivial cosine
    # The mean is over the defined layers and says how many those are.
    assert report["update_defined"] == 2
    assert report["mean_update_cos"] == pytest.approx((want["hidden.1"] + want["fc"]) / 2,
                                                      abs=1e-12)
    assert report["teaching_defined"] == 2 and math.isfinite(report["mean_teaching_cos"])


def test_defined_cosines_do_not_change_when_a_layer_is_undefined():
    # The same network on data: every cosine defined, each equal to the direct one.
    model, x, y = _net()
    rule = make_rule("fa", model, seed=0)
    report = alignment(model, rule, x, y)
    want = _direct_update_cos(model, rule, x, y)
    assert report["update_defined"] == 3
    for name, value in report["update_cos"].items():
        assert value == pytest.approx(want[name], abs=1e-12)
    assert report["mean_update_cos"] == pytest.approx(sum(want.values()) / 3, abs=1e-12)
    teaching = report["teaching_cos"].values()
    assert report["mean_teaching_cos"] == pytest.approx(sum(teaching) / 2, abs=1e-12)


def test_a_silent_network_is_undefined_everywhere_never_a_fake_zero():
    model, x, y = _net()
    with torch.no_grad():
        for _, m in local_layers(model):
            m.bias.zero_()
    x = torch.zeros_like(x)  # every layer's input is zero: every weight update is zero
    report = alignment(model, make_rule("bp", model), x, y)
    assert all(math.isnan(v) for v in report["update_cos"].values())
    assert math.isnan(report["mean_update_cos"]) and report["update_defined"] == 0


def test_teaching_cosine_is_nan_where_the_true_gradient_is_zero():
    # A zero read-out: no gradient reaches any population (nor any hidden weight), while
    # fa's random feedback still sends a teaching signal: one side zero, so undefined.
    model, x, y = _net()
    with torch.no_grad():
        model.fc.weight.zero_()
    rule = make_rule("fa", model, seed=0)
    report = alignment(model, rule, x, y)
    assert all(math.isnan(v) for v in report["teaching_cos"].values())
    assert math.isnan(report["mean_teaching_cos"]) and report["teaching_defined"] == 0
    update = report["update_cos"]
    assert math.isnan(update["hidden.0"]) and math.isnan(update["hidden.1"])
    assert update["fc"] == pytest.approx(1.0, abs=1e-12)
    assert report["mean_update_cos"] == update["fc"] and report["update_defined"] == 1


def _same(a, b, where="state") -> None:
    """Equal, recursively: tensors bit for bit, floats with NaN equal to NaN."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (u, v) in enumerate(zip(a, b)):
            _same(u, v, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), where
    else:
        assert a == b, where


@pytest.mark.parametrize("trained", [False, True])
@pytest.mark.parametrize("name", ["dfa", "sdil"])
def test_alignment_restores_a_rule_that_draws_or_matches_its_feedback_on_first_use(name,
                                                                                  trained):
    """dfa draws its projections and sdil its vectorisers, coefficients and predictor at
    the first call; a diagnostic before (or after) the first step leaves the rule's state
    exactly as it found it, so the run's next step is the one it would have taken."""
    from lab.models import ResNet

    def build():
        torch.manual_seed(0)
        model = ResNet(8, 4, dims=1, in_channels=1, n_classes=5, dtype=torch.float64)
        params = {} if name == "dfa" else {"a_warmup_steps": 0, "pert_directions": 2,
                                           "predictor_every": 1, "pert_every": 1,
                                           "traffic_ratio": 0.0}
        return model, make_rule(name, model, params, seed=3)

    g = torch.Generator().manual_seed(1)
    x = torch.randn(12, 1, 20, generator=g, dtype=torch.float64)
    y = torch.randint(0, 5, (12,), generator=g)
    model, rule = build()
    twin_model, twin = build()
    if trained:
        for r in (rule, twin):
            r.compute_gradients(x, y, 0)
            if name == "sdil":  # a gain and a predictor that are not zero
                r.apical.gains = [0.3] * len(r.apical.gains)
    before = copy.deepcopy(rule.state_dict())
    report = alignment(model, rule, x, y)
    assert math.isfinite(report["mean_teaching_cos"])
    _same(rule.state_dict(), before)
    model.zero_grad(set_to_none=True)
    twin_model.zero_grad(set_to_none=True)
    rule.compute_gradients(x, y, 1)
    twin.compute_gradients(x, y, 1)
    for (n, p), (_, q) in zip(model.named_parameters(), twin_model.named_parameters()):
        assert torch.equal(p.grad, q.grad), n
    _same(rule.state_dict(), twin.state_dict())


def test_norm_ratios_are_the_direct_ones_and_scale_with_the_feedback():
    # The cosine says nothing of the step's length: fa at feedback_scale s teaches the
    # hidden layer with a signal proportional to s, so the ratio doubles with s while every
    # cosine stays the same; the read-out gets the exact error (ratio 1).
    model, x, y = _net()
    reports, wants = [], []
    for scale in (1.0, 2.0):
        net = copy.deepcopy(model)
        rule = make_rule("fa", net, {"feedback_scale": scale}, seed=0)
        reports.append(alignment(net, rule, x, y))
        rule.compute_gradients(x, y, None)
        got = {n: m.weight.grad.clone() for n, m in local_layers(net)}
        plain = copy.deepcopy(net)
        for _, m in local_layers(plain):
            m.feedback = None
        plain.zero_grad(set_to_none=True)
        F.cross_entropy(plain(x), y).backward()
        wants.append({n: float(got[n].norm() / m.weight.grad.norm())
                      for n, m in local_layers(plain)})
    for report, want in zip(reports, wants):
        assert report["update_norm"] == pytest.approx(want, rel=1e-12)
        assert report["update_norm"]["fc"] == pytest.approx(1.0, rel=1e-12)
        assert report["mean_update_norm"] == pytest.approx(sum(want.values()) / 3, rel=1e-12)
    one, two = reports
    # hidden1's signal is B1 e, linear in the scale; hidden0's is B0 (relu' * B1 e),
    # quadratic; each layer's update is its population's signal times its input.
    assert two["teaching_norm"]["hidden1"] == pytest.approx(2 * one["teaching_norm"]["hidden1"],
                                                            rel=1e-9)
    assert two["teaching_norm"]["hidden0"] == pytest.approx(4 * one["teaching_norm"]["hidden0"],
                                                            rel=1e-9)
    assert two["update_norm"]["hidden.1"] == pytest.approx(2 * one["update_norm"]["hidden.1"],
                                                            rel=1e-9)
    assert two["update_norm"]["hidden.0"] == pytest.approx(4 * one["update_norm"]["hidden.0"],
                                                            rel=1e-9)
    assert two["update_cos"] == pytest.approx(one["update_cos"], abs=1e-12)
    assert two["teaching_cos"] == pytest.approx(one["teaching_cos"], abs=1e-12)
    # bp: every ratio is exactly 1
    rule = make_rule("bp", model, seed=0)
    exact = alignment(model, rule, x, y)
    assert all(v == pytest.approx(1.0, rel=1e-12) for v in
               [*exact["teaching_norm"].values(), *exact["update_norm"].values()])
