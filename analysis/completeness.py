"""Refuse incomplete data: one error listing everything a protocol's runs lack.

``check_complete`` is generic over trainers and protocols: the caller gives the
expected run ids (from the protocol), the expected number of epochs (from the
config, per run or for all), the per-epoch trajectory fields and the final
fields that must be present and finite. Every missing run, unfinished run,
missing or extra epoch, missing field and non-finite value is collected into
one :class:`IncompleteProtocolError`, so a researcher fixes everything in one
pass instead of one problem per rerun.

Input tables are those of ``lab.records``: ``runs`` from ``load_runs`` (one row
per run, ``run_id`` and ``status`` at least) and ``metrics`` from
``load_metrics`` (tidy rows run_id, axis, index, metric, value). A metric that
was recorded as null is absent from the tidy table, so it counts as missing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import pandas as pd


class IncompleteProtocolError(ValueError):
    """A protocol's data is incomplete; ``problems`` lists each problem as one line."""

    def __init__(self, message: str, problems: list[str]):
        super().__init__(message)
        self.problems = problems


def spans(indices: Iterable[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2, 5, 7-8"``: epoch lists that stay readable."""
    values = sorted(set(int(i) for i in indices))
    parts, start = [], None
    for i, value in enumerate(values):
        if start is None:
            start = value
        if i + 1 == len(values) or values[i + 1] != value + 1:
            parts.append(str(start) if start == value else f"{start}-{value}")
            start = None
    return ", ".join(parts)


def _expected_epochs(n_epochs: int | Mapping[str, int], run_id: str) -> int:
    return n_epochs[run_id] if isinstance(n_epochs, Mapping) else n_epochs


def _trajectory_problems(run_id: str, rows: pd.DataFrame, n: int,
                         fields: list[str]) -> list[str]:
    problems = []
    present = set(rows["index"])
    missing = sorted(set(range(n)) - present)
    if missing:
        problems.append(f"{run_id}: epochs {spans(missing)} missing "
                        f"(has {len(present & set(range(n)))} of {n})")
    extra = sorted(present - set(range(n)))
    if extra:
        problems.append(f"{run_id}: epochs {spans(extra)} beyond the expected {n} "
                        "(the run's config differs from the protocol's)")
    by_field = {name: group for name, group in rows.groupby("metric")}
    for field in fields:
        group = by_field.get(field)
        have = set() if group is None else set(group["index"])
        absent = sorted((set(range(n)) & present) - have)
        if absent:
            problems.append(f"{run_id}: trajectory field {field!r} missing at epochs "
                            f"{spans(absent)}")
        if group is not None:
            bad = group[~group["value"].map(math.isfinite)]
            if len(bad):
                shown = ", ".join(sorted(set(map(str, bad["value"]))))
                problems.append(f"{run_id}: trajectory field {field!r} is non-finite "
                                f"({shown}) at epochs {spans(bad['index'])}")
    return problems


def _final_problems(run_id: str, rows: pd.DataFrame, fields: list[str]) -> list[str]:
    values = dict(zip(rows["metric"], rows["value"]))
    problems = []
    for field in fields:
        if field not in values:
            problems.append(f"{run_id}: final field {field!r} missing")
        elif not math.isfinite(values[field]):
            problems.append(f"{run_id}: final field {field!r} is non-finite ({values[field]})")
    return problems


def find_problems(runs: pd.DataFrame, metrics: pd.DataFrame, expected_ids: Iterable[str],
                  n_epochs: int | Mapping[str, int], trajectory_fields: Iterable[str] = (),
                  final_fields: Iterable[str] = ()) -> list[str]:
    """Every problem :func:`check_complete` would report, one line each (empty = complete)."""
    expected = list(expected_ids)
    trajectory_fields, final_fields = list(trajectory_fields), list(final_fields)
    problems = []
    present = set(runs["run_id"]) if len(runs) else set()
    missing = [run_id for run_id in expected if run_id not in present]
    if missing:
        problems.append(f"{len(missing)} of {len(expected)} runs missing: {', '.join(missing)}")
    statuses = dict(zip(runs["run_id"], runs["status"])) if len(runs) else {}
    errors = dict(zip(runs["run_id"], runs["error"])) if "error" in runs else {}
    epochs = metrics[metrics["axis"] == "epoch"]
    finals = metrics[metrics["axis"] == "final"]
    for run_id in expected:
        if run_id not in present:
            continue
        if statuses[run_id] != "complete":
            why = f": {errors[run_id]}" if errors.get(run_id) else ""
            problems.append(f"{run_id}: status {statuses[run_id]!r}, not 'complete'{why}")
        n = _expected_epochs(n_epochs, run_id)
        problems += _trajectory_problems(run_id, epochs[epochs["run_id"] == run_id], n,
                                         trajectory_fields)
        problems += _final_problems(run_id, finals[finals["run_id"] == run_id], final_fields)
    return problems


def check_complete(runs: pd.DataFrame, metrics: pd.DataFrame, expected_ids: Iterable[str],
                   n_epochs: int | Mapping[str, int], trajectory_fields: Iterable[str] = (),
                   final_fields: Iterable[str] = ()) -> None:
    """Raise IncompleteProtocolError listing every gap, or return None when complete.

    Complete means: every expected run is present with status ``complete``; it
    has exactly epochs 0..n-1 (``n_epochs`` an int, or run_id -> int); every
    trajectory field is present and finite at every epoch; every final field is
    present and finite. Runs that are not expected are ignored.
    """
    expected = list(expected_ids)
    problems = find_problems(runs, metrics, expected, n_epochs, trajectory_fields,
                             final_fields)
    if problems:
        lines = "\n".join(f"  - {line}" for line in problems)
        raise IncompleteProtocolError(
            f"incomplete data: {len(problems)} problem(s) across {len(expected)} expected runs "
            f"(only complete data is summarised; rerun the sweep to fill the gaps):\n{lines}",
            problems)
