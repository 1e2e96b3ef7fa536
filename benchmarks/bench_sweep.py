"""A 4-run sweep on 2 Dask workers vs the same 4 runs one after another.

Both execute ``notebooks/01-train-conv.ipynb`` through papermill with the same
parameters (1 thread per run, as the sweep sets them): the sequential side
calls ``lab.notebook.execute`` four times in this process; the parallel side
is ``lab.sweep.run_sweep`` with 2 workers, LocalCluster start-up included.
Prints the ratio of wall times. Target (issue #3): at most 0.65.

    python benchmarks/bench_sweep.py [--workers 2] [--epochs 20]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import yaml

from lab.notebook import execute
from lab.sweep import expand, load_protocol, run_sweep

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "01-train-conv.ipynb"


def _protocol(tmp: Path, name: str, epochs: int) -> Path:
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "name": name, "notebook": str(NOTEBOOK), "out": name, "threads_per_run": 1,
        "fixed": {"dataset": "mnist1d", "n_train": 0, "depth": 8, "width": 8,
                  "epochs": epochs, "batch_size": 64, "progress": False},
        "grid": {"seed": [0, 1, 2, 3]}}))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=20)
    args = parser.parse_args()
    os.environ.setdefault("LAB_DATA_DIR", str(ROOT / "data"))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        sequential = load_protocol(_protocol(tmp, "sequential", args.epochs))
        start = time.perf_counter()
        for spec in expand(sequential):
            result = execute(sequential.notebook, Path(sequential.out) / spec.run_id,
                             {**spec.params, "threads": 1})
            assert result.status == "complete", result.error
            print(f"  sequential {spec.run_id}: {result.wall_s:.2f} s")
        serial = time.perf_counter() - start
        swept = load_protocol(_protocol(tmp, "swept", args.epochs))
        start = time.perf_counter()
        report = run_sweep(swept, workers=args.workers, progress=False)
        parallel = time.perf_counter() - start
        assert not report.failed, report.summary()
        for outcome in report.outcomes:
            print(f"  sweep      {outcome.run_id}: {outcome.wall_s:.2f} s")
    print(f"4 runs sequentially: {serial:.1f} s; sweep on {args.workers} workers: "
          f"{parallel:.1f} s; ratio sweep / sequential = {parallel / serial:.2f} "
          "(target <= 0.65)")


if __name__ == "__main__":
    main()
