"""Summary tables: mean +- std over seeds, grouped by the other grid keys.

The usual statistics of repeated runs (sample mean and the ddof=1 standard deviation
over seeds), with the arguments checked: group keys and metrics given in the wrong
order are refused by name rather than summarized into nonsense.
"""

from __future__ import annotations

import math
import numbers

import numpy as np
import pandas as pd

from lab.records import RUN_COLUMNS

from .checks import check_group_keys, config_twins, dataframe, listing, names, unrun_hint

_ALL = "all runs"
_STATS = ("mean", "std", "n")
# A std that fixed decimals would show with fewer than two significant digits (0.0000 for
# 3.6e-5) is shown with this many instead.
_STD_SIGNIFICANT = 3
# A run's results, as ProtocolRuns.table() names them: what is summarized, never grouped by.
_RESULT = "final."
# Columns of the runs table that are neither grid keys nor results.
_BOOKKEEPING = frozenset(RUN_COLUMNS) | {"n_rows"}
_ORDER = "the order is summarize(table, group_keys, metrics)"


def _numeric(table: pd.DataFrame, metric: str) -> pd.Series:
    """The column as numbers (None -> NaN); a column of text is a TypeError naming it."""
    column = table[metric]
    if pd.api.types.is_numeric_dtype(column):
        return column
    try:
        return pd.to_numeric(column)
    except (TypeError, ValueError):
        examples = ", ".join(repr(v) for v in dict.fromkeys(column.dropna().tolist()[:3]))
        # Text that is neither a result nor bookkeeping is a grid or config value
        # (a rule's name): the column is most likely a group key given as a metric.
        swapped = not metric.startswith(_RESULT) and metric not in _BOOKKEEPING
        hint = (f"; {metric!r} looks like a group key: group_keys and metrics look "
                f"swapped ({_ORDER})" if swapped else "")
        raise TypeError(f"summarize: column {metric!r} is not numeric (values such as "
                        f"{examples}); metrics must be columns of numbers, e.g. "
                        f"final.test_acc{hint}") from None


def _check_not_results(group_keys: list[str], metrics: list[str]) -> None:
    """A final.* column is a run's result: grouping by it makes one group per value.
    Only the prefix decides, so a numeric grid key (weight_decay, lr) stays a group key."""
    results = [key for key in group_keys if key.startswith(_RESULT)]
    if not results:
        return
    if any(metric.startswith(_RESULT) for metric in metrics):
        hint = "group by grid keys (e.g. ProtocolRuns.group_keys) instead."
    else:
        hint = (f"group_keys and metrics look swapped ({_ORDER}); did you mean "
                f"summarize(table, {metrics!r}, {group_keys!r})?")
    raise ValueError(f"summarize: group_keys {results!r} are final.* columns (a run's "
                     f"results, not grid keys: grouping by them makes one group per value); "
                     f"{hint} To group by a result on purpose, copy it to a column without "
                     "the 'final.' prefix first")


def summarize(table: pd.DataFrame, group_keys: list[str], metrics: list[str]) -> pd.DataFrame:
    """One row per group: the group keys, then per metric ``<metric>/mean``,
    ``<metric>/std`` (sample std, ddof=1) and ``<metric>/n``, then ``n`` (runs in the
    group). The group keys are remembered in ``summary.attrs["group_keys"]`` (for
    :func:`format_mean_std`).

    A NaN (a run without that final metric, or one that recorded NaN) is left out of
    its metric's mean and std, and ``<metric>/n`` counts the values that did enter:
    a mean over 1 of 2 seeds says so (``<metric>/n`` 1, ``n`` 2; the std of one value
    is NaN). An infinite value is kept and counted: the mean is then infinite and
    the std NaN (a spread around infinity is undefined); +inf and -inf in one group
    make the mean NaN as well (undefined). :func:`format_mean_std` says which of these
    happened. The analysis notebooks refuse NaN and infinities before this
    (``check_complete``), so there every ``<metric>/n`` equals ``n``.

    ``table`` has one row per run (``ProtocolRuns.table()``); with no group keys
    (a grid over seeds only) every run is one group, labelled "all runs".
    ``group_keys`` and ``metrics`` are lists of column names (a group key named twice is
    a ValueError; a metric named twice is summarized once); a metric column must
    hold numbers. A group key may not be named like a column the summary makes
    (``n``, ``<metric>/mean``, ...).

    The two lists given in the wrong order are refused, by two rules that leave
    grouping by grid keys alone: a group key named ``final.*`` (a run's result) is a
    ValueError, decided by that prefix only, not by dtype, so grouping by a numeric
    grid key (``weight_decay``, ``lr``) stays allowed (to group by a result on purpose,
    copy it to a column without the prefix); a metric column holding text is a
    TypeError, which says the column looks like a group key when it is neither a
    ``final.*`` result nor run bookkeeping (``status``, ``run_id``, ...). A numeric
    grid key given as a metric is summarized (it is a column of numbers): nothing
    but its name says it was meant as a group key.
    """
    table = dataframe(table, "table", "the runs table, one row per run (ProtocolRuns.table())")
    group_keys = check_group_keys(group_keys, "summarize")
    metrics = names(metrics, "metrics", "column names")
    missing = [c for c in group_keys + metrics if c not in table.columns]
    if missing:
        raise KeyError(f"summarize: column(s) {', '.join(missing)} not in the table"
                       f"{config_twins(missing, table.columns)}{unrun_hint(missing, table)}; "
                       f"columns: {listing(table.columns, 20)}")
    made = ["n"] + [f"{metric}/{stat}" for metric in metrics for stat in _STATS]
    clashes = [key for key in group_keys if key in made]
    if clashes:
        raise ValueError(f"summarize: group key(s) {', '.join(map(repr, clashes))} have the "
                         "name of a column the summary makes (n, <metric>/mean, <metric>/std, "
                         "<metric>/n); rename them first, e.g. table.rename(columns="
                         f"{{{clashes[0]!r}: {clashes[0] + '_'!r}}})")
    _check_not_results(group_keys, metrics)
    if not len(table):  # a filter that matched nothing: an empty summary would pass silently
        raise ValueError("summarize: the table has no runs (one row per run is expected: "
                         "ProtocolRuns.table(); did a filter leave no rows?)")
    keys = group_keys or ["group"]
    frame = table.assign(**{metric: _numeric(table, metric) for metric in metrics})
    if not group_keys:
        frame = frame.assign(group=_ALL)
    grouped = frame.groupby(keys, sort=True, dropna=False)
    columns = {}
    for metric in metrics:
        values = grouped[metric]
        with np.errstate(invalid="ignore"):  # inf - inf: NaN, documented above
            columns[f"{metric}/mean"] = values.mean()
            columns[f"{metric}/std"] = values.std(ddof=1)
        columns[f"{metric}/n"] = values.count()
    out = pd.DataFrame(columns, index=grouped.size().index)
    out["n"] = grouped.size()
    out = out.reset_index()
    out.attrs["group_keys"] = list(keys)
    return out


def _key_columns(summary: pd.DataFrame) -> list[str]:
    """The group-key columns: as summarize remembered them, else every column that is
    not one of its statistics (a summary rebuilt from records has no attrs)."""
    remembered = summary.attrs.get("group_keys")
    if remembered is not None and all(key in summary.columns for key in remembered):
        return list(remembered)
    metrics = {c[: -len("/mean")] for c in summary.columns
               if c.endswith("/mean") and f"{c[: -len('/mean')]}/std" in summary.columns}
    made = {"n"} | {f"{metric}/{stat}" for metric in metrics for stat in _STATS}
    return [c for c in summary.columns if c not in made]


def _std_text(std: float, digits: int) -> str:
    if std != 0 and math.isfinite(std) and abs(std) < 10.0 ** (1 - digits):
        return f"{std:.{_STD_SIGNIFICANT}g}"  # 3.6e-05, not 0.0000
    return f"{std:.{digits}f}"


def _mean_text(mean: float, digits: int) -> str:
    # The std's rule for a mean too small for the decimals (an MT-1 residual ratio of
    # 1.6e-09 read "0.0000": a nonzero mean shown as zero)
    return _std_text(mean, digits)


def _cell(mean: float, std: float, count: int, digits: int) -> str:
    if count == 0:
        return "no value"
    if math.isnan(mean):  # values were there (count > 0): only inf - inf makes this
        return "undefined: +inf and -inf among the values"
    if math.isinf(mean):
        return f"{mean:.{digits}f}" + (" (no std: a value is infinite)" if count > 1 else "")
    if math.isnan(std):
        return _mean_text(mean, digits) + (" (no std: a value is not finite)" if count > 1
                                           else "")
    return f"{_mean_text(mean, digits)} ± {_std_text(std, digits)}"


def format_mean_std(summary: pd.DataFrame, digits: int = 4) -> pd.DataFrame:
    """The summary as text, ``0.9123 ± 0.0040`` per metric: a table to read, not compute on.

    The group-key columns come first, as :func:`summarize` made them (any name). The
    mean has ``digits`` decimals; so has the std, unless that would show it with fewer
    than two significant digits: then it has 3 significant figures (``0.9998 ± 3.6e-05``,
    not ``± 0.0000``); a mean that small likewise (``1.4e-09 ± 2.83e-10``, not a
    nonzero mean shown as ``0.0000``). A metric with fewer values than runs in its
    group (NaN left out, see :func:`summarize`) reads ``0.2170 (1 of 2 runs)``, a group
    of one run ``0.2170 (1 run: no std)``; an
    infinite value reads ``inf (no std: a value is infinite)``, +inf and -inf in one
    group ``undefined: +inf and -inf among the values``.

    ``summary`` must be :func:`summarize`'s output (it has the ``n`` column); any other
    table, e.g. the runs table itself, is a ValueError saying so.
    """
    summary = dataframe(summary, "summary", "summarize's output")
    if "n" not in summary.columns:
        raise ValueError("format_mean_std expects summarize's output (columns "
                         "<metric>/mean, <metric>/std, <metric>/n per metric, and n), got a "
                         f"table with columns {listing(summary.columns)}; pass "
                         "format_mean_std(summarize(table, group_keys, metrics))")
    if not len(summary):
        raise ValueError("format_mean_std: the summary has no rows (summarize's output has one "
                         "per group)")
    if isinstance(digits, bool) or not isinstance(digits, numbers.Integral):
        raise TypeError(f"format_mean_std: digits must be an int (decimals shown), got "
                        f"{digits!r} ({type(digits).__name__})")
    if not 0 <= digits <= 15:
        raise ValueError(f"format_mean_std: digits must be from 0 to 15 (decimals shown), "
                         f"got {digits}")
    means = [c for c in summary.columns if c.endswith("/mean")
             and f"{c[: -len('/mean')]}/std" in summary.columns]
    keys = _key_columns(summary)
    out = summary[keys].copy()
    for column in means:
        metric = column[: -len("/mean")]
        std = summary[f"{metric}/std"]
        counts = summary.get(f"{metric}/n", summary["n"])
        cells = []
        for m, s, k, n in zip(summary[column], std, counts, summary["n"]):
            cell = _cell(float(m), float(s), int(k), digits)
            if k != n:
                cell = f"{cell} ({k} of {n} runs)"
            elif n == 1 and not math.isnan(float(m)):  # a mean alone read as a mean over seeds
                cell = f"{cell} (1 run: no std)"
            cells.append(cell)
        out[metric] = cells
    out["n"] = summary["n"]
    return out
