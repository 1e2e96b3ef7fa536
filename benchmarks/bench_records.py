"""Record saves must not grow with the history (DESIGN section 10).

A synthetic step-axis run (``lab.train.synthetic``) logs 20,000 rows of 10
metrics and saves (row part + checkpoint + record.json) every 100 steps.
Printed: the time of the last 10 saves divided by the time of the first 10
(target <= 1.5), and the mean save time. Run::

    .venv/bin/python benchmarks/bench_records.py [--steps 20000] [--every 100]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from lab.lifecycle import Lifecycle
from lab.train.synthetic import SyntheticConfig, train_synthetic


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--metrics", type=int, default=10)
    args = parser.parse_args()

    timings: list[float] = []
    save = Lifecycle._save

    def timed(self, **kwargs):
        start = time.perf_counter()
        save(self, **kwargs)
        timings.append(time.perf_counter() - start)

    Lifecycle._save = timed
    config = SyntheticConfig(steps=args.steps, n_metrics=args.metrics,
                             checkpoint_every=args.every)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        record = train_synthetic(config, f"{tmp}/run")
        total = time.perf_counter() - start
    Lifecycle._save = save
    assert record["status"] == "complete" and record["rows"]["step"] == args.steps
    saves = timings[:-1]  # the last one is the finish
    first, last = sum(saves[:10]), sum(saves[-10:])
    # fsync time on a shared machine is noisy: the medians over 20 saves say the same, steadier.
    med_first, med_last = statistics.median(saves[:20]), statistics.median(saves[-20:])
    print(f"{len(timings)} saves of {args.every} rows x {args.metrics} metrics, "
          f"{args.steps} rows in {total:.1f} s")
    print(f"mean save {1e3 * statistics.mean(timings):.2f} ms; first 10: {1e3 * first:.1f} ms, "
          f"last 10: {1e3 * last:.1f} ms")
    print(f"last/first ratio: {last / first:.2f} (target <= 1.5); medians of 20: "
          f"{med_last / med_first:.2f}")


if __name__ == "__main__":
    main()
