"""Completeness against each run's own declaration, on any axis: every kind of gap is named.

The committed step-axis fixture (``fixtures/steps``: two synthetic runs, a row
every 5 steps, ``val_loss`` every 20 steps) passes; each test then removes or
spoils one thing in the tables and checks the one error names it.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest

from analysis.completeness import (
    IncompleteProtocolError,
    UnknownFieldError,
    check_complete,
    find_problems,
)
from lab import records

STEPS = Path(__file__).parent / "fixtures" / "steps" / "runs"
LEGACY = Path(__file__).parent / "fixtures" / "legacy" / "runs"
IDS = ["synthetic_seed-0", "synthetic_seed-1"]


@pytest.fixture
def tables():
    return records.load_runs(STEPS), records.load_metrics(STEPS)


def test_the_step_fixture_is_complete(tables):
    runs, metrics = tables
    assert set(runs["axis"]) == {"step"} and set(runs["n_rows"]) == {12}
    check_complete(runs, metrics, IDS)
    steps = sorted(set(metrics[metrics["axis"] == "step"]["index"]))
    assert steps == list(range(0, 60, 5))
    assert find_problems(runs, metrics, IDS, ["train_loss"], ["final_loss"]) == []


def _problems(runs, metrics, **extra):
    with pytest.raises(IncompleteProtocolError) as info:
        check_complete(runs, metrics, IDS, **extra)
    assert "incomplete data" in str(info.value)
    return info.value.problems


def _drop(metrics, run_id, metric=None, index=None):
    keep = metrics["run_id"] != run_id
    if metric is not None:
        keep |= metrics["metric"] != metric
    if index is not None:
        keep |= metrics["index"] != index
    return metrics[keep]


def test_a_missing_run_is_named(tables):
    runs, metrics = tables
    problems = _problems(runs[runs["run_id"] != IDS[1]], metrics)
    assert problems == [f"1 of 2 runs missing: {IDS[1]}"]


def test_an_unfinished_run_is_named_with_its_error(tables):
    runs, metrics = tables
    runs = runs.copy()
    runs.loc[runs["run_id"] == IDS[0], ["status", "error"]] = ["diverged", "loss exploded"]
    assert _problems(runs, metrics) == [
        f"{IDS[0]}: status 'diverged', not 'complete': loss exploded"]


def test_missing_rows_on_the_step_axis_are_named_as_steps(tables):
    runs, metrics = tables
    for step in (15, 20, 25, 55):
        metrics = _drop(metrics, IDS[0], index=step)
    problems = _problems(runs, metrics)
    assert problems == [f"{IDS[0]}: steps 15-25, 55 missing (has 8 of 12 rows)"]


def test_rows_beyond_the_declaration_are_named(tables):
    runs, metrics = tables
    extra = pd.DataFrame({"run_id": [IDS[1]], "axis": ["step"], "index": [60],
                          "metric": ["train_loss"], "value": [1.0]})
    problems = _problems(runs, pd.concat([metrics, extra], ignore_index=True))
    assert problems == [f"{IDS[1]}: steps 60 beyond the declared 12 rows of stride 5"]


def test_a_missing_field_at_some_rows_is_named(tables):
    runs, metrics = tables
    for step in (10, 35):
        metrics = _drop(metrics, IDS[1], "train_loss", step)
    assert _problems(runs, metrics) == [f"{IDS[1]}: field 'train_loss' missing at steps 10, 35"]


def test_a_prefix_with_no_metric_under_it_is_named(tables):
    runs, metrics = tables
    metrics = metrics[~((metrics["run_id"] == IDS[0]) & metrics["metric"].str.startswith("m/")
                        & (metrics["index"] == 5))]
    assert _problems(runs, metrics) == [f"{IDS[0]}: metrics under 'm/' missing at steps 5"]


def test_non_finite_values_are_named_with_their_value(tables):
    runs, metrics = tables
    metrics = metrics.copy()
    hit = (metrics["run_id"] == IDS[0]) & (metrics["metric"] == "m/1") & (metrics["index"] == 45)
    metrics.loc[hit, "value"] = math.inf
    hit = (metrics["run_id"] == IDS[0]) & (metrics["metric"] == "train_loss") & \
        (metrics["index"] == 50)
    metrics.loc[hit, "value"] = math.nan
    assert _problems(runs, metrics) == [
        f"{IDS[0]}: field 'train_loss' is non-finite (nan) at steps 50",
        f"{IDS[0]}: metrics under 'm/' is non-finite (inf in m/1) at steps 45"]


def test_a_periodic_field_is_required_only_where_it_is_due(tables):
    runs, metrics = tables
    due = sorted(set(metrics[(metrics["metric"] == "val_loss")]["index"]))
    assert due == [0, 20, 40]  # every 20 steps from 0
    # asked for by name (10-summary's trajectory_fields), it is still due at its cadence
    # only: asked at every row, a run validating every 20 steps was incomplete for good
    assert find_problems(runs, metrics, IDS, ["train_loss", "val_loss"]) == []
    metrics = _drop(metrics, IDS[1], "val_loss", 20)
    assert _problems(runs, metrics) == [f"{IDS[1]}: field 'val_loss' missing at steps 20"]
    assert _problems(runs, metrics, row_metrics=["val_loss"]) == [
        f"{IDS[1]}: field 'val_loss' missing at steps 20"]


def test_final_fields_missing_or_non_finite_are_named(tables):
    runs, metrics = tables
    metrics = metrics.copy()
    metrics = _drop(metrics, IDS[0], "final_loss", -1)
    hit = (metrics["run_id"] == IDS[1]) & (metrics["axis"] == "final")
    metrics.loc[hit, "value"] = -math.inf
    assert _problems(runs, metrics) == [
        f"{IDS[0]}: final field 'final_loss' missing",
        f"{IDS[1]}: final field 'final_loss' is non-finite (-inf)"]


def test_what_the_analysis_adds_is_required_too(tables):
    runs, metrics = tables
    # One run records each added field, so the other's lack is a gap (a field no run
    # records is a misspelled name: test_a_field_no_run_records_is_an_error_not_a_gap).
    steps = list(range(0, 60, 5))
    added = pd.DataFrame({"run_id": [IDS[1]] * 12 + [IDS[0]],
                          "axis": ["step"] * 12 + ["final"], "index": steps + [-1],
                          "metric": ["alignment/0"] * 12 + ["test_acc"], "value": 0.5})
    metrics = pd.concat([metrics, added], ignore_index=True)
    problems = _problems(runs, metrics, row_metrics=["alignment/"], final_metrics=["test_acc"])
    assert f"{IDS[0]}: metrics under 'alignment/' missing at steps 0-55" in problems
    assert f"{IDS[1]}: final field 'test_acc' missing" in problems


def test_every_problem_is_listed_in_one_error(tables):
    runs, metrics = tables
    metrics = _drop(metrics, IDS[0], index=5)
    metrics = _drop(metrics, IDS[1], "val_loss", 40)
    runs = runs.copy()
    runs.loc[runs["run_id"] == IDS[1], "status"] = "running"
    with pytest.raises(IncompleteProtocolError) as info:
        check_complete(runs, metrics, IDS + ["absent"])
    message = str(info.value)
    assert "4 problem(s) across 3 expected runs" in message
    for line in ("1 of 3 runs missing: absent", f"{IDS[0]}: steps 5 missing",
                 f"{IDS[1]}: status 'running'", f"{IDS[1]}: field 'val_loss' missing at steps 40"):
        assert line in message


def test_a_record_without_a_declaration_cannot_pass():
    runs, metrics = records.load_runs(LEGACY), records.load_metrics(LEGACY)
    problems = find_problems(runs, metrics, ["rule-bp_seed-0"])
    assert problems == ["rule-bp_seed-0: its record declares no expectation of a complete run "
                        "(written by an older lab or a plain notebook); rerun it"]


def test_a_field_no_run_records_is_an_error_not_a_gap(tables):
    runs, metrics = tables
    # A run the protocol does not expect recording the name does not make it recorded.
    stray = pd.DataFrame({"run_id": ["other"], "axis": ["step"], "index": [0],
                          "metric": ["train_los"], "value": [1.0]})
    metrics = pd.concat([metrics, stray], ignore_index=True)
    with pytest.raises(UnknownFieldError) as info:
        check_complete(runs, metrics, IDS, ["train_los", "m/", "final_loss"], ["final_los"])
    assert not isinstance(info.value, IncompleteProtocolError)
    assert info.value.fields == ["train_los", "final_loss", "final_los"]
    # Closest first (difflib), then the rest in order; one line per field, not per run.
    assert str(info.value) == (
        "3 requested field(s) recorded by none of the 2 expected runs (a misspelled name? "
        "rerunning the sweep cannot add them):\n"
        "  - no run records a row field 'train_los'; recorded: 'train_loss', 'm/0', 'm/1', "
        "'val_loss'\n"
        "  - no run records a row field 'final_loss' (it is a final field, not a row field); "
        "recorded: 'val_loss', 'train_loss', 'm/0', 'm/1'\n"
        "  - no run records a final field 'final_los'; recorded: 'final_loss'")


def test_a_field_some_runs_record_is_still_a_gap_per_run(tables):
    runs, metrics = tables
    metrics = _drop(metrics, IDS[1], "train_loss")
    metrics = _drop(metrics, IDS[0], "final_loss", -1)
    assert _problems(runs, metrics, row_metrics=["train_loss"]) == [
        f"{IDS[0]}: final field 'final_loss' missing",
        f"{IDS[1]}: field 'train_loss' missing at steps 0-55"]


def test_with_no_rows_at_all_a_name_cannot_be_judged_and_the_gaps_are_listed(tables):
    runs, metrics = tables
    metrics = metrics[metrics["axis"] != "step"]  # both runs died before their first row
    problems = _problems(runs, metrics, row_metrics=["train_los"])
    assert problems == [f"{rid}: steps 0-55 missing (has 0 of 12 rows)" for rid in IDS]
    # ... while finals are still judged: a misspelled final is named.
    with pytest.raises(UnknownFieldError, match=r"final field 'final_los'; recorded: "
                                                r"'final_loss'$"):
        check_complete(runs, metrics, IDS, final_metrics=["final_los"])
