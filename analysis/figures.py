"""Figures over run records: one run's curves, and learning curves per group with seed bands.

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


def run_curves(trajectory: list[dict], fields: Sequence[tuple[str, ...]] = (
        ("train_loss", "val_loss"), ("train_acc", "val_acc")), title: str = "") -> NotebookFigure:
    """One run's per-epoch curves: one panel per tuple of fields."""
    fig = NotebookFigure(figsize=(_PANEL[0] * len(fields), _PANEL[1]), layout="constrained")
    axes = fig.subplots(1, len(fields), squeeze=False)[0]
    epochs = [row["epoch"] for row in trajectory]
    for ax, group in zip(axes, fields):
        for field in group:
            points = [(e, row.get(field)) for e, row in zip(epochs, trajectory)
                      if row.get(field) is not None]
            if points:
                ax.plot(*zip(*points), marker="o", markersize=3, label=_label(field))
        ax.set_xlabel("epoch")
        ax.legend()
    if title:
        fig.suptitle(title)
    return fig


def group_label(row: pd.Series, group_keys: Sequence[str]) -> str:
    return ", ".join(f"{key}={row[key]}" for key in group_keys) or "all runs"


def curve_bands(metrics: pd.DataFrame, table: pd.DataFrame, group_keys: Sequence[str],
                field: str) -> pd.DataFrame:
    """Per group and epoch: mean, std (over seeds, ddof=1) and n of ``field``."""
    rows = metrics[(metrics["axis"] == "epoch") & (metrics["metric"] == field)]
    labels = table.assign(group=[group_label(r, group_keys) for _, r in table.iterrows()])
    rows = rows.merge(labels[["run_id", "group"]], on="run_id")
    stats = rows.groupby(["group", "index"])["value"].agg(["mean", "std", "count"])
    return stats.rename(columns={"count": "n"}).reset_index().rename(columns={"index": "epoch"})


def learning_curves(metrics: pd.DataFrame, table: pd.DataFrame, group_keys: Sequence[str],
                    fields: Sequence[str] = ("train_loss", "val_acc")) -> NotebookFigure:
    """One panel per field; per group (e.g. rule) the mean over seeds with a +-1 std band.

    ``metrics`` is the tidy table (``lab.records.load_metrics``); ``table`` maps
    run_id to its grid values (``ProtocolRuns.table()``).
    """
    fig = NotebookFigure(figsize=(_PANEL[0] * len(fields), _PANEL[1]), layout="constrained")
    axes = fig.subplots(1, len(fields), squeeze=False)[0]
    for ax, field in zip(axes, fields):
        bands = curve_bands(metrics, table, group_keys, field)
        for group, rows in bands.groupby("group", sort=True):
            line, = ax.plot(rows["epoch"], rows["mean"], label=f"{group} (n={rows['n'].max()})")
            std = rows["std"].fillna(0.0)  # one seed: no band
            ax.fill_between(rows["epoch"], rows["mean"] - std, rows["mean"] + std,
                            color=line.get_color(), alpha=0.25, linewidth=0)
        ax.set_xlabel("epoch")
        ax.set_ylabel(_label(field))
        if ax.lines:
            ax.legend(fontsize="small")
    return fig
