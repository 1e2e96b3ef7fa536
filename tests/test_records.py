"""Run records: round trips, atomic writes, validation messages, tidy tables, run tables."""

from __future__ import annotations

import copy
import errno
import json
import math
import os
import warnings

import pandas as pd
import pytest
import torch

from lab import records
from lab.records import RecordError

CONFIG = {"rule": "fa", "lr": 0.05, "seed": 3, "widths": [16, 32], "optim": {"momentum": 0.9}}


@pytest.fixture(scope="module")
def base_record():
    # environment() shells out to git; build the record once and copy it per test.
    return records.new_record(run_id="r0", kind="conv", config=CONFIG, device="cpu")


def filled(base, run_id="r0", **overrides):
    record = copy.deepcopy(base)
    record["run_id"] = run_id
    record["trajectory"] = [
        {
            "epoch": 0,
            "loss": 2.3,
            "acc": 0.1,
            "alignment": {"conv0": 0.93, "fc": 0.5},
            "grad_norm": [1.0, 2.0],
            "epoch_wall_s": 1.5,
        },
        {
            "epoch": 1,
            "loss": 1.9,
            "acc": None,
            "alignment": {"conv0": 0.95, "fc": 0.61},
            "grad_norm": [0.5, 0.25],
            "epoch_wall_s": 1.4,
        },
    ]
    record["steps"] = [{"step": 0, "eta": 0.1}, {"step": 10, "eta": 0.2}]
    record["final"] = {"test_acc": 0.81, "alignment": {"conv0": 0.9}}
    record["work"] = {"flops": 1.0e9, "timing": {"train_wall_s": 9.0}}
    record.update(overrides)
    return record


def strict_loads(text):
    def refuse(constant):
        raise AssertionError(f"non-strict JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


# ---------------------------------------------------------------------------
# round trip


@pytest.mark.parametrize(
    "value", [0.5, math.nan, math.inf, -math.inf], ids=["finite", "nan", "inf", "-inf"]
)
def test_round_trip_equals_saved_record(tmp_path, base_record, value):
    record = filled(base_record)
    record["trajectory"][1]["loss"] = value
    record["trajectory"][1]["alignment"]["fc"] = value
    record["final"]["grad_norms"] = [value, 1.0]
    path = records.save_run(tmp_path / "run", record)

    assert path == tmp_path / "run" / "record.json"
    loaded = records.load_record(tmp_path / "run")
    for got in (
        loaded["trajectory"][1]["loss"],
        loaded["trajectory"][1]["alignment"]["fc"],
        loaded["final"]["grad_norms"][0],
    ):
        assert isinstance(got, float)
        if math.isnan(value):
            assert math.isnan(got)
        else:
            assert got == value
    # NaN != NaN, so compare everything else exactly with the NaNs set aside.
    for rec in (loaded, record):
        rec["trajectory"][1]["loss"] = rec["trajectory"][1]["alignment"]["fc"] = 0.0
        rec["final"]["grad_norms"][0] = 0.0
    assert loaded == record
    strict_loads(path.read_text())


def test_load_record_accepts_the_json_path_too(tmp_path, base_record):
    path = records.save_run(tmp_path / "run", filled(base_record))
    assert records.load_record(path) == records.load_record(tmp_path / "run")


def test_new_record_is_running_and_empty(base_record):
    assert base_record["status"] == "running"
    assert base_record["schema_version"] == records.SCHEMA_VERSION
    assert base_record["config"] == CONFIG and base_record["config"] is not CONFIG
    assert base_record["rows"] == {} and base_record["expect"] is None
    for key in ("final", "work"):
        assert base_record[key] == {}
    assert base_record["error"] is None


def test_new_record_rejects_a_config_json_cannot_hold():
    with pytest.raises(RecordError, match=r"config\.act") as info:
        records.new_record(run_id="x", kind="conv", config={"act": print})
    assert info.value.field == "config.act"


# ---------------------------------------------------------------------------
# atomic writes


def fail_json_dump(monkeypatch):
    def broken(obj, handle, **kwargs):
        handle.write('{"half": ')
        raise OSError("disk full")

    monkeypatch.setattr(records.json, "dump", broken)


def fail_replace(monkeypatch):
    def broken(src, dst):
        raise OSError("rename refused")

    monkeypatch.setattr(records.os, "replace", broken)


@pytest.mark.parametrize("break_write", [fail_json_dump, fail_replace])
def test_failed_save_keeps_previous_record(tmp_path, base_record, monkeypatch, break_write):
    run_dir = tmp_path / "run"
    records.save_run(run_dir, filled(base_record))
    before = (run_dir / "record.json").read_bytes()

    break_write(monkeypatch)
    with pytest.raises(OSError):
        records.save_run(run_dir, filled(base_record, status="complete"))
    monkeypatch.undo()

    assert (run_dir / "record.json").read_bytes() == before
    assert sorted(os.listdir(run_dir)) == ["record.json", "rows"]
    assert records.load_record(run_dir)["status"] == "running"


def test_unserialisable_value_midway_leaves_no_file(tmp_path):
    path = tmp_path / "x.json"
    records.write_json_atomic(path, {"ok": 1})
    with pytest.raises(TypeError):
        records.write_json_atomic(path, {"a": list(range(1000)), "b": object()})
    assert records.read_json(path) == {"ok": 1}
    assert os.listdir(tmp_path) == ["x.json"]


def test_failed_part_write_leaves_the_record_and_store_as_they_were(
    tmp_path, base_record, monkeypatch
):
    run_dir = tmp_path / "runs" / "run"
    record = filled(base_record)
    records.save_run(run_dir, record)
    before = records.load_record(run_dir)
    more = [{"epoch": 2, "loss": 1.5}]

    def broken(*args, **kwargs):
        raise OSError("quota")

    monkeypatch.setattr(records.json, "dumps", broken)
    with pytest.raises(OSError):
        records.append_rows(run_dir, records.load_record(run_dir, rows=False), "epoch", more)
    monkeypatch.undo()
    assert records.load_record(run_dir) == before
    records.append_rows(run_dir, records.load_record(run_dir, rows=False), "epoch", more)
    assert records.load_record(run_dir)["trajectory"] == before["trajectory"] + more


def test_append_costs_one_part_and_reads_back_exactly(tmp_path, base_record):
    run_dir = tmp_path / "run"
    record = filled(base_record)
    records.save_run(run_dir, record)
    stored = records.load_record(run_dir, rows=False)
    extra = [{"epoch": 2, "loss": math.nan, "alignment": {"fc": 0.7}}, {"epoch": 3, "loss": None}]
    records.append_rows(run_dir, stored, "epoch", extra)
    parts = sorted(p.name for p in (run_dir / "rows" / "epoch").iterdir())
    assert parts == ["000000000-000000002.jsonl", "000000002-000000004.jsonl"]
    back = records.load_record(run_dir)
    assert back["rows"] == {"epoch": 4, "step": 2}
    assert back["trajectory"][:2] == record["trajectory"]
    assert math.isnan(back["trajectory"][2]["loss"]) and back["trajectory"][3]["loss"] is None


def test_parts_beyond_the_count_are_ignored(tmp_path, base_record):
    run_dir = tmp_path / "run"
    records.save_run(run_dir, filled(base_record))
    # A kill between the part and the record: the part is there, the count is not raised.
    records.write_part(run_dir, "epoch", [{"epoch": 2, "loss": 9.0}], 2)
    assert len(records.load_record(run_dir)["trajectory"]) == 2
    assert 9.0 not in set(records.run_metrics(run_dir)["value"])
    records.truncate_rows(run_dir, "epoch", 2)
    assert len(list((run_dir / "rows" / "epoch").iterdir())) == 1


def test_non_finite_floats_are_written_as_strings(tmp_path):
    path = tmp_path / "x.json"
    records.write_json_atomic(path, {"a": [math.nan, math.inf, -math.inf], "b": {"c": 1.5}})
    assert strict_loads(path.read_text()) == {
        "a": ["NaN", "Infinity", "-Infinity"],
        "b": {"c": 1.5},
    }
    back = records.read_json(path)
    assert math.isnan(back["a"][0]) and back["a"][1:] == [math.inf, -math.inf]


# ---------------------------------------------------------------------------
# validation: every corruption names the file and the field


def _text(edit):
    def corrupt(text, record):
        return edit(text)

    return corrupt


def _record(edit):
    def corrupt(text, record):
        edit(record)
        return json.dumps(record)

    return corrupt


def _set(path, value):
    def edit(record):
        target = record
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return edit


CORRUPTIONS = {
    "truncated": (_text(lambda text: text[: len(text) // 2]), "<root>"),
    "not_json": (_text(lambda text: "this is not json {"), "<root>"),
    "json_list": (_text(lambda text: "[1, 2, 3]"), "<root>"),
    "missing_status": (_record(lambda r: r.pop("status")), "status"),
    "status_done": (_record(_set(["status"], "done")), "status"),
    "schema_99": (_record(_set(["schema_version"], 99)), "schema_version"),
    "missing_rows": (_record(lambda r: r.pop("rows")), "rows"),
    "rows_negative": (_record(_set(["rows", "epoch"], -1)), "rows.epoch"),
    "rows_beyond_store": (_record(_set(["rows", "epoch"], 3)), "rows.epoch"),
    "config_list": (_record(_set(["config"], [1, 2])), "config"),
    "final_string": (_record(_set(["final", "test_acc"], "81%")), "final.test_acc"),
    "error_number": (_record(_set(["error"], 7)), "error"),
    # A hand-edited completeness declaration gave bare KeyErrors / TypeErrors in every reader.
    "expect_no_axis": (_record(_set(["expect"], {"count": 2})), "expect.axis"),
    "expect_empty": (_record(_set(["expect"], {})), "expect.axis"),
    "expect_axis_other": (_record(_set(["expect"], {"axis": "batch", "count": 2})),
                          "expect.axis"),
    "expect_count_string": (_record(_set(["expect"], {"axis": "epoch", "count": "2"})),
                            "expect.count"),
    "expect_stride_0": (_record(_set(["expect"], {"axis": "epoch", "count": 2, "stride": 0})),
                        "expect.stride"),
    "expect_metrics_string": (_record(_set(["expect"], {"axis": "epoch", "count": 2,
                                                        "metrics": "train_loss"})),
                              "expect.metrics"),
    "expect_periodic_every_0": (_record(_set(["expect"], {"axis": "epoch", "count": 2,
                                                          "periodic": [["alignment/", 0, 0]]})),
                                "expect.periodic"),
    "expect_unknown_key": (_record(_set(["expect"], {"axis": "epoch", "count": 2, "cnt": 2})),
                           "expect.cnt"),
}


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_corrupt_record_names_path_and_field(tmp_path, base_record, name):
    corrupt, field = CORRUPTIONS[name]
    run_dir = tmp_path / "run"
    path = records.save_run(run_dir, filled(base_record))
    path.write_text(corrupt(path.read_text(), json.loads(path.read_text())))

    with pytest.raises(RecordError) as info:
        records.load_record(run_dir)
    message = str(info.value)
    assert str(path) in message
    assert f"'{field}'" in message
    assert info.value.field == field
    assert "allowed" in message


def _edit_row(axis, i, edit):
    def corrupt(lines):
        rows = [json.loads(line) for line in lines]
        edit(rows[i]) if edit else None
        return [json.dumps(row) for row in rows]

    return corrupt


PART_CORRUPTIONS = {
    "epoch_gap": ("epoch", _edit_row("epoch", 1, _set(["epoch"], 3)), "epoch[1].epoch"),
    "epoch_float": ("epoch", _edit_row("epoch", 1, _set(["epoch"], 1.5)), "epoch[1].epoch"),
    "metric_string": ("epoch", _edit_row("epoch", 0, _set(["loss"], "low")), "epoch[0].loss"),
    "nested_metric_string": ("epoch", _edit_row("epoch", 1, _set(["alignment", "fc"], "n/a")),
                             "epoch[1].alignment.fc"),
    "steps_descending": ("step", _edit_row("step", 1, _set(["step"], 0)), "step[1].step"),
    "row_lost": ("epoch", lambda lines: lines[:1], "<part 000000000-000000002.jsonl>"),
    "half_line": ("step", lambda lines: [lines[0], lines[1][:5]],
                  "<part 000000000-000000002.jsonl>"),
}


@pytest.mark.parametrize("name", list(PART_CORRUPTIONS))
def test_corrupt_row_part_names_record_and_row(tmp_path, base_record, name):
    axis, corrupt, field = PART_CORRUPTIONS[name]
    run_dir = tmp_path / "run"
    records.save_run(run_dir, filled(base_record))
    part = next((run_dir / "rows" / axis).iterdir())
    part.write_text("\n".join(corrupt(part.read_text().splitlines())) + "\n")
    # A bad row is named by its part (the file to look at) and its place on the axis; a
    # part that lost rows, as a part (a file, not a field of the record).
    for load in (records.load_record, records.run_metrics):
        with pytest.raises(RecordError) as info:
            load(run_dir)
        message = str(info.value)
        if field.startswith("<part"):
            assert message.startswith(f"{part}: the row part holds ") and "expected" in message
            assert info.value.field == field and "field" not in message
        else:
            assert message.startswith(f"{part}: field '{field}' is ") and "allowed" in message
        assert "trajectory" not in message


def test_a_part_without_its_last_newline_is_cut_short_for_every_reader(tmp_path, base_record):
    # lab runs / load_runs refused it (line count) while load_metrics / run_metrics read it.
    run_dir = tmp_path / "run"
    records.save_run(run_dir, filled(base_record))
    part = next((run_dir / "rows" / "epoch").iterdir())
    part.write_bytes(part.read_bytes().rstrip(b"\n"))
    size = part.stat().st_size
    for load in (records.check_stored_rows, records.run_metrics, records.load_record,
                 lambda d: records.load_metrics(d.parent), lambda d: records.load_runs(d.parent)):
        with pytest.raises(RecordError, match=rf"the row part holds 1 complete lines \({size} "
                           r"bytes\); expected 2 rows, as its name says \(truncated\?"):
            load(run_dir)


def test_bad_status_message_shows_value_and_choices(base_record):
    with pytest.raises(RecordError) as info:
        records.validate_record(filled(base_record, status="done"))
    message = str(info.value)
    assert "<memory>" in message and "'done'" in message
    assert all(status in message for status in records.STATUSES)


def test_missing_record_file_is_a_record_error(tmp_path):
    with pytest.raises(RecordError, match="not found") as info:
        records.load_record(tmp_path / "nowhere")
    assert str(tmp_path / "nowhere" / "record.json") in str(info.value)


def test_validate_returns_the_record(base_record):
    record = filled(base_record)
    assert records.validate_record(record) is record


# ---------------------------------------------------------------------------
# tidy metrics


def count_numeric(value):
    if isinstance(value, dict):
        return sum(count_numeric(v) for v in value.values())
    if isinstance(value, list):
        return sum(count_numeric(v) for v in value)
    return int(isinstance(value, int | float))


@pytest.mark.parametrize(
    "axis, rows, key",
    [("epoch", "trajectory", "epoch"), ("step", "steps", "step"), ("final", "final", None)],
)
def test_tidy_counts_match_numeric_leaves(base_record, axis, rows, key):
    record = filled(base_record)
    tidy = records.tidy_metrics(record)
    section = record[rows] if isinstance(record[rows], list) else [record[rows]]
    expected = sum(count_numeric({k: v for k, v in row.items() if k != key}) for row in section)
    assert (tidy["axis"] == axis).sum() == expected


def test_tidy_flattens_nested_metrics(base_record):
    tidy = records.tidy_metrics(filled(base_record))
    assert list(tidy.columns) == list(records.TIDY_COLUMNS)
    assert tidy["value"].dtype == "float64" and tidy["index"].dtype == "int64"
    values = tidy.set_index(["axis", "index", "metric"])["value"]
    assert values[("epoch", 1, "alignment/conv0")] == 0.95
    assert values[("epoch", 0, "grad_norm/1")] == 2.0
    assert values[("step", 10, "eta")] == 0.2
    assert values[("final", -1, "alignment/conv0")] == 0.9
    assert ("epoch", 1, "acc") not in values.index  # None is not a measurement
    assert set(tidy["run_id"]) == {"r0"}


def test_stored_metrics_equal_tidy_metrics(tmp_path, base_record):
    record = filled(base_record)
    records.save_run(tmp_path / "run", record)
    stored = records.run_metrics(tmp_path / "run")
    pd.testing.assert_frame_equal(stored, records.tidy_metrics(record))


# ---------------------------------------------------------------------------
# run tables


@pytest.fixture
def run_tree(tmp_path, base_record):
    root = tmp_path / "runs"
    records.save_run(root / "a" / "r0", filled(base_record, "r0", status="complete"))
    records.save_run(root / "a" / "r1", filled(base_record, "r1", status="diverged"))
    failed = filled(base_record, "r2", status="failed", error="RuntimeError: boom")
    failed["config"] = {**failed["config"], "lr": 0.5}
    failed["trajectory"] = failed["trajectory"][:1]
    failed["final"] = {}
    records.save_run(root / "b" / "deeper" / "r2", failed)
    return root


def test_load_runs_one_row_per_run(run_tree):
    runs = records.load_runs(run_tree).set_index("run_id")
    assert list(runs.index) == ["r0", "r1", "r2"]
    assert runs["status"].to_dict() == {"r0": "complete", "r1": "diverged", "r2": "failed"}
    assert runs.loc["r2", "error"] == "RuntimeError: boom"
    assert runs["n_epochs"].to_dict() == {"r0": 2, "r1": 2, "r2": 1}
    assert runs["axis"].to_dict() == dict.fromkeys(["r0", "r1", "r2"], "epoch")
    assert runs["n_rows"].to_dict() == {"r0": 2, "r1": 2, "r2": 1}
    assert runs["config.lr"].to_dict() == {"r0": 0.05, "r1": 0.05, "r2": 0.5}
    assert runs.loc["r0", "config.optim/momentum"] == 0.9
    assert runs.loc["r0", "config.widths"] == (16, 32)
    assert runs.loc["r0", "final.test_acc"] == 0.81
    assert runs.loc["r1", "final.alignment/conv0"] == 0.9
    assert math.isnan(runs.loc["r2", "final.test_acc"])
    assert runs.loc["r2", "path"] == str(run_tree / "b" / "deeper" / "r2")


def test_load_runs_names_every_corrupt_record(run_tree):
    bad = [run_tree / "a" / "r1" / "record.json", run_tree / "b" / "deeper" / "r2" / "record.json"]
    bad[0].write_text(bad[0].read_text()[:50])
    bad[1].write_text(bad[1].read_text().replace('"failed"', '"done"'))
    with pytest.raises(RecordError) as info:
        records.load_runs(run_tree)
    message = str(info.value)
    assert all(str(path) in message for path in bad)
    assert str(run_tree / "a" / "r0") not in message
    assert [path for path, _ in info.value.problems] == bad


def test_load_runs_on_a_file_says_it_is_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(FileNotFoundError, match="a file, not a directory"):
        records.load_runs(tmp_path / "f")


def test_load_runs_on_empty_dir_has_base_columns(tmp_path, base_record):
    runs = records.load_runs(tmp_path)
    assert runs.empty and list(runs.columns) == list(records.RUN_COLUMNS)
    # The dtypes of a table with runs (they were all object: a concat lost the ints).
    records.save_run(tmp_path / "a", filled(base_record, run_id="a", status="complete"))
    full = records.load_runs(tmp_path)[list(records.RUN_COLUMNS)]
    assert runs.dtypes.to_dict() == full.dtypes.to_dict() | {"error": object}
    assert runs["n_rows"].dtype == "int64" and runs["n_epochs"].dtype == "int64"


def test_load_metrics_concatenates_every_run(run_tree):
    metrics = records.load_metrics(run_tree)
    assert list(metrics.columns) == list(records.TIDY_COLUMNS)
    expected = sum(
        len(records.tidy_metrics(records.load_record(p))) for p in run_tree.glob("**/record.json")
    )
    assert len(metrics) == expected
    assert set(metrics["run_id"]) == {"r0", "r1", "r2"}
    assert metrics["value"].dtype == "float64"


def test_load_metrics_on_empty_dir(tmp_path):
    metrics = records.load_metrics(tmp_path)
    assert metrics.empty and list(metrics.columns) == list(records.TIDY_COLUMNS)


# ---------------------------------------------------------------------------
# environment and reproducibility comparisons


def test_environment_has_the_facts(base_record):
    env = base_record["environment"]
    expected = {"git_commit", "dirty", "python", "platform", "hostname", "packages"}
    assert expected | {"threads", "device", "cuda", "gpu"} <= set(env)
    assert env["threads"] == torch.get_num_threads()
    assert env["device"] == "cpu"
    assert isinstance(env["dirty"], bool) and isinstance(env["git_commit"], str)
    assert set(env["packages"]) == set(records.PACKAGES)
    assert env["packages"]["torch"] == torch.__version__


def test_without_timings_strips_wall_clock(base_record):
    record = filled(base_record)
    stripped = records.without_timings(record)
    for key in ("created", "updated", "environment", "row_parts"):
        assert key not in stripped
    assert all("epoch_wall_s" not in row for row in stripped["trajectory"])
    assert stripped["work"] == {"flops": 1.0e9, "timing": {}}
    assert "epoch_wall_s" in record["trajectory"][0]  # the original is untouched

    other = filled(base_record)
    other["trajectory"][0]["epoch_wall_s"] = 99.0
    other["updated"] = "2030-01-01T00:00:00+00:00"
    assert records.without_timings(other) == stripped


# ---------------------------------------------------------------------------
# version 1 records (rows inside record.json) are still read


LEGACY = __import__("pathlib").Path(__file__).parent / "fixtures" / "legacy" / "runs"


def test_version_1_records_read_through_the_same_api():
    runs = records.load_runs(LEGACY).set_index("run_id")
    assert set(runs.index) == {"rule-bp_seed-0", "rule-dfa_seed-1", "rule-kp_seed-0",
                               "demo-small_rule-bp_seed-0", "demo-small_rule-kp_seed-1"}
    assert set(runs["axis"]) == {"epoch"} and runs["expect"].isna().all()
    assert runs.loc["rule-kp_seed-0", "n_rows"] == 3
    metrics = records.load_metrics(LEGACY)
    for run_id in runs.index:
        legacy = records.read_json(LEGACY / run_id / "record.json")
        assert legacy["schema_version"] == 1
        mine = metrics[metrics["run_id"] == run_id].reset_index(drop=True)
        pd.testing.assert_frame_equal(mine, records.tidy_metrics(legacy))


def test_load_runs_tells_a_killed_run_from_a_live_one(base_record, tmp_path):
    """record.json says "running" for both; load_runs reads the lock, as `lab runs` does."""
    import subprocess
    import sys

    from lab import runlock

    for name in ("live", "killed", "done"):
        records.save_run(tmp_path / name, filled(base_record, run_id=name,
                                                 status="complete" if name == "done"
                                                 else "running"))
    runlock.acquire(tmp_path / "killed").release()  # a lock file left behind, nobody holding
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from lab import runlock; "
         "held = runlock.acquire(sys.argv[1]); print('held', flush=True); time.sleep(60)",
         str(tmp_path / "live")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        status = dict(zip(*records.load_runs(tmp_path)[["run_id", "status"]].T.values))
    finally:
        holder.kill()
        holder.wait()
    assert status == {"live": "running", "killed": "interrupted", "done": "complete"}
    assert dict(zip(*records.load_runs(tmp_path)[["run_id", "status"]].T.values))["live"] \
        == "interrupted"


def test_load_runs_and_metrics_take_one_runs_record_json(base_record, tmp_path):
    for name in ("a", "b"):
        records.save_run(tmp_path / name, filled(base_record, run_id=name, status="complete"))
    one = records.load_runs(tmp_path / "a" / "record.json")
    assert list(one["run_id"]) == ["a"] and len(records.load_runs(tmp_path)) == 2
    metrics = records.load_metrics(tmp_path / "a" / "record.json")
    assert set(metrics["run_id"]) == {"a"} and len(metrics) > 0
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(FileNotFoundError, match=r"notes.txt: a file, not a directory; give a "
                                                r"directory of runs or a run's record.json$"):
        records.load_runs(tmp_path / "notes.txt")


def test_a_path_argument_that_is_not_a_path_is_named(base_record, tmp_path):
    # pathlib's own "expected str, bytes or os.PathLike object, not list" names neither the
    # function nor the parameter; "" would quietly read the current directory.
    runs = "a run directory, a directory of runs or a record.json path"
    for function in (records.load_runs, records.load_metrics):
        name = function.__name__
        for value, shown in ((["r"], r"\['r'\] \(list\)"), (3, r"3 \(int\)"),
                             (None, r"None \(NoneType\)")):
            with pytest.raises(TypeError, match=rf"^{name}: root must be {runs} \(a str or "
                                                rf"os.PathLike\), got {shown}$"):
                function(value)
        with pytest.raises(ValueError, match=rf"^{name}: root must be {runs} .*got '' \(str\); "
                                             r"'\.' names the current directory$"):
            function("")
    for value, shown in ((["r"], r"\['r'\] \(list\)"), (3, r"3 \(int\)"),
                         (None, r"None \(NoneType\)")):
        with pytest.raises(TypeError, match=r"^load_record: run_dir_or_record_json must be a "
                                            r"run directory or a record.json path \(a str or "
                                            rf"os.PathLike\), got {shown}$"):
            records.load_record(value)
    one = "a run directory or a record.json path"
    for value, shown in ((["r"], r"\['r'\] \(list\)"), (None, r"None \(NoneType\)")):
        with pytest.raises(TypeError, match=rf"^run_metrics: record_path must be {one} \(a str "
                                            rf"or os.PathLike\), got {shown}$"):
            records.run_metrics(value)
    with pytest.raises(ValueError, match=r"^run_metrics: record_path must be .*got '' \(str\)"):
        records.run_metrics("")  # read ./record.json
    for value in ({}, None, {"run_id": 3}):
        with pytest.raises(TypeError, match=r"^tidy_metrics: record must be a run record \(a "
                                            r"dict with a run_id, as load_record returns\), got"):
            records.tidy_metrics(value)
    # A str and a Path still read the same run.
    records.save_run(tmp_path / "a", filled(base_record, run_id="a", status="complete"))
    assert records.load_record(str(tmp_path / "a"))["run_id"] == "a"
    assert list(records.load_runs(str(tmp_path))["run_id"]) == ["a"]
    assert records.load_metrics(tmp_path).equals(records.load_metrics(str(tmp_path)))


def test_load_runs_keeps_a_final_that_is_none_as_a_nan_column(tmp_path):
    # CfC's lift_step is None when the lift never fired: with no run holding a number
    # there, the column vanished and a report's lift table lost it.
    record = records.new_record(run_id="a", kind="cfc_aux", config={"x": 1})
    record.update(status="complete", final={"val_acc": 0.5, "lift_step": None,
                                            "nested": {"k": None, "m": 2}})
    records.save_run(tmp_path / "a", record)
    runs = records.load_runs(tmp_path / "a")
    assert math.isnan(runs["final.lift_step"].item()) and math.isnan(runs["final.nested/k"].item())
    assert runs["final.val_acc"].item() == 0.5 and runs["final.nested/m"].item() == 2


def test_keyword_flags_are_bools_not_truthy_values(base_record, tmp_path):
    import numpy as np

    # A run and the one --force moved aside (same run_id): include_old decides whether
    # the old one is read. "no" is truthy: it read the old run as if True.
    records.save_run(tmp_path / "r", filled(base_record, run_id="r", status="complete"))
    records.save_run(tmp_path / "r.old-20261130T170000Z",
                     filled(base_record, run_id="r", status="diverged"))
    bools = r"; give True or False$"
    for function in (records.load_runs, records.load_metrics):
        name = function.__name__
        for value, shown in (("no", r"'no' \(str\)"), ("False", r"'False' \(str\)"),
                             (0, r"0 \(int\)"), (None, r"None \(NoneType\)")):
            with pytest.raises(TypeError, match=rf"^{name}: include_old must be a bool, got "
                                                rf"{shown}{bools}"):
                function(tmp_path, include_old=value)
    assert list(records.load_runs(tmp_path, include_old=False)["run_id"]) == ["r"]
    both = records.load_runs(tmp_path, include_old=np.True_)  # numpy's bool is a bool
    assert sorted(both["run_id"]) == ["r", "r.old-20261130T170000Z"]
    assert set(records.load_metrics(tmp_path, include_old=True)["run_id"]) == set(both["run_id"])
    # The moved-aside run read on its own keeps its directory's name too (it read as "r",
    # and a concat with the run that replaced it held one id for two runs).
    old = tmp_path / "r.old-20261130T170000Z"
    assert list(records.load_runs(old)["run_id"]) == [old.name]
    assert set(records.load_metrics(old)["run_id"]) == {old.name}
    # rows="no" loaded the rows.
    for value, shown in (("no", r"'no' \(str\)"), (1, r"1 \(int\)"), ([], r"\[\] \(list\)")):
        with pytest.raises(TypeError, match=rf"^load_record: rows must be a bool, got "
                                            rf"{shown}{bools}"):
            records.load_record(tmp_path / "r", rows=value)
    assert "trajectory" not in records.load_record(tmp_path / "r", rows=False)
    with_rows = records.load_record(tmp_path / "r", rows=True)
    assert len(with_rows["trajectory"]) == with_rows["rows"]["epoch"] > 0


def test_a_twin_without_rows_renames_the_other_run_in_load_metrics_too(base_record,
                                                                       tmp_path):
    # load_runs renamed both runs sharing an id; load_metrics counted only runs with rows,
    # so the complete one kept "seed-0" there and a merge on run_id dropped its curves.
    records.save_run(tmp_path / "A" / "seed-0", filled(base_record, run_id="seed-0",
                                                       status="complete"))
    empty = records.new_record(run_id="seed-0", kind="conv", config={"x": 1})
    empty.update(status="failed", error="refused before its first row")
    records.save_run(tmp_path / "B" / "seed-0", empty)
    with pytest.warns(UserWarning, match="share a run_id"):
        runs = records.load_runs(tmp_path)
    with pytest.warns(UserWarning, match=r"load_metrics: 2 runs .* share a run_id"):
        metrics = records.load_metrics(tmp_path)
    assert sorted(runs["run_id"]) == ["A/seed-0", "B/seed-0"]
    assert set(metrics["run_id"]) == {"A/seed-0"}
    merged = metrics.merge(runs[["run_id", "status"]], on="run_id")
    assert len(merged) == len(metrics) and set(merged["status"]) == {"complete"}


def test_runs_sharing_a_run_id_in_different_folders_stay_apart(base_record, tmp_path):
    # Two protocols' outs each hold a rule-bp_seed-0 (or two `lab run --out` runs are
    # named alike in different folders): a groupby on run_id averaged the two runs.
    first = filled(base_record, run_id="seed-0", status="complete")
    second = filled(base_record, run_id="seed-0", status="complete")
    for row in second["trajectory"]:
        row["loss"] += 0.25  # a different run
    records.save_run(tmp_path / "protoA" / "seed-0", first)
    records.save_run(tmp_path / "protoB" / "seed-0", second)
    records.save_run(tmp_path / "protoB" / "other", filled(base_record, run_id="other",
                                                           status="complete"))
    with pytest.warns(UserWarning, match=r"load_runs: 2 runs under .* share a run_id "
                                         r"\('seed-0'\); their run_id here is their directory"):
        runs = records.load_runs(tmp_path)
    assert sorted(runs["run_id"]) == ["other", "protoA/seed-0", "protoB/seed-0"]
    with pytest.warns(UserWarning, match=r"load_metrics: 2 runs .* share a run_id"):
        metrics = records.load_metrics(tmp_path)
    assert set(metrics["run_id"]) == set(runs["run_id"])
    for run_id, record in (("protoA/seed-0", first), ("protoB/seed-0", second)):
        mine = metrics[(metrics["run_id"] == run_id) & (metrics["metric"] == "loss")]
        assert list(mine["value"]) == [row["loss"] for row in record["trajectory"]]
    # one protocol's out alone keeps the recorded ids, without a warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert list(records.load_runs(tmp_path / "protoA")["run_id"]) == ["seed-0"]


def test_a_complete_run_with_fewer_rows_than_declared_is_unreadable(tmp_path, tiny):
    # status set to complete on a run killed half way (or a row count lowered) read as
    # complete in `lab runs`, load_runs and resume, and a sweep skipped it.
    from lab.notebook import run_state
    from lab.train import ConvConfig, train_conv

    train_conv(ConvConfig(**{**tiny, "epochs": 2}), tmp_path / "r")
    record = records.load_record(tmp_path / "r", rows=False)
    assert record["expect"]["count"] == 2
    records.check_stored_rows(tmp_path / "r")
    records.write_record(tmp_path / "r", {**record, "rows": {"epoch": 1}})
    with pytest.raises(RecordError, match=r"record.json: field 'rows.epoch' is 1 for a "
                                          r"complete run; allowed: 2, the rows its expect "
                                          r"declares"):
        records.check_stored_rows(tmp_path / "r")
    assert run_state(tmp_path / "r").status == "unreadable"
    with pytest.raises(RecordError, match="1 for a complete run"):
        records.load_runs(tmp_path)
    with pytest.raises(RecordError, match="1 for a complete run"):  # it returned one epoch
        records.load_metrics(tmp_path)
    # a diverged run may stop short of its declared rows (its final metrics repeat its own
    # last row, not this one's: with the run's final_in_rows the lowered count is caught)
    records.write_record(tmp_path / "r", {**record, "rows": {"epoch": 1}, "status": "diverged"})
    assert record["final_in_rows"] == ["train_loss", "train_acc", "val_acc"]
    with pytest.raises(RecordError, match=r"field 'final.train_loss' is .* but .*"
                                          r"000000000-000000001.jsonl holds epoch\[0\]"):
        records.check_stored_rows(tmp_path / "r")
    records.write_record(tmp_path / "r", {**record, "rows": {"epoch": 1}, "status": "diverged",
                                          "final_in_rows": []})
    records.check_stored_rows(tmp_path / "r")
    assert list(records.load_metrics(tmp_path).query("axis == 'epoch'")["index"].unique()) == [0]


@pytest.mark.parametrize("error, kind", [(errno.ENOSPC, OSError), (errno.EACCES, PermissionError)])
def test_a_failed_write_names_its_file(tmp_path, error, kind):
    # A full disk during a checkpoint's torch.save said only "[Errno 28] No space left on
    # device": which file was being written was left to guess. The half file is removed.
    def write(tmp):
        tmp.write_bytes(b"half")
        raise OSError(error, os.strerror(error))
    target = tmp_path / "checkpoint.pt"
    with pytest.raises(kind) as caught:
        records.atomic_write(target, write)
    assert caught.value.errno == error and caught.value.filename == str(target)
    assert str(caught.value) == f"[Errno {error}] {os.strerror(error)}: '{target}'"
    assert list(tmp_path.iterdir()) == []
    # an error that names its file already is passed on as it is
    def named(tmp):
        raise FileNotFoundError(errno.ENOENT, "gone", "/elsewhere")
    with pytest.raises(FileNotFoundError, match="/elsewhere"):
        records.atomic_write(target, named)
