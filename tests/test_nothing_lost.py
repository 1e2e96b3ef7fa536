"""Nothing lost, nothing silently wrong (issue 35): a kill anywhere in a run's finishing
sequence, a lost record, a damaged or edited row part, a resume across a new checkpoint
cadence, a checkpoint from before a config key existed.

The oracle throughout is the uninterrupted run of the same config: its record (timings
and environment aside) is what every interrupted or repaired run must end with.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_lifecycle import _interrupt  # (a kill between rows that leaves it resumable)

import lab.notebook
from lab import records, runlock
from lab.lifecycle import CHECKPOINT, CheckpointError, Lifecycle
from lab.records import RecordError
from lab.train.synthetic import SyntheticConfig, train_synthetic


def _trainers():
    """(name, train function, config) of the three trainers at tiny sizes, each with a
    checkpoint before the end and evaluations on its last row."""
    from lab.train import CfCAuxConfig, ConvConfig, EPConfig, train_cfc_aux, train_conv, train_ep

    return {
        "conv": (train_conv, ConvConfig(dataset="mnist1d", n_train=256, depth=8, width=4,
                                        epochs=2, batch_size=64, eval_batch_size=500,
                                        schedule="constant", progress=False, threads=1,
                                        checkpoint_every=1)),
        "ep": (train_ep, EPConfig(d_model=8, n_layers=1, n_heads=2, seq_len=8, batch_size=2,
                                  steps=4, warmup_steps=0, eval_every=2, eval_batches=2,
                                  cosine_every=0, progress=False, threads=1,
                                  checkpoint_every=2)),
        "cfc": (train_cfc_aux, CfCAuxConfig(steps=4, batch_size=4, eval_every=2, units=4,
                                            aux_units=4, backbone_units=4, enc_dim=4,
                                            progress=False, threads=1, checkpoint_every=2)),
        "synthetic": (train_synthetic, SyntheticConfig(steps=20, checkpoint_every=7,
                                                       eval_every=3)),
    }


def _same(record: dict) -> dict:
    """What two runs of one config share: everything but timings and the environment."""
    return records.without_timings(record)


def _renames_into(out: Path, calls: list):
    """An os.replace that notes each rename into ``out`` (numba's cache and the like rename
    files elsewhere)."""
    real = os.replace

    def replace(src, dst):
        real(src, dst)
        if Path(dst).resolve().is_relative_to(out.resolve()):
            calls.append(Path(dst).name)
    return replace


def _reference(tmp_path, name, monkeypatch):
    """The uninterrupted run (its directory is named like every other, so run ids agree)
    and the names its renames gave, in order."""
    train, config = _trainers()[name]
    out = tmp_path / "reference" / "run"
    calls = []
    with monkeypatch.context() as patch:
        patch.setattr(os, "replace", _renames_into(out, calls))
        train(config, out)
    return records.load_record(out), calls


def _finishing(calls: list) -> list[int]:
    """The 1-based numbers of the renames of the finishing sequence: the last row part (if
    any), the final checkpoint and the final record."""
    last = len(calls) - 1 - calls[::-1].index(CHECKPOINT)
    assert calls[last + 1:] == [records.RECORD_FILE]
    first = last - 1 if calls[last - 1].endswith(records.PART_SUFFIX) else last
    return list(range(first + 1, len(calls) + 1))


def _killed_at(name: str, out: Path, n: int, after: bool) -> None:
    """Run ``name``'s tiny config in a forked child that SIGKILLs itself at its n-th rename
    into ``out``: with the temp file written and not renamed, or (``after``) just after."""
    train, config = _trainers()[name]
    pid = os.fork()
    if pid == 0:
        try:
            calls = []
            real = os.replace

            def replace(src, dst):
                if Path(dst).resolve().is_relative_to(out.resolve()):
                    calls.append(dst)
                    if len(calls) == n and not after:
                        os.kill(os.getpid(), signal.SIGKILL)
                real(src, dst)
                if calls and calls[-1] == dst and len(calls) == n and after:
                    os.kill(os.getpid(), signal.SIGKILL)

            os.replace = replace
            train(config, out)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, \
        f"the child was not killed at rename {n} (status {status})"


# ---------------------------------------------------------------------------
# fault 1: a kill between the final checkpoint and the final record


def _kill_at_every_finishing_rename(tmp_path, monkeypatch, name):
    reference, calls = _reference(tmp_path, name, monkeypatch)
    train, config = _trainers()[name]
    assert reference["status"] == "complete" and reference["final"] and reference["work"]
    points = _finishing(calls)
    assert len(points) == 3  # row part, checkpoint, record
    for n in points:
        for after in (False, True):
            out = tmp_path / f"killed-{n}-{int(after)}" / "run"
            _killed_at(name, out, n, after)
            again = train(config, out)  # the same call again
            assert again["status"] == "complete"
            on_disk = records.load_record(out)
            assert _same(on_disk) == _same(reference), (n, after)
            assert on_disk["final"] and on_disk["work"]["train_wall_s"] > 0
            records.check_stored_rows(out)
            assert runlock.inspect(out).status == "complete"


@pytest.mark.parametrize("name", ["synthetic", "cfc", "ep",
                                  pytest.param("conv", marks=pytest.mark.slow)])
def test_a_kill_at_any_rename_of_the_finish_loses_nothing(tmp_path, monkeypatch, name):
    # The checkpoint of the finished run was renamed before its record: the run came back
    # complete with final {} and work {} (conv, CfC) or failed KeyError 'ep' (EP's notebook).
    _kill_at_every_finishing_rename(tmp_path, monkeypatch, name)


@pytest.mark.parametrize("damage", ["missing", "unreadable"])
@pytest.mark.parametrize("name", ["synthetic", "cfc", "ep"])
def test_a_finished_run_whose_record_is_lost_gets_it_back_exactly(tmp_path, name, damage):
    # Deleting or truncating record.json of a finished run and calling the trainer again
    # (from Python here, as a notebook does) gave complete with empty metrics.
    train, config = _trainers()[name]
    out = tmp_path / "run"
    train(config, out)
    before = records.load_record(out)
    path = out / records.RECORD_FILE
    if damage == "missing":
        path.unlink()
    else:
        path.write_bytes(path.read_bytes()[:200])
    again = train(config, out)
    after = records.load_record(out)
    # exactly: the environment and times of the run that made it too, not of this call
    assert {k: v for k, v in after.items() if k != "updated"} == \
        {k: v for k, v in before.items() if k != "updated"}
    assert again["final"] == before["final"] and again["work"] == before["work"]


def test_an_interrupted_run_whose_record_is_lost_resumes_as_the_same_run(tmp_path):
    config = SyntheticConfig(steps=30, checkpoint_every=5)
    reference = train_synthetic(config, tmp_path / "reference" / "r")
    out = tmp_path / "killed" / "r"
    _interrupt(config, out, after=12)
    created = records.load_record(out)["created"]
    (out / records.RECORD_FILE).unlink()
    with pytest.warns(UserWarning, match="run_id='another' is not used"):
        resumed = train_synthetic(config, out, run_id="another")  # a run keeps its id
    assert _same(records.load_record(out)) == _same(reference)
    assert resumed["created"] == created and resumed["run_id"] == "r"


def _as_older_lab(out: Path) -> None:
    """The run's checkpoint as a lab before this change wrote it (format 2, no record)."""
    state = torch.load(out / CHECKPOINT, weights_only=True)
    del state["record"]
    state["format"] = 2
    torch.save(state, out / CHECKPOINT)


def _files(out: Path) -> dict:
    return {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and p.name not in (runlock.LOCK_FILE, runlock.PID_FILE)}


@pytest.mark.parametrize("damage", ["missing", "unreadable", "running"])
def test_an_older_finished_checkpoint_without_its_record_is_refused_untouched(tmp_path,
                                                                            damage):
    config = SyntheticConfig(steps=12, checkpoint_every=5)
    out = tmp_path / "run"
    train_synthetic(config, out)
    _as_older_lab(out)
    path = out / records.RECORD_FILE
    if damage == "missing":
        path.unlink()
    elif damage == "unreadable":
        path.write_text("{")
    else:  # a kill between the checkpoint and the record, under the older lab
        record = records.load_record(out, rows=False)
        records.write_record(out, {**record, "status": "running", "final": {}, "work": {},
                                   "final_in_rows": []})
    before = _files(out)
    said = {"missing": "its record.json is missing",
            "unreadable": "its record.json cannot be read",
            "running": "its record.json says 'running' and holds none"}[damage]
    with pytest.raises(CheckpointError, match=re.escape(
            f"{out} holds a complete run (12 step rows) whose final metrics and bill are lost: "
            f"{said}, and its checkpoint, written by an older lab, does not hold them. Nothing "
            "was changed.")):
        train_synthetic(config, out)
    assert _files(out) == before
    # with its record, an older checkpoint resumes and finishes as before
    if damage == "running":
        return
    fresh = tmp_path / "fresh"
    train_synthetic(config, fresh)
    _as_older_lab(fresh)
    assert _same(train_synthetic(config, fresh)) == _same(records.load_record(fresh))


def test_an_interrupted_run_of_an_older_lab_resumes_and_its_parts_are_adopted(tmp_path):
    config = SyntheticConfig(steps=30, checkpoint_every=5)
    reference = train_synthetic(config, tmp_path / "reference" / "r")
    out = tmp_path / "old" / "r"
    _interrupt(config, out, after=12)
    _as_older_lab(out)
    record = records.load_record(out, rows=False)
    older = {k: v for k, v in record.items() if k not in ("row_parts", "final_in_rows")}
    records.write_json_atomic(out / records.RECORD_FILE, {**older, "schema_version": 2})
    train_synthetic(config, out)
    resumed = records.load_record(out)
    assert _same(resumed) == _same(reference) and resumed["schema_version"] == 3
    assert [e[:2] for e in resumed["row_parts"]["step"]] == \
        [[0, 5], [5, 10], [10, 15], [15, 20], [20, 25], [25, 30]]
    records.check_stored_rows(out)


def test_a_trainer_failing_after_divergence_is_recorded_failed_not_lost(tmp_path):
    # The divergence is saved by finish() with the bill; a trainer that fails between the
    # two leaves a failed record saying both.
    config = SyntheticConfig(steps=20, blow_up_at=6, checkpoint_every=4)
    real = Lifecycle.finish

    def broken(self, final=None, work=None):
        raise RuntimeError("evaluation failed")

    Lifecycle.finish = broken
    try:
        with pytest.raises(RuntimeError):
            train_synthetic(config, tmp_path / "r")
    finally:
        Lifecycle.finish = real
    record = records.load_record(tmp_path / "r")
    assert record["status"] == "failed" and len(record["steps"]) == 7
    assert record["error"].startswith("RuntimeError: evaluation failed (after the run "
                                      "diverged: non-finite training loss")


# ---------------------------------------------------------------------------
# fault 2: damaged row parts pass as complete


def _damaged_run(tmp_path, name="cfc"):
    train, config = _trainers()[name]
    out = tmp_path / "runs" / "run"
    train(config, out)
    return out, records.load_record(out, rows=False)


def _flip(part: Path) -> None:
    data = bytearray(part.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 4] = bytes(b ^ 0xFF for b in data[middle:middle + 4])
    part.write_bytes(bytes(data))


def _change_a_digit(part: Path) -> None:
    text = part.read_text()
    match = re.search(r'"train_loss": \d\.(\d)', text)
    digit = match.group(1)
    part.write_text(text[:match.start(1)] + str((int(digit) + 1) % 10) + text[match.end(1):])
    json.loads(text.splitlines()[0])  # still valid JSON, one row per line


def _assert_damaged(out: Path, named: str, what: str) -> None:
    """Every reader refuses the run, naming ``named``; none calls it finished."""
    for check in (records.check_stored_rows, records.load_record, records.run_metrics,
                  lambda d: records.load_runs(d.parent), lambda d: records.load_metrics(d.parent)):
        with pytest.raises(RecordError, match=what) as info:
            check(out)
        assert named in str(info.value)
    state = lab.notebook.run_state(out)  # what `lab run` and `lab sweep` decide by
    assert state.status == "unreadable" and named in state.error


@pytest.mark.parametrize("which", [0, -1], ids=["first-part", "last-part"])
def test_a_flipped_byte_in_any_part_is_damage_naming_the_part(tmp_path, which):
    out, _ = _damaged_run(tmp_path)
    part = sorted((out / "rows" / "step").iterdir())[which]
    _flip(part)
    _assert_damaged(out, str(part), "unreadable text|other bytes than were committed")


@pytest.mark.parametrize("which", [0, -1], ids=["first-part", "last-part"])
def test_one_digit_changed_in_any_part_is_damage_naming_the_part(tmp_path, which):
    out, _ = _damaged_run(tmp_path)
    part = sorted((out / "rows" / "step").iterdir())[which]
    _change_a_digit(part)
    _assert_damaged(out, str(part), r"other bytes than were committed \(sha256 ")


def test_the_last_rows_val_loss_edited_against_the_final_is_damage(tmp_path):
    # Edited with care: the part's hash in record.json made to match. The final metrics
    # still say the val_loss the row said.
    out, record = _damaged_run(tmp_path)
    assert "val_loss" in record["final_in_rows"]
    start, end, _ = record["row_parts"]["step"][-1]
    part = records.part_path(out, "step", start, end)
    lines = part.read_text().splitlines()
    last = json.loads(lines[-1])
    assert last["val_loss"] == record["final"]["val_loss"]
    last["val_loss"] = 0.5
    part.write_text("\n".join([*lines[:-1], json.dumps(last)]) + "\n")
    record["row_parts"]["step"][-1][2] = hashlib.sha256(part.read_bytes()).hexdigest()
    records.write_record(out, record)
    _assert_damaged(out, str(part), re.escape(
        f"field 'final.val_loss' is {record['final']['val_loss']!r} but {part} holds "
        f"step[{last['step']}].val_loss=0.5"))


def test_the_final_val_loss_edited_in_the_record_is_damage(tmp_path):
    out, record = _damaged_run(tmp_path)
    assert record["final"]["val_loss"] != 0.5
    records.write_record(out, {**record, "final": {**record["final"], "val_loss": 0.5}})
    _assert_damaged(out, str(out / records.RECORD_FILE), "field 'final.val_loss' is 0.5 but")


def test_lab_runs_lists_a_damaged_run_as_unreadable(tmp_path, capsys):
    from lab.cli import main

    out, _ = _damaged_run(tmp_path, "synthetic")
    part = sorted((out / "rows" / "step").iterdir())[1]
    assert main(["runs", str(out.parent)]) == 0
    assert "complete" in capsys.readouterr().out
    _change_a_digit(part)
    main(["runs", str(out.parent)])
    shown = " ".join(capsys.readouterr().out.split())
    assert "complete" not in shown and "could not be read" in shown and part.name in shown, shown


def test_lab_run_does_not_skip_a_damaged_run_as_finished(tmp_path, capsys):
    # It returned rc 0 ("already finished") for a run whose part had a byte flipped.
    from lab.cli import main

    out, _ = _damaged_run(tmp_path)
    part = sorted((out / "rows" / "step").iterdir())[0]
    _change_a_digit(part)
    before = _files(out)
    params = [a for k, v in (("steps", 4), ("batch_size", 4), ("eval_every", 2), ("units", 4),
                             ("aux_units", 4), ("backbone_units", 4), ("enc_dim", 4),
                             ("threads", 1), ("checkpoint_every", 2)) for a in ("-p", k, str(v))]
    notebook = Path(__file__).parent.parent / "notebooks" / "03-train-cfc-aux.ipynb"
    assert main(["run", str(notebook), "--out", str(out), *params]) == 2
    said = " ".join(capsys.readouterr().err.split())
    assert f"{out} already holds a run whose record cannot be read ({part}: the row part " \
           "holds other bytes than were committed" in said and "nothing was changed" in said
    assert _files(out) == before


def test_records_of_older_versions_still_load_and_a_resave_hashes_their_parts(tmp_path):
    # A version 2 record (no row_parts): read by line count, as before; saved again (a
    # notebook marking it failed), its parts are hashed as they are.
    out, record = _damaged_run(tmp_path, "synthetic")
    older = {k: v for k, v in record.items() if k not in ("row_parts", "final_in_rows")}
    records.write_json_atomic(out / records.RECORD_FILE, {**older, "schema_version": 2})
    rows = records.load_record(out)["steps"]
    records.check_stored_rows(out)
    resaved = records.load_record(out, rows=False)
    records.save_run(out, {**resaved, "status": "failed", "error": "x"})
    now = records.load_record(out)
    assert now["schema_version"] == records.SCHEMA_VERSION == 3
    assert now["row_parts"] == record["row_parts"] and now["steps"] == rows
    _change_a_digit(next((out / "rows" / "step").iterdir()))
    with pytest.raises(RecordError, match="other bytes than were committed"):
        records.check_stored_rows(out)


# ---------------------------------------------------------------------------
# gap: a kill between a row part and its checkpoint, resumed at another cadence


@pytest.mark.parametrize("name,cadence", [("synthetic", 3), ("cfc", 1), ("synthetic", 0)])
def test_a_kill_after_a_part_before_its_checkpoint_resumed_at_another_cadence(
        tmp_path, monkeypatch, name, cadence):
    reference, calls = _reference(tmp_path, name, monkeypatch)
    train, config = _trainers()[name]
    # the second save's part written, its checkpoint not: a part beyond the committed rows
    second = [i for i, c in enumerate(calls, 1) if c.endswith(records.PART_SUFFIX)][1]
    out = tmp_path / "killed" / "run"
    _killed_at(name, out, second, after=True)
    assert len(list((out / "rows" / "step").iterdir())) == 2
    again = train(replace(config, checkpoint_every=cadence), out)
    assert again["status"] == "complete"
    on_disk = records.load_record(out)  # every part read and checked against its hash
    assert _same(on_disk)["steps"] == _same(reference)["steps"]
    assert _same(on_disk)["final"] == _same(reference)["final"]
    records.check_stored_rows(out)
    # the store holds the committed parts and nothing else
    committed = {records.part_path(out, "step", s, e) for s, e, _ in on_disk["row_parts"]["step"]}
    assert set((out / "rows" / "step").iterdir()) == committed


# ---------------------------------------------------------------------------
# gap: a checkpoint that lacks a config key the current config has


def _without_key(out: Path, dotted: str) -> None:
    """The run's checkpoint and record as a lab without config key ``dotted`` wrote them."""
    *parents, leaf = dotted.split(".")
    state = torch.load(out / CHECKPOINT, weights_only=True)
    for config in (state["identity"], state["record"]["config"]):
        for key in parents:
            config = config[key]
        del config[leaf]
    torch.save(state, out / CHECKPOINT)
    record = records.load_record(out, rows=False)
    config = record["config"]
    for key in parents:
        config = config[key]
    del config[leaf]
    records.write_record(out, record)


def test_a_checkpoint_without_a_new_key_resumes_at_its_default_and_refuses_another(tmp_path):
    # A parameter is added with the default that does what the code did before it: a run
    # from before resumes under the default, and under another value is a config change.
    config = SyntheticConfig(steps=30, checkpoint_every=5)
    reference = train_synthetic(config, tmp_path / "reference" / "r")
    out = tmp_path / "old" / "r"
    _interrupt(config, out, after=12)
    _without_key(out, "lr")
    with pytest.raises(CheckpointError, match=re.escape(
            "belongs to a run with a different config (lr: absent there (read as its default "
            "0.05) vs 0.1 now)")):
        train_synthetic(SyntheticConfig(steps=30, checkpoint_every=5, lr=0.1), out)
    resumed = train_synthetic(config, out)
    assert resumed["status"] == "complete"
    assert _same(resumed)["steps"] == _same(reference)["steps"]
    assert resumed["final"] == reference["final"]
    assert records.load_record(out)["config"]["lr"] == 0.05  # the record names it now


def test_a_finished_conv_run_without_a_new_rule_parameter_is_the_same_run(tmp_path):
    from lab.train import train_conv

    _, config = _trainers()["conv"]
    kp = replace(config, rule="kp", rule_params={})
    out = tmp_path / "r"
    first = train_conv(kp, out)
    assert "feedback_scale" in first["config"]["rule_params"]
    _without_key(out, "rule_params.feedback_scale")
    before = _files(out)
    again = train_conv(kp, out)  # at the default: the finished run, untouched
    assert again["status"] == "complete" and _files(out) == before
    other = replace(config, rule="kp", rule_params={"feedback_scale": 0.5})
    with pytest.raises(CheckpointError, match=re.escape(
            "different config (rule_params.feedback_scale: absent there (read as its default "
            "1.0) vs 0.5 now)")):
        train_conv(other, out)
    assert _files(out) == before
