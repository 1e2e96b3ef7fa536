"""numba_kernels speed: fused mixed-apical pass and aux_add against torch, as ratios in one run.

Populations of the 2-D ResNet-20 (width 16) at batch 128 on CIFAR shapes:
(128, 16, 32, 32), (128, 32, 16, 16), (128, 64, 8, 8). For each, rounds are
interleaved (every contender once per round, so machine noise hits all alike,
in an order shuffled every round; see ``_rounds``), and medians of the rounds
are compared:

- speedup: ``mixed_apical`` (fused kernel, allocating its output as the callers
  do) against the torch reference written naturally (``backend="torch"``, every
  intermediate allocated). Target >= 3x. (Timed in rounds of their own, so the
  reference's allocations do not disturb the bandwidth rounds.)
- bandwidth, streaming (the target, DESIGN section 10: "the machine's streaming
  bandwidth (a torch out= add of the same size)"): the fused kernel writing into a
  preallocated ``out=`` moves, at least, I and h in and the used signal out
  (3 * B*N * itemsize) plus C, P, b (3 * N * itemsize); its GB/s over those bytes
  against ``torch.add(a, b, out=c)`` over the same B*N (the same 3 arrays). As in
  STREAM, the arrays come from main memory: each contender cycles through enough
  copies of its arrays (at least 4x the last-level cache in all) that every call
  finds its own out of cache, with the population sizes unchanged and nothing else
  disturbed (the Python code of both stays warm, as in a training step, where a
  population's h was written by the forward long before). Target >= 0.8. Matched
  re-reads each example's row for its second pass from cache (L2), not from
  memory, so its bytes are counted the same. On CPU the raw kernel is also timed
  alone on numpy views (no dispatch), to show the Python overhead.
- bandwidth in cache (no target): the same comparison with one set of arrays
  used over and over, so both run from L2/L3 (6-25 MB per population here). There
  the add moves 150-250 GB/s and the kernel's arithmetic (about 8 vector
  operations per element against the add's one) and its Python dispatch show.
- ``aux_add`` (dst += src, 3 * itemsize per element) against ``Tensor.add_``:
  bandwidth ratio, target >= 0.8.
- ``predictor_update`` against its torch reference (no target; for the bill).

Threads: numba and torch are given the same count (``--threads``, default
``NUMBA_NUM_THREADS``), printed in the header.

    python benchmarks/bench_kernels.py [--quick] [--rounds 30] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import time
from pathlib import Path

import numba
import numpy as np
import torch

import numba_kernels as nk
from lab.cli import positive_int
from lab.device import configure_process
from numba_kernels import cpu

SHAPES = [(128, 16, 32, 32), (128, 32, 16, 16), (128, 64, 8, 8)]
QUICK_SHAPES = [(16, 16, 16, 16), (16, 64, 8, 8)]
MINIMA: dict = {}  # fastest round of the latest _rounds call, by contender


def _timer(device):
    if device.type == "cuda":
        def now():
            torch.cuda.synchronize(device)
            return time.perf_counter()
        return now
    return time.perf_counter


def _rounds(contenders: dict, rounds: int, now, before=None) -> dict:
    """Median seconds of each contender, timed in rounds after one warm-up call each.

    Every round calls each contender once, in an order shuffled afresh (seeded):
    torch and numba each run their own OpenMP pool, whose threads spin on the cores
    for a while after a parallel call, so whichever contender follows the other
    library's call shares the cores with those spinning threads. In a fixed order the
    kernel after the add paid that every round (10 % of its bandwidth at the largest
    population here) and the add after the last kernel likewise; shuffled, each
    contender pays it as often as the others.
    The fastest round of each is kept too (``MINIMA``): on a shared machine the
    medians carry other people's load; the minima show what the code can do.
    ``before`` (untimed) runs ahead of every timed call.
    """
    for fn in contenders.values():
        fn()
    times = {name: [] for name in contenders}
    order, shuffle = list(contenders.items()), random.Random(0).shuffle
    for _ in range(rounds):
        shuffle(order)
        for name, fn in order:
            if before is not None:
                before()
            t0 = now()
            fn()
            times[name].append(now() - t0)
    MINIMA.update({name: min(ts) for name, ts in times.items()})
    return {name: statistics.median(ts) for name, ts in times.items()}


def last_level_cache(device) -> int:
    """Bytes of the last-level cache (the GPU's L2 on CUDA); 64 MiB when unknown."""
    if device.type == "cuda":
        return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20)
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip()
        sizes.append(int(text[:-1]) << {"K": 10, "M": 20}[text[-1]] if text[-1] in "KM"
                     else int(text))
    return max(sizes, default=64 << 20)


class Rotation:
    """Copies of one contender's arrays, taken in turn: call n uses copy n % len.

    ``Rotation.streaming`` makes enough copies to hold at least 4x the last-level
    cache (STREAM's rule): by the time a copy comes round again, everything it holds
    has left the caches. One copy is the in-cache case. ``like`` (a list as long as
    the copies) is taken in the same turn instead: numpy views of the same copies.
    """

    def __init__(self, sets: list):
        self.sets, self.n = sets, 0

    @classmethod
    def streaming(cls, make, set_bytes: int, device) -> Rotation:
        return cls([make() for _ in range(max(2, -(-4 * last_level_cache(device)
                                                   // set_bytes)))])

    def __call__(self, like=None):
        self.n += 1
        sets = self.sets if like is None else like
        return sets[self.n % len(sets)]


def bench_population(shape, dtype, device, rounds, now):
    g = torch.Generator().manual_seed(0)
    u = shape[1:]
    rand = lambda s: torch.randn(s, generator=g, dtype=dtype).to(device)  # noqa: E731
    units = dict(C=(0.25 * rand(u)).exp(), P=rand(u), b=rand(u), gain=0.7)
    numel, n_units = math.prod(shape), math.prod(u)
    item = torch.empty((), dtype=dtype).element_size()
    B = shape[0]

    def population():
        # zeros, not empty: the add's output pages are touched (rand), so the kernel's must be
        # too, or its first pass through each copy pays the page faults (a training
        # step's output comes from memory the allocator keeps, already faulted in)
        out = torch.zeros(shape, dtype=dtype, device=device)
        return dict(I=rand(shape), h=rand(shape).relu(), out=out)

    def contenders(pop, adds):
        # Every kernel call and every add takes its arrays from pop() / adds().
        bw = {"add_out": lambda: (lambda a: torch.add(a[0], a[1], out=a[2]))(adds())}
        for rule in nk.RULES:
            bw[f"out_{rule}"] = lambda r=rule: nk.mixed_apical(**pop(), **units, rule=r)
        if device.type == "cpu":
            # The raw kernel alone on numpy views, without dispatch.py's checks and
            # tensor wrapping: splits the gap to add(out=) into kernel and Python.
            gain = np.dtype(str(dtype).split(".")[1]).type(units["gain"])
            per_unit = [units[k].numpy().ravel() for k in ("C", "P", "b")]

            views = [[p[k].numpy().reshape(B, -1) for k in ("I", "h", "out")]
                     for p in pop.sets]

            def kernel_raw():
                I_, h_, o_ = pop(like=views)
                cpu.mixed_apical(I_, h_, per_unit[0], gain, per_unit[1], per_unit[2],
                                 cpu.RAW, o_)
            bw["kernel_raw"] = kernel_raw
        return bw

    # The speedup rounds: one population, allocating as the callers do. Timed in rounds
    # of their own, so the reference's allocations do not disturb the bandwidth rounds.
    one = population()
    speed = {}
    for rule in nk.RULES:
        speed[f"ref_{rule}"] = lambda r=rule: nk.mixed_apical(
            one["I"], one["h"], **units, rule=r, backend="torch")
        speed[f"fused_{rule}"] = lambda r=rule: nk.mixed_apical(
            one["I"], one["h"], **units, rule=r)
    med = _rounds(speed, rounds, now)
    best = dict(MINIMA)
    # Streaming: every call finds its arrays out of cache (the target).
    set_bytes = 3 * numel * item
    pops = Rotation.streaming(population, set_bytes, device)
    adds = Rotation.streaming(lambda: [rand(shape) for _ in range(3)], set_bytes, device)
    stream = _rounds(contenders(pops, adds), rounds, now)
    best.update(MINIMA)
    # In cache: one set of arrays each, over and over.
    cached = _rounds(contenders(Rotation(pops.sets[:1]), Rotation(adds.sets[:1])), rounds, now)
    del pops, adds

    kernel_bytes = (3 * numel + 3 * n_units) * item

    def ratio(times, name):  # kernel GB/s over its bytes / add GB/s over 3 arrays
        return kernel_bytes / times[name] / (set_bytes / times["add_out"])

    rows = []
    for rule in nk.RULES:
        rows.append(dict(shape=shape, rule=rule, ref_ms=med[f"ref_{rule}"] * 1e3,
                         fused_ms=med[f"fused_{rule}"] * 1e3,
                         out_ms=stream[f"out_{rule}"] * 1e3,
                         speedup=med[f"ref_{rule}"] / med[f"fused_{rule}"],
                         gbs=kernel_bytes / stream[f"out_{rule}"] / 1e9,
                         add_gbs=set_bytes / stream["add_out"] / 1e9,
                         bw_ratio=ratio(stream, f"out_{rule}"),
                         kernel_ratio=(ratio(stream, "kernel_raw") if "kernel_raw" in stream
                                       else float("nan")),
                         cache_gbs=kernel_bytes / cached[f"out_{rule}"] / 1e9,
                         cache_add_gbs=set_bytes / cached["add_out"] / 1e9,
                         cache_ratio=ratio(cached, f"out_{rule}"),
                         cache_kernel_ratio=(ratio(cached, "kernel_raw")
                                             if "kernel_raw" in cached else float("nan")),
                         best_speedup=best[f"ref_{rule}"] / best[f"fused_{rule}"],
                         best_bw_ratio=ratio(best, f"out_{rule}")))
    return rows


def bench_aux_add(shape, dtype, device, rounds, now):
    rand = lambda: torch.randn(shape, dtype=dtype, device=device)  # noqa: E731
    nbytes = 3 * rand().numel() * rand().element_size()
    # Both add src into dst over and over: values drift, bytes do not.
    # Streaming (each call's pair out of cache, as above) and in cache (one pair).
    mine, theirs = (Rotation.streaming(lambda: (rand(), rand()), nbytes, device)
                    for _ in range(2))
    out = dict(shape=shape)
    for regime, (a, b) in (("stream", (mine, theirs)),
                           ("cache", (Rotation(mine.sets[:1]), Rotation(theirs.sets[:1])))):
        med = _rounds({"torch_add_": lambda b=b: (lambda x: x[0].add_(x[1]))(b()),
                       "aux_add": lambda a=a: nk.aux_add(*a())}, rounds, now)
        out.update({f"{regime}_torch_gbs": nbytes / med["torch_add_"] / 1e9,
                    f"{regime}_aux_gbs": nbytes / med["aux_add"] / 1e9,
                    f"{regime}_ratio": med["torch_add_"] / med["aux_add"]})
    return out


def bench_predictor(shape, dtype, device, rounds, now):
    g = torch.Generator().manual_seed(1)
    h = torch.randn(shape, generator=g, dtype=dtype).relu().to(device)
    T = 1.3 * h + 0.1 * torch.randn(shape, generator=g, dtype=dtype).to(device)
    P, b = torch.zeros(shape[1:], dtype=dtype, device=device), torch.zeros_like(h[0])
    # eta = 0 keeps P and b fixed, so every round does the same work
    med = _rounds({"ref": lambda: nk.predictor_update(h, T, P, b, 0.0, backend="torch"),
                   "fused": lambda: nk.predictor_update(h, T, P, b, 0.0)}, rounds, now)
    return dict(shape=shape, ref_ms=med["ref"] * 1e3, fused_ms=med["fused"] * 1e3,
                speedup=med["ref"] / med["fused"])


def parse_args(argv=None) -> argparse.Namespace:
    """The options, checked before anything is timed: one argparse error (exit 2) if wrong."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="small smoke sizes, 5 rounds unless --rounds")
    parser.add_argument("--rounds", type=positive_int, default=None,
                        help="timed calls per contender, round-robin (default 30)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--threads", type=positive_int, default=numba.config.NUMBA_NUM_THREADS,
                        help="numba and torch threads, set equal (default NUMBA_NUM_THREADS, "
                             f"at most {numba.config.NUMBA_NUM_THREADS} here)")
    args = parser.parse_args(argv)
    if args.rounds is None:
        args.rounds = 5 if args.quick else 30
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: this torch sees no CUDA GPU (torch.cuda.is_available() "
                     "is False); run on a GPU machine (benchmarks/gpu_check.sh), or use cpu")
    if args.threads > numba.config.NUMBA_NUM_THREADS:
        parser.error(f"argument --threads: at most NUMBA_NUM_THREADS = "
                     f"{numba.config.NUMBA_NUM_THREADS} (numba's pool is that size), got "
                     f"{args.threads}")
    return args


def machine_load() -> str | None:
    """A warning when other work shares the cores: then no ratio here means anything."""
    busy, cores = os.getloadavg()[0], os.cpu_count() or 1
    if busy <= cores - 0.5:
        return None
    return (f"WARNING: the machine is busy (load average {busy:.1f} on {cores} cores) while "
            f"benchmarking: every figure below is shared with other work; rerun on a quiet "
            f"machine before comparing with the targets")


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    configure_process(args.threads)  # numba = torch threads, and the allocator policy of runs
    shapes, rounds = (QUICK_SHAPES if args.quick else SHAPES), args.rounds
    now = _timer(device)
    print(f"device {device}, {args.dtype}, {rounds} rounds (medians), threads: "
          f"numba {numba.get_num_threads()} = torch {torch.get_num_threads()}, load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    if machine_load():
        print(machine_load())
    print(f"{'':31} {'allocating':>31}   {'streaming (target)':>32}   {'in cache':>23}")
    print(f"{'population':>20} {'rule':>10} {'torch ref ms':>12} {'fused ms':>9} "
          f"{'speedup':>8}   {'out= ms':>8} {'GB/s':>6} {'add GB/s':>8} {'ratio':>6}   "
          f"{'GB/s':>6} {'add GB/s':>8} {'ratio':>6}")
    rows = []
    for shape in shapes:
        for r in bench_population(shape, dtype, device, rounds, now):
            rows.append(r)
            print(f"{str(r['shape']):>20} {r['rule']:>10} {r['ref_ms']:12.3f} "
                  f"{r['fused_ms']:9.3f} {r['speedup']:7.2f}x   {r['out_ms']:8.3f} "
                  f"{r['gbs']:6.1f} {r['add_gbs']:8.1f} {r['bw_ratio']:6.2f}   "
                  f"{r['cache_gbs']:6.1f} {r['cache_add_gbs']:8.1f} {r['cache_ratio']:6.2f}")
    print(f"\n{'':20} {'streaming (target)':>30}   {'in cache':>30}")
    print(f"{'aux_add population':>20} {'add_ GB/s':>10} {'aux_add GB/s':>13} {'ratio':>6}   "
          f"{'add_ GB/s':>10} {'aux_add GB/s':>13} {'ratio':>6}")
    aux = []
    for shape in shapes:
        a = bench_aux_add(shape, dtype, device, rounds, now)
        aux.append(a)
        print(f"{str(a['shape']):>20} {a['stream_torch_gbs']:10.1f} {a['stream_aux_gbs']:13.1f} "
              f"{a['stream_ratio']:6.2f}   {a['cache_torch_gbs']:10.1f} "
              f"{a['cache_aux_gbs']:13.1f} {a['cache_ratio']:6.2f}")
    print(f"\n{'predictor population':>20} {'torch ref ms':>12} {'fused ms':>9} {'speedup':>8}")
    for shape in shapes:
        r = bench_predictor(shape, dtype, device, rounds, now)
        print(f"{str(r['shape']):>20} {r['ref_ms']:12.3f} {r['fused_ms']:9.3f} "
              f"{r['speedup']:7.2f}x")
    def worst(items, key):
        return min(r[key] for r in items)

    print("\nworst case over populations and rules: ratio of medians (ratio of fastest rounds)")
    print(f"mixed_apical speedup vs torch reference: {worst(rows, 'speedup'):.2f}x "
          f"({worst(rows, 'best_speedup'):.2f}x)  target >= 3")
    print(f"mixed_apical bandwidth / torch add(out=), streaming from memory: "
          f"{worst(rows, 'bw_ratio'):.2f} ({worst(rows, 'best_bw_ratio'):.2f})  target >= 0.8")
    print(f"  raw kernel alone, no dispatch: {worst(rows, 'kernel_ratio'):.2f}; in cache "
          f"(no target): {worst(rows, 'cache_ratio'):.2f}, raw kernel alone "
          f"{worst(rows, 'cache_kernel_ratio'):.2f}")
    print(f"aux_add bandwidth / torch add_, streaming from memory: "
          f"{worst(aux, 'stream_ratio'):.2f}; in cache {worst(aux, 'cache_ratio'):.2f}  "
          f"target >= 0.8")


if __name__ == "__main__":
    main()
