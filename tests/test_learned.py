"""lhfa and sdil: feedback learned from perturbation observations (float64 oracles)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from test_perturbation import smooth_net, true_gradients

from lab.config import ConfigError
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
    assert rule.gains == [0.0] * len(rule.gains)
    rule.compute_gradients(x, y, None)
    clean.compute_gradients(x, y, None)
    got, want = _grads(model), _grads(clean_model)
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_sdil_exact_predictor_leaves_the_instruction():
    """P = g C: the innovation N = R - P h is the instruction, to rounding."""
    (model, rule), (clean_model, clean), x, y = _sdil_pair("innovation")
    assert all(g > 0 for g in rule.gains)
    for i, c in enumerate(rule.coefficients):
        rule.P[i] = c * rule.gains[i]  # P = g C, b = 0: the traffic exactly predicted
        rule.b[i].zero_()
    rule.compute_gradients(x, y, None)
    clean.compute_gradients(x, y, None)
    got, want = _grads(model), _grads(clean_model)
    for n in want:
        assert torch.allclose(got[n], want[n], rtol=1e-14, atol=1e-14 * want[n].abs().max()), n


def test_sdil_raw_traffic_changes_the_update_and_the_predictor_learns_it():
    (model, rule), _, x, y = _sdil_pair("raw", predictor_warmup_steps=0)
    hs, _, _ = true_gradients(model, x, y)
    for _ in range(30):
        rule.predict(hs)
    for i, c in enumerate(rule.coefficients):  # NLMS on (h, g C h) finds P = g C
        active = hs[i].flatten(1).std(0).view_as(c) > 0.1
        assert torch.allclose(rule.P[i][active], (c * rule.gains[i])[active], rtol=1e-3)


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
    params = {"pert_directions": 2, "pert_every": 1}
    rule = make_rule(name, model, params, seed=0)
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
