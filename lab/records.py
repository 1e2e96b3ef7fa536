"""Run records: the durable, validated account of one training run (DESIGN section 8).

A run lives in its own directory::

    <run_dir>/
        record.json        the record below (strict JSON, written atomically)
        metrics.parquet    tidy table derived from the record (written atomically)
        checkpoint.pt      optional, written by the trainer
        <notebook>.ipynb   optional, the executed notebook (papermill)

``record.json`` holds one object::

    schema_version  int, == SCHEMA_VERSION
    run_id          str (by convention the run directory's name)
    kind            str, which trainer made it ("conv", "ep", "cfc", ...)
    status          one of STATUSES
    config          dict, asdict(config) of the run's frozen config
    environment     dict, see environment()
    trajectory      list of per-epoch dicts, "epoch" = 0, 1, ..., E-1 in order
    steps           list of per-step dicts, "step" strictly increasing (may be empty)
    final           dict of final metrics
    work            dict, the compute bill (may be empty)
    error           str or null (why a run failed or diverged)
    created         ISO-8601 str
    updated         ISO-8601 str, refreshed by save_run

Metric values (in trajectory, steps, final and work) are numbers, null, or dicts
and lists of those; ``tidy_metrics`` flattens them into one row per
(run_id, axis, index, metric) with nested names joined by "/" ("alignment/conv0",
"grad_norm/2").

JSON has no NaN or infinity, and a diverged run is exactly where they appear,
so ``write_json_atomic`` stores non-finite floats as the strings "NaN",
"Infinity" and "-Infinity" and ``read_json`` turns those strings back into
floats wherever they occur. The price: a string value spelled exactly like one
of them (say a config field set to "NaN") reads back as a float.

Only the standard library, numpy and pandas/pyarrow are used here; torch is
imported lazily by ``environment()`` so analysis code can read records cheaply.
"""

from __future__ import annotations

import copy
import json
import math
import os
import platform
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

SCHEMA_VERSION = 1
STATUSES = ("running", "complete", "failed", "diverged")
TIMING_SUFFIX = "wall_s"

RECORD_FILE = "record.json"
METRICS_FILE = "metrics.parquet"
TIDY_COLUMNS = ("run_id", "axis", "index", "metric", "value")
RUN_COLUMNS = ("run_id", "path", "kind", "status", "n_epochs", "error")
_TIDY_DTYPES = {"run_id": str, "axis": str, "index": "int64", "metric": str, "value": "float64"}
PACKAGES = ("lab", "torch", "numpy", "pandas", "numba", "papermill", "dask")

_NONFINITE_TO_STR = {math.inf: "Infinity", -math.inf: "-Infinity"}
_STR_TO_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_METRIC_ALLOWED = "a number, null, or a dict/list of those"


class RecordError(ValueError):
    """A run record (or a set of them) that cannot be trusted.

    ``path`` is the file, ``field`` the JSON-path-like location inside it
    (e.g. ``trajectory[3].epoch``); ``problems`` lists ``(path, message)`` pairs
    when several records were checked at once (``load_runs``).
    """

    def __init__(self, message: str, *, path=None, field=None, problems=None):
        super().__init__(message)
        self.path = None if path is None else str(path)
        self.field = field
        self.problems = list(problems or [])


# ---------------------------------------------------------------------------
# environment and new records


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _git(args: list[str], cwd: Path) -> str | None:
    # Any failure (git missing, not a checkout, no commits yet, unsafe
    # directory) just means we cannot vouch for the source tree.
    try:
        done = subprocess.run(
            ["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _git_state() -> tuple[str, bool]:
    source = Path(__file__).resolve().parent
    commit = _git(["rev-parse", "HEAD"], source)
    status = _git(["status", "--porcelain"], source)
    # Untracked files count as dirty: a new, uncommitted module changes what ran.
    dirty = bool(status and status.strip())
    return (commit.strip() if commit else "unknown"), dirty


def _package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def _torch_facts(device: str | None) -> dict:
    try:
        import torch
    except ImportError:
        return {"threads": None, "cuda": None, "gpu": None}
    facts = {"threads": torch.get_num_threads(), "cuda": None, "gpu": None}
    if torch.cuda.is_available():
        facts["cuda"] = torch.version.cuda
        index = None
        if device and device.startswith("cuda:"):
            index = int(device.split(":", 1)[1])
        facts["gpu"] = torch.cuda.get_device_name(index)
    return facts


def environment(device: str | None = None) -> dict:
    """Where and with what a run executed: enough to reproduce or doubt it.

    Keys: git_commit ("unknown" outside a git checkout), dirty, python,
    platform, hostname, packages {name: version or "not installed"}, threads,
    device (as given), cuda and gpu (None unless CUDA is available).
    """
    commit, dirty = _git_state()
    env = {
        "git_commit": commit,
        "dirty": dirty,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "packages": {name: _package_version(name) for name in PACKAGES},
        "device": device,
    }
    env.update(_torch_facts(device))
    return env


def new_record(*, run_id: str, kind: str, config: dict, device: str | None = None) -> dict:
    """A fresh "running" record; validated now so a bad config fails before training."""
    now = _now()
    record = {
        "schema_version": SCHEMA_VERSION,
        "run_id": run_id,
        "kind": kind,
        "status": "running",
        # A copy, so later edits to the caller's dict cannot rewrite history.
        "config": copy.deepcopy(config),
        "environment": environment(device),
        "trajectory": [],
        "steps": [],
        "final": {},
        "work": {},
        "error": None,
        "created": now,
        "updated": now,
    }
    return validate_record(record)


# ---------------------------------------------------------------------------
# strict JSON with non-finite floats, written atomically


def encode_nonfinite(obj: Any) -> Any:
    """Non-finite floats -> "NaN"/"Infinity"/"-Infinity", recursively: strict JSON."""
    if isinstance(obj, float | np.floating):
        value = float(obj)
        if math.isnan(value):
            return "NaN"
        return _NONFINITE_TO_STR.get(value, value)
    if isinstance(obj, np.generic | np.ndarray):
        # numpy scalars/arrays sneak in from metrics code; store their Python values.
        return encode_nonfinite(obj.tolist())
    if isinstance(obj, dict):
        return {key: encode_nonfinite(value) for key, value in obj.items()}
    if isinstance(obj, list | tuple):
        return [encode_nonfinite(value) for value in obj]
    return obj


def decode_nonfinite(obj: Any) -> Any:
    """The inverse of :func:`encode_nonfinite`."""
    if isinstance(obj, str):
        return _STR_TO_NONFINITE.get(obj, obj)
    if isinstance(obj, dict):
        return {key: decode_nonfinite(value) for key, value in obj.items()}
    if isinstance(obj, list):
        return [decode_nonfinite(value) for value in obj]
    return obj


def atomic_write(path: Path, write) -> None:
    """Call ``write(tmp_path)`` then rename over ``path``; never leave a half file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Same directory, so os.replace is a rename within one filesystem (atomic).
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    # Makes the rename itself durable; not every platform lets a directory be opened.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json_atomic(path, obj) -> None:
    """Write ``obj`` as strict JSON to ``path`` via temp file + fsync + rename."""
    encoded = encode_nonfinite(obj)

    def write(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8") as handle:
            json.dump(encoded, handle, allow_nan=False, indent=1)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())

    atomic_write(Path(path), write)


def read_json(path) -> object:
    """Read JSON written by ``write_json_atomic``, restoring NaN/inf floats."""
    with open(path, encoding="utf-8") as handle:
        return decode_nonfinite(json.load(handle))


# ---------------------------------------------------------------------------
# validation


def _describe(value: Any) -> str:
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{text} ({type(value).__name__})"


def _fail(path, field: str, found: str, allowed: str):
    raise RecordError(
        f"{path}: field '{field}' is {found}; allowed: {allowed}", path=path, field=field
    )


def _is_int(value: Any) -> bool:
    # bool is an int subclass, but True is not an epoch or a schema version.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    # numpy scalars are welcome: metrics code makes them, and they are stored as Python numbers.
    return isinstance(value, int | float | np.number | np.bool_)


_JSON_ALLOWED = "JSON values: str, number, bool, null, and lists/dicts (string keys) of those"


def _check_json(value: Any, path, field: str) -> None:
    # Config and environment must survive JSON unchanged, or the record cannot reproduce the run.
    if value is None or isinstance(value, str) or _is_number(value):
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                _fail(path, field, f"a dict with key {_describe(key)}", _JSON_ALLOWED)
            _check_json(item, path, f"{field}.{key}")
        return
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _check_json(item, path, f"{field}[{i}]")
        return
    _fail(path, field, _describe(value), _JSON_ALLOWED)


def _check_metric(value: Any, path, field: str) -> None:
    if value is None or _is_number(value):
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                _fail(path, field, f"a dict with key {_describe(key)}", "string keys")
            _check_metric(item, path, f"{field}.{key}")
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            _check_metric(item, path, f"{field}[{i}]")
        return
    _fail(path, field, _describe(value), _METRIC_ALLOWED)


_FIELD_TYPES = {
    "schema_version": (int, "an int"),
    "run_id": (str, "a non-empty string"),
    "kind": (str, "a non-empty string"),
    "status": (str, f"one of {', '.join(STATUSES)}"),
    "config": (dict, "a dict (asdict(config))"),
    "environment": (dict, "a dict (lab.records.environment())"),
    "trajectory": (list, "a list of per-epoch dicts"),
    "steps": (list, "a list of per-step dicts (may be empty)"),
    "final": (dict, "a dict of final metrics"),
    "work": (dict, "a dict (the compute bill, may be empty)"),
    "error": ((str, type(None)), "a string or null"),
    "created": (str, "an ISO-8601 timestamp string"),
    "updated": (str, "an ISO-8601 timestamp string"),
}


def _check_fields(record: dict, path) -> None:
    missing = [key for key in _FIELD_TYPES if key not in record]
    if missing:
        _fail(path, missing[0], "missing", f"a record with all of {', '.join(_FIELD_TYPES)}")
    for key, (kind, allowed) in _FIELD_TYPES.items():
        value = record[key]
        if not isinstance(value, kind) or (kind is int and not _is_int(value)):
            _fail(path, key, _describe(value), allowed)
    for key in ("run_id", "kind"):
        if not record[key]:
            _fail(path, key, "an empty string", _FIELD_TYPES[key][1])
    if record["schema_version"] != SCHEMA_VERSION:
        _fail(
            path,
            "schema_version",
            _describe(record["schema_version"]),
            f"{SCHEMA_VERSION} (this lab reads schema version {SCHEMA_VERSION} only)",
        )
    if record["status"] not in STATUSES:
        _fail(path, "status", _describe(record["status"]), f"one of {', '.join(STATUSES)}")
    for key in ("created", "updated"):
        try:
            datetime.fromisoformat(record[key])
        except ValueError:
            _fail(path, key, _describe(record[key]), "an ISO-8601 timestamp string")


def _check_rows(rows: list, axis_key: str, section: str, path) -> None:
    previous = None
    for i, row in enumerate(rows):
        where = f"{section}[{i}]"
        if not isinstance(row, dict):
            _fail(path, where, _describe(row), f"a dict with an int '{axis_key}'")
        if axis_key not in row:
            _fail(path, f"{where}.{axis_key}", "missing", f"an int {axis_key} in every row")
        index = row[axis_key]
        if not _is_int(index):
            _fail(path, f"{where}.{axis_key}", _describe(index), f"an int {axis_key}")
        if axis_key == "epoch" and index != i:
            # Epochs double as positions: a gap means a lost epoch, not a sparse log.
            _fail(
                path,
                f"{where}.epoch",
                f"{index} at position {i}",
                f"consecutive epochs 0, 1, 2, ... (expected {i})",
            )
        if axis_key == "step" and previous is not None and index <= previous:
            _fail(
                path,
                f"{where}.step",
                f"{index} after step {previous}",
                "strictly increasing steps",
            )
        previous = index
        for key, value in row.items():
            if key != axis_key:
                _check_metric(value, path, f"{where}.{key}")


def validate_record(record: dict, path="<memory>") -> dict:
    """Return ``record`` unchanged if it follows the schema, else raise RecordError."""
    if not isinstance(record, dict):
        _fail(path, "<root>", _describe(record), "a JSON object (dict) holding one run record")
    _check_fields(record, path)
    for section in ("config", "environment"):
        for key, value in record[section].items():
            _check_json(value, path, f"{section}.{key}")
    _check_rows(record["trajectory"], "epoch", "trajectory", path)
    _check_rows(record["steps"], "step", "steps", path)
    for section in ("final", "work"):
        for key, value in record[section].items():
            _check_metric(value, path, f"{section}.{key}")
    return record


# ---------------------------------------------------------------------------
# saving and loading runs


def _record_path(run_dir_or_record_json) -> Path:
    path = Path(run_dir_or_record_json)
    return path if path.suffix == ".json" else path / RECORD_FILE


def save_run(run_dir, record) -> Path:
    """Validate, stamp "updated", write record.json then metrics.parquet; return record.json."""
    run_dir = Path(run_dir)
    path = run_dir / RECORD_FILE
    validate_record(record, path)
    record["updated"] = _now()
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, record)
    # The record is the source of truth; the parquet is derived, so it goes second.
    metrics = tidy_metrics(record)
    atomic_write(
        run_dir / METRICS_FILE, lambda tmp: metrics.to_parquet(tmp, engine="pyarrow", index=False)
    )
    return path


def load_record(run_dir_or_record_json) -> dict:
    """Read and validate one record; any problem is a RecordError naming the file."""
    path = _record_path(run_dir_or_record_json)
    try:
        record = read_json(path)
    except FileNotFoundError:
        raise RecordError(
            f"{path}: no record here (file not found); allowed: a run directory "
            f"holding {RECORD_FILE}, or the path of a {RECORD_FILE}",
            path=path,
            field="<file>",
        ) from None
    except json.JSONDecodeError as err:
        raise RecordError(
            f"{path}: field '<root>' is not valid JSON ({err.msg} at line {err.lineno} "
            f"column {err.colno}), so the file is truncated or corrupt; allowed: one "
            "complete JSON object (rerun the run or restore the file)",
            path=path,
            field="<root>",
        ) from None
    except (UnicodeDecodeError, OSError) as err:
        raise RecordError(
            f"{path}: field '<root>' could not be read ({err}); allowed: a UTF-8 JSON file",
            path=path,
            field="<root>",
        ) from None
    return validate_record(record, path)


# ---------------------------------------------------------------------------
# tidy metrics and run tables


def _leaves(name: str, value: Any) -> Iterator[tuple[str, Any]]:
    """(flattened name, leaf) pairs; dicts and lists nest with "/"."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(f"{name}/{key}", item)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _leaves(f"{name}/{i}", item)
    else:
        yield name, value


def _numeric_leaves(mapping: dict, skip: str | None = None) -> Iterator[tuple[str, float]]:
    for key, value in mapping.items():
        if key == skip:
            continue
        for name, leaf in _leaves(key, value):
            # Bools count (fraction of steps converged is a useful mean); None and text do not.
            if _is_number(leaf):
                yield name, float(leaf)


def _tidy_frame(rows: list[tuple]) -> pd.DataFrame:
    columns = list(zip(*rows, strict=True)) if rows else [()] * len(TIDY_COLUMNS)
    # Fixed dtypes, so an empty table and a parquet round trip look like any other.
    frame = pd.DataFrame(
        {
            name: pd.Series(col, dtype=object)
            for name, col in zip(TIDY_COLUMNS, columns, strict=True)
        }
    )
    return frame.astype(_TIDY_DTYPES)


def tidy_metrics(record) -> pd.DataFrame:
    """One row per (run_id, axis, index, metric); axis is "epoch", "step" or "final" (index -1)."""
    run_id = record["run_id"]
    rows = []
    for row in record.get("trajectory", []):
        rows += [(run_id, "epoch", row["epoch"], m, v) for m, v in _numeric_leaves(row, "epoch")]
    for row in record.get("steps", []):
        rows += [(run_id, "step", row["step"], m, v) for m, v in _numeric_leaves(row, "step")]
    rows += [(run_id, "final", -1, m, v) for m, v in _numeric_leaves(record.get("final", {}))]
    return _tidy_frame(rows)


def _record_paths(root) -> list[Path]:
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such directory of runs")
    return sorted(root.glob(f"**/{RECORD_FILE}"))


def _raise_collected(problems: list[tuple[Path, str]], what: str) -> None:
    # Each message already starts with its file's path.
    lines = "\n".join(f"  - {message}" for _, message in problems)
    raise RecordError(
        f"{len(problems)} {what} could not be read (fix or remove them; none were skipped):\n"
        f"{lines}",
        path=problems[0][0],
        problems=problems,
    )


def _config_columns(config: dict) -> dict:
    columns = {}
    for key, value in config.items():
        if isinstance(value, dict):
            for name, leaf in _leaves(key, value):
                columns[f"config.{name}"] = leaf
        else:
            # Lists stay one column, as tuples, so a researcher can group by them.
            columns[f"config.{key}"] = tuple(value) if isinstance(value, list) else value
    return columns


def _run_row(record: dict, path: Path) -> dict:
    row = {
        "run_id": record["run_id"],
        "path": str(path.parent),
        "kind": record["kind"],
        "status": record["status"],
        "n_epochs": len(record["trajectory"]),
        "error": record["error"],
    }
    row.update(_config_columns(record["config"]))
    row.update({f"final.{name}": leaf for name, leaf in _numeric_leaves(record["final"])})
    return row


def load_runs(root) -> pd.DataFrame:
    """One row per run under ``root``: base columns, then config.* and final.* columns.

    ``path`` is the run directory. Nested config dicts and final metrics are
    flattened with "/" (final names match tidy_metrics' metric names).
    Any unreadable record raises one RecordError listing every bad path.
    """
    rows, problems = [], []
    for path in _record_paths(root):
        try:
            rows.append(_run_row(load_record(path), path))
        except RecordError as err:
            problems.append((path, str(err)))
    if problems:
        _raise_collected(problems, "run records")
    if not rows:
        return pd.DataFrame(columns=list(RUN_COLUMNS))
    frame = pd.DataFrame(rows)
    extra = sorted(c for c in frame.columns if c.startswith("config.")) + sorted(
        c for c in frame.columns if c.startswith("final.")
    )
    frame["n_epochs"] = frame["n_epochs"].astype("int64")
    return frame[list(RUN_COLUMNS) + extra]


def _run_metrics(record_path: Path) -> pd.DataFrame:
    parquet = record_path.parent / METRICS_FILE
    # A parquet older than its record is stale (the run was saved again but the
    # parquet write did not finish): the record wins.
    if parquet.exists() and parquet.stat().st_mtime >= record_path.stat().st_mtime:
        try:
            frame = pd.read_parquet(parquet, engine="pyarrow")
        except Exception as err:  # pyarrow raises several unrelated types for a bad file
            raise RecordError(
                f"{parquet}: field '<file>' is not a readable parquet table ({err}); "
                f"allowed: the table save_run writes (delete it to rebuild from {RECORD_FILE})",
                path=parquet,
                field="<file>",
            ) from None
        if list(frame.columns) != list(TIDY_COLUMNS):
            raise RecordError(
                f"{parquet}: field '<columns>' is {list(frame.columns)}; "
                f"allowed: {list(TIDY_COLUMNS)}",
                path=parquet,
                field="<columns>",
            )
        return frame
    return tidy_metrics(load_record(record_path))


def load_metrics(root) -> pd.DataFrame:
    """All runs' tidy metrics under ``root`` (metrics.parquet, or rebuilt from the record)."""
    frames, problems = [], []
    for path in _record_paths(root):
        try:
            frames.append(_run_metrics(path))
        except RecordError as err:
            problems.append((path, str(err)))
    if problems:
        _raise_collected(problems, "runs' metrics")
    frames = [frame for frame in frames if len(frame)]
    if not frames:
        return _tidy_frame([])
    return pd.concat(frames, ignore_index=True).astype(_TIDY_DTYPES)


# ---------------------------------------------------------------------------
# reproducibility comparisons


def _strip_timings(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {
            key: _strip_timings(value)
            for key, value in obj.items()
            if not (isinstance(key, str) and key.endswith(TIMING_SUFFIX))
        }
    if isinstance(obj, list | tuple):
        return type(obj)(_strip_timings(value) for value in obj)
    return copy.deepcopy(obj)


def without_timings(obj):
    """Deep copy without wall-clock fields, for comparing two runs that should be identical.

    Drops every key ending in TIMING_SUFFIX ("wall_s") at any depth, and the
    top-level "created", "updated" and "environment".
    """
    stripped = _strip_timings(obj)
    if isinstance(stripped, dict):
        for key in ("created", "updated", "environment"):
            stripped.pop(key, None)
    return stripped
