"""numba_kernels CPU forms against the torch reference, invariants, and input errors.

Oracles: the plain-torch reference (itself checked against the definitions of
DESIGN section 5 written out directly), exact invariants (an exact predictor
gives innovation == instruction; matched has innovation's per-example norm and
raw's direction), and bitwise run-to-run equality.
"""

from __future__ import annotations

import math
import os
import re

import numpy as np
import pytest
import torch

import numba_kernels as nk
from numba_kernels import cpu

TOL = {torch.float32: 1e-5, torch.float64: 1e-12}
# (B, N): odd sizes; one example; a 1-D (B, C, L) and a 2-D (B, C, H, W) population;
# a flat (B, N) one; a batch that is not a multiple of anything and rows longer than
# one CPU chunk (cpu.CHUNK units) that end mid-chunk; one big enough for the parallel kernel.
SHAPES = [(1, 7), (13, 3, 29), (5, 3, 7, 9), (3, 2, 71, 37), (129, 257)]


def test_shapes_cover_multi_chunk_rows_and_both_kernels():
    n = [math.prod(s[1:]) for s in SHAPES]
    assert any(k > cpu.CHUNK and k % cpu.CHUNK for k in n)
    assert any(math.prod(s) >= cpu.SERIAL_BELOW for s in SHAPES)
SS = ("ss_used", "ss_instruction", "ss_raw", "ss_innovation", "ss_traffic")


def population(shape, dtype, seed=0, gain=0.7):
    g = torch.Generator().manual_seed(seed)
    u = shape[1:]
    return dict(
        I=torch.randn(shape, generator=g, dtype=dtype),
        h=torch.randn(shape, generator=g, dtype=dtype).relu(),
        C=(0.25 * torch.randn(u, generator=g, dtype=dtype)).exp(),
        gain=gain,
        P=torch.randn(u, generator=g, dtype=dtype),
        b=0.1 * torch.randn(u, generator=g, dtype=dtype),
    )


def rel(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def ss(x) -> float:
    return float(x.double().square().sum())


@pytest.mark.parametrize("sign", nk.SIGNS)
def test_reference_is_the_design_definition(sign):
    # The reference against the definitions (DESIGN section 5, the seed's descent
    # convention d = -I), written out per example in float64; used = minus each.
    p = population((4, 3, 5), torch.float64)
    I, h, C, g, P, b = p["I"], p["h"], p["C"], p["gain"], p["P"], p["b"]
    s = {"hebbian": 1, "anti_hebbian": -1}[sign]
    T = g * C * h
    R = -I + s * T
    N = R - s * (P * h + b)
    M = torch.stack([R[e] * N[e].norm() / R[e].norm() for e in range(4)])
    R, N, M = -R, -N, -M
    if sign == "hebbian":  # the seed's: on an active unit the traffic lowers the gradient
        assert torch.equal(R, I - T)
    for rule, want in (("raw", R), ("innovation", N), ("matched", M)):
        got = nk.mixed_apical_reference(I, h, C, g, P, b, rule, sign)
        assert rel(got.used, want) < 1e-13
        assert math.isclose(float(got.ss_used), ss(want), rel_tol=1e-13)
        for name, x in (("ss_instruction", I), ("ss_raw", R), ("ss_innovation", N),
                        ("ss_traffic", T)):
            assert math.isclose(float(getattr(got, name)), ss(x), rel_tol=1e-13), name


@pytest.mark.parametrize("sign", nk.SIGNS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rule", nk.RULES)
def test_mixed_apical_cpu_matches_reference(shape, dtype, rule, sign):
    p = population(shape, dtype)
    got = nk.mixed_apical(**p, rule=rule, sign=sign)
    want = nk.mixed_apical(**p, rule=rule, sign=sign, backend="torch")
    assert got.used.shape == shape and got.used.dtype == dtype
    assert rel(got.used, want.used) < TOL[dtype]
    for name in SS:
        x = getattr(got, name)
        assert x.dtype == torch.float64 and x.dim() == 0
        assert math.isclose(float(x), float(getattr(want, name)), rel_tol=TOL[dtype]), name
    # RMS magnitudes are what the callers log: check one against a direct computation
    assert math.isclose(math.sqrt(float(got.ss_traffic) / got.used.numel()),
                        math.sqrt(ss(p["gain"] * p["C"] * p["h"]) / p["h"].numel()),
                        rel_tol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_exact_predictor_gives_the_instruction(dtype):
    p = population((7, 4, 1300), dtype)  # odd batch, parallel kernel, two chunks per row
    assert p["I"].numel() >= cpu.SERIAL_BELOW and 4 * 1300 > cpu.CHUNK
    p["P"] = p["gain"] * p["C"]
    p["b"] = torch.zeros_like(p["b"])
    for backend in ("auto", "torch"):
        for sign in nk.SIGNS:
            out = nk.mixed_apical(**p, rule="innovation", sign=sign, backend=backend)
            assert torch.equal(out.used, p["I"])
        assert float(out.ss_innovation) == pytest.approx(ss(p["I"]), rel=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matched_has_innovation_norm_and_raw_direction(dtype):
    p = population((9, 3, 41), dtype)
    m = nk.mixed_apical(**p, rule="matched")
    r = nk.mixed_apical(**p, rule="raw").used.double().flatten(1)
    n = nk.mixed_apical(**p, rule="innovation").used.double().flatten(1)
    u = m.used.double().flatten(1)
    tol = TOL[dtype]
    assert torch.allclose(u.norm(dim=1), n.norm(dim=1), rtol=tol, atol=0)
    cos = (u * r).sum(1) / (u.norm(dim=1) * r.norm(dim=1))
    assert torch.allclose(cos, torch.ones_like(cos), rtol=0, atol=tol)
    # the norms differ from raw's (otherwise the test above could not fail)
    assert (r.norm(dim=1) / n.norm(dim=1) - 1).abs().min() > 1e-3
    assert float(m.ss_used) == pytest.approx(float(n.square().sum()), rel=tol)


def test_matched_zero_raw_row_is_zero():
    p = population((3, 8), torch.float64)
    p["I"][1] = 0.0
    p["h"][1] = 0.0  # R_1 = 0, while N_1 = -b is not
    for backend in ("auto", "torch"):
        m = nk.mixed_apical(**p, rule="matched", backend=backend)
        assert torch.isfinite(m.used).all() and torch.equal(m.used[1], torch.zeros(8,
                                                                                 dtype=p["I"].dtype))
        n = nk.mixed_apical(**p, rule="innovation").used
        assert float(m.ss_used) == pytest.approx(ss(n[[0, 2]]), rel=1e-12)


def test_zero_gain_and_predictor_give_the_instruction_for_every_rule():
    p = population((4, 2, 9), torch.float64, gain=0.0)
    p["P"] = torch.zeros_like(p["P"])
    p["b"] = torch.zeros_like(p["b"])
    for rule in nk.RULES:
        for sign in nk.SIGNS:
            out = nk.mixed_apical(**p, rule=rule, sign=sign)
            assert torch.equal(out.used, p["I"]), rule
            assert float(out.ss_traffic) == 0.0


@pytest.mark.parametrize("rule", nk.RULES)
def test_mixed_apical_is_bitwise_deterministic(rule):
    p = population((64, 16, 8, 8), torch.float32, seed=3)  # parallel kernel
    assert p["I"].numel() >= cpu.SERIAL_BELOW
    first = nk.mixed_apical(**p, rule=rule)
    for _ in range(3):
        again = nk.mixed_apical(**p, rule=rule)
        assert torch.equal(again.used, first.used)
        assert all(torch.equal(getattr(again, k), getattr(first, k)) for k in SS)


def test_serial_and_parallel_kernels_agree_bitwise():
    # The chunking fixes the arithmetic; the thread schedule must not change it.
    # An odd batch (rows do not split evenly over the threads) and rows of three
    # chunks, the last one partial.
    B, N = 41, 2 * cpu.CHUNK + 808
    p = population((B, N), torch.float32, seed=4)
    args = [p["I"].numpy(), p["h"].numpy(), p["C"].numpy(), np.float32(p["gain"]),
            p["P"].numpy(), p["b"].numpy()]
    for code in (cpu.RAW, cpu.INNOVATION, cpu.MATCHED):
        outs, tots = [], []
        for kernel in (cpu._mixed_serial, cpu._mixed_parallel):
            out = np.empty((B, N), dtype=np.float32)
            tots.append(kernel(*args, code, out))
            outs.append(out)
        assert np.array_equal(outs[0], outs[1]) and np.array_equal(tots[0], tots[1])


def test_serial_and_parallel_kernels_have_their_own_cache_entries():
    # Both come from one factory; numba keys a cached closure by its code and its
    # closure's values, so a flag seen only by the decorator gave them one cache entry
    # and the serial kernel came back parallel from the cache.
    I = np.ones((3, 5), dtype=np.float32)
    u = np.ones(5, dtype=np.float32)
    kernels = (cpu._mixed_serial, cpu._mixed_parallel)
    for kernel in kernels:
        kernel(I, I, u, np.float32(0.5), u, u, cpu.RAW, np.empty_like(I))
    keys = [k._cache._index_key(k.signatures[0], k.targetctx.codegen()) for k in kernels]
    assert keys[0] != keys[1]
    assert cpu._mixed_serial.targetoptions.get("parallel") is False
    assert cpu._mixed_parallel.targetoptions.get("parallel") is True


def test_sums_are_the_named_sums_of_squares_in_order():
    p = population((6, 5, 7), torch.float64, seed=2)
    I, h, C, g, P, b = p["I"], p["h"], p["C"], p["gain"], p["P"], p["b"]
    T = g * C * h
    # hebbian (the default): the used gradient is minus d + T, d = -I
    direct = {"instruction": ss(I), "traffic": ss(T), "raw": ss(I - T),
              "innovation": ss(I - T + (P * h + b)), "used": ss(I - T)}
    for backend in ("auto", "torch"):
        got = nk.mixed_apical(**p, rule="raw", backend=backend)
        assert got.sums.shape == (5,) and got.sums.dtype == torch.float64
        for k, name in enumerate(got.SUMS):
            assert math.isclose(got.sums[k].item(), direct[name], rel_tol=1e-12), name
            assert torch.equal(getattr(got, f"ss_{name}"), got.sums[k])


def test_mixed_apical_inputs_grad_noncontiguous_and_out():
    p = population((5, 6, 7), torch.float64)
    want = nk.mixed_apical(**p, rule="innovation", backend="torch")
    q = dict(p)
    q["I"] = p["I"].clone().requires_grad_(True)
    q["h"] = p["h"].transpose(1, 2).contiguous().transpose(1, 2)  # non-contiguous view
    q["gain"] = torch.tensor(p["gain"], dtype=torch.float64)  # 0-d tensor gain
    assert not q["h"].is_contiguous()
    out = torch.empty(5, 6, 7, dtype=torch.float64)
    got = nk.mixed_apical(**q, rule="innovation", out=out)
    assert got.used is out and not got.used.requires_grad
    assert rel(out, want.used) < 1e-12


def test_mixed_apical_errors_name_the_argument():
    p = population((4, 3, 5), torch.float32)
    with pytest.raises(ValueError, match=r"rule='clean'; allowed: raw, matched, innovation"):
        nk.mixed_apical(**p, rule="clean")
    with pytest.raises(ValueError, match=r"I \(shape \(4, 3, 6\).*must have shape "
                                         r"\(4, 3, 5\)"):
        nk.mixed_apical(**{**p, "I": torch.zeros(4, 3, 6)}, rule="raw")
    with pytest.raises(ValueError, match=r"C \(shape \(15,\).*must have shape \(3, 5\)"):
        nk.mixed_apical(**{**p, "C": torch.ones(15)}, rule="raw")
    with pytest.raises(ValueError, match=r"P \(.*dtype torch.float64.*must match the "
                                         r"population's dtype torch.float32"):
        nk.mixed_apical(**{**p, "P": p["P"].double()}, rule="raw")
    with pytest.raises(TypeError, match=r"h \(.*dtype torch.float16.*must be a dense float32 "
                                        r"or float64 tensor"):
        nk.mixed_apical(**{**p, "h": p["h"].half(), "I": p["I"].half()}, rule="raw")
    with pytest.raises(ValueError, match=r"h \(shape \(5,\).*must be a non-empty population"):
        nk.mixed_apical(**{**p, "h": torch.ones(5), "I": torch.ones(5)}, rule="raw")
    with pytest.raises(ValueError, match=r"gain=nan is not a finite torch.float32 number"):
        nk.mixed_apical(**{**p, "gain": float("nan")}, rule="raw")
    with pytest.raises(TypeError, match=r"gain must be a finite number, got tensor"):
        nk.mixed_apical(**{**p, "gain": torch.ones(2)}, rule="raw")
    out = torch.empty(4, 5, 3).transpose(1, 2)
    with pytest.raises(ValueError, match=r"out \(shape \(4, 3, 5\).*"
                                         r"written in place and must be contiguous"):
        nk.mixed_apical(**p, rule="raw", out=out)
    with pytest.raises(ValueError, match=r"backend='gpu'; allowed: auto, numba, torch"):
        nk.mixed_apical(**p, rule="raw", backend="gpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(1, 5), (7, 3, 11), (6, 2, 5, 7), (33, 700)])
def test_predictor_update_cpu_matches_reference(shape, dtype):
    g = torch.Generator().manual_seed(5)
    h = torch.randn(shape, generator=g, dtype=dtype).relu() + 0.5
    T = 1.7 * h + 0.3 + 0.1 * torch.randn(shape, generator=g, dtype=dtype)
    P0 = torch.randn(shape[1:], generator=g, dtype=dtype)
    b0 = torch.randn(shape[1:], generator=g, dtype=dtype)
    P1, b1, P2, b2 = P0.clone(), b0.clone(), P0.clone(), b0.clone()
    got = nk.predictor_update(h, T, P1, b1, 0.25)
    want = nk.predictor_update(h, T, P2, b2, 0.25, backend="torch")
    assert rel(P1 - P0, P2 - P0) < TOL[dtype] and rel(b1 - b0, b2 - b0) < TOL[dtype]
    for a, w in zip(got, want):
        assert math.isclose(float(a), float(w), rel_tol=TOL[dtype])
    # the statistics are of the residual before the step, against a direct computation
    r = T.double() - (P0.double() * h.double() + b0.double())
    assert math.isclose(float(got.ss_residual), ss(r), rel_tol=TOL[dtype])
    assert math.isclose(float(got.ss_traffic), ss(T), rel_tol=TOL[dtype])


def test_predictor_update_is_the_design_rule_and_converges():
    # One step written out by hand in float64, then many steps: a unit whose traffic
    # is an exact affine function of h is learnt (eta = 1 solves it in one step).
    g = torch.Generator().manual_seed(6)
    h = torch.rand(50, 4, 3, generator=g, dtype=torch.float64)
    T = 2.5 * h - 0.4
    P, b = torch.zeros(4, 3, dtype=torch.float64), torch.zeros(4, 3, dtype=torch.float64)
    r = T - (P * h + b)
    hc, rc = h - h.mean(0), r - r.mean(0)
    dP = 0.5 * (rc * hc).mean(0) / (hc.square().mean(0) + 1e-12)
    db = 0.5 * r.mean(0)
    nk.predictor_update(h, T, P, b, 0.5)
    assert rel(P, dP) < 1e-12 and rel(b, db) < 1e-12
    P.zero_(), b.zero_()
    nk.predictor_update(h, T, P, b, 1.0)
    assert torch.allclose(P, torch.full_like(P, 2.5), atol=1e-10)
    for _ in range(60):
        stats = nk.predictor_update(h, T, P, b, 1.0)
    assert torch.allclose(b, torch.full_like(b, -0.4), atol=1e-10)
    assert float(stats.ss_residual) < 1e-18 * float(stats.ss_traffic)


def test_predictor_update_one_example_and_version_bump():
    h = torch.tensor([[1.0, 2.0]], dtype=torch.float64)
    T = torch.tensor([[3.0, 1.0]], dtype=torch.float64)
    P, b = torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    v = P._version
    nk.predictor_update(h, T, P, b, 0.5)
    # one example: no variance, so P does not move; b takes half the residual
    assert torch.equal(P, torch.zeros(2, dtype=torch.float64))
    assert torch.equal(b, torch.tensor([1.5, 0.5], dtype=torch.float64))
    assert P._version > v


def test_predictor_update_errors():
    h = torch.rand(4, 3, 5)
    P = torch.zeros(5, 3).t()
    with pytest.raises(ValueError, match=r"P \(shape \(3, 5\).*written in "
                                         r"place and must be contiguous"):
        nk.predictor_update(h, h, P, torch.zeros(3, 5), 0.1)
    with pytest.raises(ValueError, match=r"b \(shape \(5,\).*must have shape \(3, 5\)"):
        nk.predictor_update(h, h, torch.zeros(3, 5), torch.zeros(5), 0.1)
    with pytest.raises(ValueError, match=r"T \(shape \(4, 5, 3\).*must have shape \(4, 3, 5\)"):
        nk.predictor_update(h, torch.rand(4, 5, 3), torch.zeros(3, 5), torch.zeros(3, 5), 0.1)
    with pytest.raises(ValueError, match=r"eta=inf is not a finite torch.float32 number"):
        nk.predictor_update(h, h, torch.zeros(3, 5), torch.zeros(3, 5), float("inf"))
    # A negative step would move P and b away from the fit; refused before anything is written.
    for backend in ("auto", "torch"):
        P, b = torch.zeros(3, 5), torch.zeros(3, 5)
        with pytest.raises(ValueError) as err:
            nk.predictor_update(h, 2 * h + 1, P, b, -0.1, backend=backend)
        assert str(err.value) == ("eta=-0.1 is negative; the NLMS step size must be >= 0 (the "
                                  "rules' predictor_lr is in (0, 1]; 0 leaves P and b "
                                  "unchanged)")
        assert not P.any() and not b.any()
        nk.predictor_update(h, 2 * h + 1, P, b, 0.0, backend=backend)  # 0: allowed, a no-op
        assert not P.any() and not b.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [1, 37, cpu.SERIAL_BELOW + 3])
def test_aux_add(n, dtype):
    g = torch.Generator().manual_seed(n)
    dst = torch.randn(n, generator=g, dtype=dtype).view(-1, 1)
    src = torch.randn(n, generator=g, dtype=dtype).view(-1, 1)
    want = dst + src
    v = dst._version
    assert nk.aux_add(dst, src) is dst
    assert torch.equal(dst, want) and dst._version > v


def test_aux_add_noncontiguous_src_grad_and_errors():
    dst = torch.zeros(3, 4, requires_grad=True)
    src = torch.arange(12.0).view(4, 3).t()
    with torch.no_grad():
        nk.aux_add(dst, src)
    assert torch.equal(dst.detach(), src)
    with pytest.raises(ValueError, match=r"dst \(shape \(4, 3\).*must be contiguous"):
        nk.aux_add(torch.zeros(3, 4).t(), src.t())
    with pytest.raises(ValueError, match=r"src \(shape \(4, 3\).*must have dst's shape, dtype "
                                         r"and device \(shape \(3, 4\).*no broadcasting"):
        nk.aux_add(torch.zeros(3, 4), torch.zeros(4, 3))
    with pytest.raises(ValueError, match=r"src \(.*dtype torch.float64.*must have dst's shape, "
                                         r"dtype and device"):
        nk.aux_add(torch.zeros(3, 4), torch.zeros(3, 4, dtype=torch.float64))


@pytest.mark.slow
def test_bench_kernels_quick_smoke(capsys):
    # The benchmark's --quick size runs end to end and prints every figure it promises.
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_kernels.py"
    spec = importlib.util.spec_from_file_location("bench_kernels", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    threads = torch.get_num_threads()
    try:
        bench.main(["--quick"])
    finally:
        torch.set_num_threads(threads)
    text = capsys.readouterr().out
    for line in ("mixed_apical speedup vs torch reference", "mixed_apical bandwidth / torch "
                 "add(out=)", "aux_add bandwidth / torch add_", "GB/s", "threads: numba"):
        assert line in text, line


def test_predictor_update_names_each_bad_argument_and_bumps_both_versions():
    h = torch.rand(4, 3, 5)
    good = torch.zeros(3, 5)
    with pytest.raises(ValueError, match=r"^h \(shape \(4,\), .*must be a non-empty population"):
        nk.predictor_update(torch.rand(4), h, good, good.clone(), 0.1)
    with pytest.raises(ValueError, match=r"^P \(shape \(5, 3\).*must have shape \(3, 5\)"):
        nk.predictor_update(h, h, torch.zeros(5, 3), good.clone(), 0.1)
    with pytest.raises(ValueError, match=r"^b \(shape \(3, 5\).*written in place"):
        nk.predictor_update(h, h, good.clone(), torch.zeros(5, 3).t(), 0.1)
    P, b = good.clone(), good.clone()
    versions = P._version, b._version
    nk.predictor_update(h, h, P, b, 0.1)
    assert P._version > versions[0] and b._version > versions[1]


@pytest.mark.parametrize("backend", ["auto", "numba"])
@pytest.mark.parametrize("where", ["I", "h", "C"])
def test_a_nan_reaches_every_total_as_in_the_reference(where, backend):
    # Matched leaves all-zero raw rows out of ss_used; a NaN row is not zero and must
    # show, or the logged RMS of the used signal reads finite while the signal is NaN.
    p = population((6, 4, 5), torch.float32, seed=11)
    p[where] = p[where].clone()
    p[where].view(-1)[3] = float("nan")  # row 0 for I and h; every row for C
    for rule in nk.RULES:
        got = nk.mixed_apical(**p, rule=rule, backend=backend)
        want = nk.mixed_apical(**p, rule=rule, backend="torch")
        assert torch.equal(got.used.isnan(), want.used.isnan())
        torch.testing.assert_close(got.used, want.used, equal_nan=True)
        for k in SS:
            assert bool(getattr(got, k).isnan()) == bool(getattr(want, k).isnan()), (rule, k)
        assert bool(got.ss_used.isnan()) and bool(got.ss_raw.isnan())


@pytest.mark.parametrize("backend", ["auto", "numba"])
def test_a_row_whose_norms_overflow_is_nan_under_matched_as_in_the_reference(backend):
    # float32 row 1 at 1e30: its sums of squares overflow, so ||N_e|| / ||R_e|| is
    # undefined; the matched row and ss_used are NaN in every form, the other rows exact.
    p = population((4, 3, 5), torch.float32, seed=12)
    p["I"] = p["I"].clone()
    p["I"][1] *= 1e30
    got = nk.mixed_apical(**p, rule="matched", backend=backend)
    want = nk.mixed_apical(**p, rule="matched", backend="torch")
    assert bool(want.used[1].isnan().all()) and not bool(want.used[[0, 2, 3]].isnan().any())
    assert torch.equal(got.used.isnan(), want.used.isnan())
    torch.testing.assert_close(got.used, want.used, equal_nan=True)
    assert bool(got.ss_used.isnan()) and bool(want.ss_used.isnan())
    o = torch.randn(4, 3, 5, generator=torch.Generator().manual_seed(3))
    local = [nk.mixed_local(p["I"], p["h"], o, p["C"], p["gain"], p["P"], p["b"], "matched",
                            backend=b) for b in (backend, "torch")]
    assert torch.equal(local[0].grad.isnan(), local[1].grad.isnan())
    assert bool(local[0].ss_used.isnan()) and bool(local[1].ss_used.isnan())


@pytest.mark.parametrize("backend", nk.BACKENDS)
def test_bad_scalars_and_non_tensors_are_named(backend):
    p = population((4, 3, 5), torch.float32)
    with pytest.raises(ValueError, match=r"^gain=1e\+39 is not a finite torch.float32 number "
                                         r"\(largest 3.40282e\+38\)"):
        nk.mixed_apical(**{**p, "gain": 1e39}, rule="raw", backend=backend)
    p64 = population((4, 3, 5), torch.float64)  # the same gain is fine in float64
    assert torch.isfinite(nk.mixed_apical(**{**p64, "gain": 1e39}, rule="raw").ss_raw)
    for bad in ("two", None):
        with pytest.raises(TypeError, match=rf"^gain must be a finite number, got {bad!r}"):
            nk.mixed_apical(**{**p, "gain": bad}, rule="raw", backend=backend)
    o = torch.randn(4, 3, 5)
    with pytest.raises(ValueError, match=r"^scale=-1e\+40 is not a finite torch.float32"):
        nk.mixed_local(p["I"], p["h"], o, p["C"], 0.5, p["P"], p["b"], "raw", scale=-1e40,
                       backend=backend)
    with pytest.raises(TypeError, match=r"^I must be a torch.Tensor, got NoneType"):
        nk.mixed_apical(**{**p, "I": None}, rule="raw", backend=backend)
    with pytest.raises(TypeError, match=r"^dst must be a torch.Tensor, got NoneType"):
        nk.aux_add(None, p["I"], backend=backend)


@pytest.mark.parametrize("backend", nk.BACKENDS)
def test_out_may_be_an_input_itself(backend):
    p = population((4, 3, 5), torch.float64, seed=13)
    want = nk.mixed_apical(**p, rule="matched", backend="torch")
    I = p["I"].clone()  # noqa: E741
    got = nk.mixed_apical(**{**p, "I": I}, rule="matched", out=I, backend=backend)
    assert got.used is I and rel(I, want.used) < 1e-12


def test_more_bad_arguments_are_named():
    p = population((4, 3, 5), torch.float32)
    with pytest.raises(TypeError, match=r"^gain must be a finite number, got 1000"):
        nk.mixed_apical(**{**p, "gain": 10**400}, rule="raw")
    with pytest.raises(ValueError, match=r"^eta=1e\+39 is not a finite torch.float32"):
        nk.predictor_update(p["h"], p["I"], p["P"].clone(), p["b"].clone(), 1e39)
    # an out of another shape is told the shape expected, even when it is 1-D
    with pytest.raises(ValueError, match=r"^out \(shape \(60,\).*must have shape \(4, 3, 5\)"):
        nk.mixed_apical(**p, rule="raw", out=torch.empty(60))
    with pytest.raises(ValueError, match=r"^sign='hebb'; allowed: hebbian, anti_hebbian"):
        nk.mixed_apical(**p, rule="raw", sign="hebb")


def test_the_checks_run_once_per_layout_and_again_for_a_new_one():
    # A layout's checks are cached: the same layout again skips them (the hot path), and
    # a tensor of another shape, stride, dtype or device is a new layout, checked afresh.
    from numba_kernels import dispatch

    p = population((4, 3, 5), torch.float64, seed=21)
    dispatch._CHECKED.clear()
    calls = []
    real = dispatch._check
    dispatch._check = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        for _ in range(3):
            nk.mixed_apical(**p, rule="raw")
        assert len(calls) == 1
        with pytest.raises(ValueError, match=r"^P \(shape \(3, 4\)"):
            nk.mixed_apical(**{**p, "P": torch.zeros(3, 4, dtype=torch.float64)}, rule="raw")
        with pytest.raises(ValueError, match=r"^C \(.*dtype torch.float32.*must match"):
            nk.mixed_apical(**{**p, "C": p["C"].float()}, rule="raw")
        transposed = p["h"].transpose(1, 2).contiguous().transpose(1, 2)
        got = nk.mixed_apical(**{**p, "h": transposed}, rule="raw")
        assert len(calls) == 4
        assert torch.equal(got.used, nk.mixed_apical(**p, rule="raw").used)
    finally:
        dispatch._check = real


@pytest.mark.parametrize("backend", ["auto", "numba", "torch"])
def test_in_place_targets_autograd_tracks_are_refused(backend):
    # The kernels write through views autograd cannot see: a tracked target is refused
    # (as torch refuses an in-place op on a leaf that requires grad), with no change made;
    # under no_grad (an optimizer step) the write goes through.
    B, U = 3, 5
    h, I = torch.rand(B, U), torch.randn(B, U)
    C, P, b = torch.rand(U), torch.zeros(U), torch.zeros(U)
    leaf = torch.zeros(B, U, requires_grad=True)
    tracked = torch.zeros(B, U, requires_grad=True) * 1.0  # a non-leaf in a graph
    for target in (leaf, tracked):
        for call, name in ((lambda t: nk.aux_add(t, I, backend=backend), "dst"),
                           (lambda t: nk.mixed_apical(I, h, C, 0.5, P, b, "raw", out=t,
                                                      backend=backend), "out")):
            with pytest.raises(RuntimeError, match=rf"{name} \(shape \(3, 5\).*requires grad "
                                                   r"and is written in place.*torch.no_grad"):
                call(target)
            assert not target.detach().any()
    Pg = torch.zeros(U, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"P \(shape \(5,\).*requires grad"):
        nk.predictor_update(h, I, Pg, torch.zeros(U), 0.5, backend=backend)
    assert not Pg.detach().any()
    with torch.no_grad():
        nk.aux_add(leaf, I, backend=backend)
    assert torch.equal(leaf.detach(), I)


@pytest.mark.parametrize("backend", ["auto", "numba", "torch"])
def test_sparse_and_mkldnn_tensors_are_named(backend):
    p = population((4, 3, 5), torch.float32)
    for name in ("I", "h", "C", "P", "b"):
        for layout, value in (("sparse_coo", p[name].to_sparse()),
                              ("_mkldnn", p[name].to_mkldnn())):
            with pytest.raises(TypeError, match=rf"^{name} \(.*layout torch.{layout}\) must be "
                                                r"a dense float32 or float64 tensor"):
                nk.mixed_apical(**{**p, name: value}, rule="raw", backend=backend)
    with pytest.raises(TypeError, match=r"^src \(.*layout torch.sparse_coo\)"):
        nk.aux_add(p["I"].clone(), p["I"].to_sparse(), backend=backend)


@pytest.mark.parametrize("rule", [["raw"], {"raw": 1}, "Raw", "innovaton", None])
def test_a_bad_rule_is_named_by_every_entry_point(rule):
    # An unhashable rule once met the short path's dict lookup (TypeError: unhashable
    # type), and the exported references took any unknown rule for matched.
    p = population((4, 3, 5), torch.float32)
    args = (p["I"], p["h"], p["C"], p["gain"], p["P"], p["b"], rule)
    calls = [lambda backend=backend: nk.mixed_apical(*args[:6], rule=rule, backend=backend)
             for backend in nk.BACKENDS]
    calls += [lambda: nk.mixed_apical_reference(*args),
              lambda: nk.mixed_local(p["I"], p["h"], None, *args[2:6], rule=rule),
              lambda: nk.mixed_local_reference(p["I"], p["h"], p["h"], *args[2:])]
    for call in calls:
        with pytest.raises(ValueError, match=rf"^rule={re.escape(repr(rule))}; allowed: "):
            call()


KEEP_TORCH_THREADS = """
import torch
torch.set_num_threads(1)
import numba_kernels as nk
x = torch.rand(64, 4096).relu()  # a parallel op first: torch's pool is running
u = torch.ones(4096)
for call in (lambda: nk.mixed_apical(x, x, u, 0.5, u, u, "raw"),
             lambda: nk.predictor_update(x, x, u.clone(), u.clone(), 0.1),
             lambda: nk.aux_add(x.clone(), x)):
    call()
    assert torch.get_num_threads() == 1, torch.get_num_threads()
print("ok")
"""


def test_the_kernels_leave_torchs_thread_count_as_set():
    # Numba's OpenMP pool, started by the first parallel kernel, reset torch's count:
    # torch.set_num_threads(1) and one kernel call left torch on every core.
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", KEEP_TORCH_THREADS], capture_output=True,
                         text=True, timeout=600, env={**os.environ, "NUMBA_NUM_THREADS": "2"})
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


NO_JIT = """
import torch
import numba_kernels as nk

g = torch.Generator().manual_seed(3)
r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
for shape in [(3, 5), (2, 3, 2, 2)]:
    u = shape[1:]
    I, h, C, P, b = r(*shape), r(*shape).relu(), r(*u), r(*u), r(*u)
    for rule in nk.RULES:
        got = nk.mixed_apical(I, h, C, 0.7, P, b, rule)
        ref = nk.mixed_apical(I, h, C, 0.7, P, b, rule, backend="torch")
        assert torch.allclose(got.used, ref.used, rtol=1e-12, atol=1e-12), rule
        assert torch.allclose(got.sums, ref.sums, rtol=1e-12), rule
    o = r(*shape)
    mean, invstd, gamma = r(shape[1]), r(shape[1]).abs() + 0.5, r(shape[1])
    for rule in nk.LOCAL_RULES:
        kw = dict(mean=mean, invstd=invstd, gamma=gamma, scale=0.5, instruction=True)
        got = nk.mixed_local(I, h, o, C, 0.7, P, b, rule, **kw)
        ref = nk.mixed_local(I, h, o, C, 0.7, P, b, rule, **kw, backend="torch")
        assert torch.allclose(got.grad, ref.grad, rtol=1e-10, atol=1e-12), rule
        assert torch.allclose(got.instruction_grad, ref.instruction_grad, rtol=1e-10,
                              atol=1e-12), rule
dst = r(4, 6)
want = dst + 2 * dst
assert torch.equal(nk.aux_add(dst, 2 * dst), want)
print("ok")
"""


def test_the_kernels_run_with_numbas_jit_disabled():
    # NUMBA_DISABLE_JIT=1 (stepping through kernels in a debugger): the kernels run as
    # Python and agree with the torch reference.
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", NO_JIT], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "NUMBA_DISABLE_JIT": "1"})
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


def test_predictor_update_parallel_form_matches_the_reference_above_its_threshold():
    # (128, 16, 16, 16): 4,096 units in 8 chunks of cpu.UNIT_CHUNK, run by the prange
    # kernel; every unit is compared, so a chunk skipped or misplaced is caught.
    shape = (128, 16, 16, 16)
    assert math.prod(shape) >= cpu.SERIAL_BELOW and math.prod(shape[1:]) >= 8 * cpu.UNIT_CHUNK
    g = torch.Generator().manual_seed(9)
    h = torch.randn(shape, generator=g, dtype=torch.float64).relu() + 0.1
    T = 1.3 * h - 0.2 + 0.05 * torch.randn(shape, generator=g, dtype=torch.float64)
    P0 = torch.randn(shape[1:], generator=g, dtype=torch.float64)
    b0 = torch.randn(shape[1:], generator=g, dtype=torch.float64)
    P1, b1, P2, b2 = P0.clone(), b0.clone(), P0.clone(), b0.clone()
    got = nk.predictor_update(h, T, P1, b1, 0.5)
    want = nk.predictor_update(h, T, P2, b2, 0.5, backend="torch")
    assert bool((P2 != P0).all()) and bool((b2 != b0).all())  # every unit moves
    torch.testing.assert_close(P1, P2, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(b1, b2, rtol=1e-12, atol=1e-14)
    for a, w in zip(got, want):
        assert math.isclose(float(a), float(w), rel_tol=1e-12)


# ---- MT-2: the per-unit quadratic predictor's step -----------------------------------------


def _quadratic_case(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    h = 0.1 + torch.rand(shape, generator=g, dtype=torch.float64)
    T = 1.3 * torch.tanh(h) - 0.2 + 0.05 * torch.randn(shape, generator=g, dtype=torch.float64)
    params = [0.3 * torch.randn(shape[1:], generator=g, dtype=torch.float64) for _ in "PQb"]
    return [t.to(dtype) for t in (h, T, *params)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(1, 5), (7, 3, 11), (6, 2, 5, 7), (128, 16, 16, 16)])
def test_quadratic_predictor_update_cpu_matches_reference(shape, dtype):
    """Serial (small) and prange (the last shape: 8 chunks of UNIT_CHUNK) forms, every unit
    compared; one example (no spread: every unit degenerate, b alone steps)."""
    h, T, P0, Q0, b0 = _quadratic_case(shape, dtype, seed=21)
    got_p, want_p = [[t.clone() for t in (P0, Q0, b0)] for _ in "ab"]
    got = nk.predictor_update(h, T, got_p[0], got_p[2], 0.5, P2=got_p[1])
    want = nk.quadratic_predictor_update_reference(h, T, want_p[0], want_p[1], want_p[2], 0.5)
    # The 2 x 2 solve amplifies the reductions' rounding (the kernel sums down the batch
    # in order, torch pairwise) by its condition number: h and h^2 are correlated.
    tol = {torch.float32: 1e-5, torch.float64: 1e-10}[dtype]
    for a, w, before in zip(got_p, want_p, (P0, Q0, b0)):
        if shape[0] > 1:
            assert bool((w != before).any())
        assert rel(a - before, w - before) < tol
    for a, w in zip(got, want):
        assert math.isclose(float(a), float(w), rel_tol=TOL[dtype])


def test_quadratic_predictor_step_at_full_rate_reaches_the_least_squares_fit():
    """Each unit's fit of T on (h, h^2, 1), as torch.linalg.lstsq gives it: from zero, one
    step at eta = 1 gives its slopes (a Newton step on the centred features); b, stepped
    from the same residual, reaches the intercept as the steps repeat (the fixed point)."""
    h, T, *_ = _quadratic_case((64, 3, 4), torch.float64, seed=22)
    P, Q, b = (torch.zeros(3, 4, dtype=torch.float64) for _ in "PQb")
    x = torch.stack([h, h.square(), torch.ones_like(h)], -1).movedim(0, -2)  # (3, 4, 64, 3)
    fit = torch.linalg.lstsq(x, T.movedim(0, -1).unsqueeze(-1)).solution[..., 0]
    nk.predictor_update(h, T, P, b, 1.0, P2=Q)
    # (normal equations against lstsq's QR: the features' condition number, squared)
    for got, want in zip((P, Q), fit.unbind(-1)):
        torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-8)
    assert float((b - fit[..., 2]).abs().min()) > 0.1  # the intercept is not there yet
    for _ in range(100):
        nk.predictor_update(h, T, P, b, 1.0, P2=Q)
    for got, want in zip((P, Q, b), fit.unbind(-1)):
        torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-8)


def test_a_bad_quadratic_term_of_the_predictor_update_is_refused_by_name():
    h, T, P, Q, b = _quadratic_case((6, 2, 5), torch.float64, seed=23)
    with pytest.raises(ValueError, match=r"P2 \(shape \(10,\).*must have shape \(2, 5\)"):
        nk.predictor_update(h, T, P, b, 0.5, P2=Q.reshape(-1))
    with pytest.raises(ValueError, match=r"P2 \(.*is written in place and must be contiguous"):
        nk.predictor_update(h, T, P, b, 0.5, P2=torch.zeros(5, 2, dtype=torch.float64).T)
