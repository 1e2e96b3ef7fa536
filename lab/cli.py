"""The ``lab`` command line: train a run, run the demo protocol.

    lab train --out runs/bp-s0 -p rule bp -p seed 0 [-f params.yaml]
    lab demo [--out runs/demo]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import yaml


def parse_value(text: str):
    """A CLI literal -> int, float, bool, None, list/dict (YAML) or str."""
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return yaml.safe_load(text)


def collect_params(pairs: list[list[str]] | None, files: list[str] | None) -> dict:
    """-f files in order, then -p pairs; dotted keys ``a.b`` build nested dicts."""
    params: dict = {}
    for path in files or []:
        loaded = yaml.safe_load(Path(path).read_text())
        if not isinstance(loaded, dict):
            raise SystemExit(f"{path}: expected a YAML mapping of parameter -> value")
        params.update(loaded)
    for key, value in pairs or []:
        target = params
        *parents, leaf = key.split(".")
        for parent in parents:
            target = target.setdefault(parent, {})
        target[leaf] = parse_value(value)
    return params


def _train(args) -> int:
    from .config import ConfigError, from_dict
    from .train import ConvConfig, train_conv

    try:
        config = from_dict(ConvConfig, collect_params(args.param, args.file))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    record = train_conv(config, args.out)
    print(f"{record['status']}: {record['final']} -> {args.out}")
    return 0 if record["status"] == "complete" else 1


def _demo(args) -> int:
    """Backprop on MNIST-1D for two seeds; prints the test accuracies."""
    from .train import ConvConfig, train_conv

    out = Path(args.out)
    start = time.perf_counter()
    accs = []
    for seed in (0, 1):
        run_dir = out / f"bp-mnist1d-seed{seed}"
        record = train_conv(ConvConfig(seed=seed), run_dir)
        accs.append(record["final"]["test_acc"])
        print(f"seed {seed}: test accuracy {100 * accs[-1]:.2f}%  ({run_dir}/record.json)")
    mean = sum(accs) / len(accs)
    print(f"bp on MNIST-1D, ResNet-20 (1-D): mean test accuracy {100 * mean:.2f}% over "
          f"{len(accs)} seeds in {time.perf_counter() - start:.0f} s; records under {out}/")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lab", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train one conv run")
    train.add_argument("--out", required=True, help="run directory")
    train.add_argument("-p", "--param", nargs=2, action="append", metavar=("KEY", "VALUE"))
    train.add_argument("-f", "--file", action="append", help="YAML file of parameters")
    train.set_defaults(func=_train)
    demo = sub.add_parser("demo", help="run the demo protocol")
    demo.add_argument("--out", default="runs/demo")
    demo.set_defaults(func=_demo)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
