"""Step time of lhfa and sdil relative to fa: ordinary steps and calibration events apart.

1-D ResNet-20 (width 16) on an MNIST-1D-shaped batch of 128 (1 x 40), CPU,
one thread. An ordinary step is a full training step (rule gradients + SGD
step) with no calibration event due; a calibration event is timed on its own
(``rule.calibrate(x, y)``: the clean pass, the perturbed passes at every
population, the feedback update). Rules are interleaved round-robin so
machine noise hits them alike; ratios of medians to fa's step are printed,
with the amortised cost of a step at the rule's ``pert_every``.

    python benchmarks/bench_learned.py [--rounds 7] [--directions 4] [--every 10]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lab.models import ResNet
from lab.rules import make_rule


def _rule(name, params):
    torch.manual_seed(0)
    model = ResNet(20, 16, dims=1, in_channels=1)
    rule = make_rule(name, model, params, seed=0)
    groups = [{"params": list(model.parameters()) + rule.parameters()}] + rule.param_groups()
    return rule, torch.optim.SGD(groups, lr=0.01, momentum=0.9)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--directions", type=int, default=4)
    parser.add_argument("--every", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    x, y = torch.randn(128, 1, 40), torch.randint(0, 10, (128,))
    learned = {"pert_directions": args.directions, "pert_every": 10 ** 9}
    rules = {"fa": _rule("fa", {}), "lhfa": _rule("lhfa", learned), "sdil": _rule("sdil", learned)}
    for rule, _ in rules.values():
        rule.compute_gradients(x, y, None)  # lazily built state, warm caches
    times = {k: [] for k in ("fa", "lhfa", "sdil", "lhfa event", "sdil event")}
    for _ in range(args.rounds):
        for name, (rule, opt) in rules.items():
            opt.zero_grad(set_to_none=True)
            start = time.perf_counter()
            rule.compute_gradients(x, y, 0)
            opt.step()
            times[name].append(time.perf_counter() - start)
            if name != "fa":
                start = time.perf_counter()
                rule.calibrate(x, y)
                times[f"{name} event"].append(time.perf_counter() - start)
    fa = statistics.median(times["fa"])
    print(f"fa step: {fa * 1e3:.1f} ms (median of {args.rounds}); "
          f"{args.directions} directions per population, central differences")
    for name in ("lhfa", "sdil"):
        step, event = statistics.median(times[name]), statistics.median(times[f"{name} event"])
        print(f"{name}: ordinary step / fa step = {step / fa:.2f}; calibration event / fa step "
              f"= {event / fa:.1f}; amortised at pert_every={args.every}: "
              f"{(step + event / args.every) / fa:.2f}")


if __name__ == "__main__":
    main()
