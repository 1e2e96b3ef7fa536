"""The weight-decay study figure (issue 9 item 5): kp's cos(B, W) over epochs and at the
end, and test accuracy of kp and bp against the decay. Reads the runs of
``protocols/wd-kp.yaml``::

    lab sweep protocols/wd-kp.yaml
    .venv/bin/python benchmarks/fig_wd_kp.py runs/wd-kp benchmarks/results/wd-kp.png
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from lab import records  # noqa: E402


def main(root: Path, out: str) -> None:
    runs = []
    for run in sorted(root.iterdir()):
        if (run / "record.json").exists():
            rec = records.load_record(run)
            if rec.get("status") == "complete":
                runs.append(rec)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    colors = dict(zip([0.001, 0.003, 0.01, 0.03], ["#1b9e77", "#d95f02", "#7570b3", "#e7298a"]))
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
    fig.suptitle("MNIST-1D, 1-D ResNet-20, 60 epochs, SGD + Nesterov one-cycle; 2 seeds per point")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print("wrote", out)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
