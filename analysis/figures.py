"""Figures over run records: one run's curves, and learning curves per group with seed bands.

Curves follow the runs' own axis: ``epoch`` rows or ``step`` rows (whichever
the data has; an explicit ``axis`` picks one). Groups are any columns of the
protocol's table (``ProtocolRuns.table()``: grid keys, dotted ones included).

Figures are :class:`NotebookFigure`, a ``matplotlib.figure.Figure`` without
pyplot state: they work under the Agg backend in scripts, and a notebook cell
that returns one shows it as PNG without importing pyplot or the inline
backend (which would cost every papermill run a noticeable part of a second).

Arguments are checked before drawing: the two tables given in the wrong order, a
run record where its rows are expected, or no rows at all, is an error naming the
parameter and what it lacks, not a bare KeyError or an empty figure.
"""

from __future__ import annotations

import io
import textwrap
from collections.abc import Sequence
from typing import TYPE_CHECKING

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from lab.records import TIDY_COLUMNS

from .checks import check_group_keys, config_twins, dataframe, listing, names

if TYPE_CHECKING:  # (tables arrive made: a training notebook's curves need no pandas)
    import pandas as pd

_PANEL = (4.2, 3.2)
_STYLES = ("-", "--", "-.", ":")  # per group, with the colour


class NotebookFigure(Figure):
    """A Figure that IPython displays as PNG by itself (``_repr_png_``)."""

    def _repr_png_(self) -> bytes:
        buffer = io.BytesIO()
        self.savefig(buffer, format="png", dpi=100)
        return buffer.getvalue()


def style_axes(ax, xlabel: str, ylabel: str | None = None) -> None:
    """Axis labels, a long y label wrapped to the panel's height (it was cut off), and
    whole epochs on an epoch axis (ticks fell on 0.25 epochs)."""
    ax.set_xlabel(xlabel)
    if ylabel is not None:
        ax.set_ylabel(textwrap.fill(ylabel, 34))
    if xlabel == "epoch":
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _label(field: str) -> str:
    return field.replace("_", " ")


AXES = ("epoch", "step")


def run_curves(trajectory: list[dict], fields: Sequence[tuple[str, ...]] = (
        ("train_loss", "val_loss"), ("train_acc", "val_acc")), title: str = "") -> NotebookFigure:
    """One run's curves over its rows (per epoch, or per step): one panel per
    tuple of fields, e.g. ``[("train_loss", "val_loss")]``; a field no row has is
    left out of its panel (a run without validation has no val_loss).

    ``trajectory`` is the list of rows itself, ``record["trajectory"]`` (epoch rows)
    or ``record["steps"]`` (step rows) of ``lab.records.load_record``: the record
    (a dict) is refused with a message saying so, rather than guessing the axis;
    no rows at all is a ValueError, not an empty figure."""
    trajectory = _rows(trajectory)
    fields = _panels(fields)
    fig = NotebookFigure(figsize=(_PANEL[0] * len(fields), _PANEL[1]), layout="constrained")
    axes = fig.subplots(1, len(fields), squeeze=False)[0]
    axis = next((name for name in AXES if trajectory and name in trajectory[0]), "epoch")
    xs = [row.get(axis) for row in trajectory]
    have = sorted({key for row in trajectory for key in row})
    for group in fields:
        grouped = [f for f in group if any(isinstance(row.get(f), dict) for row in trajectory)]
        if grouped:
            inner = sorted({k for row in trajectory for k in (row.get(grouped[0]) or {})})
            raise TypeError(f"run_curves: field {grouped[0]!r} is a group of fields "
                            f"({listing(inner, 8)}), not one; these rows keep it nested "
                            f"(load_metrics names its members {grouped[0]}/<name>): draw "
                            f"members from the tidy metrics with curve_bands")
        if not any(row.get(f) is not None for f in group for row in trajectory):
            # One missing field is normal (a run without validation has no val_loss);
            # a panel with none of its fields is a typo, or the other axis's rows.
            raise ValueError(f"run_curves: no row has any of {', '.join(map(repr, group))}; "
                             f"the rows' fields: {listing(have, 20)} (names with '/', as "
                             f"load_metrics gives them, are nested here: use curve_bands)")
    for ax, group in zip(axes, fields):
        for field in group:
            points = [(x, row.get(field)) for x, row in zip(xs, trajectory)
                      if row.get(field) is not None]
            if points:
                ax.plot(*zip(*points), marker="o" if len(points) <= 50 else None,
                        markersize=3, label=_label(field))
        style_axes(ax, axis)
        if ax.lines:
            ax.legend()
    if title:
        fig.suptitle(title)
    return fig


def _rows(trajectory) -> list[dict]:
    """run_curves' ``trajectory``: a non-empty list of row dicts."""
    take = ("pass record['trajectory'] (epoch rows) or record['steps'] (step rows) of "
            "lab.records.load_record(run_dir)")
    if isinstance(trajectory, dict):
        raise TypeError(f"run_curves: trajectory must be a list of row dicts (one per epoch "
                        f"or step), got a dict, not its rows (keys {listing(trajectory, 5)}); "
                        f"{take}")
    if not isinstance(trajectory, list | tuple):
        shown = repr(trajectory)
        shown = shown if len(shown) <= 80 else f"{shown[:77]}..."
        raise TypeError(f"run_curves: trajectory must be a list of row dicts (one per epoch "
                        f"or step), got {shown} ({type(trajectory).__name__}); {take}")
    if not trajectory:
        raise ValueError("run_curves: no rows to draw: trajectory is empty (a run with no "
                         "rows on this axis yet; its other axis, if any, is record['steps'] "
                         "or record['trajectory'])")
    bad = next((i for i, row in enumerate(trajectory) if not isinstance(row, dict)), None)
    if bad is not None:
        raise TypeError(f"run_curves: trajectory must be a list of row dicts (one per epoch "
                        f"or step), but trajectory[{bad}] is {trajectory[bad]!r} "
                        f"({type(trajectory[bad]).__name__}); {take}")
    return list(trajectory)


def _panels(fields) -> list[tuple[str, ...]]:
    """run_curves' ``fields``: a non-empty list of tuples of names, one tuple per panel."""
    expected = ("a list of tuples of field names, one tuple per panel, e.g. "
                "[('train_loss', 'val_loss'), ('train_acc',)]")
    ok = isinstance(fields, list | tuple) and len(fields) > 0 and all(
        isinstance(panel, list | tuple) and panel and all(isinstance(f, str) for f in panel)
        for panel in fields)
    if not ok:
        raise TypeError(f"run_curves: fields must be {expected}; got {fields!r}")
    return [tuple(panel) for panel in fields]


def group_label(row: pd.Series, group_keys: Sequence[str]) -> str:
    return ", ".join(f"{key}={row[key]}" for key in group_keys) or "all runs"


def row_axis(metrics: pd.DataFrame, fields: Sequence[str] = ()) -> str:
    """The axis the rows of ``fields`` are on: "epoch" when any are, else "step"."""
    fields = names(fields, "fields")
    rows = metrics[metrics["metric"].isin(list(fields))] if len(fields) else metrics
    on_epochs = (rows["axis"] == "epoch").any()
    return "step" if not on_epochs and (rows["axis"] == "step").any() else "epoch"


def curve_bands(metrics: pd.DataFrame, table: pd.DataFrame, group_keys: Sequence[str],
                field: str, axis: str | None = None) -> pd.DataFrame:
    """Per group and row (epoch or step; the column is named after the axis):
    mean, std (over seeds, ddof=1) and n of ``field``. A field that none of the table's
    runs logged (on ``axis``, when given) is a ValueError naming the fields there are,
    not an empty frame."""
    group_keys = check_group_keys(group_keys, "curve_bands")
    check_tables("curve_bands", metrics, table, group_keys)
    if not isinstance(field, str):
        raise TypeError(f"curve_bands: field must be one metric name (str), got {field!r} "
                        f"({type(field).__name__})")
    _check_axis(axis)
    _check_fields("curve_bands", metrics, table, [field], axis)
    if axis is None:
        _one_axis("curve_bands", metrics, table, field)
    axis = axis or row_axis(metrics, [field])
    rows = metrics[(metrics["axis"] == axis) & (metrics["metric"] == field)]
    labels = table.assign(group=[group_label(r, group_keys) for _, r in table.iterrows()])
    rows = rows.merge(labels[["run_id", "group"]], on="run_id")
    stats = rows.groupby(["group", "index"])["value"].agg(["mean", "std", "count"])
    return stats.rename(columns={"count": "n"}).reset_index().rename(columns={"index": axis})


def _one_axis(function: str, metrics: pd.DataFrame, table: pd.DataFrame, field: str) -> None:
    """With no ``axis`` given, the table's runs must log ``field`` on one axis: a conv
    run logs train_loss per epoch, an EP or CfC run per step, and a table of both once
    drew the epoch runs alone, the others gone without a word."""
    rows = metrics[(metrics["metric"] == field) & metrics["run_id"].isin(set(table["run_id"]))]
    on = {axis: set(rows.loc[rows["axis"] == axis, "run_id"]) for axis in AXES}
    step_only = sorted(on["step"] - on["epoch"])
    if on["epoch"] and step_only:
        raise ValueError(f"{function}: the table's runs log {field!r} on different axes: "
                         f"{len(on['epoch'])} per epoch ({listing(sorted(on['epoch']), 4)}), "
                         f"{len(step_only)} per step only ({listing(step_only, 4)}); pass "
                         f"axis='epoch' or axis='step' (runs without that axis are left "
                         f"out), or split the table by its kind column")


_METRICS = "the tidy metrics table (ProtocolRuns.metrics or lab.records.load_metrics)"
_TABLE = "the runs table, one row per run (ProtocolRuns.table())"


def check_tables(function: str, metrics, table, group_keys: list[str],
                 order: str | None = None) -> None:
    """``metrics`` has the tidy columns and ``table`` run_id and the group keys; the
    two tables given in the wrong order (a natural slip: both are DataFrames of one
    protocol) are named as swapped, with the call's order (``order``, by default
    ``<function>(metrics, table, group_keys, ...)``)."""
    dataframe(metrics, "metrics", _METRICS)
    dataframe(table, "table", _TABLE)
    tidy = list(TIDY_COLUMNS)
    swapped = (set(tidy) <= set(table.columns) and not set(tidy) <= set(metrics.columns))
    order = order or f"{function}(metrics, table, group_keys, ...)"
    hint = f"; metrics and table look swapped (the order is {order})" if swapped else ""
    lacking = [column for column in tidy if column not in metrics.columns]
    if lacking:
        raise ValueError(f"{function}: metrics lacks column(s) {listing(lacking)}: it must be "
                         f"{_METRICS}, with columns {listing(tidy)}; got columns "
                         f"{listing(metrics.columns)}{hint}")
    lacking = [column for column in ["run_id", *group_keys] if column not in table.columns]
    if lacking:
        raise ValueError(f"{function}: table lacks column(s) {listing(lacking)}"
                         f"{config_twins(lacking, table.columns)}: it must be "
                         f"{_TABLE}, with run_id and the group keys; got columns "
                         f"{listing(table.columns)}{hint}")


def _check_axis(axis) -> None:
    if axis is not None and axis not in AXES:
        raise ValueError(f"axis must be one of {', '.join(map(repr, AXES))} (or None: the "
                         f"axis the field is logged on), got {axis!r}")


def _listing(values, limit: int = 30) -> str:
    values = sorted(values)
    shown = ", ".join(values[:limit])
    return shown + (f", ... ({len(values) - limit} more)" if len(values) > limit else "") \
        if values else "none"


def _check_fields(function: str, metrics: pd.DataFrame, table: pd.DataFrame,
                  fields: list[str], axis: str | None) -> None:
    """Every field has rows among the table's runs (on ``axis`` when given)."""
    if not len(table):  # said as summarize says it, not as "no run has the fields"
        raise ValueError(f"{function}: the table has no runs (one row per run is expected: "
                         "ProtocolRuns.table(); did a filter leave no rows?)")
    rows = metrics[metrics["run_id"].isin(set(table["run_id"])) & metrics["axis"].isin(AXES)]
    if axis is not None:
        rows = rows[rows["axis"] == axis]
    have = set(rows["metric"])
    unknown = [field for field in fields if field not in have]
    if unknown:
        where = f"on the {axis} axis" if axis else "on the epoch or step axis"
        raise ValueError(f"{function}: no run of the table has field(s) "
                         f"{', '.join(map(repr, unknown))} {where}; fields there: "
                         f"{_listing(have)}")


def learning_curves(metrics: pd.DataFrame, table: pd.DataFrame, group_keys: Sequence[str],
                    fields: Sequence[str] = ("train_loss", "val_acc"),
                    axis: str | None = None) -> NotebookFigure:
    """One panel per field; per group (any grid keys, e.g. a rule or a
    ``rule_params.*`` value) the mean over seeds with a +-1 std band.

    ``metrics`` is the tidy table (``lab.records.load_metrics``); ``table`` maps
    run_id to its grid values (``ProtocolRuns.table()``); ``axis``: "epoch" or
    "step" (default: the axis the fields are logged on). A field that none of
    the table's runs logged (on ``axis``, when given) is a ValueError naming it
    and the fields there are, not an empty panel.
    """
    group_keys = check_group_keys(group_keys, "learning_curves")
    fields = names(fields, "fields")
    if not fields:
        raise ValueError("learning_curves: fields is empty; name at least one metric to "
                         "draw, e.g. ['train_loss']")
    check_tables("learning_curves", metrics, table, group_keys)
    _check_axis(axis)
    _check_fields("learning_curves", metrics, table, fields, axis)
    if axis is None:
        for field in fields:
            _one_axis("learning_curves", metrics, table, field)
    # At most three panels a row: six in one row became unreadably small in a notebook.
    cols = min(3, len(fields))
    n_rows = -(-len(fields) // cols)
    fig = NotebookFigure(figsize=(_PANEL[0] * cols, _PANEL[1] * n_rows + 0.6),
                         layout="constrained")
    axes = fig.subplots(n_rows, cols, squeeze=False).ravel()
    for ax in axes[len(fields):]:
        ax.set_visible(False)
    handles: dict[str, object] = {}  # group -> its line for the figure's legend
    for ax, field in zip(axes, fields):
        on = axis or row_axis(metrics, [field])
        bands = curve_bands(metrics, table, group_keys, field, on)
        empty = []
        for k, (group, rows) in enumerate(bands.groupby("group", sort=True)):
            n = rows["n"]
            if not n.max():  # no finite value at all (an undefined cosine): said, not drawn
                empty.append(group)
                continue
            # A seed with no value at a row (NaN): the mean there is over fewer seeds, drawn
            # as an open circle, and the label gives n's range.
            count = f"n={n.max()}" if n.min() == n.max() else f"n={n.min()}-{n.max()}"
            # Colour and style by the group's place, in every panel alike (one legend for
            # all); styles too, so groups with equal values do not hide each other. A few
            # evaluations (val_acc at two steps) get markers: a bare segment between two
            # points read as a measured curve.
            line, = ax.plot(rows[on], rows["mean"], color=f"C{k % 10}",
                            linestyle=_STYLES[k % len(_STYLES)],
                            marker="." if len(rows) <= 12 else None, label=f"{group} ({count})")
            std = rows["std"].fillna(0.0)  # one seed: no band
            ax.fill_between(rows[on], rows["mean"] - std, rows["mean"] + std,
                            color=line.get_color(), alpha=0.25, linewidth=0)
            fewer = rows[n < n.max()]
            if len(fewer):
                ax.plot(fewer[on], fewer["mean"], "o", markerfacecolor="none",
                        markersize=5, color=line.get_color(), label="_fewer seeds")
            if group not in handles or "-" in count:  # a range, wherever seen, is said
                handles[group] = line
        if empty:
            ax.text(0.02, 0.98, f"no value for: {', '.join(empty)}", transform=ax.transAxes,
                    ha="left", va="top", fontsize="x-small", wrap=True)
        style_axes(ax, on, _label(field))
    if handles:
        # One legend for every panel, below them: inside a panel it covered the curves.
        fig.legend(list(handles.values()), [h.get_label() for h in handles.values()],
                   loc="outside lower center", ncol=min(3, len(handles)), fontsize="small",
                   title="mean over seeds, band +-1 std (open circle: fewer seeds there)",
                   title_fontsize="small")
    return fig
