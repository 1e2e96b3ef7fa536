"""The CfC cell and sequence (lab.models.cfc) against the closed-form equations, a step loop,
autograd (gradcheck) and, when installed, ncps."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lab.models import cfc
from lab.models.cfc import ACTIVATIONS, MODES, CfC, CfCCell, bucket_rates, load_ncps

FAST = ("function", "numba")


def _direct(cell: CfCCell, x, h, dt):
    """Hasani et al. 2022, written out from the equations with separate head matrices."""
    first = cell.backbone[0]
    a = torch.cat([x, h], dim=1) @ first.weight.t() + first.bias
    a = cfc.activate(a, cell.activation)
    for layer in cell.backbone[1:]:
        a = cfc.activate(a @ layer.weight.t() + layer.bias, cell.activation)
    H = cell.hidden_size
    w, b = cell.heads.weight, cell.heads.bias
    t = dt * cell.rate  # each unit sees dt / tau
    ff1 = a @ w[:H].t() + b[:H]
    if cell.mode == "pure":
        return -cell.A * torch.exp(-t * (torch.abs(cell.w_tau) + torch.abs(ff1))) * ff1 + cell.A
    ff2 = a @ w[H:2 * H].t() + b[H:2 * H]
    t_a = a @ w[2 * H:3 * H].t() + b[2 * H:3 * H]
    t_b = a @ w[3 * H:].t() + b[3 * H:]
    f1, f2 = torch.tanh(ff1), torch.tanh(ff2)
    gate = 1 / (1 + torch.exp(-(t_a * t + t_b)))
    if cell.mode == "no_gate":
        return f1 + gate * f2
    return f1 * (1 - gate) + gate * f2


def _perturb_pure(cell):
    # w_tau starts at 0, where |w_tau| has no derivative; move it away for gradient checks.
    if cell.mode == "pure":
        with torch.no_grad():
            cell.w_tau.uniform_(-1, 1)
            cell.A.uniform_(0.5, 1.5)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layers", [1, 2])
def test_cell_equals_closed_form(mode, layers):
    torch.manual_seed(0)
    cell = CfCCell(5, 6, mode=mode, backbone_units=7, backbone_layers=layers,
                   buckets=((2, 1.0, 1.0), (4, 2.0, 50.0))).double()
    _perturb_pure(cell)
    x, h = torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    dt = torch.rand(4, dtype=torch.float64) * 3  # per-example spans
    expected = _direct(cell, x, h, dt[:, None])
    torch.testing.assert_close(cell(x, h, dt), expected, rtol=0, atol=1e-12)
    # A different span changes the state (the spans are not ignored).
    assert (cell(x, h, dt + 1) - expected).abs().max() > 1e-3


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_backbone_activations(activation):
    torch.manual_seed(1)
    cell = CfCCell(3, 4, backbone_units=5, activation=activation).double()
    x, h = torch.randn(2, 3, dtype=torch.float64), torch.randn(2, 4, dtype=torch.float64)
    torch.testing.assert_close(cell(x, h, 0.5), _direct(cell, x, h, 0.5), rtol=0, atol=1e-12)


def _loop(model: CfC, x_bf, h0, spans_bf):
    """Step-by-step over a batch-first input with per-example spans (B, T)."""
    h, outs = h0, []
    for t in range(x_bf.shape[1]):
        h = model.cell(x_bf[:, t], h, spans_bf[:, t])
        outs.append(h)
    return torch.stack(outs, 1), h


@pytest.mark.parametrize("impl", ["loop", *FAST])
@pytest.mark.parametrize("mode", MODES)
def test_time_spans_with_batch_first_equal_a_step_loop(impl, mode):
    # B == H: ncps's squeeze makes (B,) spans broadcast along the units there, silently.
    torch.manual_seed(2)
    B, T, C, H = 6, 7, 3, 6
    model = CfC(C, H, mode=mode, backbone_units=8, impl=impl,
                buckets=((3, 1.0, 1.0), (3, 4.0, 16.0))).double()
    _perturb_pure(model.cell)
    x = torch.randn(B, T, C, dtype=torch.float64)
    h0 = torch.randn(B, H, dtype=torch.float64)
    spans = torch.rand(B, T, dtype=torch.float64) * 2 + 0.1
    out, h_n = model(x, h0, spans)
    ref_out, ref_h = _loop(model, x, h0, spans)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(h_n, ref_h, rtol=0, atol=1e-12)
    # A trailing 1 and time-major input give the same states.
    torch.testing.assert_close(model(x, h0, spans[..., None])[0], ref_out, rtol=0, atol=1e-12)
    model.batch_first = False
    out_tm, _ = model(x.transpose(0, 1), h0, spans.t())
    torch.testing.assert_close(out_tm.transpose(0, 1), ref_out, rtol=0, atol=1e-12)


def test_unbatched_input_and_default_spans():
    torch.manual_seed(3)
    model = CfC(3, 4, backbone_units=5).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    out, h_n = model(x)
    ref, ref_h = _loop(model, x[None], torch.zeros(1, 4, dtype=torch.float64),
                       torch.ones(1, 5, dtype=torch.float64))
    assert out.shape == (5, 4) and h_n.shape == (4,)
    torch.testing.assert_close(out, ref[0], rtol=0, atol=1e-12)


@pytest.mark.parametrize("impl", FAST)
@pytest.mark.parametrize("mode", MODES)
def test_handwritten_backward_matches_autograd(impl, mode):
    """gradcheck (float64, finite differences) of the sequence Function in every input."""
    torch.manual_seed(4)
    T, B, U, H = 4, 3, 5, 4
    cell = CfCCell(2, H, mode=mode, backbone_units=U, buckets=((2, 1.0, 1.0), (2, 3.0, 9.0)))
    cell = cell.double()
    _perturb_pure(cell)
    xin = torch.randn(T, B, U, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(B, H, dtype=torch.float64, requires_grad=True)
    dt = (torch.rand(T, B, 1, dtype=torch.float64) + 0.5)
    rate_dt = dt * cell.rate
    params = [p.detach().clone().requires_grad_() for p in cfc._params(cell)]

    def run(xin, h0, *params):
        return cfc._CfCSequence.apply(xin, h0, rate_dt, mode, cell.activation, impl, *params)

    assert torch.autograd.gradcheck(run, (xin, h0, *params), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("spans", ["per-example", 0.7, None])  # the last two: folded gate
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_fast_paths_equal_the_loop_in_value_and_gradient(activation, mode, spans):
    torch.manual_seed(5)
    buckets = ((2, 1.0, 1.0), (3, 2.0, 9.0))
    models = {impl: CfC(3, 5, backbone_units=6, activation=activation, mode=mode, impl=impl,
                        buckets=buckets).double()
              for impl in ("loop", *FAST)}
    _perturb_pure(models["loop"].cell)
    for model in models.values():
        model.load_state_dict(models["loop"].state_dict())
    x = torch.randn(4, 6, 3, dtype=torch.float64)
    if spans == "per-example":
        spans = torch.rand(4, 6, dtype=torch.float64) + 0.5
    target = torch.randn(4, 6, 5, dtype=torch.float64)
    results = {}
    for impl, model in models.items():
        xi = x.clone().requires_grad_()
        out, _ = model(xi, None, spans)
        ((out - target) ** 2).sum().backward()
        results[impl] = (out, xi.grad, [p.grad for p in model.parameters()])
    out0, gx0, gp0 = results["loop"]
    assert gx0.abs().max() > 1e-3  # the check below compares real gradients
    for impl in FAST:
        out, gx, gp = results[impl]
        torch.testing.assert_close(out, out0, rtol=0, atol=1e-12)
        torch.testing.assert_close(gx, gx0, rtol=1e-9, atol=1e-12)
        for a, b in zip(gp, gp0):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("impl", FAST)
@pytest.mark.parametrize("mode", ["default", "no_gate"])
def test_folded_gate_backward_matches_autograd(impl, mode):
    """gradcheck of the sequence Function with the gate folded into one head (3H wide)."""
    torch.manual_seed(9)
    T, B, U, H = 4, 3, 5, 4
    cell = CfCCell(2, H, mode=mode, backbone_units=U, buckets=((2, 1.0, 1.0), (2, 3.0, 9.0)))
    cell = cell.double()
    xin = torch.randn(T, B, U, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(B, H, dtype=torch.float64, requires_grad=True)
    w_h, w_heads, b_heads = cfc._params(cell)
    w3, b3 = cfc.fold_gate(w_heads.detach(), b_heads.detach(), 0.8 * cell.rate)
    assert w3.shape == (3 * H, U)
    params = [p.detach().clone().requires_grad_() for p in (w_h, w3, b3)]
    unused = torch.ones(1, 1, 1, dtype=torch.float64)

    def run(xin, h0, *params):
        return cfc._CfCSequence.apply(xin, h0, unused, mode, cell.activation, impl, *params)

    assert torch.autograd.gradcheck(run, (xin, h0, *params), eps=1e-6, atol=1e-7)


def test_fold_gate_is_the_gate_of_the_unfolded_heads():
    torch.manual_seed(10)
    H, U = 3, 4
    w, b = torch.randn(4 * H, U, dtype=torch.float64), torch.randn(4 * H, dtype=torch.float64)
    r = torch.rand(H, dtype=torch.float64) + 0.1
    a = torch.randn(5, U, dtype=torch.float64)
    heads = a @ w.t() + b
    w3, b3 = cfc.fold_gate(w, b, r)
    folded = a @ w3.t() + b3
    assert torch.equal(w3[:2 * H], w[:2 * H]) and torch.equal(b3[:2 * H], b[:2 * H])
    torch.testing.assert_close(folded[:, :2 * H], heads[:, :2 * H], rtol=0, atol=1e-13)
    expected = heads[:, 2 * H:3 * H] * r + heads[:, 3 * H:]
    torch.testing.assert_close(folded[:, 2 * H:], expected, rtol=0, atol=1e-13)


@pytest.mark.parametrize("dtype,ulps", [(np.float64, 4), (np.float32, 1)])
def test_vectorised_exp_is_exp_to_a_few_ulp(dtype, ulps):
    x = np.concatenate([np.linspace(-80, 80, 8001), [0.0, 1e-30, -1e-30]]).astype(dtype)
    got = x.copy()
    cfc._exp_inplace(got, np.empty(len(x)), np.empty(len(x), np.int64))
    ref = np.exp(x.astype(np.float64))
    rel = np.abs(got - ref) / ref
    assert rel.max() <= ulps * np.finfo(dtype).eps
    assert got[8001] == 1.0


def test_vectorised_exp_saturates_beyond_its_range():
    x = np.array([-745.0, -2000.0, 710.0, 5000.0])
    got = x.copy()
    cfc._exp_inplace(got, np.empty(4), np.empty(4, np.int64))
    assert np.all(got[:2] < 1e-300) and np.all(got[:2] > 0)  # exp(-708): 0 to the equations
    assert np.all(np.isfinite(got[2:])) and np.all(got[2:] > 1e307)  # tanh, sigmoid saturate


def test_float32_numba_path_is_close_to_the_loop():
    torch.manual_seed(6)
    loop, fast = CfC(20, 64, impl="loop"), CfC(20, 64, impl="numba")
    fast.load_state_dict(loop.state_dict())
    x = torch.randn(8, 10, 20)
    torch.testing.assert_close(fast(x)[0], loop(x)[0], rtol=0, atol=2e-6)


def test_input_product_is_hoisted_out_of_the_time_loop(monkeypatch):
    model = CfC(3, 4, backbone_units=5, impl="loop")
    calls = []
    original = model.cell.input_product

    def counting(x):
        calls.append(tuple(x.shape))
        return original(x)

    monkeypatch.setattr(model.cell, "input_product", counting)
    model(torch.randn(2, 9, 3))
    assert calls == [(9, 2, 3)]  # once, over every step (time-major)


def test_bucket_rates_span_each_bucket():
    rates = bucket_rates(((2, 1.0, 1.0), (3, 1.0, 100.0)))
    torch.testing.assert_close(1 / rates, torch.tensor([1.0, 1.0, 1.0, 10.0, 100.0]))


def test_a_cast_model_forms_its_rates_in_its_own_dtype():
    # the rates were rounded to float32 before a .double(): 1/7 off by 4.5e-8 relative
    buckets = ((2, 1.0, 1.0), (2, 2.0, 7.0))
    cell = CfC(2, 4, buckets=buckets).double().cell
    assert cell.rate.dtype == torch.float64
    assert cell.rate[3].item() == 1 / 7 and cell.rate[2].item() == 0.5
    back = CfC(2, 4, buckets=buckets).double().float().cell.rate
    assert back.dtype == torch.float32 and back[3].item() == torch.tensor(1 / 7).float().item()


def test_bad_arguments_are_refused_with_their_values():
    with pytest.raises(ValueError, match=r"mode='fast' is not allowed"):
        CfCCell(2, 3, mode="fast")
    with pytest.raises(ValueError, match=r"activation='sigmoid' is not allowed"):
        CfCCell(2, 3, activation="sigmoid")
    with pytest.raises(ValueError, match=r"hold 5 units but hidden_size is 4"):
        CfCCell(2, 4, buckets=((2, 1.0, 1.0), (3, 1.0, 2.0)))
    with pytest.raises(ValueError, match=r"bucket \(2, 3.0, 1.0\) is not allowed"):
        CfCCell(2, 2, buckets=((2, 3.0, 1.0),))
    with pytest.raises(ValueError, match=r"impl='jit' is not allowed"):
        CfC(2, 3, impl="jit")
    with pytest.raises(ValueError, match=r"timespans of shape \(4, 2\) do not match"):
        CfC(2, 3)(torch.randn(2, 4, 2), None, torch.ones(4, 2))
    with pytest.raises(ValueError, match=r"supports backbone_layers=1 only"):
        CfC(2, 3, backbone_layers=2, impl="numba")(torch.randn(2, 4, 2))


@pytest.mark.parametrize("mode", MODES)
def test_same_weights_as_ncps_give_the_same_outputs(mode):
    ncps_torch = pytest.importorskip("ncps.torch")
    torch.manual_seed(7)
    theirs = ncps_torch.CfC(20, 64, mode=mode)
    ours = CfC(20, 64, mode=mode)
    load_ncps(ours, theirs)
    x = torch.randn(8, 12, 20)
    h0 = torch.randn(8, 64)
    ref_out, ref_h = theirs(x, h0)
    for impl in ("loop", *FAST):
        ours.impl = impl
        out, h_n = ours(x, h0)
        torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-5)
        torch.testing.assert_close(h_n, ref_h, rtol=0, atol=1e-5)
    assert ref_out.abs().max() > 0.1  # a real comparison, not of zeros


def test_per_example_spans_run_where_ncps_breaks():
    """ncps 1.0.1 squeezes (B, T) spans to (B,) per step, which broadcasts along the units:
    with B != H it raises; ours equals the step loop with per-example spans."""
    ncps_torch = pytest.importorskip("ncps.torch")
    torch.manual_seed(8)
    theirs = ncps_torch.CfC(4, 8)
    ours = CfC(4, 8).double()
    load_ncps(ours, theirs.double())
    x, spans = torch.randn(3, 5, 4).double(), torch.rand(3, 5).double() + 0.5
    with pytest.raises(RuntimeError):
        theirs(x, timespans=spans)
    ref, _ = _loop(ours, x, torch.zeros(3, 8, dtype=torch.float64), spans)
    torch.testing.assert_close(ours(x, None, spans)[0], ref, rtol=0, atol=1e-12)
