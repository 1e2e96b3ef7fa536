"""One run lifecycle for every trainer: resume, rows, checkpoints, divergence, the record.

A trainer module holds only its own maths (build, one step or epoch, evaluate) and one
:class:`lab.experiment.Experiment`, which :func:`train` drives the same way for every
trainer. The experiment names the *parts* of a run: objects with ``state_dict`` /
``load_state_dict`` (model, optimizer, scheduler, rule, anything of its own) or
``torch.Generator`` s. The lifecycle then

- locks the run directory (``lab.runlock``) for the life of the run;
- resumes from a checkpoint written by the same config (display-only fields
  such as ``progress`` aside), restoring every part and cutting the row store
  back to the checkpoint, so a killed run ends with exactly the rows an
  uninterrupted run logs;
- logs rows on one named axis (``epoch`` or ``step``) into the append-only
  row store of ``lab.records`` (a save costs in proportion to the rows added
  since the last one; the checkpoint carries no copy of them);
- applies one divergence policy (:class:`Divergence`);
- records what identifies the run's data (``data``, declared by the trainer:
  file paths, sizes and hashes, split sizes) and refuses a resume whose data
  differs, as it refuses one whose config differs;
- writes the final status, metrics and work bill, with the training wall time
  (``work["train_wall_s"]``) summed over every session of the run.

Every checkpoint carries the record as it stands (``record``), so the checkpoint of a
finished run holds its final metrics and bill: a kill between it and record.json, or a
record lost since, gives the record back exactly on the next call.

It imports nothing from any trainer. The record stores the trainer's
declaration of what a complete run holds (:class:`Expectation`), so the
analysis checks completeness without knowing which trainer made a run.

Order of writes at a checkpoint (each one atomic): the new row part, then the
checkpoint (parts' states, row count, the record), then record.json. A kill between
any two leaves parts beyond the counts, which readers ignore and a resume removes.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from . import records, runlock
from .config import ConfigError, Diverged, as_dict, from_dict, identity, with_legacy_params
from .experiment import Divergence, Expectation, Experiment, _number

__all__ = ["CHECKPOINT", "CheckpointError", "Divergence", "Expectation", "Lifecycle",
           "check_start", "run_path", "train"]

CHECKPOINT = "checkpoint.pt"
CHECKPOINT_FORMAT = 3  # 3 carries the record; 2 (no record) is still resumed
READABLE_FORMATS = (2, 3)


class CheckpointError(ValueError):
    """A checkpoint (or a finished run) that cannot be resumed under this config."""


class _Positions:
    """Row positions without a progress bar, answering what trainers ask of one.

    Not a disabled tqdm: tqdm takes a lock shared with forked processes (a
    multiprocessing semaphore) when a bar is made and closed, disabled or not, and a
    forked process killed while holding it left every other process that makes a bar
    waiting for ever (a test that SIGKILLs forked runs hung on it)."""

    def __init__(self, start: int, stop: int):
        self._positions = range(start, stop)

    def __iter__(self):
        return iter(self._positions)

    def set_postfix(self, **values) -> None:
        pass

    def close(self) -> None:
        pass


def _state(part):
    return part.get_state() if isinstance(part, torch.Generator) else part.state_dict()


def _load(part, state) -> None:
    if isinstance(part, torch.Generator):
        part.set_state(state)
    else:
        part.load_state_dict(state)


def _differences(then: dict, now: dict, sep: str) -> str:
    """``"key: <then> there vs <now> now"`` for each key whose values differ, joined."""
    return sep.join(f"{k}: {then.get(k)!r} there vs {now.get(k)!r} now"
                    for k in sorted(set(then) | set(now)) if then.get(k) != now.get(k))


def check_start(config, cls: type, out_dir, *, caller: str, run_id=None) -> None:
    """What every trainer checks before it makes anything: a config of its class, a run
    directory it can write, a run id that is text, and what the data decides
    (``config.preflight()``)."""
    if not isinstance(config, cls):
        raise TypeError(f"{caller} expects a config of type {cls.__name__}, got {config!r:.80} "
                        f"({type(config).__name__}); build one with {cls.__name__}(...) or "
                        f"lab.config.from_dict({cls.__name__}, values)")
    if out_dir is not None:
        if not isinstance(out_dir, (str, os.PathLike)) or not str(out_dir).strip():
            raise TypeError(f"{caller} out_dir={out_dir!r}: give the run directory as a path "
                            "(str or pathlib.Path), or None to train in memory")
        runlock.check_run_dir(run_path(out_dir))
    if run_id is not None and (not isinstance(run_id, str) or not run_id.strip()):
        raise TypeError(f"{caller} run_id={run_id!r}: give the run's id as non-blank text, or "
                        "None for the run directory's name")
    config.preflight()


def train(experiment: Experiment, config, out_dir=None, *, run_id: str | None = None) -> dict:
    """Train ``experiment`` per ``config``; returns the run record, its rows under the axis
    key (``trajectory`` or ``steps``).

    With ``out_dir`` the run is recorded there, and a checkpoint left by an interrupted run
    of the same config is picked up where it stopped; ``None`` trains in memory.
    """
    if experiment.config_class is not None:  # before anything is made
        check_start(config, experiment.config_class, out_dir, caller=f"train_{experiment.kind}",
                    run_id=run_id)
    run = experiment.build(config)
    life = Lifecycle(kind=experiment.kind, config=config, expect=experiment.expectation(config),
                     parts=experiment.parts(run), out_dir=out_dir, run_id=run_id,
                     device=experiment.device(run), data=experiment.data_identity(run),
                     checkpoint_every=config.checkpoint_every,
                     divergence=experiment.divergence(config), progress=config.progress,
                     desc=experiment.describe(config))
    with life:
        done = life.start()
        if life.finished:
            return life.result()
        if done == 0:
            experiment.prepare(run, life)
        bar = life.rows()
        for index in bar:
            try:
                row = experiment.step(run, index, life)
            except Diverged as why:  # the step's own computation blew up: a result
                life.diverged(f"{why} (during {life.axis} {index * life.expect.stride})")
                break
            if (shown := experiment.postfix(row)) is not None:
                bar.set_postfix(**shown)
            if not life.log(row):
                break
        final, work = experiment.finish(run, life.rows_logged, life.status != "running")
        return life.finish(final, work)


def run_path(out_dir) -> Path:
    """The run directory ``out_dir`` names: ``~`` expanded (as in every path the project
    reads), made absolute. Never a literal ``./~`` folder."""
    return Path(out_dir).expanduser().resolve()


# What a resume compares between sessions (environment() keys): any difference can change
# the last digits of what follows. The earlier sessions' environments go under EARLIER.
SESSION_KEYS = ("threads", "git_commit", "dirty", "packages", "python", "hostname", "device",
                "cuda", "gpu")
EARLIER = "earlier_sessions"


@dataclass
class Lifecycle:
    """One run's life on disk (or in memory with ``out_dir=None``); see the module docstring."""

    kind: str
    config: object  # a frozen config dataclass
    expect: Expectation
    parts: dict
    out_dir: str | Path | None = None
    run_id: str | None = None
    device: str | None = None
    checkpoint_every: int = 1  # rows between checkpoints; 0 = only at the end
    divergence: Divergence = field(default_factory=Divergence)
    progress: bool = True
    desc: str = ""
    # What identifies the run's data (a JSON dict, declared by the trainer): stored in the
    # record as ``data`` and in every checkpoint; a resume on other data is refused.
    data: dict | None = None

    def __post_init__(self):
        self.out = run_path(self.out_dir) if self.out_dir is not None else None
        self.axis = self.expect.axis
        self.config_dict = as_dict(self.config)
        self.rows_logged: list[dict] = []  # every row of the run, in memory
        self.pending: list[dict] = []  # rows not yet in the store
        self.finished = False
        self.status, self.error = "running", None
        self._baseline: float | None = None
        self._companions: dict[str, float] = {}  # each companion loss's first finite value
        self._lock = contextlib.ExitStack()
        self._held = False
        self._runlock: runlock.RunLock | None = None  # held from start() to close()
        self.record = records.new_record(
            run_id=self.run_id or (self.out.name if self.out else "in-memory"), kind=self.kind,
            config=self.config_dict, device=self.device)
        self.record["expect"] = self.expect.as_dict()
        extras = runlock.notebook_params(self.out) if self.out is not None else None
        if extras is not None:
            self.record["notebook_params"] = extras
        code = runlock.notebook_code(self.out) if self.out is not None else None
        if code is not None:
            self.record["code"] = code
        if self.data is not None:
            self.record["data"] = copy.deepcopy(self.data)
        # Training wall time: earlier sessions' share (from the checkpoint) plus this
        # session's, up to its last row. Rows redone after a kill count once, so a resumed
        # run reports about what an uninterrupted one would.
        self._wall_before = self._wall = 0.0
        self._session_start = time.perf_counter()

    # -- start and resume ---------------------------------------------------

    def start(self) -> int:
        """Lock, resume if possible, write the ``running`` record; rows already done."""
        self._session_start = time.perf_counter()
        if self.out is None:
            return 0
        # The lock (ours or the parent's) moves with the directory if it is renamed;
        # writing by path after that would make a second, unlocked run at the old path.
        self._runlock = self._lock.enter_context(runlock.hold(self.out))
        self._held = True
        try:
            done = self._resume()
        except BaseException:
            self.close()
            raise
        self._session_start = time.perf_counter()  # reading the checkpoint is not training
        if self.finished and self.progress:
            # Called again on a finished run (a notebook cell run twice): nothing trains, and
            # a silent return would look like a run that did nothing.
            print(f"{self.out}: this run is already {self.record['status']} ({done} {self.axis} "
                  f"rows); nothing to train. Its record is returned as it is (another "
                  "out_dir starts a new run)", file=sys.stderr)
        return done

    def _resume(self) -> int:
        # Temp files of writes a kill cut short; we hold the lock, so nobody is writing them.
        for leftover in [*self.out.glob(".*.tmp"), *self.out.glob(f"{records.ROWS_DIR}/*/.*.tmp")]:
            leftover.unlink(missing_ok=True)
        old = self._old_record()
        if old is not None and (there := records.another_trainers(old, self.kind)):
            # Said first and alone: every field would differ (two trainers' configs).
            raise CheckpointError(
                f"{self.out} holds a {there!r} run; this trainer makes {self.kind!r} "
                "runs: give it another output directory (or move this one aside)")
        if old is not None:
            self._keep_run_id(old["run_id"])
            for key in ("notebook_params", "code"):
                if key in old and not runlock.held_by_parent(self.out):
                    # A call from Python on a notebook's run: what the notebook was asked
                    # and its code stay part of the run.
                    self.record[key] = old[key]
        ckpt, saved, same = self.out / CHECKPOINT, None, False
        if ckpt.exists():
            # A checkpoint says "finished" for the directory only where the record agrees (or
            # is gone): one copied in from a finished run is that file's story, not the run's.
            state = self._read_checkpoint(ckpt, record_finished=old is None or old.get(
                "status") in ("complete", "diverged"))
            done = state["rows"]
            # The record as of this checkpoint (format 3): a finished run's holds its final
            # metrics and bill, which record.json may not (a kill between the two, a record
            # lost or replaced since).
            saved = records.decode_nonfinite(state["record"]) if "record" in state else None
            same = old is not None and old["status"] == state["status"] \
                and old["rows"].get(self.axis) == done
            if state["status"] != "running" and saved is None and not same \
                    and not (old is not None and old["work"]):
                raise CheckpointError(self._lost(state["status"], done, old))
            for name, part in self.parts.items():
                _load(part, state["parts"][name])
            self._baseline = state["baseline"]
            # Checkpoints written before the wall time was carried hold none: 0 there.
            self._wall_before = self._wall = float(state.get("wall_s", 0.0))
            self.status, self.error = state["status"], state["error"]
            entries = saved["row_parts"].get(self.axis, []) if saved is not None else None
            records.truncate_rows(self.out, self.axis, done, entries)
            self.rows_logged = records.read_rows(self.out, self.axis, done, entries)
            # A store written before parts were hashed: adopted as just read.
            self.record["row_parts"] = {self.axis: entries if entries is not None else
                                        records.part_entries(self.out, self.axis, done)}
            for row in self.rows_logged:  # the companions' first values, as first logged
                self.divergence.check_companions(row, self._companions, "")
            # (record.json lost: the checkpoint's record says what the run was)
            known = old if old is not None else saved
            if known is not None and done and self.status == "running":
                self._keep_earlier_environment(known.get("environment"), done)
        else:
            if old is not None and old["status"] in ("complete", "diverged"):
                self._refuse_different(old, "record.json", old["status"])
                self._refuse_other_data(old.get("data"), "record.json", old["status"])
                self.finished, self.record = True, old
                self.rows_logged = old.pop(records.ROW_KEYS[self.axis], [])
                self.close()
                return len(self.rows_logged)
            done = 0
            records.truncate_rows(self.out, self.axis, 0)
        known = old if old is not None else saved
        if known is not None:
            self.record["created"] = known["created"]
        if old is None and saved is not None:
            self._keep_run_id(saved["run_id"])
            if "notebook_params" in saved and "notebook_params" not in self.record:
                self.record["notebook_params"] = saved["notebook_params"]
        self.record["rows"] = {self.axis: done}
        if self.status != "running":
            self.finished = True
            if same:
                # Finished, and its record says so: nothing to do, nothing rewritten.
                old.pop(records.ROW_KEYS[self.axis], None)
                self.record = old
            elif saved is not None:
                # The checkpoint of a finished run whose record.json is behind it (a kill
                # between the two), gone, or replaced since (a notebook that failed after
                # training): the run's record, as the checkpoint holds it, is written back.
                self.record = saved
                records.write_record(self.out, self.record)
            else:  # a format 2 checkpoint: the final metrics and bill of a record that has them
                self.record.update(status=self.status, error=self.error, final=old["final"],
                                   work=old["work"],
                                   final_in_rows=old.get("final_in_rows", []))
                records.write_record(self.out, self.record)
            self.close()
            return done
        records.write_record(self.out, self.record)
        return done

    def _lost(self, status: str, done: int, old: dict | None) -> str:
        """Why a finished run's checkpoint from an older lab cannot give its record back."""
        if old is not None:
            where = f"its record.json says {old['status']!r} and holds none"
        elif (self.out / records.RECORD_FILE).exists():
            where = "its record.json cannot be read"
        else:
            where = "its record.json is missing"
        return (f"{self.out} holds a {status} run ({done} {self.axis} rows) whose final "
                f"metrics and bill are lost: {where}, and its checkpoint, written by an older "
                "lab, does not hold them. Nothing was changed. Restore record.json, or train "
                "the run again: the same command with --force (lab run, lab sweep), or move "
                "this directory aside (or give another output directory) from Python")

    def _keep_earlier_environment(self, before, done: int) -> None:
        """A resume in another environment (thread count, code, packages, machine) than
        the run's rows so far: warn, and keep the earlier one in the record's
        ``environment.earlier_sessions``. Before, the record described only the last session,
        and a run half trained on 2 threads and half on 1 read as a clean 1-thread run."""
        if not isinstance(before, dict):
            return
        now = self.record["environment"]
        earlier = list(before.get(EARLIER, []))
        first = {k: v for k, v in before.items() if k != EARLIER}
        differs = [k for k in SESSION_KEYS if first.get(k) != now.get(k)]
        if differs:
            earlier.append(first)
            shown = "; ".join(f"{k}: {first.get(k)!r} there vs {now.get(k)!r} now"
                              if k != "packages" else "package versions" for k in differs)
            warnings.warn(
                f"{self.out}: resumed after {done} {self.axis}(s) in another environment "
                f"({shown}): "
                f"from here on the rows may differ in their last digits from an uninterrupted "
                f"run's (runs are bit for bit only on one thread count, code and machine); the "
                f"record keeps the earlier environment in environment.{EARLIER}",
                stacklevel=4)
        if earlier:
            now[EARLIER] = earlier

    def _keep_run_id(self, saved: str) -> None:
        # A run's id is fixed when it starts: a rerun or resume keeps it whatever run_id it
        # is given (a renamed run directory's notebook passes the new name), so the record
        # returned is the record on disk.
        if self.run_id is not None and self.run_id != saved:
            warnings.warn(f"run_id={self.run_id!r} is not used: {self.out} holds run {saved!r}, "
                          "and a run keeps the id it started with", stacklevel=2)
        self.record["run_id"] = saved

    def _old_record(self) -> dict | None:
        if not (self.out / records.RECORD_FILE).exists():
            return None
        try:
            return records.load_record(self.out)
        except records.RecordError:
            return None  # a damaged record of an unfinished run: the checkpoint decides

    def _refuse_different(self, saved_config: dict, what: str,
                          finished: str | None = None) -> None:
        raw = with_legacy_params(identity(saved_config.get("config", saved_config)))
        # Compared as stored (NaN == NaN there), which is also how a resumed record reads;
        # leaf by leaf, as the CLI does: rule_params.eta_A, not two whole dicts.
        then = dict(_leaves("", records.encode_nonfinite(raw)))
        now = dict(_leaves("", records.encode_nonfinite(identity(self.config_dict))))
        defaults = self._defaults(raw, set(now) - set(then))
        then.update(defaults)
        detail = ", ".join(
            f"{k}: absent there (read as its default {then[k]!r}) vs {now[k]!r} now"
            if k in defaults else f"{k}: {then.get(k)!r} there vs {now.get(k)!r} now"
            for k in sorted(set(then) | set(now)) if then.get(k) != now.get(k))
        if detail and finished:  # nothing to resume: say what the directory holds
            raise CheckpointError(
                f"{self.out} holds a {finished} run with a different config ({detail}); "
                "nothing was changed. Use another output directory, or move this one aside "
                "to start afresh")
        if detail:
            raise CheckpointError(
                f"{self.out / what} belongs to a run with a different config ({detail}); "
                "use another output directory, or move this one aside to start afresh")

    def _defaults(self, saved: dict, missing: set) -> dict:
        """The current defaults of the config keys ``missing`` from a saved config (one
        written before the key existed): a parameter is added with the default that does
        what the code did before it, so a run that uses the default is the same run, and
        one that sets another value is a config change. {} when the saved config no
        longer builds (a key removed since): then it is compared as it is."""
        if not missing:
            return {}
        try:
            rebuilt = as_dict(from_dict(type(self.config), saved))
        except (ConfigError, TypeError, ValueError):
            return {}
        leaves = dict(_leaves("", records.encode_nonfinite(identity(rebuilt))))
        return {name: leaves[name] for name in missing if name in leaves}

    def _refuse_other_data(self, saved: dict | None, what: str,
                           finished: str | None = None) -> None:
        # A run (or checkpoint) from before data was declared holds none: nothing to compare.
        if saved is None or self.data is None:
            return
        from .data.identity import content_only

        # Likewise a part declared since (CfC's vega series): compared only when it was saved.
        now = {key: value for key, value in self.data.items() if key in saved}
        # The same arrays read from another directory are the same data (the directory
        # is a cache: MNIST-1D's regenerated, $LAB_DATA_DIR moved).
        detail = _differences(dict(_leaves("", content_only(saved))),
                              dict(_leaves("", content_only(now))), "; ")
        if detail and finished:  # nothing to resume: the run is done, on the data it had
            raise CheckpointError(
                f"{self.out} holds a {finished} run whose data changed since ({detail}); "
                "nothing was changed. Restore the data it was made with, or use another "
                "output directory (or move this one aside) to train on the new data")
        if detail:
            raise CheckpointError(
                f"{self.out / what} belongs to a run trained on other data ({detail}); resuming "
                "would mix two datasets in one run. Restore the data the run began with, or "
                "use another output directory (or move this one aside) to start afresh")

    def _read_checkpoint(self, path: Path, record_finished: bool = True) -> dict:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # torch raises several types for a damaged file
            why = str(exc) or ("the file is empty or cut short" if isinstance(exc, EOFError)
                               else "no detail given")
            raise CheckpointError(
                f"checkpoint {path} cannot be read ({type(exc).__name__}: {why}); delete it "
                "to start the run afresh") from None
        if not isinstance(state, dict) or state.get("format") not in READABLE_FORMATS:
            raise CheckpointError(
                f"checkpoint {path} was written by an older lab (format "
                f"{state.get('format', 1) if isinstance(state, dict) else '?'}, this lab reads "
                f"{' and '.join(map(str, READABLE_FORMATS))}); delete it to start the run "
                "afresh")
        # Whose it is comes first: another trainer's config differs in every field.
        there = state.get("kind")  # (checkpoints written before it was kept hold none)
        if isinstance(there, str) and there != self.kind:
            raise CheckpointError(
                f"checkpoint {path} was written by a {there!r} run; this trainer makes "
                f"{self.kind!r} runs. Delete it (or give another output directory) to start "
                "afresh")
        missing = sorted(set(self.parts) - set(state.get("parts", {})))

        def lacking():
            return CheckpointError(
                f"checkpoint {path} lacks {', '.join(missing) or 'its config'}; it was not "
                "written by this trainer. Delete it to start the run afresh")
        # An older checkpoint names no kind: missing parts are then the sign of another
        # trainer's, said before a config comparison that would list every field.
        if "identity" not in state or (missing and there is None):
            raise lacking()
        status = state.get("status")
        finished = status if status in ("complete", "diverged") and record_finished else None
        self._refuse_different(state["identity"], CHECKPOINT, finished)
        self._refuse_other_data(state.get("data"), CHECKPOINT, finished)
        if missing:
            raise lacking()
        return state

    # -- rows -----------------------------------------------------------------

    def rows(self):
        """The remaining row positions, with a progress bar (``progress``), else plain."""
        done = len(self.rows_logged)
        if not self.progress:
            return _Positions(done, self.expect.count)
        return tqdm(range(done, self.expect.count), desc=self.desc or self.kind,
                    unit=self.axis, initial=done, total=self.expect.count)

    def baseline(self, loss: float) -> None:
        """The training loss at initialisation: the divergence bound scales with it."""
        self._baseline = float(loss)

    def diverged(self, why: str) -> None:
        """Stop the run as ``diverged`` before its next row (finish() saves it)."""
        self.status, self.error = "diverged", why

    def log(self, row: dict) -> bool:
        """Append one row; False when the run must stop (it diverged)."""
        position = len(self.rows_logged)
        row = {self.axis: position * self.expect.stride, **row}
        records.check_row(row, self.axis, f"{records.ROW_KEYS[self.axis]}[{position}]")
        self.rows_logged.append(row)
        self.pending.append(row)
        self._wall = self._wall_before + (time.perf_counter() - self._session_start)
        if self._baseline is None and isinstance(row.get(self.divergence.loss_key), float):
            if math.isfinite(row[self.divergence.loss_key]):
                self._baseline = row[self.divergence.loss_key]
        where = f"{self.axis} {row[self.axis]}"
        why = self.divergence.check(row, self._baseline, where) \
            or self.divergence.check_companions(row, self._companions, where)
        if why:
            # Saved by finish(), with the final metrics and bill: a checkpoint saying
            # "diverged" without them would be a finished run with its bill lost.
            self.status, self.error = "diverged", why
            return False
        done = len(self.rows_logged)
        if self.checkpoint_every and done % self.checkpoint_every == 0 \
                and done < self.expect.count:
            self._save(checkpoint=True)
        return True

    def _save(self, *, checkpoint: bool) -> None:
        self.record.update(status=self.status, error=self.error)
        if self.out is None:
            self.pending = []
            return
        if self._runlock is not None:  # RunMoved (both paths named) before anything is written
            self._runlock.check_in_place()
        start = self.record["rows"].get(self.axis, 0)
        entries = list(self.record["row_parts"].get(self.axis, []))
        if self.pending:
            entries.append(records.write_part(self.out, self.axis, self.pending, start))
        done = start + len(self.pending)
        # The record as it will stand; in memory only once the checkpoint is written (a
        # failed write leaves the pending rows to the next save, at the same start).
        committed = {**self.record, "rows": {**self.record["rows"], self.axis: done},
                     "row_parts": {**self.record["row_parts"], self.axis: entries}}
        if checkpoint:
            state = {"format": CHECKPOINT_FORMAT, "kind": self.kind,
                     "identity": identity(self.config_dict),
                     "rows": done, "baseline": self._baseline, "status": self.status,
                     "error": self.error, "data": self.data, "wall_s": self._wall,
                     "record": records.encode_nonfinite(committed),
                     "parts": {name: _state(part) for name, part in self.parts.items()}}
            records.atomic_write(self.out / CHECKPOINT, lambda tmp: _save_synced(state, tmp))
        self.record.update(rows=committed["rows"], row_parts=committed["row_parts"])
        records.write_record(self.out, self.record)
        self.pending = []

    # -- the end ----------------------------------------------------------------

    def finish(self, final: dict | None = None, work: dict | None = None) -> dict:
        """Final metrics and bill; status ``complete`` unless the run diverged."""
        final = dict(final or {})
        if self.status == "running":
            why = self.divergence.check(
                {k: v for k, v in final.items() if k != self.divergence.loss_key}, None,
                "the final evaluation")
            self.status, self.error = ("diverged", why) if why else ("complete", None)
        # The lifecycle owns the wall time (every trainer's the same way, across sessions).
        self.record.update(final=final, work={**(work or {}), "train_wall_s": self._wall})
        # The final metrics that repeat the last row's value (a trainer's last training
        # loss, an evaluation of the last state): readers check that they still agree.
        last = self.rows_logged[-1] if self.rows_logged else {}
        self.record["final_in_rows"] = [
            name for name, value in final.items() if _number(value) and _number(last.get(name))
            and records.encode_nonfinite(value) == records.encode_nonfinite(last[name])]
        records.validate_record(self.record)
        try:
            self._save(checkpoint=True)
        finally:
            self.close()
        self.finished = True
        return self.result()

    def fail(self, error: str) -> dict:
        """Mark the run ``failed`` (an exception in the trainer); rows so far are kept."""
        self.status, self.error = "failed", error
        try:
            self._save(checkpoint=False)
        finally:
            self.close()
        return self.result()

    def close(self) -> None:
        """Release the lock without a status change (an interrupted run stays resumable)."""
        self._held = False
        self._lock.close()

    def result(self) -> dict:
        """The record, with the run's rows under its axis key (``trajectory``/``steps``)."""
        return {**self.record, records.ROW_KEYS[self.axis]: list(self.rows_logged)}

    def __enter__(self) -> Lifecycle:
        return self

    def __exit__(self, kind, exc, tb) -> None:
        # An interrupt leaves the run resumable; a refusal never touches the run, nor does
        # a run whose directory moved away (what it saved is there, resumable).
        if exc is not None and self._held and self.status == "running" \
                and not isinstance(exc, KeyboardInterrupt | runlock.RunMoved):
            self.fail(f"{type(exc).__name__}: {exc}")
        elif exc is not None and self._held and self.status == "diverged" and not self.finished \
                and not isinstance(exc, KeyboardInterrupt | runlock.RunMoved):
            # (diverged, then the trainer failed before finish() saved it)
            self.fail(f"{type(exc).__name__}: {exc} (after the run diverged: {self.error})")
        if isinstance(exc, KeyboardInterrupt) and self._held and self.progress \
                and self.status == "running":
            # (a Jupyter user sees only torch's traceback otherwise; `lab run` and sweeps
            # say the same in their own words)
            kept = (self.out / CHECKPOINT).exists()
            print(f"\ninterrupted: {self.out} " + (
                "keeps its last checkpoint; the same call again resumes the run from it" if kept
                else "has no checkpoint yet; the same call again starts the run afresh"),
                file=sys.stderr)
        self.close()


def _leaves(prefix: str, value):
    """(dotted name, leaf) pairs of a nested dict, for naming what differs."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(f"{prefix}.{key}" if prefix else str(key), item)
    else:
        yield prefix, value


def _save_synced(state: dict, tmp: Path) -> None:
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())  # on disk before the rename makes it the checkpoint
