"""A protocol's runs as DataFrames, without torch: what every analysis starts from.

``load_protocol_runs`` reads the protocol (expected run ids and their grid
points), the run records under its ``out`` directory (``lab.records``) and the
number of epochs each run should have (its ``epochs`` parameter, else the
notebook's default). Runs in the directory that the protocol does not expect
are left out, so an edited grid does not mix old runs into the analysis.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from lab import records
from lab.sweep import SEED_KEY, Protocol, RunSpec, expand, load_protocol

from .completeness import check_complete


@dataclass
class ProtocolRuns:
    """A protocol, its expected runs, and the records found for them."""

    protocol: Protocol
    specs: list[RunSpec]
    runs_dir: Path
    runs: pd.DataFrame  # lab.records.load_runs, expected runs only
    metrics: pd.DataFrame  # lab.records.load_metrics, expected runs only
    n_epochs: dict[str, int | None]  # run_id -> expected epochs (None: not a parameter)

    @property
    def expected_ids(self) -> list[str]:
        return [spec.run_id for spec in self.specs]

    @property
    def group_keys(self) -> list[str]:
        """The grid keys a summary groups by: all but the seed."""
        return [key for key in sorted(self.protocol.grid) if key != SEED_KEY]

    def check_complete(self, trajectory_fields=(), final_fields=()) -> None:
        """:func:`analysis.completeness.check_complete` with this protocol's expectations."""
        n_epochs = {run_id: n or 0 for run_id, n in self.n_epochs.items()}
        check_complete(self.runs, self.metrics, self.expected_ids, n_epochs,
                       trajectory_fields, final_fields)

    def table(self) -> pd.DataFrame:
        """One row per expected run: run_id, its grid values, status, final.* metrics."""
        grid = pd.DataFrame([{"run_id": s.run_id, **s.grid} for s in self.specs])
        keep = ["run_id", "status", "n_epochs"] + [
            c for c in self.runs.columns if c.startswith("final.")]
        found = self.runs[[c for c in keep if c in self.runs.columns]]
        return grid.merge(found, on="run_id", how="left")


def _epochs(spec: RunSpec, defaults: dict) -> int | None:
    value = spec.params.get("epochs", defaults.get("epochs"))
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def load_protocol_runs(protocol_path, runs_dir=None) -> ProtocolRuns:
    """Load ``protocol_path`` and its runs (from ``runs_dir``, default the protocol's ``out``).

    A missing runs directory loads as no runs: the completeness check then
    lists every run as missing.
    """
    from lab.notebook import notebook_defaults

    protocol = load_protocol(protocol_path)
    specs = expand(protocol)
    directory = Path(runs_dir or protocol.out)
    ids = {spec.run_id for spec in specs}
    if directory.is_dir():
        runs = records.load_runs(directory)
        metrics = records.load_metrics(directory)
    else:
        runs = pd.DataFrame(columns=list(records.RUN_COLUMNS))
        metrics = records.tidy_metrics({"run_id": "none"})
    runs = runs[runs["run_id"].isin(ids)].reset_index(drop=True)
    metrics = metrics[metrics["run_id"].isin(ids)].reset_index(drop=True)
    defaults = notebook_defaults(protocol.notebook)
    n_epochs = {spec.run_id: _epochs(spec, defaults) for spec in specs}
    return ProtocolRuns(protocol, specs, directory, runs, metrics, n_epochs)
