"""The analysis skeleton: protocol loading, completeness, summaries, figures, reports."""

from __future__ import annotations

import math
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import matplotlib
import pandas as pd
import pytest

from analysis import (
    IncompleteProtocolError,
    UnknownFieldError,
    check_complete,
    curve_bands,
    format_mean_std,
    learning_curves,
    load_protocol_runs,
    run_curves,
    summarize,
)
from analysis.completeness import spans
from lab import records
from lab.cli import main as cli_main
from lab.notebook import execute

matplotlib.use("Agg")

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "summary"
SUMMARY = ROOT / "notebooks" / "10-summary.ipynb"
TRAJECTORY = ["train_loss", "train_acc", "val_loss", "val_acc", "lr"]
FINAL = ["test_loss", "test_acc"]


@pytest.fixture
def fixture_copy(tmp_path):
    """The committed fixture protocol and runs, copied so a test may damage them."""
    target = tmp_path / "summary"
    shutil.copytree(FIXTURE, target)
    text = (target / "protocol.yaml").read_text()
    notebook = ROOT / "notebooks" / "01-train-conv.ipynb"
    (target / "protocol.yaml").write_text(text.replace("../../../notebooks/01-train-conv.ipynb",
                                                       str(notebook)))
    return target


def _edit(run_dir: Path, change):
    record = records.load_record(run_dir)  # rows come along under "trajectory"
    change(record)
    records.save_run(run_dir, record)  # ... and replace the row store


def test_fixture_protocol_loads_complete():
    data = load_protocol_runs(FIXTURE / "protocol.yaml")
    assert data.expected_ids == ["lr-0.05_rule-bp_seed-0", "lr-0.05_rule-bp_seed-1",
                                 "lr-0.2_rule-bp_seed-0", "lr-0.2_rule-bp_seed-1"]
    assert set(data.runs["n_rows"]) == {4}
    assert all(e["axis"] == "epoch" and e["count"] == 4 for e in data.runs["expect"])
    assert data.group_keys == ["lr", "rule"]
    data.check_complete(TRAJECTORY, FINAL)
    table = data.table()
    assert list(table["status"]) == ["complete"] * 4
    assert {"lr", "rule", "seed", "final.test_acc"} <= set(table.columns)


def test_every_gap_is_listed_in_one_error(fixture_copy):
    runs = fixture_copy / "runs"
    shutil.rmtree(runs / "lr-0.05_rule-bp_seed-1")
    _edit(runs / "lr-0.05_rule-bp_seed-0", lambda r: r.update(
        trajectory=r["trajectory"][:2], status="running"))
    _edit(runs / "lr-0.2_rule-bp_seed-0", lambda r: (
        r["trajectory"][1].update(train_loss=math.nan),
        r["trajectory"][3].update(train_loss=math.inf),
        r["trajectory"][2].pop("val_acc"),
        r["final"].pop("test_acc")))
    _edit(runs / "lr-0.2_rule-bp_seed-1", lambda r: r["final"].update(test_loss=math.nan))
    data = load_protocol_runs(fixture_copy / "protocol.yaml")
    with pytest.raises(IncompleteProtocolError) as err:
        data.check_complete(TRAJECTORY, FINAL)
    problems = err.value.problems
    assert problems == [
        "1 of 4 runs missing: lr-0.05_rule-bp_seed-1",
        "lr-0.05_rule-bp_seed-0: status 'interrupted', not 'complete'",
        "lr-0.05_rule-bp_seed-0: epochs 2-3 missing (has 2 of 4 rows)",
        "lr-0.2_rule-bp_seed-0: field 'train_loss' is non-finite (inf, nan) at epochs 1, 3",
        "lr-0.2_rule-bp_seed-0: field 'val_acc' missing at epochs 2",
        "lr-0.2_rule-bp_seed-0: final field 'test_acc' missing",
        "lr-0.2_rule-bp_seed-1: final field 'test_loss' is non-finite (nan)",
    ]
    message = str(err.value)
    assert message.startswith("incomplete data: 7 problem(s) across 4 expected runs")
    assert all(problem in message for problem in problems)


def test_unreadable_runs_are_listed_under_one_header(fixture_copy):
    # load_runs / load_metrics collect their own problems under a header: the protocol's
    # error once repeated that header inside its own, per run.
    runs = fixture_copy / "runs"
    part = next((runs / "lr-0.05_rule-bp_seed-0" / "rows" / "epoch").iterdir())
    part.write_text("".join(part.read_text().splitlines(keepends=True)[:2]))
    (runs / "lr-0.2_rule-bp_seed-1" / "record.json").write_text("{")
    with pytest.raises(records.RecordError) as err:
        load_protocol_runs(fixture_copy / "protocol.yaml")
    message = str(err.value)
    assert message.startswith("2 run records could not be read (fix or remove them; none "
                              "were skipped):\n  - "), message
    assert message.count("could not be read") == 1 and message.count("\n  - ") == 2
    assert "lr-0.05_rule-bp_seed-0/rows/epoch/" in message and ": the row part holds " in message
    assert "lr-0.2_rule-bp_seed-1/record.json" in message
    assert [Path(p).parent.name for p, _ in err.value.problems] == [
        "lr-0.05_rule-bp_seed-0", "lr-0.2_rule-bp_seed-1"]


def test_a_run_copied_into_another_runs_directory_is_named(fixture_copy):
    # Read under its record's run_id, it made the run expected there "missing" and its
    # namesake "stale", with advice to rerun with --force (which would replace a good run).
    runs = fixture_copy / "runs"
    there = runs / "lr-0.2_rule-bp_seed-1"
    shutil.rmtree(there)
    shutil.copytree(runs / "lr-0.2_rule-bp_seed-0", there)
    with pytest.raises(records.RecordError) as err:
        load_protocol_runs(fixture_copy / "protocol.yaml")
    assert err.value.problems == [(there / "record.json", (
        f"{there}: its record's run_id is 'lr-0.2_rule-bp_seed-0', not "
        "'lr-0.2_rule-bp_seed-1', the run the protocol expects in this directory (a run "
        "copied or renamed into place?): move it to a directory named after its run_id, or "
        "replace it (`lab sweep --force`)"))]
    assert str(err.value).startswith("1 run records could not be read")
    # `lab runs PROTOCOL` says the same (it read the values as changed: "stale (epochs: ...)")
    from lab.cli import runs_table

    table, _ = runs_table(fixture_copy / "protocol.yaml")
    row = table[table["dir"] == there.name].iloc[0]
    assert row["status"] == "stale" and row["error"] == (
        "its record's run_id is 'lr-0.2_rule-bp_seed-0', not 'lr-0.2_rule-bp_seed-1', the run "
        "the protocol expects in this directory (a run copied or renamed into place?): move "
        "it to a directory named after its run_id, or replace it (`lab sweep --force`)")


def test_missing_runs_directory_lists_every_run(fixture_copy):
    shutil.rmtree(fixture_copy / "runs")
    data = load_protocol_runs(fixture_copy / "protocol.yaml")
    with pytest.raises(IncompleteProtocolError, match=r"none of the 4 expected runs of protocol "
                                                      r"'fixture' is in .*runs \(it holds no "
                                                      r"runs\); run `lab sweep .*protocol.yaml` "
                                                      r"first") as err:
        data.check_complete(TRAJECTORY, FINAL)
    assert err.value.problems[0].startswith("4 of 4 runs missing: ")


def test_a_runs_dir_of_another_protocol_is_said_to_be_one(fixture_copy, tmp_path):
    # It advised "rerun the sweep to fill the gaps", which writes to the protocol's out,
    # never to that runs_dir.
    other = tmp_path / "other"
    record = records.new_record(run_id="rule-bp_seed-0", kind="conv", config={})
    records.save_run(other / "rule-bp_seed-0", record)
    data = load_protocol_runs(fixture_copy / "protocol.yaml", other)
    with pytest.raises(IncompleteProtocolError, match=(
            rf"none of the 4 expected runs of protocol 'fixture' is in {re.escape(str(other))} "
            r"\(it holds 1 other run\(s\), e.g. rule-bp_seed-0: another protocol's runs\?\); "
            r"the protocol's sweep writes its runs to its out, .*runs: leave runs_dir empty")):
        data.check_complete(TRAJECTORY, FINAL)


def test_summarize_before_the_sweep_says_no_run_has_a_record(fixture_copy):
    # It said only "column(s) final.test_acc not in the table; columns: run_id, ...".
    shutil.rmtree(fixture_copy / "runs")
    table = load_protocol_runs(fixture_copy / "protocol.yaml").table()
    with pytest.raises(KeyError, match=re.escape(
            "summarize: column(s) final.test_acc not in the table; no run of the table has a "
            "record yet (4 of 4 not found: run the protocol's sweep first, `lab sweep "
            "<protocol>`); columns: ")):
        summarize(table, ["lr"], ["final.test_acc"])
    # with some runs there, a final field none of them has gets no such hint
    table = load_protocol_runs(FIXTURE / "protocol.yaml").table()
    with pytest.raises(KeyError) as err:
        summarize(table, ["lr"], ["final.nope"])
    assert "no run of the table has a record" not in str(err.value)


def test_check_complete_is_generic():
    # An MT-1-like trajectory: any fields, each run's own declaration, others ignored.
    rows = [(rid, "epoch", e, m, 1.0) for rid, n in (("a", 3), ("b", 5), ("z", 1))
            for e in range(n) for m in ("traffic_rms", "innovation_rms")]
    rows += [(rid, "final", -1, "loss", 0.5) for rid in ("a", "b")]
    # One (extra) row of used_rms, so some run records it: its absence elsewhere is a gap,
    # not a misspelled name (that is test_a_field_no_run_records_is_named_not_a_gap_per_run).
    rows += [("b", "epoch", 4, "used_rms", 1.0)]
    metrics = pd.DataFrame(rows, columns=list(records.TIDY_COLUMNS))

    def expect(count):
        return {"axis": "epoch", "count": count, "stride": 1, "metrics": ["traffic_rms"],
                "periodic": [], "final": ["loss"]}

    runs = pd.DataFrame({"run_id": ["a", "b", "z"], "status": ["complete"] * 3,
                         "error": [None] * 3, "expect": [expect(3), expect(5), expect(9)]})
    check_complete(runs, metrics, ["a", "b"])
    runs["expect"] = [expect(4), expect(4), expect(9)]
    with pytest.raises(IncompleteProtocolError) as err:
        check_complete(runs, metrics, ["a", "b"], ["used_rms"], ["loss"])
    assert err.value.problems == [
        "a: epochs 3 missing (has 3 of 4 rows)",
        "a: field 'used_rms' missing at epochs 0-2",
        "b: epochs 4 beyond the declared 4 rows of stride 1",
        "b: field 'used_rms' missing at epochs 0-3",
    ]


def test_a_metric_the_record_declares_undefined_may_be_nan_but_not_missing_or_inf():
    # A conv run whose network fell silent has NaN alignment cosines (0/0), its result;
    # 10-summary refused such a complete run and advised changing its config.
    nan, inf = float("nan"), float("inf")
    expect = {"axis": "epoch", "count": 2, "stride": 1, "metrics": ["loss"],
              "periodic": [["alignment/", 1, 0]], "final": [], "undefined": ["alignment/"]}

    def problems(cos_b, declared=True, undefined=()):
        rows = [(rid, "epoch", e, "loss", 1.0) for rid in "ab" for e in range(2)]
        rows += [("a", "epoch", e, "alignment/update_cos/l0", 0.5) for e in range(2)]
        rows += [("b", "epoch", e, "alignment/update_cos/l0", v) for e, v in enumerate(cos_b)]
        runs = pd.DataFrame({"run_id": ["a", "b"], "status": ["complete"] * 2,
                             "error": [None] * 2, "expect": [
                                 expect, expect if declared else {
                                     k: v for k, v in expect.items() if k != "undefined"}]})
        frame = pd.DataFrame(rows, columns=list(records.TIDY_COLUMNS))
        try:
            check_complete(runs, frame, ["a", "b"], undefined=undefined)
        except IncompleteProtocolError as err:
            return err.problems
        return []

    assert problems([0.5, nan]) == []
    assert problems([nan, nan]) == []
    assert problems([0.5, inf]) == [
        "b: metrics under 'alignment/' is non-finite (inf in alignment/update_cos/l0) at "
        "epochs 1"]
    assert problems([0.5]) == ["b: metrics under 'alignment/' missing at epochs 1"]
    # A record that does not declare it (an older run): NaN is a gap, unless asked.
    assert problems([0.5, nan], declared=False) == [
        "b: metrics under 'alignment/' is non-finite (nan in alignment/update_cos/l0) at "
        "epochs 1"]
    assert problems([0.5, nan], declared=False, undefined=["alignment/"]) == []


@pytest.mark.parametrize("case", ["gap", "diverged", "nan final", "both", "running"])
def test_the_advice_fits_the_problems(case):
    # "rerun the sweep to fill the gaps" was the advice for a diverged run and a NaN final
    # too, though the same config diverges again (runs are deterministic).
    expect = {"axis": "epoch", "count": 2, "stride": 1, "metrics": ["loss"], "periodic": [],
              "final": ["acc"]}
    rows = [(rid, "epoch", e, "loss", 1.0) for rid in ("a", "b") for e in range(2)]
    rows += [("a", "final", -1, "acc", 0.5),
             ("b", "final", -1, "acc", float("nan") if case == "nan final" else 0.5)]
    status = {"gap": ["complete", "failed"], "diverged": ["complete", "diverged"],
              "nan final": ["complete", "complete"], "both": ["failed", "diverged"],
              "running": ["complete", "running"]}[case]
    runs = pd.DataFrame({"run_id": ["a", "b"], "status": status, "error": [None] * 2,
                         "expect": [expect, expect]})
    with pytest.raises(IncompleteProtocolError) as err:
        check_complete(runs, pd.DataFrame(rows, columns=list(records.TIDY_COLUMNS)), ["a", "b"])
    text = str(err.value).splitlines()[0]
    assert ("rerun the sweep to fill the gaps" in text) == (case in ("gap", "both"))
    assert ("rerunning reproduces it" in text) == (case not in ("gap", "running"))
    # A run that is live (a sweep still at work; a killed one reads 'interrupted'): wait.
    assert ("a run with status 'running' is being trained now (a sweep is still at work): "
            "wait for it to finish, then run this again" in text) == (case == "running")


def test_spans():
    assert spans([5, 0, 1, 2, 7, 8]) == "0-2, 5, 7-8"
    assert spans([]) == ""


def test_summary_is_mean_and_std_over_seeds():
    data = load_protocol_runs(FIXTURE / "protocol.yaml")
    summary = summarize(data.table(), data.group_keys, ["final.test_acc"])
    assert list(summary["lr"]) == [0.05, 0.2] and list(summary["n"]) == [2, 2]
    for lr, row in zip((0.05, 0.2), summary.itertuples(index=False)):
        accs = [records.load_record(FIXTURE / "runs" / f"lr-{lr}_rule-bp_seed-{s}")
                ["final"]["test_acc"] for s in (0, 1)]
        assert row[summary.columns.get_loc("final.test_acc/mean")] == pytest.approx(
            statistics.mean(accs), abs=1e-12)
        assert row[summary.columns.get_loc("final.test_acc/std")] == pytest.approx(
            statistics.stdev(accs), abs=1e-12)
    text = format_mean_std(summary, digits=3)
    assert text.loc[0, "final.test_acc"].count("±") == 1
    overall = summarize(data.table(), [], ["final.test_acc"])
    assert list(overall["group"]) == ["all runs"] and list(overall["n"]) == [4]
    with pytest.raises(KeyError, match="final.nope"):
        summarize(data.table(), ["lr"], ["final.nope"])


def test_summarize_and_format_refuse_an_empty_table():
    # a filter that matches no run must not pass as an empty summary
    table = load_protocol_runs(FIXTURE / "protocol.yaml").table()
    none = table[table["rule"] == "nope"]
    with pytest.raises(ValueError, match=r"^summarize: the table has no runs .*filter"):
        summarize(none, ["lr"], ["final.test_acc"])
    summary = summarize(table, ["lr"], ["final.test_acc"])
    with pytest.raises(ValueError, match=r"^format_mean_std: the summary has no rows"):
        format_mean_std(summary.iloc[:0])
    # the figures say the same, not "no run of the table has field(s) ... fields there: none"
    metrics = load_protocol_runs(FIXTURE / "protocol.yaml").metrics
    with pytest.raises(ValueError, match=r"^learning_curves: the table has no runs .*filter"):
        learning_curves(metrics, none, ["lr"], ["train_loss"])
    with pytest.raises(ValueError, match=r"^curve_bands: the table has no runs .*filter"):
        curve_bands(metrics, none, ["lr"], "train_loss")


def test_figures_draw_a_band_per_group(tmp_path):
    data = load_protocol_runs(FIXTURE / "protocol.yaml")
    table = data.table()
    fig = learning_curves(data.metrics, table, data.group_keys, ["train_loss", "val_acc"])
    axes = fig.get_axes()
    assert len(axes) == 2
    assert [line.get_label() for line in axes[0].lines] == ["lr=0.05, rule=bp (n=2)",
                                                             "lr=0.2, rule=bp (n=2)"]
    assert len(axes[0].collections) == 2  # one seed band per group
    bands = curve_bands(data.metrics, table, data.group_keys, "train_loss")
    first = bands[(bands.group == "lr=0.05, rule=bp") & (bands.epoch == 0)].iloc[0]
    losses = [records.load_record(FIXTURE / "runs" / f"lr-0.05_rule-bp_seed-{s}")
              ["trajectory"][0]["train_loss"] for s in (0, 1)]
    assert first["mean"] == pytest.approx(statistics.mean(losses), abs=1e-12)
    fig.savefig(tmp_path / "curves.png")
    trajectory = records.load_record(FIXTURE / "runs" / "lr-0.2_rule-bp_seed-0")["trajectory"]
    single = run_curves(trajectory, title="one run")
    assert len(single.get_axes()) == 2 and len(single.get_axes()[0].lines) == 2
    single.savefig(tmp_path / "run.png")
    assert (tmp_path / "curves.png").stat().st_size > 1000


def test_a_seed_missing_at_a_row_is_shown_not_hidden():
    # One seed's NaN at epoch 2: the mean there was the other seed's value alone, the band
    # vanished, and the legend still said n=2.
    data = load_protocol_runs(FIXTURE / "protocol.yaml")
    table, metrics = data.table(), data.metrics.copy()
    hole = ((metrics["run_id"] == "lr-0.2_rule-bp_seed-1") & (metrics["metric"] == "train_loss")
            & (metrics["axis"] == "epoch") & (metrics["index"] == 2))
    assert hole.sum() == 1
    metrics.loc[hole, "value"] = float("nan")
    fig = learning_curves(metrics, table, data.group_keys, ["train_loss"])
    ax = fig.get_axes()[0]
    labels = [line.get_label() for line in ax.lines]
    assert labels == ["lr=0.05, rule=bp (n=2)", "lr=0.2, rule=bp (n=1-2)", "_fewer seeds"]
    circle = ax.lines[2]
    kept = metrics[(metrics["run_id"] == "lr-0.2_rule-bp_seed-0") & (metrics["index"] == 2)
                   & (metrics["metric"] == "train_loss") & (metrics["axis"] == "epoch")]
    assert list(circle.get_xdata()) == [2] and circle.get_markerfacecolor() == "none"
    assert list(circle.get_ydata()) == pytest.approx([float(kept["value"].iloc[0])])
    # one legend for the figure, below the panels, saying what the bands are
    legend = fig.legends[0]
    assert [t.get_text() for t in legend.get_texts()] == labels[:2]
    assert legend.get_title().get_text().startswith("mean over seeds, band +-1 std")


def test_a_group_with_no_value_is_named_not_drawn():
    data = load_protocol_runs(FIXTURE / "protocol.yaml")
    metrics = data.metrics.copy()
    gone = metrics["run_id"].str.startswith("lr-0.2") & (metrics["metric"] == "train_loss")
    metrics.loc[gone, "value"] = float("nan")
    ax = learning_curves(metrics, data.table(), data.group_keys, ["train_loss"]).get_axes()[0]
    assert [line.get_label() for line in ax.lines] == ["lr=0.05, rule=bp (n=2)"]
    assert [t.get_text() for t in ax.texts] == ["no value for: lr=0.2, rule=bp"]


def test_a_group_keeps_its_colour_in_every_panel():
    # One legend serves all panels: a group with no value in one panel (skipped there)
    # shifted the colour cycle, so the next group took its colour in that panel only.
    data = load_protocol_runs(FIXTURE / "protocol.yaml")
    metrics = data.metrics.copy()
    gone = metrics["run_id"].str.startswith("lr-0.05") & (metrics["metric"] == "train_loss")
    metrics.loc[gone, "value"] = float("nan")
    first, second = learning_curves(metrics, data.table(), data.group_keys,
                                    ["train_loss", "val_acc"]).get_axes()
    colour = {line.get_label(): line.get_color() for line in second.lines}
    (kept,) = first.lines
    assert kept.get_label() == "lr=0.2, rule=bp (n=2)"
    assert kept.get_color() == colour["lr=0.2, rule=bp (n=2)"] != colour["lr=0.05, rule=bp (n=2)"]


def test_six_panels_wrap_into_rows_of_three():
    data = load_protocol_runs(FIXTURE / "protocol.yaml")
    fields = ["train_loss", "val_acc", "train_acc", "val_loss", "train_loss", "val_acc"]
    fig = learning_curves(data.metrics, data.table(), data.group_keys, fields)
    shown = [ax for ax in fig.get_axes() if ax.get_visible()]
    assert len(shown) == 6
    assert len({round(ax.get_position().y0, 3) for ax in shown}) == 2  # two rows


def test_analysis_does_not_import_torch():
    code = ("import sys, analysis; "
            f"d = analysis.load_protocol_runs({str(FIXTURE / 'protocol.yaml')!r}); "
            "d.check_complete(['train_loss'], ['test_acc']); "
            "analysis.learning_curves(d.metrics, d.table(), d.group_keys); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr


def test_summary_notebook_records_the_summary(tmp_path):
    result = execute(SUMMARY, tmp_path / "report", {"protocol": str(FIXTURE / "protocol.yaml")},
                     record=False)
    assert result.status == "complete", result.error
    assert not (tmp_path / "report" / "record.json").exists()
    values = result.values
    assert values["n_runs"] == 4
    data = load_protocol_runs(FIXTURE / "protocol.yaml")
    expected = summarize(data.table(), data.group_keys, ["final.test_acc"])
    got = {row["lr"]: row for row in values["summary"]}
    for row in expected.itertuples(index=False):
        assert got[row.lr]["final.test_acc/mean"] == pytest.approx(row[2], abs=1e-9)


def test_report_refuses_incomplete_data(fixture_copy, tmp_path, capsys):
    reports = tmp_path / "reports"
    args = ["report", str(fixture_copy / "protocol.yaml"), "--notebook", str(SUMMARY),
            "--out", str(reports)]
    assert cli_main(args) == 0  # complete: the report
    good = (reports / "fixture.html").read_text()
    capsys.readouterr()
    shutil.rmtree(fixture_copy / "runs" / "lr-0.2_rule-bp_seed-1")
    code = cli_main(args)
    captured = capsys.readouterr()
    assert code == 1
    assert "IncompleteProtocolError" in captured.err and "lr-0.2_rule-bp_seed-1" in captured.err
    # The failed notebook goes beside the last good report, which it never replaces.
    failed = reports / "fixture.failed.html"
    assert f"the failed notebook: {failed.resolve()}" in captured.out
    assert "1 of 4 runs missing" in failed.read_text()
    assert (reports / "fixture.html").read_text() == good
    assert "1 of 4 runs missing" in (reports / "fixture.failed" / "notebook.ipynb").read_text()
    assert "1 of 4 runs missing" not in (reports / "fixture" / "notebook.ipynb").read_text()
    # Fixed, the report is made again and the failure's leftovers go.
    shutil.copytree(FIXTURE / "runs" / "lr-0.2_rule-bp_seed-1",
                    fixture_copy / "runs" / "lr-0.2_rule-bp_seed-1")
    assert cli_main(args) == 0
    assert not failed.exists() and not (reports / "fixture.failed").exists()


def test_a_second_report_of_one_protocol_waits_for_the_first(tmp_path, monkeypatch, capsys):
    # Two at once deleted each other's pending notebook: one crashed with a traceback and
    # called its own good report failed.
    import io
    import threading

    from filelock import FileLock

    reports = tmp_path / "reports"
    reports.mkdir()
    taken, waiting = threading.Event(), threading.Event()

    class Stderr(io.StringIO):  # tells the other "process" that this one is waiting
        def write(self, text):
            if "waiting for another" in text:
                waiting.set()
            return super().write(text)

    err = Stderr()
    monkeypatch.setattr(sys, "stderr", err)

    def other_report():  # holds the report's lock until this one waits for it
        with FileLock(reports / ".fixture.report.lock"):
            taken.set()
            waiting.wait(timeout=120)

    threading.Thread(target=other_report, daemon=True).start()
    taken.wait()
    assert cli_main(["report", str(FIXTURE / "protocol.yaml"), "--notebook", str(SUMMARY),
                     "--out", str(reports)]) == 0
    assert waiting.is_set()
    assert f"waiting for another `lab report` writing {reports / 'fixture'} to finish" \
        in err.getvalue()
    assert sorted(p.name for p in reports.iterdir()) == [".fixture.report.lock", "fixture",
                                                         "fixture.html"]
    assert sorted(p.name for p in (reports / "fixture").iterdir()) == ["notebook.ipynb"]


def test_ctrl_c_during_a_report_is_one_line_and_keeps_the_last_report(tmp_path, capsys,
                                                                       monkeypatch):
    import lab.notebook

    reports = tmp_path / "reports"
    args = ["report", str(FIXTURE / "protocol.yaml"), "--notebook", str(SUMMARY),
            "--out", str(reports)]
    assert cli_main(args) == 0
    good = (reports / "fixture.html").read_bytes()
    capsys.readouterr()

    def interrupted(notebook, out, *args, **kwargs):
        (Path(out) / "notebook.ipynb").parent.mkdir(parents=True)
        (Path(out) / "notebook.ipynb").write_text("{}")  # half-run, as papermill leaves it
        raise KeyboardInterrupt

    monkeypatch.setattr(lab.notebook, "execute", interrupted)
    assert cli_main(args) == 130
    assert capsys.readouterr().err == ("\ninterrupted; no report was made (the last one, if "
                                       "any, is unchanged)\n")
    assert (reports / "fixture.html").read_bytes() == good
    assert not (reports / "fixture.pending").exists()  # the half-run notebook is not kept


def test_ctrl_c_inside_the_swap_waits_for_its_end():
    import os
    import signal

    from lab.cli import _interrupt_deferred

    done = []
    with pytest.raises(KeyboardInterrupt):
        with _interrupt_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            done.append("after the signal")  # still runs: the interrupt waits
    assert done == ["after the signal"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_report_renders_html(tmp_path, capsys):
    reports = tmp_path / "reports"
    assert cli_main(["report", str(FIXTURE / "protocol.yaml"), "--notebook", str(SUMMARY),
                     "--out", str(reports)]) == 0
    html = reports / "fixture.html"
    assert f"report: {html.resolve()}" in capsys.readouterr().out
    text = html.read_text()
    assert "image/png" in text and "±" in text
    # The fixture protocol names no report notebook: without --notebook that is an error.
    assert cli_main(["report", str(FIXTURE / "protocol.yaml"), "--out", str(reports)]) == 2
    assert "names no report notebook" in capsys.readouterr().err


# ---------------------------------------------------------------------------
# any grid key: dotted keys, dict values, step rows


ECHO = ROOT / "tests" / "fixtures" / "notebooks" / "echo.ipynb"


def test_a_dotted_grid_key_runs_and_summaries_group_by_it(tmp_path):
    import yaml

    from lab.sweep import load_protocol, run_sweep

    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({
        "name": "dotted", "notebook": str(ECHO), "out": "runs", "threads_per_run": 1,
        "fixed": {"opts": {"scale": 1, "label": "kept"}},
        "grid": {"opts.scale": [2, 3], "x": [1, 2]}}))
    report = run_sweep(load_protocol(path), workers=2, progress=False)
    assert [(o.run_id, o.status) for o in report.outcomes] == [
        ("opts.scale-2_x-1", "complete"), ("opts.scale-2_x-2", "complete"),
        ("opts.scale-3_x-1", "complete"), ("opts.scale-3_x-2", "complete")]
    # An old run moved aside beside it (same run id) is not part of the protocol.
    kept = tmp_path / "runs" / "opts.scale-2_x-1.old-20200101T000000Z"
    shutil.copytree(tmp_path / "runs" / "opts.scale-2_x-1", kept)
    _edit(kept, lambda r: r["final"].update(scaled=1e6))

    data = load_protocol_runs(path)
    assert data.group_keys == ["opts.scale", "x"]
    assert len(data.runs) == 4
    table = data.table()
    assert list(table["opts.scale"]) == [2, 2, 3, 3]
    summary = summarize(table, ["opts.scale"], ["final.scaled"])
    # The oracle: each run's own record, grouped by the value its config holds.
    by_scale: dict = {}
    for run_dir in sorted((tmp_path / "runs").glob("opts.scale-?_x-?")):
        record = records.load_record(run_dir)
        assert record["config"]["opts"] == {"scale": record["config"]["opts"]["scale"],
                                            "label": "kept"}
        by_scale.setdefault(record["config"]["opts"]["scale"], []).append(
            record["final"]["scaled"])
    assert list(summary["opts.scale"]) == sorted(by_scale)
    for scale, mean, std in zip(summary["opts.scale"], summary["final.scaled/mean"],
                                summary["final.scaled/std"]):
        assert mean == pytest.approx(statistics.mean(by_scale[scale]), abs=1e-12)
        assert std == pytest.approx(statistics.stdev(by_scale[scale]), abs=1e-12)
    assert by_scale == {2: [2, 4], 3: [3, 6]}  # scaled = opts.scale * x, recorded by the kernel


def test_an_empty_dict_grid_value_is_a_group_of_its_own(tmp_path):
    # rule_params: [{}, {scale: 0.5}]: {} was kept as a dict, which groupby cannot hash;
    # then it was two half-NaN columns (rule_params, rule_params.scale). One column now,
    # the values as the protocol writes them.
    from analysis.load import ProtocolRuns
    from lab.sweep import Protocol, expand

    protocol = Protocol(name="t", notebook="nb", out=str(tmp_path), grid={
        "rule_params": [{}, {"scale": 0.5}], "seed": [0, 1]})
    specs = expand(protocol)
    data = ProtocolRuns(protocol, specs, tmp_path, pd.DataFrame(
        columns=list(records.RUN_COLUMNS)), records.tidy_metrics({"run_id": "none"}))
    assert data.group_keys == ["rule_params"]
    table = data.table()
    assert list(table.columns[:3]) == ["run_id", "rule_params", "seed"]
    assert dict(zip(table["run_id"], table["rule_params"])) == {
        s.run_id: "{}" if not s.grid["rule_params"] else "{scale: 0.5}" for s in specs}
    acc = {s.run_id: (0.1 if s.grid["rule_params"] else 0.5) + 0.2 * s.grid["seed"]
           for s in specs}
    table["final.acc"] = table["run_id"].map(acc)
    summary = summarize(table, data.group_keys, ["final.acc"])
    assert list(summary["rule_params"]) == ["{scale: 0.5}", "{}"]
    assert list(summary["final.acc/n"]) == [2, 2]
    assert list(summary["final.acc/mean"]) == pytest.approx([0.2, 0.6], abs=1e-12)


def test_a_grid_key_of_mixed_dicts_gives_no_phantom_rows_or_nan_labels(tmp_path):
    # The trial's conv1: rule x rule_params [{}, {feedback_scale: 0.5}] x seed. "Per seed"
    # showed 8 rows for 4 grid points (half all-NaN) and the bill read rule_params=nan.
    from analysis import rules as compare
    from analysis.load import ProtocolRuns
    from lab.sweep import Protocol, expand

    protocol = Protocol(name="t", notebook="nb", out=str(tmp_path), grid={
        "rule": ["fa", "kp"], "rule_params": [{}, {"feedback_scale": 0.5}], "seed": [0, 1],
        "opts": [{"a": 1, "b": [1, 2]}], "dims": [[3], [1, 2]]})
    specs = expand(protocol)
    acc = {s.run_id: 0.1 * (1 + (s.grid["rule"] == "kp")) + 0.01 * s.grid["seed"]
           + (0.05 if s.grid["rule_params"] else 0.0) for s in specs}
    runs = pd.DataFrame({"run_id": list(acc), "status": "complete", "n_rows": 2,
                         "final.test_acc": list(acc.values())})
    data = ProtocolRuns(protocol, specs, tmp_path, runs, records.tidy_metrics({"run_id": "x"}))
    # Dicts of one shape still flatten (opts.a, opts.b); a list is a tuple as before.
    assert data.group_keys == ["dims", "opts.a", "opts.b", "rule", "rule_params"]
    table = data.table()
    assert not table[data.group_keys].isna().any().any()
    per_seed = compare.per_seed_table(data, "final.test_acc")
    assert len(per_seed) == 8 and not per_seed.isna().any().any()  # 2 rules x 2 x 2 dims
    for (rule, dims, a, b, params), row in per_seed.iterrows():
        assert (a, b) == (1, (1, 2)) and dims in ((3,), (1, 2))
        want = [acc[s.run_id] for s in specs if s.grid["rule"] == rule and
                (s.grid["rule_params"] and "{feedback_scale: 0.5}" or "{}") == params
                and tuple(s.grid["dims"]) == dims]
        assert list(row) == pytest.approx(want, abs=1e-12)
    labels = compare.label_grid_points(table, ["rule", "rule_params"])["rule"]
    assert set(labels) == {"fa, rule_params={}", "fa, rule_params={feedback_scale: 0.5}",
                           "kp, rule_params={}", "kp, rule_params={feedback_scale: 0.5}"}


def test_dict_grid_values_are_flattened_to_columns(tmp_path):
    from analysis.load import ProtocolRuns
    from lab.sweep import Protocol, expand

    protocol = Protocol(name="t", notebook="nb", out=str(tmp_path), grid={
        "rule_params": [{"scale": 0.5, "mode": "raw"}, {"scale": 1.0, "mode": "raw"}],
        "dims": [[1, 2]], "seed": [0, 1]})
    specs = expand(protocol)
    data = ProtocolRuns(protocol, specs, tmp_path, pd.DataFrame(
        columns=list(records.RUN_COLUMNS)), records.tidy_metrics({"run_id": "none"}))
    assert data.group_keys == ["dims", "rule_params.mode", "rule_params.scale"]
    table = data.table().assign(**{"final.acc": [0.1, 0.3, 0.5, 0.9]})
    summary = summarize(table, data.group_keys, ["final.acc"])
    assert list(summary["rule_params.scale"]) == [0.5, 1.0]
    assert list(summary["dims"]) == [(1, 2), (1, 2)]
    assert list(summary["final.acc/mean"]) == pytest.approx([0.2, 0.7], abs=1e-12)


def test_curves_follow_the_step_axis(tmp_path):
    rows = [(rid, "step", step, "loss", value) for rid, scale in (("a", 1.0), ("b", 3.0))
            for step, value in ((0, 2.0 * scale), (10, 1.0 * scale), (20, 0.5 * scale))]
    metrics = pd.DataFrame(rows, columns=list(records.TIDY_COLUMNS))
    table = pd.DataFrame({"run_id": ["a", "b"], "rule": ["kp", "kp"]})
    bands = curve_bands(metrics, table, ["rule"], "loss")
    assert list(bands.columns) == ["group", "step", "mean", "std", "n"]
    assert list(bands["step"]) == [0, 10, 20]
    assert list(bands["mean"]) == pytest.approx([4.0, 2.0, 1.0], abs=1e-12)
    assert list(bands["std"]) == pytest.approx([statistics.stdev([2.0, 6.0]),
                                                statistics.stdev([1.0, 3.0]),
                                                statistics.stdev([0.5, 1.5])], abs=1e-12)
    fig = learning_curves(metrics, table, ["rule"], ["loss"])
    assert fig.get_axes()[0].get_xlabel() == "step"
    assert list(fig.get_axes()[0].lines[0].get_xdata()) == [0, 10, 20]
    single = run_curves([{"step": s, "loss": v} for s, v in ((0, 2.0), (5, 1.0))],
                        fields=(("loss",),))
    assert single.get_axes()[0].get_xlabel() == "step"
    assert list(single.get_axes()[0].lines[0].get_ydata()) == [2.0, 1.0]


def test_runs_of_an_edited_protocol_are_stale_not_results(fixture_copy, capsys):
    # The protocol was edited after its sweep: its old runs must not pass the
    # completeness check, the runs table or a report as the edited protocol's results.
    path = fixture_copy / "protocol.yaml"
    path.write_text(path.read_text().replace("epochs: 4", "epochs: 5").replace(
        "width: 8", "width: 16"))
    data = load_protocol_runs(path)
    assert list(data.table()["status"]) == ["stale"] * 4
    with pytest.raises(IncompleteProtocolError) as err:
        data.check_complete(TRAJECTORY, FINAL)
    assert len(err.value.problems) == 4
    assert ("lr-0.05_rule-bp_seed-0: status 'stale', not 'complete': it is not what the "
            "protocol asks now (epochs: 4 there vs 5 in the protocol; width: 8 there vs 16 in "
            "the protocol): rerun with `lab sweep --force`") in err.value.problems
    assert cli_main(["runs", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.count("stale") == 4 and "complete" not in out
    # A grid value the runs were made with, written otherwise (0.20 for 0.2): not stale.
    path.write_text((FIXTURE / "protocol.yaml").read_text().replace(
        "../../../notebooks", str(ROOT / "notebooks")).replace("0.2]", "0.20]"))
    load_protocol_runs(path).check_complete(TRAJECTORY, FINAL)


def test_a_fixed_key_removed_from_the_protocol_makes_its_runs_stale(fixture_copy, tmp_path,
                                                                   capsys):
    # epochs: 4 taken out of the protocol: the notebook's default now applies, so the old
    # runs are not this protocol's results. `lab runs` and `lab report` resolve the whole
    # config, defaults included, as a sweep does.
    path = fixture_copy / "protocol.yaml"
    path.write_text(path.read_text().replace("  epochs: 4\n", ""))
    assert cli_main(["runs", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.count("stale") == 4 and "complete" not in out
    reports = tmp_path / "reports"
    assert cli_main(["report", str(path), "--notebook", str(SUMMARY), "--out",
                     str(reports)]) == 2
    err = capsys.readouterr().err
    assert "4 run(s) of" in err and "are not what the protocol asks now, so no report" in err
    assert "epochs: 4 there vs" in err and not reports.exists()


def test_a_killed_run_reads_interrupted_in_the_analysis_as_in_lab_runs(fixture_copy):
    run = fixture_copy / "runs" / "lr-0.2_rule-bp_seed-1"
    _edit(run, lambda record: record.update(status="running"))  # a kill -9 leaves this
    data = load_protocol_runs(fixture_copy / "protocol.yaml")
    status = dict(zip(data.runs["run_id"], data.runs["status"]))
    assert status["lr-0.2_rule-bp_seed-1"] == "interrupted"
    with pytest.raises(IncompleteProtocolError, match=r"lr-0.2_rule-bp_seed-1: status "
                                                      r"'interrupted', not 'complete'"):
        data.check_complete(TRAJECTORY, FINAL)


# ---------------------------------------------------------------------------
# arguments: what a researcher typed wrong is named, with its value and what is allowed


def test_a_bare_string_is_refused_where_a_list_of_names_is_expected():
    from analysis import check_names, find_problems

    data = load_protocol_runs(FIXTURE / "protocol.yaml")
    with pytest.raises(TypeError, match=r"^final_metrics must be a list of metric names, "
                                        r"got 'test_acc' \(str\)$"):
        check_complete(data.runs, data.metrics, data.expected_ids, final_metrics="test_acc")
    with pytest.raises(TypeError, match=r"^row_metrics must be a list of metric names, "
                                        r"got 'val_acc' \(str\)$"):
        find_problems(data.runs, data.metrics, data.expected_ids, row_metrics="val_acc")
    with pytest.raises(TypeError, match=r"^expected_ids must be a list of run ids, "
                                        r"got 'lr-0.05_rule-bp_seed-0' \(str\)$"):
        find_problems(data.runs, data.metrics, "lr-0.05_rule-bp_seed-0")
    # The notebooks' parameters, named as the notebook names them.
    with pytest.raises(TypeError, match=r"^final_fields must be a list of metric names, "
                                        r"got 'test_acc' \(str\)$"):
        check_names(trajectory_fields=["train_loss"], final_fields="test_acc")
    with pytest.raises(TypeError, match=r"^curve_fields must be a list of metric names, "
                                        r"got None \(NoneType\)$"):
        check_names(curve_fields=None)
    with pytest.raises(TypeError, match=r"^final_fields must be a list of metric names, "
                                        r"got \['test_acc', 3\] \(3 is int, not a name\)$"):
        check_names(final_fields=["test_acc", 3])
    check_names(final_fields=["test_acc"], curve_fields=("train_loss",), none=[])
    with pytest.raises(TypeError, match=r"^group_keys must be a list of column names, "
                                        r"got 'lr' \(str\)$"):
        summarize(data.table(), "lr", ["final.test_acc"])
    with pytest.raises(TypeError, match=r"^metrics must be a list of column names, "
                                        r"got 'final.test_acc' \(str\)$"):
        summarize(data.table(), ["lr"], "final.test_acc")
    with pytest.raises(TypeError, match=r"^fields must be a list of metric names, "
                                        r"got 'train_loss' \(str\)$"):
        learning_curves(data.metrics, data.table(), data.group_keys, "train_loss")
    with pytest.raises(TypeError, match=r"^protocol must be the path of a protocol YAML file, "
                                        r"got 3 \(int\)$"):
        load_protocol_runs(3)
    with pytest.raises(TypeError, match=r"^runs_dir must be a directory of runs .*got 3 \(int\)$"):
        load_protocol_runs(FIXTURE / "protocol.yaml", 3)
    # Empty, like None: the protocol's out directory.
    assert len(load_protocol_runs(str(FIXTURE / "protocol.yaml"), "").runs) == 4


def test_summary_notebook_names_a_parameter_that_is_not_a_list(tmp_path):
    result = execute(SUMMARY, tmp_path / "report", {"protocol": str(FIXTURE / "protocol.yaml"),
                                                    "final_fields": "test_acc"}, record=False)
    assert result.status == "failed"
    assert "final_fields must be a list of metric names, got 'test_acc' (str)" in result.error


def test_summary_counts_the_values_behind_each_mean():
    # Two groups of two seeds; one value is NaN: its mean and std are over the one value
    # that is there, and the count says 1 of 2.
    table = pd.DataFrame({"run_id": list("abcd"), "rule": ["bp", "bp", "kp", "kp"],
                          "final.acc": [0.2, math.nan, 0.5, 0.7],
                          "final.loss": [1.0, 3.0, 2.0, 2.5]})
    summary = summarize(table, ["rule"], ["final.acc", "final.loss"])
    assert list(summary.columns) == [
        "rule", "final.acc/mean", "final.acc/std", "final.acc/n",
        "final.loss/mean", "final.loss/std", "final.loss/n", "n"]
    assert list(summary["final.acc/n"]) == [1, 2] and list(summary["n"]) == [2, 2]
    assert list(summary["final.loss/n"]) == [2, 2]
    assert summary.loc[0, "final.acc/mean"] == pytest.approx(0.2, abs=1e-12)
    assert math.isnan(summary.loc[0, "final.acc/std"])  # one value: no spread
    assert summary.loc[1, "final.acc/mean"] == pytest.approx(0.6, abs=1e-12)
    assert summary.loc[1, "final.acc/std"] == pytest.approx(0.1 * math.sqrt(2), abs=1e-12)
    assert summary.loc[0, "final.loss/std"] == pytest.approx(math.sqrt(2), abs=1e-12)
    text = format_mean_std(summary)
    assert list(text["final.acc"]) == ["0.2000 (1 of 2 runs)", "0.6000 ± 0.1414"]
    assert list(text["final.loss"]) == ["2.0000 ± 1.4142", "2.2500 ± 0.3536"]
    assert list(text["n"]) == [2, 2]


def test_summarize_refuses_a_column_of_text():
    data = load_protocol_runs(FIXTURE / "protocol.yaml")
    with pytest.raises(TypeError, match=r"^summarize: column 'status' is not numeric \(values "
                                        r"such as 'complete'\); metrics must be columns of "
                                        r"numbers, e.g. final.test_acc$"):
        summarize(data.table(), ["lr"], ["status"])
    # Numbers held as objects (None for a missing one) are numbers.
    table = pd.DataFrame({"g": ["x", "x"], "v": pd.Series([1.0, None], dtype=object)})
    summary = summarize(table, ["g"], ["v"])
    assert summary.loc[0, "v/mean"] == 1.0 and summary.loc[0, "v/n"] == 1


def test_curves_name_an_unknown_field_or_axis():
    data = load_protocol_runs(FIXTURE / "protocol.yaml")
    table = data.table()
    fields = "epoch_wall_s, lr, train_acc, train_loss, val_acc, val_loss"
    with pytest.raises(ValueError, match=rf"^learning_curves: no run of the table has field\(s\) "
                                         rf"'nope' on the epoch or step axis; fields there: "
                                         rf"{fields}$"):
        learning_curves(data.metrics, table, data.group_keys, ["train_loss", "nope"])
    with pytest.raises(ValueError, match=r"^learning_curves: no run of the table has field\(s\) "
                                         r"'train_loss' on the step axis; fields there: none$"):
        learning_curves(data.metrics, table, data.group_keys, ["train_loss"], axis="step")
    with pytest.raises(ValueError, match=r"^axis must be one of 'epoch', 'step' \(or None: the "
                                         r"axis the field is logged on\), got 'epochs'$"):
        learning_curves(data.metrics, table, data.group_keys, axis="epochs")
    with pytest.raises(ValueError, match=r"got 'epochs'$"):
        curve_bands(data.metrics, table, data.group_keys, "train_loss", axis="epochs")
    with pytest.raises(ValueError, match=r"^learning_curves: fields is empty; name at least one "
                                         r"metric to draw, e.g. \['train_loss'\]$"):
        learning_curves(data.metrics, table, data.group_keys, [])
    with pytest.raises(TypeError, match=r"^curve_bands: field must be one metric name \(str\), "
                                        r"got \['train_loss'\] \(list\)$"):
        curve_bands(data.metrics, table, data.group_keys, ["train_loss"])
    # A field only runs outside the table logged is not drawn as an empty panel.
    one = table.iloc[:1]
    others = data.metrics[~data.metrics["run_id"].isin(set(one["run_id"]))]
    with pytest.raises(ValueError, match=r"field\(s\) 'train_loss' .* fields there: none$"):
        learning_curves(others, one, data.group_keys, ["train_loss"])
    with pytest.raises(ValueError, match=r"^learning_curves: the table has no runs"):
        learning_curves(data.metrics, table.iloc[:0], data.group_keys, ["train_loss"])
    trajectory = records.load_record(FIXTURE / "runs" / "lr-0.2_rule-bp_seed-0")["trajectory"]
    with pytest.raises(TypeError, match=r"^run_curves: fields must be a list of tuples of field "
                                        r"names, one tuple per panel, e\.g\. \[\('train_loss', "
                                        r"'val_loss'\), \('train_acc',\)\]; got \['train_loss'\]$"):
        run_curves(trajectory, fields=["train_loss"])
    with pytest.raises(TypeError, match=r"; got \[\]$"):
        run_curves(trajectory, fields=[])
    fig = run_curves(trajectory, fields=[["train_loss"], ("val_loss", "val_acc")])
    assert [len(ax.lines) for ax in fig.get_axes()] == [1, 2]


def test_mt1_check_on_another_protocol_says_it_is_not_mt1():
    from analysis import mt1

    data = load_protocol_runs(FIXTURE / "protocol.yaml")
    with pytest.raises(ValueError, match=r"^MT-1 needs the grid key 'rule_params.traffic_rule'; "
                                         r"this protocol's grid has lr, rule, seed$"):
        mt1.check_mt1_complete(data)


def test_package_docstring_names_the_row_store_records_use():
    import analysis

    assert "parquet" not in analysis.__doc__
    assert f"rows/<axis>/<start>-<end>{records.PART_SUFFIX}" in analysis.__doc__


# ---------------------------------------------------------------------------
# format_mean_std: small stds, infinities, any group-key name; CfC's lift_step


EP_FIXTURE = ROOT / "tests" / "fixtures" / "ep"
CFC_FIXTURE = ROOT / "tests" / "fixtures" / "cfc-aux"


def test_a_small_std_is_shown_with_significant_figures_not_as_zero():
    # The EP report's ratio (EP's validation loss over its twin's) varies by ~1e-5 over seeds.
    data = load_protocol_runs(EP_FIXTURE / "protocol.yaml")
    table = data.table()
    table["final.ratio"] = table["final.val_loss"] / table["final.bp_val_loss"]
    text = format_mean_std(summarize(table, data.group_keys, ["final.ratio", "final.val_loss"]))
    for beta, cell in zip(text["beta"], text["final.ratio"]):
        finals = [records.load_record(EP_FIXTURE / "runs" / f"beta-{beta}_seed-{s}")["final"]
                  for s in (0, 1)]
        ratios = [f["val_loss"] / f["bp_val_loss"] for f in finals]
        want = statistics.stdev(ratios)
        assert 1e-6 < want < 1e-4  # the case: fixed decimals would print 0.0000
        mean, std = cell.split(" ± ")
        assert mean == f"{statistics.mean(ratios):.4f}"
        assert std == f"{want:.3g}" and float(std) == pytest.approx(want, rel=5e-3)
    # A std that four decimals show with two or more significant digits keeps them.
    assert all(len(c.split(" ± ")[1]) == 6 for c in text["final.val_loss"])
    exact = pd.DataFrame({"g": ["a", "a"], "v": [0.5, 0.5]})
    assert format_mean_std(summarize(exact, ["g"], ["v"])).loc[0, "v"] == "0.5000 ± 0.0000"
    # a mean too small for the decimals gets the std's rule (MT-1's residual ratio of
    # 1.6e-09 read "0.0000": a nonzero mean shown as zero); zero stays 0.0000
    tiny = pd.DataFrame({"run_id": list("abcd"), "g": ["x", "x", "y", "z"],
                         "v": [1.6e-9, 1.2e-9, 3e-9, 0.0]})
    cells = list(format_mean_std(summarize(tiny, ["g"], ["v"]))["v"])
    # (a group of one run says it has no std: a mean alone read as a mean over seeds)
    assert cells == [f"{1.4e-9:.3g} ± {statistics.stdev([1.6e-9, 1.2e-9]):.3g}",
                     f"{3e-9:.3g} (1 run: no std)", "0.0000 (1 run: no std)"]


def test_infinities_in_a_group_are_named_not_shown_as_a_plain_number():
    inf = math.inf
    table = pd.DataFrame({"run_id": list("abcdef"), "rule": ["x", "x", "y", "y", "z", "z"],
                          "final.m": [inf, 1.0, inf, -inf, -inf, math.nan]})
    summary = summarize(table, ["rule"], ["final.m"])
    # Kept and counted: the mean is infinite (x), undefined for +inf and -inf (y).
    assert list(summary["final.m/n"]) == [2, 2, 1] and list(summary["n"]) == [2, 2, 2]
    assert summary.loc[0, "final.m/mean"] == inf and math.isnan(summary.loc[0, "final.m/std"])
    assert math.isnan(summary.loc[1, "final.m/mean"]) and math.isnan(summary.loc[1, "final.m/std"])
    assert summary.loc[2, "final.m/mean"] == -inf
    assert list(format_mean_std(summary)["final.m"]) == [
        "inf (no std: a value is infinite)",
        "undefined: +inf and -inf among the values",
        "-inf (1 of 2 runs)"]


def test_group_keys_of_any_name_stay_in_the_formatted_table():
    table = pd.DataFrame({"run_id": list("abcd"), "rule_params/x": ["p", "p", "q", "q"],
                          "final.m": [1.0, 2.0, 3.0, 5.0]})
    summary = summarize(table, ["rule_params/x"], ["final.m"])
    assert summary.attrs["group_keys"] == ["rule_params/x"]
    text = format_mean_std(summary)
    assert list(text.columns) == ["rule_params/x", "final.m", "n"]
    assert list(text["rule_params/x"]) == ["p", "q"]
    assert list(text["final.m"]) == ["1.5000 ± 0.7071", "4.0000 ± 1.4142"]
    # Sorted, or rebuilt from recorded values (no attrs): the keys are still there.
    assert list(format_mean_std(summary.sort_values("final.m/mean", ascending=False))
                ["rule_params/x"]) == ["q", "p"]
    rebuilt = pd.DataFrame(summary.to_dict("records"))
    assert not rebuilt.attrs
    assert format_mean_std(rebuilt).equals(text)
    # A key named like a column the summary makes cannot stay beside it: refused by name.
    table = table.rename(columns={"rule_params/x": "n"})
    with pytest.raises(ValueError, match=r"^summarize: group key\(s\) 'n' have the name of a "
                                         r"column the summary makes \(n, <metric>/mean, "
                                         r"<metric>/std, <metric>/n\); rename them first, e.g. "
                                         r"table.rename\(columns=\{'n': 'n_'\}\)$"):
        summarize(table, ["n"], ["final.m"])
    with pytest.raises(ValueError, match=r"group key\(s\) 'final.m/std' have the name"):
        summarize(table.rename(columns={"n": "final.m/std"}), ["final.m/std"], ["final.m"])


@pytest.fixture
def cfc_unlifted(tmp_path):
    """The CfC fixture's protocol without the lift arm: no run of it lifted."""
    import yaml

    target = tmp_path / "cfc"
    shutil.copytree(CFC_FIXTURE, target)
    path = target / "protocol.yaml"
    protocol = yaml.safe_load(path.read_text())
    protocol["notebook"] = str(ROOT / "notebooks" / "03-train-cfc-aux.ipynb")
    protocol["grid"]["aux"] = ["never", "none"]
    path.write_text(yaml.safe_dump(protocol))
    return path


def test_cfc_lift_step_none_is_kept_when_no_run_lifted(cfc_unlifted, tmp_path):
    from analysis.cfc import lift_steps, lift_table

    data = load_protocol_runs(cfc_unlifted)
    data.check_complete()
    table = data.table()
    ids = data.expected_ids
    assert len(ids) == 4 and all(records.load_record(cfc_unlifted.parent / "runs" / i)
                                 ["final"]["lift_step"] is None for i in ids)
    assert table["final.lift_step"].isna().all()
    lifts = lift_table(table)
    assert list(lifts.columns) == ["aux", "seed", "final.lift_step", "final.val_acc",
                                   "final.val_up_fraction"]
    assert list(lifts["final.lift_step"]) == [None] * 4
    assert lift_steps(table) == dict.fromkeys(ids)
    # With the lift arm: its recorded steps, as ints, beside the others' None.
    full = load_protocol_runs(CFC_FIXTURE / "protocol.yaml").table()
    want = {i: records.load_record(CFC_FIXTURE / "runs" / i)["final"]["lift_step"]
            for i in full["run_id"]}
    assert lift_steps(full) == want and sum(v is not None for v in want.values()) == 2
    assert list(lift_table(full)["final.lift_step"]) == [want[f"aux-{a}_seed-{s}"] for a in
                                                        ("lift", "never", "none") for s in (0, 1)]
    with pytest.raises(KeyError, match=r"^\"lift_table: column 'final.lift_step' not in the "
                                       r"table \(columns: run_id, aux"):
        lift_table(table.drop(columns="final.lift_step"))
    # The report records each run's None.
    result = execute(ROOT / "notebooks" / "30-cfc-summary.ipynb", tmp_path / "report",
                     {"protocol": str(cfc_unlifted)}, record=False)
    assert result.status == "complete", result.error
    assert result.values["lift_steps"] == dict.fromkeys(ids)


# ---------------------------------------------------------------------------
# mis-ordered or wrong-typed calls (trial 5): one error naming the parameter, never
# a bare KeyError or a silently wrong table


def test_summarize_refuses_group_keys_and_metrics_swapped():
    data = load_protocol_runs(FIXTURE / "protocol.yaml")
    table = data.table()
    # The trial's call: the two lists in the wrong order. The message suggests the right
    # one, and that call gives the summary the protocol's own order gives.
    with pytest.raises(ValueError, match=r"^summarize: group_keys \['final.test_acc'\] are "
                                         r"final.\* columns \(a run's results, not grid keys: "
                                         r"grouping by them makes one group per value\); "
                                         r"group_keys and metrics look swapped \(the order is "
                                         r"summarize\(table, group_keys, metrics\)\); did you "
                                         r"mean summarize\(table, \['lr', 'rule'\], "
                                         r"\['final.test_acc'\]\)\? To group by a result on "
                                         r"purpose, copy it to a column without the 'final.' "
                                         r"prefix first$"):
        summarize(table, ["final.test_acc"], data.group_keys)
    right = summarize(table, ["lr", "rule"], ["final.test_acc"])
    assert right.equals(summarize(table, data.group_keys, ["final.test_acc"]))
    # Metrics that are final.* too: not a swap, but still no grouping by a result.
    with pytest.raises(ValueError, match=r"^summarize: group_keys \['final.test_loss'\] are "
                                         r"final.* group by grid keys \(e.g. ProtocolRuns."
                                         r"group_keys\) instead. To group"):
        summarize(table, ["lr", "final.test_loss"], ["final.test_acc"])
    # A text grid key given as a metric (and a numeric one as the group key).
    with pytest.raises(TypeError, match=r"^summarize: column 'rule' is not numeric \(values "
                                        r"such as 'bp'\); metrics must be columns of numbers, "
                                        r"e.g. final.test_acc; 'rule' looks like a group key: "
                                        r"group_keys and metrics look swapped \(the order is "
                                        r"summarize\(table, group_keys, metrics\)\)$"):
        summarize(table, ["lr"], ["rule"])
    # Not a DataFrame (the loaded protocol instead of its table).
    with pytest.raises(TypeError, match=r"^table must be the runs table, one row per run "
                                        r"\(ProtocolRuns.table\(\)\) \(a pandas DataFrame\), "
                                        r"got .* \(ProtocolRuns\)$"):
        summarize(data, data.group_keys, ["final.test_acc"])


def test_summarize_still_groups_by_a_numeric_grid_key():
    # weight_decay is a number, like a metric: only the final. prefix marks a result, so
    # grouping by it stays allowed, and the numbers are the per-group mean and std.
    table = pd.DataFrame({"run_id": list("abcdef"),
                          "weight_decay": [1e-3, 1e-3, 1e-3, 0.0, 0.0, 0.0],
                          "final.test_acc": [0.5, 0.6, 0.8, 0.2, 0.25, 0.3]})
    summary = summarize(table, ["weight_decay"], ["final.test_acc"])
    assert list(summary["weight_decay"]) == [0.0, 1e-3] and list(summary["n"]) == [3, 3]
    for row, accs in zip(summary.itertuples(index=False), ([0.2, 0.25, 0.3], [0.5, 0.6, 0.8])):
        assert row[1] == pytest.approx(statistics.mean(accs), abs=1e-12)
        assert row[2] == pytest.approx(statistics.stdev(accs), abs=1e-12)
    # A numeric metric that is not final.* stays a metric (no name rule applies to it).
    assert summarize(table, [], ["weight_decay"]).loc[0, "weight_decay/mean"] == \
        pytest.approx(0.0005, abs=1e-15)


def test_format_mean_std_refuses_a_table_that_is_not_a_summary():
    data = load_protocol_runs(FIXTURE / "protocol.yaml")
    table = data.table()
    with pytest.raises(ValueError, match=r"^format_mean_std expects summarize's output "
                                         r"\(columns <metric>/mean, <metric>/std, <metric>/n "
                                         r"per metric, and n\), got a table with columns "
                                         r"'run_id', 'lr', 'rule', 'seed', 'status', 'n_rows', "
                                         r".*; pass format_mean_std\(summarize\(table, "
                                         r"group_keys, metrics\)\)$"):
        format_mean_std(table)
    with pytest.raises(TypeError, match=r"^summary must be summarize's output \(a pandas "
                                        r"DataFrame\), got 'x' \(str\)$"):
        format_mean_std("x")
    summary = summarize(table, data.group_keys, ["final.test_acc"])
    with pytest.raises(TypeError, match=r"^format_mean_std: digits must be an int \(decimals "
                                        r"shown\), got 2.5 \(float\)$"):
        format_mean_std(summary, 2.5)
    with pytest.raises(ValueError, match=r"^format_mean_std: digits must be from 0 to 15 "
                                         r"\(decimals shown\), got -1$"):
        format_mean_std(summary, -1)
    mean = summary.loc[0, "final.test_acc/mean"]
    assert format_mean_std(summary, 2).loc[0, "final.test_acc"].startswith(f"{mean:.2f} ± ")


def test_curves_name_the_table_that_lacks_columns():
    data = load_protocol_runs(FIXTURE / "protocol.yaml")
    table = data.table()
    tidy = r"'run_id', 'axis', 'index', 'metric', 'value'"
    # The trial's call: the runs table and the metrics swapped.
    with pytest.raises(ValueError, match=r"^learning_curves: metrics lacks column\(s\) 'axis', "
                                         r"'index', 'metric', 'value': it must be the tidy "
                                         r"metrics table \(ProtocolRuns.metrics or lab.records"
                                         rf".load_metrics\), with columns {tidy}; got columns "
                                         r"'run_id', 'lr', .*; metrics and table look swapped "
                                         r"\(the order is learning_curves\(metrics, table, "
                                         r"group_keys, \.\.\.\)\)$"):
        learning_curves(table, data.metrics, data.group_keys, ["train_loss"])
    with pytest.raises(ValueError, match=r"^curve_bands: metrics lacks column\(s\) 'axis'.*"
                                         r"look swapped \(the order is curve_bands\(metrics, "):
        curve_bands(table, data.metrics, data.group_keys, "train_loss")
    # A table without a group key: which one, and no swap is suggested.
    with pytest.raises(ValueError, match=r"^learning_curves: table lacks column\(s\) 'lr': it "
                                         r"must be the runs table, one row per run \(Protocol"
                                         r"Runs.table\(\)\), with run_id and the group keys; "
                                         r"got columns 'run_id', 'rule', 'seed', ") as err:
        learning_curves(data.metrics, table.drop(columns="lr"), data.group_keys)
    assert "swapped" not in str(err.value)
    with pytest.raises(TypeError, match=r"^metrics must be the tidy metrics table .* \(a pandas "
                                        r"DataFrame\), got None \(NoneType\)$"):
        learning_curves(None, table, data.group_keys)


def test_run_curves_refuses_a_record_and_an_empty_trajectory():
    record = records.load_record(FIXTURE / "runs" / "lr-0.2_rule-bp_seed-0")
    take = (r"pass record\['trajectory'\] \(epoch rows\) or record\['steps'\] \(step rows\) "
            r"of lab.records.load_record\(run_dir\)$")
    with pytest.raises(TypeError, match=r"^run_curves: trajectory must be a list of row dicts "
                                        r"\(one per epoch or step\), got a dict, not its "
                                        r"rows \(keys 'schema_version', 'run_id', 'kind', "
                                        rf"'status', 'config', \.\.\. \(\d+ more\)\); {take}"):
        run_curves(record)
    with pytest.raises(ValueError, match=r"^run_curves: no rows to draw: trajectory is empty"):
        run_curves([])
    with pytest.raises(TypeError, match=rf"got 'train_loss' \(str\); {take}"):
        run_curves("train_loss")
    with pytest.raises(TypeError, match=rf"but trajectory\[1\] is 3 \(int\); {take}"):
        run_curves([record["trajectory"][0], 3])
    # The record's rows draw, a point per epoch.
    fig = run_curves(record["trajectory"])
    lines = fig.get_axes()[0].lines
    assert [list(line.get_xdata()) for line in lines] == [[0, 1, 2, 3]] * 2
    assert list(lines[0].get_ydata()) == [row["train_loss"] for row in record["trajectory"]]


def test_a_misspelled_field_names_itself_and_what_the_runs_record():
    data = load_protocol_runs(FIXTURE / "protocol.yaml")
    with pytest.raises(UnknownFieldError) as err:
        data.check_complete(["train_loss"], ["test_ac"])
    assert str(err.value) == (
        "1 requested field(s) recorded by none of the 4 expected runs (a misspelled name? "
        "rerunning the sweep cannot add them):\n  - no run records a final field 'test_ac'; "
        "recorded: 'test_acc', 'test_loss', 'train_acc', 'train_loss', 'val_acc'")
    # 10-summary's trajectory_fields with a typo: one line for the field, not one per run.
    with pytest.raises(UnknownFieldError, match=r"^1 requested field.*\n  - no run records a "
                                                r"row field 'val_los'; recorded: 'val_loss', "
                                                r"[^\n]*$") as err:
        data.check_complete(TRAJECTORY[:-2] + ["val_los"], FINAL)
    assert err.value.fields == ["val_los"]


def test_a_runs_dir_that_is_not_there_is_named(tmp_path):
    protocol = FIXTURE / "protocol.yaml"
    missing = tmp_path / "nonexist"
    with pytest.raises(FileNotFoundError, match=rf"^runs_dir {re.escape(str(missing))} does "
                                                rf"not exist \(the protocol's runs are in its "
                                                rf"out, {re.escape(str(FIXTURE / 'runs'))}; "
                                                r"leave runs_dir empty to use it\)$"):
        load_protocol_runs(protocol, missing)
    with pytest.raises(FileNotFoundError, match=r"^runs_dir nonexist-runs \(/.*/nonexist-runs\) "
                                                r"does not exist"):
        load_protocol_runs(protocol, "nonexist-runs")
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    with pytest.raises(NotADirectoryError, match=rf"^runs_dir {re.escape(str(a_file))} is a "
                                                 r"file, not a directory of runs$"):
        load_protocol_runs(protocol, tmp_path / "a-file")
    # The runs somewhere else (a copy) still load from an explicit runs_dir.
    shutil.copytree(FIXTURE / "runs", tmp_path / "copy")
    assert len(load_protocol_runs(protocol, tmp_path / "copy").runs) == 4


def test_summary_notebook_names_a_misspelled_trajectory_field(tmp_path):
    result = execute(SUMMARY, tmp_path / "report", {
        "protocol": str(FIXTURE / "protocol.yaml"),
        "trajectory_fields": ["train_loss", "val_los"]}, record=False)
    assert result.status == "failed"
    assert "no run records a row field 'val_los'; recorded: 'val_loss'," in result.error
    assert "rerun the sweep" not in result.error and "missing at epochs" not in result.error


def test_curve_bands_name_an_unknown_field_as_learning_curves_do():
    # An unknown field gave an empty frame: a typo read as "no data".
    data = load_protocol_runs(FIXTURE / "protocol.yaml")
    table = data.table()
    fields = "epoch_wall_s, lr, train_acc, train_loss, val_acc, val_loss"
    with pytest.raises(ValueError, match=rf"^curve_bands: no run of the table has field\(s\) "
                                         rf"'trainloss' on the epoch or step axis; fields "
                                         rf"there: {fields}$"):
        curve_bands(data.metrics, table, ["rule"], "trainloss")
    with pytest.raises(ValueError, match=r"^curve_bands: no run of the table has field\(s\) "
                                         r"'train_loss' on the step axis; fields there: none$"):
        curve_bands(data.metrics, table, ["rule"], "train_loss", axis="step")
    # A field the table's runs logged is still banded: the mean over each group's seeds.
    bands = curve_bands(data.metrics, table, ["lr"], "train_loss")
    assert set(bands["group"]) == {"lr=0.05", "lr=0.2"}
    m = data.metrics
    for (group, epoch), mean in bands.set_index(["group", "epoch"])["mean"].items():
        ids = table.loc[table["lr"] == float(group.removeprefix("lr=")), "run_id"]
        values = m[m["run_id"].isin(ids) & (m["axis"] == "epoch") & (m["index"] == epoch)
                   & (m["metric"] == "train_loss")]["value"]
        assert len(values) == 2 and mean == pytest.approx(values.mean(), rel=1e-12)


def test_a_group_key_given_twice_is_named_not_a_pandas_error():
    data = load_protocol_runs(FIXTURE / "protocol.yaml")
    table = data.table()
    message = (r"group_keys names 'rule' more than once \(\['rule', 'lr', 'rule'\]\); give each "
               r"column once, e.g. \['rule', 'lr'\]$")
    # Was pandas' "cannot insert rule, already exists".
    with pytest.raises(ValueError, match=rf"^summarize: {message}"):
        summarize(table, ["rule", "lr", "rule"], ["final.test_acc"])
    with pytest.raises(ValueError, match=rf"^curve_bands: {message}"):
        curve_bands(data.metrics, table, ["rule", "lr", "rule"], "train_loss")
    with pytest.raises(ValueError, match=rf"^learning_curves: {message}"):
        learning_curves(data.metrics, table, ["rule", "lr", "rule"], ["train_loss"])
    # A metric named twice is summarized once, as before.
    once = summarize(table, ["rule"], ["final.test_acc"])
    assert summarize(table, ["rule"], ["final.test_acc", "final.test_acc"]).equals(once)


def test_mt1_lines_log_is_a_bool():
    from analysis import mt1

    frame = pd.DataFrame({"none": [1.0, 2.0], "raw": [3.0, 4.0]}, index=[0, 1])
    for value, shown in (("no", r"'no' \(str\)"), (0, r"0 \(int\)"), (None, r"None \(NoneType\)")):
        with pytest.raises(TypeError, match=rf"^lines: log must be a bool, got {shown}; give "
                                            r"True or False$"):
            mt1.lines(frame, "rms", log=value)
    assert mt1.lines(frame, "rms", log=True).axes[0].get_yscale() == "log"
    assert mt1.lines(frame, "rms", log=False).axes[0].get_yscale() == "linear"


def test_a_summary_for_one_kind_names_another_trainers_runs():
    # 20-ep-summary on conv runs died on a bare KeyError 'final.val_loss'.
    import re
    from pathlib import Path

    from analysis import check_kind, load_protocol_runs

    fixtures = Path(__file__).resolve().parent / "fixtures"
    conv = load_protocol_runs(fixtures / "summary" / "protocol.yaml")
    with pytest.raises(ValueError, match=re.escape(
            f"20-ep-summary: the protocol {conv.protocol.name!r} holds conv runs (e.g. ")
            + r".*\), not ep runs: this summary reads EP against its twin; summarise them "
            r"with 10-summary or 11-compare-rules \(conv runs\)$"):
        check_kind(conv, "ep", "20-ep-summary", "EP against its twin")
    # 10-summary was offered for every kind; it reads conv fields, so not for CfC runs
    cfc = load_protocol_runs(fixtures / "cfc-aux" / "protocol.yaml")
    with pytest.raises(ValueError, match=r"not ep runs: .*; summarise them with "
                                         r"30-cfc-summary \(cfc_aux runs\)$"):
        check_kind(cfc, "ep", "20-ep-summary", "EP against its twin")
    check_kind(load_protocol_runs(fixtures / "ep" / "protocol.yaml"), "ep", "x", "y")
    check_kind(conv, "conv", "x", "y")


def test_run_curves_names_a_panel_of_unknown_or_grouped_fields():
    rows = records.load_record(FIXTURE / "runs" / "lr-0.2_rule-bp_seed-0")["trajectory"]
    # one field missing from a panel is normal (no val_loss without validation) ...
    assert run_curves(rows, [("train_loss", "no_such")]).get_axes()[0].lines
    # ... a panel with none of its fields is a typo, not an empty panel
    with pytest.raises(ValueError, match=r"^run_curves: no row has any of 'train_los', "
                                         r"'val_los'; the rows' fields: .*'train_loss'"):
        run_curves(rows, [("train_loss",), ("train_los", "val_los")])
    nested = [dict(row, alignment={"mean_update_cos": 0.5, "fc": 0.1}) for row in rows]
    with pytest.raises(TypeError, match=r"^run_curves: field 'alignment' is a group of fields "
                                        r"\('fc', 'mean_update_cos'\), not one"):
        run_curves(nested, [("alignment",)])


def test_curves_of_runs_on_different_axes_name_the_runs_left_out(tmp_path):
    # A conv run logs train_loss per epoch, an EP run per step: the band of the two once
    # showed the conv runs alone, the EP runs gone without a word.
    for run in ("summary/runs/lr-0.05_rule-bp_seed-0", "ep/runs/beta-0.1_seed-0"):
        shutil.copytree(ROOT / "tests" / "fixtures" / run, tmp_path / Path(run).name)
    runs, metrics = records.load_runs(tmp_path), records.load_metrics(tmp_path)
    said = (r"the table's runs log 'train_loss' on different axes: 1 per epoch "
            r"\('lr-0.05_rule-bp_seed-0'\), 1 per step only \('beta-0.1_seed-0'\); pass "
            r"axis='epoch' or axis='step'")
    with pytest.raises(ValueError, match=rf"^curve_bands: {said}"):
        curve_bands(metrics, runs, ["kind"], "train_loss")
    with pytest.raises(ValueError, match=rf"^learning_curves: {said}"):
        learning_curves(metrics, runs, ["kind"], ["train_loss"])
    step = curve_bands(metrics, runs, ["kind"], "train_loss", axis="step")
    assert set(step["group"]) == {"kind=ep"}
    one_kind = runs[runs["kind"] == "conv"]
    assert set(curve_bands(metrics, one_kind, ["kind"], "train_loss")["group"]) == {"kind=conv"}
