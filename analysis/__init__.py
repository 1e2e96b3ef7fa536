"""Analyses over run records: protocol loading, completeness, summaries, figures.

Nothing here imports torch: a run's record is plain JSON (``record.json``) and its
rows are JSON-lines parts (``rows/<axis>/<start>-<end>.jsonl``), read by ``lab.records``.
Arguments are checked (``analysis.checks``): a bare str where a list of names is
expected, a group key named twice, an unknown field, prefix or axis, an empty
table, a flag that is not a bool, is an error naming the parameter, the value and
what is allowed.

Names load on first use (PEP 562): a training notebook that draws its curves with
``analysis.figures`` does not import the protocol loader, the sweep or the summaries.
"""

from importlib import import_module

_WHERE = {
    "check_kind": "checks", "check_names": "checks",
    "IncompleteProtocolError": "completeness", "UnknownFieldError": "completeness",
    "check_complete": "completeness", "find_problems": "completeness",
    "NotebookFigure": "figures", "curve_bands": "figures", "learning_curves": "figures",
    "run_curves": "figures",
    "MixedCodeError": "load", "ProtocolRuns": "load", "load_protocol_runs": "load",
    "format_mean_std": "summary", "summarize": "summary",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'analysis' has no attribute {name!r}")
    return getattr(import_module(f".{_WHERE[name]}", __name__), name)


def __dir__():
    return sorted(set(__all__) | set(globals()))
