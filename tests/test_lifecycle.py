"""The shared run lifecycle: divergence, resume, kills at any moment, refusals, row store.

Most checks use the synthetic trainer (``lab.train.synthetic``), whose steps
cost microseconds, so kills can land anywhere, including inside a save.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import signal
import time
import warnings

import pytest
import torch

from lab import records
from lab.config import as_dict
from lab.lifecycle import CHECKPOINT, CheckpointError, Divergence, Expectation, Lifecycle
from lab.train.synthetic import SyntheticConfig, train_synthetic


def _rows(record):
    return record["steps"]


# ---------------------------------------------------------------------------
# divergence: one policy, each trigger


@pytest.mark.parametrize("key,value,eval_every,message", [
    ("train_loss", math.inf, 0, r"non-finite training loss train_loss=inf at step 7"),
    ("train_loss", math.nan, 0, r"non-finite training loss train_loss=nan at step 7"),
    ("train_loss", 1e9, 0, r"train_loss=1e\+09 at step 7 exceeds 1000 x the loss at init"),
    ("val_loss", math.nan, 1, r"non-finite evaluation loss val_loss=nan at step 7"),
])
def test_each_divergence_trigger_stops_the_run_and_keeps_its_rows(tmp_path, key, value,
                                                                  eval_every, message):
    config = SyntheticConfig(steps=20, blow_up_at=7, blow_up_key=key, blow_up_value=value,
                             eval_every=eval_every, checkpoint_every=3)
    record = train_synthetic(config, tmp_path / "r")
    assert record["status"] == "diverged"
    assert len(_rows(record)) == 8  # rows 0..7, the offending one included
    import re
    assert re.search(message, record["error"]), record["error"]
    saved = records.load_record(tmp_path / "r")
    assert saved["status"] == "diverged" and saved["error"] == record["error"]
    assert saved["rows"] == {"step": 8}
    assert json.dumps(saved["steps"][:7]) == json.dumps(record["steps"][:7])
    # Resuming a diverged run returns it as it is, without training again.
    again = train_synthetic(config, tmp_path / "r")
    assert again["status"] == "diverged" and len(_rows(again)) == 8


def test_absolute_cap_triggers_below_the_factor_bound(tmp_path):
    config = SyntheticConfig(steps=10, blow_up_at=3, blow_up_value=50.0)
    record = train_synthetic(config, tmp_path / "r", divergence=Divergence(cap=40.0))
    assert record["status"] == "diverged"
    assert "exceeds the absolute cap 40" in record["error"]
    fine = train_synthetic(config, tmp_path / "s")  # 50 < 1000 x the initial loss
    assert fine["status"] == "complete"


def test_a_step_whose_own_computation_blows_up_diverges_with_its_rows_kept(tmp_path):
    # (lhfa at lr 0.3: its perturbed passes overflowed once the weights had grown, and the
    # run was "failed", so a learning-rate selection could not finish on it.)
    from lab.config import Diverged
    from lab.lifecycle import train
    from lab.train.synthetic import Synthetic

    class BlowsUp(Synthetic):
        def step(self, run, position, life):
            if position == 5:
                raise Diverged("the rule's probes overflowed")
            return super().step(run, position, life)

    config = SyntheticConfig(steps=10, checkpoint_every=2)
    record = train(BlowsUp(), config, tmp_path / "r")
    assert record["status"] == "diverged" and len(_rows(record)) == 5
    assert record["error"] == "the rule's probes overflowed (during step 5)"
    # The final metrics are of the state after the last row, as a 5-step run's.
    five = train_synthetic(SyntheticConfig(steps=5), None)
    assert record["final"] == five["final"] and record["steps"] == five["steps"]
    saved = records.load_record(tmp_path / "r")
    assert saved["status"] == "diverged" and saved["error"] == record["error"]
    assert saved["rows"] == {"step": 5} and "train_wall_s" in saved["work"]
    again = train(BlowsUp(), config, tmp_path / "r")  # finished: returned, not retrained
    assert again["status"] == "diverged" and len(_rows(again)) == 5
    class Fails(Synthetic):
        def step(self, run, position, life):
            raise FloatingPointError("plain")

    with pytest.raises(FloatingPointError, match="^plain$"):  # any other error: failed
        train(Fails(), config, tmp_path / "f")
    assert records.load_record(tmp_path / "f")["status"] == "failed"


def test_factor_scales_with_the_baseline_not_a_fixed_number():
    policy = Divergence(factor=10.0)
    assert policy.check({"train_loss": 25.0}, 2.0, "step 1") is not None
    assert policy.check({"train_loss": 25.0}, 3.0, "step 1") is None
    assert policy.check({"train_loss": 19.9}, 2.0, "step 1") is None


def test_non_finite_final_evaluation_diverges(tmp_path):
    config = SyntheticConfig(steps=3)
    life = Lifecycle(kind="t", config=config, expect=Expectation("step", 3), parts={},
                     out_dir=tmp_path / "r", progress=False)
    with life:
        life.start()
        for _ in life.rows():
            life.log({"train_loss": 1.0})
        record = life.finish({"test_loss": math.nan, "test_acc": 0.5})
    assert record["status"] == "diverged"
    assert "non-finite evaluation loss test_loss=nan at the final evaluation" in record["error"]
    assert records.load_record(tmp_path / "r")["status"] == "diverged"


def test_rows_without_progress_never_touch_tqdm(tmp_path, monkeypatch):
    # A disabled tqdm still takes tqdm's lock shared with forked processes; a forked run
    # SIGKILLed while holding it left the next bar waiting for ever (the SIGKILL test hung).
    import lab.lifecycle

    def no_bar(*args, **kwargs):
        raise AssertionError("a progress bar was made")

    monkeypatch.setattr(lab.lifecycle, "tqdm", no_bar)
    life = Lifecycle(kind="t", config=SyntheticConfig(steps=3), expect=Expectation("step", 3),
                     parts={}, out_dir=tmp_path / "r", progress=False)
    with life:
        life.start()
        life.log({"train_loss": 1.0})
        rows = life.rows()
        assert list(rows) == [1, 2]  # the positions left, as the bar would give them
        rows.set_postfix(loss="1.0")
        rows.close()


@pytest.mark.parametrize("bad", [{"factor": 1.0}, {"cap": 0.0}])
def test_divergence_policy_refuses_bounds_that_stop_every_run(bad):
    with pytest.raises(ValueError, match="must be > 1 and cap"):
        Divergence(**bad)


# ---------------------------------------------------------------------------
# resume, refusals, what a checkpoint holds


def test_resume_refuses_another_config_but_not_a_display_flag(tmp_path):
    config = SyntheticConfig(steps=30, checkpoint_every=5)
    life = Lifecycle(kind="synthetic", config=config, expect=Expectation("step", 30), parts={},
                     out_dir=tmp_path / "r", progress=False, checkpoint_every=5)
    with life:
        life.start()
        for _ in range(12):
            life.log({"train_loss": 1.0})
        life.close()  # interrupted: 10 rows are in the store
    with pytest.raises(CheckpointError, match=r"different config \(lr: 0.05 there vs 0.1 now\)"):
        train_synthetic(SyntheticConfig(steps=30, checkpoint_every=5, lr=0.1), tmp_path / "r")
    assert records.load_record(tmp_path / "r")["status"] == "running"
    # progress is display-only: the same run, resumed (its checkpoint had no parts, so
    # the synthetic trainer's parts are missing and it says so instead of guessing).
    with pytest.raises(CheckpointError, match="lacks generator, weights"):
        train_synthetic(SyntheticConfig(steps=30, checkpoint_every=5, progress=True),
                        tmp_path / "r")


def _interrupted_synthetic(run_dir, steps=30):
    _interrupt(SyntheticConfig(steps=steps, checkpoint_every=5), run_dir, after=12)
    assert records.load_record(run_dir)["status"] == "running"  # (no one holds it)


def test_a_checkpoint_copied_from_elsewhere_is_blamed_not_the_run(tmp_path):
    # An interrupted run given a finished run's checkpoint (another config) was called "a
    # complete run with a different config"; the record says otherwise: the file is foreign.
    train_synthetic(SyntheticConfig(steps=20, checkpoint_every=5), tmp_path / "done")
    _interrupted_synthetic(tmp_path / "r")
    (tmp_path / "r" / CHECKPOINT).write_bytes((tmp_path / "done" / CHECKPOINT).read_bytes())
    before = (tmp_path / "r" / "record.json").read_bytes()
    with pytest.raises(CheckpointError, match=re.escape(
            f"{tmp_path / 'r' / CHECKPOINT} belongs to a run with a different config (steps: "
            "20 there vs 30 now)")):
        train_synthetic(SyntheticConfig(steps=30, checkpoint_every=5), tmp_path / "r")
    assert (tmp_path / "r" / "record.json").read_bytes() == before
    # the finished run itself, asked with another config, still says what it holds
    with pytest.raises(CheckpointError, match=re.escape(
            f"{tmp_path / 'done'} holds a complete run with a different config (steps: 20 "
            "there vs 30 now); nothing was changed")):
        train_synthetic(SyntheticConfig(steps=30, checkpoint_every=5), tmp_path / "done")


def test_another_trainers_checkpoint_is_named_as_such(tmp_path):
    # A CfC checkpoint in an EP run listed some 55 differing fields.
    other = Lifecycle(kind="cfc_aux", config=SyntheticConfig(steps=30), parts={},
                      expect=Expectation("step", 30), out_dir=tmp_path / "x", progress=False,
                      checkpoint_every=5)
    with other:
        other.start()
        for _ in range(6):
            other.log({"train_loss": 1.0})
        other.close()
    _interrupted_synthetic(tmp_path / "r")
    (tmp_path / "r" / CHECKPOINT).write_bytes((tmp_path / "x" / CHECKPOINT).read_bytes())
    with pytest.raises(CheckpointError, match=re.escape(
            f"checkpoint {tmp_path / 'r' / CHECKPOINT} was written by a 'cfc_aux' run; this "
            "trainer makes 'synthetic' runs")):
        train_synthetic(SyntheticConfig(steps=30, checkpoint_every=5), tmp_path / "r")


def test_an_empty_checkpoint_says_so(tmp_path):
    _interrupted_synthetic(tmp_path / "r")
    (tmp_path / "r" / CHECKPOINT).write_bytes(b"")
    with pytest.raises(CheckpointError, match=re.escape(
            f"checkpoint {tmp_path / 'r' / CHECKPOINT} cannot be read (EOFError: the file is "
            "empty or cut short); delete it to start the run afresh")):
        train_synthetic(SyntheticConfig(steps=30, checkpoint_every=5), tmp_path / "r")


def test_display_only_change_resumes(tmp_path):
    config = SyntheticConfig(steps=40, checkpoint_every=5)
    full = train_synthetic(config, tmp_path / "ref")
    _interrupt(SyntheticConfig(steps=40, checkpoint_every=5), tmp_path / "r", after=17)
    resumed = train_synthetic(SyntheticConfig(steps=40, checkpoint_every=5, progress=True),
                              tmp_path / "r")
    assert resumed["steps"] == full["steps"] and resumed["final"] == full["final"]


def test_a_new_checkpoint_cadence_resumes_and_leaves_a_finished_run_as_it_is(tmp_path):
    # Changing checkpoint_every made every complete run of a protocol stale (retrained with
    # --force) and refused resumes, though the cadence never changes what is computed.
    full = train_synthetic(SyntheticConfig(steps=40, checkpoint_every=5), tmp_path / "ref")
    _interrupt(SyntheticConfig(steps=40, checkpoint_every=5), tmp_path / "r", after=17)
    resumed = train_synthetic(SyntheticConfig(steps=40, checkpoint_every=3), tmp_path / "r")
    assert resumed["steps"] == full["steps"] and resumed["final"] == full["final"]
    again = train_synthetic(SyntheticConfig(steps=40, checkpoint_every=0), tmp_path / "ref")
    assert records.without_timings(again) == records.without_timings(full)  # nothing to do
    # Still an identity for everything else: another lr is refused.
    with pytest.raises(CheckpointError, match=r"lr: 0.05 there vs 0.1 now"):
        train_synthetic(SyntheticConfig(steps=40, checkpoint_every=3, lr=0.1), tmp_path / "r")


def _interrupt(config, out, after):
    """Run ``after`` rows, then stop as a KeyboardInterrupt would (run stays resumable)."""
    calls = {"n": 0}
    original = Lifecycle.log

    def log(self, row):
        calls["n"] += 1
        if calls["n"] > after:
            raise KeyboardInterrupt
        return original(self, row)

    Lifecycle.log = log
    try:
        with pytest.raises(KeyboardInterrupt):
            train_synthetic(config, out)
    finally:
        Lifecycle.log = original
    assert records.load_record(out)["status"] == "running"


@pytest.mark.parametrize("every, said", [
    (5, "keeps its last checkpoint; the same call again resumes the run from it"),
    (0, "has no checkpoint yet; the same call again starts the run afresh")])
def test_an_interrupted_call_says_how_to_go_on(tmp_path, capsys, every, said):
    # A Jupyter user interrupting the kernel saw only torch's KeyboardInterrupt traceback.
    _interrupt(SyntheticConfig(steps=30, checkpoint_every=every, progress=True),
               tmp_path / "r", after=12)
    err = " ".join(capsys.readouterr().err.split())
    assert f"interrupted: {tmp_path / 'r'} {said}" in err
    _interrupt(SyntheticConfig(steps=30, checkpoint_every=every), tmp_path / "q", after=12)
    assert "interrupted" not in capsys.readouterr().err  # progress=False: quiet


def test_checkpoint_holds_state_and_a_count_not_the_rows(tmp_path):
    train_synthetic(SyntheticConfig(steps=25, checkpoint_every=10), tmp_path / "r")
    state = torch.load(tmp_path / "r" / CHECKPOINT, weights_only=True)
    assert set(state) == {"format", "kind", "identity", "rows", "baseline", "status", "error",
                          "parts", "data", "wall_s", "record"}
    assert state["rows"] == 25 and set(state["parts"]) == {"weights", "generator"}
    # the record as record.json holds it (final metrics and bill), not the rows
    stored = records.load_record(tmp_path / "r", rows=False)
    assert {**records.decode_nonfinite(state["record"]), "updated": stored["updated"]} == stored
    # One part per save: rows 0-10, 10-20, 20-25.
    names = sorted(p.name for p in (tmp_path / "r" / "rows" / "step").iterdir())
    assert names == ["000000000-000000010.jsonl", "000000010-000000020.jsonl",
                     "000000020-000000025.jsonl"]
    record = json.loads((tmp_path / "r" / "record.json").read_text())
    assert "steps" not in record and "trajectory" not in record
    assert record["rows"] == {"step": 25} and record["expect"]["count"] == 25


@pytest.mark.parametrize("damage,message", [
    (lambda s: s.pop("identity"), "lacks its config"),
    (lambda s: s["parts"].pop("generator"), "lacks generator"),
    (lambda s: s.pop("format"), "written by an older lab"),
])
def test_damaged_checkpoint_is_refused_not_resumed(tmp_path, damage, message):
    config = SyntheticConfig(steps=20, checkpoint_every=5)
    _interrupt(config, tmp_path / "r", after=12)
    path = tmp_path / "r" / CHECKPOINT
    state = torch.load(path, weights_only=True)
    damage(state)
    torch.save(state, path)
    with pytest.raises(CheckpointError, match=message):
        train_synthetic(config, tmp_path / "r")


def test_unreadable_checkpoint_names_the_file(tmp_path):
    config = SyntheticConfig(steps=20, checkpoint_every=5)
    _interrupt(config, tmp_path / "r", after=12)
    (tmp_path / "r" / CHECKPOINT).write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match=r"checkpoint .*checkpoint.pt cannot be read"):
        train_synthetic(config, tmp_path / "r")


def test_finished_run_is_returned_untouched_and_another_config_refused(tmp_path):
    config = SyntheticConfig(steps=10)
    first = train_synthetic(config, tmp_path / "r")
    (tmp_path / "r" / CHECKPOINT).unlink()  # as the committed fixtures are kept
    before = (tmp_path / "r" / "record.json").read_bytes()
    again = train_synthetic(config, tmp_path / "r")
    assert again["steps"] == first["steps"] and again["created"] == first["created"]
    with pytest.raises(CheckpointError, match=r"different config \(steps: 10 there vs 12 now\)"):
        train_synthetic(SyntheticConfig(steps=12), tmp_path / "r")
    assert (tmp_path / "r" / "record.json").read_bytes() == before


@pytest.mark.parametrize("checkpoint", [True, False])
def test_a_finished_run_called_again_says_so(tmp_path, capsys, checkpoint):
    # A notebook cell run twice returned the finished run without a word, progress or not.
    config = SyntheticConfig(steps=6, progress=True)
    train_synthetic(config, tmp_path / "r")
    if not checkpoint:
        (tmp_path / "r" / CHECKPOINT).unlink()
    capsys.readouterr()
    again = train_synthetic(config, tmp_path / "r")
    err = " ".join(capsys.readouterr().err.split())
    assert again["status"] == "complete"
    assert (f"{tmp_path / 'r'}: this run is already complete (6 step rows); nothing to train. "
            "Its record is returned as it is (another out_dir starts a new run)") in err
    train_synthetic(SyntheticConfig(steps=6, progress=False), tmp_path / "q")
    capsys.readouterr()
    train_synthetic(SyntheticConfig(steps=6, progress=False), tmp_path / "q")
    assert capsys.readouterr().err == ""  # progress=False: quiet, as asked


def test_a_second_process_cannot_enter_a_locked_run(tmp_path):
    from lab.runlock import RunLocked, acquire

    lock = acquire(tmp_path / "r")
    try:
        with pytest.raises(RunLocked, match=f"in use by process {os.getpid()}"):
            train_synthetic(SyntheticConfig(steps=5), tmp_path / "r")
    finally:
        lock.release()
    assert not (tmp_path / "r" / "record.json").exists()


def test_in_memory_run_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    record = train_synthetic(SyntheticConfig(steps=12, checkpoint_every=5))
    assert record["status"] == "complete" and len(record["steps"]) == 12
    assert os.listdir(tmp_path) == []


def test_expectation_refuses_bad_declarations():
    with pytest.raises(ValueError, match="Expectation.axis='epochs' is not allowed"):
        Expectation("epochs", 3)
    with pytest.raises(ValueError, match="Expectation.stride=0 is not allowed"):
        Expectation("step", 3, stride=0)
    with pytest.raises(ValueError, match="needs an int every >= 1"):
        Expectation("step", 3, periodic=(("val_loss", 0, 0),))


# ---------------------------------------------------------------------------
# SIGKILL at any moment, including inside a save


KILL_CONFIG = SyntheticConfig(steps=3000, checkpoint_every=7, eval_every=9)


def _child(out, kill_at_replace: int | None, after: bool) -> None:
    """Run in a forked child; optionally SIGKILL itself at its n-th atomic rename
    (``after``: just after it, else with the temp file written and not yet renamed)."""
    torch.set_num_threads(1)
    if kill_at_replace is not None:
        calls = {"n": 0}
        real = os.replace

        def replace(src, dst):
            calls["n"] += 1
            if calls["n"] == kill_at_replace and not after:
                os.kill(os.getpid(), signal.SIGKILL)
            real(src, dst)
            if calls["n"] == kill_at_replace and after:
                os.kill(os.getpid(), signal.SIGKILL)

        records.os.replace = replace
    try:
        train_synthetic(KILL_CONFIG, out)
    finally:
        os._exit(0)


def _fork(out, kill_at_replace=None, after=False) -> int:
    pid = os.fork()
    if pid == 0:
        _child(out, kill_at_replace, after)
    return pid


def _valid(out) -> int:
    record = records.load_record(out)  # validates record.json and every counted part
    records.run_metrics(out)
    assert record["status"] == "running"
    return record["rows"].get("step", 0)


@pytest.mark.slow
def test_sigkill_anywhere_never_breaks_the_store_and_resume_is_exact(tmp_path):
    start = time.perf_counter()
    reference = train_synthetic(KILL_CONFIG, tmp_path / "reference")
    per_step = (time.perf_counter() - start) / KILL_CONFIG.steps
    out = tmp_path / "killed"
    rng = random.Random(0)
    kills, progress = 0, []
    # Inside saves: at the n-th atomic rename of the child (row part, checkpoint or record),
    # before it (temp file written) or just after it (the next file not yet written).
    for i, n in enumerate(rng.sample(range(2, 40), 12)):
        pid = _fork(out, kill_at_replace=n, after=bool(i % 2))
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status)
        kills += 1
        progress.append(_valid(out))
    # At random moments from outside: after about 5 to 100 steps' worth of time, so that
    # twelve kills land before the run can finish on a fast machine or a slow one.
    for _ in range(12):
        pid = _fork(out)
        time.sleep(rng.uniform(5, 100) * per_step)
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        if os.WIFSIGNALED(status):
            kills += 1
            progress.append(_valid(out))
    assert kills >= 20, f"only {kills} kills landed"
    assert progress == sorted(progress) and progress[-1] < KILL_CONFIG.steps
    resumed = train_synthetic(KILL_CONFIG, out)
    assert resumed["status"] == "complete"
    assert resumed["steps"] == reference["steps"]
    assert resumed["final"] == reference["final"]
    assert records.load_record(out)["steps"] == reference["steps"]
    # Resume cut the store back each time: its parts tile the rows exactly, none left over.
    spans = sorted(tuple(map(int, p.name.split(".")[0].split("-")))
                   for p in (out / "rows" / "step").iterdir())
    assert [a for a, _ in spans] == [0] + [b for _, b in spans[:-1]]
    assert spans[-1][1] == KILL_CONFIG.steps


# ---------------------------------------------------------------------------
# the data a run read: recorded, carried in checkpoints, checked on resume


def _life(out, data, steps=30):
    return Lifecycle(kind="synthetic", config=SyntheticConfig(steps=steps, checkpoint_every=5),
                     expect=Expectation("step", steps), parts={}, out_dir=out, progress=False,
                     checkpoint_every=5, data=data)


def _half_run(out, data, rows=12):
    with _life(out, data) as life:
        life.start()
        for _ in range(rows):
            life.log({"train_loss": 1.0})
        life.close()  # interrupted: 10 rows are in the store


def test_resume_on_other_data_is_refused_naming_each_difference(tmp_path):
    then = {"csv": {"path": "/d/p.csv", "size": 10, "sha256": "aa"}, "split": {"n_val": 4}}
    _half_run(tmp_path / "r", then)
    assert records.load_record(tmp_path / "r")["data"] == then
    now = {"csv": {"path": "/d/p.csv", "size": 12, "sha256": "bb"}, "split": {"n_val": 4}}
    life = _life(tmp_path / "r", now)
    with pytest.raises(CheckpointError) as err:
        life.start()
    assert str(err.value) == (
        f"{tmp_path / 'r' / CHECKPOINT} belongs to a run trained on other data (csv.sha256: "
        "'aa' there vs 'bb' now; csv.size: 10 there vs 12 now); resuming would mix two "
        "datasets in one run. Restore the data the run began with, or use another output "
        "directory (or move this one aside) to start afresh")
    assert not life._held  # the lock is released; the run is untouched
    assert records.load_record(tmp_path / "r")["data"] == then
    with _life(tmp_path / "r", then) as life:  # the same data resumes
        assert life.start() == 10


def test_a_checkpoint_without_data_resumes_under_a_trainer_that_declares_it(tmp_path):
    # Runs checkpointed before data was declared (and trainers that declare none, like conv)
    # keep resuming: there is nothing to compare against.
    _half_run(tmp_path / "r", None)
    assert "data" not in records.load_record(tmp_path / "r")
    with _life(tmp_path / "r", {"csv": {"sha256": "aa"}}) as life:
        assert life.start() == 10


def test_a_part_of_the_data_declared_since_is_not_a_change(tmp_path):
    # CfC runs began recording the vega series' hash later: an older run resumes, while a
    # part it did record is still compared.
    then = {"split": {"n_val": 4}}
    _half_run(tmp_path / "r", then)
    now = {"split": {"n_val": 4}, "vega": {"vega": "all", "length": 123, "sha256": "cc"}}
    with _life(tmp_path / "r", now) as life:
        assert life.start() == 10
    _half_run(tmp_path / "s", then)
    with pytest.raises(CheckpointError, match=r"other data \(split.n_val: 4 there vs 5 now\)"):
        _life(tmp_path / "s", {**now, "split": {"n_val": 5}}).start()


def test_train_wall_time_is_summed_over_sessions_up_to_the_last_row(tmp_path):
    with _life(tmp_path / "r", None, steps=10) as life:
        life.start()
        for _ in range(7):
            time.sleep(0.05)
            life.log({"train_loss": 1.0})
        time.sleep(0.3)  # after the checkpoint at 5 rows: lost with the kill, redone later
        life.close()
    saved = torch.load(tmp_path / "r" / CHECKPOINT, weights_only=True)
    assert saved["rows"] == 5 and 0.25 <= saved["wall_s"] < 0.25 + 5
    with _life(tmp_path / "r", None, steps=10) as life:
        assert life.start() == 5
        for _ in range(5):
            time.sleep(0.05)
            life.log({"train_loss": 1.0})
        time.sleep(0.3)  # the final evaluation is not training time
        record = life.finish({}, {"examples": 3})
    wall = record["work"]["train_wall_s"]
    assert record["work"]["examples"] == 3
    assert saved["wall_s"] + 0.25 <= wall < saved["wall_s"] + 0.25 + 0.25  # 5 more rows only


def _as_notebook_run(monkeypatch, out, params):
    """The environment a parent notebook run sets for the trainer it starts."""
    from lab import runlock

    monkeypatch.setenv(runlock.ENV, str(out))
    monkeypatch.setenv(runlock.PARAMS_ENV, json.dumps(params))


def test_python_call_on_a_notebooks_run_keeps_what_the_notebook_was_asked(tmp_path,
                                                                         monkeypatch):
    # A direct call on a finished notebook run rewrote record.json without
    # notebook_params, so a later `lab run` with other notebook values said "already
    # complete with these parameters". Finished: the record is not touched at all.
    from lab import runlock

    out = tmp_path / "r"
    with monkeypatch.context() as env:
        _as_notebook_run(env, out, {"note": "keep"})
        train_synthetic(SyntheticConfig(steps=10), out)
    assert records.load_record(out)["notebook_params"] == {"note": "keep"}
    assert runlock.ENV not in os.environ
    before = (out / "record.json").read_bytes()
    again = train_synthetic(SyntheticConfig(steps=10), out)
    assert (out / "record.json").read_bytes() == before
    assert again["notebook_params"] == {"note": "keep"} and len(again["steps"]) == 10


def test_python_resume_of_an_interrupted_notebook_run_keeps_its_notebook_params(tmp_path,
                                                                               monkeypatch):
    out = tmp_path / "r"
    config = SyntheticConfig(steps=20, checkpoint_every=5)
    with monkeypatch.context() as env:
        _as_notebook_run(env, out, {"note": "keep", "scale": 1.5})
        _interrupt(config, out, after=12)
    assert records.load_record(out)["notebook_params"] == {"note": "keep", "scale": 1.5}
    done = train_synthetic(config, out)
    assert done["status"] == "complete" and len(done["steps"]) == 20
    assert records.load_record(out)["notebook_params"] == {"note": "keep", "scale": 1.5}


def test_a_finished_run_whose_record_was_replaced_gets_its_record_back(tmp_path):
    # The checkpoint says complete but the record was overwritten (a notebook that failed
    # after training): the run's record is written back from the checkpoint, rows intact.
    config = SyntheticConfig(steps=10)
    first = train_synthetic(config, tmp_path / "r")
    record = records.load_record(tmp_path / "r")
    records.write_record(tmp_path / "r", {**record, "status": "failed", "error": "boom"})
    again = train_synthetic(config, tmp_path / "r")
    assert again["status"] == "complete" and again["error"] is None
    assert again["steps"] == first["steps"] and again["final"] == first["final"]
    assert records.load_record(tmp_path / "r")["status"] == "complete"


def test_a_companion_arms_loss_diverges_by_its_own_first_value_or_non_finite():
    policy = Divergence(companion_keys=("bp_train_loss", "aux/h5"))
    seen: dict = {}
    assert policy.check_companions({"bp_train_loss": 2.0, "aux": {"h5": 0.5}}, seen, "s 0") \
        is None
    assert seen == {"bp_train_loss": 2.0, "aux/h5": 0.5}
    # Bounded by each arm's own first value (not the main loss's): 1000 x 0.5 = 500.
    assert policy.check_companions({"bp_train_loss": 1999.0, "aux": {"h5": 499.0}}, seen,
                                   "s 1") is None
    why = policy.check_companions({"bp_train_loss": 3.0, "aux": {"h5": 501.0}}, seen, "step 7")
    assert why.startswith("aux/h5=501 at step 7 exceeds 1000 x its first value (0.5)")
    why = policy.check_companions({"bp_train_loss": math.nan}, seen, "step 8")
    assert why.startswith("non-finite bp_train_loss=nan at step 8: the companion arm diverged")
    # A row without the arm (an eval-only row, no aux path) is no evidence either way.
    assert policy.check_companions({"train_loss": 1.0}, seen, "s 9") is None


def test_a_diverging_backprop_twin_stops_the_ep_run(tmp_path):
    # The twin blew up to NaN while the governor skipped every EP step, and the run ended
    # `complete`: the comparison EP is judged by was void and the record said nothing.
    from lab.train import EPConfig, train_ep

    config = EPConfig(d_model=16, n_layers=2, n_heads=2, seq_len=16, batch_size=4, steps=20,
                      warmup_steps=0, eval_every=5, eval_batches=2, cosine_every=5,
                      checkpoint_every=5, threads=1, progress=False, drift_bound=1e-9, lr=1e4,
                      optimizer="sgd", grad_clip=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "EP never updated", the point of this run
        record = train_ep(config, tmp_path / "ep")
    assert record["status"] == "diverged" and len(record["steps"]) == 2
    first = record["steps"][0]["bp_train_loss"]
    assert record["error"].startswith(f"bp_train_loss={record['steps'][1]['bp_train_loss']:.4g}"
                                      f" at step 1 exceeds 1000 x its first value ({first:.4g})")
    assert records.load_record(tmp_path / "ep")["status"] == "diverged"


def test_a_non_finite_drift_stops_the_ep_run_with_beta_named(tmp_path):
    # beta = 1e39 overflowed float32 in the nudged phase: every drift was NaN, the governor
    # skipped all 30 steps and the run ended `complete`, which `lab report` then refused.
    # (1e39 is now refused with the config; 3e38, inside float32, still overflows there.)
    from lab.train import EPConfig, train_ep

    config = EPConfig(d_model=16, n_layers=2, n_heads=2, seq_len=16, batch_size=4, steps=10,
                      warmup_steps=0, eval_every=5, eval_batches=2, cosine_every=5,
                      checkpoint_every=5, threads=1, progress=False, beta=3e38)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        record = train_ep(config, tmp_path / "ep")
    # Not also "the drift governor skipped all steps ... raise drift_bound": wrong advice
    # for an overflow, which the error names.
    assert not [w for w in caught if "EP never updated" in str(w.message)]
    assert record["status"] == "diverged" and len(record["steps"]) == 1
    assert record["error"] == ("non-finite drift=nan at step 0: the nudged phase overflowed "
                               "(is beta=3e+38 too large for dtype float32?)")
    policy = Divergence(finite_keys=("drift",))
    assert policy.check({"drift": 0.5}, None, "step 1") is None
    assert policy.check({"drift": math.inf}, None, "step 2") == "non-finite drift=inf at step 2"


def test_a_diverging_aux_path_stops_the_cfc_run(tmp_path):
    from lab.train import CfCAuxConfig, train_cfc_aux

    config = CfCAuxConfig(steps=40, batch_size=8, eval_every=5, threads=1, progress=False,
                          units=8, aux_units=8, backbone_units=8, enc_dim=4, aux_lr=1e6,
                          lift_window=0)
    record = train_cfc_aux(config, tmp_path / "cfc")
    assert record["status"] == "diverged" and len(record["steps"]) == 2
    first = record["steps"][0]["aux_huber_ema"]["h1"]
    assert record["error"].startswith("aux_huber_ema/h1=") and f"({first:.4g})" in record["error"]
    # Healthy: the same run at a sane aux rate completes with the watch on.
    healthy = train_cfc_aux(CfCAuxConfig(**{**as_dict(config), "aux_lr": 1e-3, "steps": 10}),
                            tmp_path / "ok")
    assert healthy["status"] == "complete"


# ---------------------------------------------------------------------------
# the run directory renamed while the run trains


def _rename_at(monkeypatch, old, new, at: int) -> None:
    """Rename the run directory just before row ``at`` is logged (a user's `mv`)."""
    real = Lifecycle.log

    def log(self, row):
        if len(self.rows_logged) == at:
            os.rename(old, new)
        return real(self, row)

    monkeypatch.setattr(Lifecycle, "log", log)


@pytest.mark.parametrize("parent_holds", [False, True])
def test_a_run_whose_directory_is_renamed_stops_without_recreating_it(tmp_path, monkeypatch,
                                                                      parent_holds):
    from lab import runlock

    config = SyntheticConfig(steps=30, checkpoint_every=5)
    old, new = tmp_path / "mv1", tmp_path / "mv1b"
    parent = None
    if parent_holds:  # `lab run` / a sweep holds the lock for the notebook's kernel
        parent = runlock.acquire(old)
        monkeypatch.setenv(runlock.ENV, str(old))
    _rename_at(monkeypatch, old, new, at=7)
    with pytest.raises(runlock.RunMoved) as err:
        train_synthetic(config, old)
    message = str(err.value)
    assert f"run directory {old} was moved to {new} " in message
    assert f"stopped without writing to {old}" in message
    assert not old.exists()  # not re-created: no second, unlocked run there
    if parent is not None:
        with pytest.raises(runlock.RunMoved, match=f"{old} was moved to {new} "):
            parent.check_in_place()
        parent.release()
        assert not old.exists()
    assert not (new / runlock.PID_FILE).exists()  # the holder's pid went with its lock
    # What it saved stays in the renamed directory: rows up to the checkpoint at 5,
    # status running (interrupted, resumable), nothing marked failed.
    saved = records.load_record(new)
    assert (saved["status"], saved["error"], saved["rows"]) == ("running", None, {"step": 5})
    assert runlock.inspect(new).status == "interrupted"
    monkeypatch.undo()
    resumed = train_synthetic(config, new)
    fresh = train_synthetic(config, tmp_path / "fresh")
    assert resumed["status"] == "complete" and len(_rows(resumed)) == 30
    assert json.dumps(_rows(resumed)) == json.dumps(_rows(fresh))
    assert resumed["final"] == fresh["final"]


def test_a_finished_run_on_changed_data_is_not_called_a_resume(tmp_path):
    # From Python the refusal said "resuming would mix two datasets" though the run was
    # done and nothing would resume: it says what `lab train` says.
    then = {"csv": {"path": "/d/p.csv", "size": 10, "sha256": "aa"}}
    with _life(tmp_path / "r", then, steps=5) as life:
        life.start()
        for _ in range(5):
            life.log({"train_loss": 1.0})
        life.finish({})
    before = (tmp_path / "r" / "record.json").read_bytes()
    now = {"csv": {"path": "/d/p.csv", "size": 10, "sha256": "bb"}}
    for what in (CHECKPOINT, None):  # with its checkpoint, and kept as the fixtures are
        if what is None:
            (tmp_path / "r" / CHECKPOINT).unlink()
        with pytest.raises(CheckpointError) as err:
            _life(tmp_path / "r", now, steps=5).start()
        assert str(err.value) == (
            f"{tmp_path / 'r'} holds a complete run whose data changed since (csv.sha256: "
            "'aa' there vs 'bb' now); nothing was changed. Restore the data it was made with, "
            "or use another output directory (or move this one aside) to train on the new data")
        assert (tmp_path / "r" / "record.json").read_bytes() == before


def test_a_run_directory_of_another_trainer_is_named_in_one_line(tmp_path):
    # A CfC notebook run in a conv run's directory listed ~57 "there vs now" fields.
    train_synthetic(SyntheticConfig(steps=5), tmp_path / "r")
    before = (tmp_path / "r" / "record.json").read_bytes()
    life = Lifecycle(kind="cfc_aux", config=SyntheticConfig(steps=5),
                     expect=Expectation("step", 5), parts={}, out_dir=tmp_path / "r",
                     progress=False)
    with pytest.raises(CheckpointError) as err:
        life.start()
    assert str(err.value) == (f"{tmp_path / 'r'} holds a 'synthetic' run; this trainer makes "
                              "'cfc_aux' runs: give it another output directory (or move this "
                              "one aside)")
    assert (tmp_path / "r" / "record.json").read_bytes() == before and not life._held


def test_the_notebook_layers_stand_in_record_is_not_another_trainers(tmp_path):
    # A notebook that failed before its trainer wrote a record leaves kind "notebook":
    # the rerun's trainer takes the directory over, as before.
    from lab.notebook import mark_failed

    mark_failed(tmp_path / "r", "r", {"steps": 5}, "failed in data loading")
    assert records.load_record(tmp_path / "r")["kind"] == "notebook"
    assert train_synthetic(SyntheticConfig(steps=5), tmp_path / "r")["status"] == "complete"


def test_a_run_directory_under_tilde_is_the_home_one(tmp_path, monkeypatch):
    # Every path the project reads expands ~; a trainer's out_dir must too, never making
    # a folder literally named "~" in the working directory.
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    record = train_synthetic(SyntheticConfig(steps=3), "~/runs/t")
    assert record["status"] == "complete" and record["run_id"] == "t"
    assert records.load_record(tmp_path / "home" / "runs" / "t")["status"] == "complete"
    assert not (tmp_path / "~").exists()


def _three_trainers(tiny):
    """(name, train function, config maker) of the three trainers at tiny sizes."""
    from lab.train import CfCAuxConfig, ConvConfig, EPConfig, train_cfc_aux, train_conv, train_ep

    return [
        ("conv", train_conv, lambda **kw: ConvConfig(**{**tiny, "epochs": 1,
                                                       "schedule": "constant", **kw})),
        ("ep", train_ep, lambda **kw: EPConfig(d_model=8, n_layers=1, n_heads=2, seq_len=8,
                                               batch_size=2, steps=2, warmup_steps=0,
                                               eval_every=0, cosine_every=0, progress=False,
                                               **kw)),
        ("cfc", train_cfc_aux, lambda **kw: CfCAuxConfig(steps=2, batch_size=4, eval_every=0,
                                                         units=4, aux_units=4,
                                                         backbone_units=4, enc_dim=4,
                                                         progress=False, **kw)),
    ]


@pytest.mark.parametrize("which", ["conv", "ep", "cfc"])
def test_a_trainer_leaves_the_thread_counts_as_it_found_them(which, tiny, tmp_path):
    # A run at threads=1 left torch (and numba) on one thread for the rest of a Jupyter
    # session, and a later threads=0 run (the process's count) took 1 from it.
    import numba

    name, train, make = next(t for t in _three_trainers(tiny) if t[0] == which)
    saved = torch.get_num_threads(), numba.get_num_threads()
    two = min(2, numba.config.NUMBA_NUM_THREADS)
    try:
        numba.set_num_threads(two)
        torch.set_num_threads(2)
        record = train(make(threads=1), tmp_path / "one")
        assert record["environment"]["threads"] == 1
        assert (torch.get_num_threads(), numba.get_num_threads()) == (2, two)
        record = train(make(threads=0), tmp_path / "zero")
        assert record["environment"]["threads"] == 2  # the process's, not the last run's
        assert (torch.get_num_threads(), numba.get_num_threads()) == (2, two)
    finally:
        numba.set_num_threads(saved[1])
        torch.set_num_threads(saved[0])


def test_a_run_id_that_is_not_text_is_refused_naming_the_argument(tiny, tmp_path):
    for name, train, make in _three_trainers(tiny):
        for bad in (5, "", "  "):
            with pytest.raises(TypeError, match=rf"^train_{name if name != 'cfc' else 'cfc_aux'}"
                                                rf" run_id={bad!r}: give the run's id as "
                                                r"non-blank text, or None"):
                train(make(threads=1), tmp_path / name, run_id=bad)
        assert not (tmp_path / name).exists()


def test_numpy_horizons_resume(tmp_path, train_steps):
    # Stored as numpy ints, the config's horizons made every checkpoint unreadable with
    # torch.load(weights_only=True): the run could not resume, and the advice was to delete
    # the checkpoint.
    import numpy as np

    from lab.train import CfCAuxConfig, train_cfc_aux

    config = CfCAuxConfig(steps=4, batch_size=4, eval_every=0, units=4, aux_units=4,
                          backbone_units=4, enc_dim=4, progress=False, threads=1,
                          checkpoint_every=2, horizons=(np.int64(1), np.int64(5), np.int64(20)))
    from lab.train import cfc_aux

    train_steps(cfc_aux, stop_at=3)
    with pytest.raises(KeyboardInterrupt):
        train_cfc_aux(config, tmp_path / "r")
    assert (tmp_path / "r" / CHECKPOINT).exists()
    train_steps(cfc_aux)
    assert train_cfc_aux(config, tmp_path / "r")["status"] == "complete"


def test_the_experiment_axes_are_the_row_stores():
    # lab.experiment may not import the run package, so it names the axes itself.
    from lab import experiment

    assert experiment.AXES == records.AXES


def test_every_trainer_is_one_experiment_of_its_config_kind():
    from lab.experiment import Experiment
    from lab.train import cfc_aux, conv, ep

    for module, config in ((conv, conv.ConvConfig), (ep, ep.EPConfig),
                           (cfc_aux, cfc_aux.CfCAuxConfig)):
        assert isinstance(module.EXPERIMENT, Experiment)
        assert module.EXPERIMENT.kind == config.KIND and module.EXPERIMENT.config_class is config
