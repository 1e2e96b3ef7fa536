"""Argument checks shared by the analyses: a researcher's mistake gets one sentence
naming the parameter, the value given and what is expected, not a raw pandas or
matplotlib error (or, worse, a bare string iterated letter by letter).

The analysis notebooks call :func:`check_names` on their list parameters first, so
``-p final_fields test_acc`` fails with "final_fields must be a list of metric
names, got 'test_acc' (str)".
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from typing import TYPE_CHECKING

import numpy as np

from lab.records import another_trainers, check_flag

if TYPE_CHECKING:
    import pandas as pd


def _pandas():
    """pandas if it is loaded, else None: a value cannot be a pandas object before, and a
    training notebook drawing its curves (``figures.run_curves``) never needs pandas."""
    return sys.modules.get("pandas")


def _lists() -> tuple:
    # Sequences of names that are taken as lists. A str is a sequence too, which is
    # exactly the mistake refused here.
    pd = _pandas()
    return (list, tuple, np.ndarray) + ((pd.Index, pd.Series) if pd is not None else ())


def names(value, parameter: str, what: str = "metric names") -> list[str]:
    """``value`` (a list or tuple of str) as a list; anything else is a TypeError
    naming ``parameter``, the value and what is expected."""
    if not isinstance(value, _lists()) or (isinstance(value, np.ndarray) and value.ndim != 1):
        raise TypeError(f"{parameter} must be a list of {what}, got {value!r} "
                        f"({type(value).__name__})")
    items = list(value)
    bad = [item for item in items if not isinstance(item, str)]
    if bad:
        raise TypeError(f"{parameter} must be a list of {what}, got {items!r} "
                        f"({bad[0]!r} is {type(bad[0]).__name__}, not a name)")
    return items


def check_group_keys(value, function: str) -> list[str]:
    """``group_keys`` as a list of column names (see :func:`names`), each named once: a
    repeated key would reach pandas as a column inserted twice ("cannot insert rule,
    already exists") or label every group "rule=bp, rule=bp"."""
    items = names(value, "group_keys", "column names")
    repeated = [key for key, count in Counter(items).items() if count > 1]
    if repeated:
        raise ValueError(f"{function}: group_keys names {', '.join(map(repr, repeated))} more "
                         f"than once ({items!r}); give each column once, e.g. "
                         f"{list(dict.fromkeys(items))!r}")
    return items


def flag(value, function: str, parameter: str) -> bool:
    """A keyword flag as a bool; "no", 0 or None is a TypeError naming ``parameter``
    (as lab.records' flags: truthiness would read "no" as True)."""
    return check_flag(value, function, parameter)


def check_names(**lists) -> None:
    """Check each keyword argument is a list of metric names (see :func:`names`),
    the parameter named by its keyword: ``check_names(final_fields=final_fields)``."""
    for parameter, value in lists.items():
        names(value, parameter)


def path_like(value, parameter: str, what: str) -> None:
    """A str or os.PathLike, not empty; otherwise a TypeError naming ``parameter``."""
    if isinstance(value, str) and value.strip():
        return
    if isinstance(value, os.PathLike):
        return
    raise TypeError(f"{parameter} must be {what}, got {value!r} ({type(value).__name__})")


def dataframe(value, parameter: str, what: str) -> pd.DataFrame:
    """``value`` if it is a DataFrame; otherwise a TypeError naming ``parameter``, what
    was given and what is expected (``what``: e.g. "the runs table, ProtocolRuns.table()")."""
    pd = _pandas()
    if pd is not None and isinstance(value, pd.DataFrame):
        return value
    shown = repr(value)
    shown = shown if len(shown) <= 80 else f"{shown[:77]}..."
    raise TypeError(f"{parameter} must be {what} (a pandas DataFrame), got {shown} "
                    f"({type(value).__name__})")


def listing(values, limit: int = 12) -> str:
    """Column names for a message: ``'a', 'b', ... (3 more)``, or "none"."""
    values = [str(v) for v in values]
    shown = ", ".join(map(repr, values[:limit]))
    more = f", ... ({len(values) - limit} more)" if len(values) > limit else ""
    return shown + more if values else "none"


def config_twins(missing, columns) -> str:
    """A hint for columns a table lacks under their plain names but holds as
    ``config.<name>`` (``records.load_runs`` names config fields so; the protocol tables
    of ``ProtocolRuns.table()`` name them plainly), or ""."""
    twins = [f"config.{c}" for c in missing if f"config.{c}" in set(columns)]
    if not twins:
        return ""
    return (f"; this table names them {', '.join(map(repr, twins))} (records.load_runs' "
            f"names): pass those, or rename them (table.rename(columns="
            f"{{'config.{missing[0]}': '{missing[0]}'}}))")


def unrun_hint(missing, table: pd.DataFrame) -> str:
    """A hint for ``final.*`` columns a protocol table lacks because none of its runs has
    a record yet (``ProtocolRuns.table()`` before the sweep: status is empty), or ""."""
    if (not any(str(c).startswith("final.") for c in missing) or "status" not in table
            or not len(table) or table["status"].notna().any()):
        return ""
    return (f"; no run of the table has a record yet ({len(table)} of {len(table)} not "
            "found: run the protocol's sweep first, `lab sweep <protocol>`)")


# The analysis notebooks made for each trainer's runs (10-summary reads conv fields by
# default, and `lab report` passes it no others).
SUMMARIES = {"conv": "10-summary or 11-compare-rules", "ep": "20-ep-summary",
             "cfc_aux": "30-cfc-summary"}


def summary_for(kinds) -> str:
    """Which analysis notebook summarises runs of ``kinds``, for a refusal's advice."""
    known = [f"{SUMMARIES[k]} ({k} runs)" for k in kinds if k in SUMMARIES]
    return ("summarise them with " + ", ".join(known) if known else
            "summarise them with an analysis notebook made for their kind")


def check_kind(data, kind: str, caller: str, needs: str) -> None:
    """Refuse a protocol whose runs another trainer made: a summary written for ``kind``
    runs would otherwise fail on the first field they lack (a bare KeyError) or call
    them incomplete. ``needs`` says what the summary reads, for the message."""
    runs = data.runs
    kinds = sorted({k for k in runs["kind"] if another_trainers({"kind": k}, kind)})
    if kinds:
        some = ", ".join(runs.loc[runs["kind"] == kinds[0], "run_id"].head(3))
        raise ValueError(
            f"{caller}: the protocol {data.protocol.name!r} holds {' and '.join(kinds)} runs "
            f"(e.g. {some}), not {kind} runs: this summary reads {needs}; "
            f"{summary_for(kinds)}")
