"""Analyses over run records: protocol loading, completeness, summaries, figures.

Nothing here imports torch: records are plain JSON and parquet.
"""

from .completeness import IncompleteProtocolError, check_complete, find_problems
from .figures import NotebookFigure, curve_bands, learning_curves, run_curves
from .load import ProtocolRuns, load_protocol_runs
from .summary import format_mean_std, summarize

__all__ = [
    "IncompleteProtocolError", "NotebookFigure", "ProtocolRuns", "check_complete", "curve_bands",
    "find_problems", "format_mean_std", "learning_curves", "load_protocol_runs", "run_curves",
    "summarize",
]
