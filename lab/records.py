"""Run records: the durable, validated account of one training run (DESIGN section 8).

A run lives in its own directory::

    <run_dir>/
        record.json        small: config, environment, status, declaration, counts, final
        rows/<axis>/<start>-<end>.jsonl
                           the append-only row store: rows [start, end) of that axis
        checkpoint.pt      optional, written by the run lifecycle
        <notebook>.ipynb   optional, the executed notebook (papermill)

``record.json`` holds one object: the pydantic model ``_Record3`` below says every
field and what it allows (``_Record1`` and ``_Record2``: the older versions still read).
``row_parts`` lists each committed part of the row store with its sha256, and
``final_in_rows`` the final metrics that repeat the last row's value; every reader
checks both. Fields a record holds beyond the model (``code``) are kept, unchecked.

The rows live outside the record so that a save costs in proportion to the
rows added since the last one, not to the whole history: :func:`append_rows`
writes one new part (tidy columns row, index, metric, value), atomically, and
the record's count is raised afterwards. A part beyond the count (a kill
between the two writes) is ignored by readers and removed on resume; parts
are only ever cut at counts the record or a checkpoint has stated, so the
store is valid after a kill at any moment.

Metric values in rows, final and work are numbers, null, or dicts and lists of
those; nested names are joined by "/" ("alignment/conv0", "grad_norm/2").
``tidy_metrics`` / ``load_metrics`` give one row per (run_id, axis, index,
metric); a null is absent there, a NaN is kept.

JSON has no NaN or infinity, and a diverged run is exactly where they appear,
so ``write_json_atomic`` stores non-finite floats as the strings "NaN",
"Infinity" and "-Infinity" and ``read_json`` turns those strings back into
floats wherever they occur. The price: a string value spelled exactly like one
of them (say a config field set to "NaN") reads back as a float.

Version 1 records (rows inside record.json as ``trajectory`` and ``steps``)
are read as they are; version 2 records (a row store without ``row_parts``) have
their parts checked by line count only; only version 3 is written.

Only the standard library, numpy and pandas/pyarrow are used here; torch is
imported lazily by ``environment()`` so analysis code can read records cheaply, and
pandas by the tables' functions, so a training kernel that writes a record needs none.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import platform
import re
import socket
import subprocess
import tempfile
import warnings
from collections import Counter
from collections.abc import Iterator
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import numpy as np
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictInt,
    StrictStr,
    Tag,
    ValidationError,
)
from typing_extensions import TypeAliasType

from . import runlock

if TYPE_CHECKING:
    import pandas as pd

SCHEMA_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
STATUSES = ("running", "complete", "failed", "diverged")
AXES = ("epoch", "step")
TIMING_SUFFIX = "wall_s"

RECORD_FILE = "record.json"
# The name ``lab.runlock.move_aside`` gives a run that --force replaced: <run>.old-<UTC time>.
MOVED_ASIDE = re.compile(r"\.old-\d{8}T\d{6}Z(-\d+)?$")
METRICS_FILE = "metrics.parquet"  # version 1 only: the tidy table derived from the record
ROWS_DIR = "rows"
PART_SUFFIX = ".jsonl"
TIDY_COLUMNS = ("run_id", "axis", "index", "metric", "value")
RUN_COLUMNS = ("run_id", "path", "kind", "status", "axis", "n_rows", "n_epochs", "error",
               "expect")
_EMPTY_RUN_DTYPES = {"n_rows": "int64", "n_epochs": "int64", "error": object, "expect": object}
_TIDY_DTYPES = {"run_id": str, "axis": str, "index": "int64", "metric": str, "value": "float64"}
PACKAGES = ("lab", "torch", "numpy", "pandas", "numba", "papermill", "dask")

_NONFINITE_TO_STR = {math.inf: "Infinity", -math.inf: "-Infinity"}
_STR_TO_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


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


# The kind of the record the notebook layer writes itself (a notebook that trains nothing,
# or a run that failed before its trainer wrote one): it says nothing of a trainer.
NOTEBOOK_KIND = "notebook"


def another_trainers(record, kind: str | None) -> str | None:
    """The kind of ``record`` when a trainer other than ``kind``'s made it, else None
    (same kind, unknown kind, or the notebook layer's own record)."""
    there = record.get("kind") if isinstance(record, dict) else None
    if kind and isinstance(there, str) and there not in (kind, NOTEBOOK_KIND):
        return there
    return None


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
        "expect": None,
        "rows": {},
        "row_parts": {},
        "final_in_rows": [],
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
        os.chmod(tmp, _FILE_MODE)
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.errno and exc.filename is None:
            # A full disk inside torch.save or json.dump names no file: say which one
            # (the same errno keeps the type: OSError(ENOSPC, ...), PermissionError, ...)
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
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
# validation: one pydantic model per schema version; errors name file, field, value, allowed


# Metric values: Python and numpy numbers and bools (metrics code makes numpy scalars).
_NUMBERS = (int, float, np.number, np.bool_)

# The branch a nested value takes; these tags are dropped from a field's name in errors.
_TAGS = ("#", "{}", "[]")


def _tag(leaf: tuple):
    def tag(value: Any) -> str | None:
        if isinstance(value, leaf):
            return "#"
        if isinstance(value, dict):
            return "{}"
        return "[]" if isinstance(value, list | tuple) else None

    return tag


def _nested(name: str, leaf: tuple, allowed: str):
    return TypeAliasType(name, Annotated[
        Annotated[Any, Tag("#")] | Annotated[dict[StrictStr, name], Tag("{}")]
        | Annotated[list[name], Tag("[]")],
        Discriminator(_tag(leaf), custom_error_type="value", custom_error_message=allowed)])


_JSON_ALLOWED = "JSON values: str, number, bool, null, and lists/dicts (string keys) of those"
_METRIC_ALLOWED = "a number, null, or a dict/list of those"
Json = _nested("Json", (*_NUMBERS, str, type(None)), _JSON_ALLOWED)
Metric = _nested("Metric", (*_NUMBERS, type(None)), _METRIC_ALLOWED)
Name = Annotated[StrictStr, Field(min_length=1)]
Count = Annotated[StrictInt, Field(ge=0)]
Axis = Literal["epoch", "step"]
Timestamp = Annotated[StrictStr, AfterValidator(datetime.fromisoformat)]

# In memory, rows travel with the record under these keys (save_run writes them to the store).
ROW_KEYS = {"epoch": "trajectory", "step": "steps"}


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _EpochRow(_Model):
    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, Metric]
    epoch: StrictInt = Field(description="an int epoch")


class _StepRow(_Model):
    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, Metric]
    step: StrictInt = Field(description="an int step")


_ROWS = {"epoch": _EpochRow, "step": _StepRow}
_NAMES = "a list of metric names (non-empty strings)"


class _Expect(_Model):
    """The completeness declaration (``lab.lifecycle.Expectation.as_dict``): every reader
    indexes it, so a hand-edited one is refused here, not as a KeyError there."""

    axis: Axis = Field(description=f"one of {', '.join(AXES)}")
    count: Count = Field(description="a row count: an int >= 0")
    stride: Annotated[StrictInt, Field(ge=1)] = Field(
        1, description="an int >= 1 (axis value per row)")
    metrics: list[Name] = Field([], description=_NAMES)
    periodic: list[tuple[Name, Annotated[StrictInt, Field(ge=1)], StrictInt]] = Field(
        [], description="a list of [metric name, every (an int >= 1), offset (an int)] entries")
    final: list[Name] = Field([], description=_NAMES)
    undefined: list[Name] = Field([], description=_NAMES)


_Sha256 = Annotated[StrictStr, Field(pattern=r"^[0-9a-f]{64}$")]


def _tiled(entries: list) -> list:
    position = 0
    for start, end, _ in entries:
        if start != position or end <= start:
            raise ValueError(f"part [{start}, {end}) does not start at {position} (the "
                             "previous part's end) with end > start")
        position = end
    return entries


class _Record1(_Model):
    """Version 1: the rows inside the record."""

    model_config = ConfigDict(extra="allow")  # fields added by later code are kept, unchecked
    schema_version: StrictInt
    run_id: Name = Field(description="a non-empty string")
    kind: Name = Field(description="a non-empty string")
    status: Literal[STATUSES] = Field(description=f"one of {', '.join(STATUSES)}")
    config: dict[StrictStr, Json] = Field(description="a dict (asdict(config))")
    environment: dict[StrictStr, Json] = Field(description="a dict (lab.records.environment())")
    final: dict[StrictStr, Metric] = Field(description="a dict of final metrics")
    work: dict[StrictStr, Metric] = Field(description="a dict (the compute bill, may be empty)")
    error: StrictStr | None = Field(description="a string or null")
    created: Timestamp = Field(description="an ISO-8601 timestamp string")
    updated: Timestamp = Field(description="an ISO-8601 timestamp string")
    data: dict[StrictStr, Json] = Field({}, description="a dict (what identifies the data)")
    notebook_params: dict[StrictStr, Json] = Field(
        {}, description="a dict of the notebook's own parameters, or absent")
    trajectory: list[_EpochRow] = Field(description="a list of per-epoch dicts")
    steps: list[_StepRow] = Field(description="a list of per-step dicts (may be empty)")


class _Record2(_Record1):
    """Version 2: a row store outside the record, with counts and a declaration."""

    trajectory: list[_EpochRow] = Field([], description="a list of per-epoch dicts")
    steps: list[_StepRow] = Field([], description="a list of per-step dicts (may be empty)")
    expect: _Expect | None = Field(description="a dict (lab.lifecycle.Expectation) or null")
    rows: dict[Axis, Count] = Field(
        description=f"a dict {{axis: row count >= 0}} with axes from {', '.join(AXES)}")


class _Record3(_Record2):
    """Version 3: every committed row part verifiable by its sha256."""

    row_parts: dict[Axis, Annotated[list[tuple[Count, Count, _Sha256]],
                                    AfterValidator(_tiled)]] = Field(
        description="a dict {axis: [[start, end, sha256], ...]}: parts tiling the rows from "
                    "0, each end > start, sha256 as 64 lowercase hex digits")
    final_in_rows: list[Name] = Field(description=_NAMES)


_VERSIONS = dict(zip(READABLE_VERSIONS, (_Record1, _Record2, _Record3), strict=True))


def _describe(value: Any) -> str:
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{text} ({type(value).__name__})"


def _fail(path, field: str, found: str, allowed: str):
    raise RecordError(
        f"{path}: field '{field}' is {found}; allowed: {allowed}", path=path, field=field
    )


def _name(prefix: str, loc: tuple) -> str:
    for key in loc:
        prefix += f"[{key}]" if isinstance(key, int) else f".{key}" if prefix else key
    return prefix or "<root>"


def _raise_first(err: ValidationError, model: type[BaseModel], path, prefix: str = ""):
    """The first error pydantic found, as a RecordError: the field, the value, and the
    field's description as what is allowed (inside the declaration, the declaration's
    field is named and the place in it goes with the value)."""
    error = err.errors(include_url=False)[0]
    loc = tuple(key for key in error["loc"] if key not in _TAGS and key != "[key]")
    found = "missing" if error["type"] == "missing" else _describe(error["input"])
    if error["loc"][-1:] == ("[key]",):
        found = f"a dict with key {found}"
    field = model.model_fields.get(loc[0]) if loc else None
    allowed = field.description if field else "a value of the schema"
    if issubclass(model, _Record1) and loc[:1] == ("expect",) and len(loc) > 1:
        if error["type"] == "extra_forbidden":  # the one section that refuses unknown keys
            _fail(path, _name(prefix, loc), "not a field of expect", f"the fields "
                  f"{', '.join(_Expect.model_fields)} (lab.lifecycle.Expectation)")
        allowed = _Expect.model_fields[loc[1]].description
        if len(loc) > 2:
            found += f" at {_name('', loc[2:])}"
        loc = loc[:2]
    if error["type"] == "value":  # a nested value of the wrong type: the message says
        allowed = error["msg"]
    elif error["type"] == "value_error":
        allowed += f" ({error['msg'].removeprefix('Value error, ')})"
    _fail(path, _name(prefix, loc), found, allowed)


def check_row(row: Any, axis_key: str, where: str, path="<memory>") -> None:
    """One row: a dict with an int axis value and metric values (see the module docstring)."""
    try:
        _ROWS[axis_key].model_validate(row)
    except ValidationError as err:
        if not isinstance(row, dict):
            _fail(path, where, _describe(row), f"a dict with an int '{axis_key}'")
        _raise_first(err, _ROWS[axis_key], path, where)


def _check_order(index: int, position: int, previous: int | None, axis_key: str, where: str,
                 path) -> None:
    if axis_key == "epoch" and index != position:
        # Epochs double as positions: a gap means a lost epoch, not a sparse log.
        _fail(path, f"{where}.epoch", f"{index} at position {position}",
              f"consecutive epochs 0, 1, 2, ... (expected {position})")
    if axis_key == "step" and previous is not None and index <= previous:
        _fail(path, f"{where}.step", f"{index} after step {previous}", "strictly increasing steps")


def validate_record(record: dict, path="<memory>") -> dict:
    """Return ``record`` unchanged if it follows the schema, else raise RecordError."""
    if not isinstance(record, dict):
        _fail(path, "<root>", _describe(record), "a JSON object (dict) holding one run record")
    version = record.get("schema_version")
    model = _VERSIONS.get(version) if type(version) is int else None
    if model is None:
        _fail(path, "schema_version", "missing" if version is None else _describe(version),
              f"one of {READABLE_VERSIONS} (this lab writes version {SCHEMA_VERSION})")
    try:
        model.model_validate(record)
    except ValidationError as err:
        _raise_first(err, model, path)
    for axis, key in ROW_KEYS.items():
        previous = None
        for i, row in enumerate(record.get(key, [])):
            _check_order(row[axis], i, previous, axis, f"{key}[{i}]", path)
            previous = row[axis]
    return record


# ---------------------------------------------------------------------------
# the append-only row store


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_FILE_MODE = 0o666 & ~_umask()  # mkstemp makes 0600; run files follow the user's umask


def _parts_dir(run_dir: Path, axis: str) -> Path:
    return Path(run_dir) / ROWS_DIR / axis


def _parts(run_dir: Path, axis: str) -> list[tuple[int, int, Path]]:
    """(start, end, path) of every well-named part file of ``axis``, sorted."""
    found = []
    directory = _parts_dir(run_dir, axis)
    if not directory.is_dir():
        return found
    for path in directory.glob(f"*{PART_SUFFIX}"):
        start, _, end = path.name[: -len(PART_SUFFIX)].partition("-")
        if start.isdigit() and end.isdigit() and int(end) > int(start):
            found.append((int(start), int(end), path))
    return sorted(found)


def _chain(run_dir: Path, axis: str, count: int, path) -> list[tuple[int, int, Path]]:
    """The parts that hold rows [0, count): from each position, the longest part that fits."""
    parts, chain, position = _parts(run_dir, axis), [], 0
    while position < count:
        fitting = [p for p in parts if p[0] == position and p[1] <= count]
        if not fitting:
            # The gap, not every part's name (a long run has hundreds of parts).
            later = [p[0] for p in parts if p[0] > position]
            held = f"the next part starts at row {min(later)}" if later else "no later part"
            _fail(path, f"rows.{axis}", f"{count}, but no part holds rows from {position} "
                  f"({len(parts)} parts in {_parts_dir(run_dir, axis)}; {held})",
                  "a row store holding every counted row (restore the parts, or replace "
                  "the run: the same command with --force)")
        chain.append(max(fitting, key=lambda p: p[1]))
        position = chain[-1][1]
    return chain


def _committed(run_dir: Path, axis: str, count: int, entries: list | None,
               path) -> list[tuple[int, int, Path, str | None]]:
    """(start, end, file, sha256) of the parts holding rows [0, count): those ``entries``
    (the record's ``row_parts[axis]``) name, entries beyond the count ignored as parts
    beyond it are; without entries (a version 2 record), the chain of part files found,
    with no hash to check."""
    if entries is None:
        return [(*part, None) for part in _chain(run_dir, axis, count, path)]
    chain = [(start, end, part_path(run_dir, axis, start, end), sha)
             for start, end, sha in entries if end <= count]
    for start, end, part, _ in chain:
        if not part.is_file():
            _fail(path, f"rows.{axis}", f"{count}, but {part} (rows {start} to {end}, "
                  "committed) is missing", "a row store holding every counted row (restore "
                  "the part, or replace the run: the same command with --force)")
    reached = chain[-1][1] if chain else 0
    if reached != count:
        past = " and past it" if len(chain) < len(entries) else ""
        _fail(path, f"rows.{axis}", f"{count}, but row_parts.{axis} commits parts up to row "
              f"{reached}{past}",
              "a count at the end of a committed part (edited? restore record.json, or "
              "replace the run: the same command with --force)")
    return chain


def part_path(run_dir, axis: str, start: int, end: int) -> Path:
    """The file holding rows [start, end) of ``axis``."""
    return _parts_dir(Path(run_dir), axis) / f"{start:09d}-{end:09d}{PART_SUFFIX}"


def write_part(run_dir, axis: str, rows: list[dict], start: int) -> list:
    """Write rows [start, start + len(rows)) of ``axis`` as one new part, atomically;
    return its ``row_parts`` entry ``[start, end, sha256]``.

    A part is strict JSON, one row per line (non-finite floats encoded as in
    record.json), so rows read back exactly as they were logged. Only the new part is
    hashed, so a save costs in proportion to the rows it adds.
    """
    if axis not in AXES:
        raise ValueError(f"axis={axis!r} is not allowed; choose one of: {', '.join(AXES)}")
    for i, row in enumerate(rows):
        check_row(row, axis, f"{ROW_KEYS[axis]}[{start + i}]")
    lines = [json.dumps(encode_nonfinite(row), allow_nan=False) for row in rows]
    data = ("\n".join(lines) + "\n").encode("utf-8")

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())

    end = start + len(rows)
    atomic_write(part_path(run_dir, axis, start, end), write)
    return [start, end, hashlib.sha256(data).hexdigest()]


def part_entries(run_dir, axis: str, count: int) -> list:
    """``row_parts`` entries for the parts now holding rows [0, count) of ``axis`` (a store
    written before parts were hashed, adopted as it is: read it first to trust it)."""
    chain = _chain(Path(run_dir), axis, count, Path(run_dir) / RECORD_FILE)
    return [[start, end, hashlib.sha256(path.read_bytes()).hexdigest()]
            for start, end, path in chain]


def truncate_rows(run_dir, axis: str, count: int, parts: list | None = None) -> None:
    """Remove every part that is not in the chain holding rows [0, count): the parts
    ``parts`` (``row_parts`` entries) name, else the longest that fit."""
    keep = {p[2] for p in _committed(Path(run_dir), axis, count, parts,
                                     Path(run_dir) / RECORD_FILE)}
    for _, _, path in _parts(Path(run_dir), axis):
        if path not in keep:
            path.unlink(missing_ok=True)


def _fail_part(path: Path, found: str, expected: str):
    # A part is a file, not a field of the record: named by its own path.
    raise RecordError(f"{path}: the row part holds {found}; expected {expected}", path=path,
                      field=f"<part {path.name}>")


def _read_part(path: Path, start: int, end: int) -> tuple[list, bytes]:
    try:
        data = path.read_bytes()
        text = data.decode("utf-8")
        rows = [decode_nonfinite(json.loads(line)) for line in text.splitlines()]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        _fail_part(path, f"unreadable text ({err})", "a part written by "
                   "lab.records.write_part (restore it, or replace the run: --force)")
    if text and not text.endswith("\n"):  # cut short, as check_stored_rows (lab runs) finds
        _fail_part(path, f"{text.count(chr(10))} complete lines ({len(data)} bytes)",
                   f"{end - start} rows, as its name says (truncated? restore it, or replace "
                   "the run: --force)")
    if len(rows) != end - start:
        _fail_part(path, f"{len(rows)} rows", f"{end - start} rows, as its name says "
                   "(restore it, or replace the run: --force)")
    return rows, data


def _check_hash(path: Path, data: bytes, sha: str | None) -> None:
    """The part's bytes are the ones committed (an edit that stays valid JSON, a flipped
    byte, a part copied from another run)."""
    if sha is None:  # a version 2 record: nothing to compare with
        return
    found = hashlib.sha256(data).hexdigest()
    if found != sha:
        _fail_part(path, f"other bytes than were committed (sha256 {found[:16]}..., the "
                   f"record's row_parts says {sha[:16]}...)", "the part as written (edited or "
                   "damaged: restore it, or replace the run: the same command with --force)")


def read_rows(run_dir, axis: str, count: int, parts: list | None = None) -> list[dict]:
    """Rows [0, count) of ``axis``, validated, as the dicts that were logged.

    ``parts``: the record's ``row_parts[axis]`` (version 3): the files to read, each
    checked against its sha256; without it (version 2), the chain of part files found.
    A bad row is named by the part that holds it and its place on the axis
    (``rows/epoch/000000001-000000002.jsonl: field 'epoch[1].loss' ...``): the file to
    look at, not the record that counts the rows."""
    record_path = Path(run_dir) / RECORD_FILE
    rows, previous = [], None
    for start, end, path, sha in _committed(Path(run_dir), axis, count, parts, record_path):
        part, data = _read_part(path, start, end)
        for i, row in enumerate(part, start):
            where = f"{axis}[{i}]"
            check_row(row, axis, where, path)
            _check_order(row[axis], i, previous, axis, where, path)
            previous = row[axis]
        _check_hash(path, data, sha)
        rows += part
    return rows


def _check_final_in_rows(record: dict, last: dict | None, part: Path | None,
                         record_path) -> None:
    """The final metrics the lifecycle found equal to the last row's (``final_in_rows``)
    still are: an edit of either side that stays valid is caught."""
    names = record.get("final_in_rows") or []
    axis = main_axis(record)
    if not names or axis is None or last is None:
        return
    for name in names:
        final, row = record["final"].get(name), last.get(name)
        if name not in record["final"] or name not in last \
                or encode_nonfinite(final) != encode_nonfinite(row):
            _fail(record_path, f"final.{name}",
                  f"{final!r} but {part} holds {axis}[{last.get(axis)}].{name}={row!r}",
                  "the same value in both (the lifecycle wrote one quantity twice; one of "
                  "the two files was edited: restore it, or replace the run: the same command "
                  "with --force)")


def _row_parts(record: dict, axis: str) -> list | None:
    """The record's committed parts of ``axis``; None for a record older than version 3."""
    return record["row_parts"].get(axis, []) if "row_parts" in record else None


def _check_complete_counts(record: dict, record_path) -> None:
    """A run that says ``complete`` holds every row its ``expect`` declares. An edited record
    (status set to complete on a run killed half way, a row count lowered) read as complete
    everywhere but the report, and a sweep skipped it. (A final field missing is left to
    ``check_complete``, which lists it among a protocol's gaps.)"""
    expect = record.get("expect")
    if record["status"] != "complete" or not isinstance(expect, dict):
        return
    axis, count = expect.get("axis"), expect.get("count")
    have = record["rows"].get(axis, 0)
    if isinstance(count, int) and have != count:
        _fail(record_path, f"rows.{axis}", f"{have} for a complete run",
              f"{count}, the rows its expect declares (edited? restore it, or replace the "
              "run: --force)")


def check_stored_rows(run_dir) -> None:
    """Every counted row of each axis is in the run's row store, as it was committed.

    The cheap check ``lab runs`` makes of every run it lists (``read_rows`` parses every
    row; a sweep's listing should not): each part of the chain that holds rows [0, count)
    ends with a newline, has one line per row it names and (version 3) the sha256 the
    record committed; the last row's values the final metrics repeat (``final_in_rows``)
    equal them. A truncated, emptied or edited part (a disk that filled, a copy cut short,
    a flipped byte, a hand edit) is a RecordError naming it, as ``load_metrics`` would give.
    """
    run_dir = Path(run_dir)
    record_path = run_dir / RECORD_FILE
    record = _read_record(record_path)
    if record["schema_version"] == 1:  # rows inside the record: read with it
        return
    _check_complete_counts(record, record_path)
    for axis, count in record["rows"].items():
        chain = _committed(run_dir, axis, count, _row_parts(record, axis), record_path)
        for start, end, path, sha in chain:
            try:
                data = path.read_bytes()
            except OSError as err:
                _fail_part(path, f"unreadable text ({err})", "a part written by "
                           "lab.records.write_part (restore it, or replace the run: --force)")
            lines = data.count(b"\n")
            if lines != end - start or not data.endswith(b"\n"):
                _fail_part(path, f"{lines} complete lines ({len(data)} bytes)",
                           f"{end - start} rows, as its name says (truncated? restore it, "
                           "or replace the run: --force)")
            if sha is None:  # version 2: no hash, but its text must at least be text
                try:
                    data.decode("utf-8")
                except UnicodeDecodeError as err:
                    _fail_part(path, f"unreadable text ({err})", "a part written by "
                               "lab.records.write_part (restore it, or replace the run: "
                               "--force)")
            _check_hash(path, data, sha)
        if chain and axis == main_axis(record) and record.get("final_in_rows"):
            last = data.rstrip(b"\n").rsplit(b"\n", 1)[-1]
            _check_final_in_rows(record, decode_nonfinite(json.loads(last)), chain[-1][2],
                                 record_path)


# ---------------------------------------------------------------------------
# saving and loading runs


_ONE_RUN = f"a run directory or a {RECORD_FILE} path"
_RUNS = f"a run directory, a directory of runs or a {RECORD_FILE} path"


def _check_path_arg(value: Any, function: str, parameter: str, what: str) -> None:
    """A str or os.PathLike naming a path: pathlib's own error for a list or an int
    ("expected str, bytes or os.PathLike object") names neither function nor parameter,
    and "" would quietly mean the current directory."""
    if isinstance(value, os.PathLike) or (isinstance(value, str) and value.strip()):
        return
    shown = repr(value) if len(repr(value)) <= 80 else f"{repr(value)[:77]}..."
    error = ValueError if isinstance(value, str) else TypeError
    raise error(f"{function}: {parameter} must be {what} (a str or os.PathLike), got "
                f"{shown} ({type(value).__name__})"
                + ("; '.' names the current directory" if isinstance(value, str) else ""))


def check_flag(value: Any, function: str, parameter: str) -> bool:
    """``value`` as a bool when it is one (numpy's included); anything else is a TypeError
    naming ``function``, ``parameter`` and the value. Truthiness would read "no" or
    "False" (non-empty strings) as True and quietly do the opposite of what was asked."""
    if isinstance(value, bool | np.bool_):
        return bool(value)
    shown = repr(value) if len(repr(value)) <= 80 else f"{repr(value)[:77]}..."
    raise TypeError(f"{function}: {parameter} must be a bool, got {shown} "
                    f"({type(value).__name__}); give True or False")


def _record_path(run_dir_or_record_json) -> Path:
    path = Path(run_dir_or_record_json)
    return path if path.suffix == ".json" else path / RECORD_FILE


def save_run(run_dir, record) -> Path:
    """Validate and write a whole record; return record.json's path.

    Rows carried in memory (``trajectory``: epoch rows, ``steps``: step rows)
    replace that axis's store (one part, then the record, then the stale parts
    go); without them the store is left as it is and only record.json is
    written. The append path is :func:`append_rows` (what the run lifecycle
    uses). ``updated`` is refreshed; ``created`` is kept as given. An older record's
    parts are hashed into ``row_parts`` as they are now (one whose store is broken
    keeps its version, so readers still say what is missing).
    """
    run_dir = Path(run_dir)
    path = run_dir / RECORD_FILE
    validate_record(record, path)
    record["updated"] = _now()
    record.setdefault("expect", None)
    counts = dict(record.get("rows", {}))
    run_dir.mkdir(parents=True, exist_ok=True)
    carried = {axis: record[key] for axis, key in ROW_KEYS.items() if key in record}
    parts = record.get("row_parts")
    if parts is None:
        try:
            parts = {axis: part_entries(run_dir, axis, count) for axis, count in counts.items()
                     if axis not in carried and count}
        except RecordError:
            parts = None
    for axis, rows in carried.items():
        entry = write_part(run_dir, axis, rows, 0) if rows else None
        if parts is not None:
            parts = {**parts, axis: [entry] if entry else []}
        counts[axis] = len(rows)
    record["rows"] = counts
    if parts is not None:
        record.update(schema_version=SCHEMA_VERSION, row_parts=parts,
                      final_in_rows=record.get("final_in_rows", []))
    else:
        record["schema_version"] = 2
    write_json_atomic(path, _stored(record))
    for axis in carried:
        truncate_rows(run_dir, axis, counts[axis], _row_parts(record, axis))
    return path


def _stored(record: dict) -> dict:
    """What record.json holds: the record without the rows it may carry in memory."""
    return {key: value for key, value in record.items() if key not in ROW_KEYS.values()}


def append_rows(run_dir, record: dict, axis: str, rows: list[dict]) -> None:
    """Add ``rows`` after the record's committed rows of ``axis``, then save the record.

    Costs in proportion to ``rows``: one new part and the (small) record.
    """
    run_dir = Path(run_dir)
    start = record["rows"].get(axis, 0)
    if rows:
        entry = write_part(run_dir, axis, rows, start)
        if "row_parts" in record:
            record["row_parts"] = {**record["row_parts"],
                                   axis: [*record["row_parts"].get(axis, []), entry]}
    record["rows"] = {**record["rows"], axis: start + len(rows)}
    write_record(run_dir, record)


def write_record(run_dir, record: dict) -> Path:
    """Validate and write record.json alone (the store is not touched)."""
    path = Path(run_dir) / RECORD_FILE
    stored = _stored(record)
    validate_record(stored, path)
    stored["updated"] = record["updated"] = _now()
    write_json_atomic(path, stored)
    return path


def _read_record(path: Path) -> dict:
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
    validate_record(record, path)
    if record["schema_version"] == 1:
        # Read as version 2 in memory: counts from the rows it carries, no declaration.
        record["rows"] = {axis: len(record[key]) for axis, key in ROW_KEYS.items()
                          if record[key]}
        record["expect"] = None
    return record


def load_record(run_dir_or_record_json, *, rows: bool = True) -> dict:
    """Read and validate one record; any problem is a RecordError naming the file.

    With ``rows`` the rows come along under ``trajectory`` (epoch) and ``steps``
    (step), as lists of dicts. ``rows`` is True or False (``rows="no"`` is a TypeError,
    not a truthy "yes").
    """
    _check_path_arg(run_dir_or_record_json, "load_record", "run_dir_or_record_json", _ONE_RUN)
    rows = check_flag(rows, "load_record", "rows")
    path = _record_path(run_dir_or_record_json)
    record = _read_record(path)
    if rows and record["schema_version"] != 1:
        for axis, count in record["rows"].items():
            record[ROW_KEYS[axis]] = read_rows(path.parent, axis, count,
                                               _row_parts(record, axis))
        _check_final_against(record, path)
    return record


def _check_final_against(record: dict, record_path: Path) -> None:
    """``final_in_rows`` of a record read with its rows."""
    axis = main_axis(record)
    rows = record.get(ROW_KEYS[axis], []) if axis else []
    if rows and record.get("final_in_rows"):
        last = _committed(record_path.parent, axis, len(rows), _row_parts(record, axis),
                          record_path)[-1][2]
        _check_final_in_rows(record, rows[-1], last, record_path)


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
            if isinstance(leaf, _NUMBERS):
                yield name, float(leaf)


def _tidy_frame(rows: list[tuple]) -> pd.DataFrame:
    import pandas as pd  # (here: the run lifecycle writes records without pandas)

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
    """One row per (run_id, axis, index, metric) of an in-memory record.

    Axis is "epoch", "step" or "final" (index -1); rows come from the record's
    ``trajectory`` / ``steps`` lists (see :func:`load_record`).
    """
    if not isinstance(record, dict) or not isinstance(record.get("run_id"), str):
        raise TypeError(f"tidy_metrics: record must be a run record (a dict with a run_id, "
                        f"as load_record returns), got {_describe(record)}")
    run_id = record["run_id"]
    rows = []
    for axis, key in ROW_KEYS.items():
        for row in record.get(key, []):
            rows += [(run_id, axis, row[axis], m, v) for m, v in _numeric_leaves(row, axis)]
    rows += [(run_id, "final", -1, m, v) for m, v in _numeric_leaves(record.get("final", {}))]
    return _tidy_frame(rows)


def find_records(root) -> list[Path]:
    """Every record.json under the directory ``root`` (its own included), sorted.

    A symlinked directory that is a run, or a directory of runs (a record.json in it or
    in one of its directories), is followed, as the sweep and the report follow it (a
    run moved to another disk and linked back is still a run here; ``Path.glob("**")``
    follows no links on Python 3.11). Other links are not walked (a link to a dataset
    or to ``/`` would make a listing read the whole tree), and each directory is read
    once, so a link to a parent cannot loop.
    """
    found, seen = [], set()

    def holds_runs(link: str) -> bool:
        if os.path.isfile(os.path.join(link, RECORD_FILE)):
            return True
        try:
            with os.scandir(link) as entries:
                return any(e.is_dir() and os.path.isfile(os.path.join(e.path, RECORD_FILE))
                           for e in entries)
        except OSError:
            return False

    def walk(top: str) -> None:
        for here, dirs, files in os.walk(top):
            try:
                st = os.stat(here)
            except OSError:
                dirs[:] = []
                continue
            if (st.st_dev, st.st_ino) in seen:
                dirs[:] = []
                continue
            seen.add((st.st_dev, st.st_ino))
            dirs.sort()
            if RECORD_FILE in files:
                found.append(Path(here) / RECORD_FILE)
            for name in dirs:  # os.walk lists a link to a directory but does not enter it
                link = os.path.join(here, name)
                if os.path.islink(link) and holds_runs(link):
                    walk(link)

    walk(os.fspath(root))
    return sorted(found)


def _record_paths(root, include_old: bool = False) -> list[Path]:
    root = Path(root)
    if root.is_file() and root.name == RECORD_FILE:  # one run's record, as `lab runs` takes
        return [root]
    if not root.is_dir():
        what = "a file, not a directory" if root.exists() else "no such directory"
        raise FileNotFoundError(f"{root}: {what}; give a directory of runs or a run's "
                                f"{RECORD_FILE}")
    paths = find_records(root)
    if include_old:
        return paths
    # A run moved aside by --force (<run>.old-<time>) keeps its run_id: counted with
    # the run that replaced it, a groupby on run_id would average two different runs.
    return [p for p in paths if not any(MOVED_ASIDE.search(part)
                                        for part in p.relative_to(root).parts[:-1])]


def _old_run_id(path: Path) -> dict:
    """{"run_id": <its directory's name>} for a run moved aside by --force (it keeps the
    run_id of the run that replaced it), whether it is read alone or below a root; else {}."""
    name = Path(path).parent.name
    return {"run_id": name} if MOVED_ASIDE.search(name) else {}


def _distinct_run_ids(root, ids: list[tuple[Path, str]], caller: str) -> dict[Path, str]:
    """Replacement run ids for runs under ``root`` that share one (two protocols' outs,
    each with its ``rule-bp_seed-0``; two ``lab run --out`` runs named alike in different
    folders): each becomes its directory's path below ``root``, so a groupby on run_id
    never averages different runs, with a warning naming them. ``ids``: (record path,
    run_id) pairs; returns {record path: new run_id} for those that change."""
    seen = Counter(run_id for _, run_id in ids)
    shared = {run_id for run_id, count in seen.items() if count > 1}
    if not shared:
        return {}
    new = {path: Path(path).parent.relative_to(root).as_posix()
           for path, run_id in ids if run_id in shared}
    warnings.warn(f"{caller}: {len(new)} runs under {root} share a run_id "
                  f"({', '.join(sorted(map(repr, shared)))}); their run_id here is their "
                  f"directory below {root} ({', '.join(sorted(new.values())[:6])}"
                  f"{', ...' if len(new) > 6 else ''}), so they stay apart; load one "
                  "protocol's out to keep the recorded ids", stacklevel=3)
    return new


def _raise_collected(problems: list[tuple[Path, str]], what: str) -> None:
    # Each message already starts with its file's path.
    lines = "\n".join(f"  - {message}" for _, message in problems)
    raise RecordError(
        f"{len(problems)} {what} could not be read (fix or remove them; none were skipped):\n"
        f"{lines}",
        path=problems[0][0],
        problems=problems,
    )


def config_columns(config: dict) -> dict:
    """A config as load_runs' ``config.*`` columns (nested dicts joined with "/")."""
    columns = {}
    for key, value in config.items():
        if isinstance(value, dict):
            for name, leaf in _leaves(key, value):
                columns[f"config.{name}"] = leaf
        else:
            # Lists stay one column, as tuples, so a researcher can group by them.
            columns[f"config.{key}"] = tuple(value) if isinstance(value, list) else value
    return columns


def main_axis(record: dict) -> str | None:
    """The axis a run's rows are declared on (else the one holding rows; None if none)."""
    if record.get("expect"):
        return record["expect"]["axis"]
    counts = record.get("rows", {})
    return next((axis for axis in AXES if counts.get(axis)), None)


def run_params(record: dict) -> dict:
    """What a run was asked: its config, and the parameters its notebook declares beyond
    the config class (``notebook_params``, when the run was made by a notebook that has
    any), in one mapping (config fields win a name clash, which resolving refuses)."""
    return {**record.get("notebook_params", {}), **record["config"]}


def _run_row(record: dict, path: Path) -> dict:
    axis = main_axis(record)
    row = {
        "run_id": record["run_id"],
        "path": str(path.parent),
        "kind": record["kind"],
        "status": record["status"],
        "axis": axis,
        "n_rows": record["rows"].get(axis, 0) if axis else 0,
        "n_epochs": record["rows"].get("epoch", 0),
        "error": record["error"],
        "expect": record["expect"],
    }
    row.update(config_columns(run_params(record)))
    row.update({f"final.{name}": leaf for name, leaf in _numeric_leaves(record["final"])})
    # A final that is None by design (CfC's lift_step when the lift never fired) is a NaN
    # column, so it exists even when no run has a number there.
    for key, value in record["final"].items():
        for name, leaf in _leaves(key, value):
            if leaf is None:
                row.setdefault(f"final.{name}", math.nan)
    return row


def load_runs(root, include_old: bool = False) -> pd.DataFrame:
    """One row per run under ``root``: base columns, then config.* and final.* columns.

    Runs moved aside by ``--force`` (``<run>.old-<time>``, same run_id as the run
    that replaced them) are left out unless ``include_old`` (or ``root`` is one); then
    their run_id is their directory's name, so the two runs stay apart.

    ``status`` is the live one, as ``lab runs`` shows it: record.json says "running" for
    a run in progress and for one whose process was killed; the run's lock tells them
    apart, so a killed run reads "interrupted".

    A run that is not live has its row store checked (:func:`check_stored_rows`: line
    counts, the parts' sha256, the final metrics that repeat the last row): parts cut
    short, damaged or edited make it unreadable, as ``load_metrics`` and ``lab runs`` find
    it, never a "complete" run without all its rows as they were written.

    ``path`` is the run directory, ``axis`` / ``n_rows`` its main axis and row
    count, ``expect`` its completeness declaration (dict, or None for records
    that declare none). Nested config dicts and final metrics are flattened
    with "/" (final names match tidy_metrics' metric names); a final that is None
    is a NaN column. Any unreadable
    record raises one RecordError listing every bad path. A ``root`` that is not a
    path (a list, an int, None), or an ``include_old`` that is not a bool, is a
    TypeError naming it.
    """
    import pandas as pd  # (here: the run lifecycle writes records without pandas)

    _check_path_arg(root, "load_runs", "root", _RUNS)
    include_old = check_flag(include_old, "load_runs", "include_old")
    rows, problems = [], []
    for path in _record_paths(root, include_old):
        try:
            row = _run_row(load_record(path, rows=False), path) | _old_run_id(path)
            row["status"] = live_status(row["status"], row["path"])
            if row["status"] != "running":  # a live run may be replacing its parts
                check_stored_rows(row["path"])  # a row store cut short or edited: not complete
            rows.append(row)
        except RecordError as err:
            problems.append((path, str(err)))
    if problems:
        _raise_collected(problems, "run records")
    if not rows:  # the dtypes a table with runs has (a concat with it keeps its ints)
        return pd.DataFrame({c: pd.Series(dtype=_EMPTY_RUN_DTYPES.get(c, str))
                             for c in RUN_COLUMNS})
    apart = _distinct_run_ids(root, [(Path(row["path"]) / RECORD_FILE, row["run_id"])
                                     for row in rows], "load_runs")
    for row in rows:
        row["run_id"] = apart.get(Path(row["path"]) / RECORD_FILE, row["run_id"])
    frame = pd.DataFrame(rows)
    extra = sorted(c for c in frame.columns if c.startswith("config.")) + sorted(
        c for c in frame.columns if c.startswith("final.")
    )
    for column in ("n_rows", "n_epochs"):
        frame[column] = frame[column].astype("int64")
    return frame[list(RUN_COLUMNS) + extra]


def live_status(status: str, run_dir) -> str:
    """``status`` from record.json, but "interrupted" for a "running" run that no process
    holds (killed, or stopped by Ctrl-C before the record was saved)."""
    if status != "running":
        return status
    return "running" if runlock.holder(run_dir) is not None else "interrupted"


def _v1_metrics(record_path: Path, record: dict) -> pd.DataFrame:
    import pandas as pd  # (here: the run lifecycle writes records without pandas)

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
    return tidy_metrics(record)


def run_metrics(record_path) -> pd.DataFrame:
    """One run's tidy metrics (its row store and final metrics; version 1: its record)."""
    _check_path_arg(record_path, "run_metrics", "record_path", _ONE_RUN)
    record_path = _record_path(record_path)
    record = _read_record(record_path)
    if record["schema_version"] == 1:
        return _v1_metrics(record_path, record)
    _check_complete_counts(record, record_path)  # as every listing checks it
    for axis, count in record["rows"].items():
        record[ROW_KEYS[axis]] = read_rows(record_path.parent, axis, count,
                                           _row_parts(record, axis))
    _check_final_against(record, record_path)
    return tidy_metrics(record)


def load_metrics(root, include_old: bool = False) -> pd.DataFrame:
    """All runs' tidy metrics under ``root`` (row stores, or version 1 records); runs
    moved aside by ``--force`` are left out unless ``include_old`` (see load_runs).
    A ``root`` that is not a path (a list, an int, None), or an ``include_old`` that is
    not a bool, is a TypeError naming it."""
    import pandas as pd  # (here: the run lifecycle writes records without pandas)

    _check_path_arg(root, "load_metrics", "root", _RUNS)
    include_old = check_flag(include_old, "load_metrics", "include_old")
    frames, problems, ids = [], [], []
    for path in _record_paths(root, include_old):
        try:
            frame = run_metrics(path).assign(**_old_run_id(path))
        except RecordError as err:
            problems.append((path, str(err)))
            continue
        frames.append((path, frame))
        # A run without rows counts too: load_runs renames every run sharing an id, and a
        # merge of the two tables on run_id must find the same names (a twin that failed
        # before its first row left the other's curves under the old id, dropped there).
        ids.append((path, frame["run_id"].iat[0] if len(frame) else
                    _old_run_id(path).get("run_id") or _read_record(path)["run_id"]))
    if problems:
        _raise_collected(problems, "runs' metrics")
    apart = _distinct_run_ids(root, ids, "load_metrics")
    frames = [frame.assign(run_id=apart[path]) if path in apart else frame
              for path, frame in frames if len(frame)]
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
    top-level "created", "updated", "environment" and "row_parts" (the parts' hashes
    cover their rows' timings, and their bounds the checkpoint cadence).
    """
    stripped = _strip_timings(obj)
    if isinstance(stripped, dict):
        for key in ("created", "updated", "environment", "row_parts"):
            stripped.pop(key, None)
    return stripped
