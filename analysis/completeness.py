"""Refuse incomplete data: one error listing everything a protocol's runs lack.

What a complete run holds is what its trainer declared and the record stores
(``expect``: axis, row count, stride, metrics required on every row, periodic
metrics, final metrics, row metrics that may be undefined (NaN) as a result; see
``lab.lifecycle.Expectation``), so the check works
on any axis and for any trainer without reading a trainer's parameters. An
analysis may require more (``row_metrics``, ``final_metrics``: e.g. the
rule comparison needs alignment). Every missing run, unfinished run, missing
or extra row, missing field and non-finite value is collected into one
:class:`IncompleteProtocolError`, so a researcher fixes everything in one
pass instead of one problem per rerun.

A field the analysis asks for that *no* expected run records (on its row axis,
or among its finals, whichever was asked) is not a gap a rerun could fill but
a misspelled or wrong name: :func:`check_complete` raises
:class:`UnknownFieldError` naming it and the fields the runs do record
(closest first), instead of one "missing" line per run.

Input tables are those of ``lab.records``: ``runs`` from ``load_runs`` (one row
per run: ``run_id``, ``status``, ``error``, ``expect``) and ``metrics`` from
``load_metrics`` (tidy rows run_id, axis, index, metric, value). A metric that
was recorded as null is absent from the tidy table, so it counts as missing.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Sequence

import pandas as pd

from .checks import listing, names


class IncompleteProtocolError(ValueError):
    """A protocol's data is incomplete; ``problems`` lists each problem as one line."""

    def __init__(self, message: str, problems: list[str]):
        super().__init__(message)
        self.problems = problems


class UnknownFieldError(ValueError):
    """A requested field no run of the protocol records; ``fields`` names each one."""

    def __init__(self, message: str, fields: list[str]):
        super().__init__(message)
        self.fields = fields


def spans(indices: Iterable[int], stride: int = 1) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2, 5, 7-8"``: index lists that stay readable.

    With ``stride``, neighbours are ``stride`` apart (steps logged every 5: 15-25 is 15, 20, 25).
    """
    values = sorted(set(int(i) for i in indices))
    parts, start = [], None
    for i, value in enumerate(values):
        if start is None:
            start = value
        if i + 1 == len(values) or values[i + 1] != value + stride:
            parts.append(str(start) if start == value else f"{start}-{value}")
            start = None
    return ", ".join(parts)


def _named(rows: pd.DataFrame, name: str) -> pd.DataFrame:
    """Rows of metric ``name``, or of every metric under the prefix ``name`` ending in "/"."""
    if name.endswith("/"):
        return rows[rows["metric"].str.startswith(name)]
    return rows[rows["metric"] == name]


def _matches(metric: str, names: Sequence[str]) -> bool:
    """``metric`` is one of ``names`` or lies under one ending in "/"."""
    return any(metric == n or (n.endswith("/") and metric.startswith(n)) for n in names)


def _field_problems(run_id: str, rows: pd.DataFrame, axis: str, name: str,
                    required: set[int], stride: int, undefined: Sequence[str] = ()) -> list[str]:
    problems = []
    group = _named(rows, name)
    what = f"{'metrics under' if name.endswith('/') else 'field'} {name!r}"
    absent = sorted(required - set(group["index"]))
    if absent:
        problems.append(f"{run_id}: {what} missing at {axis}s {spans(absent, stride)}")
    # A NaN where the quantity may be undefined is a result; inf never is.
    # (astype: mapping an empty string column gives a string dtype pandas will not "and")
    result = group["value"].isna() & group["metric"].map(
        lambda m: _matches(m, undefined)).astype(bool)
    bad = group[group["index"].isin(required) & ~group["value"].map(math.isfinite) & ~result]
    if len(bad):
        shown = ", ".join(sorted(set(map(str, bad["value"]))))
        where = spans(bad["index"], stride)
        if name.endswith("/"):
            shown += " in " + ", ".join(sorted(set(bad["metric"])))
        problems.append(f"{run_id}: {what} is non-finite ({shown}) at {axis}s {where}")
    return problems


def _row_problems(run_id: str, rows: pd.DataFrame, expect: dict,
                  row_metrics: list[str], undefined: Sequence[str] = ()) -> list[str]:
    axis, count, stride = expect["axis"], expect["count"], expect.get("stride", 1)
    wanted = [i * stride for i in range(count)]
    present = set(rows["index"])
    problems = []
    missing = sorted(set(wanted) - present)
    if missing:
        problems.append(f"{run_id}: {axis}s {spans(missing, stride)} missing "
                        f"(has {len(present & set(wanted))} of {count} rows)")
    extra = sorted(present - set(wanted))
    if extra:
        problems.append(f"{run_id}: {axis}s {spans(extra, stride)} beyond the declared "
                        f"{count} rows of stride {stride}")
    have = set(wanted) & present
    # A field the run declares periodic (val_acc every eval_every epochs) is due at its
    # cadence only, even when the caller asks for it: asked at every row, a run that
    # validates every 2 epochs was "incomplete" for good.
    periodic = {name for name, _, _ in expect.get("periodic", ())}
    asked = [name for name in row_metrics if name not in periodic]
    for name in dict.fromkeys(list(expect.get("metrics", ())) + asked):
        problems += _field_problems(run_id, rows, axis, name, have, stride, undefined)
    for name, every, offset in expect.get("periodic", ()):
        due = {v for v in have if (v - offset) % every == 0}
        problems += _field_problems(run_id, rows, axis, name, due, stride, undefined)
    return problems


def _final_problems(run_id: str, rows: pd.DataFrame, fields: list[str]) -> list[str]:
    problems = []
    for field in fields:
        group = _named(rows, field)
        if not len(group):
            problems.append(f"{run_id}: final field {field!r} missing")
        for metric, value in zip(group["metric"], group["value"]):
            if not math.isfinite(value):
                problems.append(f"{run_id}: final field {metric!r} is non-finite ({value})")
    return problems


def find_problems(runs: pd.DataFrame, metrics: pd.DataFrame, expected_ids: Sequence[str],
                  row_metrics: Sequence[str] = (), final_metrics: Sequence[str] = (),
                  undefined: Sequence[str] = ()) -> list[str]:
    """Every problem :func:`check_complete` would report, one line each (empty = complete).

    ``expected_ids``, ``row_metrics`` and ``final_metrics`` are lists (or tuples) of
    names; a bare str is refused (TypeError naming the parameter), not read letter
    by letter. ``undefined`` names row metrics (or prefixes ending in "/") that may be
    NaN because the quantity is undefined there (e.g. a cosine at a silent layer):
    present and NaN is then a result, not a gap; missing or infinite still is a problem.
    A run's record adds those its trainer declared (``expect["undefined"]``).
    """
    expected = names(expected_ids, "expected_ids", "run ids")
    row_metrics = names(row_metrics, "row_metrics")
    final_metrics = names(final_metrics, "final_metrics")
    undefined = names(undefined, "undefined")
    problems = []
    present = set(runs["run_id"]) if len(runs) else set()
    missing = [run_id for run_id in expected if run_id not in present]
    if missing:
        problems.append(f"{len(missing)} of {len(expected)} runs missing: {', '.join(missing)}")
    by_id = {row.run_id: row for row in runs.itertuples(index=False)} if len(runs) else {}
    groups = dict(tuple(metrics.groupby(["run_id", "axis"]))) if len(metrics) else {}
    empty = metrics.iloc[:0]
    for run_id in expected:
        if run_id not in present:
            continue
        run = by_id[run_id]
        if run.status != "complete":
            why = f": {run.error}" if getattr(run, "error", None) else ""
            problems.append(f"{run_id}: status {run.status!r}, not 'complete'{why}")
        expect = getattr(run, "expect", None)
        if not isinstance(expect, dict):
            problems.append(f"{run_id}: its record declares no expectation of a complete run "
                            "(written by an older lab or a plain notebook); rerun it")
            continue
        rows = groups.get((run_id, expect["axis"]), empty)
        problems += _row_problems(run_id, rows, expect, row_metrics,
                                  (*undefined, *expect.get("undefined", ())))
        problems += _final_problems(run_id, groups.get((run_id, "final"), empty),
                                    list(expect.get("final", ())) + final_metrics)
    return list(dict.fromkeys(problems))


def _recorded(runs: pd.DataFrame, metrics: pd.DataFrame,
              expected: Sequence[str]) -> tuple[set[str], set[str]]:
    """(row fields, final fields) recorded by any present expected run: row fields on
    the axis its record declares, so a step-axis run's eval rows do not count."""
    if not len(runs) or not len(metrics):
        return set(), set()
    axes = {row.run_id: row.expect["axis"] for row in runs.itertuples(index=False)
            if row.run_id in set(expected) and isinstance(getattr(row, "expect", None), dict)}
    ours = metrics[metrics["run_id"].isin(list(axes))]
    on_axis = ours["axis"] == ours["run_id"].map(axes)
    return set(ours.loc[on_axis, "metric"]), set(ours.loc[ours["axis"] == "final", "metric"])


def _is_recorded(name: str, recorded: set[str]) -> bool:
    return any(_matches(metric, [name]) for metric in recorded)


def _unknown(name: str, kind: str, recorded: set[str], other: set[str]) -> str:
    """One line: ``name`` is recorded by no run; what is recorded, closest first."""
    close = difflib.get_close_matches(name, sorted(recorded), n=len(recorded), cutoff=0.6)
    ordered = close + sorted(recorded - set(close))
    hint = (f" (it is a {'final' if kind == 'row' else 'row'} field, not a {kind} field)"
            if _is_recorded(name, other) else "")
    return f"no run records a {kind} field {name!r}{hint}; recorded: {listing(ordered)}"


def check_fields(runs: pd.DataFrame, metrics: pd.DataFrame, expected_ids: Sequence[str],
                 row_metrics: Sequence[str] = (), final_metrics: Sequence[str] = ()) -> None:
    """Raise UnknownFieldError if a requested field is recorded by no expected run.

    Only when the runs record something of that kind: with no rows (or no finals)
    at all there is nothing to compare a name with, and the gaps are real.
    """
    expected = names(expected_ids, "expected_ids", "run ids")
    row_metrics = names(row_metrics, "row_metrics")
    final_metrics = names(final_metrics, "final_metrics")
    rows, finals = _recorded(runs, metrics, expected)
    lines, fields = [], []
    for asked, kind, recorded, other in ((row_metrics, "row", rows, finals),
                                         (final_metrics, "final", finals, rows)):
        if not recorded:
            continue
        for name in dict.fromkeys(asked):
            if not _is_recorded(name, recorded):
                lines.append(_unknown(name, kind, recorded, other))
                fields.append(name)
    if lines:
        body = "\n".join(f"  - {line}" for line in lines)
        raise UnknownFieldError(
            f"{len(lines)} requested field(s) recorded by none of the {len(expected)} expected "
            f"runs (a misspelled name? rerunning the sweep cannot add them):\n{body}", fields)


def check_complete(runs: pd.DataFrame, metrics: pd.DataFrame, expected_ids: Sequence[str],
                   row_metrics: Sequence[str] = (), final_metrics: Sequence[str] = (),
                   undefined: Sequence[str] = ()) -> None:
    """Raise IncompleteProtocolError listing every gap, or return None when complete.

    Complete means: every expected run is present with status ``complete`` and
    holds what its record declares (rows on its axis, their metrics, its final
    metrics), plus ``row_metrics`` on every row and ``final_metrics``, all
    present and finite, except that a row metric its record declares undefined-able
    (``expect["undefined"]``: a conv run's alignment cosines), or one ``undefined``
    names, may be NaN (see :func:`find_problems`). Runs that are not expected are
    ignored.

    A ``row_metrics`` or ``final_metrics`` name that no expected run records
    is an :class:`UnknownFieldError` (see :func:`check_fields`), not a gap per run.
    """
    expected = names(expected_ids, "expected_ids", "run ids")
    check_fields(runs, metrics, expected, row_metrics, final_metrics)
    problems = find_problems(runs, metrics, expected, row_metrics, final_metrics, undefined)
    if problems:
        lines = "\n".join(f"  - {line}" for line in problems)
        raise IncompleteProtocolError(
            f"incomplete data: {len(problems)} problem(s) across {len(expected)} expected runs "
            f"({advice(problems)}):\n{lines}", problems)


def advice(problems: Sequence[str]) -> str:
    """What to do about ``problems`` (find_problems' lines): a rerun fills gaps, but a run
    that diverged, or a non-finite value in a finished run, is what the same config
    gives again (runs are deterministic), so "rerun the sweep" alone would not help."""
    results = [p for p in problems if "status 'diverged'" in p or "is non-finite" in p]
    # 'running' is live (a killed run reads 'interrupted'): a sweep is still at work.
    running = [p for p in problems if "status 'running'" in p]
    text = "only complete data is summarised"
    if running:
        text += ("; a run with status 'running' is being trained now (a sweep is still at "
                 "work): wait for it to finish, then run this again")
    if len(results) + len(running) < len(problems):
        text += "; rerun the sweep to fill the gaps"
    if results:
        text += ("; a diverged run or a non-finite value is what the same config gives "
                 "again (runs are deterministic): rerunning reproduces it, so change or "
                 "drop that grid point, or summarise the runs without it")
    return text
