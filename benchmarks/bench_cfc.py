"""Our CfC sequence forward + backward against ncps's CfC of the same size, in one process.

Batch 32 x 50 steps x 20 inputs -> 64 units, backbone 128 units (ncps's default), default
mode, CPU, one thread. Timed: outputs of every step, a sum, backward into every parameter and
the input. The implementations of ``lab.models.cfc.CfC`` (DESIGN section 7) run side by side:

- ``loop``: hoisted input product + fused heads, per-step torch autograd;
- ``function``: one autograd Function, hand-written backward through time in torch ops;
- ``numba``: the same Function with each direction's time loop compiled (element-wise work
  fused, per-step products on BLAS).

Calls are interleaved round-robin so machine noise hits every variant alike; the ratio of
medians ncps / ours is printed (> 1: ours faster; the target is >= 1.5 for the default).

    python benchmarks/bench_cfc.py [--rounds 30] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lab.device import configure_process
from lab.models.cfc import CfC, load_ncps

BATCH, STEPS, INPUTS, UNITS = 32, 50, 20, 64


def _step(model, x):
    def run():
        model.zero_grad(set_to_none=True)
        x.grad = None
        out, _ = model(x)
        out.sum().backward()
    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    configure_process(args.threads)  # threads and the allocator policy, as runs
    torch.manual_seed(0)
    x = torch.randn(BATCH, STEPS, INPUTS, requires_grad=True)
    variants = {}
    ours = {impl: CfC(INPUTS, UNITS, impl=impl) for impl in ("loop", "function", "numba")}
    try:
        from ncps.torch import CfC as NcpsCfC
    except ImportError:
        print("ncps is not installed: timing ours only (pip install ncps==1.0.1 to compare)")
    else:
        theirs = NcpsCfC(INPUTS, UNITS)
        for model in ours.values():
            load_ncps(model, theirs)
        variants["ncps"] = _step(theirs, x)
    variants.update({f"ours/{impl}": _step(model, x) for impl, model in ours.items()})

    times = {name: [] for name in variants}
    for run in variants.values():  # warm-up: numba compiles (or loads its cache) here
        run(), run()
    for _ in range(args.rounds):
        for name, run in variants.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)

    print(f"CfC forward+backward: batch {BATCH}, {STEPS} steps, {INPUTS} inputs -> {UNITS} "
          f"units, CPU, {torch.get_num_threads()} thread(s), median of {args.rounds} rounds")
    base = statistics.median(times["ncps"]) if "ncps" in times else None
    for name, ts in times.items():
        med = statistics.median(ts)
        ratio = f"  ncps/this = {base / med:.2f}x" if base else ""
        print(f"  {name:15s} {med * 1e3:7.2f} ms{ratio}")
    if base:
        best = base / statistics.median(times["ours/numba"])
        print(f"target: ours (numba, the CPU default) >= 1.5x ncps: {best:.2f}x, "
              f"{'met' if best >= 1.5 else 'NOT met'}")


if __name__ == "__main__":
    main()
