"""``numba_kernels.mixed_local``: a population's backward step to its layer's output.

Oracles: ATen's own ReLU and batch-norm backward applied to the used signal and
to the instruction (what autograd computes for each), the torch reference,
exact invariants (zero traffic makes the used signal's gradient the
instruction's bit for bit), and determinism across runs and thread schedules.
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


def _used(p, rule):
    if rule == "none":
        return p["I"]
    return nk.mixed_apical(p["I"], p["h"], p["C"], p["gain"], p["P"], p["b"], rule,
                           backend="torch").used


def _local(p, rule, stats, backend="auto", **kw):
    return nk.mixed_local(p["I"], p["h"], p["o"], p["C"], p["gain"], p["P"], p["b"], rule,
                          backend=backend, **stats, **kw)


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("rule", nk.LOCAL_RULES)
@pytest.mark.parametrize("shape", SHAPES)
def test_outputs_are_atens_backward_of_the_used_signal_and_of_the_instruction(shape, rule,
                                                                             norm):
    """grad = L(U), instruction_grad = L(I), masked = the ReLU's backward of I (float64)."""
    p, stats, _ = _case(shape, torch.float64, norm=norm)
    want, want_gamma, want_beta = _aten_local(_used(p, rule), p["h"], p["o"], stats, 0.7)
    clean = _aten_local(p["I"], p["h"], p["o"], stats, 0.7)[0]
    masked = torch.ops.aten.threshold_backward(p["I"], p["h"], 0.0)
    for backend in ("auto", "torch"):
        got = _local(p, rule, stats, backend, scale=0.7, instruction=True, masked=True)
        for name, a, w in (("grad", got.grad, want), ("instruction", got.instruction_grad,
                                                      clean)):
            torch.testing.assert_close(a, w, rtol=1e-12, atol=1e-14 * w.abs().max(), msg=name)
        assert torch.equal(got.masked, masked)
        if norm:
            torch.testing.assert_close(got.dgamma, want_gamma, rtol=1e-12, atol=1e-13)
            torch.testing.assert_close(got.dbeta, want_beta, rtol=1e-12, atol=1e-13)
        else:
            assert got.dgamma is None and got.dbeta is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rule", nk.LOCAL_RULES)
@pytest.mark.parametrize("shape", SHAPES)
def test_cpu_kernel_matches_reference(shape, rule, dtype):
    p, stats, _ = _case(shape, dtype, seed=1)
    tol = 2e-6 if dtype == torch.float32 else 1e-13
    kw = dict(scale=0.5, instruction=True, masked=True)
    got, want = _local(p, rule, stats, **kw), _local(p, rule, stats, "torch", **kw)
    for name in ("grad", "instruction_grad"):
        a, w = getattr(got, name), getattr(want, name)
        assert float((a - w).abs().max() / w.abs().max()) < tol, name
    assert torch.equal(got.masked, want.masked)
    for a, w in ((got.dgamma, want.dgamma), (got.dbeta, want.dbeta)):
        assert float((a - w).abs().max() / w.abs().max()) < 10 * tol
    # The sums of squares are mixed_apical's, magnitude included (none: used = I).
    mixed = nk.mixed_apical(p["I"], p["h"], p["C"], p["gain"], p["P"], p["b"],
                            "innovation" if rule == "none" else rule, backend="torch")
    want_ss = dict(ss_used=mixed.ss_instruction if rule == "none" else mixed.ss_used)
    for name in ("ss_used", "ss_instruction", "ss_raw", "ss_innovation", "ss_traffic"):
        w = want_ss.get(name, getattr(mixed, name))
        assert abs(float(getattr(got, name)) / float(w) - 1) < tol, name
    # Outputs not asked for are not made.
    lean = _local(p, rule, stats, scale=0.5)
    assert lean.instruction_grad is None and lean.masked is None
    assert torch.equal(lean.grad, got.grad)


@pytest.mark.parametrize("rule", nk.LOCAL_RULES)
def test_zero_traffic_makes_the_used_gradient_the_instructions_bit_for_bit(rule):
    """Zero gain and predictor: U == I, so the layer learns from the clean gradient exactly."""
    for dtype in (torch.float32, torch.float64):
        p, stats, _ = _case((6, 2, 5, 7), dtype, seed=2)
        p = dict(p, gain=0.0, P=torch.zeros_like(p["P"]), b=torch.zeros_like(p["b"]))
        got = _local(p, rule, stats, scale=0.7, instruction=True)
        clean = _local(p, "none", stats, scale=0.7)
        assert torch.equal(got.grad, got.instruction_grad)
        # Against the clean rule's own call: each rule's loop is compiled apart, and
        # fastmath may order its vectorised channel sums differently: equal to rounding.
        tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-13,
                                                                             atol=1e-15)
        for a, b in ((got.grad, clean.grad), (got.dgamma, clean.dgamma),
                     (got.dbeta, clean.dbeta)):
            torch.testing.assert_close(a, b, **tol)


def test_no_norm_is_the_masked_scaled_signal():
    p, _, _ = _case((7, 3, 11), torch.float64, seed=3, norm=False)
    p = dict(p, o=None)
    got = _local(p, "innovation", {}, scale=0.25, instruction=True)
    # hebbian (the default): the used gradient is I - ((g C - P) h - b)
    innovation = p["I"] - ((p["C"] * p["gain"] - p["P"]) * p["h"] - p["b"])
    torch.testing.assert_close(got.grad, 0.25 * innovation * (p["h"] > 0), rtol=1e-14,
                               atol=1e-15)
    assert torch.equal(got.instruction_grad, 0.25 * p["I"] * (p["h"] > 0))
    out = torch.full_like(p["I"], float("nan"))
    res = _local(p, "innovation", {}, scale=0.25, out=out)
    assert res.grad is out and torch.equal(out, got.grad)


@pytest.mark.parametrize("rule", nk.LOCAL_RULES)
def test_serial_parallel_and_repeated_runs_agree_bitwise(rule):
    p, stats, _ = _case((33, 16, 9, 9), torch.float32, seed=4)
    kw = dict(instruction=True, masked=True)
    runs = [_local(p, rule, stats, **kw) for _ in range(2)]
    threshold = cpu.SERIAL_BELOW
    try:
        cpu.SERIAL_BELOW = 1 << 40  # everything serial
        runs.append(_local(p, rule, stats, **kw))
    finally:
        cpu.SERIAL_BELOW = threshold
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)


def test_noncontiguous_inputs_are_handled():
    p, stats, _ = _case((6, 2, 5, 7), torch.float64, seed=5)
    t = {k: v.transpose(2, 3).contiguous().transpose(2, 3) if k in ("I", "h", "o") else v
         for k, v in p.items()}
    assert not t["I"].is_contiguous()
    got = _local(t, "matched", stats, instruction=True, masked=True)
    want = _local(p, "matched", stats, instruction=True, masked=True)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("change, message", [
    (dict(rule="mixed"), r"rule='mixed'; allowed: none, raw, matched, innovation"),
    (dict(o="short"), r"o \(shape \(6, 2, 5, 6\).*must have shape \(6, 2, 5, 7\)"),
    (dict(invstd=None), r"mean and invstd come together"),
    (dict(mean="wide"), r"mean \(shape \(3,\).*must have shape \(2,\)"),
    (dict(C="flat"), r"C \(shape \(70,\).*must have shape \(2, 5, 7\)"),
    (dict(P="f32"), r"P \(.*dtype torch.float32.*must match the population's dtype"),
    (dict(out="strided"), r"out \(.*is written in place and must be contiguous"),
    (dict(scale=float("nan")), r"scale=nan is not a finite torch.float64 number"),
])
def test_bad_arguments_are_refused_by_name(change, message):
    p, stats, _ = _case((6, 2, 5, 7), torch.float64, seed=6)
    kw = dict(p, rule="raw", scale=1.0, **stats)
    edits = {"short": p["o"][..., :6], "wide": torch.zeros(3, dtype=torch.float64),
             "flat": p["C"].reshape(-1), "f32": p["P"].float(),
             "strided": torch.empty(6, 2, 7, 5, dtype=torch.float64).transpose(2, 3)}
    for k, v in change.items():
        kw[k] = edits.get(v, v) if isinstance(v, str) and k != "rule" else v
    args = [kw.pop(k) for k in ("I", "h", "o", "C", "gain", "P", "b", "rule")]
    with pytest.raises((ValueError, TypeError), match=message):
        nk.mixed_local(*args, **kw)


def test_a_norm_without_weight_is_gamma_one():
    p, stats, _ = _case((6, 2, 5, 7), torch.float64, seed=7)
    ones = dict(stats, gamma=torch.ones_like(stats["gamma"]))
    plain = dict(stats, gamma=None)
    for backend in ("auto", "torch"):
        a = _local(p, "innovation", plain, backend, instruction=True)
        b = _local(p, "innovation", ones, backend, instruction=True)
        assert torch.equal(a.grad, b.grad) and torch.equal(a.dgamma, b.dgamma)
        assert torch.equal(a.instruction_grad, b.instruction_grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rule", nk.LOCAL_RULES)
def test_a_gamma_that_requires_grad_gives_the_same_bits(rule, dtype):
    """A gamma that requires grad (it is a parameter) is read detached by the same kernel:
    equal outputs, the float64 sums of squares included."""
    p, stats, _ = _case((9, 16, 3, 5), dtype, seed=8)  # 16 channels: numpy, torch sums differ
    kw = dict(scale=0.5, instruction=True, masked=True)
    short = _local(p, rule, stats, **kw)
    checked = _local(p, rule, dict(stats, gamma=stats["gamma"].requires_grad_()), **kw)
    for a, b in zip(short, checked):
        assert torch.equal(a, b)
        assert a.dtype == b.dtype and a.shape == b.shape


def test_float32_populations_run_float32_loops():
    """Every scalar a float32 population's kernel is compiled for is float32: one float64
    scalar (the zero, a norm statistic, the scale) makes numba promote the slab loops to
    float64, converting every element twice (a third slower at ResNet-20 sizes)."""
    from numba.core import types

    for shape in [(3, 2, 5), (64, 16, 8, 8)]:  # below and above SERIAL_BELOW
        p, stats, _ = _case(shape, torch.float32)
        for rule in nk.LOCAL_RULES:
            _local(p, rule, stats, instruction=True, masked=True)
            _local(p, rule, {})
    compiled = [sig for pair in cpu._LOCAL for kernel in pair for sig in kernel.signatures
                if sig[0].dtype == types.float32]
    assert len(compiled) >= 2  # both forms (every rule in each)
    for sig in compiled:
        scalars = [a for a in sig if isinstance(a, types.Float)]
        assert scalars and all(a == types.float32 for a in scalars), sig


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_a_norm_without_o_says_why_o_is_needed(backend):
    """o is read only by the norm's backward: missing with mean / invstd given, the error
    says so (not just "o must be a torch.Tensor"); without a norm o=None is fine."""
    p, stats, _ = _case((6, 2, 5, 7), torch.float64, seed=8)
    with pytest.raises(TypeError) as err:
        nk.mixed_local(p["I"], p["h"], None, p["C"], p["gain"], p["P"], p["b"], "raw",
                       backend=backend, **stats)
    assert str(err.value) == (
        "o is None, but mean / invstd were given: the norm's backward reads o, the layer's "
        "output before the norm (B, Ch, *S); pass o, or leave out mean, invstd and gamma for "
        "a layer without a norm")
    got = nk.mixed_local(p["I"], p["h"], None, p["C"], p["gain"], p["P"], p["b"], "raw",
                         backend=backend)
    want = _local(p, "raw", {}, backend)  # o given but unread without a norm
    assert torch.equal(got.grad, want.grad)


# ---- MT-2: the quadratic predictor's form and the given-traffic form -------------------------


def _mt2_case(shape, dtype, seed):
    """A population with a quadratic term P2 and a given traffic and prediction."""
    p, stats, _ = _case(shape, dtype, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    p["P2"] = (0.2 * torch.randn(shape[1:], generator=g, dtype=torch.float64)).to(dtype)
    p["T"], p["prediction"] = (torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
                               for _ in "ab")
    return p, stats


def _quadratic(p, rule, stats, backend="auto", **kw):
    return nk.mixed_local(p["I"], p["h"], p["o"], p["C"], p["gain"], p["P"], p["b"], rule,
                          P2=p["P2"], backend=backend, **stats, **kw)


def _given(p, rule, stats, backend="auto", **kw):
    return nk.mixed_traffic_local(p["I"], p["h"], p["o"], p["T"], p["prediction"], rule,
                                  backend=backend, **stats, **kw)


def _assert_matches(got, want, tol):
    for name in ("grad", "instruction_grad"):
        a, w = getattr(got, name), getattr(want, name)
        assert float((a - w).abs().max() / w.abs().max()) < tol, name
    assert torch.equal(got.masked, want.masked)
    if want.dgamma is not None:
        for a, w in ((got.dgamma, want.dgamma), (got.dbeta, want.dbeta)):
            assert float((a - w).abs().max() / w.abs().max()) < 10 * tol
    for name in ("ss_used", "ss_instruction", "ss_raw", "ss_innovation", "ss_traffic"):
        a, w = float(getattr(got, name)), float(getattr(want, name))
        assert abs(a / w - 1) < tol, name


@pytest.mark.parametrize("sign", ["hebbian", "anti_hebbian"])
@pytest.mark.parametrize("form", ["quadratic", "given"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(1, 3, 7), (5, 9), (7, 3, 11), (33, 16, 9, 9)])
def test_mt2_forms_match_the_reference(shape, dtype, form, sign):
    """The CPU kernel's quadratic and given forms against the torch reference: every rule,
    with and without a norm, odd shapes (one example, a flat population, a multi-thread
    one above SERIAL_BELOW)."""
    run = {"quadratic": _quadratic, "given": _given}[form]
    tol = 2e-6 if dtype == torch.float32 else 1e-13
    for norm in (True, False):
        p, stats = _mt2_case(shape, dtype, seed=11)
        stats = stats if norm else {}
        for rule in nk.LOCAL_RULES:
            kw = dict(scale=0.5, instruction=True, masked=True, sign=sign)
            _assert_matches(run(p, rule, stats, **kw), run(p, rule, stats, "torch", **kw), tol)
            lean = run(p, rule, stats, scale=0.5, sign=sign)
            assert lean.instruction_grad is None and lean.masked is None


def test_the_quadratic_reference_is_the_general_one_with_its_traffic_and_prediction():
    """P h + P2 h^2 + b with T = g C h: the quadratic form's maths is the general form's on
    those tensors (float64, to rounding), and P2 = 0 is the affine form bit for bit."""
    p, stats = _mt2_case((6, 2, 5, 7), torch.float64, seed=12)
    T = p["C"] * p["gain"] * p["h"]
    prediction = p["P"] * p["h"] + p["P2"] * p["h"] ** 2 + p["b"]
    for rule in nk.LOCAL_RULES:
        for sign in ("hebbian", "anti_hebbian"):
            kw = dict(scale=0.5, instruction=True, masked=True, sign=sign, **stats)
            quad = nk.mixed_local_reference(p["I"], p["h"], p["o"], p["C"], p["gain"], p["P"],
                                            p["b"], rule, P2=p["P2"], **{
                                                k: kw[k] for k in ("mean", "invstd", "gamma",
                                                                   "scale", "instruction",
                                                                   "masked", "sign")})
            general = nk.mixed_traffic_local_reference(
                p["I"], p["h"], p["o"], T, prediction, rule, **{
                    k: kw[k] for k in ("mean", "invstd", "gamma", "scale", "instruction",
                                       "masked", "sign")})
            _assert_matches(quad, general, 1e-12)
            zero = _quadratic(dict(p, P2=torch.zeros_like(p["P2"])), rule, stats,
                              scale=0.5, sign=sign)
            affine = _local(p, rule, stats, scale=0.5, sign=sign)
            assert torch.equal(zero.grad, affine.grad), rule


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_an_exact_quadratic_predictor_leaves_the_instruction_bit_for_bit(dtype):
    """P = g C, P2 = 0, b = 0 on linear traffic: the correction is exactly zero, so the
    used gradient is the instruction's (the kernel forms it as the reference does)."""
    p, stats = _mt2_case((6, 2, 5, 7), dtype, seed=13)
    gC = p["C"] * p["gain"]
    p = dict(p, P=gC, P2=torch.zeros_like(gC), b=torch.zeros_like(gC))
    for sign in ("hebbian", "anti_hebbian"):
        got = _quadratic(p, "innovation", stats, scale=0.7, instruction=True, sign=sign)
        assert torch.equal(got.grad, got.instruction_grad)


def test_a_given_traffic_equal_to_its_prediction_leaves_the_instruction():
    p, stats = _mt2_case((6, 2, 5, 7), torch.float32, seed=14)
    p["prediction"] = p["T"].clone()
    got = _given(p, "innovation", stats, scale=0.7, instruction=True)
    assert torch.equal(got.grad, got.instruction_grad)
    assert float(got.ss_innovation) == pytest.approx(float(got.ss_instruction), rel=1e-6)


@pytest.mark.parametrize("change, message", [
    (dict(P2="flat"), r"P2 \(shape \(70,\).*must have shape \(2, 5, 7\)"),
    (dict(P2="f32"), r"P2 \(.*dtype torch.float32.*must match the population's dtype"),
])
def test_a_bad_quadratic_term_is_refused_by_name(change, message):
    p, stats = _mt2_case((6, 2, 5, 7), torch.float64, seed=15)
    edits = {"flat": p["P2"].reshape(-1), "f32": p["P2"].float()}
    with pytest.raises(ValueError, match=message):
        _quadratic(dict(p, P2=edits[change["P2"]]), "raw", stats)


@pytest.mark.parametrize("name, edit, message", [
    ("T", lambda t: t[..., :6], r"T \(shape \(6, 2, 5, 6\).*must have shape \(6, 2, 5, 7\)"),
    ("prediction", lambda t: t.float(), r"prediction \(.*must match the population's dtype"),
    ("T", lambda t: "traffic", r"T must be a torch.Tensor, got str"),
])
def test_a_bad_given_traffic_or_prediction_is_refused_by_name(name, edit, message):
    p, stats = _mt2_case((6, 2, 5, 7), torch.float64, seed=16)
    with pytest.raises((ValueError, TypeError), match=message):
        _given(dict(p, **{name: edit(p[name])}), "raw", stats)
