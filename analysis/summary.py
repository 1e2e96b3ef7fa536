"""Summary tables: mean +- std over seeds, grouped by the other grid keys."""

from __future__ import annotations

import pandas as pd

_ALL = "all runs"


def summarize(table: pd.DataFrame, group_keys: list[str], metrics: list[str]) -> pd.DataFrame:
    """One row per group: ``<metric>/mean``, ``<metric>/std`` (sample std, ddof=1;
    NaN for one seed) and ``n`` (runs in the group).

    ``table`` has one row per run (``ProtocolRuns.table()``); with no group keys
    (a grid over seeds only) every run is one group, labelled "all runs".
    """
    missing = [c for c in list(group_keys) + list(metrics) if c not in table.columns]
    if missing:
        raise KeyError(f"summarize: column(s) {', '.join(missing)} not in the table; "
                       f"columns: {', '.join(map(str, table.columns))}")
    keys = list(group_keys) or ["group"]
    frame = table if group_keys else table.assign(group=_ALL)
    grouped = frame.groupby(keys, sort=True, dropna=False)
    columns = {}
    for metric in metrics:
        values = grouped[metric]
        columns[f"{metric}/mean"] = values.mean()
        columns[f"{metric}/std"] = values.std(ddof=1)
    out = pd.DataFrame(columns)
    out["n"] = grouped.size()
    return out.reset_index()


def format_mean_std(summary: pd.DataFrame, digits: int = 4) -> pd.DataFrame:
    """The summary as text, ``0.9123 ± 0.0040`` per metric: a table to read, not compute on."""
    means = [c for c in summary.columns if c.endswith("/mean")]
    keys = [c for c in summary.columns if "/" not in c and c != "n"]
    out = summary[keys].copy()
    for column in means:
        metric = column[: -len("/mean")]
        std = summary[f"{metric}/std"]
        out[metric] = [f"{m:.{digits}f} ± {s:.{digits}f}" if pd.notna(s) else f"{m:.{digits}f}"
                       for m, s in zip(summary[column], std)]
    out["n"] = summary["n"]
    return out
