#!/usr/bin/env bash
# numba_kernels on a real GPU, in one go: the CUDA kernel tests, then the kernel benchmark
# on CUDA tensors (float32 and float64), printing the figures for the README.
#
#   bash benchmarks/gpu_check.sh            # from the repository root, on a GPU machine
#
# Uses .venv if it exists (else python3). Installs nothing beyond the project's own
# `pip install -e .[test]` (numba-cuda[cu13] comes with the `test` extra), and only when
# numba_kernels, numba-cuda or pytest cannot be imported. torch must already be a CUDA build
# (the Makefile's TORCH_SPEC picks the wheel); the script stops if torch sees no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python

# The GPU first: on a machine without one, stop before installing anything.
"$PY" -c 'import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} sees no CUDA GPU: install a CUDA build of torch first")'

if ! "$PY" -c 'import numba_kernels, numba.cuda, pytest' 2>/dev/null; then
    "$PY" -m pip install -q -e '.[test]'
fi

"$PY" - <<'EOF'
import torch
from numba import cuda
print("torch", torch.__version__, "on", torch.cuda.get_device_name(0))
print("numba-cuda sees:", cuda.gpus[0].name, "cc", cuda.gpus[0].compute_capability)
EOF

echo "== CUDA kernel tests (simulator, PTX, and the real-GPU tests that skip elsewhere)"
# -rs lists any skip: on a GPU machine none of these should skip.
"$PY" -m pytest -q -rs tests/test_kernels_cuda.py tests/test_kernels.py

echo "== benchmark, CUDA tensors"
for dtype in float32 float64; do
    "$PY" benchmarks/bench_kernels.py --device cuda --dtype "$dtype" --rounds 50
done
