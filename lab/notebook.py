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
                               minimal one made here (kind "notebook")

Parameters the notebook does not declare are refused before anything runs. A
failing cell leaves the run ``failed`` with the error, and the executed
notebook with the traceback. The kernel is ``python3`` and must be this
interpreter (:func:`ensure_kernel`), so runs see the same installed ``lab``.
As with papermill, the kernel starts in the caller's working directory
(Jupyter and nbval start it in the notebook's): relative paths given as
parameters are relative to where ``lab run``/``lab sweep`` was started.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import math
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import records
from .config import ConfigError

if TYPE_CHECKING:  # imported where used: kernels import this module for record_value
    import nbformat

RECORD_MIME = "application/vnd.lab.record+json"
OUTPUT_NOTEBOOK = "notebook.ipynb"
KERNEL = "python3"
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
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
    from .config import field_names, from_dict

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
    return dict(papermill.inspect_notebook(str(notebook)))


def notebook_defaults(notebook) -> dict[str, Any]:
    """The ``parameters`` cell's defaults as Python values (literals are evaluated)."""
    defaults = {}
    for name, info in declared_parameters(notebook).items():
        try:
            defaults[name] = ast.literal_eval(info["default"])
        except (ValueError, SyntaxError):
            defaults[name] = info["default"]  # an expression; keep its source
    return defaults


def check_parameters(notebook, params: Mapping, declared=None) -> None:
    """Raise ParameterError naming every parameter ``notebook`` does not declare."""
    declared = declared_parameters(notebook) if declared is None else declared
    unknown = [name for name in params if name not in declared]
    if unknown:
        listed = ", ".join(declared) if declared else "(none: it has no cell tagged 'parameters')"
        raise ParameterError(f"notebook {notebook} does not declare parameter(s) "
                             f"{', '.join(map(repr, unknown))}; declared: {listed}")


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

        install(kernel_name=name, prefix=sys.prefix)
        cmd = current()
    if not ours(cmd):
        raise NotebookError(
            f"kernel {name!r} runs {cmd or 'nothing (no such kernel)'}, not this interpreter "
            f"({sys.executable}); register it with `{sys.executable} -m ipykernel install "
            f"--sys-prefix --name {name}` (make install does this)")
    return cmd


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


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

    @property
    def ok(self) -> bool:
        return self.status != "failed"


@contextlib.contextmanager
def _kernel_env(threads: int | None, env: Mapping[str, str | None] | None):
    """Environment for the kernel, which copies os.environ when it starts.

    ``threads`` sets the OMP/MKL/OpenBLAS thread counts; ``env`` sets variables
    (None unsets one). Changed for the duration of one execution and restored:
    a sweep worker runs one execution at a time.
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


def _describe_error(err: Exception) -> str:
    from papermill.exceptions import PapermillExecutionError

    if isinstance(err, PapermillExecutionError):
        # The traceback stays in the executed notebook; the record gets the gist.
        return f"{err.ename}: {err.evalue} (in cell {err.cell_index})"
    return f"{type(err).__name__}: {err}"


def _papermill(notebook: Path, target: Path, params: dict, timeout: float | None,
               log_output: bool) -> str | None:
    """Run papermill; returns the error text if the notebook failed, None if it ran."""
    import papermill

    try:
        papermill.execute_notebook(
            str(notebook), str(target), parameters=params, kernel_name=KERNEL,
            progress_bar=False, log_output=log_output, execution_timeout=timeout,
            extra_arguments=KERNEL_ARGS,
            # Every output is on disk by now and run files are written atomically;
            # a graceful shutdown waits seconds for torch's exit handlers.
            shutdown_kernel="immediate")
    except Exception as err:  # a cell error, a dead kernel, a timeout: the run failed
        return _describe_error(err)
    return None


def _finite_numbers(values: dict) -> dict:
    return {key: value for key, value in values.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value)}


def mark_failed(run_dir, run_id: str, params: Mapping, error: str) -> dict:
    """Set the run's record to ``failed`` with ``error``, keeping what it holds;
    a run that failed before writing a record (or whose record is unreadable)
    gets a minimal one."""
    run_dir = Path(run_dir)
    try:
        record = records.load_record(run_dir)
    except records.RecordError:
        record = records.new_record(run_id=run_id, kind="notebook", config=dict(params))
    record.update(status="failed", error=error)
    records.save_run(run_dir, record)
    return record


def _settle_record(out: Path, run_id: str, params: dict, values: dict, error: str | None,
                   started: float) -> tuple[str, str | None]:
    """Bring record.json in line with how the notebook ended; returns (status, error)."""
    if error is not None:
        mark_failed(out, run_id, params, error)
        return "failed", error
    path = out / records.RECORD_FILE
    if not path.exists() or path.stat().st_mtime < started:
        # A notebook that trains nothing still leaves a record (replacing one
        # from an earlier attempt), so sweeps of it resume like any other; its
        # numeric recorded values are the final metrics.
        record = records.new_record(run_id=run_id, kind="notebook", config=params)
        record.update(status="complete", final=_finite_numbers(values))
        records.save_run(out, record)
        return "complete", None
    try:
        record = records.load_record(out)
    except records.RecordError as err:
        error = f"the notebook ran but left an unreadable record: {err}"
    else:
        if record["status"] != "running":
            return record["status"], record.get("error")
        error = "the notebook finished but its record is still 'running'"
    mark_failed(out, run_id, params, error)
    return "failed", error


def _finish_notebook(target: Path, meta: dict) -> None:
    """Mirror the outcome into metadata.lab, written last: a run is finished only
    once this is on disk, so a kill before it never passes for complete."""
    import nbformat

    nb = nbformat.read(target, as_version=4)
    meta["values"] = _outputs_values(nb)
    nb.metadata["lab"] = meta
    records.atomic_write(target, lambda tmp: nbformat.write(nb, str(tmp)))


def execute(notebook, out_dir, params: Mapping | None = None, *, run_id: str | None = None,
            threads: int | None = None, env: Mapping[str, str | None] | None = None,
            record: bool = True, timeout: float | None = None,
            log_output: bool = False) -> RunResult:
    """Execute ``notebook`` with ``params`` into ``out_dir``; see the module docstring.

    ``out_dir`` is passed as the ``out_dir`` parameter when the notebook
    declares one (and may not be given in ``params``). ``threads`` (default:
    ``params["threads"]`` when positive) sets OMP/MKL/OpenBLAS thread counts
    for the kernel, and ``env`` sets (None: unsets) its environment variables.
    ``record=False`` leaves record.json alone (reports).
    Raises ParameterError/NotebookError before running; a failing notebook
    does not raise but returns status ``failed``.
    """
    notebook = Path(notebook)
    out = Path(out_dir).resolve()
    params = dict(params or {})
    declared = declared_parameters(notebook)
    check_parameters(notebook, params, declared)
    if "out_dir" in params:
        raise ParameterError(f"out_dir={params['out_dir']!r} was given as a parameter; the run "
                             f"directory is set by execute's out_dir ({out})")
    if "out_dir" in declared:
        params["out_dir"] = str(out)
    run_id = run_id or out.name
    if threads is None and isinstance(params.get("threads"), int):
        threads = params["threads"] or None
    ensure_kernel()
    out.mkdir(parents=True, exist_ok=True)
    target = out / OUTPUT_NOTEBOOK
    start, started = time.perf_counter(), time.time()
    with _kernel_env(threads, env):
        error = _papermill(notebook, target, params, timeout, log_output)
    if not target.exists():  # papermill failed before writing anything
        import nbformat

        nbformat.write(_read(notebook), str(target))
    values = read_values(target)
    status = "failed" if error else "complete"
    if record:
        status, error = _settle_record(out, run_id, params, values, error, started)
    meta = {"run_id": run_id, "source": str(notebook.resolve()), "params": params,
            "status": status, "error": error}
    _finish_notebook(target, meta)
    return RunResult(run_id, out, target, status, error, records.decode_nonfinite(values),
                     time.perf_counter() - start)


def finished(run_dir) -> dict | None:
    """metadata.lab of the run's executed notebook once :func:`execute` finished it."""
    import nbformat

    path = Path(run_dir) / OUTPUT_NOTEBOOK
    if not path.is_file():
        return None
    try:
        meta = nbformat.read(path, as_version=4).metadata.get("lab")
    except Exception:  # a notebook cut short mid-write by a kill is not finished
        return None
    return dict(meta) if meta and "status" in meta else None


def render_html(executed_notebook, html_path) -> Path:
    """Render an executed notebook to a standalone HTML file (nbconvert)."""
    from nbconvert import HTMLExporter

    body, _ = HTMLExporter().from_notebook_node(_read(executed_notebook))
    html_path = Path(html_path)
    html_path.parent.mkdir(parents=True, exist_ok=True)
    records.atomic_write(html_path, lambda tmp: tmp.write_text(body, encoding="utf-8"))
    return html_path


__all__ = [
    "RECORD_MIME", "NotebookError", "ParameterError", "RunResult", "check_parameters",
    "config_from", "declared_parameters", "ensure_kernel", "execute", "finished", "mark_failed",
    "notebook_defaults", "read_values", "record_value", "render_html",
]
