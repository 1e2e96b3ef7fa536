"""Fused element-wise kernels for the learning rules: the math once, in three forms.

Each kernel will exist as a CUDA kernel (numba-cuda, zero-copy on torch CUDA
tensors), a CPU kernel (numba njit, parallel, zero-copy on CPU tensors) and a
plain torch reference, behind one dispatcher that picks by the tensors'
device; tests compare the first two with the reference (CUDA on the simulator,
NUMBA_ENABLE_CUDASIM=1). The first kernels arrive with the mixed-apical-traffic
rules (DESIGN section 5): traffic / raw / innovation in one fused pass with
the sums of squares and per-example norms, the predictor's per-unit
reductions, and ``aux_add`` (dst += src) for the CfC trainer.
"""
