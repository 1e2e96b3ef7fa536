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


def _bill(name, events=1, **params):
    model = ResNet(8, 4, dims=1, in_channels=1)
    calibrated = name in ("kp_traffic", "sdil")  # a training step needs the traffic gains
    if calibrated:
        params = {"traffic_calibration_examples": 4, "predictor_warmup_steps": 0,
                  **({"a_warmup_steps": 0} if name == "sdil" else {}), **params}
    rule = make_rule(name, model, params, seed=0)
    x, y = torch.randn(4, 1, 16), torch.tensor([0, 1, 2, 3])
    if calibrated:
        rule.prepare(x, y)
    for step in range(events):
        rule.compute_gradients(x, y, step * getattr(rule.params, "mirror_every", 1))
    return bill(rule, model, (1, 16), examples=100), forward_macs(model, (1, 16))


def _hooked(shape=(1, 16)):
    """Per-layer MACs of the same model counted by forward hooks (independent of layer_macs)."""
    model = ResNet(8, 4, dims=1, in_channels=1)
    return hook_macs(model, torch.randn(2, *shape))


def test_bp_reverse_skips_the_first_layers_input_gradient():
    """Weight gradients of every layer, input gradients of every layer but the stem."""
    work, f = _bill("bp")
    hooked = _hooked()
    assert f == sum(hooked.values())
    reverse = sum(hooked.values()) + sum(v for k, v in hooked.items() if k != "stem")
    assert work["macs"] == {"forward": 100 * f, "bp_reverse": 100 * reverse}
    assert work["total_macs"] == 100 * (f + reverse)


@pytest.mark.parametrize("name", ["fa", "kp", "usf", "brsf", "frsf", "wm", "rrm"])
def test_feedback_bill_leaves_out_the_stem(name):
    work, f = _bill(name)
    hooked = _hooked()
    without_stem = sum(v for k, v in hooked.items() if k != "stem")
    assert work["macs"]["feedback_propagation"] == 100 * without_stem
    assert work["macs"]["local_correlation"] == 100 * f


def test_kp_extra_over_fa_is_only_the_feedback_update():
    kp, f = _bill("kp")
    fa, _ = _bill("fa")
    extra = {k: v - fa["macs"].get(k, 0) for k, v in kp["macs"].items()}
    without_stem = sum(v for k, v in _hooked().items() if k != "stem")
    assert {k: v for k, v in extra.items() if v} == {"feedback_update": 100 * without_stem}


def test_mirror_bill_counts_probe_passes_per_event():
    hooked = _hooked()
    without_stem = sum(v for k, v in hooked.items() if k != "stem")
    for events in (1, 3):
        wm, _ = _bill("wm", events=events, mirror_batch_size=8)
        rrm, _ = _bill("rrm", events=events, mirror_batch_size=8)
        # Per probe, response + correlation (+ the prediction B x for rrm), on layers with a B.
        assert wm["macs"]["mirror"] == events * 2 * 8 * without_stem
        assert rrm["macs"]["mirror"] == events * 3 * 8 * without_stem


def test_nodepert_bill_counts_perturbed_passes_and_elementwise_apart():
    """One step's perturbation MACs equal what forward hooks see run beyond the clean pass."""
    import math

    from lab.models.layers import Conv, local_layers

    model = ResNet(8, 4, dims=1, in_channels=1)
    rule = make_rule("nodepert", model, {"pert_directions": 3}, seed=0)
    x, y = torch.randn(4, 1, 16), torch.tensor([0, 1, 2, 3])
    counted = {"macs": 0}

    def hook(module, inputs, output):
        per_output = (module.in_channels * math.prod(module.kernel_size)
                      if isinstance(module, Conv) else module.in_features)
        counted["macs"] += output.numel() * per_output

    sizes = []
    model(torch.randn(1, 1, 16), tap=lambda i, h: sizes.append(h[0].numel()) or h)
    handles = [m.register_forward_hook(hook) for _, m in local_layers(model)]
    try:
        rule.compute_gradients(x, y, 0)
    finally:
        for handle in handles:
            handle.remove()
    f = forward_macs(model, (1, 16))
    work = bill(rule, model, (1, 16), examples=4)
    assert work["macs"] == {"forward": 4 * f, "local_correlation": 4 * f,
                            "perturbation": counted["macs"] - 4 * f}
    # Every population re-runs the layers above it, once per direction: more than the
    # read-out alone, less than a full forward per population.
    assert 3 * 4 * len(sizes) * model.fc.in_features < work["macs"]["perturbation"]
    assert work["macs"]["perturbation"] < 3 * 4 * len(sizes) * f
    # draw, scale-and-add, dot per direction and unit; never folded into the MACs.
    assert work["elementwise"] == {"perturbation": 4 * 3 * sum(sizes) * 4}
    assert work["total_macs"] == 2 * 4 * f + work["macs"]["perturbation"]


def test_dfa_bill_counts_the_projection_of_every_population():
    work, f = _bill("dfa")
    model = ResNet(8, 4, dims=1, in_channels=1)
    sizes = []
    model(torch.randn(1, 1, 16), tap=lambda i, h: sizes.append(h[0].numel()) or h)
    assert work["macs"] == {"forward": 100 * f, "local_correlation": 100 * f,
                            "feedback_propagation": 10 * sum(sizes) * 100}


def test_dfa_gradient_matching_bills_its_one_backprop_pass():
    # projection_norm "gradient" runs one forward and backprop's input gradients (every
    # layer but the stem) on the first batch (4 examples here), before training.
    work, f = _bill("dfa", projection_norm="gradient")
    hooked = _hooked()
    reverse_inputs = sum(v for k, v in hooked.items() if k != "stem")
    assert work["macs"]["gradient_matching"] == 4 * (f + reverse_inputs)
    assert work["total_macs"] == sum(work["macs"].values())
    assert "gradient_matching" not in _bill("dfa", projection_norm="fixed")[0]["macs"]


@pytest.mark.parametrize("name", ["usf", "frsf", "brsf"])
def test_sign_symmetry_refresh_is_elementwise_per_step(name):
    work, _ = _bill(name, events=3)
    model = ResNet(8, 4, dims=1, in_channels=1)
    weights = sum(m.weight.numel() for n, m in model.layers if n != "stem")
    want = {"feedback_refresh": 2 * 3 * weights}
    if name == "brsf":  # a fresh draw, its scale and |.| per weight and step
        want["feedback_draw"] = 3 * 3 * weights
    assert work["elementwise"] == want


@pytest.mark.parametrize("name", sorted(RULES))
def test_every_rule_bills_the_forward_pass(name):
    work, f = _bill(name)
    assert work["macs"]["forward"] == 100 * f
    assert work["examples"] == 100 and work["forward_macs_per_example"] == f
    assert work["total_macs"] == sum(work["macs"].values())


def _counted_macs(fn) -> int:
    """Multiply-accumulates of every matmul and convolution ``fn`` runs, as torch's own
    FLOP formulas count them at dispatch (2 FLOPs per MAC), independent of the bill's.
    (A bare dispatch mode: FlopCounterMode's module tracker refuses autograd.grad on a
    leaf population, which lhfa's calibration differentiates.)"""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import flop_registry

    class Counter(TorchDispatchMode):
        flops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            formula = flop_registry.get(func._overloadpacket)
            if formula is not None:
                Counter.flops += formula(*args, **kwargs, out_val=out)
            return out

    with Counter():
        fn()
    return Counter.flops // 2


@pytest.mark.parametrize("name", ["bp", "fa", "dfa", "nodepert", "wm", "rrm", "kp_traffic",
                                  "sdil", "lhfa"])
@pytest.mark.parametrize("dims", [1, 2])
def test_what_a_run_bills_is_what_torch_counts(name, dims):
    # Calibration passes (lhfa's events, kp_traffic's gains) formed every layer's
    # weight-gradient product, then threw it away: about a fifth (lhfa) and a third
    # (kp_traffic) of their work went unbilled; the mirrors' shape probe and padding
    # counts were billed nowhere. (kp bills B's update, which it copies from
    # W's, as documented: not counted here.)
    torch.manual_seed(0)
    shape = (1, 40) if dims == 1 else (3, 8, 8)
    model = ResNet(8, 4, dims=dims, in_channels=shape[0])
    params = {"traffic_calibration_examples": 8, "predictor_warmup_steps": 1,
              "predictor_batch": 8} if name in ("kp_traffic", "sdil") else {}
    if name in ("lhfa", "sdil"):  # a calibration event in prepare and one at step 1
        params.update(calibration_batch=8, pert_directions=2, pert_every=1,
                      **({"warmup_steps": 1} if name == "lhfa" else {"a_warmup_steps": 1}))
    rule = make_rule(name, model, params, seed=0)
    x, y = torch.randn(8, *shape), torch.randint(0, 10, (8,))
    layer_macs = model.layer_macs(shape)

    def billed(examples):  # kp_traffic's B update is KP's, copied from W's (documented)
        return sum(v for k, v in rule.work(layer_macs, examples).items()
                   if k != "feedback_update")

    # From a fresh rule (nothing run, nothing billed: kp_traffic billed its predictor's
    # warm-up from its parameters before it ran): preparation and the first step, then
    # one more step on its own.
    assert billed(0) == 0
    counted = _counted_macs(lambda: (rule.prepare(x, y), rule.compute_gradients(x, y, 0)))
    assert counted == billed(len(y))
    first = billed(len(y))
    assert _counted_macs(lambda: rule.compute_gradients(x, y, 1)) == billed(2 * len(y)) - first
