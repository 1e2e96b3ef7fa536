"""Notebooks as runs: recorded values, papermill execution, failures, the training notebook."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from lab import records
from lab.cli import main as cli_main
from lab.config import describe, field_names
from lab.notebook import (
    RECORD_MIME,
    NotebookError,
    ParameterError,
    declared_parameters,
    ensure_kernel,
    execute,
    notebook_defaults,
    read_values,
    record_value,
    render_html,
)
from lab.train import ConvConfig

ROOT = Path(__file__).resolve().parents[1]
ECHO = ROOT / "tests" / "fixtures" / "notebooks" / "echo.ipynb"
TRAIN = ROOT / "notebooks" / "01-train-conv.ipynb"
# Smoke-size values the training notebook may hold instead of ConvConfig's defaults.
SMOKE_FIELDS = {"n_train", "depth", "width", "epochs", "progress"}


def _outputs(path, output_type):
    nb = nbformat.read(path, as_version=4)
    return [o for cell in nb.cells for o in cell.get("outputs", []) if o.output_type == output_type]


def test_values_are_recorded_read_back_and_mirrored(tmp_path):
    result = execute(ECHO, tmp_path / "run", {"x": 3}, threads=1)
    assert result.status == "complete" and result.error is None
    values = read_values(tmp_path / "run" / "notebook.ipynb")
    assert values["x"] == 103  # recorded twice: the later value wins
    assert values["twice"] == 6
    assert math.isnan(values["nan"])
    assert values["nested"] == {"list": [1, 2.5], "none": None}
    assert set(result.values) == set(values) and result.values["twice"] == 6
    # The kernel is this interpreter, whatever python is first on PATH.
    assert os.path.samefile(values["executable"], sys.executable)
    assert values["omp_threads"] == "1"
    # Mirrored into metadata: still readable once outputs are stripped.
    nb = nbformat.read(result.notebook, as_version=4)
    assert nb.metadata["lab"]["values"]["twice"] == 6
    assert nb.metadata["lab"]["status"] == "complete"
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
    nbformat.write(nb, str(tmp_path / "stripped.ipynb"))
    assert read_values(tmp_path / "stripped.ipynb")["twice"] == 6


def test_a_notebook_without_a_record_gets_a_complete_one(tmp_path):
    execute(ECHO, tmp_path / "run", {"x": 2})
    record = records.load_record(tmp_path / "run")
    assert record["status"] == "complete" and record["kind"] == "notebook"
    assert record["run_id"] == "run"
    # Finite numeric values become the final metrics; NaN and text do not.
    assert record["final"] == {"x": 102, "twice": 4}


def test_unknown_parameter_is_refused_before_running(tmp_path):
    with pytest.raises(ParameterError) as err:
        execute(ECHO, tmp_path / "run", {"x": 1, "learning_rate": 0.1})
    message = str(err.value)
    assert "'learning_rate'" in message
    assert "declared: x, fail_on, write_record, out_dir" in message
    assert not (tmp_path / "run").exists()
    with pytest.raises(ParameterError, match="out_dir='elsewhere' was given as a parameter"):
        execute(ECHO, tmp_path / "run", {"out_dir": "elsewhere"})
    with pytest.raises(NotebookError, match="does not exist"):
        execute(tmp_path / "nope.ipynb", tmp_path / "run", {})


def test_failing_cell_before_any_record(tmp_path):
    result = execute(ECHO, tmp_path / "run", {"x": 3, "fail_on": 3})
    assert result.status == "failed" and not result.ok
    assert "ValueError: asked to fail at x=3" in result.error
    record = records.load_record(tmp_path / "run")
    assert record["status"] == "failed" and record["error"] == result.error
    assert record["config"]["x"] == 3 and record["kind"] == "notebook"
    # The executed notebook keeps the traceback, and values recorded before the error.
    errors = _outputs(result.notebook, "error")
    assert errors and errors[0]["ename"] == "ValueError"
    assert read_values(result.notebook)["x"] == 3


def test_failing_cell_after_the_record_keeps_it(tmp_path):
    result = execute(ECHO, tmp_path / "run", {"x": 3, "fail_on": 3, "write_record": True})
    record = records.load_record(tmp_path / "run")
    assert result.status == record["status"] == "failed"
    assert record["kind"] == "echo" and record["trajectory"] == [{"epoch": 0, "loss": 1.0}]
    assert "asked to fail at x=3" in record["error"]
    # A later successful attempt in the same directory replaces the failure.
    assert execute(ECHO, tmp_path / "run", {"x": 4}).status == "complete"
    assert records.load_record(tmp_path / "run")["status"] == "complete"


def test_record_value_outside_a_kernel(capsys):
    import numpy as np

    record_value("acc", np.float32(0.5))
    assert "acc = 0.5" in capsys.readouterr().out
    with pytest.raises(TypeError, match=r"record_value: bad\.obj is object"):
        record_value("bad", {"obj": object()})
    with pytest.raises(ValueError, match="non-empty string"):
        record_value("", 1)


def test_read_values_of_a_hand_made_notebook(tmp_path):
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("")
    cell.outputs = [nbformat.v4.new_output("display_data", data={
        RECORD_MIME: {"a": 1, "b": "Infinity"}, "text/plain": "a = 1"})]
    nb.cells = [cell]
    nbformat.write(nb, str(tmp_path / "n.ipynb"))
    assert read_values(tmp_path / "n.ipynb") == {"a": 1, "b": math.inf}


def test_kernel_spec_points_at_this_interpreter():
    cmd = ensure_kernel()
    assert cmd in ("python", "python3") or os.path.samefile(cmd, sys.executable)


def test_cli_run_without_the_venv_on_path(tmp_path):
    # A bare PATH: the kernel must still be this venv's interpreter.
    env = {**os.environ, "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-m", "lab.cli", "run", str(ECHO), "--out",
                           str(tmp_path / "r"), "-p", "x", "5"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "r: complete" in done.stdout and "twice=10" in done.stdout
    values = read_values(tmp_path / "r" / "notebook.ipynb")
    assert os.path.samefile(values["executable"], sys.executable)


def test_cli_run_failure_and_bad_parameter(tmp_path, capsys):
    assert cli_main(["run", str(ECHO), "--out", str(tmp_path / "f"), "-p", "x", "1",
                     "-p", "fail_on", "1"]) == 1
    captured = capsys.readouterr()
    assert "f: failed" in captured.out and "asked to fail at x=1" in captured.err
    assert records.load_record(tmp_path / "f")["status"] == "failed"
    assert cli_main(["run", str(ECHO), "--out", str(tmp_path / "g"), "-p", "y", "1"]) == 2
    assert "does not declare parameter(s) 'y'" in capsys.readouterr().err


# ---------------------------------------------------------------------------
# the training notebook


def test_training_notebook_declares_exactly_the_config_fields():
    assert list(declared_parameters(TRAIN)) == field_names(ConvConfig) + ["out_dir"]


def test_training_notebook_defaults_are_the_config_defaults_at_smoke_size():
    defaults = notebook_defaults(TRAIN)
    for name, info in describe(ConvConfig).items():
        default = info["default"]
        if default is dataclasses.MISSING:  # a default_factory field
            default = getattr(ConvConfig(), name)
        if name not in SMOKE_FIELDS:
            assert defaults[name] == default, (
                f"notebooks/01-train-conv.ipynb sets {name} = {defaults[name]!r} but ConvConfig's "
                f"default is {default!r}; update the parameters cell")
    assert defaults["epochs"] <= 3 and defaults["progress"] is False
    assert defaults["out_dir"] == "."


def test_training_notebook_with_injected_small_parameters(tiny, tmp_path):
    params = {**tiny, "epochs": 2, "seed": 1, "threads": 1}
    result = execute(TRAIN, tmp_path / "bp-s1", params)
    assert result.status == "complete", result.error
    record = records.load_record(tmp_path / "bp-s1")
    assert record["run_id"] == "bp-s1" and record["kind"] == "conv"
    assert {k: record["config"][k] for k in params} == params
    values = result.values
    assert values["status"] == "complete" and values["epochs"] == 2
    assert values["test_acc"] == pytest.approx(record["final"]["test_acc"], abs=1e-12)
    assert 0.0 <= values["test_acc"] <= 1.0
    assert math.isfinite(values["test_loss"]) and values["test_loss"] > 0
    pngs = [o for o in _outputs(result.notebook, "execute_result") if "image/png" in o["data"]]
    assert pngs, "the learning-curve figure is missing from the executed notebook"
    html = render_html(result.notebook, tmp_path / "run.html")
    assert "<html" in html.read_text()[:2000].lower()
