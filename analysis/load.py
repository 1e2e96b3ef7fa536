"""A protocol's runs as DataFrames, without torch: what every analysis starts from.

``load_protocol_runs`` reads the protocol (expected run ids and their grid
points) and the run records under its ``out`` directory (``lab.records``);
what each run must hold is declared in its own record (``expect``). Only
``<out>/<run_id>`` counts as a run of the protocol: runs the protocol does not
expect, and old runs moved aside by ``--force`` (``<run_id>.old-<time>``, same
run id), are left out, so an edited grid does not mix old runs into the
analysis; a run whose config differs from its spec (the protocol was edited
after the sweep) has status ``stale``, which the completeness check refuses.

Grid keys may be dotted (``rule_params.traffic_rule``) and grid values may be
dicts: :meth:`ProtocolRuns.table` flattens a key whose values are all dicts with
the same leaves into one column per leaf (``rule_params.traffic_rule``); any other
key with a dict among its values (``rule_params: [{}, {feedback_scale: 0.5}]``) is
one column of the values as the protocol writes them (``{}``,
``{feedback_scale: 0.5}``), since a column per leaf would be NaN wherever a value
lacks that leaf. :attr:`ProtocolRuns.group_keys` names those columns, so summaries
and figures group by any grid key.

Runs made with different versions of the notebook's code (the records' ``code``
hashes differ: a code cell was edited between runs) are not one experiment:
:func:`load_protocol_runs` refuses them (:class:`MixedCodeError`, naming each version
and its runs) unless called with ``mixed_code=True``. A record from before the code was
recorded has no version ("code unknown") and mixes with any.

A final metric a record holds as None (CfC's ``lift_step`` when the lift never
fired) is a column of NaN in the runs table, even when no run has a number there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import yaml

from lab import records
from lab.sweep import SEED_KEY, Protocol, RunSpec, expand, load_protocol, mark_stale

from .checks import path_like
from .completeness import IncompleteProtocolError, check_complete, find_problems


@dataclass
class ProtocolRuns:
    """A protocol, its expected runs, and the records found for them."""

    protocol: Protocol
    specs: list[RunSpec]
    runs_dir: Path
    runs: pd.DataFrame  # lab.records.load_runs, expected runs only
    metrics: pd.DataFrame  # lab.records.load_metrics, expected runs only

    @property
    def expected_ids(self) -> list[str]:
        return [spec.run_id for spec in self.specs]

    @property
    def group_keys(self) -> list[str]:
        """The grid columns a summary groups by (flattened, see :meth:`table`): all
        but the seed."""
        columns = dict.fromkeys(name for spec in self.specs
                                for name in _grid_columns(spec.grid, self._as_text))
        return sorted(name for name in columns if name != SEED_KEY)

    @property
    def _as_text(self) -> set[str]:
        """Grid keys written as one column of text: see :func:`_text_keys`."""
        return _text_keys(self.protocol.grid)

    def check_complete(self, row_metrics=(), final_metrics=(), undefined=()) -> None:
        """:func:`analysis.completeness.check_complete` for this protocol's expected runs.

        When ``runs_dir`` holds none of them, that is said first: "rerun the sweep" would
        not help where the directory is another protocol's, or not where the sweep writes."""
        if self.specs and not set(self.expected_ids) & set(self.runs["run_id"]):
            self._refuse_foreign_dir()
        check_complete(self.runs, self.metrics, self.expected_ids, row_metrics, final_metrics,
                       undefined)

    def _refuse_foreign_dir(self) -> None:
        n = len(self.specs)
        held = sorted(p.parent.name for p in self.runs_dir.glob(f"*/{records.RECORD_FILE}"))
        holds = (f"it holds {len(held)} other run(s), e.g. {', '.join(held[:3])}: another "
                 "protocol's runs?" if held else "it holds no runs")
        out = Path(self.protocol.out)
        where = (f"run `lab sweep {self.protocol.source}` first (it writes to {out})"
                 if self.runs_dir.resolve() == out.resolve() else
                 f"the protocol's sweep writes its runs to its out, {out}: leave runs_dir "
                 "empty to read them there")
        raise IncompleteProtocolError(
            f"incomplete data: none of the {n} expected runs of protocol "
            f"{self.protocol.name!r} is in {self.runs_dir} ({holds}); {where}",
            find_problems(self.runs, self.metrics, self.expected_ids))

    def table(self) -> pd.DataFrame:
        """One row per expected run: run_id, its grid values (dict values of one shape
        flattened into one column per leaf, ``key.leaf``, other dict-holding keys as
        text; lists as tuples), status, row count, final.* metrics."""
        text = self._as_text
        grid = pd.DataFrame([{"run_id": s.run_id, **_grid_columns(s.grid, text)}
                             for s in self.specs])
        keep = ["run_id", "status", "n_rows"] + [
            c for c in self.runs.columns if c.startswith("final.")]
        found = self.runs[[c for c in keep if c in self.runs.columns]]
        return grid.merge(found, on="run_id", how="left")


def _text_keys(grid: dict) -> set[str]:
    """The grid keys whose values contain a dict but are not all dicts of one shape (same
    leaves): one column per leaf would leave holes (NaN) where a value lacks a leaf and
    make rows no grid point has, so the key is one column of text instead."""
    def holds_dict(value) -> bool:
        return isinstance(value, dict) or (isinstance(value, list)
                                           and any(map(holds_dict, value)))

    def shape(value) -> frozenset | None:
        flat = _flat({"": value}) if isinstance(value, dict) and value else None
        if flat is None or any(isinstance(v, tuple) and any(map(holds_dict, v))
                               for v in flat.values()):
            return None  # not flattened: {}, a non-dict, a list of dicts
        return frozenset(flat)

    return {key for key, values in grid.items() if any(map(holds_dict, values))
            and (None in {shape(v) for v in values} or len({shape(v) for v in values}) > 1)}


def _as_written(value) -> str:
    """A grid value as compact YAML, as a protocol writes it: ``{}``, ``{scale: 0.5}``."""
    text = yaml.safe_dump(value, default_flow_style=True, sort_keys=True, width=10**6)
    return text.strip().removesuffix("\n...")  # (a bare scalar's end-of-document mark)


def _grid_columns(point: dict, text: set[str]) -> dict:
    """A grid point's table columns: keys in ``text`` as one text column, the rest
    :func:`_flat`."""
    out = {}
    for key, value in point.items():  # (in the grid point's order)
        out.update({key: _as_written(value)} if key in text else _flat({key: value}))
    return out


def _flat(point: dict, prefix: str = "") -> dict:
    """{"rule_params": {"a": 1}, "dims": [1, 2]} -> {"rule_params.a": 1, "dims": (1, 2)}."""
    out = {}
    for key, value in point.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{name}."))
        elif isinstance(value, dict):
            # {} (the rule's defaults, a natural baseline arm): a dict cannot be a group key.
            out[name] = "{}"
        else:
            # Tuples, so a list-valued grid key can be grouped by.
            out[name] = tuple(value) if isinstance(value, list) else value
    return out


class MixedCodeError(ValueError):
    """The protocol's runs were made with more than one version of the notebook's code."""


def _refuse_mixed_code(protocol: Protocol, dirs: list[Path]) -> None:
    from lab.notebook import CODE_KEY, NotebookError, code_identity

    versions: dict[str, list[str]] = {}
    for run_dir in dirs:
        code = json.loads((run_dir / records.RECORD_FILE).read_bytes()).get(CODE_KEY)
        if isinstance(code, dict) and isinstance(code.get("sha256"), str):
            versions.setdefault(code["sha256"], []).append(run_dir.name)
    if len(versions) < 2:
        return
    try:
        now = code_identity(protocol.notebook).sha256
    except NotebookError:
        now = None
    listed = "\n".join(
        f"  - version {sha[:12]}{' (the notebook now)' if sha == now else ''}: "
        f"{len(ids)} run(s): {', '.join(ids[:4])}{', ...' if len(ids) > 4 else ''}"
        for sha, ids in versions.items())
    raise MixedCodeError(
        f"the runs of protocol {protocol.name!r} were made with {len(versions)} versions of "
        f"its notebook's code ({protocol.notebook}), so they are not one experiment:\n"
        f"{listed}\nrerun the runs of the old code with the notebook as it is now (`lab sweep "
        f"{protocol.source}` calls them stale; --force replaces them), or pass "
        "mixed_code=True to analyse the versions together knowingly")


def load_protocol_runs(protocol_path, runs_dir=None, *, mixed_code: bool = False
                       ) -> ProtocolRuns:
    """Load ``protocol_path`` and its runs (from ``runs_dir``, default the protocol's ``out``).

    A missing ``out`` (the sweep has not run yet) loads as no runs: the
    completeness check then lists every run as missing. A ``runs_dir`` given
    but not there is a FileNotFoundError naming it (a typo; rerunning the sweep
    would not fill it), one that is a file a NotADirectoryError. A protocol or
    runs directory that is not a path (``-p protocol 3`` in a notebook) is a
    TypeError naming it. Runs of more than one version of the notebook's code are refused
    (:class:`MixedCodeError`) unless ``mixed_code`` is True.
    """
    records.check_flag(mixed_code, "load_protocol_runs", "mixed_code")
    path_like(protocol_path, "protocol", "the path of a protocol YAML file")
    if runs_dir is not None and runs_dir != "":  # empty, like None: the protocol's out
        path_like(runs_dir, "runs_dir", "a directory of runs (or empty/None: the protocol's out)")
    protocol = load_protocol(protocol_path, configs=False)  # no config class: no torch
    specs = expand(protocol)
    directory = Path(runs_dir or protocol.out)
    if runs_dir and not directory.is_dir():
        where = f"{runs_dir} ({directory.resolve()})" if not directory.is_absolute() else runs_dir
        if directory.exists():
            raise NotADirectoryError(f"runs_dir {where} is a file, not a directory of runs")
        raise FileNotFoundError(f"runs_dir {where} does not exist (the protocol's runs are in "
                                f"its out, {protocol.out}; leave runs_dir empty to use it)")
    # A protocol's run is exactly <out>/<run_id>: not an old run moved aside
    # beside it (same run id), nor anything else under <out>.
    dirs = [directory / spec.run_id for spec in specs
            if (directory / spec.run_id / records.RECORD_FILE).is_file()]
    run_frames, metric_frames, problems = [], [], []
    for run_dir in dirs:
        try:
            runs = records.load_runs(run_dir)
            runs = runs[[Path(p).resolve() == run_dir.resolve() for p in runs["path"]]]
            if len(runs) and runs["run_id"].iat[0] != run_dir.name:
                # A run copied or renamed into place: read under its own id, it made the
                # expected run "missing" and its namesake "stale" (and a --force rerun would
                # have replaced a good run).
                problems.append((run_dir / records.RECORD_FILE, (
                    f"{run_dir}: its record's run_id is {runs['run_id'].iat[0]!r}, not "
                    f"{run_dir.name!r}, the run the protocol expects in this directory (a "
                    "run copied or renamed into place?): move it to a directory named after "
                    "its run_id, or replace it (`lab sweep --force`)")))
                continue
            run_frames.append(runs)
            metric_frames.append(records.load_metrics(run_dir))
        except records.RecordError as err:
            # load_runs / load_metrics collect their problems under a header of their
            # own: take the problems, so the message has one header and a line per run
            problems += err.problems or [(run_dir / records.RECORD_FILE, str(err))]
    if problems:
        lines = "\n".join(f"  - {message}" for _, message in problems)
        raise records.RecordError(f"{len(problems)} run records could not be read (fix or "
                                  f"remove them; none were skipped):\n{lines}",
                                  path=problems[0][0], problems=problems)
    if not mixed_code:
        _refuse_mixed_code(protocol, [Path(p) for frame in run_frames for p in frame["path"]])
    run_frames = [frame for frame in run_frames if len(frame)]
    runs = pd.concat(run_frames, ignore_index=True) if run_frames else \
        pd.DataFrame(columns=list(records.RUN_COLUMNS))
    runs = mark_stale(runs, specs)  # an edited protocol's old runs are not its results
    metric_frames = [frame for frame in metric_frames if len(frame)]
    metrics = pd.concat(metric_frames, ignore_index=True) if metric_frames else \
        records.tidy_metrics({"run_id": "none"})
    return ProtocolRuns(protocol, specs, directory, runs, metrics)
