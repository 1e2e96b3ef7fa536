"""papermill's overhead per run: the training notebook vs the same function in-process.

Executes ``notebooks/01-train-conv.ipynb`` with a tiny config through
``lab.notebook.execute`` (kernel start, imports, training, figure, recorded
values, record bookkeeping) and calls ``lab.train.train_conv`` with the same
config in this process (torch already imported). The two are interleaved,
repeated, and the difference of the medians is printed in seconds. Target
(DESIGN section 10): at most 3 s.

    python benchmarks/bench_papermill.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("LAB_DATA_DIR", str(ROOT / "data"))
    in_process, notebook = [], []
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
    direct, pm = statistics.median(in_process), statistics.median(notebook)
    print(f"in-process train_conv: median {direct:.2f} s  ({_times(in_process)})")
    print(f"papermill notebook:    median {pm:.2f} s  ({_times(notebook)})")
    print(f"papermill overhead per run: {pm - direct:.2f} s (target <= 3 s); "
          f"ratio notebook / in-process = {pm / direct:.2f}")


if __name__ == "__main__":
    main()
