"""Contracts every rule keeps, and the perturbation estimator's direction draws.

Oracles: a second rule built from the saved state (equal gradients, bit for bit),
torch's own clipping, explicit formulas for the estimator's curvature and
counts, exact properties of the direction bases.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from lab.diagnostics.work import bill
from lab.models import ResNet
from lab.rules import RULES, make_rule
from lab.rules.perturbation import PerturbationEstimator, Probe

Y = torch.tensor([0, 1, 2, 3, 0, 1])

# Preparation drawn from the six examples of _model's batch.
SIX = {"kp_traffic": {"traffic_calibration_examples": 6, "predictor_warmup_steps": 2,
                      "predictor_batch": 6},
       "sdil": {"traffic_calibration_examples": 6, "predictor_warmup_steps": 2,
                "predictor_batch": 6, "a_warmup_steps": 2, "calibration_batch": 6},
       "lhfa": {"warmup_steps": 2, "calibration_batch": 6}}
# The rules whose traffic gains are calibrated by ``prepare`` (a training step before
# it is refused); these parameters let the six examples do it, with no warm-up.
CALIBRATED = {"kp_traffic": {"traffic_calibration_examples": 6, "predictor_warmup_steps": 0},
              "sdil": {"traffic_calibration_examples": 6, "predictor_warmup_steps": 0,
                       "a_warmup_steps": 0}}


def _model(seed=0, **kw):
    torch.manual_seed(seed)
    model = ResNet(8, 4, dims=1, in_channels=2, n_classes=4, dtype=torch.float64, **kw)
    return model, torch.randn(6, 2, 16, dtype=torch.float64)


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("name", sorted(RULES))
def test_a_fresh_rules_state_rebuilds_the_same_rule(name):
    """state_dict before any step (lazy tensors still absent; for the rules whose traffic
    gains are calibrated, just after ``prepare``) loads into a fresh rule built with
    another seed, and both then compute the same gradients bit for bit."""
    model, x = _model()
    twin = copy.deepcopy(model)
    a = make_rule(name, model, CALIBRATED.get(name, {}), seed=3)
    b = make_rule(name, twin, CALIBRATED.get(name, {}), seed=4)
    if name in CALIBRATED:
        a.prepare(x, Y)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    model.train(), twin.train()
    a.compute_gradients(x, Y, 0)
    b.compute_gradients(x, Y, 0)
    for ga, gb in zip(_grads(model), _grads(twin)):
        assert torch.equal(ga, gb)


@pytest.mark.parametrize("name", sorted(RULES))
def test_every_rule_takes_a_batch_of_one(name):
    model, x = _model()
    rule = make_rule(name, model, SIX.get(name, {}), seed=0)
    rule.prepare(x, Y)  # a no-op for most; the traffic gains need it
    model.train()
    out = rule.compute_gradients(x[:1], Y[:1], 0)
    assert out.logits.shape == (1, 4) and math.isfinite(float(out.loss))
    assert all(p.grad is not None and torch.isfinite(p.grad).all()
               for p in model.parameters())


@pytest.mark.parametrize("name", sorted(set(RULES) - {"bp"}))  # autograd trains anything
def test_an_unsupported_model_is_refused_naming_the_rule(name):
    model = nn.Sequential(nn.Flatten(), nn.Linear(32, 4)).double()
    with pytest.raises(ValueError, match=rf"rule '{name}'"):
        make_rule(name, model, seed=0)


@pytest.mark.parametrize("name", ["fa", "kp", "usf", "brsf", "frsf", "lhfa", "kp_traffic"])
def test_feedback_scale_is_honoured(name):
    """The same seed at feedback_scale 0.3 gives exactly 0.3 x the feedback tensors."""
    model, _ = _model()
    one = make_rule(name, model, {"feedback_scale": 1.0}, seed=5)
    small = make_rule(name, copy.deepcopy(model), {"feedback_scale": 0.3}, seed=5)
    for b1, b3 in zip(one.feedback, small.feedback):
        torch.testing.assert_close(b3, 0.3 * b1, rtol=1e-12, atol=0)


@pytest.mark.parametrize("name", ["bp", "fa", "kp", "dfa"])
def test_clip_gradients_is_torchs_clip_on_the_models_gradients(name):
    model, x = _model()
    rule = make_rule(name, model, seed=0)
    model.train()
    rule.compute_gradients(x, Y, 0)
    reference = [p.grad.clone().requires_grad_(False) for p in model.parameters()]
    holders = [torch.zeros_like(g, requires_grad=True) for g in reference]
    for h, g in zip(holders, reference):
        h.grad = g.clone()
    norm = float(torch.cat([g.flatten() for g in reference]).norm())
    for max_norm in (norm / 7, 10 * norm):
        want = torch.nn.utils.clip_grad_norm_(holders, max_norm)
        got = rule.clip_gradients(max_norm)
        assert got == pytest.approx(float(want), rel=1e-14)
        for p, h in zip(model.parameters(), holders):
            torch.testing.assert_close(p.grad, h.grad, rtol=1e-15, atol=0)


def test_dfa_bill_before_its_first_step_has_no_projection():
    model, _ = _model()
    rule = make_rule("dfa", model, seed=0)
    work = bill(rule, model, (2, 16), examples=10)
    assert work["macs"].get("feedback_propagation", 0) == 0


def test_dfa_projections_keep_float64_precision():
    model, x = _model()
    rule = make_rule("dfa", model, seed=0)
    rule.compute_gradients(x, Y, 0)
    for d in rule.projections:
        assert d.dtype == torch.float64 and not torch.equal(d.float().double(), d)


# -- the perturbation estimator's draws, curvature and counts ----------------------------

def _estimator(model, **kw):
    return PerturbationEstimator(model, sigma=1e-4, directions=3,
                                 generator=torch.Generator().manual_seed(2), **kw)


def test_gaussian_and_orthogonal_bases_are_what_they_say():
    model, _ = _model(normalization="none")
    like = torch.zeros(3, 4, dtype=torch.float64)  # a population of D = 12 elements
    d = like.numel()
    gauss = _estimator(model).draw(like, 40).flatten(1)  # (40, 12)
    norms = gauss.norm(dim=1)
    assert norms.std() > 0.1 and not torch.equal(gauss.float().double(), gauss)
    assert gauss.dtype == torch.float64
    ortho = _estimator(model, basis="orthogonal").draw(like, d + 1).flatten(1)  # 2 blocks
    assert ortho.shape == (d + 1, d)
    torch.testing.assert_close(ortho.norm(dim=1), torch.full((d + 1,), math.sqrt(d),
                                                             dtype=torch.float64))
    gram = ortho[:d] @ ortho[:d].T
    torch.testing.assert_close(gram, d * torch.eye(d, dtype=torch.float64), atol=1e-12,
                               rtol=0)
    # The estimator's own generator decides: the global RNG does not.
    torch.manual_seed(123)
    a = _estimator(model, basis="orthogonal").draw(like, 5)
    torch.manual_seed(456)
    b = _estimator(model, basis="orthogonal").draw(like, 5)
    assert torch.equal(a, b)


def test_probe_curvature_and_residual_by_their_definitions():
    g = torch.Generator().manual_seed(0)
    xi = torch.randn(5, 3, 4, generator=g, dtype=torch.float64)  # (K, B, U)
    u = torch.randn(3, 4, generator=g, dtype=torch.float64)
    for obs in (torch.randn(5, generator=g, dtype=torch.float64),
                torch.randn(5, 3, generator=g, dtype=torch.float64)):
        probe = Probe(0, xi, obs)
        if obs.ndim == 1:  # batch loss: <u, xi_k> over everything
            dots = (xi * u).sum(dim=(1, 2))
            want_curv = dots.square().mean()
            want_res = ((dots - obs).view(5, 1, 1) * xi).mean(0)
        else:  # per example: <u_b, xi_kb>, squares summed over examples
            dots = (xi * u).sum(dim=2)  # (K, B)
            want_curv = dots.square().sum(1).mean()
            want_res = ((dots - obs).unsqueeze(-1) * xi).mean(0)
        torch.testing.assert_close(probe.curvature(u), want_curv, rtol=1e-14, atol=0)
        torch.testing.assert_close(probe.residual(u), want_res, rtol=1e-13, atol=1e-15)
        want_est = (obs.view(*obs.shape, *[1] * (xi.ndim - obs.ndim)) * xi).mean(0)
        torch.testing.assert_close(probe.estimate(), want_est, rtol=1e-14, atol=0)


@pytest.mark.parametrize("per_example", [False, True])
def test_counts_are_the_passes_made(per_example):
    model, x = _model(normalization="none")
    hs = []
    logits = model(x, tap=lambda i, h: hs.append(h.detach()) or h)
    losses = F.cross_entropy(logits, Y, reduction="none").detach()
    est = _estimator(model, difference="forward", per_example=per_example, chunk=1)
    clean = losses if per_example else losses.sum()
    est.observe(2, hs[2], Y, clean)
    est.observe(4, hs[4], Y, clean)
    assert est.counts() == {"loss_queries": 6, "observations": 6 * (6 if per_example else 1),
                            "example_passes": 36}
    assert est.elementwise() == 4 * 3 * (hs[2].numel() + hs[4].numel())


def test_alignment_leaves_a_rules_own_group_tensors_alone():
    """A tensor in ``param_groups`` keeps its gradient through an alignment probe."""
    from lab.diagnostics.alignment import alignment
    from lab.rules.base import Rule

    model, x = _model()
    extra = torch.zeros(3, dtype=torch.float64, requires_grad=True)

    class WithGroup(Rule):
        name = "with_group_contract"

        def param_groups(self):
            return [{"params": [extra], "lr": 0.5}]

        def compute_gradients(self, x, y, step, record=False):
            from lab.rules.common import Recorder

            recorder = Recorder(len(y))
            F.cross_entropy(self.model(x, tap=recorder), y).backward()
            extra.grad = torch.full_like(extra, 7.0)
            from lab.rules.base import StepResult
            return StepResult(None, None, recorder.teaching() if record else None)

    rule = WithGroup(model)
    sentinel = torch.full_like(extra, -1.0)
    extra.grad = sentinel
    alignment(model, rule, x, Y)
    assert extra.grad is sentinel and torch.equal(sentinel, torch.full_like(extra, -1.0))


def _same(a, b) -> bool:
    """Deep equality of two states (tensors bit for bit)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b




@pytest.mark.parametrize("name", sorted(RULES))
def test_a_diagnostic_call_leaves_the_rule_as_it_was(name):
    """compute_gradients(step=None) changes no state: the next real step and the bill are
    those of a run without the diagnostic call, and two diagnostic calls agree."""
    model, x = _model()
    twin = copy.deepcopy(model)
    a, b = (make_rule(name, net, SIX.get(name), seed=2) for net in (model, twin))
    model.train(), twin.train()

    def step(rule, net, index):
        net.zero_grad(set_to_none=True)  # as the trainers do
        rule.compute_gradients(x, Y, index)
        return _grads(net)

    for rule, net in ((a, model), (b, twin)):
        rule.prepare(x, Y)
        step(rule, net, 0)
    before = copy.deepcopy(a.state_dict())
    first = step(a, model, None)
    second = step(a, model, None)
    assert _same(a.state_dict(), before), f"{name}: a diagnostic call changed the state"
    for g1, g2 in zip(first, second, strict=True):
        assert torch.equal(g1, g2)
    for ga, gb in zip(step(a, model, 1), step(b, twin, 1), strict=True):
        assert torch.equal(ga, gb)
    assert _same(a.state_dict(), b.state_dict())
