"""Figures over run records: one run's curves, and learning curves per group with seed bands.

Curves follow the runs' own axis: ``epoch`` rows or ``step`` rows (whichever
the data has; an explicit ``axis`` picks one). Groups are any columns of the
protocol's table (``ProtocolRuns.table()``: grid keys, dotted ones included).

Figures are :class:`NotebookFigure`, a ``matplotlib.figure.Figure`` without
pyplot state: they work under the Agg backend in scripts, and a notebook cell
that returns one shows it as PNG without importing pyplot or the inline
backend (which would cost every papermill run a noticeable part of a second).
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import pandas as pd
from matplotlib.figure import Figure

_PANEL = (4.2, 3.2)


class NotebookFigure(Figure):
    """A Figure that IPython displays as PNG by itself (``_repr_png_``)."""

    def _repr_png_(self) -> bytes:
        buffer = io.BytesIO()
        self.savefig(buffer, format="png", dpi=100)
        return buffer.getvalue()


def _label(field: str) -> str:
    return field.replace("_", " ")


AXES = ("epoch", "step")


def run_curves(trajectory: list[dict], fields: Sequence[tuple[str, ...]] = (
        ("train_loss", "val_loss"), ("train_acc", "val_acc")), title: str = "") -> NotebookFigure:
    """One run's curves over its rows (per epoch, or per step): one panel per
    tuple of fields."""
    fig = NotebookFigure(figsize=(_PANEL[0] * len(fields), _PANEL[1]), layout="constrained")
    axes = fig.subplots(1, len(fields), squeeze=False)[0]
    axis = next((name for name in AXES if trajectory and name in trajectory[0]), "epoch")
    xs = [row.get(axis) for row in trajectory]
    for ax, group in zip(axes, fields):
        for field in group:
            points = [(x, row.get(field)) for x, row in zip(xs, trajectory)
                      if row.get(field) is not None]
            if points:
                ax.plot(*zip(*points), marker="o" if len(points) <= 50 else None,
                        markersize=3, label=_label(field))
        ax.set_xlabel(axis)
        if ax.lines:
            ax.legend()
    if title:
        fig.suptitle(title)
    return fig


def group_label(row: pd.Series, group_keys: Sequence[str]) -> str:
    return ", ".join(f"{key}={row[key]}" for key in group_keys) or "all runs"


def row_axis(metrics: pd.DataFrame, fields: Sequence[str] = ()) -> str:
    """The axis the rows of ``fields`` are on: "epoch" when any are, else "step"."""
    rows = metrics[metrics["metric"].isin(list(fields))] if len(fields) else metrics
    on_epochs = (rows["axis"] == "epoch").any()
    return "step" if not on_epochs and (rows["axis"] == "step").any() else "epoch"


def curve_bands(metrics: pd.DataFrame, table: pd.DataFrame, group_keys: Sequence[str],
                field: str, axis: str | None = None) -> pd.DataFrame:
    """Per group and row (epoch or step; the column is named after the axis):
    mean, std (over seeds, ddof=1) and n of ``field``."""
    axis = axis or row_axis(metrics, [field])
    rows = metrics[(metrics["axis"] == axis) & (metrics["metric"] == field)]
    labels = table.assign(group=[group_label(r, group_keys) for _, r in table.iterrows()])
    rows = rows.merge(labels[["run_id", "group"]], on="run_id")
    stats = rows.groupby(["group", "index"])["value"].agg(["mean", "std", "count"])
    return stats.rename(columns={"count": "n"}).reset_index().rename(columns={"index": axis})


def learning_curves(metrics: pd.DataFrame, table: pd.DataFrame, group_keys: Sequence[str],
                    fields: Sequence[str] = ("train_loss", "val_acc"),
                    axis: str | None = None) -> NotebookFigure:
    """One panel per field; per group (any grid keys, e.g. a rule or a
    ``rule_params.*`` value) the mean over seeds with a +-1 std band.

    ``metrics`` is the tidy table (``lab.records.load_metrics``); ``table`` maps
    run_id to its grid values (``ProtocolRuns.table()``); ``axis``: "epoch" or
    "step" (default: the axis the fields are logged on).
    """
    fig = NotebookFigure(figsize=(_PANEL[0] * len(fields), _PANEL[1]), layout="constrained")
    axes = fig.subplots(1, len(fields), squeeze=False)[0]
    for ax, field in zip(axes, fields):
        on = axis or row_axis(metrics, [field])
        bands = curve_bands(metrics, table, group_keys, field, on)
        for group, rows in bands.groupby("group", sort=True):
            line, = ax.plot(rows[on], rows["mean"], label=f"{group} (n={rows['n'].max()})")
            std = rows["std"].fillna(0.0)  # one seed: no band
            ax.fill_between(rows[on], rows["mean"] - std, rows["mean"] + std,
                            color=line.get_color(), alpha=0.25, linewidth=0)
        ax.set_xlabel(on)
        ax.set_ylabel(_label(field))
        if ax.lines:
            ax.legend(fontsize="small")
    return fig
