"""The CUDA kernels on numba's CUDA simulator, against the torch reference.

Run by tests/test_kernels_cuda.py in a subprocess with NUMBA_ENABLE_CUDASIM=1
(the variable must be set before ``numba.cuda`` is imported, so it cannot share a
process with tests that import the real ``numba.cuda``). With the simulator
there are no torch CUDA tensors: the kernels get numpy arrays (device arrays of
the simulator) and their results are compared with the reference on the same
data. Prints one line per case; exits non-zero on the first mismatch.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch

if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
    sys.exit("run with NUMBA_ENABLE_CUDASIM=1 (set before numba.cuda is imported)")

from numba_kernels import gpu, reference  # noqa: E402

# Small blocks keep the simulator (one python thread per CUDA thread) fast while
# still giving several blocks per row and rows that end mid-block.
TPB = 16
TOL = {np.float32: 2e-6, np.float64: 1e-12}


def close(name, got, want, tol):
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    scale = max(np.abs(want).max(), 1e-300)
    err = np.abs(got - want).max() / scale
    if not err <= tol:
        sys.exit(f"FAIL {name}: max relative error {err:.3g} > {tol:g}")


def data(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    t = {k: torch.randn(shape if k in "Ih" else shape[1:], generator=g, dtype=torch.float64)
         for k in ("I", "h", "C", "P", "b")}
    t["h"] = t["h"].relu()
    t["C"] = (0.25 * t["C"]).exp()
    return {k: v.to(torch.float32 if dtype == np.float32 else torch.float64) for k, v in t.items()}


def check_mixed(shape, dtype, rule, seed=0):
    t = data(shape, dtype, seed)
    gain = 0.7
    # The CUDA kernels compute the gradient-convention form (raw I + T): the reference's
    # anti_hebbian sign; dispatch negates gain, P and b for the hebbian one.
    ref = reference.mixed_apical_reference(t["I"], t["h"], t["C"], gain, t["P"], t["b"], rule,
                                           "anti_hebbian")
    B, N = shape[0], int(np.prod(shape[1:]))
    I, h = (t[k].reshape(B, N).numpy() for k in "Ih")
    gC = (t["C"] * gain).reshape(N).numpy()
    P, b = (t[k].reshape(N).numpy() for k in "Pb")
    out = np.full((B, N), np.nan, dtype=dtype)
    shapes = gpu.mixed_workspace_shapes(B, N, TPB)
    ws = {k: np.zeros(s) for k, s in shapes.items()}
    ws["scales"] = np.zeros(B, dtype=dtype)
    code = {"raw": gpu.RAW, "innovation": gpu.INNOVATION, "matched": gpu.MATCHED}[rule]
    gpu.mixed_apical(I, h, gC, P, b, code, out, ws["part"], ws["rows"], ws["scales"],
                     ws["tot"], tpb=TPB)
    name = f"mixed {rule} {shape} {dtype.__name__}"
    close(name + " used", out, ref.used.reshape(B, N).numpy(), TOL[dtype])
    want = [ref.ss_instruction, ref.ss_traffic, ref.ss_raw, ref.ss_innovation, ref.ss_used]
    close(name + " sums of squares", ws["tot"], [float(x) for x in want], TOL[dtype])
    print("ok", name)


def check_nan_matched(dtype, kind="nan"):
    """A NaN in one example's instruction (or, ``kind="overflow"``, a row whose sums of
    squares overflow: float64 only, the kernel squares in float64) reaches matched's
    ss_used, as in the reference (the all-zero-row exclusion must not swallow it), and
    only that row is NaN."""
    t = data((3, 10), dtype, seed=5)
    if kind == "nan":
        t["I"][1, 4] = float("nan")
    else:
        t["I"][1] *= 1e160
    ref = reference.mixed_apical_reference(t["I"], t["h"], t["C"], 0.7, t["P"], t["b"],
                                           "matched", "anti_hebbian")
    I, h = t["I"].numpy(), t["h"].numpy()
    gC = (t["C"] * 0.7).numpy()
    out = np.zeros((3, 10), dtype=dtype)
    shapes = gpu.mixed_workspace_shapes(3, 10, TPB)
    ws = {k: np.zeros(s) for k, s in shapes.items()}
    ws["scales"] = np.zeros(3, dtype=dtype)
    gpu.mixed_apical(I, h, gC, t["P"].numpy(), t["b"].numpy(), gpu.MATCHED, out, ws["part"],
                     ws["rows"], ws["scales"], ws["tot"], tpb=TPB)
    name = f"matched {kind} row {dtype.__name__}"
    if not (np.isnan(ws["tot"][4]) and np.isnan(float(ref.ss_used))):
        sys.exit(f"FAIL {name}: ss_used {ws['tot'][4]} (reference {float(ref.ss_used)})")
    if not np.array_equal(np.isnan(out), ref.used.isnan().numpy()):
        sys.exit(f"FAIL {name}: NaN positions differ from the reference's")
    keep = [0, 2]  # the clean rows
    close(name + " clean rows", out[keep], ref.used.numpy()[keep], TOL[dtype])
    print("ok", name)


def check_local(shape, dtype, rule, norm, seed=6):
    """``mixed_local`` through the dispatcher's CUDA branch (simulator) against the reference."""
    import numba_kernels as nk

    t = data(shape, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    like = t["I"]
    o = torch.randn(shape, generator=g, dtype=torch.float64).to(like)
    Ch = shape[1]
    stats = {}
    if norm:
        stats = dict(mean=torch.randn(Ch, generator=g, dtype=torch.float64).to(like),
                     invstd=torch.rand(Ch, generator=g, dtype=torch.float64).add(0.5).to(like),
                     gamma=torch.randn(Ch, generator=g, dtype=torch.float64).to(like))
    args = (t["I"], t["h"], o, t["C"], 0.7, t["P"], t["b"], rule)
    kw = dict(scale=0.5, instruction=True, masked=True, **stats)
    got = nk.mixed_local(*args, **kw)
    want = nk.mixed_local(*args, backend="torch", **kw)
    name = f"local {rule} {shape} {dtype.__name__} norm={norm}"
    for field in ("grad", "instruction_grad", "masked"):
        close(f"{name} {field}", getattr(got, field), getattr(want, field), TOL[dtype])
    lean = nk.mixed_local(*args, scale=0.5, **stats)  # the optional outputs not written
    assert lean.instruction_grad is None and lean.masked is None
    close(name + " grad alone", lean.grad, want.grad, TOL[dtype])
    if norm:
        close(name + " dgamma", got.dgamma, want.dgamma, TOL[dtype] * 10)
        close(name + " dbeta", got.dbeta, want.dbeta, TOL[dtype] * 10)
    close(name + " sums", [float(x) for x in got[5:]], [float(x) for x in want[5:]], TOL[dtype])
    print("ok", name)


def check_local_mt2(shape, dtype, form, rule, norm, sign, seed=7):
    """MT-2's forms of ``mixed_local`` through the dispatcher's CUDA branch: the per-unit
    quadratic predictor (P2) and a given traffic and prediction, against the reference."""
    import numba_kernels as nk

    t = data(shape, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    like = t["I"]

    def r(*s):
        return torch.randn(*s, generator=g, dtype=torch.float64).to(like)

    o, P2, T, prediction = r(*shape), 0.2 * r(*shape[1:]), r(*shape), r(*shape)
    Ch = shape[1]
    stats = dict(mean=r(Ch), invstd=r(Ch).abs() + 0.5, gamma=r(Ch)) if norm else {}
    kw = dict(scale=0.5, instruction=True, masked=True, sign=sign, **stats)
    if form == "quadratic":
        args = (t["I"], t["h"], o, t["C"], 0.7, t["P"], t["b"], rule)
        got = nk.mixed_local(*args, P2=P2, **kw)
        want = nk.mixed_local(*args, P2=P2, backend="torch", **kw)
    else:
        args = (t["I"], t["h"], o, T, prediction, rule)
        got = nk.mixed_traffic_local(*args, **kw)
        want = nk.mixed_traffic_local(*args, backend="torch", **kw)
    name = f"local {form} {rule} {sign} {shape} {dtype.__name__} norm={norm}"
    for field in ("grad", "instruction_grad", "masked"):
        close(f"{name} {field}", getattr(got, field), getattr(want, field), TOL[dtype])
    if norm:
        close(name + " dgamma", got.dgamma, want.dgamma, TOL[dtype] * 10)
        close(name + " dbeta", got.dbeta, want.dbeta, TOL[dtype] * 10)
    close(name + " sums", [float(x) for x in got[5:]], [float(x) for x in want[5:]], TOL[dtype])
    print("ok", name)


def check_predictor(shape, dtype, seed=1):
    t = data(shape, dtype, seed)
    T = t["I"]  # any (B, *U) tensor serves as the traffic to predict
    P_ref, b_ref = t["P"].clone(), t["b"].clone()
    stats = reference.predictor_update_reference(t["h"], T, P_ref, b_ref, 0.3)
    B, N = shape[0], int(np.prod(shape[1:]))
    P, b = (t[k].reshape(N).numpy().copy() for k in "Pb")
    shapes = gpu.predictor_workspace_shapes(N, TPB)
    part, tot = np.zeros(shapes["part"]), np.zeros(shapes["tot"])
    gpu.predictor_update(t["h"].reshape(B, N).numpy(), T.reshape(B, N).numpy(), P, b, 0.3,
                         part, tot, tpb=TPB)
    name = f"predictor {shape} {dtype.__name__}"
    close(name + " P", P, P_ref.reshape(N).numpy(), TOL[dtype])
    close(name + " b", b, b_ref.reshape(N).numpy(), TOL[dtype])
    close(name + " sums of squares", tot, [float(x) for x in stats], TOL[dtype])
    print("ok", name)


def check_quadratic_predictor(shape, dtype, seed=1):
    """MT-2's quadratic predictor step against its reference."""
    t = data(shape, dtype, seed)
    T = t["I"]  # any (B, *U) tensor serves as the traffic to predict
    # h spread over [0.1, 1.1] (not ReLU's zeros): the 2 x 2 solve is well conditioned,
    # so the two reduction orders agree to rounding
    t["h"] = (0.1 + torch.rand(shape, generator=torch.Generator().manual_seed(seed),
                               dtype=torch.float64)).to(T)
    P_ref, Q_ref, b_ref = t["P"].clone(), 0.5 * t["C"], t["b"].clone()
    B, N = shape[0], int(np.prod(shape[1:]))
    P, Q, b = (x.reshape(N).numpy().copy() for x in (P_ref, Q_ref, b_ref))
    stats = reference.quadratic_predictor_update_reference(t["h"], T, P_ref, Q_ref, b_ref, 0.3)
    shapes = gpu.predictor_workspace_shapes(N, TPB)
    part, tot = np.zeros(shapes["part"]), np.zeros(shapes["tot"])
    gpu.quadratic_predictor_update(t["h"].reshape(B, N).numpy(), T.reshape(B, N).numpy(), P,
                                   Q, b, 0.3, part, tot, tpb=TPB)
    name = f"quadratic predictor {shape} {dtype.__name__}"
    for label, got, want in (("P", P, P_ref), ("P2", Q, Q_ref), ("b", b, b_ref)):
        close(f"{name} {label}", got, want.reshape(N).numpy(), TOL[dtype] * 10)
    close(name + " sums of squares", tot, [float(x) for x in stats], TOL[dtype])
    print("ok", name)


def check_add(n, dtype, seed=2):
    rng = np.random.default_rng(seed)
    dst, src = rng.standard_normal(n).astype(dtype), rng.standard_normal(n).astype(dtype)
    want = dst + src
    gpu.aux_add(dst, src, tpb=TPB)
    if not np.array_equal(dst, want):
        sys.exit(f"FAIL aux_add {n} {dtype.__name__}: differs from dst + src")
    print("ok", f"aux_add {n} {dtype.__name__}")


def main():
    for dtype in (np.float32, np.float64):
        # (B, C, H, W) with N = 70 over 16-thread blocks; a 1-D (B, C, L) with one
        # example; a flat (B, N) whose batch is not a multiple of anything.
        for shape in ((3, 2, 5, 7), (1, 3, 11), (5, 9)):
            for rule in ("raw", "matched", "innovation"):
                check_mixed(shape, dtype, rule)
            check_predictor(shape, dtype)
            check_quadratic_predictor(shape, dtype)
        check_add(37, dtype)
    # matched with an all-zero raw row: that example's signal is zero, not NaN
    check_zero_row()
    for dtype in (np.float32, np.float64):
        check_nan_matched(dtype)
    check_nan_matched(np.float64, "overflow")
    check_exact_predictor()
    check_dispatch_cuda_branch()
    # mixed_local, through the dispatcher's CUDA branch on 16-thread blocks: (B, C, H, W)
    # with slabs of 35 over the blocks, one example, a flat (B, C) population (slabs of
    # one unit); with and without a norm
    import functools

    gpu.mixed_local = functools.partial(gpu.mixed_local, tpb=TPB)
    for dtype in (np.float32, np.float64):
        for shape in ((3, 2, 5, 7), (1, 3, 11), (5, 9)):
            for rule in ("none", "raw", "matched", "innovation"):
                for norm in (True, False):
                    if shape == (3, 2, 5, 7) or (norm and rule not in ("none", "raw")):
                        check_local(shape, dtype, rule, norm)
    # MT-2's forms: every rule on the 4-D population (both signs, with and without a
    # norm between them); one example and a flat population under matched
    for dtype in (np.float32, np.float64):
        for form in ("quadratic", "given"):
            for rule, sign in (("none", "hebbian"), ("raw", "anti_hebbian"),
                               ("matched", "hebbian"), ("innovation", "anti_hebbian")):
                check_local_mt2((3, 2, 5, 7), dtype, form, rule, sign == "hebbian", sign)
            for shape in ((1, 3, 11), (5, 9)):
                check_local_mt2(shape, dtype, form, "matched", True, "anti_hebbian")


def check_zero_row():
    shape = (2, 6)
    t = data(shape, np.float64, 3)
    t["I"][0] = 0.0
    t["h"][0] = 0.0
    ref = reference.mixed_apical_reference(t["I"], t["h"], t["C"], 0.7, t["P"], t["b"], "matched",
                                           "anti_hebbian")
    out = np.full(shape, np.nan)
    ws = {k: np.zeros(s) for k, s in gpu.mixed_workspace_shapes(2, 6, TPB).items()}
    gpu.mixed_apical(t["I"].numpy(), t["h"].numpy(), (t["C"] * 0.7).numpy(), t["P"].numpy(),
                     t["b"].numpy(), gpu.MATCHED, out, ws["part"], ws["rows"], ws["scales"],
                     ws["tot"], tpb=TPB)
    if not (np.all(out[0] == 0.0) and np.isfinite(out).all()):
        sys.exit(f"FAIL matched zero row: {out[0]}")
    close("matched zero row", out, ref.used.numpy(), 1e-12)
    print("ok matched zero row")


def check_exact_predictor():
    # P = g*C, b = 0 predicts the traffic exactly: innovation is the instruction, bit for bit.
    shape = (3, 20)
    for dtype in (np.float32, np.float64):
        t = data(shape, dtype, 4)
        gC = (t["C"] * 0.7).numpy()
        I, h = t["I"].numpy(), t["h"].numpy()
        out = np.full(shape, np.nan, dtype=dtype)
        ws = {k: np.zeros(s) for k, s in gpu.mixed_workspace_shapes(3, 20, TPB).items()}
        gpu.mixed_apical(I, h, gC, gC.copy(), np.zeros_like(gC), gpu.INNOVATION, out,
                         ws["part"], ws["rows"], np.zeros(3, dtype=dtype), ws["tot"], tpb=TPB)
        if not np.array_equal(out, I):
            sys.exit(f"FAIL exact predictor {dtype.__name__}: innovation != instruction")
        print("ok exact predictor", dtype.__name__)


def check_dispatch_cuda_branch():
    # The dispatcher's CUDA branch (workspace, argument order, reshapes, results) with the
    # simulator standing in for the GPU: CPU tensors, numpy views for device arrays.
    import contextlib

    import numba_kernels as nk
    from numba_kernels import dispatch

    dispatch._form = lambda backend, device: "torch" if backend == "torch" else "cuda"
    dispatch._cuda_launch = lambda device: contextlib.nullcontext(0)  # stream 0
    dispatch._device_array = lambda t: t.numpy()
    for dtype in (np.float32, np.float64):
        tol = TOL[dtype]
        t = data((3, 2, 5, 7), dtype, 5)
        for rule, sign in (("raw", "hebbian"), ("matched", "hebbian"),
                           ("innovation", "hebbian"), ("raw", "anti_hebbian")):
            got = nk.mixed_apical(t["I"], t["h"], t["C"], 0.7, t["P"], t["b"], rule, sign=sign)
            want = nk.mixed_apical(t["I"], t["h"], t["C"], 0.7, t["P"], t["b"], rule,
                                   sign=sign, backend="torch")
            close(f"dispatch {rule} used", got.used, want.used, tol)
            close(f"dispatch {rule} sums", got.sums.tolist(), want.sums.tolist(), tol)
            # per-unit tensors that are not contiguous (a transposed C: C * g keeps its
            # strides) are made contiguous before the flat views the kernels take
            Ct = t["C"].transpose(1, 2).contiguous().transpose(1, 2)
            got = nk.mixed_apical(t["I"], t["h"], Ct, 0.7, t["P"], t["b"], rule, sign=sign)
            close(f"dispatch {rule} transposed C", got.used, want.used, tol)
        P1, b1, P2, b2 = t["P"].clone(), t["b"].clone(), t["P"].clone(), t["b"].clone()
        s1 = nk.predictor_update(t["h"], t["I"], P1, b1, 0.3)
        s2 = nk.predictor_update(t["h"], t["I"], P2, b2, 0.3, backend="torch")
        close("dispatch predictor P", P1, P2, tol)
        close("dispatch predictor b", b1, b2, tol)
        close("dispatch predictor sums", [float(x) for x in s1], [float(x) for x in s2], tol)
        dst, src = t["I"].clone(), t["h"].transpose(1, 2).contiguous().transpose(1, 2)
        want = t["I"] + src
        nk.aux_add(dst, src)
        close("dispatch aux_add", dst, want, 0.0)
        print("ok dispatch cuda branch", dtype.__name__)


if __name__ == "__main__":
    main()
    print("all simulator checks passed")
