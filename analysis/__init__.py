"""Analyses over run records: protocol loading, completeness, summaries, figures.

Nothing here imports torch: a run's record is plain JSON (``record.json``) and its
rows are JSON-lines parts (``rows/<axis>/<start>-<end>.jsonl``), read by ``lab.records``.
Arguments are checked (``analysis.checks``): a bare str where a list of names is
expected, a group key named twice, an unknown field, prefix or axis, an empty
table, a flag that is not a bool, is an error naming the parameter, the value and
what is allowed.
"""

from .checks import check_kind, check_names
from .completeness import (
    IncompleteProtocolError,
    UnknownFieldError,
    check_complete,
    find_problems,
)
from .figures import NotebookFigure, curve_bands, learning_curves, run_curves
from .load import MixedCodeError, ProtocolRuns, load_protocol_runs
from .summary import format_mean_std, summarize

__all__ = [
    "IncompleteProtocolError", "MixedCodeError", "NotebookFigure", "ProtocolRuns",
    "check_complete", "check_kind",
    "check_names",
    "curve_bands", "find_problems", "format_mean_std", "learning_curves", "load_protocol_runs",
    "run_curves", "summarize", "UnknownFieldError",
]
