"""Summary tables: mean +- std over seeds, grouped by the other grid keys."""

from __future__ import annotations

import pandas as pd

from .checks import names

_ALL = "all runs"


def _numeric(table: pd.DataFrame, metric: str) -> pd.Series:
    """The column as numbers (None -> NaN); a column of text is a TypeError naming it."""
    column = table[metric]
    if pd.api.types.is_numeric_dtype(column):
        return column
    try:
        return pd.to_numeric(column)
    except (TypeError, ValueError):
        examples = ", ".join(repr(v) for v in dict.fromkeys(column.dropna().tolist()[:3]))
        raise TypeError(f"summarize: column {metric!r} is not numeric (values such as "
                        f"{examples}); metrics must be columns of numbers, e.g. "
                        "final.test_acc") from None


def summarize(table: pd.DataFrame, group_keys: list[str], metrics: list[str]) -> pd.DataFrame:
    """One row per group: per metric ``<metric>/mean``, ``<metric>/std`` (sample std,
    ddof=1) and ``<metric>/n``, then ``n`` (runs in the group).

    A NaN (a run without that final metric, or one that recorded NaN) is left out of
    its metric's mean and std, and ``<metric>/n`` counts the values that did enter:
    a mean over 1 of 2 seeds says so (``<metric>/n`` 1, ``n`` 2; the std of one value
    is NaN). :func:`format_mean_std` marks such a metric. An infinite value is kept
    (the mean is then infinite). The analysis notebooks refuse NaN before this
    (``check_complete``), so there every ``<metric>/n`` equals ``n``.

    ``table`` has one row per run (``ProtocolRuns.table()``); with no group keys
    (a grid over seeds only) every run is one group, labelled "all runs".
    ``group_keys`` and ``metrics`` are lists of column names; a metric column must
    hold numbers.
    """
    group_keys = names(group_keys, "group_keys", "column names")
    metrics = names(metrics, "metrics", "column names")
    missing = [c for c in group_keys + metrics if c not in table.columns]
    if missing:
        raise KeyError(f"summarize: column(s) {', '.join(missing)} not in the table; "
                       f"columns: {', '.join(map(str, table.columns))}")
    keys = group_keys or ["group"]
    frame = table.assign(**{metric: _numeric(table, metric) for metric in metrics})
    if not group_keys:
        frame = frame.assign(group=_ALL)
    grouped = frame.groupby(keys, sort=True, dropna=False)
    columns = {}
    for metric in metrics:
        values = grouped[metric]
        columns[f"{metric}/mean"] = values.mean()
        columns[f"{metric}/std"] = values.std(ddof=1)
        columns[f"{metric}/n"] = values.count()
    out = pd.DataFrame(columns, index=grouped.size().index)
    out["n"] = grouped.size()
    return out.reset_index()


def format_mean_std(summary: pd.DataFrame, digits: int = 4) -> pd.DataFrame:
    """The summary as text, ``0.9123 ± 0.0040`` per metric: a table to read, not compute on.

    A metric with fewer values than runs in its group (NaN left out, see
    :func:`summarize`) reads ``0.2170 (1 of 2 runs)``.
    """
    means = [c for c in summary.columns if c.endswith("/mean")]
    keys = [c for c in summary.columns if "/" not in c and c != "n"]
    out = summary[keys].copy()
    for column in means:
        metric = column[: -len("/mean")]
        std = summary[f"{metric}/std"]
        counts = summary.get(f"{metric}/n", summary["n"])
        cells = []
        for m, s, k, n in zip(summary[column], std, counts, summary["n"]):
            cell = f"{m:.{digits}f} ± {s:.{digits}f}" if pd.notna(s) else f"{m:.{digits}f}"
            cells.append(cell if k == n else f"{cell} ({k} of {n} runs)")
        out[metric] = cells
    out["n"] = summary["n"]
    return out
