"""Protocols and resumable sweeps on Dask (DESIGN section 8).

A protocol (``protocols/*.yaml``) names a notebook and a grid::

    name: demo                            # also the report's name
    notebook: ../notebooks/01-train-conv.ipynb
    out: ../runs/demo                     # one directory per run inside
    report: ../notebooks/10-summary.ipynb # optional: what `lab report` executes
    workers: 2                            # optional: local Dask workers (default 2)
    threads_per_run: 0                    # optional: 0 = usable cores // workers
    fixed: {dataset: mnist1d, epochs: 30}
    grid:                                 # every combination is one run
      rule: [kp]
      rule_params.traffic_rule: [raw, matched]   # a dotted key: one key inside a dict
      seed: [0, 1]

Relative paths are relative to the protocol file, so a protocol means the same
from any working directory: ``notebook``, ``out``, ``report`` and every data path
among the parameters (a text parameter named ``*_path`` or ``*_dir``, such as
``csv_path``, ``text_path``, ``data_dir``); a blank ``notebook``, ``out`` or ``report`` (which
would mean the working directory), an ``out`` that is or lies inside a file and
a ``report`` that is a directory or does not exist are refused at load. Every ``fixed`` and
``grid`` key must be a parameter the notebook declares (for a dotted key, its
first part);
``out_dir`` is the sweep's to set. When the notebook names its config class
(``metadata["lab_config"]``), every run of the grid is built into it at load,
so a bad value or an unknown dotted key is refused before any kernel starts, as
are grid points that resolve to one config (``weight_decay: [0, 0.0]``, or
``rule_params: [{}, {feedback_scale: 1.0}]`` where 1.0 is the default): two ids,
one run. A sweep on a local cluster refuses an ``out`` it cannot make or write
before Dask starts, and starts no more workers than runs to execute.

An override is applied over ``fixed``, so a fixed dotted key inside a dict an
override replaces (it would beat the override's leaf) is refused, as is a fixed
dotted key inside a grid key's dicts.

:func:`expand` turns the grid into runs with stable, readable ids
(``rule-kp_rule_params.traffic_rule-raw_seed-0``: sorted grid keys; see
:func:`run_id_for` for values that their text does not name exactly, and long ids).
:func:`run_sweep` decides each run from its record.json, the single source of
a run's status (:func:`lab.notebook.decide`): a run finished with the
protocol's resolved config (defaults filled in, display-only fields aside) is
kept; one finished with another config, or with other notebook code (a code cell
edited: the record's ``code``), is reported ``stale`` with each difference
(``--force`` moves it aside and runs it afresh); a run another
process holds (``lab.runlock``) is reported ``locked`` and left alone; the
rest are executed with :func:`lab.notebook.execute`, one Dask task per run,
and an interrupted run resumes from its checkpoint. Each task decides again
under the run's lock, so two sweeps of one protocol execute each run once in
total. A failing run is recorded and the others go on.

Dask: a ``LocalCluster`` of single-threaded worker processes by default, or
``Client(address)`` for a cluster (a shared file system for ``out`` is then
assumed, and workers should run with ``--nthreads 1``); the same code path
either way. Each run's kernel gets ``threads_per_run`` threads (OMP/MKL/Numba
variables, and the notebook's ``threads`` parameter when it declares one), so
runs do not oversubscribe the cores. The thread count is part of a run's
config (sums may round differently), so a protocol meant to reproduce across
machines sets ``threads_per_run`` rather than relying on the core count (or
sets ``threads`` in ``fixed``/``grid``; both at once are refused). With
``threads_per_run: 0`` and no ``threads``, a run already made keeps the count
it was made with: a sweep with other workers, ``lab runs`` and ``lab report``
all take it as given rather than calling the run stale.

Dask starts local workers with ``spawn``: a script calling :func:`run_sweep`
needs the ``if __name__ == "__main__":`` guard (the CLI has it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import logging
import math
import os
import re
import sys
import threading
import time
import unicodedata
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from . import records
from .config import (
    ConfigError,
    bounded,
    configclass,
    dotted_parent,
    field_names,
    load_yaml,
    read_yaml_mapping,
    with_legacy_params,
)

SEED_KEY = "seed"
_UNSAFE = re.compile(r"[^A-Za-z0-9.=,+_-]+")  # outside a protocol name's characters
_REPORT_SUFFIXES = (".pending", ".failed", ".html")  # lab report's own names
_ID_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789.=,+-_")
_KEY_CHARS = _ID_CHARS - {"=", ","}  # a dict key inside an id: a parameter name
_ENV_AT_IMPORT = dict(os.environ)  # before any in-process Dask nanny edits it (kernel_env)


# Runs a protocol may make. Each is resolved and checked before any starts (about 4 ms
# a run here) and each costs a kernel start (3 s): 10,000 is an hour of checks and
# overhead alone; a grid of 10**7 points hung `lab sweep` silently.
MAX_RUNS = 10_000


class ProtocolError(ConfigError):
    """A protocol file that cannot be run: unreadable, malformed or inconsistent."""


class SchedulerError(RuntimeError):
    """The Dask scheduler given to a sweep cannot be reached."""


@configclass
class Protocol:
    """A validated protocol; paths are absolute once loaded by :func:`load_protocol`."""

    name: str
    notebook: str
    out: str
    grid: dict
    fixed: dict = dataclasses.field(default_factory=dict)
    workers: int = bounded(2, 1)
    threads_per_run: int = bounded(0, 0)  # 0 = usable cores // workers
    report: str = ""  # the analysis notebook `lab report` executes; "" = none
    # grid key -> {grid value -> {parameter: value}}: settings that belong to one
    # grid value (e.g. a rule's own learning rate), applied over `fixed`.
    overrides: dict = dataclasses.field(default_factory=dict)
    # Fragments (YAML files with `fixed` and/or `overrides`) merged in at load: what a
    # selection protocol chose (`lab select`, analysis.select). Absolute once loaded.
    include: list = dataclasses.field(default_factory=list)
    # A selection protocol's choice (analysis.select reads it; a sweep ignores it).
    select: dict = dataclasses.field(default_factory=dict)
    source: str = ""  # the YAML file it came from

    def __post_init__(self):
        for part in ("fixed", "grid"):
            _check_names(f"Protocol.{part}", getattr(self, part))
        # A grid key is part of every run's directory name: a parameter's name, or a dotted
        # path into a dict parameter (whose keys may be any text: weights.0, weights.a-b),
        # never a path ("x./../../y" wrote a run outside out).
        odd = [key for key in self.grid if any(c in key for c in "/\\\0")
               or "" in key.split(".")]
        if odd:
            raise ProtocolError(
                f"Protocol.grid key(s) {', '.join(map(repr, odd))} are not parameter names: a "
                "grid key is a notebook parameter's name, or a dotted path into a dict "
                "parameter (rule_params.traffic_rule), with no empty part and no '/', '\\' "
                "or NUL: it becomes part of each run's directory name")
        if not self.name or _UNSAFE.search(self.name):
            raise ProtocolError(f"Protocol.name={self.name!r} is not allowed; use a non-empty "
                                "name of ASCII letters, digits and . = , + - _ (it names "
                                "directories and report files)")
        # '.' and '..' name the reports directory and its parent, which `lab report` would
        # replace (rmtree) with the report; a leading dot hides the report; the suffixes
        # are the names of another protocol's report in progress or failed.
        if self.name.startswith(".") or self.name.endswith(_REPORT_SUFFIXES):
            raise ProtocolError(
                f"Protocol.name={self.name!r} is not allowed: a name may not start with '.' "
                f"(it names a directory beside the others: '.' and '..' are the reports "
                f"directory and its parent) or end with {' or '.join(_REPORT_SUFFIXES)} "
                "(another report's working names); e.g. 'mt1-quick'")
        if not self.grid:
            raise ProtocolError("Protocol.grid is empty; give at least one parameter with a "
                                "list of values, e.g. grid: {seed: [0, 1]}")
        bad = {key: value for key, value in self.grid.items()
               if not isinstance(value, list) or not value}
        if bad:
            raise ProtocolError(
                "Protocol.grid values must be non-empty lists; got "
                + ", ".join(f"{key}: {value!r}" for key, value in bad.items()))
        count = math.prod(len(values) for values in self.grid.values())
        if count > MAX_RUNS:  # every run is checked before any starts: hours, silently
            raise ProtocolError(
                f"Protocol.grid makes {count:,} runs ("
                + " x ".join(f"{len(v)} {k}" for k, v in self.grid.items())
                + f"); a protocol holds at most {MAX_RUNS:,}: split it into several "
                "protocols, or vary fewer keys at once")
        both = sorted(set(self.grid) & set(self.fixed))
        if both:
            raise ProtocolError(f"Protocol parameter(s) {', '.join(both)} are both fixed and in "
                                "the grid; keep each in one place")
        # A fixed dotted key inside a grid key's dict is applied after it (dotted keys set
        # leaves last): it would silently override that leaf of every grid value.
        shadowed = sorted(f"{f} (inside grid key {g})" for f in self.fixed for g in self.grid
                          if f.startswith(g + "."))
        if shadowed:
            raise ProtocolError(f"Protocol.fixed {', '.join(shadowed)} would override that leaf "
                                "of every grid value; set it inside each grid value instead, or "
                                "take the key out of the grid")
        # Likewise a dotted grid key inside another grid key whose dict values hold that
        # leaf: the run ids would name the dict's value, the runs would train with the
        # dotted key's. (A leaf the dicts do not hold is a product of the two: allowed.)
        overridden = []
        for k in self.grid:
            g = dotted_parent(k, self.grid)
            holding = [v for v in self.grid[g] if _holds(v, k[len(g) + 1:])] if g else []
            if holding:
                overridden.append(f"{k} (inside grid key {g}, whose value {holding[0]!r} "
                                  "sets it)")
        if overridden:
            raise ProtocolError(f"Protocol.grid {', '.join(overridden)} would override that "
                                "leaf of the other key's values, which the run ids would still "
                                "name; vary the leaf in one of the two keys only")
        _check_whole_and_dotted("Protocol.fixed", self.fixed)
        self._check_overrides()
        self._check_override_clashes()
        self._check_paths()
        self._check_threads()
        from .notebook import RESERVED  # parameters a sweep sets itself

        reserved = sorted(set(RESERVED) & {k.split(".")[0] for k in [*self.grid, *self.fixed]})
        if reserved:
            raise ProtocolError(f"Protocol parameter(s) {', '.join(reserved)} are set by the "
                                "sweep (each run's directory under `out`); remove them")


    def _check_overrides(self) -> None:
        for key, table in self.overrides.items():
            if key not in self.grid:
                raise ProtocolError(
                    f"Protocol.overrides[{key!r}]: {key!r} is not a grid key; overrides are "
                    f"keyed by grid keys: {', '.join(sorted(self.grid))}")
            if not isinstance(table, dict):
                raise ProtocolError(
                    f"Protocol.overrides[{key!r}] is a {type(table).__name__}; it must map "
                    f"values of grid[{key!r}] to parameter mappings")
            for value, params in table.items():
                if isinstance(params, dict):
                    _check_names(f"Protocol.overrides[{key!r}][{value!r}]", params)
                    _check_whole_and_dotted(f"Protocol.overrides[{key!r}][{value!r}]", params)
                # (by identity: true == 1 in Python, but they are two grid values)
                if _identity(value) not in {_identity(v) for v in self.grid[key]}:
                    raise ProtocolError(
                        f"Protocol.overrides[{key!r}][{value!r}]: {value!r} is not a value of "
                        f"grid[{key!r}] = {self.grid[key]!r}, so it would never apply")
                if not isinstance(params, dict):
                    raise ProtocolError(
                        f"Protocol.overrides[{key!r}][{value!r}] is {params!r} "
                        f"({type(params).__name__}); it must be a mapping of parameter: value")
                clash = sorted(set(params) & set(self.grid))
                if clash:
                    raise ProtocolError(f"Protocol.overrides[{key!r}][{value!r}] sets grid "
                                        f"key(s) {', '.join(clash)}; override fixed ones only")
                where = f"Protocol.overrides[{key!r}][{value!r}]"
                inside = sorted(f"{p} (inside grid key {g})" for p in params for g in self.grid
                                if p.startswith(g + "."))
                if inside:
                    raise ProtocolError(f"{where} sets {', '.join(inside)}, which would override "
                                        "that leaf of every grid value; set it inside the grid "
                                        "values instead, or take the key out of the grid")
                # Dotted keys are applied after whole dicts, so a fixed leaf inside a dict the
                # override replaces would beat the override, which is meant to win over `fixed`.
                beaten = sorted(f"Protocol.fixed {f} beats {where} {p}" for f in self.fixed
                                for p in params if "." not in p and f.startswith(p + "."))
                if beaten:
                    raise ProtocolError(
                        f"{'; '.join(beaten)}: a dotted key is applied after a whole dict, so "
                        "the override's value of that leaf would never apply; in the override, "
                        "set the leaf as the same dotted key (it then wins), or in fixed, give "
                        "the whole dict instead of the dotted key")

    def _check_override_clashes(self) -> None:
        # Two grid keys' tables that set one parameter differently meet in every run that has
        # both values (the grid is a product): one would win silently, by key order.
        tables = [(key, value, params) for key, table in self.overrides.items()
                  for value, params in table.items()]
        for i, (k1, v1, p1) in enumerate(tables):
            for k2, v2, p2 in tables[i + 1:]:
                if k1 == k2:
                    continue
                clash = sorted(p for p in p1 if p in p2 and p1[p] != p2[p])
                if clash:
                    name = clash[0]
                    raise ProtocolError(
                        f"Protocol.overrides[{k1!r}][{v1!r}] and overrides[{k2!r}][{v2!r}] both "
                        f"set {name} ({p1[name]!r} and {p2[name]!r}) for the runs with "
                        f"{k1}={v1!r} and {k2}={v2!r}; one would win silently: set "
                        f"{', '.join(clash)} in one of the two tables")

    def _check_paths(self) -> None:
        # An empty path would silently mean the current directory (the one `lab` is run
        # from), so a protocol would mean something else from another directory.
        for key, what in (("notebook", "the notebook each run executes"),
                          ("out", "the directory that holds the runs, one directory each "
                                  "(it need not exist yet)")):
            if not getattr(self, key).strip():
                raise ProtocolError(f"Protocol.{key}={getattr(self, key)!r} is blank; give "
                                    f"{what}: a path relative to the protocol file, or absolute")
        if self.report and not self.report.strip():  # ("" itself is the default: none)
            raise ProtocolError(f"Protocol.report={self.report!r} is blank; give the analysis "
                                "notebook `lab report` executes, or leave it out for none")

    def _keys_setting(self, name: str) -> list[str]:
        """Where the protocol sets parameter ``name``: fixed, grid and overrides entries."""
        found = [f"Protocol.{part} {name}={getattr(self, part)[name]!r}"
                 for part in ("fixed", "grid") if name in getattr(self, part)]
        found += [f"Protocol.overrides[{key!r}][{value!r}] {name}={params[name]!r}"
                  for key, table in self.overrides.items() if isinstance(table, dict)
                  for value, params in table.items()
                  if isinstance(params, dict) and name in params]
        return found

    def _check_threads(self) -> None:
        given = self._keys_setting("threads")
        if self.threads_per_run and given:
            raise ProtocolError(
                f"Protocol.threads_per_run={self.threads_per_run} and {', '.join(given)} both "
                "set each run's thread count; keep one: threads_per_run (the sweep gives it to "
                "the notebook's threads parameter), or threads in fixed/grid with "
                "threads_per_run: 0")

    def overrides_for(self, point: dict) -> dict:
        """The override parameters that apply to one grid point."""
        out = {}
        for key, table in sorted(self.overrides.items()):
            here = _identity(point[key])  # (true and 1 are two values, as in the run ids)
            for value, params in table.items():
                if _identity(value) == here:
                    out.update(params)
        return out


def _check_names(where: str, mapping: dict) -> None:
    """Refuse keys that are not parameter names (YAML reads ``5:`` as an int, ``~:`` as null)."""
    bad = [key for key in mapping if not isinstance(key, str)]
    if bad:
        raise ProtocolError(f"{where} has key(s) that are not parameter names: "
                            f"{', '.join(map(repr, bad))}; a key is the name of a notebook "
                            "parameter (text), or a dotted path into one")


def _check_whole_and_dotted(where: str, mapping: dict) -> None:
    """Refuse a dict parameter given whole and by a dotted key inside it in one mapping
    (as ``-p`` refuses it): the dotted key would win without a word."""
    for key in mapping:
        parent = dotted_parent(key, mapping)
        if parent is not None:
            raise ProtocolError(f"{where} sets {key}, a key inside {parent}, which it also "
                                f"gives whole ({mapping[parent]!r}); give either the whole "
                                f"{parent} or its dotted keys")


def _holds(value, path: str) -> bool:
    """Whether dict ``value`` holds the dotted ``path`` ("b.c": value["b"]["c"])."""
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return False
        value = value[part]
    return True


@dataclass(frozen=True)
class RunSpec:
    """One run of a protocol: its id, the notebook parameters, and its grid point."""

    run_id: str
    params: dict
    grid: dict


# ---------------------------------------------------------------------------
# loading and expanding


def _read_yaml(path: Path) -> dict:
    return read_yaml_mapping(path, "protocol", ProtocolError,
                             f"a YAML mapping with keys {', '.join(_yaml_keys())}")


def _yaml_keys() -> list[str]:
    return [name for name in field_names(Protocol) if name != "source"]


def _build(data: dict, path: Path) -> Protocol:
    allowed = _yaml_keys()
    unknown = sorted(set(map(str, data)) - set(allowed))
    if unknown:
        raise ProtocolError(f"protocol {path}: unknown key(s) {', '.join(unknown)}; "
                            f"allowed: {', '.join(allowed)}")
    required = [f.name for f in dataclasses.fields(Protocol)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [key for key in required if key not in data]
    if not data:  # an empty file (or only comments): say that, not four missing keys
        raise ProtocolError(f"protocol {path} is empty; a protocol is a YAML mapping with at "
                            f"least {', '.join(required)} (see protocols/demo.yaml)")
    if missing:
        raise ProtocolError(f"protocol {path}: missing key(s) {', '.join(missing)}; "
                            f"required: {', '.join(required)}")
    report = data.get("report")
    if "report" in data and report is None:  # `report:` left empty (YAML null): none
        data = {**data, "report": ""}
    if isinstance(report, str) and not report.strip():  # "" is the default's "none"
        raise ProtocolError(f"protocol {path}: Protocol.report={report!r} is blank; give the "
                            "analysis notebook `lab report` executes (a path relative to the "
                            "protocol file, or absolute), or leave the key out for none")
    here = path.parent
    # "~" is the home directory, as in a data_dir (else a directory named "~" appears).
    resolved = {key: str((here / Path(data[key]).expanduser()).resolve())
                for key in ("notebook", "out", "report") if isinstance(data.get(key), str)
                and data[key].strip()}
    # An empty section (`fixed:` with only comments under it) is YAML's null: no entries.
    empty = {key: {} for key in ("fixed", "grid", "overrides")
             if key in data and data[key] is None}
    try:
        protocol = Protocol(**{**data, **resolved, **empty, "source": str(path)})
    except ConfigError as err:
        raise ProtocolError(f"protocol {path}: {err}") from None
    _check_places(protocol, data)
    return protocol


def _check_places(protocol: Protocol, data: dict) -> None:
    """Refuse an ``out`` that cannot be a directory and a ``report`` that is one, now
    rather than in every run (and before a Dask cluster starts)."""
    out = Path(protocol.out)
    for place in (out, *out.parents):  # the nearest part of it that exists
        if place.exists():
            if not place.is_dir():
                what = "is" if place == out else f"is inside {place}, which is"
                raise ProtocolError(
                    f"protocol {protocol.source}: Protocol.out={data['out']!r} ({out}) {what} "
                    "a file, not a directory; out must be a directory that holds the runs "
                    "(it need not exist yet)")
            break
    if protocol.report and Path(protocol.report).is_dir():
        raise ProtocolError(f"protocol {protocol.source}: Protocol.report={data['report']!r} "
                            f"({protocol.report}) is a directory; give the analysis notebook "
                            "(.ipynb) `lab report` executes, or leave the key out for none")
    if protocol.report and not Path(protocol.report).exists():
        # Found now, not by `lab report` after the whole sweep has run.
        report = Path(protocol.report)
        near = sorted(p.name for p in report.parent.glob("*.ipynb")) if \
            report.parent.is_dir() else []
        raise ProtocolError(f"protocol {protocol.source}: Protocol.report={data['report']!r} "
                            f"({report}) does not exist; notebooks in {report.parent}: "
                            f"{', '.join(near) or 'none'} (or leave the key out for none)")


def _check_notebook(protocol: Protocol, configs: bool = True):
    """The notebook's NotebookSpec (without its config class unless ``configs``),
    once its file and parameter names are checked."""
    from .notebook import (
        NotebookError,
        ParameterError,
        check_parameters,
        check_trains,
        notebook_spec,
    )

    notebook = Path(protocol.notebook)
    if notebook.is_dir():
        raise ProtocolError(f"protocol {protocol.source}: notebook {notebook} is a directory; "
                            "give the notebook (.ipynb) each run executes")
    if not notebook.is_file():
        near = sorted(p.name for p in notebook.parent.glob("*.ipynb")) if \
            notebook.parent.is_dir() else []
        raise ProtocolError(f"protocol {protocol.source}: notebook {notebook} does not exist; "
                            f"notebooks in {notebook.parent}: {', '.join(near) or 'none'}")
    try:
        spec = notebook_spec(notebook, with_class=configs)
        if configs:  # (without the class it cannot tell a run from an analysis)
            check_trains(spec)
    except (NotebookError, ParameterError) as err:
        raise ProtocolError(f"protocol {protocol.source}: {err}") from None
    # Each mapping apart, so the refusal says where the name is (and with what value).
    places = [("Protocol.fixed", protocol.fixed), ("Protocol.grid", protocol.grid)] + [
        (f"Protocol.overrides[{key!r}][{value!r}]", params)
        for key, table in protocol.overrides.items() for value, params in table.items()]
    for where, params in places:
        try:
            check_parameters(notebook, params, spec.declared)
        except ParameterError as err:
            given = ", ".join(f"{k}: {params[k]!r}" for k in params
                              if k.split(".")[0] not in spec.declared)
            raise ProtocolError(f"protocol {protocol.source}: {where}"
                                f"{f' ({given})' if given else ''}: {err}") from None
    return spec


def _check_report(protocol: Protocol) -> None:
    """A ``report`` that is no analysis notebook (a training notebook, a text file) is
    found now, as a missing one is, not by `lab report` after the whole sweep."""
    from .notebook import NotebookError, check_reports, notebook_spec

    if protocol.report:
        try:
            check_reports(notebook_spec(protocol.report, with_class=False))
        except NotebookError as err:
            raise ProtocolError(f"protocol {protocol.source}: Protocol.report: {err}") from None


def _some(ids: list[str], shown: int = 8) -> str:
    # A large grid's refusal names a few runs, not thousands (one paragraph still).
    more = len(ids) - shown
    return ", ".join(ids[:shown]) + (f" and {more} more" if more > 0 else "")


def _check_runs(protocol: Protocol, spec, preflight: bool = True) -> None:
    """Build every run's config before any kernel starts; one error lists each
    distinct problem with the runs it affects. ``preflight``: also what this machine
    and its files decide (a device, a data file), which only matters to runs to be made."""
    from .notebook import resolve_parameters

    problems: dict[str, list[str]] = {}
    specs = expand(protocol)
    same: dict[Any, list[RunSpec]] = {}  # resolved config -> the grid points giving it
    for run in specs:
        try:
            resolved = resolve_parameters(protocol.notebook, run.params, spec,
                                          preflight=preflight)
        except ConfigError as err:
            problems.setdefault(str(err), []).append(run.run_id)
        else:
            same.setdefault(_config_key(resolved.asked()), []).append(run)
    if problems:
        n = sum(map(len, problems.values()))
        listed = "; ".join(f"{message} (run{'s' if len(ids) > 1 else ''} {_some(ids)})"
                           for message, ids in problems.items())
        outcome = "so none was started" if preflight else "so its runs cannot be listed"
        raise ProtocolError(f"protocol {protocol.source}: {n} of {len(specs)} runs have "
                            f"parameters the notebook refuses, {outcome}: {listed}")
    twins = [runs for runs in same.values() if len(runs) > 1]
    if twins:
        # Two ids, one config: both would execute and the report would count one result
        # twice (0 and 0.0 are one weight decay; {} and a rule's defaults are one rule).
        listed = "; ".join(" and ".join(f"{json.dumps(run.grid, sort_keys=True)} (run "
                                        f"{run.run_id})" for run in runs) for runs in twins[:3])
        more = f" (and {len(twins) - 3} more such groups)" if len(twins) > 3 else ""
        raise ProtocolError(f"protocol {protocol.source}: grid points resolve to the same "
                            f"config, so they are the same run twice: {listed}{more}; keep "
                            "one of each such group of values in the grid")


def _frozen(value: Any) -> Any:
    """``value`` hashable, equal where ``==`` holds (0 and 0.0: one hash, as Python's)."""
    if isinstance(value, dict):
        return frozenset((key, _frozen(item)) for key, item in value.items())
    if isinstance(value, list | tuple):
        return tuple(map(_frozen, value))
    return value


def _config_key(asked: dict) -> Any:
    """A resolved config as :func:`lab.notebook.config_differences` compares it (display-
    only fields aside, ``==`` on each leaf): equal keys mean that a run made with one is
    "already complete with these parameters" for the other."""
    from .config import identity

    return _frozen(identity(asked))


def load_protocol(path, *, configs: bool = True, preflight: bool = True) -> Protocol:
    """Read and validate a protocol: its keys, its notebook, its parameters (every
    run's, built into the notebook's config class when it names one) and that
    its grid gives distinct run ids. Each problem is a ProtocolError.

    ``configs=False`` skips building the configs (and importing the config
    class, hence torch): for analyses of runs already made. ``preflight=False``
    builds them but leaves out what this machine decides (a CUDA device, a data file
    that exists where the runs were made): for listing runs made elsewhere.
    """
    given, path = Path(path), Path(path).resolve()
    if not given.is_absolute() and not path.exists():
        # A notebook's relative paths are Jupyter's (from notebooks/); papermill run from
        # elsewhere reads them from its own working directory.
        raise ProtocolError(f"protocol {path} does not exist: the relative path {str(given)!r} "
                            f"is read from the working directory, {Path.cwd()}; give a path "
                            "from there, or run the notebook where its paths start (Jupyter: "
                            "the notebook's folder; papermill: --cwd notebooks)")
    protocol = _build(_included(_read_yaml(path), path), path)
    spec = _check_notebook(protocol, configs)
    _check_report(protocol)
    expand(protocol)  # duplicate run ids are a protocol error, found now
    if configs:
        _check_runs(protocol, spec, preflight)
    return protocol


INCLUDABLE = ("fixed", "overrides")


def _included(data: dict, path: Path) -> dict:
    """``data`` with each ``include`` fragment's ``fixed`` and ``overrides`` merged in (an
    override for a grid value this protocol does not run is left out); a parameter set
    both in the protocol and in a fragment (or in two fragments) is refused, so what a
    selection chose never silently loses to, or beats, a hand-written value."""
    names = data.get("include") or []
    names = [names] if isinstance(names, str) else names
    if not isinstance(names, list) or not all(isinstance(n, str) and n.strip() for n in names):
        raise ProtocolError(f"protocol {path}: include={data.get('include')!r}; give a file "
                            "name or a list of them (relative to the protocol file)")
    merged = {key: dict(data.get(key) or {}) for key in INCLUDABLE}
    owner: dict[tuple, str] = {}
    for key in merged["fixed"]:
        owner["fixed", key] = str(path)
    for grid_key, table in merged["overrides"].items():
        for value, params in (table or {}).items() if isinstance(table, dict) else ():
            for name in params or {} if isinstance(params, dict) else ():
                owner["overrides", grid_key, value, name] = str(path)
    files = []
    for name in names:
        file = (path.parent / Path(name).expanduser()).resolve()
        if not file.is_file():
            writers = _writers_of(file, path.parent)
            hint = (f"`lab select {writers[0]}` writes it" if writers else
                    "`lab select` writes one from a selection protocol (its select.into)")
            raise ProtocolError(
                f"protocol {path}: include {name!r} ({file}) does not exist; {hint}: run "
                "that first, or remove the include")
        fragment = read_yaml_mapping(file, "included fragment", ProtocolError,
                                     "a YAML mapping with fixed and/or overrides")
        odd = sorted(set(fragment) - set(INCLUDABLE))
        if odd:
            raise ProtocolError(f"included fragment {file}: key(s) {', '.join(odd)} cannot be "
                                f"included; a fragment holds {' and/or '.join(INCLUDABLE)}")
        places = [(("fixed", k), v, merged["fixed"], k)
                  for k, v in (fragment.get("fixed") or {}).items()]
        grid = data.get("grid") if isinstance(data.get("grid"), dict) else {}
        for grid_key, table in (fragment.get("overrides") or {}).items():
            # One fragment serves several protocols: entries for grid values this
            # protocol does not run are not for it.
            here = {_identity(v) for v in grid.get(grid_key) or []}
            for value, params in (table or {}).items():
                if _identity(value) not in here:
                    continue
                target = merged["overrides"].setdefault(grid_key, {}).setdefault(value, {})
                places += [(("overrides", grid_key, value, k), v, target, k)
                           for k, v in (params or {}).items()]
        for where, value, target, key in places:
            if where in owner:
                raise ProtocolError(
                    f"protocol {path}: {'.'.join(map(str, where))} is set both in "
                    f"{owner[where]} and in the included fragment {file}; keep it in one "
                    "place (a chosen value belongs to the fragment)")
            owner[where] = str(file)
            target[key] = value
        files.append(str(file))
    if not names:
        return data
    return {**data, **{k: v for k, v in merged.items() if v or k in data}, "include": files}


def _writers_of(fragment: Path, directory: Path) -> list[str]:
    """The selection protocols beside a protocol whose ``select.into`` is ``fragment``."""
    found = []
    for other in sorted(directory.glob("*.yaml")):
        try:
            into = (load_yaml(other.read_text(encoding="utf-8")) or {}).get("select", {})
            into = into.get("into") if isinstance(into, dict) else None
        except (OSError, ValueError, AttributeError):
            continue  # not a protocol this hint can read; the include's error stands
        if isinstance(into, str) and (other.parent / into).resolve() == fragment:
            found.append(str(other))
    return found


# One file name is at most 255 bytes (ext4, XFS, APFS...); `--force` renames a run to
# `<run_id>.old-<UTC time>[-n]`, so a run id leaves room for that.
MAX_RUN_ID_BYTES = 255 - len(".old-20260101T000000Z-99")
_DIGITS = 8  # hex digits of the sha256 that tells shortened or non-ASCII ids apart


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:_DIGITS]


def _safe(text: str, safe: str) -> str:
    """``text`` with each run of characters outside ``safe`` (ASCII) and the letters
    and digits of any script (NFC: one form per letter) as one "-"."""
    text = unicodedata.normalize("NFC", text)
    kept = "".join(c if c in safe or (not c.isascii() and c.isalnum()) else "\0" for c in text)
    # Only the replaced runs at the ends go: a value's own minus sign stays (-0.001 and
    # 0.001 are two runs, not one id).
    return re.sub("\0+", "-", kept.strip("\0"))


def _reads_back(text: str, value: Any) -> bool:
    """Whether ``text``, read as a -p value or a YAML file reads it, is ``value`` itself
    (same type: the string "1" is not the int 1, "True" is not true)."""
    try:
        back = load_yaml(text)
    except yaml.YAMLError:
        return False
    return type(back) is type(value) and back == value


def _label(value: Any) -> tuple[str, bool]:
    """(readable form, whether it names ``value`` exactly): a value is named exactly when
    its text is kept as it is and reads back as the same value of the same type."""
    if isinstance(value, dict):
        parts = [(_safe(str(key), _KEY_CHARS), str(key), *_label(item))
                 for key, item in sorted(value.items(), key=lambda kv: str(kv[0]))]
        # {} has no text at all (`rule_params-` would not name it): the digest names it.
        return (",".join(f"{safe}={slug}" for safe, _, slug, _ in parts),
                bool(parts) and all(safe == key and exact for safe, key, _, exact in parts))
    if isinstance(value, list | tuple):
        labels = [_label(item) for item in value]
        return ("+".join(slug for slug, _ in labels),
                bool(labels) and all(exact for _, exact in labels))
    if value is None:
        return "None", True  # as ids have always read (the string "None" is told apart
        # only when both are in one grid: see _clashing)
    if isinstance(value, bool):
        return str(value).lower(), True
    text = str(value)
    slug = _safe(text, _ID_CHARS)
    return slug, slug == text and _reads_back(text, value)


def _digest_of(value: Any) -> str:
    # A string's own text (so a non-ASCII value's id is what it always was), else its
    # JSON: the int 1 and the string "1" hash apart.
    if isinstance(value, str):
        return _digest(value)
    return _digest(json.dumps(value, sort_keys=True, ensure_ascii=False, default=repr))


def _slug(value: Any, *, clash: bool = False) -> str:
    """The value's part of a run id: its readable form, followed by a digest when that
    form does not name it exactly, or when ``clash`` (another value of the grid key reads
    the same, letter case aside)."""
    slug, exact = _label(value)
    if exact and not clash:
        return slug
    return f"{slug}-{_digest_of(value)}" if slug else _digest_of(value)


def _identity(value: Any) -> str:
    """One string per distinct grid value (1, 1.0, "1" and true apart)."""
    return f"{type(value).__name__}:{json.dumps(value, sort_keys=True, default=repr)}"


def _clashing(values: list) -> set[str]:
    """The identities of the values whose ids would coincide ignoring letter case: one
    directory on a case-insensitive file system (macOS, Windows)."""
    seen: dict[str, set[str]] = {}
    for value in values:
        seen.setdefault(_slug(value).casefold(), set()).add(_identity(value))
    return {ident for idents in seen.values() if len(idents) > 1 for ident in idents}


def run_id_for(grid_point: dict, grid: dict | None = None) -> str:
    """``key-value`` pairs in sorted key order, joined by ``_``: stable and readable.

    A value is written as itself when that text names it exactly: it holds only ASCII
    letters, digits and ``. = , + - _`` and the letters and digits of any script, and
    reads back (as -p reads it) as the same value of the same type (``seed-0``,
    ``lr-0.001``, ``drift--0.001``, ``rule-kp_traffic``, ``note-α``; null is ``None``).
    Otherwise the kept characters (each other run of characters becomes one ``-``) are
    followed by ``-`` and the first 8 hex digits of the value's sha256, so distinct
    values give distinct ids: ``a b`` -> ``a-b-<hash>``, an emoji, the empty string,
    ``{}`` or ``[]`` -> the hash alone, a string that reads as another type (``"1"``, ``"True"``) ->
    ``1-<hash>``. A list is its items' forms joined by ``+``, a dict ``key=value`` joined
    by ``,``, written as themselves when each item is (``horizons-1+5``): like ``None``
    they read as strings (``"1+5"``), which :func:`_clashing` tells apart within one
    grid key. With ``grid`` (key -> all its values, as :func:`expand` passes it),
    values of one key whose ids would be equal ignoring letter case (``b`` and ``B``:
    one directory on macOS) all get the hash too. An id longer than
    ``MAX_RUN_ID_BYTES`` bytes of UTF-8 (a file name is at most 255, and ``--force``
    appends ``.old-<time>``) is cut there and ends in ``-`` and the sha256 digits of
    the whole id: distinct, stable, and still a name the file system takes.
    """
    return _run_id(grid_point, {key: _clashing(grid[key]) for key in grid_point
                                if key in (grid or {})})


def _run_id(grid_point: dict, clashes: dict[str, set[str]]) -> str:
    # run_id_for with each key's clashing identities given: :func:`expand` finds them once
    # per key, not once per grid point (that was quadratic in a key's values: a grid of
    # 1000 seeds did not list in 200 s).
    run_id = "_".join(
        f"{key}-{_slug(value, clash=_identity(value) in clashes.get(key, ()))}"
        for key, value in sorted(grid_point.items()))
    if len(run_id.encode("utf-8")) <= MAX_RUN_ID_BYTES:
        return run_id
    room = MAX_RUN_ID_BYTES - _DIGITS - 1
    head = run_id.encode("utf-8")[:room].decode("utf-8", "ignore")  # whole characters
    return f"{head}-{_digest(run_id)}"


def spec_differences(spec: RunSpec, runs) -> dict[str, list[str]]:
    """run_id -> ``"key: <run's> there vs <protocol's> in the protocol"`` for each of the
    spec's parameters a finished run of it holds otherwise; runs without differences
    are left out.

    ``runs`` is ``records.load_runs``' table (its ``config.*`` columns). This is the
    torch-free check behind ``stale`` in ``lab runs PROTOCOL`` and the analysis: an
    edited protocol must not pass off the runs of its old version as its own. (A sweep
    checks more: the whole resolved config, defaults included.)
    """
    from .config import identity
    from .notebook import apply_params  # dotted keys nested as the notebook receives them

    wanted = records.config_columns(identity(apply_params({}, spec.params)))
    out = {}
    for row in runs[runs["run_id"] == spec.run_id].to_dict("records"):
        diffs = []
        legacy = records.config_columns(with_legacy_params(
            {"rule": row.get("config.rule"), "rule_params": {}}))
        for column, value in sorted(wanted.items()):
            there = row.get(column, legacy.get(column, "(absent)"))
            if isinstance(there, float) and there != there:  # configs hold no NaN: absent
                there = "(absent)"
            if there != value:
                diffs.append(f"{column.removeprefix('config.')}: {there!r} there vs "
                             f"{value!r} in the protocol")
        if diffs:
            out[row["run_id"]] = diffs
    return out


# How a stale run's reason starts when the directory holds another run (copied or renamed
# into place): that reason is the whole message, not "not what the protocol asks now".
MISPLACED = "its record's run_id is"


def stale_runs(protocol: Protocol, *, mixed_code: bool = False) -> dict[str, str]:
    """run_id -> why, for each recorded run of ``protocol`` that is not what the protocol
    asks now: its whole resolved config (the notebook's defaults included, as a sweep
    resolves it) differs, the notebook's code changed since (unless ``mixed_code``: the
    caller takes runs of other code versions knowingly), or a data file it read has
    changed since. A record from before the code was recorded is "code unknown": not
    stale for that alone.

    What ``lab runs PROTOCOL`` and ``lab report`` check (it needs the notebook's config
    class, hence torch); the analysis library's own check (:func:`mark_stale`) is the
    torch-free part of it. Threads are compared as a sweep's :func:`plan` does: when the
    protocol leaves them to the machine, a run's recorded count is taken as given.
    """
    from .data.identity import changed_files
    from .notebook import _article, asked_differences, notebook_spec, resolve_parameters

    nb = notebook_spec(protocol.notebook)
    stale = {}
    for spec in expand(protocol):
        record = _read_record(Path(protocol.out) / spec.run_id)
        if record is None:
            continue  # missing or unreadable: reported as such elsewhere
        if record.get("run_id", spec.run_id) != spec.run_id:
            # A run copied or renamed into place: its values differ for that reason, so
            # name it (as the analysis does) rather than the values.
            stale[spec.run_id] = (f"{MISPLACED} {record['run_id']!r}, not "
                                  f"{spec.run_id!r}, the run the protocol expects in this "
                                  "directory (a run copied or renamed into place?): move it "
                                  "to a directory named after its run_id, or replace it "
                                  "(`lab sweep --force`)")
            continue
        params = _run_params(spec, nb.declared, _threads(protocol, protocol.workers, record))
        resolved = resolve_parameters(protocol.notebook, params, nb, preflight=False)
        there = records.another_trainers(record, resolved.kind)
        if there:  # every field would differ: name the kinds, as lab sweep does
            stale[spec.run_id] = (f"it holds {_article(there)} {there} run, and the protocol's "
                                  f"notebook makes {resolved.kind} runs")
            continue
        # Compared as a sweep's lab.notebook.decide compares (the notebook's own
        # parameters included).
        why = asked_differences(record, resolved)
        code = None if mixed_code else nb.code.changed_since(record)
        why += [code] if code else []
        why += changed_files(record.get("data"), resolved.config.get("data_dir"))
        if why:
            stale[spec.run_id] = "; ".join(why)
    return stale


def mark_stale(runs, specs: list[RunSpec], why: dict[str, str] | None = None):
    """``runs`` (load_runs' table) with status ``stale`` and the reason as ``error`` for
    every run in ``why`` (run_id -> reason; default: :func:`spec_differences`, torch-free;
    :func:`stale_runs` is the whole check)."""
    if why is None:
        why = {run_id: "; ".join(diffs) for spec in specs
               for run_id, diffs in spec_differences(spec, runs).items()}
    runs = runs.copy()
    for run_id, reason in why.items():
        at = runs["run_id"] == run_id
        runs.loc[at, "status"] = "stale"
        runs.loc[at, "error"] = reason if reason.startswith(MISPLACED) else (
            f"it is not what the protocol asks now ({reason}): rerun with `lab sweep --force`")
    return runs


def _data_paths(params: dict, source: str) -> dict:
    """``params`` with each data path (a text parameter named ``*_path`` or ``*_dir``, but
    ``out_dir``) relative to the protocol file ``source``, as a config stores it (``~``
    expanded, absolute, symlinks resolved); "" stays "" (the default). So a protocol reads
    the same files from any working directory (run ids keep the grid's text)."""
    if not source:
        return params
    base = Path(source).parent
    return {key: str((base / Path(value).expanduser()).resolve())
            if (key.endswith(("_path", "_dir")) and key != "out_dir" and isinstance(value, str)
                and value.strip()) else value
            for key, value in params.items()}


def expand(protocol: Protocol) -> list[RunSpec]:
    """Every grid combination as a RunSpec; duplicate run ids are a ProtocolError."""
    keys = sorted(protocol.grid)
    clashes = {key: _clashing(protocol.grid[key]) for key in keys}
    specs = []
    for values in itertools.product(*(protocol.grid[key] for key in keys)):
        point = dict(zip(keys, values))
        params = {**protocol.fixed, **protocol.overrides_for(point), **point}
        params = _data_paths(params, protocol.source)
        specs.append(RunSpec(_run_id(point, clashes), params, point))
    # Letter case aside: ids that differ only in case are one directory on macOS.
    groups: dict[str, list[RunSpec]] = {}
    for spec in specs:
        groups.setdefault(spec.run_id.casefold(), []).append(spec)
    duplicated = sorted(folded for folded, same in groups.items() if len(same) > 1)
    if duplicated:
        def clash(folded: str) -> str:
            same = groups[folded]
            return (" / ".join(dict.fromkeys(s.run_id for s in same)) + " from "
                    + " and ".join(json.dumps(s.grid, sort_keys=True, default=repr)
                                   for s in same))

        # The cause first, per key (a value listed twice, 0.1 and 1e-1), then a few of
        # the runs it doubles: a long grid's every clash made a message of 80 KB.
        causes = []
        for key in keys:
            parts: dict[str, list] = {}
            for value in protocol.grid[key]:
                parts.setdefault(_slug(value).casefold(), []).append(value)
            causes += [f"{key}: {' and '.join(map(repr, same))} give one id ({key}-"
                       f"{_slug(same[0])})" for same in parts.values() if len(same) > 1]
        shown = duplicated[:3]
        clashes = "; ".join(map(clash, shown)) + (
            f"; and {len(duplicated) - len(shown)} more" if len(duplicated) > len(shown) else "")
        raise ProtocolError(f"protocol {protocol.source or protocol.name}: the grid gives "
                            f"{len(duplicated)} duplicate run id(s)"
                            + (f" ({'; '.join(causes[:5])})" if causes else "")
                            + f": {clashes}; make the grid values distinct")
    return specs


# ---------------------------------------------------------------------------
# the sweep

# How a run of a sweep ended: complete | diverged | failed (executed or kept), stale
# (finished with other parameters), unreadable (its record cannot be read), locked
# (another process works in it). The last three were left untouched.
LEFT_ALONE = ("stale", "unreadable", "locked")


@dataclass
class RunOutcome:
    """How one run of a sweep ended (plain data: it travels back from Dask workers)."""

    run_id: str
    status: str  # complete | diverged | failed | stale | unreadable | locked
    error: str | None = None
    skipped: bool = False  # not executed this time (already finished, or left alone)
    wall_s: float = 0.0
    moved_aside: str | None = None  # where --force kept the run it replaced


@dataclass
class SweepReport:
    """Every run of a protocol with its outcome, in the protocol's order."""

    protocol: str
    out: str
    outcomes: list[RunOutcome]
    wall_s: float = 0.0

    @property
    def failed(self) -> list[RunOutcome]:
        return [o for o in self.outcomes if o.status == "failed"]

    @property
    def diverged(self) -> list[RunOutcome]:
        """Runs that ended ``diverged`` (a finished result, reported apart from failures)."""
        return [o for o in self.outcomes if o.status == "diverged"]

    @property
    def left_alone(self) -> list[RunOutcome]:
        """Runs this sweep could not execute: stale, unreadable or locked."""
        return [o for o in self.outcomes if o.status in LEFT_ALONE]

    @property
    def executed(self) -> list[RunOutcome]:
        return [o for o in self.outcomes if not o.skipped]

    def table(self):
        import pandas as pd

        return pd.DataFrame([dataclasses.asdict(o) for o in self.outcomes],
                            columns=[f.name for f in dataclasses.fields(RunOutcome)])

    def summary(self) -> str:
        kept = sum(o.skipped and o.status in ("complete", "diverged") for o in self.outcomes)
        count = Counter(o.status for o in self.left_alone)
        lines = [f"{self.protocol}: {len(self.outcomes)} runs, {len(self.executed)} executed, "
                 f"{kept} already finished, {count['locked']} locked by another process, "
                 f"{count['stale'] + count['unreadable']} left alone (stale or unreadable), "
                 f"{len(self.failed)} failed, {len(self.diverged)} diverged in "
                 f"{self.wall_s:.1f} s; runs in {self.out}"]
        lines += [f"  {o.status.upper()} {o.run_id}: {o.error}"
                  for o in self.outcomes if o.status in ("failed", "diverged", *LEFT_ALONE)]
        lines += [f"  replaced {o.run_id}: the old run is kept in {o.moved_aside}"
                  for o in self.outcomes if o.moved_aside]
        if count["locked"]:
            # Two sweeps of one protocol: the other may well have finished it by now.
            lines.append("  (a locked run is another process's to finish, and it may have "
                         "by now: `lab runs` on the protocol shows where each run stands)")
        return "\n".join(lines)


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def kernel_env() -> dict[str, str | None]:
    """The sweeping process's own values of what the Dask nanny sets in workers.

    The nanny sets ``distributed.nanny.pre-spawn-environ`` in each worker
    (MALLOC_TRIM_THRESHOLD_=65536 among them, which slows torch training by
    some 15 %); a run's kernel gets the values this process had before any
    nanny (None: unset). A LocalCluster's nannies live in this process and
    write their values into its os.environ for good, hence the snapshot taken
    at import. Thread counts are set per run anyway.
    """
    import dask
    import distributed  # noqa: F401 (registers the distributed.* config)

    from .notebook import THREAD_VARS

    keys = dask.config.get("distributed.nanny.pre-spawn-environ", {}) or {}
    return {key: _ENV_AT_IMPORT.get(key) for key in keys if key not in THREAD_VARS}


def _left_alone(run_id: str, err: Exception) -> RunOutcome:
    from .notebook import RunConflict
    from .runlock import RunLocked

    if isinstance(err, RunLocked):
        return RunOutcome(run_id, "locked", str(err), skipped=True)
    status = err.reason if isinstance(err, RunConflict) else "unreadable"
    return RunOutcome(run_id, status, str(err), skipped=True)


def _execute_run(notebook: str, run_dir: str, run_id: str, params: dict, threads: int,
                 env: dict, replace: str, spec) -> dict:
    """One Dask task: decide under the run's lock, then execute; never raises for a run."""
    from .notebook import RunConflict, execute
    from .runlock import RunLocked

    start = time.perf_counter()
    try:
        result = execute(notebook, run_dir, params, run_id=run_id, threads=threads, env=env,
                         replace=replace, spec=spec)
    except (RunLocked, RunConflict) as err:  # the run changed hands since the plan
        return dataclasses.asdict(_left_alone(run_id, err))
    except (ConfigError, OSError) as err:  # refused before running; nothing was written
        return dataclasses.asdict(RunOutcome(run_id, "failed", f"{type(err).__name__}: {err}",
                                             skipped=True, wall_s=time.perf_counter() - start))
    moved = str(result.moved_aside) if result.moved_aside else None
    # A run directory moved away mid-run reads "interrupted" where it is now; for the
    # sweep it is a run its `out` did not get: failed, with the error naming where it is.
    status = "failed" if result.moved_away else result.status
    return dataclasses.asdict(RunOutcome(run_id, status, result.error,
                                         skipped=result.skipped, wall_s=result.wall_s,
                                         moved_aside=moved))


def _connect(scheduler: str):
    """A Client of the scheduler at ``scheduler``, or SchedulerError: an address where
    nothing listens, or where something else answers (an HTTP server made the handshake
    wait past Client's own timeout; a stray reply failed deep in distributed with a
    traceback). Connected in a helper thread, given CONNECT_S in all."""
    from distributed import Client

    def refused(why: str) -> SchedulerError:
        return SchedulerError(f"cannot reach the Dask scheduler {scheduler!r} ({why}); give "
                              "its address as tcp://host:port, or leave --scheduler out for "
                              "a local cluster")

    why = _unreachable(scheduler)
    if why:
        raise refused(why)
    got: list = []

    def connect() -> None:
        try:
            got.append(Client(scheduler, timeout=f"{CONNECT_S}s"))
        except Exception as err:  # whatever the address gave instead of a scheduler
            got.append(err)

    # A daemon thread: a handshake that never ends must not hold the process's exit.
    thread = threading.Thread(target=connect, name="lab-connect", daemon=True)
    thread.start()
    thread.join(CONNECT_S + 5)
    if not got:
        raise refused(f"no Dask scheduler answered there in {CONNECT_S + 5} s")
    if isinstance(got[0], Exception):
        raise refused(f"{type(got[0]).__name__}: {got[0]}"[:300])
    return got[0]


def _unreachable(scheduler: str) -> str | None:
    """Why a TCP address surely has no scheduler (its host unknown, or nothing listening
    on its port), found at once; None otherwise (it may answer, or is not TCP). distributed
    itself retries a refused connection until its timeout, then reports a timeout."""
    import socket

    from distributed.comm.addressing import parse_address, parse_host_port

    try:
        kind, where = parse_address(scheduler)
        host, port = parse_host_port(where)
    except Exception:  # (not host:port: distributed says what it makes of the address)
        return None
    if kind not in ("tcp", "tls"):
        return None
    try:
        socket.create_connection((host, port), timeout=min(5, CONNECT_S)).close()
    except socket.gaierror as err:
        return f"no host named {host!r}: {err.strerror}"
    except ConnectionRefusedError:
        return f"nothing listens on port {port} of {host} (connection refused)"
    except OSError:  # a timeout, no route, ...: left to distributed's own attempts
        return None
    return None


CONNECT_S = 20  # seconds to reach a --scheduler (Client's timeout; the wait adds 5)
WORKER_WAIT_S = 30  # seconds for a --scheduler to have a worker before the sweep gives up


@contextlib.contextmanager
def _client(scheduler: str | None, workers: int):
    from distributed import Client, LocalCluster

    if scheduler:
        client = _connect(scheduler)
        with client:
            try:  # a scheduler without workers would leave the sweep at 0 % for ever
                client.wait_for_workers(1, timeout=WORKER_WAIT_S)
            except (TimeoutError, OSError):  # (distributed's WorkerStartTimeoutError too)
                raise SchedulerError(
                    f"the Dask scheduler {scheduler!r} has no workers (none joined in "
                    f"{WORKER_WAIT_S:g} s); start one (`dask worker {scheduler}`), or leave "
                    "--scheduler out for a local cluster") from None
            yield client
        return
    # One single-threaded worker process per concurrent run: each runs one
    # notebook at a time, and its kernel's threads are set per run. No dashboard;
    # the scheduler's own HTTP server takes any free port, so two sweeps at once
    # never warn "Port 8787 is already in use".
    with _quiet_when_interrupted() as interrupted, \
            LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                         dashboard_address=None, scheduler_kwargs={"dashboard_address": ":0"},
                         silence_logs=logging.ERROR) as cluster, Client(cluster) as client:
        try:
            yield client
        except (KeyboardInterrupt, SystemExit):
            interrupted()  # before the cluster's shutdown, which runs as this propagates
            raise


@contextlib.contextmanager
def _quiet_when_interrupted():
    """Yield a function that silences distributed's loggers until this context ends.

    Called on Ctrl-C (or SIGTERM's exit) while the cluster inside shuts down: a nanny
    whose worker died of the same signal may log a CancelledError traceback, which
    would bury the CLI's one line on how to resume. Otherwise nothing is silenced (a
    log may tell why a sweep broke), and the levels are restored once the cluster is
    closed."""
    saved: dict[logging.Logger, int] = {}

    def silence() -> None:
        names = ["distributed", *(name for name in logging.root.manager.loggerDict
                                  if name.startswith("distributed."))]
        for logger in map(logging.getLogger, names):
            saved.setdefault(logger, logger.level)
            logger.setLevel(logging.CRITICAL + 1)

    try:
        yield silence
    finally:
        for logger, level in saved.items():
            logger.setLevel(level)


def _run_params(spec: RunSpec, declared: dict, threads: int) -> dict:
    params = dict(spec.params)
    if "threads" in declared and "threads" not in params:
        params["threads"] = threads
    return params


def _read_record(run_dir: Path) -> dict | None:
    try:
        return records.load_record(run_dir, rows=False)
    except (records.RecordError, FileNotFoundError, OSError):
        return None


def _threads(protocol: Protocol, n_workers: int, record: dict | None = None) -> int:
    """The thread count a run is resolved with (unless its parameters set ``threads``).

    ``threads_per_run`` when the protocol sets it; otherwise (0: the machine decides) the
    count ``record`` (a finished or interrupted run's) was made with, so the same run
    is not stale under another worker count: threads change float rounding, not what
    was asked; and for a new run, the usable cores shared among ``n_workers``.
    """
    if protocol.threads_per_run:
        return protocol.threads_per_run
    recorded = _recorded_threads(record)
    return max(1, usable_cores() // n_workers) if recorded is None else recorded


def _recorded_threads(record: dict | None) -> int | None:
    config = (record or {}).get("config")
    recorded = config.get("threads") if isinstance(config, dict) else None
    return recorded if isinstance(recorded, int) and not isinstance(recorded, bool) else None


def plan(protocol: Protocol, threads: int | None = None, *, force: bool = False,
         nb=None, preflight: bool = True) -> tuple[list[RunSpec], dict[str, RunOutcome | None]]:
    """The protocol's runs, each with the parameters it executes with (``threads``
    included when the notebook declares it), and for each the outcome of leaving it
    alone (None: it must execute), decided from its record.json and lock only.

    ``threads``: the per-run thread count of a new run (part of the config; default:
    as a local sweep with the protocol's workers would set it). With
    ``threads_per_run: 0`` and no ``threads`` in the protocol, a run already made
    keeps its recorded count, as :func:`stale_runs` compares it. ``force``: stale
    and unreadable runs are to be replaced, so they execute (afresh, with
    ``threads``). ``preflight``: check what this machine decides (threads against its
    cores, a device, data files) — not for runs a remote cluster executes. A run's
    parameters refused here are a ProtocolError: nothing has started.
    """
    from .notebook import RunConflict, decide, notebook_spec, resolve_parameters
    from .runlock import RunLocked

    nb = notebook_spec(protocol.notebook) if nb is None else nb
    threads = _threads(protocol, protocol.workers) if threads is None else threads
    specs = []
    out = Path(protocol.out)
    replace = "conflicting" if force else "never"
    outcomes: dict[str, RunOutcome | None] = {}

    def resolved(run_id: str, params: dict):
        try:
            return resolve_parameters(protocol.notebook, params, nb, preflight=preflight)
        except ConfigError as err:  # e.g. threads_per_run far above this machine's cores
            raise ProtocolError(f"protocol {protocol.source}: run {run_id} would execute "
                                "with parameters the notebook refuses, so none was started: "
                                f"{err}") from None

    for spec in expand(protocol):
        recorded = None if protocol.threads_per_run or "threads" not in nb.declared else \
            _recorded_threads(_read_record(out / spec.run_id))
        params = _run_params(spec, nb.declared, threads if recorded is None else recorded)
        try:
            decision, state = decide(out / spec.run_id, resolved(spec.run_id, params), replace)
            if decision == "replace" and params != _run_params(spec, nb.declared, threads):
                params = _run_params(spec, nb.declared, threads)  # a new run: this machine's
                decision, state = decide(out / spec.run_id, resolved(spec.run_id, params),
                                         replace)
        except (RunLocked, RunConflict) as err:
            outcomes[spec.run_id] = _left_alone(spec.run_id, err)
        else:
            outcomes[spec.run_id] = RunOutcome(spec.run_id, state.status, skipped=True) \
                if decision == "done" else None
        specs.append(dataclasses.replace(spec, params=params))
    return specs, outcomes


def run_sweep(protocol: Protocol, scheduler: str | None = None, workers: int | None = None, *,
              progress: bool = True, force: bool = False) -> SweepReport:
    """Execute every unfinished run of ``protocol``; see the module docstring.

    ``force``: runs finished with other parameters (stale) or with an unreadable
    record are moved aside (``<run>.old-<time>``) and run afresh.
    """
    from tqdm import tqdm

    from .notebook import notebook_spec

    start = time.perf_counter()
    if not scheduler:  # (a cluster's workers write `out` on their shared file system)
        _check_writable(protocol)
    nb = notebook_spec(protocol.notebook)
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int)
                                or workers < 1):
        raise ProtocolError(f"workers={workers!r}: give a whole number >= 1 (local Dask worker "
                            "processes), or None for the protocol's")
    workers = workers or protocol.workers
    env = kernel_env()  # before a LocalCluster's nannies edit os.environ
    with contextlib.ExitStack() as stack:
        client = None
        if scheduler:  # the cluster's worker count sets the default threads per run
            client = stack.enter_context(_client(scheduler, workers))
            workers = len(client.scheduler_info().get("workers", {})) or workers
        threads = _threads(protocol, workers)
        specs, outcomes = plan(protocol, threads, force=force, nb=nb,
                               preflight=not scheduler)
        todo = [spec for spec in specs if outcomes[spec.run_id] is None]
        if todo:
            if client is None:
                workers = _local_workers(workers, [_kernel_threads(spec.params, threads)
                                                   for spec in todo])
            client = client or stack.enter_context(_client(None, workers))
            out = Path(protocol.out)
            replace = "conflicting" if force else "never"
            futures = {}
            for spec in todo:  # (plan gave each its parameters, threads included)
                future = client.submit(
                    _execute_run, protocol.notebook, str(out / spec.run_id), spec.run_id,
                    spec.params, _kernel_threads(spec.params, threads), env, replace, nb,
                    key=f"{spec.run_id}-{uuid.uuid4().hex[:8]}", pure=False)
                futures[future] = spec
            outcomes.update(_collect(futures, out, protocol.name, progress, tqdm))
    return SweepReport(protocol.name, protocol.out, [outcomes[s.run_id] for s in specs],
                       time.perf_counter() - start)


def _check_writable(protocol: Protocol) -> None:
    """Refuse an ``out`` this process cannot make or write, or one inside a run's
    directory, before Dask starts (each run would otherwise fail alone with a bare
    PermissionError): ``lab.runlock.check_runs_dir``, in the protocol's name."""
    from .runlock import check_runs_dir

    try:
        check_runs_dir(Path(protocol.out), "Protocol.out")
    except ConfigError as err:
        raise ProtocolError(f"protocol {protocol.source or protocol.name}: {err}") from None


def _local_workers(workers: int, threads: list[int]) -> int:
    """The local worker processes for runs of ``threads`` kernel threads each: no more
    than the runs (an idle worker is a process for nothing), said in one line; and a
    warning when the busy workers' threads exceed this machine's cores (not capped:
    oversubscribing may be meant, e.g. runs that wait on I/O)."""
    if workers > len(threads):
        print(f"{workers} workers asked, {len(threads)} run(s) to execute: starting "
              f"{len(threads)} worker process(es)", file=sys.stderr)
        workers = len(threads)
    busy = sum(sorted(threads, reverse=True)[:workers])  # the most running at once
    cores = usable_cores()
    if busy > cores:
        per = threads[0] if len(set(threads)) == 1 else f"up to {max(threads)}"
        print(f"warning: {workers} workers x {per} thread(s) per run = {busy} threads on "
              f"{cores} core(s): the runs will share cores and each go slower (fewer "
              "--workers or a smaller threads_per_run would fit)", file=sys.stderr)
    return workers


def _kernel_threads(params: dict, threads: int) -> int:
    """The kernel's OMP/MKL/Numba threads: the run's own ``threads`` when it sets one."""
    given = params.get("threads")
    if isinstance(given, int) and not isinstance(given, bool) and given > 0:
        return given
    return threads


def _scheduler_lost(error: str) -> bool:
    """Whether a task's error is the Dask scheduler's loss (its futures cancelled), not
    the task's own failure: the run may still be training on its worker."""
    return "scheduler-connection-lost" in error or "CancelledError" in error.split(":")[0]


def _record_lost_worker(out: Path, spec: RunSpec, error: str) -> RunOutcome:
    """A worker died (KilledWorker) or the task broke: mark the run's record
    failed, unless another process has taken the run over meanwhile. A run that
    wrote no record yet stays without one (it is simply executed next time).

    With the scheduler lost, a run without a record never started here (it is not
    counted executed), and one whose worker still holds it may well finish: said so,
    instead of a bare "locked" or "failed"."""
    from .notebook import mark_failed
    from .runlock import RunLocked, acquire

    lost = _scheduler_lost(error)
    run_dir = out / spec.run_id
    if not (run_dir / records.RECORD_FILE).exists():
        if lost:
            return RunOutcome(spec.run_id, "failed", "the Dask scheduler was lost before "
                              f"this run started ({error}); nothing was made: run the sweep "
                              "again", skipped=True)
        return RunOutcome(spec.run_id, "failed", error)
    try:
        with acquire(run_dir):
            mark_failed(run_dir, spec.run_id, spec.params, error)
    except RunLocked as err:
        if lost:
            return RunOutcome(spec.run_id, "locked", "the Dask scheduler was lost while this "
                              f"run trained; its worker still holds it ({err}) and may finish "
                              "it: `lab runs` on the protocol shows where it stands",
                              skipped=True)
        return RunOutcome(spec.run_id, "locked", f"{error}; then {err}", skipped=True)
    return RunOutcome(spec.run_id, "failed", error)


def _collect(futures: dict, out: Path, name: str, progress: bool, tqdm) -> dict:
    from distributed import as_completed

    outcomes = {}
    bar = tqdm(total=len(futures), desc=name, unit="run", disable=not progress)
    for future in as_completed(futures):
        spec = futures[future]
        try:
            outcome = RunOutcome(**future.result())
        except Exception as err:  # the worker died (KilledWorker) or the task broke
            outcome = _record_lost_worker(out, spec, f"{type(err).__name__}: {err}")
        outcomes[spec.run_id] = outcome
        bar.update()
        bar.set_postfix(failed=sum(o.status == "failed" for o in outcomes.values()))
        if outcome.status in ("failed", *LEFT_ALONE):
            bar.write(f"{outcome.status.upper()} {spec.run_id}: {outcome.error}")
    bar.close()
    return outcomes
