"""The ``lab`` command line: train, run notebooks, sweep protocols, list runs, report.

    lab train  --out runs/bp-s0 -p rule bp -p seed 0 [-f params.yaml]
    lab run    notebooks/01-train-conv.ipynb --out runs/bp-s0 -p rule bp [-f params.yaml]
    lab sweep  protocols/demo.yaml [--scheduler ADDRESS] [--workers N]
    lab runs   runs/demo | protocols/demo.yaml
    lab report protocols/demo.yaml [--notebook NB] [--out reports]

Exit status: 0 when everything asked for completed, 1 when a run failed (or
diverged, for train/run), 2 for bad input (unknown parameter, bad protocol).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

if TYPE_CHECKING:
    import pandas as pd


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


def _error(exc: Exception) -> int:
    print(f"error: {exc}", file=sys.stderr)
    return 2


def _run(args) -> int:
    from .config import ConfigError
    from .notebook import NotebookError, execute

    try:
        result = execute(args.notebook, args.out, collect_params(args.param, args.file))
    except (ConfigError, NotebookError, OSError, yaml.YAMLError) as exc:
        return _error(exc)
    print(f"{result.run_id}: {result.status} in {result.wall_s:.1f} s -> {result.notebook}")
    if result.error:
        print(f"error: {result.error}", file=sys.stderr)
    values = {k: v for k, v in result.values.items() if not isinstance(v, dict | list)}
    if values:
        print("recorded: " + ", ".join(f"{k}={v}" for k, v in values.items()))
    return 0 if result.status == "complete" else 1


def _sweep(args) -> int:
    from .sweep import ProtocolError, load_protocol, run_sweep

    try:
        protocol = load_protocol(args.protocol)
    except ProtocolError as exc:
        return _error(exc)
    try:
        report = run_sweep(protocol, scheduler=args.scheduler, workers=args.workers,
                           progress=not args.quiet)
    except KeyboardInterrupt:
        # Finished runs are on disk; unfinished ones resume from their checkpoints.
        print(f"\ninterrupted; run `lab sweep {args.protocol}` again to finish the remaining "
              "runs (finished ones are kept)", file=sys.stderr)
        return 130
    table = report.table()[["run_id", "status", "skipped", "wall_s", "error"]]
    print(table.to_string(index=False, max_colwidth=80))
    print(report.summary())
    return 1 if report.failed else 0


def runs_table(target) -> pd.DataFrame:
    """Runs under a directory, or a protocol's expected runs (missing ones included)."""
    import pandas as pd

    from . import records

    target = Path(target)
    expected = None
    if target.suffix in (".yaml", ".yml"):
        from .sweep import expand, load_protocol

        protocol = load_protocol(target)
        expected = [spec.run_id for spec in expand(protocol)]
        target = Path(protocol.out)
    if expected is None or target.is_dir():
        runs = records.load_runs(target)  # a missing directory is an error unless expected
    else:
        runs = pd.DataFrame(columns=list(records.RUN_COLUMNS))
    if expected is not None:
        missing = [rid for rid in expected if rid not in set(runs["run_id"])]
        runs = runs[runs["run_id"].isin(expected)]
        runs = pd.concat([runs, pd.DataFrame({"run_id": missing, "status": "missing"})],
                         ignore_index=True)
    finals = [c for c in runs.columns if c.startswith("final.")]
    table = runs[["run_id", "status", "n_epochs", *finals, "error"]].copy()
    table["n_epochs"] = table["n_epochs"].astype("Int64")  # missing runs have none
    table["error"] = table["error"].map(lambda e: e.splitlines()[0][:60] if isinstance(e, str)
                                        else "")
    return table.rename(columns=lambda c: c.removeprefix("final."))


def _runs(args) -> int:
    from .records import RecordError
    from .sweep import ProtocolError

    try:
        table = runs_table(args.target)
    except (RecordError, ProtocolError, FileNotFoundError) as exc:
        return _error(exc)
    if table.empty:
        print(f"no runs under {args.target}")
        return 0
    print(table.to_string(index=False, float_format=lambda v: f"{v:.4f}"))
    return 0


def _report(args) -> int:
    from .config import ConfigError
    from .notebook import NotebookError, execute, render_html
    from .sweep import load_protocol

    try:
        protocol = load_protocol(args.protocol)
        notebook = args.notebook or protocol.report
        if not notebook:
            raise NotebookError(f"protocol {protocol.source} names no report notebook; add "
                                "`report: <path>` to it or pass --notebook")
        params = {"protocol": protocol.source}
        if args.runs:
            params["runs_dir"] = str(Path(args.runs).resolve())
        out = Path(args.out)
        result = execute(notebook, out / protocol.name, params, record=False)
    except (ConfigError, NotebookError) as exc:
        return _error(exc)
    html = render_html(result.notebook, out / f"{protocol.name}.html")
    if result.error:
        print(f"error: the report notebook failed: {result.error}", file=sys.stderr)
    print(f"report: {html.resolve()}")
    return 0 if result.ok else 1


def _params_args(parser) -> None:
    parser.add_argument("-p", "--param", nargs=2, action="append", metavar=("KEY", "VALUE"),
                        help="a parameter (value parsed as YAML); repeatable")
    parser.add_argument("-f", "--file", action="append", help="YAML file of parameters")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lab", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train one conv run in-process")
    train.add_argument("--out", required=True, help="run directory")
    _params_args(train)
    train.set_defaults(func=_train)
    run = sub.add_parser("run", help="execute a notebook with papermill into a run directory")
    run.add_argument("notebook")
    run.add_argument("--out", required=True, help="run directory")
    _params_args(run)
    run.set_defaults(func=_run)
    sweep = sub.add_parser("sweep", help="execute a protocol's unfinished runs on Dask")
    sweep.add_argument("protocol", help="protocols/*.yaml")
    sweep.add_argument("--scheduler", help="Dask scheduler address (default: a LocalCluster)")
    sweep.add_argument("--workers", type=int, help="local workers (default: the protocol's)")
    sweep.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    sweep.set_defaults(func=_sweep)
    runs = sub.add_parser("runs", help="table of runs with status and final metrics")
    runs.add_argument("target", help="a directory of runs, or a protocol YAML")
    runs.set_defaults(func=_runs)
    report = sub.add_parser("report", help="execute a protocol's analysis notebook to HTML")
    report.add_argument("protocol")
    report.add_argument("--notebook", help="analysis notebook (default: the protocol's report)")
    report.add_argument("--runs", help="runs directory (default: the protocol's out)")
    report.add_argument("--out", default="reports", help="reports directory")
    report.set_defaults(func=_report)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
