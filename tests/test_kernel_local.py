"""``numba_kernels.mixed_local``: the used signal carried through the local derivative.

Oracles: ATen's own ReLU and batch-norm backward applied to the used signal
(what autograd would compute if the layer learned from it), the torch
reference, exact invariants (a zero correction leaves the base bit for bit),
and determinism across runs and thread schedules.
"""

from __future__ import annotations

import pytest
import torch

import numba_kernels as nk
from numba_kernels import cpu

SHAPES = [(1, 3, 7), (5, 9), (7, 3, 11), (6, 2, 5, 7), (33, 16, 9, 9)]


def _case(shape, dtype, seed=0, norm=True):
    g = torch.Generator().manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)

    ch, unit = shape[1], shape[1:]
    p = dict(I=r(*shape), h=r(*shape).relu(), o=r(*shape), C=(0.25 * r(*unit)).exp(),
             gain=1.3, P=0.3 * r(*unit), b=0.1 * r(*unit))
    stats = dict(mean=r(ch), invstd=r(ch).abs() + 0.5, gamma=r(ch)) if norm else {}
    return p, stats, r(*shape)


def _aten_local(signal, h, o, stats, scale):
    """ATen's backward from h to o for ``signal``: ReLU mask, scale, batch-norm backward."""
    masked = torch.ops.aten.threshold_backward(signal, h, 0.0) * scale
    if not stats:
        return masked, None, None
    if h.dim() == 2:  # (B, C): the norm's backward wants a spatial dim
        masked, o = masked.unsqueeze(-1), o.unsqueeze(-1)
    grad, dgamma, dbeta = torch.ops.aten.native_batch_norm_backward(
        masked, o, stats["gamma"], None, None, stats["mean"], stats["invstd"], True, 1e-5,
        [True, True, True])
    return grad.view(h.shape), dgamma, dbeta


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("rule", nk.RULES)
@pytest.mark.parametrize("shape", SHAPES)
def test_base_plus_correction_is_atens_backward_of_the_used_signal(shape, rule, norm):
    """grad = local(I) + local(U - I) = local(U), against ATen's kernels, in float64."""
    p, stats, _ = _case(shape, torch.float64, norm=norm)
    used = nk.mixed_apical(p["I"], p["h"], p["C"], p["gain"], p["P"], p["b"], rule,
                           backend="torch").used
    want, want_gamma, want_beta = _aten_local(used, p["h"], p["o"], stats, 0.7)
    base, base_gamma, base_beta = _aten_local(p["I"], p["h"], p["o"], stats, 0.7)
    for backend in ("auto", "torch"):
        got = nk.mixed_local(p["I"], p["h"], p["o"], p["C"], p["gain"], p["P"], p["b"], rule,
                             base=base, scale=0.7, backend=backend, **stats)
        torch.testing.assert_close(got.grad, want, rtol=1e-12, atol=1e-14 * want.abs().max())
        if norm:
            torch.testing.assert_close(base_gamma + got.dgamma, want_gamma, rtol=1e-12,
                                       atol=1e-13)
            torch.testing.assert_close(base_beta + got.dbeta, want_beta, rtol=1e-12, atol=1e-13)
        else:
            assert got.dgamma is None and got.dbeta is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rule", nk.RULES)
@pytest.mark.parametrize("shape", SHAPES)
def test_cpu_kernel_matches_reference(shape, rule, dtype):
    p, stats, base = _case(shape, dtype, seed=1)
    tol = 2e-6 if dtype == torch.float32 else 1e-13
    got = nk.mixed_local(p["I"], p["h"], p["o"], p["C"], p["gain"], p["P"], p["b"], rule,
                         base=base, scale=0.5, **stats)
    want = nk.mixed_local(p["I"], p["h"], p["o"], p["C"], p["gain"], p["P"], p["b"], rule,
                          base=base, scale=0.5, backend="torch", **stats)
    assert float((got.grad - want.grad).abs().max() / want.grad.abs().max()) < tol
    for a, w in ((got.dgamma, want.dgamma), (got.dbeta, want.dbeta)):
        assert float((a - w).abs().max() / w.abs().max()) < 10 * tol
    # The sums of squares are mixed_apical's, magnitude included.
    mixed = nk.mixed_apical(p["I"], p["h"], p["C"], p["gain"], p["P"], p["b"], rule,
                            backend="torch")
    for name in ("ss_used", "ss_instruction", "ss_raw", "ss_innovation", "ss_traffic"):
        assert abs(float(getattr(got, name)) / float(getattr(mixed, name)) - 1) < tol, name


@pytest.mark.parametrize("rule", nk.RULES)
def test_a_zero_correction_leaves_the_base_bit_for_bit(rule):
    """Zero gain and predictor: used == I, so the layer learns from the base exactly."""
    for dtype in (torch.float32, torch.float64):
        p, stats, base = _case((6, 2, 5, 7), dtype, seed=2)
        zero = torch.zeros_like(p["P"])
        got = nk.mixed_local(p["I"], p["h"], p["o"], p["C"], 0.0, zero, zero, rule, base=base,
                             scale=0.7, **stats)
        assert torch.equal(got.grad, base)
        assert not got.dgamma.any() and not got.dbeta.any()


def test_no_norm_is_base_plus_the_masked_scaled_correction():
    p, _, base = _case((7, 3, 11), torch.float64, seed=3, norm=False)
    got = nk.mixed_local(p["I"], p["h"], None, p["C"], p["gain"], p["P"], p["b"], "innovation",
                         base=base, scale=0.25)
    correction = (p["C"] * p["gain"] - p["P"]) * p["h"] - p["b"]
    want = base + 0.25 * correction * (p["h"] > 0)
    torch.testing.assert_close(got.grad, want, rtol=1e-14, atol=1e-15)
    # Without a base the correction alone; in place when out is the base.
    alone = nk.mixed_local(p["I"], p["h"], None, p["C"], p["gain"], p["P"], p["b"],
                           "innovation", scale=0.25)
    torch.testing.assert_close(alone.grad, want - base, rtol=1e-12, atol=1e-14)
    inplace = base.clone()
    res = nk.mixed_local(p["I"], p["h"], None, p["C"], p["gain"], p["P"], p["b"],
                         "innovation", base=inplace, out=inplace, scale=0.25)
    assert res.grad is inplace and torch.equal(inplace, got.grad)


@pytest.mark.parametrize("rule", nk.RULES)
def test_serial_parallel_and_repeated_runs_agree_bitwise(rule):
    p, stats, base = _case((33, 16, 9, 9), torch.float32, seed=4)
    runs = [nk.mixed_local(p["I"], p["h"], p["o"], p["C"], p["gain"], p["P"], p["b"], rule,
                           base=base, **stats) for _ in range(2)]
    assert torch.equal(runs[0].grad, runs[1].grad) and torch.equal(runs[0].dgamma,
                                                                   runs[1].dgamma)
    threshold = cpu.SERIAL_BELOW
    try:
        cpu.SERIAL_BELOW = 1 << 40  # everything serial
        serial = nk.mixed_local(p["I"], p["h"], p["o"], p["C"], p["gain"], p["P"], p["b"],
                                rule, base=base, **stats)
    finally:
        cpu.SERIAL_BELOW = threshold
    assert torch.equal(serial.grad, runs[0].grad) and torch.equal(serial.dbeta, runs[0].dbeta)
    assert float(serial.ss_used) == float(runs[0].ss_used)


def test_noncontiguous_inputs_are_handled():
    p, stats, base = _case((6, 2, 5, 7), torch.float64, seed=5)
    t = {k: v.transpose(2, 3).contiguous().transpose(2, 3) if k in ("I", "h", "o") else v
         for k, v in p.items()}
    assert not t["I"].is_contiguous()
    got = nk.mixed_local(t["I"], t["h"], t["o"], t["C"], t["gain"], t["P"], t["b"], "matched",
                         base=base, **stats)
    want = nk.mixed_local(p["I"], p["h"], p["o"], p["C"], p["gain"], p["P"], p["b"], "matched",
                          base=base, **stats)
    assert torch.equal(got.grad, want.grad)


@pytest.mark.parametrize("change, message", [
    (dict(rule="mixed"), r"rule='mixed'; allowed: raw, matched, innovation"),
    (dict(o="short"), r"o \(shape \(6, 2, 5, 6\).*must have the population's shape"),
    (dict(invstd=None), r"mean and invstd come together"),
    (dict(mean="wide"), r"mean \(shape \(3,\).*one value per channel, shape \(2,\)"),
    (dict(C="flat"), r"C \(shape \(70,\).*must be per unit, shape \(2, 5, 7\)"),
    (dict(base="f32"), r"base \(.*dtype torch.float32.*must match the population's dtype"),
    (dict(out="strided"), r"out \(.*is written in place and must be contiguous"),
    (dict(scale=float("nan")), r"scale must be finite, got nan"),
])
def test_bad_arguments_are_refused_by_name(change, message):
    p, stats, base = _case((6, 2, 5, 7), torch.float64, seed=6)
    kw = dict(p, rule="raw", base=base, scale=1.0, **stats)
    edits = {"short": p["o"][..., :6], "wide": torch.zeros(3, dtype=torch.float64),
             "flat": p["C"].reshape(-1), "f32": base.float(),
             "strided": torch.empty(6, 2, 7, 5, dtype=torch.float64).transpose(2, 3)}
    for k, v in change.items():
        kw[k] = edits.get(v, v) if isinstance(v, str) and k != "rule" else v
    args = [kw.pop(k) for k in ("I", "h", "o", "C", "gain", "P", "b", "rule")]
    with pytest.raises((ValueError, TypeError), match=message):
        nk.mixed_local(*args, **kw)


def test_a_norm_without_weight_is_gamma_one():
    p, stats, base = _case((6, 2, 5, 7), torch.float64, seed=7)
    args = (p["I"], p["h"], p["o"], p["C"], p["gain"], p["P"], p["b"], "innovation")
    ones = dict(stats, gamma=torch.ones_like(stats["gamma"]))
    plain = dict(stats, gamma=None)
    for backend in ("auto", "torch"):
        a = nk.mixed_local(*args, base=base, backend=backend, **plain)
        b = nk.mixed_local(*args, base=base, backend=backend, **ones)
        assert torch.equal(a.grad, b.grad) and torch.equal(a.dgamma, b.dgamma)
