"""kp_traffic: the DESIGN section 5 invariants, in float64 on small 1-D and 2-D ResNets."""

from __future__ import annotations

import pytest
import torch

from lab.config import ConfigError
from lab.models import ResNet
from lab.models.mlp import MLP
from lab.rules import make_rule

TRAFFIC_RULES = ("raw", "matched", "innovation")
SIGNS = ("hebbian", "anti_hebbian")
SHAPES = {1: (1, 40), 2: (3, 8, 8)}


def _mixed(instruction, traffic, predicted, sign):
    """The used gradients by the seed's recipe, written directly: d = -I, R_d = d + s T,
    N_d = R_d - s (P h + b), M_d = R_d ||N_d|| / ||R_d|| per example; used = minus each."""
    s = {"hebbian": 1.0, "anti_hebbian": -1.0}[sign]
    d = -instruction
    raw = d + s * traffic
    innovation = raw - s * predicted
    norms = innovation.flatten(1).norm(dim=1) / raw.flatten(1).norm(dim=1)
    matched = raw * norms.view(-1, *[1] * (raw.ndim - 1))
    return {"raw": -raw, "innovation": -innovation, "matched": -matched}


def _setup(rule, params=None, dims=1, seed=3, model_seed=0, normalization="batchnorm",
           residual_scale=1.0):
    torch.manual_seed(model_seed)
    channels = SHAPES[dims][0]
    model = ResNet(8, 4, dims=dims, in_channels=channels, n_classes=10,
                   normalization=normalization, residual_scale=residual_scale,
                   dtype=torch.float64)
    return model, make_rule(rule, model, params or {}, seed=seed)


def _batch(dims, n=24, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *SHAPES[dims], generator=g, dtype=torch.float64)
    return x, torch.randint(0, 10, (n,), generator=g)


def _grads(model, rule, x, y, record=False):
    model.zero_grad(set_to_none=True)
    for b in getattr(rule, "feedback", []):
        b.grad = None
    out = rule.compute_gradients(x, y, None, record=record)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    feedback = [b.grad.clone() for b in rule.feedback]
    return grads, feedback, out


def _same(a, b, name=""):
    """Equal to float64 rounding: the norm's backward is the fused kernel's, not ATen's,
    so sums over the batch run in another order (a wrong scale or term is far above)."""
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14 * float(b.abs().max()), msg=name)


def _calibrated(dims, traffic_rule, residual_scale=1.0, **extra):
    model, rule = _setup("kp_traffic", {"traffic_rule": traffic_rule,
                                        "traffic_calibration_examples": 20,
                                        "predictor_warmup_steps": 0, **extra}, dims,
                         residual_scale=residual_scale)
    x, y = _batch(dims)
    rule.prepare(x, y)
    return model, rule, x, y


@pytest.mark.parametrize("dims", [1, 2])
@pytest.mark.parametrize("normalization", ["batchnorm", "none"])
@pytest.mark.parametrize("traffic_rule", TRAFFIC_RULES)
@pytest.mark.parametrize("sign", SIGNS)
def test_zero_gain_and_zero_predictor_give_clean_kp(dims, normalization, traffic_rule, sign):
    x, y = _batch(dims)
    model, kp = _setup("kp", dims=dims, normalization=normalization)
    clean, clean_b, _ = _grads(model, kp, x, y)
    model, rule = _setup("kp_traffic", {"traffic_rule": traffic_rule, "traffic_sign": sign},
                         dims, normalization=normalization)
    assert rule.apical.gains == [0.0] * len(rule.apical.gains)  # before calibration
    mixed, mixed_b, _ = _grads(model, rule, x, y)
    assert clean.keys() == mixed.keys()
    for name in clean:
        _same(mixed[name], clean[name], name)
    for a, b in zip(mixed_b, clean_b):
        _same(a, b)


@pytest.mark.parametrize("dims,sign", [(1, "hebbian"), (2, "hebbian"), (1, "anti_hebbian")])
def test_the_none_reference_is_clean_kp_with_the_traffic_calibrated(dims, sign):
    x, y = _batch(dims)
    model, kp = _setup("kp", dims=dims)
    clean, clean_b, _ = _grads(model, kp, x, y)
    model, rule, _, _ = _calibrated(dims, "none", traffic_sign=sign)
    assert min(rule.apical.gains) > 0
    mixed, mixed_b, _ = _grads(model, rule, x, y)
    for name in clean:
        _same(mixed[name], clean[name], name)
    for a, b in zip(mixed_b, clean_b):
        _same(a, b)


@pytest.mark.parametrize("dims", [1, 2])
def test_calibration_meets_the_ratio_on_the_calibration_examples(dims):
    model, rule, x, y = _calibrated(dims, "raw", traffic_ratio=2.5)
    hs, instructions = rule.instructions(x[:20], y[:20])
    for i, (h, instruction) in enumerate(zip(hs, instructions)):
        traffic = rule.apical.coefficients[i] * rule.apical.gains[i] * h
        ratio = traffic.square().mean().sqrt() / instruction.square().mean().sqrt()
        assert abs(float(ratio) - 2.5) < 1e-12, (i, float(ratio))
    # The coefficients are exp(0.25 N(0,1)): log-normal around 1, with log-std 0.25.
    logs = torch.cat([c.log().flatten() for c in rule.apical.coefficients])
    assert abs(float(logs.std()) - 0.25) < 0.02 and abs(float(logs.mean())) < 0.02


@pytest.mark.parametrize("dims,sign", [(1, "hebbian"), (2, "hebbian"), (1, "anti_hebbian"),
                                       (2, "anti_hebbian")])
def test_an_exact_predictor_leaves_innovation_equal_to_the_instruction(dims, sign):
    model, rule, x, y = _calibrated(dims, "innovation", traffic_sign=sign)
    for i in range(len(rule.apical.P)):
        rule.apical.P[i] = rule.apical.coefficients[i] * rule.apical.gains[i]
        rule.apical.b[i].zero_()
    _, _, out = _grads(model, rule, x, y, record=True)
    import numba_kernels
    for i, instruction in enumerate(out.teaching):
        h = rule.last_h[i]
        used = numba_kernels.mixed_apical(instruction, h, rule.apical.coefficients[i],
                                          rule.apical.gains[i], rule.apical.P[i],
                                          rule.apical.b[i], "innovation", sign=sign).used
        assert (used - instruction).abs().max() <= 1e-14 * instruction.abs().max()
    # ... and so the innovation rule trains exactly as clean KP does.
    clean_model, kp = _setup("kp", dims=dims)
    clean, _, _ = _grads(clean_model, kp, x, y)
    mixed, _, _ = _grads(model, rule, x, y)
    for name in clean:
        torch.testing.assert_close(mixed[name], clean[name], rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("sign", SIGNS)
def test_matched_has_the_innovation_norm_and_the_raw_direction(sign):
    import numba_kernels

    model, rule, x, y = _calibrated(1, "matched", traffic_sign=sign)
    ap = rule.apical
    ap.P[3] = 0.5 * ap.coefficients[3] * ap.gains[3]  # half the traffic predicted
    _, _, out = _grads(model, rule, x, y, record=True)
    for i, instruction in enumerate(out.teaching):
        h = rule.last_h[i]
        signals = {name: numba_kernels.mixed_apical(
            instruction, h, rule.apical.coefficients[i], rule.apical.gains[i], rule.apical.P[i],
            rule.apical.b[i], name, sign=sign).used for name in TRAFFIC_RULES}
        m, n, r = (signals[k].flatten(1) for k in ("matched", "innovation", "raw"))
        torch.testing.assert_close(m.norm(dim=1), n.norm(dim=1), rtol=1e-12, atol=0)
        cos = (m * r).sum(1) / (m.norm(dim=1) * r.norm(dim=1))
        assert (cos - 1).abs().max() < 1e-12


@pytest.mark.parametrize("traffic_rule", TRAFFIC_RULES)
@pytest.mark.parametrize("residual_scale,sign", [(1.0, "hebbian"), (0.5, "hebbian"),
                                                 (1.0, "anti_hebbian")])
def test_each_layer_learns_from_the_used_signal_at_its_population(traffic_rule, residual_scale,
                                                                  sign):
    """Oracle: autograd of sum(U * h) / B w.r.t. the producing layer alone (the residual
    scale on the norm's output included), U written directly from the seed's recipe."""
    model, rule, x, y = _calibrated(2, traffic_rule, residual_scale=residual_scale,
                                    traffic_sign=sign)
    rule.apical.P[2] = 0.3 * rule.apical.coefficients[2] * rule.apical.gains[2]
    rule.apical.b[2].fill_(0.01)
    grads, feedback, out = _grads(model, rule, x, y, record=True)
    ap = rule.apical
    used = [_mixed(out.teaching[i], ap.gains[i] * ap.coefficients[i] * rule.last_h[i],
                   ap.P[i] * rule.last_h[i] + ap.b[i], sign)[traffic_rule]
            for i in range(len(out.teaching))]
    populations = {}

    def tap(i, h):
        populations[i] = h
        return h

    model(x, tap=tap)
    layers = [model.stem] + [c for blk in model.blocks for c in (blk.conv1, blk.conv2)]
    norms = [model.stem_norm] + [n for blk in model.blocks for n in (blk.norm1, blk.norm2)]
    for i, (conv, norm) in enumerate(zip(layers, norms)):
        surrogate = (used[i].detach() * populations[i]).sum() / len(y)
        want = torch.autograd.grad(surrogate, [conv.weight, norm.weight, norm.bias],
                                   retain_graph=True)
        name = [n for n, p in model.named_parameters() if p is conv.weight][0]
        torch.testing.assert_close(grads[name], want[0], rtol=1e-10, atol=1e-13)
        torch.testing.assert_close(norm.weight.grad, want[1], rtol=1e-10, atol=1e-13)
        torch.testing.assert_close(norm.bias.grad, want[2], rtol=1e-10, atol=1e-13)
    # Kolen-Pollack: every feedback tensor gets exactly its forward weight's update.
    for (_, module), b_grad in zip(rule.layers, feedback):
        assert torch.equal(b_grad, module.weight.grad)
    # The traffic is large: the used signal is not the instruction.
    if traffic_rule != "innovation":
        assert float((used[0] - out.teaching[0]).norm()) > float(out.teaching[0].norm())


@pytest.mark.parametrize("traffic_rule", TRAFFIC_RULES)
def test_traffic_never_reaches_a_lower_population(traffic_rule):
    model, rule, x, y = _calibrated(1, traffic_rule)
    _, _, first = _grads(model, rule, x, y, record=True)
    rule.apical.gains = [10 * g for g in rule.apical.gains]
    grads, _, second = _grads(model, rule, x, y, record=True)
    for a, b in zip(first.teaching, second.teaching):
        assert torch.equal(a, b)
    # The weight updates, which take the mixed signal, do change.
    _, kp = _setup("kp", dims=1)
    clean, _, _ = _grads(*_setup("kp", dims=1), x, y)
    assert not torch.equal(grads["stem.weight"], clean["stem.weight"])


@pytest.mark.parametrize("sign", SIGNS)
def test_the_predictor_update_depends_on_its_own_units_only(sign):
    _, rule_a, x, y = _calibrated(1, "innovation", traffic_sign=sign)
    # Another network entirely: every forward and feedback weight differs.
    _, rule_c = _setup("kp_traffic", {"predictor_warmup_steps": 0}, 1, model_seed=7, seed=11)
    with torch.no_grad():
        for b in rule_c.feedback:
            b.normal_()
    rule_a.compute_gradients(x, y, None)
    h = {i: t.clone() for i, t in rule_a.last_h.items()}
    rule_c.apical.gains, rule_c.apical.coefficients = list(rule_a.apical.gains), [c.clone() for c in
                                                             rule_a.apical.coefficients]
    for rule in (rule_a, rule_c):
        rule.apical.P = [torch.zeros_like(t[0]) for t in h.values()]
        rule.apical.b = [torch.zeros_like(t[0]) for t in h.values()]
        rule.apical.predict(h)
    for i, hi in h.items():
        a, c = rule_a.apical, rule_c.apical
        assert torch.equal(a.P[i], c.P[i]) and torch.equal(a.b[i], c.b[i])
        # From zero, one NLMS step on T = g C h (an exact linear function of h, per unit)
        # moves P to eta x g C wherever h varies over the batch, and b to eta x mean(T).
        gc = rule_a.apical.coefficients[i] * rule_a.apical.gains[i]
        varies = hi.var(0) > 1e-6
        eta = rule_a.params.predictor_lr
        torch.testing.assert_close(rule_a.apical.P[i][varies], eta * gc[varies], rtol=1e-6, atol=0)
        torch.testing.assert_close(rule_a.apical.b[i], eta * (gc * hi).mean(0), rtol=1e-12,
                                   atol=1e-15)


def test_warm_up_learns_the_traffic_and_is_recorded():
    model, rule = _setup("kp_traffic", {"traffic_calibration_examples": 20,
                                        "predictor_warmup_steps": 20, "predictor_batch": 16})
    x, y = _batch(1, n=40)
    order = torch.randperm(40, generator=torch.Generator().manual_seed(5))
    rule.prepare(x, y)
    assert rule.warmup["first_ratio"] == pytest.approx(1.0)  # P = b = 0: nothing predicted
    assert rule.warmup["last_ratio"] < 1e-3
    # The rule draws warm-up batches with its own generator: the global one is untouched.
    assert torch.equal(order, torch.randperm(40, generator=torch.Generator().manual_seed(5)))


@pytest.mark.parametrize("params,message", [
    ({"traffic_calibration_examples": 100}, r"traffic_calibration_examples=100 but the "
                                            r"training set has only 40 examples"),
    ({"predictor_batch": 64, "traffic_calibration_examples": 40},
     r"predictor_batch=64 but the training set has only 40"),
])
def test_examples_that_do_not_exist_are_refused(params, message):
    _, rule = _setup("kp_traffic", params)
    x, y = _batch(1, n=40)
    with pytest.raises(ConfigError, match=message):
        rule.prepare(x, y)


@pytest.mark.parametrize("params,message", [
    ({"traffic_rule": "mixed"},
     r"traffic_rule='mixed' is not allowed; choose one of: 'none', 'raw'"),
    ({"traffic_ratio": -1.0}, r"traffic_ratio=-1.0 is out of range"),
    ({"predictor_lr": 0.0}, r"predictor_lr=0.0 is out of range"),
])
def test_bad_parameters_are_refused(params, message):
    with pytest.raises(ConfigError, match=message):
        _setup("kp_traffic", params)


def test_a_model_without_known_populations_is_refused():
    model = MLP(40, (16,), 10)
    with pytest.raises(ConfigError, match="kp_traffic' needs a lab.models.ResNet"):
        make_rule("kp_traffic", model, {})


@pytest.mark.parametrize("traffic_rule", ["none", "innovation"])
def test_the_bill_adds_no_macs_to_kp_and_counts_element_wise_work_apart(traffic_rule):
    """Clean transport: kp_traffic's step bill is kp's; calibration, warm-up and the
    element-wise work are billed on their own lines, per example and per unit."""
    from lab.diagnostics.work import bill

    model, rule, x, y = _calibrated(1, traffic_rule, predictor_warmup_steps=3,
                                    predictor_batch=8, predictor_every=2)
    kp_model, kp = _setup("kp")
    for step in range(4):
        rule.compute_gradients(x, y, step)
    work, clean = bill(rule, model, (1, 40), 96), bill(kp, kp_model, (1, 40), 96)
    f = work["forward_macs_per_example"]
    assert {k: v for k, v in work["macs"].items()
            if k not in ("calibration", "predictor_warmup")} == clean["macs"]
    assert work["macs"]["predictor_warmup"] == 3 * 8 * f
    assert work["macs"]["calibration"] == 20 * (f + rule.feedback_macs(model.layer_macs((1, 40))))
    units = sum(p.numel() for p in rule.apical.P)
    assert units == sum(h[0].numel() for h in rule.last_h.values())
    per_unit = {"none": ("mixed_apical", 12), "innovation": ("mixed_local", 30)}[traffic_rule]
    assert work["elementwise"][per_unit[0]] == per_unit[1] * units * 96
    # warm-up passes (3 of predictor_batch 8) and every second training step (2 of the
    # step's 24 examples) update the predictor
    assert work["elementwise"]["predictor"] == (3 * 8 + 2 * 24) * 8 * units


def _true_gradients(model, x, y):
    """d(sum loss)/dh per population by plain autograd on a copy without feedback."""
    import copy

    import torch.nn.functional as F

    from lab.models.layers import local_layers

    twin = copy.deepcopy(model)
    for _, m in local_layers(twin):
        m.feedback = None
    hs = []
    logits = twin(x, tap=lambda i, h: hs.append(h) or h)
    grads = torch.autograd.grad(F.cross_entropy(logits, y, reduction="sum"), hs)
    return [h.detach() for h in hs], list(grads)


def _kp_instruction(model, x, y):
    """KP's instruction d(sum loss)/dh through the feedback tensors, by plain autograd."""
    import torch.nn.functional as F

    from lab.models.state import preserved_norm_stats

    hs = []
    with preserved_norm_stats(model):
        logits = model(x, tap=lambda i, h: hs.append(h) or h)
        loss = F.cross_entropy(logits, y, reduction="sum")
        hs = [h for h in hs if h.requires_grad]
        grads = torch.autograd.grad(loss, hs, allow_unused=True)
    return list(grads)


def _cos_examples(a, b):
    """Mean over examples (both non-zero) of the cosine, computed directly."""
    vals = []
    for u, v in zip(a.flatten(1), b.flatten(1)):
        if u.norm() > 0 and v.norm() > 0:
            vals.append(float(u @ v / (u.norm() * v.norm())))
    return sum(vals) / len(vals) if vals else float("nan")


@pytest.mark.parametrize("traffic_rule,sign", [
    ("none", "hebbian"), ("raw", "hebbian"), ("innovation", "hebbian"), ("matched", "hebbian"),
    ("raw", "anti_hebbian"), ("matched", "anti_hebbian")])
def test_final_metrics_against_independent_values(traffic_rule, sign):
    """Residual ratio, gains, silent count and every signal's alignment with autograd's
    gradient, each recomputed here from its definition; the call changes no state."""
    model, rule, x, y = _calibrated(1, traffic_rule, predictor_warmup_steps=2,
                                    predictor_batch=8, traffic_sign=sign)
    with torch.no_grad():  # a predictor that is neither exact nor zero
        for i, p in enumerate(rule.apical.P):
            p.copy_(0.5 * rule.apical.gains[i] * rule.apical.coefficients[i])
            rule.apical.b[i].fill_(0.01 * (i + 1))
    model.train()
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    P_before = [p.clone() for p in rule.apical.P]
    final = rule.final_metrics(x, y)
    assert all(torch.equal(b, dict(model.named_buffers())[n]) for n, b in buffers.items())
    assert all(torch.equal(a, b) for a, b in zip(P_before, rule.apical.P))

    hs, true = _true_gradients(model, x, y)
    kp_teaching = _kp_instruction(model, x, y)
    ss_r = ss_t = 0.0
    names = model.population_names
    for i, h in enumerate(hs):
        traffic = rule.apical.gains[i] * rule.apical.coefficients[i] * h
        ss_r += float((traffic - (rule.apical.P[i] * h + rule.apical.b[i])).square().sum())
        ss_t += float(traffic.square().sum())
        instr = kp_teaching[i]
        want = {"instruction": instr,
                **_mixed(instr, traffic, rule.apical.P[i] * h + rule.apical.b[i], sign)}
        want["used"] = want["instruction" if traffic_rule == "none" else traffic_rule]
        for s, signal in want.items():
            got = final["signal_alignment"][s][names[i]]
            assert abs(got - _cos_examples(signal, true[i])) < 1e-9, (s, i)
    assert abs(final["predictor_residual_ratio"] - (ss_r / ss_t) ** 0.5) < 1e-12
    assert final["gains"] == rule.apical.gains and final["silent_populations"] == sum(
        int(h.abs().max() == 0) for h in hs)
    for s, per in final["signal_alignment"].items():
        values = [v for k, v in per.items() if k != "mean" and v == v]
        assert abs(per["mean"] - sum(values) / len(values)) < 1e-12, s
    assert final["warmup"]["first_ratio"] > final["warmup"]["last_ratio"] >= 0


@pytest.mark.parametrize("sign", SIGNS)
def test_epoch_apical_rms_is_each_signals_rms_over_the_epochs_steps(sign):
    """The logged RMS of used, instruction, raw, innovation and traffic per population,
    recomputed from the step's instruction (record=True) and the rule's tensors."""
    model, rule, x, y = _calibrated(1, "innovation", predictor_warmup_steps=1,
                                    predictor_batch=8, traffic_sign=sign)
    with torch.no_grad():
        for i, b in enumerate(rule.apical.b):
            b.fill_(0.02 * (i + 1))  # an imperfect predictor: innovation != instruction
    rule.epoch_metrics()  # start a fresh epoch
    ss = {s: {} for s in ("used", "instruction", "raw", "innovation", "traffic")}
    numel = {}
    halves = [(x[:12], y[:12]), (x[12:], y[12:])]
    for step, (xb, yb) in enumerate(halves):
        model.zero_grad(set_to_none=True)
        P = [p.clone() for p in rule.apical.P]
        b = [q.clone() for q in rule.apical.b]
        out = rule.compute_gradients(xb, yb, step, record=True)
        for i, instr in enumerate(out.teaching):
            h = rule.last_h[i]
            traffic = rule.apical.gains[i] * rule.apical.coefficients[i] * h
            mixed = _mixed(instr, traffic, P[i] * h + b[i], sign)
            raw, innov = mixed["raw"], mixed["innovation"]
            for s, v in (("used", innov), ("instruction", instr), ("raw", raw),
                         ("innovation", innov), ("traffic", traffic)):
                ss[s][i] = ss[s].get(i, 0.0) + float(v.square().sum())
            numel[i] = numel.get(i, 0) + h.numel()
    apical = rule.epoch_metrics()["apical"]
    names = model.population_names
    for s in ss:
        per = apical[f"rms_{s}"]
        for i, name in enumerate(names):
            want = (ss[s][i] / numel[i]) ** 0.5
            assert abs(per[name] - want) <= 1e-9 * want, (s, name)
        assert abs(per["mean"] - sum(per[n] for n in names) / len(names)) < 1e-12
    # The sums restart: an epoch with no logged step has no RMS.
    empty = rule.epoch_metrics()["apical"]["rms_used"]
    assert all(v != v for v in empty.values())


def test_residual_ratio_is_defined_by_traffic_and_nan_without_it():
    model, rule, x, y = _calibrated(1, "innovation")
    rule.compute_gradients(x, y, None)
    hs = {i: h * 1e-3 for i, h in rule.last_h.items()}  # traffic well below 1
    with torch.no_grad():
        for i, b in enumerate(rule.apical.b):
            b.fill_(1e-5 * (i + 1))
    ap = rule.apical
    ss_r = sum(float((ap.gains[i] * ap.coefficients[i] * h - (ap.P[i] * h + ap.b[i]))
                     .square().sum()) for i, h in hs.items())
    ss_t = sum(float((rule.apical.gains[i] * rule.apical.coefficients[i] * h).square().sum())
               for i, h in hs.items())
    assert ss_t < 1
    assert abs(rule.apical.residual_ratio(hs) - (ss_r / ss_t) ** 0.5) < 1e-12 * (ss_r / ss_t) ** 0.5
    silent = {i: torch.zeros_like(h) for i, h in hs.items()}
    assert ap.residual_ratio(silent) != ap.residual_ratio(silent)  # NaN: no traffic


def test_zero_traffic_ratio_records_zero_gains_and_an_undefined_residual():
    """traffic_ratio 0 (the natural control): every gain is 0, so the residual ratio is
    0/0, NaN, in a network with no silent population; this is the record the MT-1
    analysis accepts as complete (analysis.mt1.check_mt1_complete)."""
    model, rule, x, y = _calibrated(1, "innovation", traffic_ratio=0.0)
    final = rule.final_metrics(x, y)
    assert final["gains"] == [0.0] * len(model.population_names)
    assert final["silent_populations"] == 0
    assert final["predictor_residual_ratio"] != final["predictor_residual_ratio"]
    assert all(v == v for v in final["signal_alignment"]["used"].values())


def test_state_round_trip_copies_every_rule_tensor():
    model, rule, x, y = _calibrated(2, "innovation", predictor_warmup_steps=2,
                                    predictor_batch=8)
    fresh_model, fresh = _setup("kp_traffic", {"traffic_rule": "innovation"}, dims=2)
    assert all(p is None for p in fresh.state_dict()["P"])  # nothing seen yet: no shapes
    state = rule.state_dict()
    fresh.load_state_dict(state)
    for name in ("P", "b", "coefficients"):
        for a, b in zip(getattr(rule.apical, name), getattr(fresh.apical, name)):
            assert torch.equal(a, b) and a.data_ptr() != b.data_ptr(), name
    assert fresh.apical.gains == rule.apical.gains and fresh.warmup == rule.warmup
    with torch.no_grad():
        rule.apical.P[0].add_(1.0)  # the saved state is a copy, not a view of the live tensors
    assert not torch.equal(state["P"][0], rule.apical.P[0])


def test_a_step_frees_its_record_when_it_ends():
    """Nothing keeps a finished step's record (and so every tensor it holds) alive: a
    cycle through the autograd graph (record -> output -> node -> record) passes through
    C++ objects the garbage collector cannot see, so it would never be freed."""
    import gc

    from lab.rules.traffic import _Step

    model, rule, x, y = _calibrated(2, "innovation")
    for _ in range(3):
        rule.compute_gradients(x, y, 0)
    gc.collect()
    assert sum(type(o) is _Step for o in gc.get_objects()) == 0


def test_bench_traffic_quick_smoke():
    """The speed benchmark runs end to end (ResNet-8, batch 32) and prints its ratios;
    a subprocess, since it wraps numba_kernels.mixed_local for its breakdown."""
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_traffic.py"
    out = subprocess.run([sys.executable, str(bench), "--quick", "--repeats", "2", "--runs", "2"],
                         capture_output=True, text=True, check=True).stdout
    for line in ("kp_traffic / kp: ", "replayed / kp: ", "fused mixed_local kernel ", "run 2:",
                 "median of 2 runs"):
        assert line in out, out


def test_a_norm_without_affine_parameters_trains_like_kp():
    """BatchNorm(affine=False): no gamma or beta to credit; the step is still clean KP's."""
    x, y = _batch(2)
    grads = []
    for rule_name, params in (("kp", {}), ("kp_traffic", {"traffic_rule": "none"})):
        model, rule = _setup(rule_name, params, dims=2)
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.affine, module.weight, module.bias = False, None, None
        rule.detach()  # (one rule on a model at a time)
        rule = make_rule(rule_name, model, params, seed=3)
        grads.append(_grads(model, rule, x, y)[0])
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        _same(grads[1][name], grads[0][name], name)


def test_calibrated_gains_hold_the_ratio_and_refuse_leaving_the_dtype():
    from lab.config import ConfigError
    from lab.rules.apical import calibrated_gains

    # RMS(I) / RMS(C h) = sqrt(ss_i / ss_ch): 2 and 1/3; a population with C h == 0 gets 0.
    assert calibrated_gains("kp_traffic", 4.0, [16.0, 1.0, 5.0], [4.0, 9.0, 0.0],
                            torch.float64) == [8.0, 4.0 / 3.0, 0.0]
    with pytest.raises(ConfigError, match=r"^kp_traffic: rule_params.traffic_ratio=10000.0 "
                                          r"calibrates population 1's gain to 1e\+64 \(RMS\(I\) / "
                                          r"RMS\(C h\) = 1e\+60\), beyond torch.float32's range; "
                                          r"use a smaller traffic_ratio$"):
        calibrated_gains("kp_traffic", 1e4, [1.0, 1e80], [1.0, 1e-40], torch.float32)
    assert calibrated_gains("kp_traffic", 1e4, [1.0, 1e80], [1.0, 1e-40],
                            torch.float64)[1] == pytest.approx(1e64, rel=1e-12)


@pytest.mark.parametrize("name", ["kp_traffic", "sdil"])
def test_a_training_step_before_the_gains_are_calibrated_is_refused(name):
    """Uncalibrated, every gain is 0: no traffic, a silent clean-KP run. A training step
    (step given) is refused until ``prepare``; a diagnostic call (step None), a ratio of 0
    and gains set by hand are not."""
    x, y = _batch(1)
    calibration = {"traffic_calibration_examples": len(y), "predictor_warmup_steps": 0}
    if name == "sdil":
        calibration.update(a_warmup_steps=0, pert_directions=2)
    model, rule = _setup(name, calibration)
    rule.compute_gradients(x, y, None)  # a diagnostic call: allowed
    with pytest.raises(RuntimeError, match=rf"{name}: the traffic gains are not calibrated "
                       r"\(all 0, so no traffic would mix in although "
                       r"rule_params.traffic_ratio=4.0\): call rule.prepare\(x, y\)"):
        rule.compute_gradients(x, y, 0)
    rule.prepare(x, y)
    assert min(rule.apical.gains) > 0
    rule.compute_gradients(x, y, 0)
    # no traffic asked for: nothing to calibrate
    model, rule = _setup(name, {**calibration, "traffic_ratio": 0.0})
    rule.compute_gradients(x, y, 0)
    # gains set by hand are taken as they are
    model, rule = _setup(name, calibration)
    rule.apical.gains = [0.5] * len(rule.apical.gains)
    rule.compute_gradients(x, y, 0)


@pytest.mark.parametrize("normalization", ["batchnorm", "none"])
def test_kp_traffic_in_eval_mode_is_refused_where_its_step_needs_batch_statistics(
        normalization):
    x, y = _batch(1)
    model, rule = _setup("kp_traffic", {"traffic_calibration_examples": len(y),
                                        "predictor_warmup_steps": 0},
                         normalization=normalization)
    rule.prepare(x, y)
    model.eval()
    if normalization == "none":  # no batch statistics: eval mode changes nothing
        rule.compute_gradients(x, y, 0)
        return
    with pytest.raises(RuntimeError, match=r"kp_traffic: the model is in eval mode; its fused "
                       r"local step is the backward of batch normalisation with the batch's "
                       r"own statistics.*call model.train\(\) before compute_gradients"):
        rule.compute_gradients(x, y, 0)
    model.train()
    rule.compute_gradients(x, y, 0)


@pytest.mark.parametrize("sign", SIGNS)
def test_with_no_instruction_a_raw_step_moves_active_drive_the_signs_way(sign):
    """The seed's sign: with the instruction zero everywhere (every feedback tensor 0), raw's
    used gradient is -s g C h / B (s = +1 hebbian). Checked by hand at the stem: the BN
    shift's and scale's gradients, the conv weight's through BN's backward; the BN shift
    alone then raises (hebbian) or lowers (anti_hebbian) every active unit's pre-activation
    by exactly lr |dbeta|; the whole step moves the traffic-weighted drive sum(C h z) by its
    first-order value lr s g / B ||d sum(C h z) / d theta||^2."""
    model, rule, x, y = _calibrated(2, "raw", traffic_sign=sign)
    with torch.no_grad():
        for b in rule.feedback:
            b.zero_()
    s = {"hebbian": 1.0, "anti_hebbian": -1.0}[sign]
    conv, norm = model.stem, model.stem_norm
    eps, B = norm.eps, len(y)

    def stem(weight=None, gamma=None, beta=None):
        """(o, z, h) at the stem: conv output, pre-activation, activity (batch statistics)."""
        o = torch.nn.functional.conv2d(x, conv.weight if weight is None else weight, conv.bias,
                                       conv.stride, conv.padding)
        var, mean = torch.var_mean(o, dim=(0, 2, 3), keepdim=True, correction=0)
        xhat = (o - mean) / (var + eps).sqrt()
        z = ((norm.weight if gamma is None else gamma).view(1, -1, 1, 1) * xhat
             + (norm.bias if beta is None else beta).view(1, -1, 1, 1))
        return o, xhat, z, z.relu()

    with torch.no_grad():
        o, xhat, z, h = stem()
    _, _, out = _grads(model, rule, x, y, record=True)
    assert all(float(t.abs().max()) == 0 for t in out.teaching)  # no instruction anywhere
    torch.testing.assert_close(rule.last_h[0], h, rtol=1e-12, atol=1e-12)

    C, g = rule.apical.coefficients[0], rule.apical.gains[0]
    m = (-s * g * C * h / B) * (h > 0)  # the used gradient through the ReLU
    dbeta = m.sum((0, 2, 3))
    dgamma = (m * xhat).sum((0, 2, 3))
    invstd = 1 / (o.var(dim=(0, 2, 3), correction=0) + eps).sqrt()

    def per_channel(t):
        return t.mean((0, 2, 3), keepdim=True)

    v = (norm.weight * invstd).view(1, -1, 1, 1) * (m - per_channel(m)
                                                     - xhat * per_channel(m * xhat))
    weight = conv.weight.detach().clone().requires_grad_(True)
    out_o = torch.nn.functional.conv2d(x, weight, None, conv.stride, conv.padding)
    dweight, = torch.autograd.grad((v * out_o).sum(), weight)
    torch.testing.assert_close(norm.bias.grad, dbeta, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(norm.weight.grad, dgamma, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(conv.weight.grad, dweight, rtol=1e-10, atol=1e-14)

    lr = 1e-3
    active = h > 0
    shift = -lr * dbeta  # the BN shift of one SGD step
    channels = active.any(dim=(0, 2, 3))
    assert channels.any()
    assert bool((s * shift[channels] > 0).all())  # up under hebbian, down under anti
    with torch.no_grad():
        _, _, z_shift, _ = stem(beta=norm.bias - lr * norm.bias.grad)
    moved = (z_shift - z)[active]
    assert bool((s * moved > 0).all())
    want = shift.view(1, -1, 1, 1).expand_as(z)[active]
    torch.testing.assert_close(moved, want, rtol=1e-9, atol=1e-16)

    # The whole step (conv weight, gamma, beta): sum(C h z) moves by its first-order value.
    params = [p.detach().clone().requires_grad_(True) for p in (conv.weight, norm.weight,
                                                                norm.bias)]
    _, _, z_p, _ = stem(*params)
    drive = (C * h * z_p).sum()
    grads = torch.autograd.grad(drive, params)
    predicted = lr * s * g / B * sum(float(q.square().sum()) for q in grads)
    with torch.no_grad():
        _, _, z_new, _ = stem(conv.weight - lr * conv.weight.grad, norm.weight
                              - lr * norm.weight.grad, norm.bias - lr * norm.bias.grad)
    measured = float((C * h * (z_new - z)).sum())
    assert s * measured > 0
    assert abs(measured - predicted) < 0.02 * abs(predicted), (measured, predicted)


def test_a_run_stored_before_traffic_sign_reads_as_anti_hebbian():
    """Runs made before ``traffic_sign`` existed added the traffic to the gradient: a stored
    config without the key (the committed MT-1 fixture's) reads, through
    ``with_legacy_params``, as ``anti_hebbian``, which matches a config asking for that and
    not the new default; the rules' checkpoint state keeps its keys (old checkpoints load)."""
    import json
    from pathlib import Path

    from lab.config import with_legacy_params
    from lab.rules import resolve_params

    runs = Path(__file__).parent / "fixtures" / "mt1" / "runs"
    record = json.loads((runs / "rule_params.traffic_rule-raw_seed-0" / "record.json")
                        .read_text())
    old = record["config"]
    assert old["rule"] == "kp_traffic" and "traffic_sign" not in old["rule_params"]
    read = with_legacy_params(old)
    assert read["rule_params"] == resolve_params(
        "kp_traffic", {**old["rule_params"], "traffic_sign": "anti_hebbian"})
    assert read["rule_params"] != resolve_params("kp_traffic", old["rule_params"])
    assert resolve_params("kp_traffic", {})["traffic_sign"] == "hebbian"
    assert with_legacy_params(read) == read  # a stored key is kept
    hebbian = {**old, "rule_params": {**old["rule_params"], "traffic_sign": "hebbian"}}
    # its sign is kept (keys it lacks that came later, MT-2's, are filled in)
    assert with_legacy_params(hebbian)["rule_params"] == {**with_legacy_params(old)[
        "rule_params"], "traffic_sign": "hebbian"}
    kp = {"rule": "kp", "rule_params": {"feedback_scale": 1.0}}
    assert with_legacy_params(kp) == kp  # a rule without legacy parameters: unchanged
    sdil = with_legacy_params({"rule": "sdil", "rule_params": {"traffic_rule": "raw"}})
    assert sdil["rule_params"]["traffic_sign"] == "anti_hebbian"
    # The state a checkpoint holds: the same keys as before the apical module existed.
    _, rule, _, _ = _calibrated(1, "raw")
    assert set(rule.state_dict()) >= {
        "gains", "coefficients", "P", "b", "predictor_generator", "warmup",
        "calibration_examples", "predictor_updates", "predictor_examples", "sums", "numels",
        "summed_steps"}


@pytest.mark.parametrize("momentum", [0.1, None])
def test_a_step_updates_the_norms_running_statistics_as_batch_norm_does(momentum):
    """kp_traffic runs the norms' forward itself for a step (to keep the batch statistics
    its fused backward needs): running mean, variance and batch count end bit for bit as
    nn.BatchNorm leaves them in kp's step (a cumulative average when momentum is None)."""
    x, y = _batch(2)
    buffers = []
    for name in ("kp", "kp_traffic"):
        model, rule = _setup(name, {"traffic_rule": "raw"} if name == "kp_traffic" else {},
                             dims=2)
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.momentum = momentum
        for _ in range(2):
            _grads(model, rule, x, y)
        buffers.append(dict(model.named_buffers()))
    assert buffers[0].keys() == buffers[1].keys() and buffers[0]
    for n in buffers[0]:
        assert torch.equal(buffers[0][n], buffers[1][n]), n
    assert int(buffers[1]["stem_norm.num_batches_tracked"]) == 2


def test_a_run_stored_before_traffic_sign_reads_as_anti_hebbian_on_resume(tmp_path, tiny):
    """A finished kp_traffic run whose record and checkpoint lack traffic_sign (made before
    the parameter existed) is the same run as one asking anti_hebbian, and another run than
    one asking the new default."""
    import json

    import torch

    from lab.lifecycle import CheckpointError
    from lab.records import RECORD_FILE
    from lab.train import ConvConfig, train_conv

    SMALL = {"traffic_calibration_examples": 64, "predictor_warmup_steps": 2}

    def old(config):
        return ConvConfig(**{**tiny, "epochs": 1, "rule": "kp_traffic", "rule_params": {
            "traffic_sign": "anti_hebbian", **SMALL, **config}})

    out = tmp_path / "r"
    done = train_conv(old({}), out)
    for path in (out / RECORD_FILE,):
        record = json.loads(path.read_text())
        del record["config"]["rule_params"]["traffic_sign"]
        path.write_text(json.dumps(record))
    state = torch.load(out / "checkpoint.pt", weights_only=False)
    for holder in (state["identity"], state["record"]["config"]):
        del holder["rule_params"]["traffic_sign"]
    torch.save(state, out / "checkpoint.pt")
    before = (out / RECORD_FILE).read_bytes()
    again = train_conv(old({}), out)  # nothing to do: the same run
    assert again["final"] == done["final"] and (out / RECORD_FILE).read_bytes() == before
    with pytest.raises(CheckpointError, match=r"traffic_sign: 'anti_hebbian' there vs "
                                              r"'hebbian' now"):
        train_conv(ConvConfig(**{**tiny, "epochs": 1, "rule": "kp_traffic",
                                 "rule_params": SMALL}), out)
    assert (out / RECORD_FILE).read_bytes() == before
