"""Choose hyper-parameters on a validation split, by one stated criterion (DESIGN section 3).

A *selection protocol* is an ordinary protocol whose runs hold a validation split carved
from the training set, plus a ``select`` section saying what to choose::

    select:
      choose: [lr]                 # grid keys whose values are being chosen
      per: rule                    # one choice per value of this grid key (optional)
      metric: val_acc              # a final metric every run records
      goal: max                    # max | min
      into: selected/rules.yaml    # written here (relative to the protocol file)

The criterion: for every value of ``per``, the candidate (a combination of the ``choose``
keys' values) whose mean of ``final.<metric>`` over the other grid keys (the seeds) is
best. A run that diverged counts as the worst possible value, so a candidate that
diverges on any seed loses to every candidate that does not; a tie keeps the candidate
listed first in the grid. Every expected run must be finished (complete or diverged):
a choice made on part of the budget would not be the stated procedure.

``into`` is a protocol fragment (``fixed`` without ``per``, else ``overrides`` keyed by
``per``) that the final protocol names under ``include:``; the final protocol trains on
the whole training set at the chosen values and evaluates the test split once.
``lab select PROTOCOL`` runs the selection sweep and writes the fragment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from .completeness import IncompleteProtocolError, find_problems
from .load import ProtocolRuns, load_protocol_runs

GOALS = ("max", "min")
SELECT_KEYS = ("choose", "per", "metric", "goal", "into")


class SelectionError(ValueError):
    """A ``select`` section that cannot be carried out; the message names the key."""


@dataclass(frozen=True)
class SelectSpec:
    choose: tuple[str, ...]
    metric: str
    goal: str
    into: Path
    per: str | None = None


def read_spec(section, grid: dict, protocol_path) -> SelectSpec:
    """The protocol's ``select`` section, checked against its grid."""
    where = f"protocol {protocol_path}: select"
    if not isinstance(section, dict) or not section:
        raise SelectionError(f"{where} is {section!r}; a selection protocol's select is a "
                             f"mapping with keys {', '.join(SELECT_KEYS)} (per optional)")
    unknown = sorted(set(map(str, section)) - set(SELECT_KEYS))
    if unknown:
        raise SelectionError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: "
                             f"{', '.join(SELECT_KEYS)}")
    missing = [k for k in ("choose", "metric", "into") if k not in section]
    if missing:
        raise SelectionError(f"{where}: missing key(s) {', '.join(missing)}")
    choose = section["choose"]
    choose = [choose] if isinstance(choose, str) else choose
    per = section.get("per")
    if not isinstance(choose, list) or not choose or not all(isinstance(c, str) for c in choose):
        raise SelectionError(f"{where}.choose={section['choose']!r}; give a grid key or a list "
                             "of grid keys (e.g. [lr])")
    for key in [*choose, *([per] if per is not None else [])]:
        if key not in grid:
            raise SelectionError(f"{where}: {key!r} is not a grid key; the grid has "
                                 f"{', '.join(sorted(grid))}")
    if per is not None and (not isinstance(per, str) or per in choose):
        raise SelectionError(f"{where}.per={per!r}; give one grid key that is not chosen "
                             "(the choice is made once per value of it), or leave it out")
    goal = section.get("goal", "max")
    if goal not in GOALS:
        raise SelectionError(f"{where}.goal={goal!r}; allowed: {', '.join(GOALS)}")
    if not isinstance(section["metric"], str) or not section["metric"]:
        raise SelectionError(f"{where}.metric={section['metric']!r}; give the name of a final "
                             "metric every run records (e.g. val_acc)")
    if not isinstance(section["into"], str) or not section["into"].strip():
        raise SelectionError(f"{where}.into={section['into']!r}; give the path of the YAML "
                             "file the chosen values are written to")
    into = (Path(protocol_path).parent / Path(section["into"]).expanduser()).resolve()
    return SelectSpec(tuple(choose), section["metric"], goal, into, per)


def choose(table: pd.DataFrame, spec: SelectSpec, grid: dict) -> pd.DataFrame:
    """One row per (per value, candidate): mean, std and count of the metric over the
    other grid keys, ``diverged`` runs, and ``chosen`` (True for one candidate per value).

    ``table`` is :meth:`ProtocolRuns.table` (grid columns, status, ``final.*``).
    """
    column = f"final.{spec.metric}"
    if column not in table.columns:
        finals = sorted(c[len("final."):] for c in table.columns if c.startswith("final."))
        raise SelectionError(f"select.metric={spec.metric!r}: no run records it; the runs' "
                             f"final metrics are {', '.join(finals) or '(none)'}")
    worst = -math.inf if spec.goal == "max" else math.inf
    scored = table.assign(
        score=[worst if status == "diverged" else value
               for status, value in zip(table["status"], table[column])],
        diverged=table["status"].eq("diverged"))
    keys = ([spec.per] if spec.per else []) + list(spec.choose)
    # Candidates in grid order, so a tie keeps the value the protocol lists first.
    order = {key: {_key(v): i for i, v in enumerate(grid[key])} for key in keys}
    rows = []
    for values, group in scored.groupby(keys, sort=False, dropna=False):
        values = values if isinstance(values, tuple) else (values,)
        rows.append({**dict(zip(keys, values)), "mean": group["score"].mean(),
                     # (a diverged run has no spread to speak of: its score is not a number)
                     "std": (math.nan if group["diverged"].any() else
                             group["score"].std(ddof=1) if len(group) > 1 else 0.0),
                     "n": len(group), "diverged": int(group["diverged"].sum()),
                     "_order": tuple(order[k][_key(v)] for k, v in zip(keys, values))})
    out = pd.DataFrame(rows).sort_values("_order", kind="stable").reset_index(drop=True)
    target = (out.groupby(spec.per)["mean"].transform(spec.goal) if spec.per
              else out["mean"].agg(spec.goal))
    # Equal to the float's last digits: accuracies are counts over one split, so two
    # candidates tie exactly (0.98 and 0.985 against 0.9875 and 0.9775) while their float
    # means differ in the 16th digit, which must not break the grid-order rule.
    best = out["mean"].eq(target) | np.isclose(out["mean"], target, rtol=1e-9, atol=0.0)
    by = out[spec.per] if spec.per else pd.Series(0, index=out.index)
    first = best & ~best.groupby(by).cumsum().gt(1)
    return out.assign(chosen=first).drop(columns="_order")


def _key(value):
    # grid values as the table holds them (lists become tuples there)
    return repr(tuple(value) if isinstance(value, list) else value)


def fragment(result: pd.DataFrame, spec: SelectSpec) -> dict:
    """The protocol fragment holding the chosen values: ``fixed`` or ``overrides``."""
    chosen = result[result["chosen"]]
    if spec.per is None:
        row = chosen.iloc[0]
        return {"fixed": {key: _plain(row[key]) for key in spec.choose}}
    return {"overrides": {spec.per: {_plain(row[spec.per]): {k: _plain(row[k])
                                                              for k in spec.choose}
                                     for _, row in chosen.iterrows()}}}


def _plain(value):
    if hasattr(value, "item"):  # numpy scalar -> Python
        return value.item()
    return list(value) if isinstance(value, tuple) else value


@dataclass
class Selection:
    spec: SelectSpec
    data: ProtocolRuns
    result: pd.DataFrame

    @property
    def chosen(self) -> pd.DataFrame:
        return self.result[self.result["chosen"]].reset_index(drop=True)

    def write(self) -> Path:
        """Write the fragment to ``spec.into`` (atomically) with a header naming how it was
        chosen; returns the path."""
        import yaml

        from lab.records import atomic_write

        header = (f"# Chosen by `lab select {_shown(self.data.protocol.source)}`: "
                  f"{f'for each {self.spec.per}, ' if self.spec.per else ''}the "
                  f"{', '.join(self.spec.choose)} with the "
                  f"{self.spec.goal} mean final {self.spec.metric} on the validation split "
                  f"over the seeds ({int(self.result['n'].max())} runs a candidate).\n"
                  "# Generated: edit the selection protocol and rerun rather than this file.\n"
                  + self.evidence())
        body = yaml.safe_dump(fragment(self.result, self.spec), sort_keys=False)
        self.spec.into.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(self.spec.into, lambda tmp: tmp.write_text(header + body))
        return self.spec.into

    def evidence(self) -> str:
        """Every candidate's score as YAML comments, so the fragment shows why it holds what
        it holds after the selection's runs are gone (chosen rows marked ``<-``)."""
        keys = ([self.spec.per] if self.spec.per else []) + list(self.spec.choose)
        table = self.result[keys + ["mean", "std", "n", "diverged"]].copy()
        table["mean"] = [("diverged" if abs(m) == math.inf else f"{m:.4f}")
                         for m in table["mean"]]
        table["std"] = table["std"].map(lambda v: "" if math.isnan(v) else f"{v:.4f}")
        table[""] = ["<-" if c else "" for c in self.result["chosen"]]
        lines = table.to_string(index=False).splitlines()
        return "".join(f"#   {line.rstrip()}\n" for line in
                       [f"candidates ({self.spec.metric} mean over seeds):", *lines])


def _shown(path) -> str:
    """``path`` as a command typed beside the fragment would name it: relative to the
    protocols' folder's parent (the repository), so a committed fragment names no machine."""
    path = Path(path)
    return str(path.relative_to(path.parent.parent)) if path.is_absolute() else str(path)


def select(protocol_path, runs_dir=None, *, mixed_code: bool = False) -> Selection:
    """Load a selection protocol's runs and choose; IncompleteProtocolError unless every
    expected run finished (complete, or diverged: a result that loses). ``mixed_code``: as
    :func:`analysis.load.load_protocol_runs`."""
    data = load_protocol_runs(protocol_path, runs_dir, mixed_code=mixed_code)
    spec = read_spec(getattr(data.protocol, "select", None), data.protocol.grid, protocol_path)
    # A diverged run is a finished result (the worst score): the rows and final metrics it
    # never reached are not gaps.
    diverged = set(data.runs["run_id"][data.runs["status"] == "diverged"]) if len(data.runs) \
        else set()
    problems = [p for p in find_problems(data.runs, data.metrics, data.expected_ids)
                if p.split(":", 1)[0] not in diverged]
    if problems:
        lines = "\n".join(f"  - {line}" for line in problems)
        raise IncompleteProtocolError(
            f"selection needs every run of {data.protocol.name} finished; "
            f"{len(problems)} problem(s) (run `lab select {protocol_path}` or `lab sweep` "
            f"to fill them):\n{lines}", problems)
    return Selection(spec, data, choose(data.table(), spec, data.protocol.grid))


def selection_figure(selection: Selection, ax=None):
    """The metric against the first chosen key, one line per ``per`` value, with the
    seeds' spread and the chosen point ringed. Returns the axes."""
    import matplotlib.pyplot as plt

    from .figures import style_axes

    spec, result = selection.spec, selection.result
    key = spec.choose[0]
    ax = ax or plt.subplots(figsize=(6, 4))[1]
    groups = result.groupby(spec.per, sort=False) if spec.per else [("all", result)]
    for name, group in groups:
        finite = group[group["mean"].abs() != math.inf]
        line = ax.errorbar(finite[key], finite["mean"], yerr=finite["std"], marker="o",
                           capsize=3, label=str(name))
        pick = group[group["chosen"]]
        ax.scatter(pick[key], pick["mean"], s=160, facecolors="none",
                   edgecolors=line[0].get_color(), linewidths=2)
    values = pd.to_numeric(result[key], errors="coerce")
    if values.notna().all() and (values > 0).all() and values.max() / values.min() >= 10:
        ax.set_xscale("log")
    style_axes(ax, key, f"validation {spec.metric} (mean over seeds)")
    ax.set_title(f"{selection.data.protocol.name}: chosen values ringed; diverged not drawn")
    ax.legend(fontsize="small", ncol=2)
    return ax
