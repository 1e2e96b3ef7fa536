"""papermill's overhead per run: the training notebook vs the same function in-process.

Executes ``notebooks/01-train-conv.ipynb`` with a tiny config through
``lab.notebook.execute`` (kernel start, imports, training, figure, recorded
values, record bookkeeping) and calls ``lab.train.train_conv`` with the same
config in this process (torch already imported). The two are interleaved,
repeated, and the difference of the medians is printed in seconds. Target
(DESIGN section 10): at most 3 s. Beside it, the floor any fresh kernel pays before
lab's own code: a bare Python process that imports torch and matplotlib's Figure and
builds a torch optimizer (whose first use imports ``torch._dynamo``). Where a run's
time goes is printed too, from papermill's cell timings: the kernel's start, the
imports cell, the training cell (a fresh kernel's first run) and the rest.

    python benchmarks/bench_papermill.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lab.notebook import execute
from lab.train import ConvConfig, train_conv

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "01-train-conv.ipynb"
PARAMS = dict(dataset="mnist1d", n_train=256, depth=8, width=4, epochs=3, batch_size=64,
              eval_batch_size=500, threads=1, progress=False)


def _times(values: list[float]) -> str:
    return ", ".join(f"{t:.2f}" for t in values)


def _phases(notebook: Path, total: float) -> dict[str, float]:
    """Seconds of one executed notebook: kernel start (papermill's start to the first
    cell), the imports cell, the training cell, and everything else of ``total``."""
    from datetime import datetime

    nb = json.loads(notebook.read_text())
    cells = [c["metadata"]["papermill"] for c in nb["cells"] if c["cell_type"] == "code"]
    start = datetime.fromisoformat(nb["metadata"]["papermill"]["start_time"])
    first = datetime.fromisoformat(cells[0]["start_time"])
    sources = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    imports = next(c["duration"] for c, s in zip(cells, sources) if "from lab.train import" in s)
    training = next(c["duration"] for c, s in zip(cells, sources) if "= train_conv(" in s)
    kernel = (first - start).total_seconds()
    return {"kernel start": kernel, "imports cell": imports, "training cell": training,
            "the rest": total - kernel - imports - training}


FLOOR = ("import torch, matplotlib.figure; "
         "torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)")


def _floor() -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", FLOOR], check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("LAB_DATA_DIR", str(ROOT / "data"))
    in_process, notebook, phases, floor = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        train_conv(ConvConfig(**PARAMS), Path(tmp) / "warm-up")  # data cache, imports
        for i in range(args.repeats):
            start = time.perf_counter()
            record = train_conv(ConvConfig(**PARAMS), Path(tmp) / f"direct-{i}")
            in_process.append(time.perf_counter() - start)
            start = time.perf_counter()
            result = execute(NOTEBOOK, Path(tmp) / f"papermill-{i}", PARAMS)
            notebook.append(time.perf_counter() - start)
            assert result.status == record["status"] == "complete", result.error
            phases.append(_phases(result.notebook, notebook[-1]))
            floor.append(_floor())
    direct, pm = statistics.median(in_process), statistics.median(notebook)
    print(f"in-process train_conv: median {direct:.2f} s  ({_times(in_process)})")
    print(f"papermill notebook:    median {pm:.2f} s  ({_times(notebook)})")
    print(f"papermill overhead per run: {pm - direct:.2f} s (target <= 3 s); "
          f"ratio notebook / in-process = {pm / direct:.2f}")
    print(f"floor (python + torch + torch._dynamo + matplotlib, no lab): median "
          f"{statistics.median(floor):.2f} s ({_times(floor)}); lab's own share of the "
          f"overhead: {pm - direct - statistics.median(floor):.2f} s")
    print("a papermill run, median seconds: " + ", ".join(
        f"{name} {statistics.median(p[name] for p in phases):.2f}" for name in phases[0]))


if __name__ == "__main__":
    main()
