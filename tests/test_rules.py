"""Oracles for every learning rule (DESIGN section 4)."""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_rule_contracts import SIX

from lab.config import ConfigError
from lab.diagnostics.alignment import alignment, backprop_reference
from lab.models import Linear, ResNet
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
def test_fa_against_an_autograd_copy_of_the_model(kind):
    """A deepcopy of the model carries no feedback, so it computes backprop's gradients.

    The read-out's update needs no feedback (equal to autograd's); the layer
    below it gets e . B_fc in place of e . W_fc; with B random and independent
    of W its update is far from backprop's.
    """
    model, x = _model(kind)
    rule = make_rule("fa", model, seed=0)
    twin = copy.deepcopy(model)
    assert all(m.feedback is None for _, m in twin.layers)
    rule.compute_gradients(x, Y, None)
    F.cross_entropy(twin(x), Y).backward()
    assert torch.allclose(model.fc.weight.grad, twin.fc.weight.grad, atol=1e-12, rtol=0)
    below = rule.layers[-2][0]  # the last layer under the read-out
    got = dict(model.named_parameters())[below + ".weight"].grad
    want = dict(twin.named_parameters())[below + ".weight"].grad
    assert abs(_cos(got, want)) < 0.5, _cos(got, want)


def _cos(a, b):
    """cos without an epsilon clamp: a zero norm gives NaN, which fails any comparison."""
    a, b = a.flatten().double(), b.flatten().double()
    return float(torch.dot(a, b) / (a.norm() * b.norm()))


def _init_ratios(kind, name, scale, seed):
    torch.manual_seed(seed)
    if kind == "mlp":
        model = MLP(40, (100, 50), 10)
    else:
        model = ResNet(20, 16, dims=1 if kind == "resnet1d" else 2, in_channels=1 if
                       kind == "resnet1d" else 3)
    rule = make_rule(name, model, {"feedback_scale": scale}, seed=seed)
    return model, rule, rule.epoch_metrics()["feedback"]["norm_ratio"]


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("name, scale", [("fa", 1.0), ("fa", 0.5), ("kp", 1.0), ("wm", 2.0),
                                         ("frsf", 1.0), ("brsf", 0.5)])
def test_feedback_norm_matches_the_forward_weights_at_initialisation(kind, name, scale):
    """E ||B_l|| / ||W_l|| = feedback_scale for every layer that has a B (within 5%)."""
    seeds = range(6)
    runs = [_init_ratios(kind, name, scale, seed) for seed in seeds]
    model, rule, _ = runs[0]
    first = model.layers[0]
    # The first layer reads the data: no B, no tracking.
    assert first[1].feedback is None and first[0] not in runs[0][2]
    assert [n for n, _ in rule.layers] == [n for n, _ in model.layers[1:]]
    for layer in runs[0][2]:
        mean = sum(r[layer] for _, _, r in runs) / len(runs)
        assert abs(mean / scale - 1) < 0.05, (layer, mean)


@pytest.mark.parametrize("kind", MODELS)
def test_usf_magnitude_is_its_stated_scale(kind):
    """|B| = feedback_scale x rms(W at construction) everywhere, so ||B|| / ||W|| = scale."""
    model, rule, _ = _init_ratios(kind, "usf", 0.5, 0)
    x = torch.randn(4, *{"mlp": (40,), "resnet1d": (1, 40), "resnet2d": (3, 8, 8)}[kind])
    rule.compute_gradients(x, torch.tensor([0, 1, 2, 3]), 0)
    for (_, m), b in zip(rule.layers, rule.feedback):
        rms = float(m.weight.detach().double().pow(2).mean().sqrt())
        assert torch.allclose(b.abs().double(), torch.full_like(b, 0.5 * rms).double(),
                              rtol=1e-6, atol=0)
    ratios = rule.epoch_metrics()["feedback"]["norm_ratio"]
    assert all(abs(r - 0.5) < 1e-4 for r in ratios.values()), ratios


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_kp_difference_decays_geometrically(clip):
    """Plain SGD: ||W - B||_t = (1 - lr * wd)^t ||W - B||_0 per layer, clipped or not."""
    model, x = _model("resnet2d")
    rule = make_rule("kp", model, seed=0)
    lr, wd, steps = 0.05, 0.1, 6
    opt = torch.optim.SGD(list(model.parameters()) + rule.parameters(), lr=lr,
                          weight_decay=wd)
    gap0 = [(m.weight - b).norm().item() for (_, m), b in zip(rule.layers, rule.feedback)]
    for t in range(steps):
        opt.zero_grad(set_to_none=True)
        rule.compute_gradients(x, Y, t)
        if clip:
            assert rule.clip_gradients(clip) > clip  # clipping is active
        opt.step()
    for g0, ((_, m), b) in zip(gap0, zip(rule.layers, rule.feedback)):
        expected = g0 * (1 - lr * wd) ** steps
        assert abs((m.weight - b).norm().item() - expected) < 1e-10 * max(1.0, g0)


def test_kp_clip_norm_is_the_models_and_b_gets_ws_clipped_update():
    model, x = _model("resnet2d")
    rule = make_rule("kp", model, seed=0)
    rule.compute_gradients(x, Y, 0)
    model_norm = torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item()
    max_norm = model_norm / 3
    assert abs(rule.clip_gradients(max_norm) - model_norm) < 1e-12 * model_norm
    clipped = torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item()
    assert abs(clipped - max_norm) < 1e-6 * max_norm  # torch's 1e-6 guard
    for (_, m), b in zip(rule.layers, rule.feedback):
        assert torch.equal(b.grad, m.weight.grad)
    # A norm under the limit leaves every gradient as it was.
    before = [p.grad.clone() for p in model.parameters()]
    assert rule.clip_gradients(10 * max_norm) == pytest.approx(max_norm, rel=1e-6)
    assert all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters()))


def _ghost_gap(optimizer_cls, gap0, settings, **kwargs):
    """W - B's law: the same optimizer stepping a tensor whose gradient is always zero.

    W and B get the same gradient, so for a decay that acts on each tensor
    alone (SGD's L2 with momentum, AdamW's decoupled decay) W - B evolves as a
    parameter with zero gradient would. Adam's L2 decay enters its moments,
    where it does not.
    """
    ghost = [g.clone().requires_grad_(True) for g in gap0]
    opt = optimizer_cls(ghost, **kwargs)
    for setting in settings:  # per step, what the schedule set (lr, momentum or betas)
        opt.param_groups[0].update(setting)
        for g in ghost:
            g.grad = torch.zeros_like(g)
        opt.step()
    return [g.detach() for g in ghost]


@pytest.mark.parametrize("optimizer, grad_clip", [("sgd", 0.5), ("adam", 0.0), ("adam", 0.5)])
def test_kp_decay_law_under_the_trainers_optimizers(optimizer, grad_clip, tiny):
    """The trainer's optimizer, schedule and clipping: W - B follows the decay law alone."""
    from lab.train.conv import ConvConfig, build_run

    config = ConvConfig(**{**tiny, "rule": "kp", "dtype": "float64", "optimizer": optimizer,
                           "grad_clip": grad_clip, "weight_decay": 0.05, "lr": 0.01})
    run = build_run(config)
    rule, opt = run.rule, run.optimizer
    gap0 = [(m.weight - b).detach().clone() for (_, m), b in zip(rule.layers, rule.feedback)]
    settings, clipped = [], 0
    x, y = run.data.train.x[:64], run.data.train.y[:64]
    for step in range(5):
        settings.append({k: v for k, v in opt.param_groups[0].items()
                         if k in ("lr", "momentum", "betas")})
        opt.zero_grad(set_to_none=True)
        rule.compute_gradients(x, y, step)
        if grad_clip:
            clipped += rule.clip_gradients(grad_clip) > grad_clip
        opt.step()
        run.scheduler.step()
    assert clipped == (5 if grad_clip else 0)
    if optimizer == "sgd":
        expected = _ghost_gap(torch.optim.SGD, gap0, settings, momentum=0.9,
                              nesterov=opt.param_groups[0]["nesterov"], weight_decay=0.05)
    else:
        assert isinstance(opt, torch.optim.AdamW), type(opt)
        # Decoupled decay: (1 - lr_t wd) per step, whatever Adam's moments do.
        expected = [g * math.prod(1 - s["lr"] * 0.05 for s in settings) for g in gap0]
    assert len(expected) == len(run.model.layers) - 1  # every layer but the stem
    for g0, e, ((_, m), b) in zip(gap0, expected, zip(rule.layers, rule.feedback)):
        gap = (m.weight - b).detach()
        assert torch.allclose(gap, e, rtol=0, atol=1e-9 * float(e.abs().max())), (
            float((gap - e).abs().max()))
        assert float(e.norm() / g0.norm()) < 1 - 1e-4  # the decay acted


def test_kp_law_fails_under_adam_with_l2_decay():
    """Why ``adam`` is AdamW: with L2 inside Adam's moments W - B leaves the law."""
    model, x = _model("resnet2d")
    rule = make_rule("kp", model, seed=0)
    opt = torch.optim.Adam(list(model.parameters()) + rule.parameters(), lr=0.01,
                           weight_decay=0.1)
    gap0 = [(m.weight - b).detach().clone() for (_, m), b in zip(rule.layers, rule.feedback)]
    for t in range(5):
        opt.zero_grad(set_to_none=True)
        rule.compute_gradients(x, Y, t)
        opt.step()
    law = [g * (1 - 0.01 * 0.1) ** 5 for g in gap0]
    errors = [float(((m.weight - b).detach() - e).norm() / e.norm())
              for e, ((_, m), b) in zip(law, zip(rule.layers, rule.feedback))]
    assert max(errors) > 0.01, errors


def _mirrored(name, params, events, kind="resnet1d20"):
    """A fixed W and ``events`` mirror events; feedback tracking after each."""
    torch.manual_seed(0)
    if kind == "resnet1d20":
        model, x = ResNet(20, 16, dims=1, in_channels=1, dtype=torch.float64), \
            torch.randn(2, 1, 40, dtype=torch.float64)
    else:
        model, x = _model(kind)
    rule = make_rule(name, model, params, seed=0)
    rule.compute_gradients(x, Y[:len(x)], None)  # shapes only: no event without a step
    assert rule.events == 0
    history = []
    for _ in range(events):
        rule.mirror_event()
        history.append(rule.epoch_metrics()["feedback"])
    return model, rule, history


def _samples(rule, model):
    """Probe samples per event and layer: probes x output positions (independent count)."""
    x = torch.zeros(1, 1, 40, dtype=torch.float64)
    positions = {}
    hooks = [m.register_forward_hook(lambda mod, i, o, n=n: positions.__setitem__(n, o[0, 0]
                                                                                 .numel()))
             for n, m in model.layers]
    model.eval()
    model(x)
    for h in hooks:
        h.remove()
    return {n: rule.params.mirror_batch_size * positions[n] for n, _ in rule.layers}


def test_wm_at_the_defaults_settles_at_the_stated_floor():
    """1 - cos(B, W) -> decay r / (2 (2 - decay)), r = (fan_in + 1) / samples (the docstring).

    At the defaults the 1-D ResNet-20 read-out (fan_in 64, 32 probes) settles
    near cos 0.95; every layer is checked against its own floor.
    """
    model, rule, history = _mirrored("wm", {}, 100)
    d = rule.params.mirror_decay
    samples = _samples(rule, model)
    late = history[40:]  # after ~4 time constants 1 / (2 decay)
    for name, m in rule.layers:
        r = (m.weight[0].numel() + 1) / samples[name]
        floor = d * r / (2 * (2 - d))
        measured = 1 - sum(h["cos"][name] for h in late) / len(late)
        assert 0.8 < measured / floor < 1.25, (name, measured, floor)
    fc = 1 - sum(h["cos"]["fc"] for h in late) / len(late)
    assert 0.94 < 1 - fc < 0.96


@pytest.mark.parametrize("sigma", [0.3, 3.0])
def test_wm_scale_is_lr_over_decay_for_any_probe_sigma(sigma):
    """B -> (eta / decay) W: a norm ratio, not only a direction, with s != 1."""
    model, rule, history = _mirrored(
        "wm", {"mirror_lr": 0.05, "mirror_decay": 0.1, "mirror_sigma": sigma,
               "mirror_batch_size": 256}, 60, kind="resnet2d")
    final = history[-1]
    for name, _ in rule.layers:
        assert abs(final["norm_ratio"][name] - 0.5) < 0.05, (name, final["norm_ratio"][name])
        assert final["cos"][name] > 0.97


@pytest.mark.parametrize("sigma", [0.3, 3.0])
def test_rrm_converges_to_w_for_any_probe_sigma(sigma):
    model, rule, history = _mirrored("rrm", {"mirror_sigma": sigma, "mirror_lr": 0.5}, 40,
                                     kind="resnet2d")
    final = history[-1]
    assert history[0]["max_rel_err"] > 0.1
    assert final["max_rel_err"] < 1e-3, final["rel_err"]
    assert all(abs(v - 1) < 1e-3 for v in final["norm_ratio"].values())


@pytest.mark.parametrize("lr", [0.1, 0.66, 0.7, 1.0])
def test_rrm_converges_for_every_allowed_mirror_lr(lr):
    """Plain LMS diverges once eta > 2 / (1 + r): 0.66 at this read-out (r = 65 / 32).

    60 events on a fixed W (issue 9 measured 17.7 and 8.6e8 relative error at
    0.7 and 1.0 before the cap); the step is capped at the LMS optimum.
    """
    model, rule, history = _mirrored("rrm", {"mirror_lr": lr}, 60)
    samples = _samples(rule, model)
    for (name, m), rate in zip(rule.layers, rule.rates):
        r = (m.weight[0].numel() + 1) / samples[name]
        assert rate == pytest.approx(min(lr, 1 / (1 + r)), rel=1e-12)
    final = history[-1]["rel_err"]
    for name in ("fc", "blocks.8.conv2", "blocks.0.conv1"):
        assert final[name] < 1e-2, (name, final[name])
        assert max(h["rel_err"][name] for h in history) <= history[0]["rel_err"][name] * 1.5


@pytest.mark.parametrize("name", ["usf", "brsf", "frsf"])
def test_sign_symmetry_feedback_has_the_weights_signs(name):
    model, x = _model("resnet2d")
    rule = make_rule(name, model, seed=0)
    rule.compute_gradients(x, Y, 0)
    for (_, m), b in zip(rule.layers, rule.feedback):
        assert torch.equal(torch.sign(b), torch.sign(m.weight))


@pytest.mark.parametrize("name", ["usf", "brsf", "frsf"])
def test_sign_symmetry_update_is_not_backprops(name):
    """The read-out's update is exact; below it, B = sign(W) |.| is not W."""
    model, x = _model("resnet2d")
    twin = copy.deepcopy(model)
    rule = make_rule(name, model, seed=0)
    rule.compute_gradients(x, Y, 0)
    F.cross_entropy(twin(x), Y).backward()
    assert torch.allclose(model.fc.weight.grad, twin.fc.weight.grad, atol=1e-12, rtol=0)
    stem, want = model.stem.weight.grad, twin.stem.weight.grad
    assert _cos(stem, want) < 0.999  # B has W's signs, not W


def test_brsf_draws_fresh_magnitudes_and_frsf_keeps_them():
    """brsf: |B| ~ |N(0, s^2)| afresh (mean s sqrt(2 / pi)); frsf: the first draw, kept."""
    torch.manual_seed(0)
    for name, same in [("brsf", False), ("frsf", True)]:
        model = ResNet(20, 16, dims=2, in_channels=3, dtype=torch.float64)
        x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
        rule = make_rule(name, model, seed=0)
        rule.compute_gradients(x, Y[:4], 0)
        first = rule.feedback[-2].clone()
        rule.compute_gradients(x, Y[:4], 1)
        assert torch.equal(first.abs(), rule.feedback[-2].abs()) is same
        for b, s in zip(rule.feedback, rule.scales):
            if b.numel() >= 2000:
                assert abs(float(b.abs().mean()) / (s * math.sqrt(2 / math.pi)) - 1) < 0.05


def test_segment_cut_computes_no_input_gradient():
    """dfa and nodepert cut with a plain detach: no cut tensor gets a .grad."""
    from lab.rules import common

    for name in ("dfa", "nodepert"):
        model, x = _model("resnet2d")
        rule = make_rule(name, model, seed=0)
        cuts = []
        original = common.Segments.__call__

        def spy(self, index, h, original=original, cuts=cuts):
            cut = original(self, index, h)
            cuts.append(cut)
            return cut
        common.Segments.__call__ = spy
        try:
            rule.compute_gradients(x, Y, 0)
        finally:
            common.Segments.__call__ = original
        assert len(cuts) == len(model.population_names)
        assert all(c.grad is None and not c.requires_grad for c in cuts)
        assert all(p.grad is not None for p in model.parameters())


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


def test_dfa_projection_has_the_stated_std():
    """D_l ~ N(0, (feedback_scale / sqrt(K))^2): checked on a layer with many entries."""
    torch.manual_seed(0)
    model = ResNet(20, 16, dims=1, in_channels=1, n_classes=10, dtype=torch.float64)
    x = torch.randn(4, 1, 40, dtype=torch.float64)
    for scale in (1.0, 0.3):
        rule = make_rule("dfa", model, {"feedback_scale": scale}, seed=0)
        rule.compute_gradients(x, Y[:4], None)
        assert [d.shape for d in rule.projections][0] == (10, 16 * 40)
        for d in rule.projections:
            assert abs(float(d.std()) / (scale / math.sqrt(10)) - 1) < 0.05
            assert abs(float(d.mean())) < 0.05 * scale / math.sqrt(10) * 10


@pytest.mark.parametrize("kind, directions", [("mlp", 4000), ("resnet1d", 12000)])
def test_nodepert_estimate_is_unbiased(kind, directions):
    """Direction and magnitude: <est, g> / ||g||^2 -> 1, and the spread is the estimator's.

    Error ~ ||g|| sqrt(units / directions): more units need more directions.
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
        est, g = est.flatten().double(), g.flatten().double()
        noise = (est - g).norm() / g.norm()
        units = g.numel()
        assert noise < 2 * math.sqrt(units / directions), noise  # the estimator's own spread
        assert _cos(est, g) > 0.9
        # The projection on g is unbiased; its noise is ~ noise / sqrt(units).
        assert abs(float(torch.dot(est, g) / g.norm() ** 2) - 1) < 0.1


def test_nodepert_runs_its_passes_in_full_float32():
    """TF32 is switched off during the clean and perturbed passes and restored after."""
    model, x = _model("resnet2d")
    rule = make_rule("nodepert", model, {"pert_directions": 2}, seed=0)
    conv = torch.backends.cudnn.conv
    seen = []
    # The read-out runs once per pass: the clean one, then one per population and direction.
    model.fc.register_forward_pre_hook(lambda mod, args: seen.append(conv.fp32_precision))
    before = conv.fp32_precision
    rule.compute_gradients(x, Y, 0)
    assert len(seen) == 1 + 2 * len(model.population_names) and set(seen) == {"ieee"}
    assert conv.fp32_precision == before


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
    rule = make_rule(name, model, SIX.get(name, {}), seed=0)
    rule.prepare(x, Y)  # the traffic gains (kp_traffic, sdil), lhfa's warm-up
    rule.compute_gradients(x, Y, 0)  # lazily built state (shapes, projections)
    model.zero_grad(set_to_none=True)
    params = {n: p.clone() for n, p in model.named_parameters()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    state = copy.deepcopy(rule.state_dict())
    model.eval()
    report = alignment(model, rule, x, Y)
    assert not model.training  # the mode is restored
    assert set(report["teaching_cos"]) == set(model.population_names)
    assert set(report["update_cos"]) == {n for n, _ in rule_layers(model)}
    for n, p in model.named_parameters():
        assert torch.equal(p, params[n]) and p.grad is None
    for n, b in model.named_buffers():
        assert torch.equal(b, buffers[n]), n
    _assert_same_state(rule.state_dict(), state)
    if name == "bp":
        assert min(report["teaching_cos"].values()) > 1 - 1e-9
        assert min(report["update_cos"].values()) > 1 - 1e-9


def _assert_same_state(a, b):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b) or torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same_state(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for u, v in zip(a, b):
            _assert_same_state(u, v)
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b)
    else:
        assert a == b


def test_alignment_matches_a_hand_computed_value_in_training_mode():
    """fa on a batch-norm model: every number against an independent computation.

    The last population feeds only the mean pool and the read-out, so its
    teaching signals are e_i . B_fc (fa) and e_i . W_fc (backprop), spread over
    positions: their per-example cosine is cos(e_i B, e_i W). Update cosines
    come from a feedback-free deepcopy trained in the same (training) mode.
    """
    model, x = _model("resnet2d")
    rule = make_rule("fa", model, seed=0)
    twin = copy.deepcopy(model)
    model.eval()  # the diagnostic must switch to training mode itself
    report = alignment(model, rule, x, Y)
    twin.train()
    logits = twin(x)
    F.cross_entropy(logits, Y).backward()
    e = output_error(logits.detach(), Y)  # (B, K)
    b, w = model.fc.feedback, model.fc.weight.detach()
    hand = F.cosine_similarity(e @ b, e @ w, dim=1).mean()
    last = model.population_names[-1]
    assert abs(report["teaching_cos"][last] - float(hand)) < 1e-9
    assert report["teaching_cos"][last] < 0.5  # random B: far from backprop's signal
    model.train()
    rule.compute_gradients(x, Y, None)
    twin_grads = dict(twin.named_parameters())
    for name, m in model.layers:
        want = _cos(m.weight.grad, twin_grads[name + ".weight"].grad)
        assert abs(report["update_cos"][name] - want) < 1e-9, name
    assert report["update_cos"]["fc"] > 1 - 1e-9
    assert report["update_cos"][model.layers[-2][0]] < 0.5
    for kind in ("teaching", "update"):
        values = list(report[f"{kind}_cos"].values())
        assert report[f"mean_{kind}_cos"] == pytest.approx(sum(values) / len(values), abs=1e-15)


@pytest.mark.parametrize("name", ["nodepert", "brsf", "wm", "kp"])
def test_alignment_every_step_leaves_the_trajectory_unchanged(name):
    """Rules with generators and their own state: same parameters with or without alignment."""
    finals = []
    for with_alignment in (False, True):
        model, x = _model("resnet2d")
        rule = make_rule(name, model, {"mirror_every": 1} if name == "wm" else {}, seed=0)
        opt = torch.optim.SGD(list(model.parameters()) + rule.parameters(), lr=0.05,
                              momentum=0.9)
        for step in range(3):
            if with_alignment:
                alignment(model, rule, x, Y)
            opt.zero_grad(set_to_none=True)
            rule.compute_gradients(x, Y, step)
            opt.step()
        finals.append(([p.detach().clone() for p in model.parameters()],
                       [b.clone() for b in model.buffers()], rule.state_dict()))
    (p0, b0, s0), (p1, b1, s1) = finals
    assert all(torch.equal(u, v) for u, v in zip(p0 + b0, p1 + b1))
    _assert_same_state(s0, s1)


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
    ("nodepert", {"pert_sigma": 1.5}, r"pert_sigma=1.5 is out of range; allowed: \(0.0, 1.0\]"),
    ("nodepert", {"pert_directions": 0}, r"pert_directions=0 is out of range"),
    ("dfa", {"feedback_scale": -1.0}, r"feedback_scale=-1.0 is out of range"),
    ("dfa", {"projection_norm": "bp"}, r"projection_norm='bp'.*'fixed', 'gradient'"),
    ("kp_traffic", {"traffic_ratio": 1e300}, r"traffic_ratio=1e\+300 is out of range; allowed: "
     r"\[0.0, 10000.0\]"),
    ("sdil", {"traffic_ratio": 2e4}, r"traffic_ratio=20000.0 is out of range"),
    ("fa", {"feedback_seed": 2**63}, r"feedback_seed=9223372036854775808 is out of range; "
     r"allowed: \[0, 9223372036854775807\]"),
    ("kp", {"mirror_every": 3}, r"rule 'kp' has no parameter\(s\) 'mirror_every'; it takes "
     r"feedback_scale, feedback_seed; 'mirror_every': parameter\(s\) of rule rrm / wm \(to "
     r"train with it: -p rule rrm, or rule='rrm'\) \(changing a config's rule"),
    ("bp", {"feedback_scale": 1.0}, r"rule 'bp' has no parameter\(s\) 'feedback_scale'; it "
     r"takes no parameters"),
    # a rule's parameter without that rule: the rules that take it are named
    ("bp", {"traffic_rule": "matched"}, r"rule 'bp' has no parameter\(s\) 'traffic_rule'; it "
     r"takes no parameters; 'traffic_rule': parameter\(s\) of rule kp_traffic / sdil \(to "
     r"train with it: -p rule kp_traffic, or rule='kp_traffic'\)"),
    ("fa", {"nope": 1}, r"'nope'; it takes feedback_scale, feedback_seed \(changing"),
    ("fa", ["feedback_scale"], r"rule 'fa': params must be a mapping of parameter names to "
     r"values or a FeedbackParams, got \['feedback_scale'\] \(list\)"),
])
def test_bad_rule_parameters(name, params, message):
    with pytest.raises(ConfigError, match=message):
        resolve_params(name, params)


@pytest.mark.parametrize("name", [n for n in sorted(RULES) if n != "bp"])
def test_unsupported_model_names_its_layers(name):
    class TorchLayers(nn.Module):  # the tap contract, but torch's own Linear layers
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))

        def forward(self, x, tap=None):
            return self.body(x)

    with pytest.raises(ValueError, match=r"cannot handle body.0 \(Linear\), body.2 \(Linear\)"):
        make_rule(name, TorchLayers())


@pytest.mark.parametrize("seed", [-5, "0", 2**63, 1.5, True, None])
def test_make_rule_refuses_a_bad_seed(seed):
    with pytest.raises(ConfigError, match=rf"make_rule seed={re.escape(repr(seed))} is not "
                                          r"allowed; give an integer in \[0, 922337203685477580"):
        make_rule("fa", ResNet(8, 4, dims=1, in_channels=1, n_classes=4), seed=seed)


def test_make_rule_takes_a_numpy_integer_seed_as_the_int():
    import numpy as np

    model = ResNet(8, 4, dims=1, in_channels=1, n_classes=4)
    by_numpy = make_rule("fa", copy.deepcopy(model), seed=np.int64(3))
    by_int = make_rule("fa", copy.deepcopy(model), seed=3)
    draws = [[b.clone() for b in r.feedback if b is not None] for r in (by_numpy, by_int)]
    assert all(torch.equal(a, b) for a, b in zip(*draws)) and len(draws[0]) > 0
    with pytest.raises(ConfigError, match=r"make_rule seed=-1 is not allowed"):
        make_rule("fa", model, seed=np.int64(-1))


def test_make_rule_takes_the_rules_params_instance():
    from lab.rules import rule_class
    model = ResNet(8, 4, dims=1, in_channels=1, n_classes=4)
    params = rule_class("fa").Params(feedback_scale=2.0)
    by_instance = make_rule("fa", model, params, seed=3)
    by_instance.detach()  # (one rule on a model at a time)
    by_mapping = make_rule("fa", model, {"feedback_scale": 2.0}, seed=3)
    assert by_instance.params == by_mapping.params == params
    feedback = list(by_instance.feedback)
    assert len(feedback) > 0
    for a, b in zip(feedback, by_mapping.feedback, strict=True):
        assert torch.equal(a, b)


def test_unknown_rule_lists_known():
    with pytest.raises(ConfigError, match=r"unknown rule 'hebb'; known rules: bp, brsf"):
        make_rule("hebb", nn.Linear(2, 2))
    # a list was a raw "TypeError: unhashable type: 'list'"
    from lab.rules import resolve_params

    for call in (lambda: resolve_params(["kp"], {}), lambda: make_rule(["kp"], nn.Linear(2, 2))):
        with pytest.raises(ConfigError, match=re.escape(
                "unknown rule ['kp'] (list; a rule is a name); known rules: bp, brsf")):
            call()


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


def test_autograd_step_composes_a_rules_tap_with_the_recorder():
    """The recorder reads each population after the rule's tap: what later layers read."""
    from lab.rules.bp import autograd_step

    model, x = _model("resnet2d")
    twin = copy.deepcopy(model)
    last = len(model.population_names) - 1
    seen = []

    def tap(index, h):
        seen.append(index)
        return 2.0 * h if index == last else h
    out = autograd_step(model, x, Y, record=True, tap=tap)
    assert seen == list(range(last + 1))
    # The same network with the last population doubled, by hand: doubling before
    # the mean pool is doubling the read-out's input.
    logits = twin.fc(2.0 * _pooled(twin, x)).detach()
    assert torch.allclose(out.logits, logits, atol=1e-12, rtol=0)
    # d(sum loss)/dh' at h' = 2h, the tensor the pool reads: e . W_fc spread over positions.
    e = output_error(logits, Y)  # (B, K)
    positions = out.teaching[last][0, 0].numel()
    spread = (e @ twin.fc.weight.detach())[:, :, None, None] / positions
    assert torch.allclose(out.teaching[last], spread.expand_as(out.teaching[last]),
                          atol=1e-12, rtol=0)


def _pooled(model, x):
    pooled = []
    model.fc.register_forward_hook(lambda m, i, o: pooled.append(i[0]))
    model(x)
    return pooled[0]


def test_clip_gradients_scales_the_rules_own_groups_alike():
    """A tensor in ``param_groups`` gets the model's clip coefficient, outside the norm."""
    from lab.rules.base import Rule

    model, x = _model("mlp")
    extra = torch.zeros(3, dtype=torch.float64, requires_grad=True)

    class WithGroup(Rule):
        name = "with_group_test"

        def param_groups(self):
            return [{"params": [extra], "lr": 0.5}]

        def compute_gradients(self, x, y, step, record=False):
            F.cross_entropy(self.model(x), y).backward()
            extra.grad = torch.full_like(extra, 100.0)  # huge, and not in the norm

    rule = WithGroup(model)
    rule.compute_gradients(x, Y, 0)
    norm = torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item()
    assert rule.clip_gradients(norm / 4) == pytest.approx(norm, rel=1e-12)
    assert torch.allclose(extra.grad, torch.full_like(extra, 100.0 / 4), rtol=1e-5)


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_dfa_gradient_projection_norm_matches_backprop_on_its_first_batch(scale):
    model, x = _model("resnet2d")
    true, _ = backprop_reference(copy.deepcopy(model), x, Y)
    fixed = make_rule("dfa", copy.deepcopy(model), {"feedback_scale": scale}, seed=0)
    fixed_out = fixed.compute_gradients(x, Y, 0, record=True)
    buffers = [b.clone() for b in model.buffers()]
    rule = make_rule("dfa", model, {"projection_norm": "gradient", "feedback_scale": scale},
                     seed=0)
    out = rule.compute_gradients(x, Y, 0, record=True)
    for t, g, f in zip(out.teaching, true, fixed_out.teaching):
        assert abs(float(t.norm() / g.norm()) - scale) < 1e-9 * scale
        assert abs(_cos(t, f) - 1) < 1e-12  # the same directions as the fixed D, rescaled
    # The calibration pass leaves the running statistics as one training pass would.
    twin, _ = _model("resnet2d")
    twin(x)
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), twin.buffers()))
    assert not all(torch.equal(a, b) for a, b in zip(model.buffers(), buffers))


@pytest.mark.parametrize("name", ["fa", "usf", "frsf", "wm"])
def test_feedback_state_round_trips_and_refuses_an_old_layout(name):
    model, x = _model("resnet1d")
    rule = make_rule(name, model, {"feedback_scale": 0.7}, seed=3)
    rule.compute_gradients(x, Y, 0)
    state = copy.deepcopy(rule.state_dict())
    other_model, _ = _model("resnet1d")
    other = make_rule(name, other_model, seed=9)
    other.load_state_dict(state)
    assert other.scales == rule.scales
    assert all(torch.equal(a, b) for a, b in zip(other.feedback, rule.feedback))
    old = {**state, "feedback": [torch.zeros_like(model.stem.weight)] + state["feedback"]}
    with pytest.raises(ValueError, match=r"holds 8 feedback tensors; this model needs 7"):
        other.load_state_dict(old)


def test_feedback_tracking_against_hand_values():
    from lab.rules.feedback import feedback_tracking

    a, b = Linear(3, 2), Linear(2, 2)
    with torch.no_grad():
        a.weight.copy_(torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]))
        b.weight.copy_(torch.tensor([[3.0, 4.0], [0.0, 0.0]]))
    feedback = [2 * a.weight.detach(), torch.tensor([[0.0, 0.0], [5.0, 0.0]])]
    t = feedback_tracking([("a", a), ("b", b)], feedback)
    assert t["cos"] == pytest.approx({"a": 1.0, "b": 0.0}, abs=1e-12)
    assert t["norm_ratio"] == pytest.approx({"a": 2.0, "b": 1.0}, abs=1e-12)
    # ||2W - W|| / ||W|| = 1; ||B - W|| / ||W|| = sqrt(25 + 25) / 5.
    assert t["rel_err"] == pytest.approx({"a": 1.0, "b": math.sqrt(2)}, abs=1e-12)
    assert t["mean_cos"] == pytest.approx(0.5) and t["min_cos"] == pytest.approx(0.0)
    assert t["mean_rel_err"] == pytest.approx((1 + math.sqrt(2)) / 2)
    assert t["max_rel_err"] == pytest.approx(math.sqrt(2))


def test_mirror_events_follow_the_schedule_and_the_warmup():
    model, x = _model("resnet1d")
    rule = make_rule("wm", model, {"mirror_every": 4, "mirror_warmup_steps": 3}, seed=0)
    counts = []
    for step in range(9):
        rule.compute_gradients(x, Y, step)
        model.zero_grad(set_to_none=True)
        counts.append(rule.events)
    # 3 warm-up events and one scheduled event at step 0, then steps 4 and 8.
    assert counts == [4, 4, 4, 4, 5, 5, 5, 5, 6]
    rule.compute_gradients(x, Y, None)  # a diagnostic call: no event
    assert rule.events == 6


@pytest.mark.parametrize("name", ["fa", "dfa"])
def test_feedback_depends_on_the_run_seed_and_the_feedback_seed(name):
    def draw(seed, feedback_seed):
        model, x = _model("resnet1d")
        rule = make_rule(name, model, {"feedback_seed": feedback_seed}, seed=seed)
        rule.compute_gradients(x, Y, None)
        return rule.feedback[0] if name == "fa" else rule.projections[0]
    same = draw(0, 0)
    assert torch.equal(same, draw(0, 0))
    assert not torch.allclose(same, draw(1, 0))
    assert not torch.allclose(same, draw(0, 1))


def test_register_refuses_what_is_not_a_rule():
    import dataclasses

    from lab.rules import Rule
    from lab.rules.registry import RULES, register

    def rule(rule_name, params=None, gradients=True):
        attrs = {"name": rule_name} if params is None else {"name": rule_name, "Params": params}
        if gradients:
            attrs["compute_gradients"] = lambda self, x, y, step, record=False: None
        return type("Custom", (Rule,), attrs)

    class NotARule:
        name = "not_a_rule"

    class Loose:  # a dataclass, but not frozen: a config could not hash it
        pass

    cases = [
        (NotARule, TypeError, r"^register\(<class .*NotARule'>\): a rule is a subclass of "
         r"lab.rules.Rule$"),
        (rule(""), ValueError, r"^rule class Custom: name='' is not allowed; give lower-case"),
        (rule("my rule/x"), ValueError, r"^rule class Custom: name='my rule/x' is not allowed"),
        (rule("Fa"), ValueError, r"name='Fa' is not allowed"),
        (rule("fa"), ValueError, r"^rule name 'fa' is already registered, by "
         r"lab.rules.feedback.FeedbackAlignment$"),
        (rule("fresh_test_rule", gradients=False), TypeError, r"^rule 'fresh_test_rule': "
         r"Custom does not define compute_gradients\(self, x, y, step, record=False\)"),
        (rule("fresh_test_rule", dict), TypeError, r"^rule 'fresh_test_rule': Custom.Params="
         r"<class 'dict'> is not a frozen dataclass; declare"),
        (rule("fresh_test_rule", dataclasses.dataclass(Loose)), TypeError,
         r"Params=.*Loose'> is not a frozen dataclass"),
    ]
    # compute_gradients(self, x, y) failed only at the first step, and a Params field with
    # no default only when a config was made (a bare TypeError from its __init__)
    two_args = type("Custom", (Rule,), {"name": "fresh_test_rule",
                                        "compute_gradients": lambda self, x, y: None})

    @dataclasses.dataclass(frozen=True)
    class Bare:
        s: float

    cases += [
        (two_args, TypeError, r"^rule 'fresh_test_rule': Custom.compute_gradients\(self, x, y\) "
         r"cannot take the trainers' call \(too many positional arguments\); define "
         r"compute_gradients\(self, x, y, step, record=False\)"),
        (rule("fresh_test_rule", Bare), TypeError, r"^rule 'fresh_test_rule': Custom.Params "
         r"field\(s\) s have no default; give each parameter one"),
    ]
    for cls, error, message in cases:
        with pytest.raises(error, match=message):
            register(cls)
    assert "fresh_test_rule" not in RULES and RULES["fa"].__name__ == "FeedbackAlignment"

    @dataclasses.dataclass(frozen=True)
    class Params:
        tags: tuple = ()

    fresh = rule("fresh_test_rule", Params)
    try:
        assert register(fresh) is fresh and RULES["fresh_test_rule"] is fresh
        # The same class made again (a notebook cell run twice) replaces itself; another
        # class under the name is still refused.
        again = rule("fresh_test_rule", Params)
        assert register(again) is again and RULES["fresh_test_rule"] is again
        other = type("Other", (Rule,), {"name": "fresh_test_rule",
                                        "compute_gradients": again.compute_gradients})
        with pytest.raises(ValueError, match=r"^rule name 'fresh_test_rule' is already "
                                             r"registered, by .*Custom$"):
            register(other)
        # A tuple parameter read back from a record (JSON holds it as a list) is the tuple.
        from lab.rules.registry import rule_params

        assert rule_params("fresh_test_rule", {"tags": [1, 2]}) == Params(tags=(1, 2))
    finally:
        RULES.pop("fresh_test_rule", None)


@pytest.mark.parametrize("rule, params, message", [
    ("kp_traffic", {"traffic_rule": "bogus"},
     r"^rule 'kp_traffic': rule_params.traffic_rule='bogus' is not allowed; choose one of: "
     r"'none', 'raw', 'matched', 'innovation'"),
    ("lhfa", {"pert_every": 0}, r"^rule 'lhfa': rule_params.pert_every=0 is out of range"),
])
def test_a_bad_rule_parameter_names_the_rule_and_the_key_as_written(rule, params, message):
    # It named the holding class (TrafficParams.traffic_rule), which no researcher typed.
    from lab.config import ConfigError
    from lab.rules.registry import rule_params

    with pytest.raises(ConfigError, match=message):
        rule_params(rule, params)


def test_the_readme_recipe_for_a_rule_of_ones_own_trains(tmp_path):
    # docs/extending.md's "Your own rule" block, as written there: it registers, trains, and with
    # scale 1/2 at twice the learning rate takes bp's steps (both factors powers of two).
    import re
    from pathlib import Path

    from lab.rules.registry import RULES
    from lab.train import ConvConfig, train_conv

    readme = (Path(__file__).resolve().parents[1] / "docs" / "extending.md").read_text()
    section = readme[readme.index("### Your own rule"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    import sys
    import types

    module = types.ModuleType("readme_rule")  # dataclasses look their module up
    sys.modules["readme_rule"] = module
    try:
        exec(compile(code, "docs/extending.md", "exec"), module.__dict__)
        assert RULES["scaled_bp"].__name__ == "ScaledBackprop"
        tiny = dict(depth=8, width=4, epochs=2, n_train=128, batch_size=32, threads=1,
                    progress=False, schedule="constant", weight_decay=0.0, dtype="float64")
        mine = train_conv(ConvConfig(**tiny, lr=0.2, rule="scaled_bp",
                                     rule_params={"scale": 0.5}), tmp_path / "s")
        bp = train_conv(ConvConfig(**tiny, lr=0.1), tmp_path / "bp")
        assert mine["status"] == "complete" and mine["config"]["rule_params"] == {"scale": 0.5}
        assert mine["final"]["test_loss"] == pytest.approx(bp["final"]["test_loss"], rel=1e-12)
        assert mine["final"]["test_loss"] != pytest.approx(
            train_conv(ConvConfig(**tiny, lr=0.2), tmp_path / "bp2")["final"]["test_loss"],
            rel=1e-6)  # the scale matters
        with pytest.raises(ConfigError, match=r"rule 'scaled_bp': rule_params.scale=0.0 is out "
                           r"of range"):
            ConvConfig(**tiny, rule="scaled_bp", rule_params={"scale": 0.0})
    finally:
        RULES.pop("scaled_bp", None)
        sys.modules.pop("readme_rule", None)


def test_the_readme_recipe_for_ones_own_model_trains_and_detaches():
    # docs/extending.md's "Your own model" block, as written there: prepare, ten kp steps that
    # move the weights, then detach() leaves a model whose backward is autograd's.
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "docs" / "extending.md").read_text()
    section = readme[readme.index("### Your own model"):readme.index("### Your own rule")]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "rule.prepare(x, y)" in code
    namespace: dict = {}
    torch.manual_seed(0)
    exec(compile(code, "docs/extending.md", "exec"), namespace)
    model, x, y = namespace["model"], namespace["x"], namespace["y"]
    assert math.isfinite(float(namespace["loss"]))
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    mine = [p.grad.clone() for p in model.parameters()]
    reference = copy.deepcopy(model)
    reference.zero_grad(set_to_none=True)
    grads = torch.autograd.grad(F.cross_entropy(reference(x), y), list(reference.parameters()))
    for a, b in zip(mine, grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_bp_refuses_a_model_left_with_another_rules_feedback():
    # make_rule("bp", model) after fa on the same model computed fa's gradients as "bp".
    from lab.models.layers import local_layers
    from lab.models.resnet import ResNet

    model = ResNet(depth=8, width=4, dims=1, in_channels=1, n_classes=10)
    fa = make_rule("fa", model, seed=0)
    for name in ("bp", "kp"):  # a second feedback rule replaced the first's tensors too
        with pytest.raises(ConfigError, match=rf"^rule '{name}': the model's layers .* hold "
                                              r"another rule's feedback tensors \(a model "
                                              r"trains under one rule at a time\); call that "
                                              r"rule's detach\(\) first"):
            make_rule(name, model)
    fa.detach()
    assert all(layer.feedback is None for _, layer in local_layers(model))
    assert make_rule("bp", model).name == "bp"


# (rule, parameter, value the float32 model cannot apply, what the error says)
UNREPRESENTABLE = [
    ("dfa", "feedback_scale", 1e-300, r"below the smallest normal float32 \(1\.175e-38\)"),
    ("usf", "feedback_scale", 1e-45, r"below the smallest normal float32"),
    ("fa", "feedback_scale", 1e300, r"overflows float32.*largest 3\.40282e\+38"),
    ("rrm", "mirror_sigma", 1e-40, r"below the smallest normal float32"),
    ("wm", "mirror_sigma", 1e39, r"overflows float32"),
    ("nodepert", "pert_sigma", 1e-9, r"below float32's epsilon \(1\.192e-07\).*rounded away"),
    ("lhfa", "pert_sigma", 1e-8, r"below float32's epsilon"),
    ("kp_traffic", "traffic_ratio", 1e-40, r"below the smallest normal float32"),
    ("kp_traffic", "predictor_lr", 1e-39, r"below the smallest normal float32"),
    ("sdil", "traffic_ratio", 1e-40, r"below the smallest normal float32"),
    ("wm", "mirror_lr", 1e-39, r"below the smallest normal float32"),
    ("wm", "mirror_decay", 1e-45, r"below the smallest normal float32"),
    ("lhfa", "eta_A", 1e-40, r"below the smallest normal float32"),
]


@pytest.mark.parametrize("name, field, value, says", UNREPRESENTABLE)
def test_a_scale_the_models_dtype_cannot_hold_is_refused(name, field, value, says):
    """Before: feedback_scale 1e-300 (dfa), 1e-45 (usf) and pert_sigma 1e-30 (nodepert)
    trained float32 runs to "complete" with no teaching signal below the read-out."""
    from lab.train import ConvConfig

    given = re.escape(f"rule_params.{field}={value!r} ")
    with pytest.raises(ConfigError, match=rf"ConvConfig\.rule_params: rule '{name}': "
                                          rf"{given}.*{says}"):
        ConvConfig(rule=name, rule_params={field: value})
    torch.manual_seed(0)
    small = ResNet(8, 4, dims=1, in_channels=2, n_classes=4)  # float32
    with pytest.raises(ConfigError, match=rf"{given}.*{says}"):
        make_rule(name, small, {field: value})
    if value < 1:  # float64 holds it: allowed there, in the config and for a float64 model
        ConvConfig(rule=name, rule_params={field: value}, dtype="float64")
        make_rule(name, small.double(), {field: value})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_dtype_limits_themselves_are_allowed(dtype):
    import numpy as np

    info = np.finfo(str(dtype).removeprefix("torch."))
    torch.manual_seed(0)
    model = MLP(12, (10, 8), 4, dtype=dtype)
    make_rule("dfa", model, {"feedback_scale": float(info.tiny)})
    make_rule("fa", model, {"feedback_scale": float(info.max)})
    make_rule("nodepert", model, {"pert_sigma": float(info.eps)})
    with pytest.raises(ConfigError, match="pert_sigma"):
        make_rule("nodepert", model, {"pert_sigma": float(info.eps) / 2})


@pytest.mark.parametrize("dims, length, kernel, stride, padding", [
    (1, 37, 3, 1, 1), (1, 40, 3, 2, 1), (1, 9, 5, 2, 2), (1, 4, 3, 1, 0),
    (2, 7, 3, 1, 1), (2, 9, 3, 2, 1), (2, 5, 1, 2, 0)])
def test_mirror_sample_counts_are_the_product_of_ones(dims, length, kernel, stride, padding):
    # Counted index by index now (a convolution of ones each event was unbilled work):
    # the same numbers as the product, exactly.
    from lab.models.layers import Conv
    from lab.rules.mirror import _sample_counts, _weight_product

    conv = Conv(dims, 2, 3, kernel, stride=stride, padding=padding).double()
    x = torch.randn(4, 2, *[length + i for i in range(dims)], dtype=torch.float64)
    y = conv(x)
    ones_x, ones_y = torch.ones_like(x[:1, :1]), torch.ones_like(y[:1, :1])
    want = _weight_product(conv, ones_x, ones_y, (1, 1, *conv.weight.shape[2:]))
    got = _sample_counts(conv, x, y, conv.weight.shape)
    assert got.shape == want.shape and torch.equal(got, want)
    assert got.min() >= 1  # every tap sees some real sample here
