"""The ``lab`` command line: train, run notebooks, sweep protocols, list runs, report.

    lab train  --out runs/bp-s0 -p rule bp -p seed 0 [-f params.yaml] [--force]
    lab run    notebooks/01-train-conv.ipynb --out runs/bp-s0 -p rule bp [-f params.yaml] [--force]
    lab sweep  protocols/demo.yaml [--scheduler ADDRESS] [--workers N] [--force]
    lab runs   runs/demo | protocols/demo.yaml
    lab report protocols/demo.yaml [--notebook NB] [--out reports]

Parameters: ``-f`` files in order, then ``-p`` pairs; a dotted key
(``-p rule_params.scale 0.5``) sets one key inside a dict parameter. Every
parameter is checked before anything starts or is created. A run directory
that already holds a finished run of the same parameters is left alone; one
holding a run of other parameters is refused with the differing fields
(``--force`` moves the old run aside to ``<out>.old-<time>``, never deletes).

Exit status: 0 when everything asked for completed, 1 when a run failed (or
diverged, for train/run), was held by another process or could not be read,
or (sweep) was left alone as stale, 2 for bad input (unknown parameter or bad
value, bad protocol or parameter file, a run directory holding other
parameters given to train/run, an unwritable directory, a blank --out, an --out
inside another run's directory or one that already holds run directories).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shlex
import shutil
import signal
import sys
import textwrap
import threading
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import click

from . import runlock
from .config import (
    ConfigError,
    DuplicateKeyError,
    YAMLError,
    as_dict,
    dotted_parent,
    from_dict,
    load_yaml,
    read_yaml_mapping,
)

if TYPE_CHECKING:
    import pandas as pd

# The commands import records, notebook, sweep and train (pandas, papermill, Dask, torch)
# when they run: `lab --help` and a refused parameter do not wait for them.


class ParameterFileError(ConfigError):
    """A ``-f`` parameter file that cannot be used."""


_NULL = re.compile(r"^(?:null|Null|NULL|~)$")
_NON_FINITE = ("inf", "+inf", "-inf", "infinity", "+infinity", "-infinity", "nan")


def parse_value(text: str, key: str | None = None):
    """A CLI literal -> int, float, bool, None, list/dict or str, read as a parameter
    file reads it (YAML 1.2: ``010`` is ten, ``1e-3`` a float, ``2026-11-30`` a string).

    What YAML would turn into nothing stays the text: ``-p x ""`` is the empty string and
    ``-p x '#tag'`` is ``'#tag'`` (not a comment); only null or ``~`` is None. ``inf`` and
    ``nan`` (any case) are floats, as Python reads them. A mapping that gives a key
    twice is a ConfigError naming ``key`` (the -p key), as it is in a file.
    """
    if text.strip().lower() in _NON_FINITE:
        return float(text)
    try:
        value = load_yaml(text)
    except DuplicateKeyError as err:  # a dict, but which value was meant is unknown
        where = f"-p {key} {text!r}" if key is not None else repr(text)
        raise ConfigError(f"{where}: {err.problem}") from None
    except YAMLError:
        return text  # not YAML (e.g. "[fast"): the text itself, for the config to judge
    if value is None and not _NULL.match(text.strip()):
        return text
    return value


def _read_parameter_file(path: str) -> dict:
    return read_yaml_mapping(path, "parameter file", ParameterFileError,
                             "a YAML mapping of parameter: value lines")


def collect_params(pairs: list[list[str]] | None, files: list[str] | None) -> dict:
    """-f files in order, then -p pairs; a later layer wins over an earlier one. Dotted
    keys (``a.b``) are kept as they are: :func:`lab.notebook.apply_params` sets them
    inside their dict parameter, after the whole dicts, so a later dotted key wins over
    an earlier whole ``a``; a later whole ``a`` drops the earlier layers' ``a.*`` keys.
    Within one layer (one file, or the -p pairs) a key given twice, or a dict given
    whole and by dotted keys, is refused."""
    params: dict = {}
    layers = [(f"in {path}", _read_parameter_file(path)) for path in files or []]
    given: dict = {}
    for key, value in pairs or []:
        if key in given:  # the last one would win without a word
            raise ConfigError(f"-p {key} is given twice ({given[key]!r} and {value!r}); give "
                              "each parameter once")
        given[key] = value
    layers.append(("as -p", {key: parse_value(value, key) for key, value in given.items()}))
    for where, layer in layers:
        for key in layer:
            # `-p a '{b: 1}' -p a.b 2`: a.b given twice, once inside a's dict
            parent = dotted_parent(key, layer)
            if parent is not None:
                shown = given.get(parent, layer[parent])
                raise ConfigError(f"{key} (given {where}) sets a key inside {parent}, which "
                                  f"is given whole there too ({shown!r}); give either the "
                                  f"whole {parent} or its dotted keys")
        for key, value in layer.items():
            for old in [k for k in params if k.startswith(key + ".")]:
                del params[old]  # a later whole dict replaces the earlier leaves
            params[key] = value
    return params


def _error(exc: Exception | str, code: int = 2) -> int:
    print(f"error: {exc}", file=sys.stderr)
    return code


_CHECKPOINT = "checkpoint.pt"  # lab.lifecycle.CHECKPOINT (which imports torch)


def _interrupted(out) -> int:
    # Ctrl-C: the last checkpoint is on disk; `lab runs` reads the unheld run as interrupted.
    if not Path(out).exists():  # stopped while starting: there is nothing to resume
        print(f"\ninterrupted before the run started; nothing was made in {out}",
              file=sys.stderr)
    elif not (Path(out) / _CHECKPOINT).exists():  # (checkpoint_every 0: only at the end)
        print(f"\ninterrupted before the run's first checkpoint; the same command again "
              f"starts {out} from the beginning (checkpoint_every sets how often a run "
              "saves)", file=sys.stderr)
    else:
        print(f"\ninterrupted; run the same command again to resume {out} from its last "
              "checkpoint", file=sys.stderr)
    return 130


def _replace(force: bool) -> str:
    return "always" if force else "never"


def _check_run_dir(out) -> ConfigError | None:
    """``runlock.check_run_dir`` for --out; a directory that cannot be written but holds a
    finished run is returned, not raised: the same parameters there need no write ("nothing
    to do"), anything else raises it then."""
    try:
        runlock.check_run_dir(out, "--out")
    except ConfigError as err:
        here = Path(out)
        try:
            finished = here.is_dir() and runlock.inspect(here).status in runlock.FINISHED
        except OSError:  # (a name the file system refuses: the error says so)
            finished = False
        if not finished:
            raise
        return err
    return None


def _train(args) -> int:
    from .notebook import Resolved, apply_params, decide
    from .train import ConvConfig  # (lab.train.configs: no torch before a value is checked)

    out = Path(args.out).resolve()
    try:
        config = from_dict(ConvConfig, apply_params({}, collect_params(args.param, args.file)))
        unwritable = _check_run_dir(args.out)  # (the text: a blank --out is refused)
        # With the kind, a run another trainer made is refused in one line, not a diff of
        # every field.
        resolved = Resolved({}, as_dict(config), full=True, kind=ConvConfig.KIND)
        decision, state = decide(out, resolved, _replace(args.force), maker="`lab train`")
        if unwritable is not None and decision != "done":
            raise unwritable
        if decision != "done":  # after decide: a refused run reads (and caches) no data
            config.preflight()
    except ConfigError as exc:
        return _error(exc)
    except runlock.RunLocked as exc:
        return _error(exc, 1)
    if decision == "done":
        print(f"{out.name}: already {state.status} with these parameters; nothing to do "
              f"(--force trains it afresh, keeping the old run aside) -> {args.out}")
        return 0 if state.status == "complete" else 1
    try:
        if decision == "replace":
            print(f"the old run is kept in {runlock.move_aside(out)}")
        from .train import train_conv  # torch and the rules: only for a run that trains

        record = train_conv(config, out)
    except KeyboardInterrupt:
        return _interrupted(args.out)
    except runlock.RunLocked as exc:
        return _error(exc, 1)
    except (ValueError, OSError) as exc:  # e.g. DataError: the dataset is smaller than n_train
        return _error(f"{type(exc).__name__}: {exc}", 1)
    print(f"{record['status']}: {record['final']} -> {args.out}")
    if record.get("error"):
        print(f"error: {record['error']}", file=sys.stderr)
    return 0 if record["status"] == "complete" else 1


def _run(args) -> int:
    from .notebook import NotebookError, RunConflict, execute

    unwritable = None
    try:
        params = collect_params(args.param, args.file)
        unwritable = _check_run_dir(args.out)
        result = execute(args.notebook, args.out, params, replace=_replace(args.force))
    except KeyboardInterrupt:
        return _interrupted(args.out)
    except (RunConflict, ConfigError, NotebookError) as exc:
        return _error(exc)
    except runlock.RunLocked as exc:
        return _error(exc, 1)
    except OSError as exc:  # the machine, not a parameter (those are checked first): exit 1
        if unwritable is not None:  # a finished run there, and these parameters must write
            return _error(unwritable)
        return _error(f"{type(exc).__name__}: {exc}", 1)
    if result.skipped:
        print(f"{result.run_id}: already {result.status} with these parameters; nothing to do "
              f"(--force runs it afresh, keeping the old run aside) -> {result.out_dir}")
        return 0 if result.status == "complete" else 1
    if result.moved_aside:
        print(f"the old run is kept in {result.moved_aside}")
    where = result.notebook
    if result.moved_away:  # the old path is gone (or another directory): say where it is
        where = (f"{result.notebook} (the run directory moved there; resume it there)"
                 if result.moved_to else f"{args.out} (the run directory was moved or deleted)")
    print(f"{result.run_id}: {result.status} in {result.wall_s:.1f} s -> {where}")
    if result.error:
        print(f"error: {result.error}", file=sys.stderr)
    values = {k: v for k, v in result.values.items() if not isinstance(v, dict | list)}
    if values and not result.error:  # after an error they would read as the run's outcome
        print("recorded: " + ", ".join(f"{k}={v}" for k, v in values.items()))
    return 0 if result.status == "complete" else 1


def _sweep(args) -> int:
    from .sweep import ProtocolError, SchedulerError, expand, load_protocol, run_sweep

    try:
        protocol = load_protocol(args.protocol)
    except ProtocolError as exc:
        return _error(exc)
    try:
        report = run_sweep(protocol, scheduler=args.scheduler, workers=args.workers,
                           progress=not args.quiet, force=args.force)
    except (SchedulerError, ProtocolError) as exc:
        return _error(exc)
    except KeyboardInterrupt:
        # Finished runs are on disk; unfinished ones resume from their checkpoints.
        # The same command resumes: the cluster it named, and its options.
        again = shlex.join(["lab", args.command, args.protocol]
                           + (["--scheduler", args.scheduler] if args.scheduler else [])
                           + (["--workers", str(args.workers)] if args.workers else []))
        print(f"\ninterrupted; run `{again}` again to finish the remaining runs (finished "
              "ones are kept)", file=sys.stderr)
        if args.scheduler:  # its workers are not this process's: nothing stops them
            print(f"runs already started on {args.scheduler}'s workers go on to the end (`lab "
                  f"runs {shlex.quote(args.protocol)}` shows them running); the rerun counts "
                  "them as they are by then", file=sys.stderr)
        return 130
    table = report.table()[["run_id", "status", "skipped", "wall_s", "error"]].fillna("")
    print(table.to_string(index=False, max_colwidth=80))
    print(report.summary())
    others = _not_in_protocol(Path(protocol.out), [spec.run_id for spec in expand(protocol)])
    if others:  # a grid value removed since: left alone, and said so (as `lab runs` does)
        print(f"note: {_not_in_protocol_note(others)}; the sweep leaves "
              f"{'it' if len(others) == 1 else 'them'} alone")
    return 1 if report.failed or report.left_alone else 0


def _select(args) -> int:
    """A selection protocol's sweep, then the choice (analysis.select), written to its
    ``select.into`` for the final protocol to include."""
    # analysis sits above lab; only this command needs it (and pandas through it).
    from analysis.completeness import IncompleteProtocolError
    from analysis.select import SelectionError, read_spec, select

    from .records import RecordError
    from .sweep import ProtocolError, load_protocol

    try:
        protocol = load_protocol(args.protocol)
        read_spec(protocol.select, protocol.grid, args.protocol)
    except (ProtocolError, SelectionError) as exc:
        if isinstance(exc, SelectionError) and not protocol.select:
            exc = f"{args.protocol} has no select section, so there is nothing to choose; " \
                  "a selection protocol says what to choose (docs/sweeps-and-protocols.md)"
        return _error(exc)
    code = _sweep(args)
    if code:
        print("selection not made: every run must finish first", file=sys.stderr)
        return code
    try:
        selection = select(args.protocol)
    except (SelectionError, IncompleteProtocolError, RecordError) as exc:
        return _error(exc)
    path = selection.write()
    spec = selection.spec
    print(selection.result.to_string(index=False))
    print(f"chosen: {spec.goal} mean final {spec.metric} over seeds, per "
          f"{spec.per or 'protocol'}; written to {path}")
    return 0


# ---------------------------------------------------------------------------
# lab runs


def _run_rows(record_dirs: list[Path]) -> tuple[pd.DataFrame, list[tuple[Path, str]]]:
    """The readable runs (load_runs' rows, status made live) and the unreadable ones."""
    import pandas as pd

    from . import records

    frames, unreadable = [], []
    for run_dir in record_dirs:
        try:
            # its row store checked too (by line count): a finished run whose rows were cut
            # short is not "complete", as load_metrics and `lab report` would find
            runs = records.load_runs(run_dir)
            own = runs[[Path(p) == run_dir for p in runs["path"]]]
        except records.RecordError as err:
            unreadable.append((run_dir, str(err)))
            continue
        frames.append(own)  # not nested runs
    frames = [frame for frame in frames if len(frame)]
    if not frames:
        return pd.DataFrame(columns=list(records.RUN_COLUMNS)), unreadable
    runs = pd.concat(frames, ignore_index=True)
    # load_runs tells a live run from a killed one by its lock; name the live one's pid.
    live = []
    for path, status in zip(runs["path"], runs["status"]):
        pid = runlock.holder(path) if status == "running" else None
        live.append(f"running (pid {pid})" if pid else status)
    return runs.assign(status=live), unreadable


def _with_starting(runs: pd.DataFrame, root: Path, expected: list[str] | None) -> pd.DataFrame:
    """Add the runs that have no record yet: a live one (imports and data loading come
    before the first record), so it is never shown missing, and one killed before its
    first record (its lock and executed notebook are there), so it is not invisible."""
    import pandas as pd

    from . import records
    from .notebook import OUTPUT_NOTEBOOK

    if not root.is_dir():
        return runs
    locks = [root / rid / runlock.LOCK_FILE for rid in expected] if expected is not None \
        else sorted(root.glob(f"**/{runlock.LOCK_FILE}"))
    starting = []
    for lock in locks:
        run_dir = lock.parent
        if not lock.exists() or (run_dir / records.RECORD_FILE).exists():
            continue
        pid = runlock.holder(run_dir)
        if pid is not None:
            starting.append({"run_id": run_dir.name, "path": str(run_dir),
                             "status": f"running (pid {pid})" if pid else "running"})
        elif (run_dir / OUTPUT_NOTEBOOK).exists():
            # A lock alone is not a run (a refused attempt leaves one); with the executed
            # notebook beside it, a run started there and died before its first record.
            starting.append({"run_id": run_dir.name, "path": str(run_dir),
                             "status": "interrupted",
                             "error": "stopped before its first record; run it again"})
    return pd.concat([runs, pd.DataFrame(starting)], ignore_index=True) if starting else runs


def _relative(path: str, base: Path) -> str:
    try:
        return str(Path(path).relative_to(base)) or "."
    except ValueError:
        return str(path)


def runs_table(target) -> tuple[pd.DataFrame, list[tuple[str, str]]]:
    """(runs, unreadable) under a directory of runs, a single run, or a protocol's
    expected runs (missing ones included). ``dir`` is each run's directory
    relative to the path given; unreadable is [(dir, reason)]."""
    import pandas as pd

    from . import records

    if not isinstance(target, str | os.PathLike):
        raise TypeError(f"runs_table: target must be a path (a directory of runs, a run's "
                        f"record.json or a protocol .yaml), got {target!r} "
                        f"({type(target).__name__})")
    target = Path(target)
    expected = None
    if target.suffix in (".yaml", ".yml"):
        from .sweep import expand, load_protocol, mark_stale, stale_runs

        # Validated as a sweep would (a protocol the sweep refuses is not listed as
        # "missing"), but not against this machine: a listing starts nothing, and runs made
        # on a GPU cluster (device cuda, data files there) are listed on a laptop.
        protocol = load_protocol(target, preflight=False)
        specs = expand(protocol)
        expected = [spec.run_id for spec in specs]
        root = Path(protocol.out)
    elif target.is_file() and target.name == records.RECORD_FILE:
        root = target.parent
    elif target.is_file():
        raise FileNotFoundError(f"{target} is a file; give a directory of runs, a run's "
                                f"{records.RECORD_FILE}, or a protocol (.yaml)")
    elif not target.is_dir():
        raise FileNotFoundError(f"{target}: no such directory of runs")
    else:
        root = target
    root = root.resolve()
    dirs = [p.parent for p in records.find_records(root)] if root.is_dir() else []
    others = []
    if expected is not None:  # a protocol's runs are exactly <out>/<run_id>
        others = _not_in_protocol(root, expected)
        dirs = [d for d in dirs if d.parent == root and d.name in set(expected)]
    runs, unreadable = _run_rows(dirs)
    runs = _with_starting(runs, root, expected)
    if expected is not None:
        # stale_runs is keyed by directory (<out>/<run_id>); a record's own run_id may name
        # another (run directories swapped or copied), so each row is marked for the
        # directory it shows, then given its record's run_id back.
        ids = runs["run_id"]
        runs = mark_stale(runs.assign(run_id=[Path(p).name for p in runs["path"]]), specs,
                          stale_runs(protocol))  # the whole check: defaults too
        found = set(runs["run_id"]) | {d.name for d, _ in unreadable}
        runs = runs.assign(run_id=ids)
        missing = [rid for rid in expected if rid not in found]
        runs = pd.concat([runs, pd.DataFrame({"run_id": missing, "status": "missing",
                                              "path": [str(root / m) for m in missing]})],
                         ignore_index=True)
        order = {rid: i for i, rid in enumerate(expected)}
        runs = runs.sort_values("run_id", key=lambda ids: ids.map(order), kind="stable")
    base = root if expected is not None else (target.resolve() if target.is_dir() else root)
    if expected is None and (base / records.RECORD_FILE).is_file():
        base = base.parent  # one run given: its dir shows as its name, not "."
    runs = runs.assign(dir=[_relative(p, base) for p in runs["path"]])
    count = "n_rows" if "n_rows" in runs.columns else "n_epochs"
    # Headline finals only: nested diagnostics (final.rule/...) stay in the records and
    # `records.load_runs`, or a rule with per-population diagnostics buries the table.
    finals = [c for c in runs.columns if c.startswith("final.") and "/" not in c]
    columns = ["run_id", "dir", "status", *(["axis"] if "axis" in runs.columns else []), count,
               *finals, "error"]
    table = runs[columns].copy().reset_index(drop=True)
    table[count] = table[count].astype("Int64")  # missing runs have none
    for column in finals:  # counts (ep_updates, skipped_steps, lifted) print as counts
        values = pd.to_numeric(table[column], errors="coerce").dropna()
        if len(values) and table[column].dtype.kind == "f" and (values % 1 == 0).all() \
                and values.abs().max() < 2 ** 53 and not column.endswith(("acc", "loss")):
            table[column] = table[column].astype("Int64")
    table["error"] = table["error"].map(lambda e: e if isinstance(e, str) else "")
    if "axis" in table.columns:
        table["axis"] = table["axis"].fillna("")
    bad = [(_relative(str(d), base), reason) for d, reason in unreadable]
    table = table.rename(columns=lambda c: c.removeprefix("final."))
    # Runs in the protocol's out that it does not ask for (a grid value removed since,
    # another protocol's): not its runs, so not listed, but not passed over in silence.
    table.attrs["not_in_protocol"] = others
    return table, bad


def _not_in_protocol(root: Path, expected) -> list[str]:
    """Run directories right in a protocol's out that it does not ask for (a grid value
    removed since, another protocol's); runs moved aside by --force are not counted."""
    from . import records

    if not root.is_dir():
        return []
    wanted = set(expected)
    return sorted(p.parent.name for p in root.glob(f"*/{records.RECORD_FILE}")
                  if p.parent.name not in wanted and not records.MOVED_ASIDE.search(p.parent.name))


def _not_in_protocol_note(others: list[str]) -> str:
    one = len(others) == 1
    return (f"{len(others)} run director{'y' if one else 'ies'} in the protocol's out "
            f"{'is' if one else 'are'} not among its runs ({', '.join(others[:3])}"
            f"{', ...' if len(others) > 3 else ''}): a grid value removed since, or another "
            "protocol's? `lab runs` on the directory lists them")


def _runs(args) -> int:
    from .records import MOVED_ASIDE, RecordError
    from .sweep import ProtocolError

    try:
        table, unreadable = runs_table(args.target)
    except (RecordError, ProtocolError, FileNotFoundError, ConfigError) as exc:
        # (ConfigError: a protocol edited to a bad value, found comparing its runs)
        return _error(exc)
    if table.empty and not unreadable:
        print(f"no runs under {args.target}")
        return 0
    if not table.empty:
        # The table shows each message's start; a cut one is printed whole below it (a
        # stale run's reason names the values that differ, at its end).
        full = table["error"]
        shown = table.assign(error=full.map(lambda e: textwrap.shorten(
            " ".join(e.split()), _ERROR_WIDTH, placeholder=" [...]")))
        print(shown.to_string(index=False, float_format=lambda v: f"{v:.4f}"))
        cut = [(run_id, text) for run_id, text, short in
               zip(table["run_id"], full, shown["error"]) if short != " ".join(text.split())]
        if cut:
            print(f"\n{len(cut)} message(s) in full:")
            for run_id, text in cut:
                print(f"  {run_id}: " + "\n    ".join(text.splitlines()))
    others = table.attrs.get("not_in_protocol", [])
    if others:
        print(f"\n{_not_in_protocol_note(others)}")
    # A run --force moved aside was replaced on purpose (often because it was broken):
    # shown, but it does not make the listing fail.
    old = [(w, r) for w, r in unreadable if MOVED_ASIDE.search(Path(w).name)]
    live = [(w, r) for w, r in unreadable if (w, r) not in old]
    for label, items in (("could not be read", live),
                         ("moved aside by --force could not be read (not counted)", old)):
        if items:
            print(f"\n{len(items)} run(s) {label}:")
            for where, reason in items:
                print(f"  {where}: {reason}")
    return 1 if live else 0


_HTML = "report.html"  # rendered inside the pending directory, moved out beside it
_ERROR_WIDTH = 60  # characters of a run's message in `lab runs`' table


@contextlib.contextmanager
def _report_lock(out: Path, base: str):
    """One `lab report` at a time writes ``out/base``: a second one waits for the first
    (they would delete each other's pending notebook), then makes its own."""
    from filelock import FileLock, Timeout  # (20 ms at start-up that only reports need)

    lock = FileLock(out / f".{base}.report.lock")
    try:
        out.mkdir(parents=True, exist_ok=True)
        lock.acquire(timeout=0)
    except PermissionError as err:  # made read-only after the check, or refused anyway
        where = err.filename or out
        raise ConfigError(f"--out {out}: {where} is not writable ({err.strerror}); choose a "
                          "directory you can write to") from None
    except Timeout:
        print(f"waiting for another `lab report` writing {out / base} to finish",
              file=sys.stderr)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


@contextlib.contextmanager
def _interrupt_deferred():
    """Ctrl-C during the block takes effect at its end (a few renames that belong
    together); outside the main thread, where no handler can be set, the block just runs."""
    caught = []
    try:
        previous = signal.signal(signal.SIGINT, lambda *_: caught.append(True))
    except ValueError:  # not the main thread
        previous = None
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


def _check_report_owner(out: Path, base: str, name: str, source: str) -> None:
    """Refuse to replace a report another protocol file made under the same name.

    Reports are named after the protocol's ``name``; a protocol copied and edited
    without renaming would silently overwrite the other's report. The executed notebook
    of the last report records the protocol it was given (its papermill parameters); a
    report whose protocol file no longer exists (moved, renamed) is replaced.
    """
    from .notebook import OUTPUT_NOTEBOOK

    for directory in (out / base, out / f"{base}.failed"):
        try:
            nb = json.loads((directory / OUTPUT_NOTEBOOK).read_text(encoding="utf-8"))
            other = nb["metadata"]["papermill"]["parameters"]["protocol"]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # no report there, or not one this command made
        if isinstance(other, str) and Path(other).is_absolute() and Path(other).is_file() \
                and Path(other).resolve() != Path(source):
            raise ConfigError(
                f"{out / base}.html is the report of {other}, another protocol with the "
                f"name {name!r}; a report of {source} would replace it. Give "
                "one of the two protocols its own `name:` (reports, not runs, are named "
                "after it), or pass --out another reports directory")


def _report(args) -> int:
    from .notebook import NotebookError, check_reports, execute, notebook_spec, render_html
    from .sweep import expand, load_protocol, stale_runs

    try:
        protocol = load_protocol(args.protocol, configs=False)  # reads runs, makes none
        # Before anything is read or run: a report that cannot be written is a bad --out
        # (the lock and mkdir below turn a later refusal into the same line).
        if not str(args.out).strip():
            raise ConfigError(f"--out {args.out!r} is blank, which would mean the working "
                              "directory; give the reports directory (default: reports)")
        runlock.check_writable_dir(args.out, "--out", "the reports")
        inside = runlock.enclosing_run(args.out)
        if inside is not None:  # the report would travel with that run when moved aside
            raise ConfigError(f"--out {args.out} lies in the run directory {inside}; give a "
                              "reports directory outside every run (default: reports)")
        notebook = args.notebook or protocol.report
        if not notebook:
            raise NotebookError(f"protocol {protocol.source} names no report notebook; add "
                                "`report: <path>` to it or pass --notebook")
        check_reports(notebook_spec(notebook, with_class=False))  # before the lock file
        # The protocol's own runs are checked however they are named; another runs
        # directory (a copy, a fixture made elsewhere) is the caller's to vouch for.
        if not args.runs or Path(args.runs).resolve() == Path(protocol.out).resolve():
            # Runs a sweep still trains: the notebook would run to the end and fail on
            # them (status running, rows missing); said at once instead.
            run_ids = [spec.run_id for spec in expand(protocol)]
            live = {run_id: runlock.holder(Path(protocol.out) / run_id) for run_id in run_ids}
            live = {run_id: pid for run_id, pid in live.items() if pid is not None}
            if live:
                raise NotebookError(
                    f"{len(live)} run(s) of {protocol.source} are still training, so no report "
                    "was made (let the sweep finish, then report again):\n"
                    + "\n".join(f"  - {run_id}: held by pid {pid or 'unknown'}"
                                for run_id, pid in list(live.items())[:8])
                    + (f"\n  and {len(live) - 8} more" if len(live) > 8 else ""))
            if not any((Path(protocol.out) / run_id / runlock.RECORD_FILE).exists()
                       for run_id in run_ids):
                # The notebook would start a kernel only to list every run as missing.
                raise NotebookError(
                    f"none of the {len(run_ids)} run(s) of {protocol.source} has a record in "
                    f"{protocol.out} yet, so no report was made: run `lab sweep "
                    f"{args.protocol}` first")
            stale = stale_runs(protocol, mixed_code=args.mixed_code)
            if stale:
                raise NotebookError(
                    f"{len(stale)} run(s) of {protocol.source} are not what the protocol asks "
                    "now, so no report was made (rerun them with `lab sweep --force`; runs "
                    "that differ only in the notebook's code may be reported together, "
                    "knowingly, with --mixed-code):\n"
                    + "\n".join(f"  - {run_id}: {why}" for run_id, why in stale.items()))
            others = _not_in_protocol(Path(protocol.out), run_ids)
            if others:  # as `lab runs PROTOCOL` says; the report reads only the protocol's
                print(f"note: {_not_in_protocol_note(others)}; the report leaves "
                      f"{'it' if len(others) == 1 else 'them'} out", file=sys.stderr)
        # absolute: the executed report says which protocol file made it, wherever from
        params = {"protocol": str(Path(protocol.source).resolve())}
        if args.mixed_code:
            if "mixed_code" not in notebook_spec(notebook, with_class=False).declared:
                raise NotebookError(f"--mixed-code: {notebook} does not take a mixed_code "
                                    "parameter, so it would refuse the runs anyway; add "
                                    "`mixed_code = False` to its parameters cell and pass it "
                                    "to load_protocol_runs")
            params["mixed_code"] = True
        if args.runs:
            if not Path(args.runs).is_dir():
                raise NotebookError(f"--runs {args.runs}: no such directory of runs")
            params["runs_dir"] = str(Path(args.runs).resolve())
            if Path(args.runs).resolve() != Path(protocol.out).resolve():
                print(f"note: --runs {args.runs} is not the protocol's out ({protocol.out}): "
                      "its runs are checked for presence and completeness, not against the "
                      "protocol's values (a run made with other values is reported as it is)",
                      file=sys.stderr)
        out = Path(args.out)
        # Another notebook than the protocol's own report gets its own name: the two would
        # overwrite each other.
        base = protocol.name
        if args.notebook and protocol.report and (Path(args.notebook).resolve()
                                                  != Path(protocol.report).resolve()):
            base = f"{protocol.name}.{Path(args.notebook).stem}"
        if (out / base).resolve().parent != out.resolve():  # the report replaces out/base
            raise ConfigError(f"the report's name {base!r} is not a plain name inside --out "
                              f"{out}; rename the protocol (or the notebook)")
        with _report_lock(out, base):
            _check_report_owner(out, base, protocol.name, params["protocol"])
            # Executed aside, then put in place: a failed report (e.g. incomplete data) never
            # replaces the last good one, neither its HTML nor its executed notebook.
            pending = out / f"{base}.pending"
            shutil.rmtree(pending, ignore_errors=True)
            try:
                result = execute(notebook, pending, params, record=False)
                name = base if result.ok else f"{base}.failed"
                render_html(pending / Path(result.notebook).name, pending / _HTML)
            except KeyboardInterrupt:  # a half-run notebook is nobody's report
                shutil.rmtree(pending, ignore_errors=True)
                raise
            with _interrupt_deferred():  # the notebook and its HTML replace the old together
                shutil.rmtree(out / name, ignore_errors=True)
                pending.rename(out / name)
                html = out / f"{name}.html"
                os.replace(out / name / _HTML, html)
                if result.ok:  # a failure reported earlier is resolved: its leftovers mislead
                    shutil.rmtree(out / f"{base}.failed", ignore_errors=True)
                    (out / f"{base}.failed.html").unlink(missing_ok=True)
    except (ConfigError, NotebookError) as exc:
        return _error(exc)
    except KeyboardInterrupt:
        print("\ninterrupted; no report was made (the last one, if any, is unchanged)",
              file=sys.stderr)
        return 130
    if result.error:
        print(f"error: the report notebook failed: {result.error}", file=sys.stderr)
        print(f"the failed notebook: {html.resolve()}")
        return 1
    print(f"report: {html.resolve()}")
    return 0


# ---------------------------------------------------------------------------
# the command line: click reads it into a namespace, main() runs the command outside
# click, so that Ctrl-C, SIGTERM and a closed pipe end it as below (not "Aborted!")


class _Path(click.ParamType):
    """A path with ``~`` expanded, as the shell would unquoted (a quoted ``"~/runs"``
    would otherwise make a folder named ``~``); a path to read is never empty: ``lab runs
    "$DIR"`` with DIR unset would list the working directory without a word."""

    name = "path"

    def convert(self, value, param, ctx):
        if not value and isinstance(param, click.Argument):  # (" " may be a directory)
            self.fail(f"an empty path ({value!r}); give a path (is a shell variable "
                      "unset?); . is the working directory", param, ctx)
        return os.path.expanduser(value)


def _pairs(ctx, param, pairs):
    """``-p KEY VALUE``: click takes the two words after -p as they are, so a negative
    number is a value (``-p lr -1e-3``); an option there (``-p x --force``) is a
    forgotten value, refused rather than taken as the text."""
    for key, value in pairs:
        if value.startswith("-") and value != "-":
            number = parse_value(value, key)
            if isinstance(number, bool) or not isinstance(number, int | float):
                raise ConfigError(
                    f"-p {key} has no value: next comes {value!r}, which is read as an "
                    "option; give -p KEY VALUE (a text value that starts with '-' can be "
                    f"written with a space before it: -p {key} ' {value}')")
    return [list(pair) for pair in pairs]


def _workers(ctx, param, text):
    try:
        value = None if text is None else int(text)
    except ValueError:
        value = 0
    if value is not None and value < 1:
        raise click.UsageError(f"--workers {text!r}: give a whole number >= 1 (local Dask "
                               "worker processes)")
    return value


_RUN_OPTIONS = [
    click.Option(["--out"], required=True, type=_Path(), help="run directory"),
    click.Option(["-p", "--param"], nargs=2, multiple=True, metavar="KEY VALUE",
                 callback=_pairs, help="a parameter (value parsed as YAML; a dotted key sets "
                 "one key inside a dict parameter); repeatable"),
    click.Option(["-f", "--file"], multiple=True, type=_Path(), help="YAML file of "
                 "parameters; repeatable, a later file and then -p win over an earlier one"),
    click.Option(["--force"], is_flag=True,
                 help="replace a run already in --out (moved aside, never deleted)")]
_SWEEP_OPTIONS = [
    click.Option(["--scheduler"], help="Dask scheduler address (default: a LocalCluster)"),
    click.Option(["--workers"], metavar="N", callback=_workers,
                 help="local workers (default: the protocol's)"),
    click.Option(["--force"], is_flag=True,
                 help="replace runs finished with other parameters (moved aside)"),
    click.Option(["-q", "--quiet"], is_flag=True, help="no progress bar")]
_COMMANDS = {  # name -> (help, parameters); `lab NAME` runs _NAME(args)
    "train": ("train one conv run in-process (ConvConfig's defaults: ResNet-20, 60 epochs; "
              "notebook 01's are smaller)", _RUN_OPTIONS),
    "run": ("execute a notebook with papermill into a run directory",
            [click.Argument(["notebook"], type=_Path()), *_RUN_OPTIONS]),
    "sweep": ("execute a protocol's unfinished runs on Dask (PROTOCOL: protocols/*.yaml)", [
        click.Argument(["protocol"], type=_Path()),
        *_SWEEP_OPTIONS]),
    "select": ("run a selection protocol's sweep, choose on its validation metric and write "
               "the chosen values to its select.into (docs/sweeps-and-protocols.md)", [
        click.Argument(["protocol"], type=_Path()),
        *_SWEEP_OPTIONS]),
    "runs": ("table of runs with status and final metrics (TARGET: a directory of runs, a "
             "record.json, or a protocol YAML)", [click.Argument(["target"], type=_Path())]),
    "report": ("execute a protocol's analysis notebook to HTML", [
        click.Argument(["protocol"], type=_Path()),
        click.Option(["--notebook"], type=_Path(), help="analysis notebook (default: the "
                     "protocol's report; another than the protocol's writes "
                     "<protocol>.<notebook>.html)"),
        click.Option(["--runs"], type=_Path(), help="runs directory (default: the "
                     "protocol's out, whose runs must be what the protocol asks now; another "
                     "directory is not checked for stale runs)"),
        click.Option(["--out"], default="reports", type=_Path(),
                     help="reports directory (default: reports/ in the current directory)"),
        click.Option(["--mixed-code"], is_flag=True,
                     help="report runs made by different versions of the notebook's code "
                          "together (refused by default)")]),
}
_cli = click.Group("lab", help=__doc__.splitlines()[0].replace("``", ""),
                   context_settings={"help_option_names": ["-h", "--help"]},
                   commands=[click.Command(name, params=params, help=text,
                                           callback=functools.partial(SimpleNamespace,
                                                                      command=name))
                             for name, (text, params) in _COMMANDS.items()])


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    kind = "" if category is UserWarning else f" ({category.__name__})"
    return f"warning{kind}: {message}\n"


def main(argv: list[str] | None = None) -> int:
    try:
        args = _cli.main(argv, prog_name="lab", standalone_mode=False)
    except click.ClickException as exc:  # a usage error: click's message, exit 2
        exc.show()
        raise SystemExit(exc.exit_code) from None
    except ConfigError as exc:  # a -p with no value
        return _error(exc)
    if not isinstance(args, SimpleNamespace):  # --help, printed
        return args
    # A warning for the researcher (a split that cannot be honoured, a schedule shortened)
    # as one line, not Python's "file:line: UserWarning:" plus the source line.
    formatwarning = warnings.formatwarning
    warnings.formatwarning = _one_line_warning
    # SIGTERM (a job scheduler's stop, `kill`) takes Ctrl-C's path: the run ends
    # interrupted with its message, a sweep shuts its cluster down; before, the process
    # died silently (and a sweep's Dask left semaphores behind). Exit 143 = 128 + 15.
    terminated = []

    def on_term(signum, frame):
        terminated.append(signum)
        raise KeyboardInterrupt

    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, on_term) if main_thread else None
    try:
        code = globals()[f"_{args.command}"](args)  # (looked up now: tests replace one)
    except KeyboardInterrupt:
        # One the command does not handle itself (those around a run's or a report's
        # writes say what was kept), e.g. while it imports its modules.
        print(f"\ninterrupted; `lab {args.command}` stopped before it changed any run or "
              "report", file=sys.stderr)
        code = 130
    except BrokenPipeError:
        # `lab runs ... | head`: the reader has gone, which is no error. Python would
        # complain again flushing stdout at exit, so point it at devnull first.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    finally:
        warnings.formatwarning = formatwarning
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    return 128 + signal.SIGTERM if terminated and code == 130 else code


def positive_int(text: str) -> int:
    """argparse type of a count (the benchmarks' --rounds, --threads ...): an integer >= 1."""
    import argparse  # (only the benchmarks' parsers use it)

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


if __name__ == "__main__":
    sys.exit(main())
