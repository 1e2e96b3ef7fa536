"""lhfa and sdil: feedback learned from perturbation observations (float64 oracles)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from test_perturbation import smooth_net, true_gradients

from lab.config import ConfigError, Diverged
from lab.diagnostics.alignment import alignment
from lab.models.layers import Conv, local_layers
from lab.rules import make_rule, resolve_params
from lab.rules.common import output_error

# A complete orthogonal set of directions on the batch's summed loss: exact observations.
EXACT = {"pert_sigma": 1e-5, "pert_basis": "orthogonal", "pert_directions": 64, "eta_A": 1.0,
         "pert_per_example": False}


def test_lhfa_calibration_drives_alignment_from_fa_level_above_0_9():
    """Frozen weights, exact observations (a complete orthogonal set): B learns."""
    model, x, y = smooth_net()
    rule = make_rule("lhfa", model, {**EXACT, "warmup_steps": 0}, seed=0)
    fa = make_rule("fa", copy.deepcopy(model), seed=0)  # the same B draw, fixed
    start = alignment(model, rule, x, y)["mean_teaching_cos"]
    assert start == pytest.approx(alignment(fa.model, fa, x, y)["mean_teaching_cos"], abs=1e-12)
    assert start < 0.5
    weights = {n: p.clone() for n, p in model.named_parameters()}
    for _ in range(12):
        rule.calibrate(x, y)
    report = alignment(model, rule, x, y)
    assert report["mean_teaching_cos"] > 0.9
    assert min(report["teaching_cos"].values()) > 0.8
    for n, p in model.named_parameters():  # calibration never moves W nor writes .grad
        assert torch.equal(p, weights[n]) and p.grad is None
    # The read-out's delta is the exact output error e, so its transport becomes exact:
    # e B -> e W (B itself is pinned only on e's row space: rank K - 1 here).
    fc = dict(local_layers(model))["fc"]
    e = output_error(model(x).detach(), y)  # (B, K)
    assert (e @ fc.feedback - e @ fc.weight).norm() / (e @ fc.weight).norm() < 1e-2


def test_sdil_vectorisers_converge_to_the_least_squares_map():
    """A_l -> argmin ||e A - dL/dh_l|| (minimum norm: e's rows sum to zero)."""
    model, x, y = smooth_net()
    rule = make_rule("sdil", model, {**EXACT, "a_warmup_steps": 0}, seed=0)
    hs, grads, loss = true_gradients(model, x, y)
    e = output_error(model(x).detach(), y)  # (B, K)
    for _ in range(25):
        rule.calibrate(x, y)
    for i, (a, g) in enumerate(zip(rule.A, grads)):
        star = torch.linalg.lstsq(e, g.flatten(1), driver="gelsd").solution  # (K, units)
        assert (a - star).norm() / star.norm() < 1e-3, i


def _sdil_pair(traffic_rule, **kw):
    model, x, y = smooth_net()
    params = {"a_warmup_steps": 2, "predictor_warmup_steps": 0, "calibration_batch": 4,
              "traffic_calibration_examples": 4, "pert_directions": 4, **kw}
    rule = make_rule("sdil", model, {**params, "traffic_rule": traffic_rule}, seed=0)
    clean_model = copy.deepcopy(model)
    clean = make_rule("sdil", clean_model, {**params, "traffic_rule": "none"}, seed=0)
    for r in (rule, clean):
        r.prepare(x, y)
    return (model, rule), (clean_model, clean), x, y


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_sdil_zero_gain_innovation_is_the_instruction():
    (model, rule), (clean_model, clean), x, y = _sdil_pair("innovation", traffic_ratio=0.0)
    assert rule.apical.gains == [0.0] * len(rule.apical.gains)
    rule.compute_gradients(x, y, None)
    clean.compute_gradients(x, y, None)
    got, want = _grads(model), _grads(clean_model)
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_sdil_exact_predictor_leaves_the_instruction():
    """P = g C: the innovation N = R - P h is the instruction, to rounding."""
    (model, rule), (clean_model, clean), x, y = _sdil_pair("innovation")
    assert all(g > 0 for g in rule.apical.gains)
    for i, c in enumerate(rule.apical.coefficients):
        rule.apical.P[i] = c * rule.apical.gains[i]  # P = g C, b = 0: the traffic exactly predicted
        rule.apical.b[i].zero_()
    rule.compute_gradients(x, y, None)
    clean.compute_gradients(x, y, None)
    got, want = _grads(model), _grads(clean_model)
    for n in want:
        assert torch.allclose(got[n], want[n], rtol=1e-14, atol=1e-14 * want[n].abs().max()), n


def test_sdil_raw_traffic_changes_the_update_and_the_predictor_learns_it():
    (model, rule), _, x, y = _sdil_pair("raw", predictor_warmup_steps=0)
    hs, _, _ = true_gradients(model, x, y)
    for _ in range(30):
        rule.apical.predict(hs)
    for i, c in enumerate(rule.apical.coefficients):  # NLMS on (h, g C h) finds P = g C
        active = hs[i].flatten(1).std(0).view_as(c) > 0.1
        want = (c * rule.apical.gains[i])[active]
        assert torch.allclose(rule.apical.P[i][active], want, rtol=1e-3)


def _hooked_macs(model):
    counted = {"macs": 0}

    def hook(module, inputs, output):
        per_output = (module.in_channels * math.prod(module.kernel_size)
                      if isinstance(module, Conv) else module.in_features)
        counted["macs"] += output.numel() * per_output

    return counted, [m.register_forward_hook(hook) for _, m in local_layers(model)]


@pytest.mark.parametrize("name", ["lhfa", "sdil"])
def test_bill_counts_one_calibration_event_against_hooks(name):
    model, x, y = smooth_net()
    k = 3
    rule = make_rule(name, model, {"pert_directions": k}, seed=0)
    rule.compute_gradients(x, y, None)  # shapes
    layer_macs = model.layer_macs((1, x.shape[2]))
    before = rule.work(layer_macs, 0)
    queries = rule.estimator.loss_queries
    counted, handles = _hooked_macs(model)
    try:
        rule.calibrate(x, y)
    finally:
        for h in handles:
            h.remove()
    after = rule.work(layer_macs, 0)
    forward = sum(layer_macs.values()) * len(y)  # the event's clean (lhfa: fa) pass
    assert after["perturbation"] - before["perturbation"] == counted["macs"] - forward
    observed = len(rule.reads) if name == "lhfa" else len(model.population_names)
    assert rule.estimator.loss_queries - queries == 2 * k * observed  # central differences
    assert after["calibration"] > before["calibration"]


@pytest.mark.parametrize("name, warm", [("lhfa", "warmup_steps"), ("sdil", "a_warmup_steps")])
def test_events_follow_pert_every_and_the_warmup(name, warm):
    model, x, y = smooth_net()
    extra = {"predictor_warmup_steps": 1, "predictor_batch": 4,
             "traffic_calibration_examples": 4} if name == "sdil" else {}
    rule = make_rule(name, model, {"pert_directions": 2, "pert_every": 3, warm: 2,
                                   "calibration_batch": 2, **extra}, seed=0)
    order = torch.get_rng_state()
    rule.prepare(x, y)
    assert torch.equal(order, torch.get_rng_state())  # the global generator is untouched
    assert rule.events == 2 and rule.calibration_examples == 4
    for step in range(7):
        rule.compute_gradients(x, y, step)
    assert rule.events == 2 + 2  # after steps 3 and 6
    rule.compute_gradients(x, y, None)  # a diagnostic call: no event
    assert rule.events == 4
    metrics = rule.epoch_metrics()
    assert metrics["calibration"]["events"] == 4
    assert metrics["perturbation"]["loss_queries"] == rule.estimator.loss_queries > 0


@pytest.mark.parametrize("name", ["lhfa", "sdil"])
def test_state_round_trip_resumes_exactly(name):
    model, x, y = smooth_net()
    params = {"pert_directions": 2, "pert_every": 1, "calibration_batch": 4}
    if name == "sdil":  # the traffic gains, calibrated on the four examples
        params.update(traffic_calibration_examples=4, predictor_batch=4)
    rule = make_rule(name, model, params, seed=0)
    rule.prepare(x, y)
    rule.compute_gradients(x, y, 0)
    twin_model = copy.deepcopy(model)
    twin = make_rule(name, twin_model, params, seed=0)
    twin.load_state_dict(copy.deepcopy(rule.state_dict()))
    for r, m in ((rule, model), (twin, twin_model)):
        m.zero_grad(set_to_none=True)
        r.compute_gradients(x, y, 1)
    a, b = _grads(model), _grads(twin_model)
    assert all(torch.equal(a[n], b[n]) for n in a)
    tensors = "feedback" if name == "lhfa" else "A"
    for u, v in zip(rule.state_dict()[tensors], twin.state_dict()[tensors]):
        assert torch.equal(u, v)


@pytest.mark.parametrize("name", ["lhfa", "sdil"])
@pytest.mark.parametrize("key, value, message", [
    ("pert_sigma", 0.0, r"pert_sigma=0.0 is out of range; allowed: "),
    ("pert_sigma", 1.5, r"pert_sigma=1.5 is out of range; allowed: \(0.0, 1.0\]"),
    ("pert_every", 0, r"pert_every=0 is out of range; allowed: "),
    ("pert_directions", 0, r"pert_directions=0 is out of range; allowed: "),
    ("eta_A", 0.0, r"eta_A=0.0 is out of range; allowed: "),
    ("eta_A", 2.5, r"eta_A=2.5 is out of range; allowed: "),
    ("pert_difference", "backward", r"pert_difference='backward'.*central.*forward"),
    ("pert_basis", "sobol", r"pert_basis='sobol'.*gaussian.*orthogonal"),
    ("calibration_batch", 0, r"calibration_batch=0 is out of range; allowed: "),
])
def test_bad_parameters_name_key_value_and_allowed(name, key, value, message):
    with pytest.raises(ConfigError, match=message):
        resolve_params(name, {key: value})


@pytest.mark.parametrize("name, key", [("lhfa", "warmup_steps"), ("sdil", "a_warmup_steps")])
def test_bad_warmup_steps(name, key):
    with pytest.raises(ConfigError, match=rf"{key}=-1 is out of range; allowed: "):
        resolve_params(name, {key: -1})


@pytest.mark.parametrize("name, key", [("lhfa", "calibration_batch"),
                                       ("sdil", "calibration_batch"),
                                       ("sdil", "traffic_calibration_examples")])
def test_prefix_longer_than_the_training_set_is_refused(name, key):
    model, x, y = smooth_net()
    fits = {"calibration_batch": 2} if name == "lhfa" else {
        "calibration_batch": 2, "predictor_batch": 2, "traffic_calibration_examples": 2}
    rule = make_rule(name, model, {**fits, key: 10}, seed=0)
    with pytest.raises(ConfigError, match=rf"{key}=10 but the training set has only 4 "
                                          r"examples; allowed: 1 to 4"):
        rule.prepare(x, y)


@pytest.mark.slow
@pytest.mark.parametrize("name, params", [
    ("lhfa", {"warmup_steps": 2, "pert_directions": 2, "pert_every": 2,
              "calibration_batch": 32}),
    ("sdil", {"a_warmup_steps": 2, "pert_directions": 2, "pert_every": 2,
              "calibration_batch": 32, "predictor_warmup_steps": 2, "predictor_batch": 32,
              "traffic_calibration_examples": 64}),
])
def test_trains_and_records_completely(name, params, tiny):
    from lab.train import ConvConfig, train_conv

    record = train_conv(ConvConfig(rule=name, seed=0, rule_params=params, alignment_every=1,
                                   **{**tiny, "epochs": 2}))
    assert record["status"] == "complete"
    last = record["trajectory"][-1]
    assert last["rule"]["calibration"]["events"] > 2
    assert math.isfinite(last["alignment"]["mean_teaching_cos"])
    macs = record["work"]["macs"]
    assert macs["perturbation"] > 0 and macs["calibration"] > 0


def test_lhfa_learns_from_few_noisy_gaussian_directions():
    """K = 8 N(0, I) directions of a 64-unit population, central differences: NLMS at
    eta_A = 1 stays stable on these noisy observations and still aligns the transport."""
    model, x, y = smooth_net()
    rule = make_rule("lhfa", model, {"pert_sigma": 1e-4, "pert_directions": 8, "eta_A": 1.0,
                                     "pert_per_example": False, "warmup_steps": 0}, seed=0)
    start = alignment(model, rule, x, y)["mean_teaching_cos"]
    norms = [float(b.norm()) for b in rule.feedback]
    for _ in range(50):
        rule.calibrate(x, y)
    assert start < 0.2 and alignment(model, rule, x, y)["mean_teaching_cos"] > 0.9
    assert all(float(b.norm()) < 3 * n for b, n in zip(rule.feedback, norms))


# -- oracles for the numbers each rule reports and the updates it makes --------------------

def _fa_signals(model, x, y, layers):
    """Populations, fa teaching (d sum-loss/dh through each layer's B) and each B layer's
    output gradient, from the model's own transport (autograd through the B slots)."""
    hs, outs = [], {}
    handles = [m.register_forward_hook(lambda mod, i, o: outs.__setitem__(id(mod), o))
               for _, m in layers]
    try:
        logits = model(x, tap=lambda i, h: hs.append(h) or h)
        loss = F.cross_entropy(logits, y, reduction="sum")
        grads = torch.autograd.grad(loss, hs + [outs[id(m)] for _, m in layers])
    finally:
        for handle in handles:
            handle.remove()
    return [h.detach() for h in hs], grads[:len(hs)], grads[len(hs):]


def _transport(module, h, weight):
    """The layer's forward with ``weight``, on population h (fc reads its spatial mean)."""
    if isinstance(module, Conv):
        return F.conv1d(h, weight, None, module.stride, module.padding)
    return F.linear(h.mean(dim=tuple(range(2, h.ndim))) if h.ndim > 2 else h, weight)


def _teaching(module, delta, weight, like):
    """autograd: the input gradient the layer's transport makes with ``weight`` as B."""
    h = like.clone().requires_grad_()
    return torch.autograd.grad(_transport(module, h, weight), h, delta)[0]


def _b_gradient(module, delta, signal, weight):
    """autograd: d <teaching(B), signal> / dB = d <delta, forward(signal; B)> / dB."""
    b = weight.clone().requires_grad_()
    return torch.autograd.grad((delta * _transport(module, signal, b)).sum(), b)[0]


def test_lhfa_b_teaching_and_b_gradient_match_autograd():
    model, x, y = smooth_net()
    rule = make_rule("lhfa", model, {"warmup_steps": 0}, seed=0)
    hs, _, deltas = _fa_signals(model, x, y, rule.layers)
    gen = torch.Generator().manual_seed(3)
    for (name, module), b, index, delta in zip(rule.layers, rule.feedback, rule.reads, deltas):
        like = hs[index]
        weight = torch.randn(b.shape, generator=gen, dtype=b.dtype)  # "a given B"
        signal = torch.randn(like.shape, generator=gen, dtype=like.dtype)
        got = rule.b_teaching(module, delta, weight, like)
        want = _teaching(module, delta, weight, like)
        assert got.shape == like.shape
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14, msg=name)
        torch.testing.assert_close(rule.b_gradient(module, delta, signal),
                                   _b_gradient(module, delta, signal, b),
                                   rtol=1e-12, atol=1e-14, msg=name)
        # A single example (calibration_batch=1) is a legal batch.
        torch.testing.assert_close(rule.b_teaching(module, delta[:1], weight, like[:1]),
                                   want[:1], rtol=1e-12, atol=1e-14, msg=name)
    # The read-out of an unpooled (B, C) population: no spatial mean to undo.
    fc = rule.layers[-1][1]
    flat = hs[-1].mean(2)  # (B, C)
    delta = deltas[-1]
    weight = torch.randn(fc.weight.shape, generator=gen, dtype=flat.dtype)
    torch.testing.assert_close(rule.b_teaching(fc, delta, weight, flat),
                               _teaching(fc, delta, weight, flat), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(rule.b_gradient(fc, delta, flat),
                               _b_gradient(fc, delta, flat, weight), rtol=1e-12, atol=1e-14)


def _nlms(x_old, grad, curvature, eta):
    return x_old - eta * grad.square().sum() / curvature * grad


@pytest.mark.parametrize("difference, per_example", [("central", False), ("forward", False),
                                                      ("forward", True)])
def test_lhfa_one_event_is_the_exact_nlms_step(difference, per_example):
    """Complete orthogonal directions (exact observations): R_l = t_l - dL/dh_l, and each B
    takes X -= eta ||G||^2 / ||t(G)||^2 G with G and t(G) from autograd."""
    model, x, y = smooth_net()
    sigma = 1e-5 if difference == "central" else 1e-8
    eta = 0.7
    rule = make_rule("lhfa", model, {**EXACT, "eta_A": eta, "pert_sigma": sigma,
                                     "pert_difference": difference, "pert_per_example": per_example,
                                     "warmup_steps": 0}, seed=0)
    _, true, _ = true_gradients(copy.deepcopy(model), x, y)  # the copy has no B: backprop
    hs, teaching, deltas = _fa_signals(model, x, y, rule.layers)
    old = [b.clone() for b in rule.feedback]
    rule.calibrate(x, y)
    tol = 1e-7 if difference == "central" else 1e-5
    fits = []
    for (name, module), b, b0, index, delta in zip(rule.layers, rule.feedback, old,
                                                     rule.reads, deltas):
        residual = teaching[index] - true[index]
        grad = _b_gradient(module, delta, residual, b0)
        curvature = _teaching(module, delta, grad, hs[index]).square().sum()
        want = _nlms(b0, grad, curvature, eta)
        assert (b - want).norm() / (want - b0).norm() < tol, name
        fits.append(float(residual.norm() / true[index].norm()))
    k, n = EXACT["pert_directions"], len(rule.reads)
    queries = (2 if difference == "central" else 1) * k * n
    assert rule.estimator.counts() == {
        "loss_queries": queries, "observations": queries * (len(y) if per_example else 1),
        "example_passes": queries * len(y)}
    fit = sum(fits) / len(fits)
    assert rule.fit == pytest.approx(fit, rel=tol)
    assert rule.final_metrics(x, y) == {
        "perturbation": rule.estimator.counts(),
        "calibration": {"events": 1, "fit": rule.fit, "examples": len(y)}}
    metrics = rule.epoch_metrics()
    assert metrics["calibration"] == {"events": 1, "fit": rule.fit}
    assert metrics["perturbation"] == rule.estimator.counts()
    assert "feedback" in metrics  # fa's tracking of B


@pytest.mark.parametrize("difference, per_example", [("central", False), ("forward", False),
                                                      ("forward", True)])
def test_sdil_one_event_is_the_exact_nlms_step(difference, per_example):
    """A_l -= eta ||G||^2 / ||e G||^2 G, G = e^T (e A_l - dL/dh_l), exact observations."""
    model, x, y = smooth_net()
    sigma = 1e-5 if difference == "central" else 1e-8
    eta = 0.7
    rule = make_rule("sdil", model, {**EXACT, "eta_A": eta, "pert_sigma": sigma,
                                     "pert_difference": difference, "pert_per_example": per_example,
                                     "a_warmup_steps": 0}, seed=0)
    rule.compute_gradients(x, y, None)  # shapes: A_l drawn
    hs, true, _ = true_gradients(model, x, y)
    e = output_error(model(x).detach(), y)  # (B, K)
    old = [a.clone() for a in rule.A]
    rule.calibrate(x, y)
    tol = 1e-7 if difference == "central" else 1e-5
    fits = []
    for i, (a, a0, g) in enumerate(zip(rule.A, old, true)):
        residual = (e @ a0).view_as(g) - g
        grad = e.T @ residual.flatten(1)  # (K, units)
        want = _nlms(a0, grad, (e @ grad).square().sum(), eta)
        assert (a - want).norm() / (want - a0).norm() < tol, i
        fits.append(float(residual.norm() / g.norm()))
    k, n = EXACT["pert_directions"], len(hs)
    queries = (2 if difference == "central" else 1) * k * n
    assert rule.estimator.counts() == {
        "loss_queries": queries, "observations": queries * (len(y) if per_example else 1),
        "example_passes": queries * len(y)}
    assert rule.fit == pytest.approx(sum(fits) / len(fits), rel=tol)
    assert rule.final_metrics(x, y) == {
        "perturbation": rule.estimator.counts(), "gains": [0.0] * n,
        "calibration": {"events": 1, "fit": rule.fit, "examples": len(y)}}
    metrics = rule.epoch_metrics()
    assert metrics["calibration"] == {"events": 1, "fit": rule.fit}
    assert metrics["perturbation"] == rule.estimator.counts()


@pytest.mark.parametrize("name", ["lhfa", "sdil"])
@pytest.mark.parametrize("difference, per_example", [("central", True), ("forward", True),
                                                      ("forward", False)])
def test_observation_counts_follow_difference_and_per_example(name, difference, per_example):
    model, x, y = smooth_net()
    k = 2
    rule = make_rule(name, model, {"pert_directions": k, "pert_difference": difference,
                                   "pert_per_example": per_example}, seed=0)
    rule.calibrate(x, y)
    n = len(rule.reads) if name == "lhfa" else len(model.population_names)
    queries = (2 if difference == "central" else 1) * k * n
    assert rule.estimator.counts() == {
        "loss_queries": queries, "observations": queries * (len(y) if per_example else 1),
        "example_passes": queries * len(y)}
    assert math.isfinite(rule.fit)


def _sdil_used(rule_name, ins, h, c, gain, p, b, sign="hebbian"):
    """DESIGN section 5 in d sum-loss/dh units: the signal each traffic rule injects (the
    seed's descent convention d = -I, R_d = d + s T, N_d = R_d - s (P h + b); minus each)."""
    s = {"hebbian": 1.0, "anti_hebbian": -1.0}[sign]
    traffic = gain * c * h
    raw = -(-ins + s * traffic)
    innovation = -(-ins + s * traffic - s * (p * h + b))
    if rule_name == "none":
        return ins, raw, innovation, traffic
    if rule_name == "raw":
        return raw, raw, innovation, traffic
    if rule_name == "innovation":
        return innovation, raw, innovation, traffic
    scale = innovation.flatten(1).norm(dim=1) / raw.flatten(1).norm(dim=1)  # (B,)
    return raw * scale.view(-1, *[1] * (h.ndim - 1)), raw, innovation, traffic


def _cut(hs):
    return lambda i, h: hs.append(h) or h.detach()


def _predictor_nlms(h, T, P, b, eta):
    """DESIGN section 5's predictor step, written directly (float64)."""
    r = T - (P * h + b)
    hc, rc = h - h.mean(0), r - r.mean(0)
    return (P + eta * (rc * hc).mean(0) / (hc.square().mean(0) + 1e-12), b + eta * r.mean(0))


@pytest.mark.parametrize("traffic_rule,sign,every", [
    ("none", "hebbian", 100), ("raw", "hebbian", 1), ("innovation", "hebbian", 2),
    ("matched", "hebbian", 1), ("raw", "anti_hebbian", 2), ("matched", "anti_hebbian", 100)])
def test_sdil_step_and_apical_metrics_against_a_direct_implementation(traffic_rule, sign,
                                                                      every):
    """Gradients: the read-out's from the mean loss, each other layer's from its own
    population's used signal / B (autograd within the segment). Metrics: per population
    RMS over the summed steps of each signal, recomputed from the same formulas. The
    predictor: every ``every`` steps one NLMS step on the step's (h, g C h), written
    directly, and no change between."""
    model, x, y = smooth_net()
    rule = make_rule("sdil", model, {"traffic_rule": traffic_rule, "pert_every": 100,
                                     "predictor_every": every, "traffic_sign": sign}, seed=0)
    names = model.population_names
    fresh = rule.epoch_metrics()["apical"]  # nothing summed yet
    assert all(math.isnan(fresh[f"rms_{s}"][n]) for s in ("used", "traffic") for n in names)
    assert rule.compute_gradients(x, y, None).teaching is None  # record defaults to False
    gen = torch.Generator().manual_seed(5)
    rule.apical.gains = [0.5 + 0.25 * i for i in range(len(names))]
    for i, c in enumerate(rule.apical.coefficients):
        rule.apical.P[i] = (torch.randn(c.shape, generator=gen, dtype=c.dtype)
                            * rule.apical.gains[i])
        rule.apical.b[i] = 0.1 * torch.randn(c.shape, generator=gen, dtype=c.dtype)
    sums = {s: [0.0] * len(names) for s in ("used", "instruction", "raw", "innovation",
                                             "traffic")}
    numels = [0] * len(names)
    batches = [x, 0.7 * x + 0.3 * torch.randn(x.shape, generator=gen, dtype=x.dtype)]
    updates = 0
    for step, xb in enumerate(batches + batches[:1]):
        model.zero_grad(set_to_none=True)
        before = [(p.clone(), b.clone()) for p, b in zip(rule.apical.P, rule.apical.b)]
        result = rule.compute_gradients(xb, y, step, record=True)
        got = _grads(model)
        twin = copy.deepcopy(model)
        hs = []  # each population with its own segment's graph; the next layer reads a copy
        logits = twin(xb, tap=_cut(hs))
        e = output_error(logits.detach(), y)  # (B, K)
        total = F.cross_entropy(logits, y)
        for i, h in enumerate(hs):
            ins = (e @ rule.A[i]).view_as(h)
            torch.testing.assert_close(result.teaching[i], ins, rtol=1e-13, atol=0.0)
            ap = rule.apical
            used, raw, innovation, traffic = _sdil_used(
                traffic_rule, ins, h.detach(), ap.coefficients[i], ap.gains[i], *before[i], sign)
            if (step + 1) % every == 0:
                want_P, want_b = _predictor_nlms(h.detach(), traffic, *before[i],
                                                 ap.params.predictor_lr)
                assert bool((want_P != before[i][0]).any())
            else:
                want_P, want_b = before[i]
            torch.testing.assert_close(ap.P[i], want_P, rtol=1e-12, atol=1e-15)
            torch.testing.assert_close(ap.b[i], want_b, rtol=1e-12, atol=1e-15)
            total = total + (h * used).sum() / len(y)
            for s, v in (("used", used), ("instruction", ins), ("raw", raw),
                         ("innovation", innovation), ("traffic", traffic)):
                sums[s][i] += float(v.square().sum())
            numels[i] += h.numel()
        total.backward()
        want = _grads(twin)
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=1e-10, atol=1e-13, msg=n)
        updates += (step + 1) % every == 0
    assert rule.apical.predictor_updates == updates
    rule.compute_gradients(x, y, None)  # a diagnostic call sums nothing
    assert rule.steps == 3
    apical = rule.epoch_metrics()["apical"]
    for s, per in sums.items():
        rms = [math.sqrt(v / m) for v, m in zip(per, numels)]
        for name, value in zip(names, rms):
            assert apical[f"rms_{s}"][name] == pytest.approx(value, rel=1e-10), (s, name)
        assert apical[f"rms_{s}"]["mean"] == pytest.approx(sum(rms) / len(rms), rel=1e-10)
    again = rule.epoch_metrics()["apical"]  # the sums restart each epoch
    assert all(math.isnan(again[f"rms_{s}"][n]) for s in sums for n in names)


def test_sdil_initial_draws():
    """A_l ~ N(0, (feedback_scale / sqrt K)^2) minus its class mean, C ~ exp(0.25 N(0, 1)),
    drawn in float64, different per population, following seed, feedback_seed and
    traffic_seed; a single example is enough to build them."""
    from lab.rules.learned import SDIL

    def built(seed=0, **kw):
        model, x, y = smooth_net()
        rule = make_rule("sdil", model, {"feedback_scale": 0.3, **kw}, seed=seed)
        rule.compute_gradients(x[:1], y[:1], None)
        return rule

    rule = built()
    k = rule.A[0].shape[0]
    assert k == 3 and [a.shape[1] for a in rule.A] == [16] * 7
    a = torch.cat(rule.A, 1)
    assert a.sum(0).abs().max() < 1e-15  # no all-ones component
    # E (a - mean_k a)^2 = s^2 (1 - 1 / K); 336 entries: the std's sampling sd is ~5%.
    assert float(a.square().mean().sqrt()) == pytest.approx(
        0.3 / math.sqrt(k) * math.sqrt(1 - 1 / k), rel=0.15)
    logs = torch.cat([c.log().flatten() for c in rule.apical.coefficients])
    assert float(logs.std()) == pytest.approx(0.25, rel=0.15)
    assert float(logs.mean()) == pytest.approx(0.0, abs=0.1)
    for t in rule.A + rule.apical.coefficients:  # float64 draws, not float32 rounded
        assert t.dtype == torch.float64 and not torch.equal(t, t.float().double())
    assert not torch.equal(rule.apical.coefficients[0], rule.apical.coefficients[1])
    assert not torch.equal(rule.A[0], rule.A[1])
    same = built()
    assert all(torch.equal(u, v) for u, v in zip(rule.A + rule.apical.coefficients,
                                                  same.A + same.apical.coefficients))
    model, x, y = smooth_net()
    default = SDIL(model, SDIL.Params(feedback_scale=0.3))  # seed 0
    default.compute_gradients(x[:1], y[:1], None)
    assert all(torch.equal(u, v) for u, v in zip(rule.A + rule.apical.coefficients,
                                                  default.A + default.apical.coefficients))
    other_seed, other_fb, other_traffic = built(seed=1), built(feedback_seed=1), \
        built(traffic_seed=1)
    for u, v in zip(rule.A, other_seed.A):
        assert not torch.equal(u, v)
    for u, v in zip(rule.apical.coefficients, other_seed.apical.coefficients):
        assert not torch.equal(u, v)
    for i in range(len(rule.A)):
        assert not torch.equal(rule.A[i], other_fb.A[i])
        assert torch.equal(rule.apical.coefficients[i], other_fb.apical.coefficients[i])
        assert torch.equal(rule.A[i], other_traffic.A[i])
        assert not torch.equal(rule.apical.coefficients[i], other_traffic.apical.coefficients[i])
    assert rule.apical.gains == [0.0] * 7
    assert all(float(p.abs().max()) == 0.0 for p in rule.apical.P + rule.apical.b)


def test_lhfa_draws_fa_feedback_for_its_seed():
    from lab.rules.learned import LearnedFA

    for seed in (0, 5):
        model, _, _ = smooth_net()
        rule = LearnedFA(model, seed=seed) if seed else LearnedFA(model)
        fa = make_rule("fa", smooth_net()[0], seed=seed)
        assert all(torch.equal(b, f) for b, f in zip(rule.feedback, fa.feedback))


@pytest.mark.parametrize("name", ["lhfa", "sdil"])
def test_fresh_rule_metrics_and_state(name):
    model, x, y = smooth_net()
    rule = make_rule(name, model, {}, seed=0)
    metrics = rule.epoch_metrics()
    assert metrics["calibration"]["events"] == 0 and math.isnan(metrics["calibration"]["fit"])
    final = rule.final_metrics(x, y)
    assert math.isnan(final["calibration"]["fit"])
    twin = make_rule(name, smooth_net()[0], {}, seed=0)
    twin.load_state_dict(copy.deepcopy(rule.state_dict()))  # before any tensor is drawn
    assert math.isnan(twin.fit) and twin.events == 0
    if name == "sdil":
        assert twin.A is None and twin.apical.P == [None] * 7
        assert final["gains"] == [0.0] * 7
        bill = rule.work(model.layer_macs((1, x.shape[2])), 5)
        assert bill["feedback_propagation"] == bill["calibration"] == 0
        assert bill["traffic_calibration"] == 0
        assert rule.elementwise(5)["mixed_apical"] == 0


def test_rules_name_themselves_in_model_errors():
    import torch.nn as nn

    from lab.models.mlp import MLP

    for name in ("lhfa", "sdil"):
        with pytest.raises(ConfigError, match=rf"rule '{name}' needs a lab.models.ResNet"):
            make_rule(name, MLP(4, (3,), 2), {}, seed=0)
    with pytest.raises(ValueError, match=r"rule 'sdil' cannot train Sequential"):
        make_rule("sdil", nn.Sequential(nn.Linear(2, 2)), {}, seed=0)


@pytest.mark.parametrize("name, key", [("lhfa", "calibration_batch"),
                                       ("sdil", "calibration_batch"),
                                       ("sdil", "predictor_batch")])
def test_prefix_bounds_are_inclusive(name, key):
    """A draw as large as the training set is allowed; one more example is refused."""
    extra = {"a_warmup_steps": 1, "predictor_warmup_steps": 1, "predictor_batch": 2,
             "traffic_calibration_examples": 2} if name == "sdil" else {"warmup_steps": 1}
    params = {**extra, "calibration_batch": 2, "pert_directions": 1}
    model, x, y = smooth_net()
    make_rule(name, model, {**params, key: len(x)}, seed=0).prepare(x, y)
    rule = make_rule(name, smooth_net()[0], {**params, key: len(x) + 1}, seed=0)
    with pytest.raises(ConfigError, match=rf"^{name}: rule_params.{key}=5 but the training set "
                                          r"has only 4 examples; allowed: 1 to 4 \(or a larger "
                                          r"n_train\)$"):
        rule.prepare(x, y)


def test_lhfa_records_only_when_asked():
    model, x, y = smooth_net()
    rule = make_rule("lhfa", model, {}, seed=0)
    assert rule.compute_gradients(x, y, None).teaching is None
    assert len(rule.compute_gradients(x, y, None, record=True).teaching) == 7


def _forward_per_example(model, x, modules=None):
    """One example's forward MACs, counted by hooks (over ``modules``, default all layers)."""
    counted = {"macs": 0}

    def hook(module, inputs, output):
        per_output = (module.in_channels * math.prod(module.kernel_size)
                      if isinstance(module, Conv) else module.in_features)
        counted["macs"] += output.numel() * per_output

    chosen = [m for _, m in local_layers(model)] if modules is None else modules
    handles = [m.register_forward_hook(hook) for m in chosen]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    assert counted["macs"] % len(x) == 0
    return counted["macs"] // len(x)


def _units(model, x):
    hs = []
    with torch.no_grad():
        model(x, tap=lambda i, h: hs.append(h) or h)
    return [h[0].numel() for h in hs]


@pytest.mark.parametrize("name", ["lhfa", "sdil"])
def test_bill_after_warmup_and_steps_from_explicit_counts(name):
    """Warm-up events on calibration_batch draws, then events every pert_every steps on the
    step's batch; every component recomputed from hooks and explicit event/example/
    direction/update counts."""
    model, x, y = smooth_net()
    k, batch, cal = 2, len(y), 3
    params = {"pert_directions": k, "pert_every": 3, "calibration_batch": cal}
    if name == "sdil":
        params.update(a_warmup_steps=2, predictor_every=2, predictor_warmup_steps=2,
                      predictor_batch=batch, traffic_calibration_examples=batch)
    else:
        params.update(warmup_steps=2)
    rule = make_rule(name, model, params, seed=0)
    rule.prepare(x, y)
    for step in range(5):
        rule.compute_gradients(x, y, step)
    events, examples = 2 + 1, 2 * cal + batch  # warm-up, then step 3 (of 1..5)
    assert rule.events == events and rule.calibration_examples == examples
    layer_macs = model.layer_macs((1, x.shape[2]))
    forward = _forward_per_example(model, x)
    assert forward == sum(layer_macs.values())
    units = _units(model, x)
    n = 7
    work, trained = rule.work(layer_macs, 11), 11
    assert work["perturbation"] == rule.estimator.macs(layer_macs)
    # Perturbed elements: 2K passes per observed population and event, each of B x units.
    elements = 2 * k * examples * sum(units)
    if name == "lhfa":
        fb = _forward_per_example(model, x, [m for _, m in rule.layers])
        assert fb == rule.feedback_macs(layer_macs)
        assert work == {"forward": forward * trained, "local_correlation": forward * trained,
                        "feedback_propagation": fb * trained,
                        "calibration": examples * (forward + 3 * fb),
                        "perturbation": work["perturbation"]}
        assert rule.elementwise(trained) == {"perturbation": 4 * elements}
        return
    kk = 3  # classes
    updates = 2 + 2  # warm-up, then steps 2 and 4
    assert rule.apical.predictor_updates == updates and rule.steps == 5
    assert rule.gain_examples == batch
    assert work == {"forward": forward * trained, "local_correlation": forward * trained,
                    "feedback_propagation": kk * sum(units) * trained,
                    "calibration": examples * (forward + 3 * kk * sum(units)),
                    "perturbation": work["perturbation"],
                    "predictor_warmup": 2 * batch * forward,
                    "traffic_calibration": batch * (forward + kk * sum(units))}
    assert rule.elementwise(trained) == {
        "mixed_apical": 12 * sum(units) * trained,
        "predictor": updates * batch * 8 * sum(units),
        "perturbation": 4 * elements}
    assert len(units) == n


@pytest.mark.parametrize("name", ["lhfa", "sdil"])
def test_a_calibration_that_observes_nothing_finite_stops_the_run(name, monkeypatch):
    # Overflowing perturbed passes gave a NaN fit, every NLMS step was skipped, and the
    # run went on as plain fa / dfa, recorded complete.
    import dataclasses

    model, x, y = smooth_net()
    warm = {"lhfa": "warmup_steps", "sdil": "a_warmup_steps"}[name]
    rule = make_rule(name, model, {warm: 0}, seed=0)
    observe = rule.estimator.observe

    def overflowing(*args, **kwargs):
        probe = observe(*args, **kwargs)
        return dataclasses.replace(probe, observations=torch.full_like(probe.observations,
                                                                        math.inf))

    monkeypatch.setattr(rule.estimator, "observe", overflowing)
    with pytest.raises(FloatingPointError, match=(
            rf"^rule '{name}': the first calibration event fits the perturbation observations "
            r"as nan though the loss is finite: the perturbed passes overflowed at the initial "
            r"weights \(rule_params.pert_sigma=0.001\); give a smaller pert_sigma$")) as first:
        rule.calibrate(x, y)
    assert not isinstance(first.value, Diverged)  # at the initial weights: a config error
    assert rule.events == 0
    monkeypatch.setattr(rule.estimator, "observe", observe)
    rule.calibrate(x, y)  # finite observations: an ordinary event
    assert rule.events == 1 and math.isfinite(rule.fit)
    # Later, the weights have grown (a rate too large): the run diverged, a result.
    monkeypatch.setattr(rule.estimator, "observe", overflowing)
    with pytest.raises(Diverged, match=rf"^rule '{name}': calibration event 2 fits .* as nan"):
        rule.calibrate(x, y)
    monkeypatch.setattr(rule.estimator, "observe", observe)
    assert rule.events == 1 and math.isfinite(rule.fit)


@pytest.mark.parametrize("predictor", ["unit_affine", "channel_linear"])
def test_sdil_bills_its_predictors_channel_map(predictor):
    # sdil shares kp_traffic's compartment, so MT-2's channel map costs it the same MACs:
    # k^2 S per prediction (every trained example), three such products per observed
    # example, a k x k solve per population and update; the per-unit predictors none.
    (model, rule), _, x, y = _sdil_pair("innovation", predictor=predictor,
                                        predictor_warmup_steps=2, predictor_batch=4)
    for step in range(1, 4):
        rule.compute_gradients(x, y, step)
    ap, trained = rule.apical, 3 * len(y)
    shapes = ap.shapes
    assert len(shapes) == len(rule.A) and ap.predictor_updates > 0
    work = rule.work(model.layer_macs(tuple(x.shape[1:])), trained)
    if predictor == "unit_affine":
        assert "predictor" not in work
        return
    map_macs = sum(s[0] * math.prod(s) for s in shapes.values())
    solves = sum(4 * s[0] ** 3 // 3 for s in shapes.values())
    assert work["predictor"] == (trained * map_macs + ap.predictor_examples * 3 * map_macs
                                 + ap.predictor_updates * solves) > 0
    units = sum(math.prod(s) for s in shapes.values())
    assert rule.elementwise(trained)["predictor"] == (
        ap.predictor_examples * 6 + trained * 1) * units
