"""Step time of every rule relative to backprop, measured in one process.

2-D ResNet-20 (width 16) on a CIFAR-shaped batch of 128 (3x32x32), CPU, a
full training step (rule gradients + SGD step). Steps of the rules are
interleaved round-robin so that machine noise hits every rule alike; the
ratio of medians is printed. If BioTorch is installed
(``pip install --no-deps biotorch==0.0.16``), its ``fa`` ResNet-20 is timed
in the same rounds.

Learned feedback (lhfa, sdil) is then split against fa, on the MNIST-1D shape
its protocol trains (1-D ResNet-20, batch 128 of 1 x 40): ordinary steps (no
calibration event due; full step with the SGD step) and calibration events
(``rule.calibrate(x, y)``: the clean pass, the perturbed passes at every
population, the feedback update) timed apart, interleaved with fa's steps, and
the amortised step at ``--every`` (the protocol's ``pert_every``). That second
table is printed for the learned rules named in ``--rules`` (none named: no
table); it times its own fa and always uses the protocol's batch of 128, whatever
``--batch`` says.

    python benchmarks/bench_rules.py [--rounds 15] [--rules bp,fa,kp] [--every 8]

``--rules`` must include ``bp``: every ratio is against bp's step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from lab.cli import positive_int
from lab.device import configure_process
from lab.models import ResNet
from lab.rules import RULES, make_rule

LEARNED = ("lhfa", "sdil")
LEARNED_BATCH = 128  # the MNIST-1D protocol's batch: the second table's own, not --batch


def _lab_step(rule_name, x, y, dims=2, params=None):
    torch.manual_seed(0)
    model = ResNet(20, 16, dims=dims, in_channels=x.shape[1])
    if rule_name in LEARNED:  # ordinary steps: no calibration event falls due
        params = {"pert_every": 10 ** 9, **(params or {})}
    calibrated = rule_name in ("kp_traffic", "sdil")
    if calibrated:  # the traffic gains, calibrated on this batch, no warm-up
        params = {"traffic_calibration_examples": len(y), "predictor_warmup_steps": 0,
                  **({"a_warmup_steps": 0} if rule_name == "sdil" else {}), **(params or {})}
    rule = make_rule(rule_name, model, params or {}, seed=0)
    if calibrated:
        rule.prepare(x, y)  # as the trainer does before the first step
    # As the trainer builds it: the rule's tensors beside the model's, its own groups apart.
    groups = [{"params": list(model.parameters()) + rule.parameters()}] + rule.param_groups()
    opt = torch.optim.SGD(groups, lr=0.01, momentum=0.9)
    state = {"step": 0}

    def step():
        opt.zero_grad(set_to_none=True)
        rule.compute_gradients(x, y, state["step"])
        opt.step()
        state["step"] += 1
    step.rule = rule
    return step


def learned_split(rounds: int, every: int, learned=LEARNED) -> None:
    """Learned-feedback rules against fa on the MNIST-1D shape (batch LEARNED_BATCH):
    ordinary steps and calibration events apart."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(LEARNED_BATCH, 1, 40, generator=g)
    y = torch.randint(0, 10, (LEARNED_BATCH,), generator=g)
    steps = {name: _lab_step(name, x, y, dims=1) for name in ("fa", *learned)}
    for step in steps.values():
        step(), step()
    times = {k: [] for k in (*steps, *(f"{n} event" for n in learned))}
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
            if name in learned:
                start = time.perf_counter()
                step.rule.calibrate(x, y)
                times[f"{name} event"].append(time.perf_counter() - start)
    fa = statistics.median(times["fa"])
    print(f"\nlearned feedback, 1-D ResNet-20, batch {LEARNED_BATCH} x 1 x 40: fa step "
          f"{1e3 * fa:.1f} ms; {steps[learned[0]].rule.params.pert_directions} directions per "
          "population and event")
    print(f"{'rule':<6} {'step / fa':>10} {'event / fa':>11} {f'amortised at every={every}':>26}")
    for name in learned:
        step, event = statistics.median(times[name]), statistics.median(times[f"{name} event"])
        amortised = (step + event / every) / fa
        print(f"{name:<6} {step / fa:>10.2f} {event / fa:>11.1f} {amortised:>26.2f}")


def _biotorch_fa_resnet20():
    """Our ResNet-20 with every Conv/Linear swapped for BioTorch's FA layers.

    BioTorch's own model zoo imports torchvision (unusable beside the CPU
    torch here); its layers need torch alone, and swapping them into the same
    architecture makes the comparison about the FA machinery only.
    """
    from biotorch.layers.fa import Conv2d, Linear

    model = ResNet(20, 16, dims=2, in_channels=3)
    config = {"type": "fa", "options": {"init": "kaiming"}}

    def conv(old):
        return Conv2d(old.in_channels, old.out_channels, 3, old.stride[0], old.padding[0],
                      bias=False, layer_config=dict(config))

    model.stem = conv(model.stem)
    for block in model.blocks:
        block.conv1, block.conv2 = conv(block.conv1), conv(block.conv2)
    model.fc = Linear(model.fc.in_features, model.fc.out_features, layer_config=dict(config))
    return model


def _biotorch_step(x, y):
    try:
        torch.manual_seed(0)
        model = _biotorch_fa_resnet20()
    except ImportError:  # BioTorch not installed
        return None
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step():
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return step


def parse_args(argv=None) -> argparse.Namespace:
    """The options, checked before any timing: one argparse error (exit 2) if wrong."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0].replace("\n", " "),
        epilog="Second table: learned feedback (lhfa, sdil) against fa on the MNIST-1D shape, "
               f"printed when --rules names lhfa and/or sdil; it uses its own batch of "
               f"{LEARNED_BATCH} (the protocol's), not --batch.")
    parser.add_argument("--rounds", type=positive_int, default=15,
                        help="timed steps per rule, interleaved round-robin (default 15)")
    parser.add_argument("--rules", default=",".join(sorted(RULES)),
                        help="comma-separated rules to time; must include bp, the baseline "
                             "(default: every rule)")
    parser.add_argument("--batch", type=positive_int, default=128,
                        help="batch of the first table's CIFAR-shaped input (default 128)")
    parser.add_argument("--every", type=positive_int, default=8,
                        help="lhfa/sdil pert_every: one calibration event every EVERY steps, "
                             "for the second table's amortised step (default 8)")
    args = parser.parse_args(argv)
    rules = [name.strip() for name in args.rules.split(",")]
    unknown = [name for name in rules if name not in RULES]
    if unknown:
        parser.error(f"argument --rules: unknown rule(s) {', '.join(map(repr, unknown))}; "
                     f"known rules: {', '.join(sorted(RULES))}")
    if len(set(rules)) != len(rules):
        parser.error(f"argument --rules: a rule is named twice in {args.rules!r}")
    if "bp" not in rules:
        parser.error(f"argument --rules: must include bp, the baseline every ratio is "
                     f"against; got {args.rules!r}")
    args.rules = rules
    args.learned = tuple(name for name in LEARNED if name in rules)
    return args


def main(argv=None):
    args = parse_args(argv)
    configure_process(torch.get_num_threads())  # the allocator policy every run has
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    steps = {name: _lab_step(name, x, y) for name in args.rules}
    bio = _biotorch_step(x, y)
    if bio is not None:
        steps["biotorch-fa"] = bio
    times = {name: [] for name in steps}
    for step in steps.values():  # warm-up: allocator, lazy shapes
        step(), step()
    for _ in range(args.rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["bp"])
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, batch {args.batch}, "
          f"{args.rounds} rounds; median bp step {1000 * base:.1f} ms")
    print(f"{'rule':<12} {'median ms':>10} {'/ bp':>7}")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"{name:<12} {1000 * m:>10.1f} {m / base:>7.3f}")
    if "biotorch-fa" in times and "fa" in times:
        ratio = statistics.median(times["fa"]) / statistics.median(times["biotorch-fa"])
        print(f"lab fa / BioTorch fa = {ratio:.3f}")
    if args.learned:
        learned_split(args.rounds, args.every, args.learned)


if __name__ == "__main__":
    main()
