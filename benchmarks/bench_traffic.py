"""kp_traffic step / kp step on the 2-D ResNet-20 at batch 128 (CPU), per predictor.

Clean transport adds no multiply-accumulates (the weight-gradient product takes
the used signal, the input-gradient product the clean one) and no memory
passes: each population's backward step from h to its layer's output is one
fused kernel (``numba_kernels.mixed_local``) standing in for autograd's ReLU,
residual-scale and norm backward. Steps of the rules alternate and the median
of each is compared, in one run, under the allocator policy every run has
(``lab.device.configure_process``). The breakdown splits kp_traffic's step:
the fused kernel and its weight-gradient products (which autograd would
otherwise compute inside KP's fused conv backward); and a third contender,
kp_traffic with every kernel result replayed from a cache (the kernel's work
removed, everything else kept), shows what the step costs besides the kernel::

    .venv/bin/python benchmarks/bench_traffic.py [--repeats 15] [--runs 1] [--batch 128] [--quick]
        [--predictor unit_affine|unit_quadratic|channel_linear|all]

``--predictor`` (MT-2) picks kp_traffic's predictor (``all``: each in turn, against
the same kp); goals: unit_affine <= 1.05, unit_quadratic <= 1.10, channel_linear <= 1.25.
Each runs a fused kernel: unit_affine and unit_quadratic ``mixed_local`` from the per-unit
coefficients; channel_linear ``mixed_traffic_local`` from the traffic and the prediction
formed in torch (its k x k map is a matmul), whose making counts outside the kernel.
The steps are medians, so the predictor's own update (one step in ``predictor_every``)
is not in them.

``--quick`` is a smoke run: ResNet-8 at batch 32, or at ``--batch`` when given.

``--runs N`` repeats the whole measurement N times in one process and prints
each run's ratio, their median and range (on a shared machine one run can land
in a slow spell; the spread says how much that moves the ratio).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import numba_kernels
from lab.device import configure_process
from lab.models import ResNet
from lab.rules import make_rule
from lab.rules import traffic as traffic_rule
from lab.rules.apical import PREDICTORS

GOALS = {"unit_affine": 1.05, "unit_quadratic": 1.10, "channel_linear": 1.25}
KERNELS = ("mixed_local", "mixed_traffic_local")  # the fused local steps (either form)

SPENT: dict[str, float] = {}
REPLAY = {"on": False, "cache": {}}


def _timed(owner, name: str) -> None:
    """Accumulate the wall time of ``owner.name`` calls into SPENT[name]."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            SPENT[name] = SPENT.get(name, 0.0) + time.perf_counter() - start
    setattr(owner, name, wrapper)


def _replayable(owner, name: str) -> None:
    """``owner.name`` answers from a cache (keyed by shape and outputs) while REPLAY is on."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        key = (tuple(args[1].shape), kwargs.get("instruction"), kwargs.get("masked"),
               kwargs.get("mean") is not None)
        if REPLAY["on"] and key in REPLAY["cache"]:
            return REPLAY["cache"][key]
        REPLAY["cache"][key] = out = inner(*args, **kwargs)
        return out
    setattr(owner, name, wrapper)


def _step(model, rule, x, y, step):
    model.zero_grad(set_to_none=True)
    SPENT.clear()
    start = time.perf_counter()
    rule.compute_gradients(x, y, step)
    return time.perf_counter() - start


def _measure(rules, x, y, repeats: int) -> dict:
    """One measurement: medians of alternating steps (module docstring), in seconds."""
    times = {label: [] for label in ("kp", "kp_traffic", "kp again", "replayed")}
    parts = {"kernel": [], "_conv_weight_grad": []}
    # kp and kp_traffic alternating; then, apart (so the replay does not disturb the
    # comparison), kp and the replayed step alternating.
    for pairing in ((("kp", "kp", False), ("kp_traffic", "kp_traffic", False)),
                    (("kp again", "kp", False), ("replayed", "kp_traffic", True))):
        for i in range(repeats):
            for label, name, replay in pairing:
                model, rule = rules[name]
                REPLAY["on"] = replay
                times[label].append(_step(model, rule, x, y, i + 1))
                if label == "kp_traffic":
                    parts["kernel"].append(sum(SPENT.get(k, 0.0) for k in KERNELS))
                    parts["_conv_weight_grad"].append(SPENT.get("_conv_weight_grad", 0.0))
    REPLAY["on"] = False
    out = {k: statistics.median(v) for k, v in times.items()}
    out.update({k: statistics.median(v) for k, v in parts.items()})
    return out


def parse_args(argv=None) -> argparse.Namespace:
    """The options, checked before anything is built: one argparse error (exit 2) if wrong.
    Sets ``depth`` and resolves ``batch`` (default 128, or 32 with ``--quick``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15,
                        help="steps per rule and pairing in one measurement (default 15)")
    parser.add_argument("--runs", type=int, default=1, help="whole measurements, one process")
    parser.add_argument("--batch", type=int, default=None,
                        help="examples per step, also the traffic calibration and predictor "
                             "batches (default 128; 32 with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="ResNet-8 instead of ResNet-20, batch 32 unless --batch: a smoke run")
    parser.add_argument("--predictor", default="unit_affine", choices=(*PREDICTORS, "all"),
                        help="kp_traffic's predictor (default unit_affine; all: each in turn)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.runs < 1:
        parser.error(f"--repeats and --runs must be at least 1, got {args.repeats} and "
                     f"{args.runs}")
    if args.batch is not None and args.batch < 1:
        parser.error(f"argument --batch: must be at least 1, got {args.batch}")
    args.depth = 8 if args.quick else 20
    if args.batch is None:
        args.batch = 32 if args.quick else 128
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    configure_process(torch.get_num_threads())  # the allocator policy every run has
    depth, batch = args.depth, args.batch
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    for kernel in KERNELS:
        _replayable(numba_kernels, kernel)
        _timed(numba_kernels, kernel)
    _timed(traffic_rule, "_conv_weight_grad")
    print(f"ResNet-{depth} 2-D, batch {batch}, {torch.get_num_threads()} threads, "
          f"median of {args.repeats} steps per run")
    predictors = list(PREDICTORS) if args.predictor == "all" else [args.predictor]
    for predictor in predictors:
        REPLAY["cache"].clear()
        rules = {}
        for name, params in (("kp", {}), ("kp_traffic", {
                "traffic_rule": "innovation", "predictor": predictor,
                "traffic_calibration_examples": batch, "predictor_warmup_steps": 2,
                "predictor_batch": batch})):
            torch.manual_seed(0)
            model = ResNet(depth, 16, dims=2, in_channels=3, n_classes=10)
            rule = make_rule(name, model, params)
            rule.prepare(x, y)
            _step(model, rule, x, y, 0)  # warm-up (allocator, numba compilation)
            rules[name] = (model, rule)
        _report(predictor, rules, x, y, args)


def _report(predictor, rules, x, y, args) -> None:
    goal = GOALS[predictor]
    print(f"predictor {predictor}:")
    ratios = []
    for run in range(args.runs):
        m = _measure(rules, x, y, args.repeats)
        ratios.append(m["kp_traffic"] / m["kp"])
        if args.runs > 1:
            print(f"run {run + 1}:", end=" ")
        print(f"kp step {1e3 * m['kp']:.1f} ms, kp_traffic step {1e3 * m['kp_traffic']:.1f} ms")
        print(f"  of which: fused mixed_local kernel {1e3 * m['kernel']:.1f} ms, "
              f"weight-gradient products {1e3 * m['_conv_weight_grad']:.1f} ms")
        print(f"  kp_traffic with the kernel's results replayed / kp: "
              f"{m['replayed'] / m['kp again']:.3f}")
        print(f"  kp_traffic / kp: {ratios[-1]:.3f}")
    print(f"kp_traffic ({predictor}) / kp: {statistics.median(ratios):.3f}"
          + (f" median of {args.runs} runs ({min(ratios):.3f} - {max(ratios):.3f}; "
             f"{sum(r <= goal for r in ratios)} of {args.runs} at or under {goal})"
             if args.runs > 1 else "") + f" (goal <= {goal})")


if __name__ == "__main__":
    main()
