"""Compile every CPU kernel once into numba's on-disk cache: ``python -m numba_kernels.warm``.

Each training run is a new process (a papermill kernel), and numba compiles a kernel
the first time a process calls it unless its cache holds it. ``make install`` runs
this module so that the first runs of a sweep (two workers compiling the same kernels
at once, on a fresh clone) load them instead: about a minute of compiling on a
2-core machine, once per checkout. It calls every CPU entry point at a size on each
side of the serial/parallel threshold, every rule, with and without a norm, and each
set of ``mixed_local`` outputs (MT-2's quadratic and given-traffic forms too); float32 by
default (what training uses), ``--float64`` adds the double-precision forms the tests use.
"""

from __future__ import annotations

import argparse
import time

import torch

from . import cpu
from .dispatch import (
    LOCAL_RULES,
    RULES,
    aux_add,
    mixed_apical,
    mixed_local,
    mixed_traffic_local,
    predictor_update,
)


def warm(dtype: torch.dtype = torch.float32) -> None:
    """Call every CPU kernel form for ``dtype`` once (results discarded)."""
    gen = torch.Generator().manual_seed(0)
    for shape in [(2, 3, 2, 2), (64, 8, 8, 8)]:  # (B, C, H, W): serial, then parallel
        B, C = shape[:2]
        x = [torch.randn(shape, generator=gen, dtype=dtype) for _ in range(3)]
        u = [torch.randn(shape[1:], generator=gen, dtype=dtype) for _ in range(3)]
        norm = dict(mean=torch.randn(C, dtype=dtype), invstd=torch.rand(C, dtype=dtype) + 0.5,
                    gamma=torch.randn(C, dtype=dtype))
        for rule in LOCAL_RULES:
            for kw in ({}, norm):
                for inst, masked in ((False, False), (True, False), (False, True),
                                     (True, True)):
                    mixed_local(x[0], x[1].relu(), x[2], u[0], 0.5, u[1], u[2], rule,
                                instruction=inst, masked=masked, **kw)
                    # MT-2's forms: the quadratic predictor, and T / prediction given
                    mixed_local(x[0], x[1].relu(), x[2], u[0], 0.5, u[1], u[2], rule,
                                instruction=inst, masked=masked, P2=u[0], **kw)
                    mixed_traffic_local(x[0], x[1].relu(), x[2], x[1], x[2], rule,
                                        instruction=inst, masked=masked, **kw)
        flat = [t.reshape(B, -1) for t in x]  # (B, N)
        unit = [t.reshape(-1) for t in u]  # (N,)
        for rule in RULES:
            mixed_apical(flat[0], flat[1], unit[0], 0.5, unit[1], unit[2], rule)
            mixed_apical(flat[0], flat[1], unit[0], 0.5, unit[1], unit[2], rule,
                         out=torch.empty_like(flat[0]))
        predictor_update(flat[1], flat[0], unit[1].clone(), unit[2].clone(), 0.1)
        predictor_update(flat[1], flat[0], unit[1].clone(), unit[2].clone(), 0.1,
                         P2=unit[0].clone())
        aux_add(flat[0].clone(), flat[1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m numba_kernels.warm", description=__doc__
                                     .splitlines()[0])
    parser.add_argument("--float64", action="store_true",
                        help="also compile the float64 forms (the test suite uses them)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    for dtype in (torch.float32, torch.float64) if args.float64 else (torch.float32,):
        warm(dtype)
    print(f"numba kernels compiled or loaded from the cache in "
          f"{time.perf_counter() - start:.0f} s (serial below {cpu.SERIAL_BELOW} elements)")


if __name__ == "__main__":
    main()
