"""MT-2 report: how much of clean KP's accuracy survives traffic a local predictor
cannot model exactly, against the residual the predictor leaves (issue 37).

One point per run with traffic mixed in (``traffic_rule`` innovation or matched): its
test-accuracy gap to the clean reference (``none``) at the same grid point otherwise
(traffic model, predictor, dose, seed) against the predictor's residual / traffic ratio
at the end of training (RMS(T - prediction) / RMS(T) on the probe batch). Torch-free.
"""

from __future__ import annotations

import pandas as pd

from .figures import NotebookFigure as Figure

RULE = "rule_params.traffic_rule"
MODEL = "rule_params.traffic_model"
PREDICTOR = "rule_params.predictor"
RESIDUAL = "rule/predictor_residual_ratio"
ALIGN = "rule/signal_alignment/used/mean"
MARKERS = {"unit_affine": "o", "unit_quadratic": "s", "channel_linear": "^"}


def _setting(data, table: pd.DataFrame, key: str, default: str) -> pd.Series:
    if key in table:
        return table[key].astype(str)
    return pd.Series(str(data.protocol.fixed.get(key, default)), index=table.index)


def run_frame(data) -> pd.DataFrame:
    """Per run: its grid point, test accuracy, residual ratio, used-signal alignment and
    ``gap`` = accuracy of the matching ``none`` run minus its own (NaN for ``none``)."""
    table = data.table().set_index("run_id")
    if RULE not in table:
        raise ValueError(f"MT-2 needs the grid key {RULE!r}; this protocol's grid has "
                         f"{', '.join(sorted(data.protocol.grid))}")
    finals = data.metrics[data.metrics["axis"] == "final"].pivot_table(
        index="run_id", columns="metric", values="value", dropna=False)
    frame = pd.DataFrame({
        "traffic_model": _setting(data, table, MODEL, "linear"),
        "predictor": _setting(data, table, PREDICTOR, "unit_affine"),
        "traffic_rule": table[RULE].astype(str)}, index=table.index)
    # A dose axis (``noise``, ``mixing``) or any other grid key beside these: a column of
    # its own, so that points at different doses are never averaged together.
    for key in dose_keys(data):
        frame[_short(key)] = table[key]
    frame = frame.join(finals.reindex(columns=["test_acc", RESIDUAL, ALIGN])
                       .rename(columns={RESIDUAL: "residual", ALIGN: "align_used"}))
    keys = [k for k in data.group_keys if k != RULE and k in table] + (
        ["seed"] if "seed" in table and "seed" not in data.group_keys else [])
    pair = table[keys].astype(str).agg("|".join, axis=1) if keys else pd.Series("", table.index)
    clean = frame["test_acc"].where(frame["traffic_rule"] == "none").groupby(pair).transform(
        "max")
    frame["gap"] = (clean - frame["test_acc"]).where(frame["traffic_rule"] != "none")
    return frame


def dose_keys(data) -> list[str]:
    """The grid keys other than the traffic model, predictor, traffic rule and seed."""
    return [k for k in data.group_keys if k not in (RULE, MODEL, PREDICTOR, "seed")]


def _short(key: str) -> str:
    return key.rsplit(".", 1)[-1]


def summary(data) -> pd.DataFrame:
    """Mean over seeds of accuracy, gap, residual and alignment per grid point (traffic
    model, predictor, any dose key, traffic rule)."""
    frame = run_frame(data)
    doses = [_short(k) for k in dose_keys(data)]
    return frame.groupby(["traffic_model", "predictor", *doses, "traffic_rule"]).agg(
        test_acc=("test_acc", "mean"), gap=("gap", "mean"), residual=("residual", "mean"),
        align_used=("align_used", "mean"), seeds=("test_acc", "size"))


def gap_figure(data) -> Figure:
    """Accuracy gap to clean KP against the residual ratio: colour = traffic model,
    marker = predictor; filled = innovation, hollow = matched."""
    frame = run_frame(data).dropna(subset=["gap", "residual"])
    fig = Figure(figsize=(6.5, 4), layout="constrained")
    ax = fig.subplots()
    if frame.empty:  # every run with traffic diverged: a gap needs a finished run
        return _nothing_to_draw(fig, "no run with traffic finished (a diverged run has "
                                "no final accuracy)")
    models = sorted(frame["traffic_model"].unique())
    colours = {m: f"C{k}" for k, m in enumerate(models)}
    for (model, predictor, rule), part in frame.groupby(
            ["traffic_model", "predictor", "traffic_rule"]):
        filled = rule == "innovation"
        ax.scatter(part["residual"], part["gap"], marker=MARKERS.get(predictor, "x"),
                   facecolors=colours[model] if filled else "none",
                   edgecolors=colours[model], label=f"{model}, {predictor}, {rule}")
    ax.set_xscale("log")
    ax.axhline(0, color="grey", linewidth=0.5)
    ax.set_xlabel("predictor residual / traffic (RMS, end of training)")
    ax.set_ylabel("test acc(none) - test acc(run)")
    ax.legend(fontsize="x-small", ncol=2)
    return fig


def alignment_figure(data) -> Figure:
    """The used signal's cosine with the BP gradient (mean over populations where
    defined) against the residual ratio, innovation (filled) vs matched (hollow)."""
    frame = run_frame(data).dropna(subset=["residual", "align_used"])
    frame = frame[frame["traffic_rule"] != "none"]
    fig = Figure(figsize=(6.5, 4), layout="constrained")
    ax = fig.subplots()
    if frame.empty:  # (a protocol run with alignment_every 0 records no used-signal cosine)
        return _nothing_to_draw(fig, "no run with traffic recorded the used signal's "
                                "alignment")
    for k, rule in enumerate(("innovation", "matched")):
        part = frame[frame["traffic_rule"] == rule]
        ax.scatter(part["residual"], part["align_used"], label=rule,
                   facecolors=f"C{k}" if rule == "innovation" else "none", edgecolors=f"C{k}")
    ax.set_xscale("log")
    ax.set_xlabel("predictor residual / traffic (RMS, end of training)")
    ax.set_ylabel("cos(used signal, BP gradient)")
    ax.legend(fontsize="small")
    return fig


def _nothing_to_draw(fig: Figure, why: str) -> Figure:
    """The figure says why it is empty (a log axis over no points cannot be drawn)."""
    ax = fig.axes[0]
    ax.text(0.5, 0.5, why, ha="center", va="center", transform=ax.transAxes)
    ax.set_axis_off()
    return fig
