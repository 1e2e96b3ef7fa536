"""The weight-decay study (issue 9 item 5): the README's table and figure. kp's
cos(B, W) over epochs and at the end, and test accuracy of kp and bp against the
decay. Reads the runs of ``protocols/wd-kp.yaml``, prints the table (markdown) and,
given a path, draws the figure::

    lab sweep protocols/wd-kp.yaml
    .venv/bin/python benchmarks/fig_wd_kp.py runs/wd-kp benchmarks/results/wd-kp.png
"""

from __future__ import annotations

import argparse
import collections
import math
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from lab import records  # noqa: E402


def _runs(root: Path) -> list[dict]:
    """Every run under ``root``; SystemExit naming those that are not complete (a figure
    of whatever happens to be finished would not be the study's)."""
    runs = [records.load_record(run) for run in sorted(root.iterdir())
            if (run / records.RECORD_FILE).exists()
            and not records.MOVED_ASIDE.search(run.name)]
    if not runs:
        raise SystemExit(f"error: no runs under {root} (run `lab sweep protocols/wd-kp.yaml`)")
    unfinished = [f"{r['run_id']} ({r['status']})" for r in runs if r["status"] != "complete"]
    if unfinished:
        raise SystemExit(f"error: {len(unfinished)} run(s) under {root} are not complete: "
                         f"{', '.join(unfinished)}; finish them (`lab sweep`) first")
    return runs


def _title(runs: list[dict]) -> str:
    """What the runs are, read from their configs (not what the protocol meant them to be)."""
    def values(key):
        return sorted({r["config"][key] for r in runs}, key=str)

    seeds = collections.Counter((r["config"]["rule"], r["config"]["weight_decay"]) for r in runs)
    per_point = sorted(set(seeds.values()))
    return (f"{'/'.join(map(str, values('dataset')))}, ResNet-{'/'.join(map(str, values('depth')))}"
            f" width {'/'.join(map(str, values('width')))}, "
            f"{'/'.join(map(str, values('epochs')))} epochs, {'/'.join(values('optimizer'))} "
            f"{'/'.join(values('schedule'))}; {'/'.join(map(str, per_point))} seed(s) per point")


def _mean_std(values: list[float]) -> str:
    """``98.55 ± 0.07`` (std over seeds, ddof 1); the value alone for one seed."""
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"


def _decay(value: float) -> str:
    """``1e-3`` for 0.001, as the README writes decays; ``0`` for none."""
    if not value:
        return "0"
    mantissa, exponent = f"{value:e}".split("e")
    return f"{float(mantissa):g}e{int(exponent)}"


def table(runs: list[dict]) -> str:
    """The README's table, one row per decay: kp and bp test accuracy (%, mean ± std over
    seeds) and kp's cos(B, W) at the last epoch, mean over layers then seeds, with in
    parentheses the lowest layer's cosine in any seed."""
    acc, cos, low = (collections.defaultdict(list) for _ in range(3))
    for rec in runs:
        c = rec["config"]
        acc[c["rule"], c["weight_decay"]].append(100 * rec["final"]["test_acc"])
        if c["rule"] == "kp":
            feedback = rec["trajectory"][-1]["rule"]["feedback"]
            cos[c["weight_decay"]].append(feedback["mean_cos"])
            low[c["weight_decay"]].append(feedback["min_cos"])
    lines = ["| weight decay | kp test acc (%) | kp cos(B, W) at the end, mean over layers "
             "(min) | bp test acc (%) |", "| --- | --- | --- | --- |"]
    for decay in sorted({w for _, w in acc}):
        kp = _mean_std(acc["kp", decay]) if ("kp", decay) in acc else "—"
        bp = _mean_std(acc["bp", decay]) if ("bp", decay) in acc else "—"
        lowest = min(low[decay], default=math.nan)
        # Near 1 only the fifth decimal tells convergence apart.
        feedback = (f"{statistics.mean(cos[decay]):.3f} "
                    f"({lowest:.{5 if lowest > 0.99 else 2}f})" if cos[decay] else "—")
        lines.append(f"| {_decay(decay)} | {kp} | {feedback} | {bp} |")
    return "\n".join(lines)


def main(root: Path, out: str | None) -> None:
    runs = _runs(root)
    print(f"{_title(runs)}\n\n{table(runs)}")
    if out is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    decays = sorted({r["config"]["weight_decay"] for r in runs})
    colors = {w: plt.cm.viridis(i / max(1, len(decays) - 1)) for i, w in enumerate(decays)}
    for rec in runs:
        c = rec["config"]
        if c["rule"] != "kp":
            continue
        rows = rec.get("trajectory") or []
        cos = [r["rule"]["feedback"]["mean_cos"] for r in rows]
        axes[0].plot(range(1, len(cos) + 1), cos, color=colors[c["weight_decay"]],
                     label=f"wd {c['weight_decay']:g}" if c["seed"] == 0 else None)
    axes[0].set(xlabel="epoch", ylabel="kp: mean cos(B, W) over layers", ylim=(0, 1.02))
    axes[0].axhline(0.9, color="gray", ls=":", lw=1)
    axes[0].legend(fontsize=8)
    by = collections.defaultdict(list)
    for rec in runs:
        c = rec["config"]
        rows = rec.get("trajectory") or []
        fb = (rows[-1].get("rule") or {}).get("feedback") or {}
        by[(c["rule"], c["weight_decay"])].append(
            (100 * rec["final"]["test_acc"], fb.get("mean_cos")))
    for rule, marker in [("kp", "o"), ("bp", "s")]:
        wds = sorted(w for r, w in by if r == rule)
        for w in wds:
            pts = by[(rule, w)]
            axes[2].scatter([w] * len(pts), [a for a, _ in pts], marker=marker, alpha=0.4,
                            color="C0" if rule == "kp" else "C1")
            if rule == "kp":
                axes[1].scatter([w] * len(pts), [c for _, c in pts], color="C0", alpha=0.4)
        axes[2].plot(wds, [sum(a for a, _ in by[(rule, w)]) / len(by[(rule, w)]) for w in wds],
                     marker=marker, label=rule, color="C0" if rule == "kp" else "C1")
        if rule == "kp":
            axes[1].plot(wds, [sum(c for _, c in by[(rule, w)]) / len(by[(rule, w)]) for w in wds],
                         marker=marker, color="C0")
    axes[1].set(xscale="log", xlabel="weight decay", ylabel="kp: cos(B, W) at the end",
                ylim=(0, 1.02))
    axes[1].axhline(0.9, color="gray", ls=":", lw=1)
    axes[2].set(xscale="log", xlabel="weight decay", ylabel="test accuracy (%)")
    axes[2].axhline(98.5, color="gray", ls=":", lw=1)
    axes[2].legend()
    fig.suptitle(_title(runs))
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print("wrote", out)


def cli(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", type=Path, help="the runs of protocols/wd-kp.yaml (its out)")
    parser.add_argument("out", nargs="?", help="the figure to write (.png); without it, "
                        "only the table is printed")
    args = parser.parse_args(argv)
    if not args.runs.is_dir():
        parser.error(f"runs {args.runs}: no such directory of runs")
    main(args.runs, args.out)


if __name__ == "__main__":
    cli()
