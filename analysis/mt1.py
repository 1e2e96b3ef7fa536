"""MT-1: Kolen-Pollack under mixed apical traffic, raw vs matched vs innovation.

The protocol (``protocols/mt1.yaml``) runs ``kp_traffic`` with
``rule_params.traffic_rule`` in {none, raw, matched, innovation}: ``none`` is
clean KP with the same traffic formed and logged (the reference), the others
let the traffic into plasticity as it is, at the innovation's norm, or after
the local predictor has removed what it can. This module checks the runs hold
everything the comparison needs (one error listing every gap) and draws it:
final accuracy and loss per condition, feedback cosine and the five
mixed-apical RMS trajectories, the innovation/traffic and used/instruction
ratios over training, the predictor's residual ratio, and each signal's
alignment with the true gradient.
"""

from __future__ import annotations

import pandas as pd

from .figures import NotebookFigure as Figure

CONDITION = "rule_params.traffic_rule"
SIGNALS = ("used", "instruction", "raw", "innovation", "traffic")
ALIGNED = ("instruction", "raw", "innovation", "matched", "used")
ROW_METRICS = (
    "train_loss", "rule/feedback/mean_cos", "rule/feedback/min_cos",
    "rule/feedback/mean_rel_err", "rule/feedback/max_rel_err",
    *(f"rule/apical/rms_{s}/mean" for s in SIGNALS),
)
# The predictor's residual ratio and the signal alignments are required too, but
# may be undefined (NaN) when a condition silenced the network: a population with
# no active unit carries no traffic and sends no instruction below it. That is a
# result, not a gap: ``silent_populations`` (required, finite) says how many.
FINAL_METRICS = ("test_acc", "test_loss", "rule/silent_populations")
MEASURED = ("rule/predictor_residual_ratio",
            *(f"rule/signal_alignment/{s}/mean" for s in ALIGNED))


def check_mt1_complete(data) -> None:
    """Every run complete with the MT-1 trajectories and final diagnostics (one error).

    The diagnostics in ``MEASURED`` must be present; they may be NaN only in a run
    with silent populations (see above), and then the tables show NaN. A protocol
    without the ``rule_params.traffic_rule`` grid key is not MT-1: one ValueError
    says so, instead of a list of everything such runs lack.
    """
    from .completeness import IncompleteProtocolError, find_problems

    _table(data)
    problems = find_problems(data.runs, data.metrics, data.expected_ids, ROW_METRICS,
                             FINAL_METRICS)
    finals = data.metrics[data.metrics["axis"] == "final"]
    for run_id in data.expected_ids:
        mine = finals[finals["run_id"] == run_id].set_index("metric")["value"]
        if not len(mine):
            continue
        for name in MEASURED:
            if name not in mine:
                problems.append(f"{run_id}: final field {name!r} missing")
            elif mine[name] != mine[name] and not mine.get("rule/silent_populations", 0) > 0:
                problems.append(f"{run_id}: final field {name!r} is non-finite (nan) although "
                                "no population is silent")
    if problems:
        lines = "\n".join(f"  - {line}" for line in problems)
        raise IncompleteProtocolError(
            f"incomplete data: {len(problems)} problem(s) across {len(data.expected_ids)} "
            f"expected runs (only complete data is summarised; rerun the sweep to fill the "
            f"gaps):\n{lines}", problems)


def _table(data) -> pd.DataFrame:
    table = data.table()
    if CONDITION not in table:
        raise ValueError(f"MT-1 needs the grid key {CONDITION!r}; this protocol's grid has "
                         f"{', '.join(sorted(data.protocol.grid))}")
    return table


def final_table(data) -> pd.DataFrame:
    """Per condition, mean and std over seeds of accuracy, loss and the final diagnostics."""
    table = _table(data)
    finals = data.metrics[data.metrics["axis"] == "final"].pivot_table(
        index="run_id", columns="metric", values="value")
    columns = ["test_acc", "test_loss", "rule/silent_populations", *MEASURED]
    frame = finals[columns].join(table.set_index("run_id")[CONDITION])
    frame = frame.rename(columns=lambda c: c.replace("rule/signal_alignment/", "align_")
                         .replace("/mean", "").replace("rule/", ""))
    stats = frame.groupby(CONDITION).agg(["mean", "std"])
    stats.columns = [f"{a}/{b}" for a, b in stats.columns]
    return stats


def epoch_frame(data, metric: str) -> pd.DataFrame:
    """Mean over seeds per (condition, epoch) of one per-epoch metric."""
    table = _table(data)
    rows = data.metrics[(data.metrics["axis"] == "epoch") & (data.metrics["metric"] == metric)]
    rows = rows.merge(table[["run_id", CONDITION]], on="run_id")
    return rows.groupby([CONDITION, "index"])["value"].mean().unstack(CONDITION)


def ratio_frame(data, numerator: str, denominator: str) -> pd.DataFrame:
    """Per condition and epoch, the mean over seeds of RMS(numerator) / RMS(denominator)."""
    table = _table(data)
    m = data.metrics[data.metrics["axis"] == "epoch"]
    wide = m[m["metric"].isin([f"rule/apical/rms_{numerator}/mean",
                               f"rule/apical/rms_{denominator}/mean"])]
    wide = wide.pivot_table(index=["run_id", "index"], columns="metric", values="value")
    ratio = (wide[f"rule/apical/rms_{numerator}/mean"]
             / wide[f"rule/apical/rms_{denominator}/mean"]).rename("value").reset_index()
    ratio = ratio.merge(table[["run_id", CONDITION]], on="run_id")
    return ratio.groupby([CONDITION, "index"])["value"].mean().unstack(CONDITION)


def lines(frame: pd.DataFrame, ylabel: str, *, log: bool = False) -> Figure:
    """One line per condition over epochs."""
    fig = Figure(figsize=(5.5, 3.4), layout="constrained")
    ax = fig.subplots()
    for condition in frame.columns:
        ax.plot(frame.index, frame[condition], label=condition)
    ax.set_xlabel("epoch")
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.legend(fontsize="small", title="traffic_rule")
    return fig


def rms_panels(data) -> Figure:
    """The five mixed-apical RMS trajectories, one panel per condition (log scale)."""
    conditions = sorted(_table(data)[CONDITION].unique())
    fig = Figure(figsize=(3.2 * len(conditions), 3.0), layout="constrained")
    axes = fig.subplots(1, len(conditions), squeeze=False, sharey=True).ravel()
    for ax, condition in zip(axes, conditions):
        for signal in SIGNALS:
            frame = epoch_frame(data, f"rule/apical/rms_{signal}/mean")
            ax.plot(frame.index, frame[condition], label=signal)
        ax.set_title(condition)
        ax.set_yscale("log")
        ax.set_xlabel("epoch")
    axes[0].set_ylabel("RMS (mean over populations)")
    axes[-1].legend(fontsize="small")
    return fig


def alignment_bars(data) -> Figure:
    """Mean over populations and seeds of cos(signal, true gradient), per condition."""
    stats = final_table(data)
    fig = Figure(figsize=(7, 3.2), layout="constrained")
    ax = fig.subplots()
    width = 0.8 / len(ALIGNED)
    for k, signal in enumerate(ALIGNED):
        xs = [i + k * width for i in range(len(stats))]
        ax.bar(xs, stats[f"align_{signal}/mean"], width, yerr=stats[f"align_{signal}/std"]
               .fillna(0), capsize=2, label=signal)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(stats))], stats.index)
    ax.set_ylabel("cos(signal, BP gradient)")
    ax.axhline(0, color="grey", linewidth=0.5)
    ax.legend(fontsize="small", ncol=3)
    return fig
