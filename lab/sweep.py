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
      rule: [bp]
      seed: [0, 1]

Relative paths are relative to the protocol file, so a protocol means the same
from any working directory. Every ``fixed`` and ``grid`` key must be a
parameter the notebook declares; ``out_dir`` is the sweep's to set.

:func:`expand` turns the grid into runs with stable, readable ids
(``rule-bp_seed-0``: sorted grid keys). :func:`run_sweep` skips runs that are
finished, executes the rest with :func:`lab.notebook.execute`, one Dask task
per run, and records failures without stopping the others. A run is finished
only when its record says ``complete`` *and* its executed notebook carries the
outcome that ``execute`` writes last, so a run killed anywhere before the end
is executed again (and ``train_conv`` resumes it from its checkpoint).

Dask: a ``LocalCluster`` of single-threaded worker processes by default, or
``Client(address)`` for a cluster (a shared file system for ``out`` is then
assumed, and workers should run with ``--nthreads 1``); the same code path
either way. Each run's kernel gets ``threads_per_run`` threads (OMP/MKL
variables, and the notebook's ``threads`` parameter when it declares one), so
runs do not oversubscribe the cores. The thread count is part of a run's
config (sums may round differently), so a protocol meant to reproduce across
machines sets ``threads_per_run`` rather than relying on the core count.
A finished run whose parameters differ from the protocol's now is reported
as failed ("stale") rather than silently kept or overwritten.

Dask starts local workers with ``spawn``: a script calling :func:`run_sweep`
needs the ``if __name__ == "__main__":`` guard (the CLI has it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import os
import re
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from . import records
from .config import ConfigError, bounded, field_names, validate

SEED_KEY = "seed"
RESERVED = ("out_dir",)  # parameters a sweep sets itself
_UNSAFE = re.compile(r"[^A-Za-z0-9.=,+-]+")
_ENV_AT_IMPORT = dict(os.environ)  # before any in-process Dask nanny edits it (kernel_env)


class ProtocolError(ConfigError):
    """A protocol file that cannot be run: unreadable, malformed or inconsistent."""


@dataclass(frozen=True)
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
    source: str = ""  # the YAML file it came from

    def __post_init__(self):
        validate(self)
        if not self.name or _UNSAFE.search(self.name):
            raise ProtocolError(f"Protocol.name={self.name!r} is not allowed; use a non-empty "
                                "name of letters, digits and . = , + - (it names directories)")
        if not self.grid:
            raise ProtocolError("Protocol.grid is empty; give at least one parameter with a "
                                "list of values, e.g. grid: {seed: [0, 1]}")
        bad = {key: value for key, value in self.grid.items()
               if not isinstance(value, list) or not value}
        if bad:
            raise ProtocolError(
                "Protocol.grid values must be non-empty lists; got "
                + ", ".join(f"{key}: {value!r}" for key, value in bad.items()))
        both = sorted(set(self.grid) & set(self.fixed))
        if both:
            raise ProtocolError(f"Protocol parameter(s) {', '.join(both)} are both fixed and in "
                                "the grid; keep each in one place")
        self._check_overrides()
        reserved = sorted(set(RESERVED) & (set(self.grid) | set(self.fixed)))
        if reserved:
            raise ProtocolError(f"Protocol parameter(s) {', '.join(reserved)} are set by the "
                                "sweep (each run's directory under `out`); remove them")


    def _check_overrides(self) -> None:
        for key, table in self.overrides.items():
            if key not in self.grid or not isinstance(table, dict):
                raise ProtocolError(
                    f"Protocol.overrides[{key!r}] must map values of the grid key {key!r} "
                    f"to parameter mappings; grid keys: {', '.join(sorted(self.grid))}")
            for value, params in table.items():
                if value not in self.grid[key] or not isinstance(params, dict):
                    raise ProtocolError(
                        f"Protocol.overrides[{key!r}][{value!r}] must be a mapping for a value "
                        f"in grid[{key!r}] = {self.grid[key]!r}")
                clash = sorted(set(params) & set(self.grid))
                if clash:
                    raise ProtocolError(f"Protocol.overrides[{key!r}][{value!r}] sets grid "
                                        f"key(s) {', '.join(clash)}; override fixed ones only")

    def overrides_for(self, point: dict) -> dict:
        """The override parameters that apply to one grid point."""
        out = {}
        for key, table in sorted(self.overrides.items()):
            out.update(table.get(point[key], {}))
        return out


@dataclass(frozen=True)
class RunSpec:
    """One run of a protocol: its id, the notebook parameters, and its grid point."""

    run_id: str
    params: dict
    grid: dict


# ---------------------------------------------------------------------------
# loading and expanding


def _read_yaml(path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ProtocolError(f"protocol {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ProtocolError(f"protocol {path} cannot be read ({err}); expected a YAML "
                            "text file") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        where = getattr(err, "problem_mark", None)
        line = f" at line {where.line + 1}" if where else ""
        raise ProtocolError(f"protocol {path} is not valid YAML{line} "
                            f"({getattr(err, 'problem', err)}); expected a YAML mapping with "
                            f"keys {', '.join(_yaml_keys())}") from None
    if not isinstance(data, dict):
        raise ProtocolError(f"protocol {path} holds a {type(data).__name__}, not a mapping; "
                            f"expected a YAML mapping with keys {', '.join(_yaml_keys())}")
    return data


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
    if missing:
        raise ProtocolError(f"protocol {path}: missing key(s) {', '.join(missing)}; "
                            f"required: {', '.join(required)}")
    here = path.parent
    resolved = {key: str((here / data[key]).resolve())
                for key in ("notebook", "out", "report") if isinstance(data.get(key), str)
                and data[key]}
    try:
        return Protocol(**{**data, **resolved, "source": str(path)})
    except ConfigError as err:
        raise ProtocolError(f"protocol {path}: {err}") from None


def _check_notebook(protocol: Protocol) -> None:
    from .notebook import NotebookError, ParameterError, check_parameters

    notebook = Path(protocol.notebook)
    if not notebook.is_file():
        near = sorted(p.name for p in notebook.parent.glob("*.ipynb")) if \
            notebook.parent.is_dir() else []
        raise ProtocolError(f"protocol {protocol.source}: notebook {notebook} does not exist; "
                            f"notebooks in {notebook.parent}: {', '.join(near) or 'none'}")
    try:
        overridden = {k: v for table in protocol.overrides.values() for params in
                      table.values() for k, v in params.items()}
        check_parameters(notebook, {**protocol.fixed, **overridden, **protocol.grid})
    except (NotebookError, ParameterError) as err:
        raise ProtocolError(f"protocol {protocol.source}: {err}") from None


def load_protocol(path) -> Protocol:
    """Read and validate a protocol: its keys, its notebook and its parameters,
    and that its grid gives distinct run ids. Each problem is a ProtocolError."""
    path = Path(path).resolve()
    protocol = _build(_read_yaml(path), path)
    _check_notebook(protocol)
    expand(protocol)  # duplicate run ids are a protocol error, found now
    return protocol


def _slug(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, dict):
        return ",".join(f"{key}={_slug(item)}" for key, item in sorted(value.items()))
    if isinstance(value, list | tuple):
        return "+".join(_slug(item) for item in value)
    # Run ids name directories: anything but a few safe characters becomes "-".
    return _UNSAFE.sub("-", str(value)).strip("-") or "none"


def run_id_for(grid_point: dict) -> str:
    """``key-value`` pairs in sorted key order, joined by ``_``: stable and readable."""
    return "_".join(f"{key}-{_slug(grid_point[key])}" for key in sorted(grid_point))


def expand(protocol: Protocol) -> list[RunSpec]:
    """Every grid combination as a RunSpec; duplicate run ids are a ProtocolError."""
    keys = sorted(protocol.grid)
    specs = []
    for values in itertools.product(*(protocol.grid[key] for key in keys)):
        point = dict(zip(keys, values))
        params = {**protocol.fixed, **protocol.overrides_for(point), **point}
        specs.append(RunSpec(run_id_for(point), params, point))
    counts = Counter(spec.run_id for spec in specs)
    duplicated = sorted(run_id for run_id, n in counts.items() if n > 1)
    if duplicated:
        clashes = "; ".join(
            f"{run_id} from " + " and ".join(
                json.dumps(s.grid, sort_keys=True) for s in specs if s.run_id == run_id)
            for run_id in duplicated)
        raise ProtocolError(f"protocol {protocol.source or protocol.name}: the grid gives "
                            f"duplicate run ids: {clashes}; make the grid values distinct")
    return specs


# ---------------------------------------------------------------------------
# run state


def run_state(run_dir, params: dict | None = None) -> str:
    """missing | running | failed | diverged | unfinished | stale | complete.

    ``unfinished``: the record says complete but the notebook never finished
    (killed in its last cells). ``stale``: finished, with other parameters
    than ``params`` (the protocol changed since).
    """
    from .notebook import finished

    run_dir = Path(run_dir)
    if not (run_dir / records.RECORD_FILE).exists():
        return "missing"
    try:
        status = records.load_record(run_dir)["status"]
    except records.RecordError:
        return "failed"
    if status != "complete":
        return status
    meta = finished(run_dir)
    if meta is None or meta.get("status") != "complete":
        return "unfinished"
    if params is not None and _differences(meta.get("params", {}), params):
        return "stale"
    return "complete"


def _differences(then: dict, now: dict) -> list[str]:
    return [f"{key}: {then.get(key)!r} there vs {now[key]!r} now"
            for key in sorted(now) if then.get(key) != now[key]]


# ---------------------------------------------------------------------------
# the sweep


@dataclass
class RunOutcome:
    """How one run of a sweep ended (plain data: it travels back from Dask workers)."""

    run_id: str
    status: str  # complete | diverged | failed
    error: str | None = None
    skipped: bool = False  # not executed this time (already complete, or stale)
    wall_s: float = 0.0


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
    def executed(self) -> list[RunOutcome]:
        return [o for o in self.outcomes if not o.skipped]

    def table(self):
        import pandas as pd

        return pd.DataFrame([dataclasses.asdict(o) for o in self.outcomes],
                            columns=[f.name for f in dataclasses.fields(RunOutcome)])

    def summary(self) -> str:
        kept = sum(o.skipped and o.status == "complete" for o in self.outcomes)
        lines = [f"{self.protocol}: {len(self.outcomes)} runs, {len(self.executed)} executed, "
                 f"{kept} already complete, "
                 f"{len(self.failed)} failed in {self.wall_s:.1f} s; runs in {self.out}"]
        lines += [f"  FAILED {o.run_id}: {o.error}" for o in self.failed]
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


def _execute_run(notebook: str, run_dir: str, run_id: str, params: dict,
                 threads: int, env: dict) -> dict:
    """One Dask task: execute one run's notebook; never raises for a failed run."""
    from .notebook import execute

    start = time.perf_counter()
    try:
        result = execute(notebook, run_dir, params, run_id=run_id, threads=threads,
                         env=env)
    except ConfigError as err:  # refused before running (e.g. a parameter error)
        from .notebook import mark_failed

        mark_failed(run_dir, run_id, params, f"{type(err).__name__}: {err}")
        return dataclasses.asdict(RunOutcome(run_id, "failed", f"{type(err).__name__}: {err}",
                                             wall_s=time.perf_counter() - start))
    return dataclasses.asdict(RunOutcome(run_id, result.status, result.error,
                                         wall_s=result.wall_s))


@contextlib.contextmanager
def _client(scheduler: str | None, workers: int):
    from distributed import Client, LocalCluster

    if scheduler:
        with Client(scheduler) as client:
            yield client
        return
    # One single-threaded worker process per concurrent run: each runs one
    # notebook at a time, and its kernel's threads are set per run.
    with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                      dashboard_address=None, silence_logs=logging.ERROR) as cluster, \
            Client(cluster) as client:
        yield client


def _run_params(spec: RunSpec, declared: dict, threads: int) -> dict:
    params = dict(spec.params)
    if "threads" in declared and "threads" not in params:
        params["threads"] = threads
    return params


def plan(protocol: Protocol) -> tuple[list[RunSpec], dict[str, str]]:
    """The protocol's runs and each one's current state (see :func:`run_state`)."""
    specs = expand(protocol)
    out = Path(protocol.out)
    return specs, {s.run_id: run_state(out / s.run_id, s.params) for s in specs}


def _not_to_run(spec: RunSpec, state: str, out: Path) -> RunOutcome | None:
    """The outcome of a run the sweep leaves alone, or None if it must execute."""
    if state == "complete":
        return RunOutcome(spec.run_id, "complete", skipped=True)
    if state == "stale":
        # Rerunning over a finished run of other parameters would mix two
        # configurations in one directory (and its checkpoint refuses anyway).
        from .notebook import finished

        then = (finished(out / spec.run_id) or {}).get("params", {})
        return RunOutcome(spec.run_id, "failed", skipped=True, error=(
            f"finished earlier with other parameters ({'; '.join(_differences(then, spec.params))}"
            f"); delete {out / spec.run_id} to run it again"))
    return None


def run_sweep(protocol: Protocol, scheduler: str | None = None, workers: int | None = None, *,
              progress: bool = True) -> SweepReport:
    """Execute every unfinished run of ``protocol``; see the module docstring."""
    from tqdm import tqdm

    from .notebook import declared_parameters

    start = time.perf_counter()
    specs, states = plan(protocol)
    out = Path(protocol.out)
    outcomes = {}
    for spec in specs:
        outcome = _not_to_run(spec, states[spec.run_id], out)
        if outcome is not None:
            outcomes[spec.run_id] = outcome
    todo = [spec for spec in specs if spec.run_id not in outcomes]
    if todo:
        workers = workers or protocol.workers
        declared = declared_parameters(protocol.notebook)
        env = kernel_env()  # before a LocalCluster's nannies edit os.environ
        with _client(scheduler, workers) as client:
            n_workers = len(client.scheduler_info().get("workers", {})) or workers
            threads = protocol.threads_per_run or max(1, usable_cores() // n_workers)
            futures = {}
            for spec in todo:
                future = client.submit(
                    _execute_run, protocol.notebook, str(out / spec.run_id), spec.run_id,
                    _run_params(spec, declared, threads), threads, env,
                    key=f"{spec.run_id}-{uuid.uuid4().hex[:8]}", pure=False)
                futures[future] = spec
            outcomes.update(_collect(futures, out, protocol.name, progress, tqdm))
    return SweepReport(protocol.name, str(out), [outcomes[s.run_id] for s in specs],
                       time.perf_counter() - start)


def _collect(futures: dict, out: Path, name: str, progress: bool, tqdm) -> dict:
    from distributed import as_completed

    from .notebook import mark_failed

    outcomes = {}
    bar = tqdm(total=len(futures), desc=name, unit="run", disable=not progress)
    for future in as_completed(futures):
        spec = futures[future]
        try:
            outcome = RunOutcome(**future.result())
        except Exception as err:  # the worker died (KilledWorker) or the task broke
            error = f"{type(err).__name__}: {err}"
            mark_failed(out / spec.run_id, spec.run_id, spec.params, error)
            outcome = RunOutcome(spec.run_id, "failed", error)
        outcomes[spec.run_id] = outcome
        bar.update()
        bar.set_postfix(failed=sum(o.status == "failed" for o in outcomes.values()))
        if outcome.status == "failed":
            bar.write(f"FAILED {spec.run_id}: {outcome.error}")
    bar.close()
    return outcomes
