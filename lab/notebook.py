"""Notebooks as runs: record values from inside a kernel, execute with papermill (DESIGN 8).

Inside a notebook, :func:`record_value` emits a display output carrying the
custom mimetype ``application/vnd.lab.record+json`` with ``{name: value}``;
:func:`read_values` reads those back from an executed notebook (and
:func:`execute` mirrors them into the notebook's ``metadata.lab.values``).
Only JSON values are recorded; non-finite floats travel as the strings
"NaN"/"Infinity"/"-Infinity", as in run records.

:func:`execute` runs one notebook with papermill into a run directory::

    <out_dir>/notebook.ipynb   the executed notebook (metadata.lab: run_id,
                               params, status, error, values)
    <out_dir>/record.json      written by the notebook (e.g. train_conv), or a
                               minimal one made here (kind "notebook"): the
                               single source of the run's status

Parameters are checked before anything runs or is created: names the notebook
does not declare are refused, and a notebook that names its config class in
its metadata (``"lab_config": "lab.train.configs:ConvConfig"``) has the resolved
parameters (its defaults, then the given values; a dotted key such as
``rule_params.scale`` sets one key inside a dict parameter) built into that
class, so a bad value is refused with the class's message. The notebook's own
parameters (beyond its config class) are type-checked by the builtin the cell
annotates (``smooth: int = 3``), else by their default's type when it is an
int, float, str or bool (:func:`check_own_types`). The run directory
is then decided from its record.json: a finished run of the same resolved
config is left alone, one of another config is refused unless replaced (moved
aside, never deleted), and a directory another process holds is skipped. The
notebook's code is part of a run's identity (:class:`CodeIdentity`, the record's
``code``): a run made with other code is refused the same way. The
executing process holds the run's lock (``lab.runlock``) and the kernel dies
with it (Linux: ``PR_SET_PDEATHSIG``), so no orphaned kernel writes into a run
that a restarted sweep has started again. A failing cell leaves the run
``failed`` with the error, naming the cell by its position in the source
notebook, and the executed notebook with the traceback. The kernel is
``python3`` and must be this interpreter (:func:`ensure_kernel`), so runs see
the same installed ``lab``.
As with papermill, the kernel starts in the caller's working directory
(Jupyter and nbval start it in the notebook's): relative paths given as
parameters are relative to where ``lab run``/``lab sweep`` was started.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import dataclasses
import functools
import hashlib
import importlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import records, runlock
from .config import ConfigError, as_dict, field_names, from_dict, identity, with_legacy_params

if TYPE_CHECKING:  # imported where used: kernels import this module for record_value
    import nbformat

RECORD_MIME = "application/vnd.lab.record+json"
OUTPUT_NOTEBOOK = "notebook.ipynb"
KERNEL = "python3"
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS")
CONFIG_KEY = "lab_config"  # notebook metadata: "module:Class" its parameters build
RESERVED = ("out_dir",)  # parameters set by execute, never given
# The kernel's own INFO/WARNING/ERROR chatter (e.g. "running over TCP without
# encryption" for a kernel on localhost) would drown a sweep's log.
KERNEL_ARGS = ["--IPKernelApp.log_level=CRITICAL"]


class NotebookError(ValueError):
    """A notebook that cannot be run: missing, unreadable, or no usable kernel."""


class ParameterError(ConfigError):
    """A parameter the notebook's ``parameters`` cell does not declare."""


# ---------------------------------------------------------------------------
# recording values inside a kernel


def _plain(value: Any, name: str) -> Any:
    """JSON-ready copy of ``value`` (numpy scalars/arrays -> Python), or a clear error."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()  # numpy scalars and arrays, torch tensors
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, Mapping):
        return {str(key): _plain(item, f"{name}.{key}") for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item, f"{name}[{i}]") for i, item in enumerate(value)]
    raise TypeError(f"record_value: {name} is {type(value).__name__} ({value!r:.60}); "
                    "allowed: numbers, strings, bools, None, and lists/dicts of those")


def record_value(name: str, value: Any) -> None:
    """Record ``value`` under ``name`` in the executing notebook.

    Outside a kernel it only prints ``name = value``. Returns None, so a
    cell ending in a record shows the value once.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"record_value: name must be a non-empty string, got {name!r}")
    plain = _plain(value, name)
    payload = {name: records.encode_nonfinite(plain)}  # NaN-safe, as in records
    text = f"{name} = {plain!r}"
    try:
        from IPython import get_ipython
    except ImportError:  # plain Python without IPython
        get_ipython = None
    if get_ipython is None or get_ipython() is None:
        print(text)
        return
    from IPython.display import display

    display({RECORD_MIME: payload, "text/plain": text}, raw=True)


def _outputs_values(nb) -> dict:
    values: dict = {}
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if RECORD_MIME in data:
                values.update(data[RECORD_MIME])  # later records win, as in the kernel
    return values


def read_values(executed_notebook) -> dict:
    """Values recorded with :func:`record_value` in an executed notebook.

    Read from the outputs; a notebook whose outputs were stripped still has
    them in ``metadata.lab.values`` once :func:`execute` finished it.
    """
    nb = _read(executed_notebook)
    values = _outputs_values(nb) or nb.metadata.get("lab", {}).get("values", {})
    return records.decode_nonfinite(dict(values))


def config_from(cls, namespace: Mapping):
    """``cls`` built from the names in ``namespace`` (a notebook's ``globals()``)
    that are its fields: the parameters cell declares them with the same names."""
    missing = [name for name in field_names(cls) if name not in namespace]
    if missing:
        raise ParameterError(f"{cls.__name__} field(s) {', '.join(missing)} are not defined in "
                             "the notebook; declare every field in the parameters cell")
    return from_dict(cls, {name: namespace[name] for name in field_names(cls)})


# ---------------------------------------------------------------------------
# notebooks and their parameters


def _read(path) -> nbformat.NotebookNode:
    import nbformat

    path = Path(path)
    if path.is_dir():
        raise NotebookError(f"notebook {path} is a directory; give the notebook (.ipynb)")
    if not path.is_file():
        raise NotebookError(f"notebook {path} does not exist")
    try:
        return nbformat.read(path, as_version=4)
    except Exception as err:  # nbformat raises JSON, validation and reader errors
        raise NotebookError(f"notebook {path} cannot be read as a Jupyter notebook "
                            f"({type(err).__name__}: {err})") from None


def declared_parameters(notebook) -> dict[str, dict]:
    """name -> papermill's description (default source, inferred type) of the
    notebook's ``parameters`` cell, in declaration order."""
    import papermill

    _read(notebook)  # a clear error for a missing or broken file
    return dict(papermill.inspect_notebook(_for_papermill(notebook)))


def _for_papermill(path) -> str:
    """``path`` as papermill should be given it: papermill reads a path that starts
    with ``-`` as standard input (``./-nb.ipynb`` arrives as ``-nb.ipynb``), so such a
    relative path goes absolute."""
    text = str(path)
    return str(Path(path).absolute()) if text.startswith("-") else text


class Expression(str):
    """A parameters-cell default that is not a literal (``epochs = 1 + 1``): its source.

    lab reads defaults without running the notebook, so it cannot know the value; a run
    that would use one is refused (:func:`resolve_parameters`) instead of taking the
    source text for the value.
    """


def _literal_defaults(declared: Mapping[str, dict]) -> dict[str, Any]:
    defaults = {}
    for name, info in declared.items():
        try:
            defaults[name] = ast.literal_eval(info["default"])
        except (ValueError, SyntaxError):
            defaults[name] = Expression(info["default"])
    return defaults


def _refuse_expressions(notebook, merged: Mapping) -> None:
    computed = {k: v for k, v in merged.items() if isinstance(v, Expression)}
    if computed:
        shown = "; ".join(f"{k} = {v}" for k, v in computed.items())
        raise ParameterError(
            f"the parameters cell of {notebook} computes its default for {shown}; lab reads "
            "the defaults without running the notebook, so each must be a literal (a number, "
            "string, list, dict, True/False/None): write the value, or give the parameter "
            "with -p / in the protocol")


def notebook_defaults(notebook) -> dict[str, Any]:
    """The ``parameters`` cell's defaults as Python values (literals are evaluated)."""
    return _literal_defaults(declared_parameters(notebook))


def config_class(notebook, nb=None) -> type | None:
    """The config class named by the notebook's ``metadata["lab_config"]``
    (``"module:Class"``), or None when it names none."""
    nb = _read(notebook) if nb is None else nb
    name = nb.metadata.get(CONFIG_KEY)
    if name is None:
        return None
    module, _, attr = str(name).partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as err:
        raise NotebookError(
            f"notebook {notebook}: metadata {CONFIG_KEY}={name!r} does not name an importable "
            f"class ({type(err).__name__}: {err}); expected 'module:Class', e.g. "
            "'lab.train.configs:ConvConfig'") from None
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise NotebookError(f"notebook {notebook}: metadata {CONFIG_KEY}={name!r} is not a "
                            "config dataclass")
    return cls


# ---------------------------------------------------------------------------
# a notebook's code as part of a run's identity

CODE_KEY = "code"  # the record field: {"sha256": <hex>, "cells": [<16 hex a code cell>]}
# Cells whose source is not the notebook's code: its parameters (compared as parameters)
# and the ones papermill inserts into an executed copy.
_NOT_CODE = ("parameters", "injected-parameters", "papermill-error-cell-tag")


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class CodeIdentity:
    """A notebook's code cells as a run's identity: the parameters cell aside, outputs
    and metadata ignored, and each cell's source normalised (trailing whitespace of every
    line and blank lines dropped; indentation and spacing inside a line count, as Python
    reads them), so a whitespace-only edit is the same code.

    ``cells``: (position counted from 1 among every cell of the notebook, first line,
    digest) of each non-empty code cell, for naming the cell that changed.
    """

    sha256: str
    cells: tuple[tuple[int, str, str], ...]
    name: str = "the notebook"  # its file's name, in messages

    @classmethod
    def of(cls, nb, name: str = "the notebook") -> CodeIdentity:
        cells, texts = [], []
        for position, cell in enumerate(nb.cells, 1):
            if cell.cell_type != "code" or set(cell.metadata.get("tags", [])) & set(_NOT_CODE):
                continue
            lines = [line.rstrip() for line in cell.source.splitlines()]
            text = "\n".join(line for line in lines if line)
            if text:
                texts.append(text)
                cells.append((position, text.split("\n", 1)[0].strip(), _digest(text)[:16]))
        return cls(_digest("\n\0\n".join(texts)), tuple(cells), name)

    def as_record(self) -> dict:
        return {"sha256": self.sha256, "cells": [digest for _, _, digest in self.cells]}

    def changed_since(self, record: Mapping) -> str | None:
        """What changed in the notebook's code since ``record`` was made with it, or None
        when it is the same code or the record does not tell (a record from before the
        code was recorded: "code unknown", never called stale for that alone)."""
        then = record.get(CODE_KEY)
        if not isinstance(then, Mapping) or not isinstance(then.get("sha256"), str) \
                or then["sha256"] == self.sha256:
            return None
        old = set(then.get("cells") or [])
        changed = [f"cell {position} (`{first[:60]}`)" for position, first, digest
                   in self.cells if digest not in old]
        if changed:
            shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more"
                                              if len(changed) > 3 else "")
            return (f"{self.name}'s code changed since: {shown}, counting every cell from 1, "
                    f"{'is' if len(changed) == 1 else 'are'} not the code the run was made with")
        gone = len(old - {digest for _, _, digest in self.cells}) or "a"
        return f"{self.name}'s code changed since: {gone} code cell(s) of the run's were removed " \
               "or reordered"


def code_identity(notebook) -> CodeIdentity:
    """The :class:`CodeIdentity` of the notebook at ``notebook``."""
    return CodeIdentity.of(_read(notebook), Path(notebook).name)


@dataclass(frozen=True)
class NotebookSpec:
    """What a notebook accepts: its declared parameters, their defaults, its config class,
    and its code's identity."""

    path: Path
    declared: dict
    defaults: dict
    config_class: type | None
    code: CodeIdentity | None = None


def notebook_spec(notebook, *, with_class: bool = True) -> NotebookSpec:
    """Read ``notebook`` once for everything :func:`resolve_parameters` needs;
    ``with_class=False`` leaves its config class unimported (analyses: no torch)."""
    nb = _read(notebook)  # a clear error for a missing or broken file first
    declared = declared_parameters(notebook)
    cls = config_class(notebook, nb) if with_class else None
    return NotebookSpec(Path(notebook), declared, _literal_defaults(declared), cls,
                        CodeIdentity.of(nb, Path(notebook).name))


# How a notebook's own parameter is type-checked: a float accepts an int (1 for 1.0), and
# neither int nor float accepts a bool (True is an int to Python, not to a researcher).
_OWN_TYPES = {int: (int,), float: (int, float), str: (str,), bool: (bool,)}
_BY_NAME = {t.__name__: t for t in _OWN_TYPES}


def _own_type(info: Mapping, default: Any) -> type | None:
    """The type a notebook's own parameter must have: the builtin its parameters cell
    annotates, else its default's type; None (anything) for None/list/dict defaults."""
    annotated = _BY_NAME.get(str(info.get("inferred_type_name", "")).strip("'\""))
    if annotated is not None:
        return annotated
    return type(default) if type(default) in _OWN_TYPES else None


def check_own_types(notebook, values: Mapping, declared: Mapping, defaults: Mapping) -> None:
    """Raise ParameterError for a value of ``values`` (the notebook's own parameters,
    by name) whose type is not the one :func:`_own_type` gives it."""
    for name, value in values.items():
        want = _own_type(declared.get(name, {}), defaults.get(name))
        if want is None or isinstance(value, Expression):
            continue
        if isinstance(value, bool) and want is not bool or not isinstance(value, _OWN_TYPES[want]):
            raise ParameterError(f"{notebook} parameter {name} must be {want.__name__}, got "
                                 f"{value!r} ({type(value).__name__})")


# What `lab report` hands an analysis notebook: a notebook declaring both is one.
REPORT_PARAMETERS = ("protocol", "runs_dir")


def check_trains(spec: NotebookSpec) -> None:
    """NotebookError if ``spec``'s notebook is an analysis notebook (it declares
    ``REPORT_PARAMETERS`` and names no config class): executed as a run it would
    summarise its default protocol's runs and be recorded as a run of its own."""
    if spec.config_class is None and all(p in spec.declared for p in REPORT_PARAMETERS):
        raise NotebookError(
            f"{spec.path} is an analysis notebook (it takes {' and '.join(REPORT_PARAMETERS)} "
            "and trains nothing), not a run; execute it for a protocol with `lab report "
            f"<protocol.yaml> --notebook {spec.path}`")


def check_reports(spec: NotebookSpec) -> None:
    """NotebookError unless ``spec``'s notebook is an analysis notebook (it declares the
    ``protocol`` parameter `lab report` sets): a training notebook was found only after
    the reports directory had been locked and a kernel started."""
    declared = spec.declared
    if REPORT_PARAMETERS[0] not in declared:
        raise NotebookError(
            f"{spec.path} is not an analysis notebook: it does not declare the "
            f"{REPORT_PARAMETERS[0]!r} parameter `lab report` sets (it declares "
            f"{', '.join(list(declared)[:6])}{', ...' if len(declared) > 6 else ''}); give "
            "an analysis notebook (notebooks/1x-, 20-, 30-*.ipynb), or run a training notebook "
            "with `lab run`")


def trainer_kind(cls: type | None) -> str | None:
    """The record kind the trainer of config class ``cls`` writes (its ``KIND``:
    ``"conv"`` for ConvConfig); None when the class declares none."""
    kind = getattr(cls, "KIND", None)
    return kind if isinstance(kind, str) else None


def _root(key: str) -> str:
    return key.split(".", 1)[0]


def check_parameters(notebook, params: Mapping, declared=None) -> None:
    """Raise ParameterError naming every parameter ``notebook`` does not declare
    (a dotted key ``a.b`` needs ``a`` declared), or ``out_dir``, which is the run's."""
    declared = declared_parameters(notebook) if declared is None else declared
    unknown = [name for name in params if _root(name) not in declared]
    settable = [name for name in declared if name not in RESERVED]
    if unknown:
        listed = ", ".join(settable) if declared else \
            "(none: it has no cell tagged 'parameters')"
        raise ParameterError(f"notebook {notebook} does not declare parameter(s) "
                             f"{', '.join(map(repr, unknown))}; declared: {listed}")
    reserved = [name for name in params if _root(name) in RESERVED]
    if reserved:
        raise ParameterError(f"{reserved[0]}={params[reserved[0]]!r} was given as a parameter; "
                             "the run directory is set by --out (or the sweep), not by a "
                             "parameter")


def apply_params(base: Mapping, params: Mapping) -> dict:
    """``base`` updated with ``params`` (copies; neither is changed).

    Plain keys replace a value; then each dotted key ``a.b`` sets key ``b``
    inside the dict parameter ``a``, keeping its other keys.
    """
    out = copy.deepcopy(dict(base))
    for key, value in params.items():
        if "." not in key:
            out[key] = copy.deepcopy(value)
    for key in sorted(k for k in params if "." in k):
        root, *inner, leaf = key.split(".")
        target = out.setdefault(root, {})
        for depth, name in enumerate([root, *inner]):
            if depth:
                target = target.setdefault(name, {})
            if not isinstance(target, dict):
                where = ".".join([root, *inner][:depth + 1])
                raise ParameterError(
                    f"{key}={params[key]!r} sets a key inside {where}, but {where} is "
                    f"{target!r} ({type(target).__name__}), not a dict; a dotted key sets one "
                    "key inside a dict parameter such as rule_params")
        target[leaf] = copy.deepcopy(params[key])
    return out


def _as_stored(value: Any) -> Any:
    """``value`` as a record stores and reads it back (tuples become lists)."""
    return records.decode_nonfinite(json.loads(json.dumps(records.encode_nonfinite(value))))


@dataclass(frozen=True)
class Resolved:
    """A run's parameters with the notebook's defaults filled in."""

    params: dict  # what papermill injects: the keys given, dotted ones merged into their dict
    config: dict  # the run's resolved config, as its record stores it
    full: bool  # config holds every field (built by the notebook's config class)
    # The notebook's own parameters beyond its config class (defaults filled in), as the
    # trainer's record keeps them under "notebook_params": part of what the run was asked.
    extras: dict = field(default_factory=dict)
    kind: str | None = None  # the record kind its config class's trainer writes, if known
    code: CodeIdentity | None = None  # the notebook's code (None: not compared)

    def asked(self) -> dict:
        """Config and the notebook's own parameters: what ``records.run_params`` reads back."""
        return {**self.extras, **self.config}


def _check_declares_every_field(notebook, spec: NotebookSpec) -> None:
    """A parameters cell must declare every field of the notebook's config class: the
    kernel builds the config from the cell's names (``config_from``), so a missing one
    would fail there, after a kernel started and a failed run was left behind."""
    cls = spec.config_class
    if cls is None:
        return
    missing = [f for f in dataclasses.fields(cls) if f.name not in spec.declared]
    if missing:
        first = missing[0]
        default = (first.default if first.default is not dataclasses.MISSING
                   else first.default_factory() if first.default_factory is not dataclasses.MISSING
                   else None)
        raise ParameterError(
            f"notebook {notebook}: its parameters cell does not declare {cls.__name__} "
            f"field(s) {', '.join(f.name for f in missing)} (its config class, named in its "
            f"metadata 'lab_config'); the kernel builds the config from the cell's names, so "
            f"declare every field there, e.g. `{first.name} = {default!r}` (the default)")


def resolve_parameters(notebook, params: Mapping | None = None,
                       spec: NotebookSpec | None = None, *, preflight: bool = True) -> Resolved:
    """Check ``params`` against the notebook before anything runs.

    Unknown names are refused; with a config class (``metadata["lab_config"]``)
    the defaults plus ``params`` must build it, so a bad value is a ConfigError
    naming the field, the value and what is allowed. Without one, the resolved
    config is the declared defaults updated with ``params``.
    """
    spec = notebook_spec(notebook) if spec is None else spec
    params = dict(params or {})
    _check_declares_every_field(notebook, spec)
    check_parameters(notebook, params, spec.declared)
    defaults = {k: v for k, v in spec.defaults.items() if k not in RESERVED}
    merged = apply_params(defaults, params)
    _refuse_expressions(notebook, merged)
    given = {root: merged[root] for root in dict.fromkeys(map(_root, params))}
    cls = spec.config_class
    fields = set(field_names(cls)) if cls is not None else set()
    check_own_types(notebook, {k: v for k, v in given.items() if k not in fields},
                    spec.declared, spec.defaults)
    if cls is None:
        return Resolved(given, _as_stored(merged), full=False, code=spec.code)
    dotted = [key for key in params if "." in key]

    def context(message: str) -> str:
        # Name a dotted key only where the error is about the leaf it set (an error about
        # another leaf of the same dict, e.g. a default, is not that key's doing).
        hit = [key for key in dotted if re.search(rf"\b{re.escape(key.split('.')[-1])}\b",
                                                  message)]
        return f" (given by {', '.join(hit)})" if hit else ""

    try:
        config = from_dict(cls, {k: v for k, v in merged.items() if k in fields})
        # What the data or machine decides (dataset sizes, files): still before a kernel.
        if preflight:
            getattr(config, "preflight", lambda: None)()
    except ConfigError as err:
        if not context(str(err)):
            raise
        raise ParameterError(f"{err}{context(str(err))}") from None
    except (TypeError, ValueError) as err:  # a check in the class's own __post_init__
        raise ParameterError(f"{cls.__name__}: {err}{context(str(err))}") from None
    extras = {k: v for k, v in merged.items() if k not in fields}
    return Resolved(given, _as_stored(as_dict(config)), full=True, extras=_as_stored(extras),
                    kind=trainer_kind(cls), code=spec.code)


_ABSENT = object()


def _leaf_keys(config: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}, "c": 2} -> {"a.b": 1, "c": 2}; an empty dict stays a value."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(_leaf_keys(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def asked_differences(record: Mapping, resolved: Resolved) -> list[str]:
    """:func:`config_differences` between what a recorded run was asked (config and the
    notebook's own parameters, ``records.run_params``) and what ``resolved`` asks now.
    A record from before notebooks' own parameters were kept holds the config only:
    then the config alone is compared."""
    if "notebook_params" in record or not resolved.extras:
        then, now = records.run_params(record), resolved.asked()
    else:
        then, now = record["config"], resolved.config
    then = with_legacy_params(then)
    return config_differences(then, _same_data_dir(then, now, record), resolved.full)


def _same_data_dir(then: Mapping, now: Mapping, record: Mapping) -> Mapping:
    """``now`` with its ``data_dir`` set to the run's when both name one directory.

    ``data_dir: ""`` stands for ``$LAB_DATA_DIR`` (else ~/.cache/lab) as it is where the
    config is used, so the literal alone cannot tell: "" now with $LAB_DATA_DIR at the
    directory the run read is the same run (the recorded data identity, compared
    apart, tells whether its content changed); "" with $LAB_DATA_DIR elsewhere is not.
    """
    old, new = then.get("data_dir"), now.get("data_dir")
    if not (isinstance(old, str) and isinstance(new, str)) or old == new or (old and new):
        return now
    from .data import default_data_dir  # (torch: only for a config that has a data_dir)
    from .data.identity import absolute

    data = record.get("data")
    read = data.get("dir") if isinstance(data, dict) else None  # the directory it read
    there = old or read or str(default_data_dir())
    here = new or str(default_data_dir())
    return {**now, "data_dir": old} if absolute(there) == absolute(here) else now


def config_differences(then: Mapping, now: Mapping, full: bool = True) -> list[str]:
    """``"field: <then> there vs <now> now"`` for each field that differs.

    Display-only and operational fields (``lab.config.DISPLAY_ONLY``, ``OPERATIONAL``:
    the progress bar, the checkpoint cadence) never differ. ``full``
    compares every field of either; otherwise only fields both hold (a notebook
    without a config class may record a config of its own shape).
    """
    # Dict parameters compared leaf by leaf: the message names rule_params.x, not two
    # whole dicts that differ in one key.
    then = _leaf_keys(identity(_as_stored(dict(then))))
    now = _leaf_keys(identity(_as_stored(dict(now))))
    keys = set(then) | set(now) if full else set(then) & set(now)

    def shown(config, key):
        value = config.get(key, _ABSENT)
        return "(absent)" if value is _ABSENT else repr(value)

    return [f"{key}: {shown(then, key)} there vs {shown(now, key)} now" for key in sorted(keys)
            if then.get(key, _ABSENT) != now.get(key, _ABSENT)]


@functools.cache
def ensure_kernel(name: str = KERNEL) -> str:
    """Make sure kernel ``name`` runs this interpreter; returns its argv[0].

    jupyter_client substitutes ``sys.executable`` for a bare ``python``; any
    other interpreter would run notebooks against another environment. In a
    virtual environment a missing or foreign spec is (re)installed into
    ``sys.prefix`` (what ``make install`` does with ``ipykernel install --sys-prefix``).
    """
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    def current() -> str | None:
        try:
            return KernelSpecManager().get_kernel_spec(name).argv[0]
        except NoSuchKernel:
            return None

    def ours(cmd: str | None) -> bool:
        bare = {"python", "python3", f"python{sys.version_info[0]}.{sys.version_info[1]}"}
        return cmd is not None and (cmd in bare or _same_file(cmd, sys.executable))

    cmd = current()
    if not ours(cmd) and sys.prefix != sys.base_prefix:
        from ipykernel.kernelspec import install

        try:
            install(kernel_name=name, prefix=sys.prefix)
        except OSError as err:  # an install this user cannot write
            raise NotebookError(
                f"kernel {name!r} runs {cmd or 'nothing (no such kernel)'}, not this "
                f"interpreter ({sys.executable}), and it could not be registered in "
                f"{sys.prefix} ({err.strerror or err}); ask whoever owns that environment "
                f"to run `{sys.executable} -m ipykernel install --sys-prefix --name {name}`, "
                "or use an environment of your own") from None
        cmd = current()
    if not ours(cmd):
        where = KernelSpecManager().find_kernel_specs().get(name)
        found = f" (its spec: {where}"
        extra = [d for d in os.environ.get("JUPYTER_PATH", "").split(os.pathsep) if d]
        if where and any(Path(where).resolve().is_relative_to(Path(d).resolve())
                         for d in extra):
            found += (f", found through JUPYTER_PATH={os.environ['JUPYTER_PATH']}, which "
                      "comes before this environment's kernels: remove that spec or unset "
                      "JUPYTER_PATH")
        found = found + ")" if where else ""
        raise NotebookError(
            f"kernel {name!r} runs {cmd or 'nothing (no such kernel)'}{found}, not this "
            f"interpreter ({sys.executable}); register it with `{sys.executable} -m "
            f"ipykernel install --sys-prefix --name {name}` (make install does this)")
    return cmd


def _same_file(a: str, b: str) -> bool:
    if a == b or os.path.realpath(a) == os.path.realpath(b):
        return True  # (samefile must stat both: a directory this user cannot read fails)
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


# ---------------------------------------------------------------------------
# kernels that die with the process that started them

# Run as `python -c _LAUNCHER <kernel argv...>`: ask Linux to SIGKILL this process
# when its parent dies, then become the kernel (the request survives execve). A
# kernel orphaned by a killed sweep would otherwise keep training and writing
# for about a second, until ipykernel's parent poller noticed.
_LAUNCHER = """\
import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
parent = os.environ.get("JPY_PARENT_PID")
if parent and os.getppid() != int(parent):  # the parent died before the request
    os._exit(1)
os.execvp(sys.argv[1], sys.argv[1:])
"""


_SOCKET_PREFIX = "lab-kernel-"


def _remove_dead_socket_dirs() -> None:
    """Remove the socket directories that killed processes left in the temp folder.

    A process killed with SIGKILL cannot remove its kernel's socket directory, named
    ``lab-kernel-<pid>-*`` after it; the next kernel started removes the ones of this
    user whose process is gone. A pid reused since, or owned by another user, keeps
    its directory (the cost: one empty directory)."""
    root = Path(tempfile.gettempdir())
    for path in root.glob(f"{_SOCKET_PREFIX}*-*"):
        pid = path.name[len(_SOCKET_PREFIX):].split("-", 1)[0]
        try:
            if not pid.isdigit() or path.stat().st_uid != os.getuid():
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except OSError:  # alive under another user (EPERM), or the entry just went
            continue


@functools.cache
def _kernel_manager_class():
    from jupyter_client.manager import AsyncKernelManager

    class BoundKernelManager(AsyncKernelManager):
        """Starts the kernel through ``_LAUNCHER``, so it dies with its parent, and talks
        to it over Unix sockets in a directory of its own, not TCP ports.

        Why not TCP: jupyter_client picks free ports by binding and releasing them, and
        the kernel binds them a moment later; in between, any process's outgoing
        connection (a Dask cluster makes many) may take one as its source port. The
        kernel then dies with "Address already in use" and the run fails after a 60 s
        wait (seen in a sweep test under load). A socket file cannot be taken that way.
        The directory is short (socket paths are limited to about 107 bytes) and is
        removed with the kernel's other files."""

        def __init__(self, **kwargs):
            _remove_dead_socket_dirs()
            self._socket_dir = tempfile.mkdtemp(prefix=f"{_SOCKET_PREFIX}{os.getpid()}-")
            kwargs.setdefault("transport", "ipc")
            kwargs.setdefault("ip", os.path.join(self._socket_dir, "k"))
            # The connection file too, so a kernel whose parent was killed leaves one
            # directory (removed by the next kernel), not a stray /tmp/tmp*.json as well.
            kwargs.setdefault("connection_file", os.path.join(self._socket_dir, "kernel.json"))
            super().__init__(**kwargs)

        def format_kernel_cmd(self, extra_arguments=None):
            cmd = super().format_kernel_cmd(extra_arguments)
            return [sys.executable, "-c", _LAUNCHER, *cmd]

        async def _async_cleanup_resources(self, restart: bool = False) -> None:
            await super()._async_cleanup_resources(restart)
            if not restart:
                shutil.rmtree(self._socket_dir, ignore_errors=True)

    return BoundKernelManager


def _papermill_options() -> dict:
    if sys.platform.startswith("linux"):
        return {"kernel_manager_class": _kernel_manager_class()}
    return {}  # no PR_SET_PDEATHSIG: ipykernel's parent poller is the fallback


# ---------------------------------------------------------------------------
# execution


@dataclass
class RunResult:
    """What :func:`execute` did: where, with which outcome, and the recorded values."""

    run_id: str
    out_dir: Path
    notebook: Path  # the executed notebook
    status: str  # a records status: complete | diverged | failed (| running)
    error: str | None
    values: dict
    wall_s: float
    skipped: bool = False  # already finished with these parameters: nothing was executed
    moved_aside: Path | None = None  # where a replaced old run was kept
    # The run directory was renamed or deleted mid-run (the run stopped): out_dir and
    # notebook then name where it is now, when the OS could tell (moved_to), else the old path.
    moved_away: bool = False
    moved_to: Path | None = None

    @property
    def ok(self) -> bool:
        return self.status != "failed"


@contextlib.contextmanager
def _kernel_env(threads: int | None, env: Mapping[str, str | None] | None):
    """Environment for the kernel, which copies os.environ when it starts.

    ``threads`` sets the OMP/MKL/OpenBLAS/Numba thread counts; ``env`` sets
    variables (None unsets one). Changed for the duration of one execution and
    restored: a sweep worker runs one execution at a time.
    """
    changes = dict(env or {})
    if threads:
        changes.update({key: str(threads) for key in THREAD_VARS})
    saved = {key: os.environ.get(key) for key in changes}
    _apply(changes)
    try:
        yield
    finally:
        _apply(saved)


def _apply(changes: Mapping[str, str | None]) -> None:
    for key, value in changes.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


_INSERTED_TAGS = ("injected-parameters", "papermill-error-cell-tag")  # cells papermill adds


def failing_cell(executed_notebook) -> tuple[int, str] | None:
    """(position counted from 1 in the *source* notebook, first line) of the cell
    that raised, or None. Papermill's own index counts the cells it inserted."""
    try:
        nb = _read(executed_notebook)
    except NotebookError:
        return None
    position = 0
    for cell in nb.cells:
        if set(cell.metadata.get("tags", [])) & set(_INSERTED_TAGS):
            continue
        position += 1
        raised = any(o.get("output_type") == "error" for o in cell.get("outputs", []))
        if raised or cell.metadata.get("papermill", {}).get("exception"):
            lines = [line.strip() for line in cell.source.splitlines() if line.strip()]
            return position, (lines[0] if lines else "")
    return None


def _describe_error(err: Exception, notebook: Path, target: Path) -> str:
    from papermill.exceptions import PapermillExecutionError

    if isinstance(err, PapermillExecutionError):
        # The traceback stays in the executed notebook; the record gets the gist.
        where = failing_cell(target)
        if where is None:
            return f"{err.ename}: {err.evalue}"
        position, first = where
        return (f"{err.ename}: {err.evalue} (in cell {position} of {notebook.name}, counting "
                f"every cell from 1, which starts `{first[:60]}`)")
    return f"{type(err).__name__}: {err}"


def _papermill(notebook: Path, target: Path, params: dict, timeout: float | None,
               log_output: bool) -> str | None:
    """Run papermill; returns the error text if the notebook failed, None if it ran."""
    import papermill

    for attempt in range(1, KERNEL_STARTS + 1):
        with _ctrl_c_watch() as seen:
            try:
                papermill.execute_notebook(
                    _for_papermill(notebook), _for_papermill(target), parameters=params,
                    kernel_name=KERNEL,
                    progress_bar=False, log_output=log_output, execution_timeout=timeout,
                    extra_arguments=KERNEL_ARGS,
                    # Every output is on disk by now and run files are written atomically;
                    # a graceful shutdown waits seconds for torch's exit handlers.
                    shutdown_kernel="immediate", **_papermill_options())
            except Exception as err:  # a cell error, a dead kernel, a timeout: the run failed
                if seen:  # ... unless it is the kernel dying of the same Ctrl-C
                    raise KeyboardInterrupt from None
                if attempt < KERNEL_STARTS and _never_started(err):
                    continue  # no cell ran: start another kernel
                return _describe_error(err, notebook, target)
        return None
    return None  # (not reached)


# Kernels started per execution. A kernel picks its TCP ports at random just before it
# binds them, so two starting at once (a sweep's workers, a parallel test run) can
# collide ("Address already in use") and die before replying to kernel_info; nothing has
# run then, so another start is safe.
KERNEL_STARTS = 3


def _never_started(err: BaseException) -> bool:
    return "died before replying to kernel_info" in str(err)


# Loggers that report a kernel's death; after a Ctrl-C that death is the interrupt itself.
_QUIET_AFTER_CTRL_C = ("asyncio", "papermill", "nbclient", "traitlets")


@contextlib.contextmanager
def _ctrl_c_watch():
    """Ctrl-C during a notebook's execution: a KeyboardInterrupt at once, remembered.

    Ctrl-C reaches the kernel too (one process group), and asyncio's own handler (3.11's
    Runner installs one over the default) only cancels the running task: when the kernel's
    death wins that race, papermill raised DeadKernelError, the run was marked failed with
    "Kernel died" and asyncio printed a traceback. Our handler (not the default, so asyncio
    leaves it) raises at once and records the interrupt; a failure after it is the
    interrupt. Outside the main thread (a sweep worker) no handler can be set: no-op.
    """
    import logging
    import signal

    seen: list[bool] = []

    def handler(signum, frame):
        if not seen:
            for name in _QUIET_AFTER_CTRL_C:
                logging.getLogger(name).setLevel(logging.CRITICAL)
        seen.append(True)
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread
        previous = None
    try:
        yield seen
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def _is_metric(value: Any) -> bool:
    if value is None or isinstance(value, (int, float)):
        return True
    if isinstance(value, dict):
        return all(_is_metric(item) for item in value.values())
    if isinstance(value, list):
        return all(_is_metric(item) for item in value)
    return False


def _metric_values(values: dict) -> dict:
    # Non-finite values are kept: records encode them, and a NaN is a result. A
    # bare None (nothing measured) and text are not metrics.
    return {key: value for key, value in values.items()
            if value is not None and _is_metric(value)}


def _existing_created(run_dir: Path) -> str | None:
    try:
        return records.load_record(run_dir, rows=False)["created"]
    except (records.RecordError, OSError, KeyError):
        return None


def mark_failed(run_dir, run_id: str, config: Mapping, error: str,
                code: CodeIdentity | None = None) -> dict:
    """Set the run's record to ``failed`` with ``error``, keeping what it holds
    (``created`` included); a run that failed before writing a record (or whose
    record is unreadable) gets a minimal one with ``config`` (and ``code``, the
    notebook's). The caller holds the run's lock."""
    run_dir = Path(run_dir)
    try:
        record = records.load_record(run_dir, rows=False)  # the rows stay as they are
    except records.RecordError:
        record = records.new_record(run_id=run_id, kind=records.NOTEBOOK_KIND, config=dict(config))
    if code is not None and CODE_KEY not in record:
        record[CODE_KEY] = code.as_record()
    record.update(status="failed", error=error)
    records.save_run(run_dir, record)
    return record


# Errors a trainer raises before it touches its run directory (lab.lifecycle's refusals).
REFUSALS = ("CheckpointError",)


def _trainers(out: Path) -> bool:
    """Whether ``out``'s record is a trainer's (not a plain notebook's, not unreadable)."""
    try:
        return records.load_record(out, rows=False)["kind"] != records.NOTEBOOK_KIND
    except records.RecordError:
        return False


def _settle_record(out: Path, run_id: str, config: dict, values: dict, error: str | None,
                   started: float, code: CodeIdentity | None = None) -> tuple[str, str | None]:
    """Bring record.json in line with how the notebook ended, the notebook's ``code``
    included; returns (status, error)."""
    path = out / records.RECORD_FILE
    if error is not None:
        if error.split(":", 1)[0] in REFUSALS and path.exists() \
                and path.stat().st_mtime < started:
            # The trainer refused to start (a foreign or damaged checkpoint): it touched
            # nothing, and an interrupted run stays resumable once the cause is removed.
            return "failed", error
        mark_failed(out, run_id, config, error, code)
        return "failed", error
    if not path.exists() or (path.stat().st_mtime < started and not _trainers(out)):
        # A notebook that trains nothing still leaves a record (replacing one
        # from an earlier attempt, whose creation time it keeps), so sweeps of it
        # resume like any other; its recorded values are the final metrics. A
        # trainer's record not written this time is one its trainer found finished
        # and left as it was (the notebook re-executed to finish its last cells):
        # it stays.
        created = _existing_created(out)
        record = records.new_record(run_id=run_id, kind=records.NOTEBOOK_KIND, config=config)
        record.update(status="complete", final=_metric_values(values))
        if code is not None:
            record[CODE_KEY] = code.as_record()
        if created:
            record["created"] = created
        records.save_run(out, record)
        return "complete", None
    try:
        record = records.load_record(out)
    except records.RecordError as err:
        error = f"the notebook ran but left an unreadable record: {err}"
    else:
        if record["status"] != "running":
            if code is not None and record.get(CODE_KEY) != code.as_record():
                # A trainer's record written by a lab that does not pass the code to it, or
                # resumed from one: the code that just ran it is recorded (decide refused
                # any other code before the kernel started).
                bare = records.load_record(out, rows=False)
                bare[CODE_KEY] = code.as_record()
                records.write_record(out, bare)
            return record["status"], record.get("error")
        error = "the notebook finished but its record is still 'running'"
    mark_failed(out, run_id, config, error, code)
    return "failed", error


def _finish_notebook(target: Path, meta: dict) -> None:
    """Mirror the outcome into metadata.lab (for readers of the notebook; the
    run's status lives in record.json)."""
    import nbformat

    nb = _read(target)
    meta["values"] = _outputs_values(nb)
    nb.metadata["lab"] = meta
    records.atomic_write(target, lambda tmp: nbformat.write(nb, str(tmp)))


class RunConflict(ConfigError):
    """The run directory holds another run: refused before anything was changed.

    ``reason``: "stale" (a run of other parameters) or "unreadable" (its record
    cannot be read, so it cannot be compared).
    """

    def __init__(self, message: str, reason: str = "stale"):
        super().__init__(message)
        self.reason = reason


REPLACE = ("never", "conflicting", "always")


def _article(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"


def decide(out: Path, resolved: Resolved, replace: str, *, locked: bool = False,
           maker: str = "this notebook") -> tuple[str, runlock.RunState]:
    """What to do with ``out``: "execute" (fresh, or resume an interrupted or
    failed run of the same config), "done" (finished with the same config) or
    "replace" (move the old run aside first). RunLocked / RunConflict otherwise.
    ``maker`` names what would make the run, in the refusal of another kind's run."""
    state = run_state(out, locked=locked)
    if state.status == "running":
        raise runlock.RunLocked(out, state.pid)
    if state.status == "missing":
        return "execute", state
    never = diffs = False
    how = ""  # what else may be done with a stale run
    if state.status == "unreadable":
        reason, problem = "unreadable", f"a run whose record cannot be read ({state.error})"
    elif (there := records.another_trainers(state.record, resolved.kind)) \
            and replace == "never":
        # Another trainer's run: every field would differ, and the diff would hide why.
        raise RunConflict(
            f"{out} holds {_article(there)} {there} run; {maker} makes {resolved.kind} "
            "runs: give it another --out (or out_dir; another `out` for a sweep); nothing was "
            "changed", "stale")
    else:
        diffs = asked_differences(state.record, resolved)
        status = f"{_article(state.status)} {state.status}"
        # A run that failed before its first row (a refused value) lost nothing.
        never = state.status == "failed" and not any((state.record.get("rows") or {}).values())
        reason, problem = "stale", (f"{status} run{' (it never trained a step)' if never else ''}"
                                    f" with other parameters ({'; '.join(diffs)})"
                                    if diffs else None)
        code = resolved.code.changed_since(state.record) \
            if resolved.code is not None and not diffs else None
        if code:
            # Other code is another run, as other parameters are; resuming would mix two
            # versions of the code in one run.
            diffs = [code]
            resume = "" if state.status in runlock.FINISHED or never else \
                "; resuming it would mix two versions of the code in one run"
            problem = (f"{status} run{' (it never trained a step)' if never else ''} made with "
                       f"other code ({code}){resume}")
            how = ", or restore the notebook's code as the run had it"
        if problem is None and not never:
            # Same parameters, but a data file it read has changed since: a finished run's
            # results are not those of these parameters any more, and an interrupted one
            # would resume on other data (refused here, before a kernel starts, with its
            # record left as it is; the lifecycle's own check is the last guard).
            from .data.identity import changed_files  # (lab.data imports torch: lazily)

            changed = changed_files(state.record.get("data"), resolved.config.get("data_dir"))
            if changed:
                resume = "" if state.status in ("complete", "diverged") else \
                    "; resuming it would train on other data (restore the file to resume it)"
                problem = (f"{status} run whose data changed since ({'; '.join(changed)})"
                           f"{resume}")
    if problem:
        # A failed run that never trained a step holds nothing to keep (it is a refused or
        # broken attempt): corrected parameters replace it, moved aside as --force would.
        if replace == "never" and not (reason == "stale" and never and diffs):
            raise RunConflict(
                f"{out} already holds {problem}; nothing was changed. To run these parameters, "
                "use another run directory (another `out` for a sweep), or --force to replace "
                f"the old run (it is moved aside to {out.name}.old-<time>, not deleted){how}",
                reason)
        return "replace", state
    if replace == "always":
        return "replace", state
    if state.status in runlock.FINISHED and not _notebook_finished(out):
        # Killed between the trainer's last record and the notebook's end: the training is
        # done (its checkpoint says so, so nothing retrains), but the notebook is not.
        return "execute", state
    return ("done" if state.status in runlock.FINISHED else "execute"), state


def run_state(out, *, locked: bool = False) -> runlock.RunState:
    """:func:`lab.runlock.inspect` with the record read and checked by ``lab.records``:
    a record whose fields or row store are damaged is "unreadable" (a finished run whose
    store lost a part must not pass as done; ``--force`` replaces it)."""
    state = runlock.inspect(out, locked=locked)
    if state.record is None:
        return state
    try:
        record = records.load_record(out, rows=False)  # status and config only
        if state.status in runlock.FINISHED:
            records.check_stored_rows(out)
    except (records.RecordError, OSError) as err:
        return runlock.RunState("unreadable", error=str(err))
    return dataclasses.replace(state, record=record)


def _notebook_finished(out: Path) -> bool:
    """False when ``out`` holds an executed notebook that never reached its end
    (no ``metadata.lab``, written last); a run made without a notebook has none
    and counts as finished."""
    import json

    try:
        with open(out / OUTPUT_NOTEBOOK, encoding="utf-8") as f:
            nb = json.load(f)
    except FileNotFoundError:
        return True
    except (OSError, ValueError):
        return False  # half-written or unreadable: executing again rewrites it
    return isinstance(nb, dict) and "lab" in nb.get("metadata", {})


def _skipped(run_id: str, out: Path, state: runlock.RunState) -> RunResult:
    record = state.record or {}
    return RunResult(run_id, out, out / OUTPUT_NOTEBOOK, record.get("status", state.status),
                     record.get("error"), {}, 0.0, skipped=True)


def execute(notebook, out_dir, params: Mapping | None = None, *, run_id: str | None = None,
            threads: int | None = None, env: Mapping[str, str | None] | None = None,
            record: bool = True, timeout: float | None = None, log_output: bool = False,
            replace: str = "never", spec: NotebookSpec | None = None) -> RunResult:
    """Execute ``notebook`` with ``params`` into ``out_dir``; see the module docstring.

    ``out_dir`` is passed as the ``out_dir`` parameter when the notebook
    declares one (and may not be given in ``params``). ``threads`` (default:
    ``params["threads"]`` when positive) sets OMP/MKL/OpenBLAS/Numba thread
    counts for the kernel, and ``env`` sets (None: unsets) its environment.

    Parameters are checked first (ParameterError/ConfigError/NotebookError,
    nothing created). With ``record`` (a run, not a report) the run directory
    is then decided from its record.json: a run finished with the same config
    is not executed again (``skipped``); one with other parameters raises
    RunConflict unless ``replace`` is "conflicting" or "always" (the old run is
    moved aside); a directory another process works in raises RunLocked.
    Otherwise the run is executed holding the directory's lock (exported to the
    kernel as ``LAB_RUN_LOCK``). A failing notebook does not raise but returns
    status ``failed``.
    """
    if replace not in REPLACE:
        raise ValueError(f"execute: replace={replace!r}; allowed: {', '.join(REPLACE)}")
    notebook = Path(notebook)
    out = Path(out_dir).expanduser().resolve()
    spec = notebook_spec(notebook) if spec is None else spec
    if record:
        check_trains(spec)
    resolved = resolve_parameters(notebook, params, spec)
    injected = dict(resolved.params)
    if "out_dir" in spec.declared:
        injected["out_dir"] = str(out)
    run_id = run_id or out.name
    if threads is None and isinstance(injected.get("threads"), int):
        threads = injected["threads"] or None
    ensure_kernel()
    if not record:
        out.mkdir(parents=True, exist_ok=True)
        return _execute(notebook, out, injected, resolved, run_id, threads, env, None,
                        timeout, log_output)
    decision, state = decide(out, resolved, replace)
    if decision == "done":
        return _skipped(run_id, out, state)
    moved = runlock.move_aside(out) if decision == "replace" else None
    with runlock.acquire(out) as lock:
        # Decided again under the lock: another process may have finished it meanwhile.
        decision, state = decide(out, resolved, "never", locked=True)
        if decision == "done":
            return _skipped(run_id, out, state)
        code = resolved.code.as_record() if resolved.code is not None else None
        env = {**(env or {}), runlock.ENV: str(out),  # the trainer's hold() is then a no-op
               runlock.PARAMS_ENV: json.dumps(resolved.extras) if resolved.extras else None,
               runlock.CODE_ENV: json.dumps(code) if code else None}
        result = _execute(notebook, out, injected, resolved, run_id, threads, env, moved,
                          timeout, log_output, record=True, lock=lock)
    return result


def _execute(notebook: Path, out: Path, injected: dict, resolved: Resolved, run_id: str,
             threads: int | None, env, moved: Path | None, timeout: float | None,
             log_output: bool, record: bool = False,
             lock: runlock.RunLock | None = None) -> RunResult:
    target = out / OUTPUT_NOTEBOOK
    start, started = time.perf_counter(), time.time()
    with _kernel_env(threads, env):
        error = _papermill(notebook, target, injected, timeout, log_output)
    if lock is not None:
        try:
            lock.check_in_place()
        except runlock.RunMoved as err:
            # Any write by the old path would make a second, unlocked run there; what the
            # trainer saved is in the moved directory, resumable from there, so the result
            # names where the run is now (the old path is gone, or another directory).
            now = Path(err.now) if err.now else None
            # Its status is what `lab runs` reads there (interrupted, or complete when the
            # training had ended): one word for one run. Gone without a trace: failed.
            there = runlock.inspect(now, locked=True).status if now else "failed"
            status = "interrupted" if there in ("missing", "running") else there
            return RunResult(run_id, now or out, (now or out) / OUTPUT_NOTEBOOK, status,
                             str(err), {}, time.perf_counter() - start, moved_aside=moved,
                             moved_away=True, moved_to=now)
    # Writing the outcome down can itself fail (a directory made read-only mid-run):
    # then the error that ended the run is reported first, the failed write after it.
    try:
        if not target.exists():  # papermill failed before writing anything
            import nbformat

            nbformat.write(_read(notebook), str(target))
        values = read_values(target)
    except OSError as err:
        values, error = {}, _also(error, "the executed notebook could not be written", err)
    except NotebookError as err:  # papermill's last write of it cut short: a full disk?
        values = {}
        error = (f"{error}\n" if error else "") + f"{err}{_disk_full(out)}"
        import nbformat

        with contextlib.suppress(OSError):  # the source in its place: readable, unexecuted
            source = _read(notebook)
            records.atomic_write(target, lambda tmp: nbformat.write(source, str(tmp)))
    status = "failed" if error else "complete"
    if record:
        try:
            status, error = _settle_record(out, run_id, resolved.config, values, error, started,
                                           resolved.code)
        except OSError as err:
            status, error = "failed", _also(error, "the run's record could not be written", err)
    meta = {"run_id": run_id, "source": str(notebook.resolve()), "params": injected,
            "status": status, "error": error}
    try:
        _finish_notebook(target, meta)
    except NotebookError:
        pass  # (its error is told above; a notebook that cannot be read has no metadata)
    except OSError as err:
        status, error = "failed", _also(error, "the executed notebook could not be updated", err)
    return RunResult(run_id, out, target, status, error, records.decode_nonfinite(values),
                     time.perf_counter() - start, moved_aside=moved)


def _disk_full(where: Path) -> str:
    """A note when the disk holding ``where`` is (nearly) full, else ""."""
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        return ""
    if free >= 16 << 20:
        return ""
    return (f" (the disk holding {where} has {free:,} bytes free: full? Free some space and "
            "run the same command again to resume)")


def _also(error: str | None, what: str, err: OSError) -> str:
    line = f"{what}: {type(err).__name__}: {err}"
    return f"{error}\n{line}" if error else line


def render_html(executed_notebook, html_path) -> Path:
    """Render an executed notebook to a standalone HTML file (nbconvert)."""
    from nbconvert import HTMLExporter

    body, _ = HTMLExporter().from_notebook_node(_read(executed_notebook))
    html_path = Path(html_path)
    html_path.parent.mkdir(parents=True, exist_ok=True)
    records.atomic_write(html_path, lambda tmp: tmp.write_text(body, encoding="utf-8"))
    return html_path


__all__ = [
    "RECORD_MIME", "NotebookError", "NotebookSpec", "ParameterError", "Resolved",
    "RunConflict", "RunResult", "apply_params", "asked_differences", "check_parameters",
    "config_class",
    "config_differences", "config_from", "declared_parameters", "decide", "ensure_kernel",
    "execute",
    "failing_cell", "mark_failed", "notebook_defaults", "notebook_spec", "read_values",
    "record_value", "render_html", "resolve_parameters",
]
