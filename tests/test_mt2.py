"""MT-2: traffic models a local predictor cannot always model, and richer predictors.

Float64 oracles on small 1-D ResNets (issue 37): calibration, exact representation,
the least-squares limit, the noise floor, locality, zero gain and refused inputs."""

from __future__ import annotations

import math

import pytest
import torch

import numba_kernels
from lab.config import ConfigError
from lab.models import ResNet
from lab.rules import make_rule
from lab.rules.apical import MixingTraffic

MODELS = ("linear", "saturating", "mixing", "noisy")
PREDICTORS = ("unit_affine", "unit_quadratic", "channel_linear")


def _rule(params, model_seed=0, seed=3, rule="kp_traffic"):
    torch.manual_seed(model_seed)
    model = ResNet(8, 4, dims=1, in_channels=1, n_classes=10, dtype=torch.float64)
    return model, make_rule(rule, model, {"traffic_calibration_examples": 20,
                                          "predictor_warmup_steps": 0, **params}, seed=seed)


def _batch(n=24, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 1, 40, generator=g, dtype=torch.float64),
            torch.randint(0, 10, (n,), generator=g))


def _observations(rule, batches=1, n=64):
    """Instruction-off activity of the fixed network on ``batches`` batches."""
    out = []
    for k in range(batches):
        x, y = _batch(n, seed=100 + k)
        hs, _ = rule.instructions(x, y)
        out.append(hs)
    return out


def _residual(apical, hs) -> float:
    return apical.residual_ratio(hs)


@pytest.mark.parametrize("model", MODELS)
def test_each_model_is_calibrated_to_the_ratio(model):
    _, rule = _rule({"traffic_model": model, "traffic_ratio": 2.5, "noise": 0.7,
                     "mixing": 0.4})
    x, y = _batch()
    rule.prepare(x, y)
    hs, ins = rule.instructions(x[:20], y[:20])
    traffic = rule.apical.traffic
    for i, (h, instruction) in enumerate(zip(hs, ins)):
        if model == "noisy":  # the expected square of g C h + e, e of RMS sigma
            ms = float((traffic.coefficients[i] * traffic.gains[i] * h).square().mean()
                       + traffic.sigmas[i] ** 2)
            # the noise is noise x the deterministic part's RMS
            det = ms - traffic.sigmas[i] ** 2
            assert traffic.sigmas[i] ** 2 == pytest.approx(0.49 * det, rel=1e-12)
        else:
            ms = float(traffic(i, h).square().mean())
        ratio = math.sqrt(ms) / float(instruction.square().mean().sqrt())
        assert abs(ratio - 2.5) < 1e-12, (model, i, ratio)


@pytest.mark.parametrize("model,predictor", [("linear", "unit_affine"),
                                             ("mixing", "channel_linear"),
                                             ("linear", "unit_quadratic")])
def test_a_predictor_that_can_represent_the_model_removes_it(model, predictor):
    _, rule = _rule({"traffic_model": model, "predictor": predictor, "mixing": 0.6})
    x, y = _batch()
    rule.prepare(x, y)
    batches = _observations(rule, 4)
    assert _residual(rule.apical, batches[0]) == pytest.approx(1.0)  # nothing predicted yet
    for step in range(60):
        rule.apical.predict(batches[step % 3])
    assert _residual(rule.apical, batches[3]) < 1e-6  # held-out batch


def test_an_affine_predictor_cannot_remove_mixing():
    _, rule = _rule({"traffic_model": "mixing", "mixing": 0.6})
    x, y = _batch()
    rule.prepare(x, y)
    batches = _observations(rule, 4)
    for step in range(60):
        rule.apical.predict(batches[step % 3])
    assert _residual(rule.apical, batches[3]) > 0.1


@pytest.mark.parametrize("predictor", ["unit_affine", "unit_quadratic"])
def test_on_saturating_traffic_the_predictor_converges_to_least_squares(predictor):
    _, rule = _rule({"traffic_model": "saturating", "predictor": predictor})
    x, y = _batch()
    rule.prepare(x, y)
    (hs,) = _observations(rule, 1, n=96)
    for _ in range(80):
        rule.apical.predict(hs)
    ss_fit = ss_lstsq = 0.0
    for i, h in enumerate(hs):
        t = rule.apical.traffic(i, h)
        ss_fit += float((t - rule.apical.predictor(i, h)).square().sum())
        # Per unit, the least-squares fit of T on (1, h[, h^2]) over the same examples.
        hu, tu = h.flatten(1).T, t.flatten(1).T  # (units, B)
        cols = [torch.ones_like(hu), hu] + ([hu.square()] if predictor != "unit_affine" else [])
        a = torch.stack(cols, -1)  # (units, B, features)
        sol = torch.linalg.lstsq(a, tu.unsqueeze(-1)).solution
        ss_lstsq += float((a @ sol - tu.unsqueeze(-1)).square().sum())
    assert ss_lstsq > 0  # saturating traffic is not affine
    assert abs(math.sqrt(ss_fit) / math.sqrt(ss_lstsq) - 1) < 1e-3


def test_quadratic_beats_affine_on_saturating_traffic():
    residuals = {}
    for predictor in ("unit_affine", "unit_quadratic"):
        _, rule = _rule({"traffic_model": "saturating", "predictor": predictor})
        x, y = _batch()
        rule.prepare(x, y)
        batches = _observations(rule, 4)
        for step in range(60):
            rule.apical.predict(batches[step % 3])
        residuals[predictor] = _residual(rule.apical, batches[3])
    assert residuals["unit_quadratic"] < residuals["unit_affine"]


def test_on_noisy_traffic_the_residual_approaches_the_noise_share():
    noise = 0.5
    _, rule = _rule({"traffic_model": "noisy", "noise": noise, "predictor_lr": 0.05})
    x, y = _batch()
    rule.prepare(x, y)
    batches = _observations(rule, 6, n=128)
    for step in range(300):
        rule.apical.predict(batches[step % 5])
    ratio = _residual(rule.apical, batches[5])
    floor = noise / math.sqrt(1 + noise ** 2)
    assert abs(ratio / floor - 1) < 0.05, (ratio, floor)


@pytest.mark.parametrize("predictor", PREDICTORS)
def test_each_predictor_update_depends_on_its_own_observations_only(predictor):
    params = {"traffic_model": "mixing", "predictor": predictor}
    _, rule_a = _rule(params)
    x, y = _batch()
    rule_a.prepare(x, y)
    # Another network entirely: every forward and feedback weight differs.
    _, rule_c = _rule(params, model_seed=7, seed=11)
    with torch.no_grad():
        for b in rule_c.feedback:
            b.normal_()
    (hs,) = _observations(rule_a, 1)
    rule_c.apical.ensure(hs)
    rule_c.apical.traffic.load(rule_a.apical.traffic.state())
    for _ in range(3):
        rule_a.apical.predict(hs)
        rule_c.apical.predict(hs)
    sa, sc = rule_a.apical.predictor.state(), rule_c.apical.predictor.state()
    for key in sa:
        for a, c in zip(sa[key], sc[key]):
            assert torch.equal(a, c), key
    assert any(float(t.abs().max()) > 0 for t in sa["b"])  # it did learn something


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("predictor", PREDICTORS)
def test_zero_gain_gives_clean_kp(model, predictor):
    model_t, rule = _rule({"traffic_model": model, "predictor": predictor,
                           "traffic_ratio": 0.0, "noise": 0.5})
    x, y = _batch()
    rule.prepare(x, y)
    torch.manual_seed(0)
    clean_model = ResNet(8, 4, dims=1, in_channels=1, n_classes=10, dtype=torch.float64)
    kp = make_rule("kp", clean_model, {}, seed=3)
    for m, r in ((model_t, rule), (clean_model, kp)):
        m.zero_grad(set_to_none=True)
        r.compute_gradients(x, y, None)
    for (name, p), q in zip(model_t.named_parameters(), clean_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12,
                                   atol=1e-14 * float(q.grad.abs().max()), msg=name)


def test_the_general_signals_equal_the_fused_ones_on_the_seeds_pair():
    g = torch.Generator().manual_seed(0)
    instruction, h = (torch.randn(6, 3, 5, generator=g, dtype=torch.float64) for _ in "ab")
    c, p, b = (torch.randn(3, 5, generator=g, dtype=torch.float64) for _ in "abc")
    for rule in ("raw", "innovation", "matched"):
        for sign in ("hebbian", "anti_hebbian"):
            fused = numba_kernels.mixed_apical_reference(instruction, h, c, 0.7, p, b, rule, sign)
            general = numba_kernels.mixed_traffic_reference(instruction, 0.7 * c * h, p * h + b,
                                                            rule, sign)
            torch.testing.assert_close(general.used, fused.used, rtol=1e-13, atol=1e-14)
            torch.testing.assert_close(general.sums, fused.sums, rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("rule", ["kp_traffic", "sdil"])
@pytest.mark.parametrize("params,message", [
    ({"traffic_model": "cubic"}, r"traffic_model.*cubic.*linear.*saturating.*mixing.*noisy"),
    ({"predictor": "oracle"}, r"predictor.*oracle.*unit_affine.*unit_quadratic"),
    ({"mixing": 1.5}, r"mixing.*1.5"),
    ({"noise": -0.1}, r"noise.*-0.1"),
])
def test_bad_inputs_are_refused_naming_the_key(rule, params, message):
    with pytest.raises(ConfigError, match=message):
        if rule == "kp_traffic":
            _rule(params)
        else:
            from lab.models.mlp import MLP
            make_rule("sdil", MLP(4, (6,), 3), params, seed=0)


def test_mixing_on_a_single_channel_population_is_refused_before_a_kernel_starts():
    traffic = MixingTraffic(1, 0, "traffic", 0, mixing=0.3)
    with pytest.raises(ConfigError, match=r"mixing=0.3 needs at least 2 channels.*\(1, 5\)"):
        traffic.ensure(0, torch.zeros(4, 1, 5, dtype=torch.float64))


def test_the_report_pairs_each_run_with_its_clean_reference_on_the_fixture():
    import json
    from pathlib import Path

    from analysis import load_protocol_runs, mt2

    fixture = Path(__file__).parent / "fixtures" / "mt2"
    frame = mt2.run_frame(load_protocol_runs(fixture / "protocol.yaml"))
    assert len(frame) == 18
    for run_id, row in frame.iterrows():
        record = json.loads((fixture / "runs" / run_id / "record.json").read_text())
        clean = json.loads((fixture / "runs" / run_id.replace(
            f"traffic_rule-{row.traffic_rule}", "traffic_rule-none") / "record.json").read_text())
        acc, ref = record["final"].get("test_acc"), clean["final"]["test_acc"]
        if row.traffic_rule == "none" or acc is None:
            assert math.isnan(row.gap)
        else:
            assert row.gap == pytest.approx(ref - acc, abs=1e-12)


@pytest.mark.parametrize("predictor", PREDICTORS)
def test_the_bill_counts_the_predictors_macs_and_element_wise_work(predictor):
    """The channel map's multiply-accumulates, counted by torch's flop counter on the
    predictor's own calls (a prediction per trained example; an update's three products
    per observed example) plus the k x k solves by hand (4 k^3 / 3 per population and
    update); the per-unit predictors have none. Element-wise work per unit from the
    populations' shapes and explicit example and update counts."""
    from torch.utils.flop_counter import FlopCounterMode

    model, rule = _rule({"predictor": predictor, "predictor_warmup_steps": 2,
                         "predictor_batch": 8, "predictor_every": 2})
    x, y = _batch()
    rule.prepare(x, y)
    for step in range(1, 6):
        rule.compute_gradients(x, y, step)
    updates, observed, trained = 2 + 2, 2 * 8 + 2 * len(y), 5 * len(y)  # steps 2 and 4
    ap = rule.apical
    assert (ap.predictor_updates, ap.predictor_examples) == (updates, observed)
    hs = rule.last_h
    units = sum(h[0].numel() for h in hs.values())
    work = rule.work(model.layer_macs((1, 40)), trained)
    if predictor == "channel_linear":
        with FlopCounterMode(display=False) as predicted:
            for i, h in hs.items():
                ap.predictor(i, h)
        per_example = predicted.get_total_flops() // 2 // len(y)  # flops = 2 MACs
        assert per_example == sum(h.shape[1] * h[0].numel() for h in hs.values())
        twin = type(ap.predictor)(len(hs))
        twin.load(ap.predictor.state())
        with FlopCounterMode(display=False) as updated:
            for i, h in hs.items():
                twin.update(i, h, ap.traffic(i, h), 0.5)
        products = updated.get_total_flops() // 2 // len(y)  # the solve is not counted
        assert products == 3 * per_example
        solves = sum(4 * h.shape[1] ** 3 // 3 for h in hs.values())
        assert work["predictor"] == (trained * per_example + observed * products
                                     + updates * solves)
    else:
        assert "predictor" not in work
    update_ops, prediction_ops = {"unit_affine": (8, 0), "unit_quadratic": (21, 2),
                                  "channel_linear": (6, 1)}[predictor]
    elementwise = rule.elementwise(trained)
    assert elementwise["predictor"] == (observed * update_ops + trained * prediction_ops) * units
    assert elementwise["mixed_local"] == 30 * units * trained
