"""Oracles for every learning rule (DESIGN section 4)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from lab.config import ConfigError
from lab.diagnostics.alignment import alignment, backprop_reference
from lab.models import ResNet
from lab.models.mlp import MLP
from lab.rules import RULES, make_rule, resolve_params
from lab.rules.common import output_error

FEEDBACK_RULES = ["fa", "kp", "usf", "brsf", "frsf", "wm", "rrm"]


def _model(kind, normalization="batchnorm"):
    torch.manual_seed(0)
    if kind == "mlp":  # no normalization to choose
        return MLP(12, (10, 8), 4, dtype=torch.float64), torch.randn(6, 12, dtype=torch.float64)
    dims = 1 if kind == "resnet1d" else 2
    model = ResNet(8, 4, dims=dims, in_channels=2, n_classes=4, normalization=normalization,
                   dtype=torch.float64)
    shape = (6, 2, 16) if dims == 1 else (6, 2, 8, 8)
    return model, torch.randn(*shape, dtype=torch.float64)


MODELS = ["resnet1d", "resnet2d", "mlp"]
Y = torch.tensor([0, 1, 2, 3, 0, 1])


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("name", FEEDBACK_RULES)
def test_feedback_equal_to_weights_gives_autograd(kind, name):
    """With B := W every FA-family rule computes backprop's gradients (float64)."""
    model, x = _model(kind)
    model.train()
    F.cross_entropy(model(x), Y).backward()
    expected = _grads(model)
    model.zero_grad(set_to_none=True)
    rule = make_rule(name, model, seed=0)
    with torch.no_grad():
        for (_, m), b in zip(rule.layers, rule.feedback):
            b.copy_(m.weight)
    rule.refresh = lambda: None  # keep B = W for sign-symmetry rules
    rule.compute_gradients(x, Y, None)
    for n, g in _grads(model).items():
        assert torch.allclose(g, expected[n], atol=1e-10, rtol=0), n


@pytest.mark.parametrize("kind", MODELS)
def test_fa_differs_from_autograd_with_random_feedback(kind):
    model, x = _model(kind)
    F.cross_entropy(model(x), Y).backward()
    expected = _grads(model)
    model.zero_grad(set_to_none=True)
    make_rule("fa", model, seed=0).compute_gradients(x, Y, None)
    first = next(n for n, _ in model.named_parameters())
    assert not torch.allclose(_grads(model)[first], expected[first])


def test_kp_difference_decays_geometrically():
    """Plain SGD: ||W - B||_t = (1 - lr * wd)^t ||W - B||_0 per layer."""
    model, x = _model("resnet2d")
    rule = make_rule("kp", model, seed=0)
    lr, wd, steps = 0.05, 0.1, 6
    opt = torch.optim.SGD(list(model.parameters()) + rule.parameters(), lr=lr,
                          weight_decay=wd)
    gap0 = [(m.weight - b).norm().item() for (_, m), b in zip(rule.layers, rule.feedback)]
    for t in range(steps):
        opt.zero_grad(set_to_none=True)
        rule.compute_gradients(x, Y, t)
        opt.step()
    for g0, ((_, m), b) in zip(gap0, zip(rule.layers, rule.feedback)):
        expected = g0 * (1 - lr * wd) ** steps
        assert abs((m.weight - b).norm().item() - expected) < 1e-10 * max(1.0, g0)


@pytest.mark.parametrize("name", ["wm", "rrm"])
def test_mirrors_align_feedback_with_fixed_weights(name):
    model, x = _model("resnet2d")
    rule = make_rule(name, model, {"mirror_batch_size": 512, "mirror_every": 1}, seed=0)
    before = rule.epoch_metrics()["feedback"]["min_cos"]
    for step in range(60):
        rule.compute_gradients(x, Y, step)
        model.zero_grad(set_to_none=True)
    after = rule.epoch_metrics()["feedback"]
    assert before < 0.5 < 0.99 < after["min_cos"], (before, after["min_cos"])
    if name == "rrm":
        assert after["max_rel_err"] < 0.1  # the regression converges to W itself


@pytest.mark.parametrize("name", ["usf", "brsf", "frsf"])
def test_sign_symmetry_feedback_has_the_weights_signs(name):
    model, x = _model("resnet2d")
    rule = make_rule(name, model, seed=0)
    rule.compute_gradients(x, Y, 0)
    for (_, m), b in zip(rule.layers, rule.feedback):
        assert torch.equal(torch.sign(b), torch.sign(m.weight))


def test_brsf_draws_fresh_magnitudes_and_frsf_keeps_them():
    model, x = _model("resnet2d")
    for name, same in [("brsf", False), ("frsf", True)]:
        rule = make_rule(name, model, seed=0)
        rule.compute_gradients(x, Y, 0)
        first = rule.feedback[0].clone()
        rule.compute_gradients(x, Y, 1)
        assert torch.equal(first.abs(), rule.feedback[0].abs()) is same
        for _, m in rule.layers:
            m.feedback = None


def test_dfa_teaching_is_projected_error_gated_by_local_derivative():
    model, x = _model("resnet2d", normalization="none")
    rule = make_rule("dfa", model, seed=0)
    out = rule.compute_gradients(x, Y, 0, record=True)
    e = output_error(out.logits, Y)  # (B, K)
    for signal, d in zip(out.teaching, rule.projections):
        assert torch.allclose(signal.flatten(1), e @ d, atol=1e-12)
    # The stem: relu(conv(x)); its update is corr(x, relu'(z) * e.D_0) / B.
    with torch.no_grad():
        z = F.conv2d(x, model.stem.weight, model.stem.bias, 1, 1)
    local = (z > 0).double() * out.teaching[0] / len(Y)
    expected = torch.nn.grad.conv2d_weight(x, model.stem.weight.shape, local, 1, 1)
    assert torch.allclose(model.stem.weight.grad, expected, atol=1e-12)


@pytest.mark.parametrize("kind, directions", [("mlp", 4000), ("resnet1d", 12000)])
def test_nodepert_estimate_is_unbiased(kind, directions):
    """Error ~ ||g|| sqrt(units / directions): more units need more directions.

    Without batch norm: the per-example estimate ignores how one example's noise
    moves the others' losses through batch statistics, as DESIGN specifies.
    """
    model, x = _model(kind, normalization="none")
    rule = make_rule("nodepert", model, {"pert_sigma": 1e-4, "pert_directions": directions},
                     seed=0)
    model.train()
    out = rule.compute_gradients(x, Y, None, record=True)
    true, _ = backprop_reference(model, x, Y)
    for est, g in zip(out.teaching, true):
        cos = F.cosine_similarity(est.flatten(), g.flatten(), dim=0)
        assert cos > 0.9, cos


def test_nodepert_leaves_norm_statistics_alone():
    model, x = _model("resnet2d")
    rule = make_rule("nodepert", model, {"pert_directions": 3}, seed=0)
    reference, _ = _model("resnet2d")
    model.train(), reference.train()
    rule.compute_gradients(x, Y, 0)
    with torch.no_grad():
        reference(x)  # one clean train-mode pass
    for (n, a), (_, b) in zip(model.named_buffers(), reference.named_buffers()):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("name", sorted(RULES))
def test_alignment_is_complete_and_leaves_state(name):
    model, x = _model("resnet2d")
    rule = make_rule(name, model, seed=0)
    rule.compute_gradients(x, Y, 0)  # lazily built state (shapes, projections)
    model.zero_grad(set_to_none=True)
    params = {n: p.clone() for n, p in model.named_parameters()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    report = alignment(model, rule, x, Y)
    assert set(report["teaching_cos"]) == set(model.population_names)
    assert set(report["update_cos"]) == {n for n, _ in rule_layers(model)}
    assert all(-1 - 1e-12 <= v <= 1 + 1e-12 for v in report["teaching_cos"].values())
    for n, p in model.named_parameters():
        assert torch.equal(p, params[n]) and p.grad is None
    for n, b in model.named_buffers():
        assert torch.equal(b, buffers[n]), n
    if name == "bp":
        assert min(report["teaching_cos"].values()) > 1 - 1e-9
        assert min(report["update_cos"].values()) > 1 - 1e-9


def rule_layers(model):
    from lab.models.layers import local_layers
    return local_layers(model)


@pytest.mark.parametrize("name, params, message", [
    ("fa", {"feedback_scale": 0.0}, r"feedback_scale=0.0 is out of range"),
    ("fa", {"feedback_seed": -1}, r"feedback_seed=-1 is out of range"),
    ("wm", {"mirror_every": 0}, r"mirror_every=0 is out of range"),
    ("wm", {"mirror_batch_size": 0}, r"mirror_batch_size=0 is out of range"),
    ("wm", {"mirror_lr": 1.5}, r"mirror_lr=1.5 is out of range"),
    ("wm", {"mirror_decay": 1.0}, r"mirror_decay=1.0 is out of range"),
    ("rrm", {"mirror_sigma": -1.0}, r"mirror_sigma=-1.0 is out of range"),
    ("rrm", {"mirror_warmup_steps": -2}, r"mirror_warmup_steps=-2 is out of range"),
    ("nodepert", {"pert_sigma": 0.0}, r"pert_sigma=0.0 is out of range"),
    ("nodepert", {"pert_directions": 0}, r"pert_directions=0 is out of range"),
    ("dfa", {"feedback_scale": -1.0}, r"feedback_scale=-1.0 is out of range"),
    ("kp", {"mirror_every": 3}, r"no field\(s\) 'mirror_every'"),
    ("bp", {"feedback_scale": 1.0}, r"no field\(s\) 'feedback_scale'"),
])
def test_bad_rule_parameters(name, params, message):
    with pytest.raises(ConfigError, match=message):
        resolve_params(name, params)


@pytest.mark.parametrize("name", [n for n in sorted(RULES) if n != "bp"])
def test_unsupported_model_names_its_layers(name):
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"cannot handle 0 \(Linear\), 2 \(Linear\)"):
        make_rule(name, model)


def test_unknown_rule_lists_known():
    with pytest.raises(ConfigError, match=r"unknown rule 'hebb'; known rules: bp, brsf"):
        make_rule("hebb", nn.Linear(2, 2))


def test_per_example_cosine_skips_examples_without_gradient():
    from lab.diagnostics.alignment import cosine_per_example
    a = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0]])
    b = torch.tensor([[1.0, 0.0], [1.0, 0.0], [-1.0, -1.0]])
    assert abs(cosine_per_example(a, b)) < 1e-12  # mean of (1, -1); the zero row is undefined
    assert cosine_per_example(a[1:2], b[1:2]) != cosine_per_example(a[1:2], b[1:2])  # NaN


def _constrained_params():
    import dataclasses
    for name in sorted(RULES):
        for f in dataclasses.fields(RULES[name].Params):
            if "range" in f.metadata:
                yield name, f


@pytest.mark.parametrize("name, f", list(_constrained_params()),
                         ids=lambda v: v if isinstance(v, str) else v.name)
def test_every_rule_parameter_refuses_out_of_range(name, f):
    lo, hi, lo_open, hi_open = f.metadata["range"]
    bad = (lo if lo_open else lo - 1) if lo is not None else (hi if hi_open else hi + 1)
    bad = float(bad) if isinstance(f.default, float) else int(bad)
    with pytest.raises(ConfigError, match=rf"{f.name}={bad!r} is out of range; allowed: "):
        resolve_params(name, {f.name: bad})
    with pytest.raises(ConfigError, match=rf"{f.name} must be"):
        resolve_params(name, {f.name: "x"})
