"""numba_kernels CUDA forms: on the simulator, compiled to PTX for sm_90, and on a real GPU.

The simulator needs NUMBA_ENABLE_CUDASIM=1 before ``numba.cuda`` is imported and
the PTX compile needs it unset, so both run in subprocesses. The real-GPU tests
skip without ``torch.cuda.is_available()`` (``benchmarks/gpu_check.sh`` runs them).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def test_cuda_kernels_on_the_simulator_match_the_reference():
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "kernels_cudasim_check.py")],
                          env=_env(NUMBA_ENABLE_CUDASIM="1"), capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "all simulator checks passed" in proc.stdout
    # every kernel family ran, in both dtypes
    for what in ("mixed raw", "mixed matched", "mixed innovation", "predictor", "aux_add",
                 "local raw", "local matched", "local innovation", "local quadratic",
                 "local given", "quadratic predictor"):
        for dtype in ("float32", "float64"):
            assert any(line.startswith(f"ok {what}") and dtype in line
                       for line in proc.stdout.splitlines()), (what, dtype)


PTX_SCRIPT = """
from numba import cuda
from numba_kernels import gpu
kernels = gpu.kernels(gpu.TPB)
for dtype in ("float32", "float64"):
    for name, sig in gpu.ptx_signatures(dtype).items():
        ptx, _ = cuda.compile_ptx(kernels[name].py_func, sig, cc=(9, 0))
        assert ".target sm_90" in ptx and ".entry" in ptx, name
        print("ptx", name, dtype, len(ptx))
print("kernels", len(gpu.ptx_signatures("float32")))
"""


def test_every_cuda_kernel_compiles_to_ptx_for_sm90():
    proc = subprocess.run([sys.executable, "-c", PTX_SCRIPT], env=_env(), capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # (numba.cuda stays out of this process: a simulator elsewhere needs it unimported)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("ptx ")]
    count = int(proc.stdout.split("kernels ")[-1])
    assert count == 11 and len(lines) == 2 * count, proc.stdout  # with MT-2's quadratic


gpu_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
SHAPES = [(1, 7), (13, 3, 29), (5, 3, 7, 9), (128, 16, 32, 32), (3, 70001)]


def _population(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    u = shape[1:]
    p = dict(I=torch.randn(shape, generator=g, dtype=dtype),
             h=torch.randn(shape, generator=g, dtype=dtype).relu(),
             C=(0.25 * torch.randn(u, generator=g, dtype=dtype)).exp(), gain=0.7,
             P=torch.randn(u, generator=g, dtype=dtype),
             b=0.1 * torch.randn(u, generator=g, dtype=dtype))
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in p.items()}


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", SHAPES)
def test_gpu_mixed_apical_matches_reference_and_repeats(shape, dtype):
    import numba_kernels as nk

    tol = 1e-5 if dtype == torch.float32 else 1e-12
    p = _population(shape, dtype)
    for rule in nk.RULES:
        got = nk.mixed_apical(**p, rule=rule)
        want = nk.mixed_apical(**p, rule=rule, backend="torch")
        assert got.used.is_cuda and got.ss_used.is_cuda
        err = (got.used - want.used).abs().max() / want.used.abs().max()
        assert float(err) < tol, rule
        for k in ("ss_used", "ss_instruction", "ss_raw", "ss_innovation", "ss_traffic"):
            assert math.isclose(float(getattr(got, k)), float(getattr(want, k)), rel_tol=tol)
        again = nk.mixed_apical(**p, rule=rule)
        assert torch.equal(again.used, got.used) and torch.equal(again.ss_used, got.ss_used)


@gpu_only
def test_gpu_exact_predictor_and_side_stream():
    import numba_kernels as nk

    p = _population((64, 8, 16, 16), torch.float32)
    p["P"] = p["gain"] * p["C"]
    p["b"] = torch.zeros_like(p["b"])
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        out = nk.mixed_apical(**p, rule="innovation")
    stream.synchronize()
    assert torch.equal(out.used, p["I"])


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gpu_predictor_update_and_aux_add(dtype):
    import numba_kernels as nk

    tol = 1e-5 if dtype == torch.float32 else 1e-12
    p = _population((33, 4, 9, 9), dtype)
    T = 1.3 * p["h"] + 0.1 * p["I"]
    P1, b1, P2, b2 = p["P"].clone(), p["b"].clone(), p["P"].clone(), p["b"].clone()
    s1 = nk.predictor_update(p["h"], T, P1, b1, 0.2)
    s2 = nk.predictor_update(p["h"], T, P2, b2, 0.2, backend="torch")
    assert float((P1 - P2).abs().max() / (P2 - p["P"]).abs().max()) < tol
    assert float((b1 - b2).abs().max() / (b2 - p["b"]).abs().max()) < tol
    for a, w in zip(s1, s2):
        assert math.isclose(float(a), float(w), rel_tol=tol)
    dst, src = p["I"].clone(), p["h"]
    want = dst + src
    assert nk.aux_add(dst, src) is dst and torch.equal(dst, want)


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(1, 3, 7), (13, 3, 29), (128, 16, 32, 32)])
def test_gpu_mixed_local_matches_reference_and_repeats(shape, dtype):
    import numba_kernels as nk

    tol = 1e-5 if dtype == torch.float32 else 1e-12
    p = _population(shape, dtype)
    g = torch.Generator().manual_seed(9)
    o = torch.randn(shape, generator=g, dtype=dtype).cuda()
    ch = shape[1]
    stats = dict(mean=torch.randn(ch, dtype=dtype).cuda(),
                 invstd=torch.rand(ch, dtype=dtype).add(0.5).cuda(),
                 gamma=torch.randn(ch, dtype=dtype).cuda())
    args = (p["I"], p["h"], o, p["C"], p["gain"], p["P"], p["b"])
    kw = dict(scale=0.5, instruction=True, masked=True, **stats)
    for rule in nk.LOCAL_RULES:
        got = nk.mixed_local(*args, rule, **kw)
        want = nk.mixed_local(*args, rule, backend="torch", **kw)
        assert got.grad.is_cuda
        for field in ("grad", "instruction_grad", "masked", "dgamma"):
            a, w = getattr(got, field), getattr(want, field)
            assert float((a - w).abs().max() / w.abs().max()) < tol, (rule, field)
        again = nk.mixed_local(*args, rule, **kw)
        assert torch.equal(again.grad, got.grad) and torch.equal(again.dbeta, got.dbeta)
