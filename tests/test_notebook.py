"""Notebooks as runs: recorded values, papermill execution, failures, the training notebook."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat
import pytest

import lab.notebook
from lab import records, runlock
from lab.cli import main as cli_main
from lab.config import ConfigError, describe, field_names
from lab.notebook import (
    RECORD_MIME,
    NotebookError,
    ParameterError,
    RunConflict,
    apply_params,
    config_differences,
    declared_parameters,
    ensure_kernel,
    execute,
    mark_failed,
    notebook_defaults,
    read_values,
    record_value,
    render_html,
    resolve_parameters,
)
from lab.rules import RULES
from lab.train import ConvConfig

ROOT = Path(__file__).resolve().parents[1]
ECHO = ROOT / "tests" / "fixtures" / "notebooks" / "echo.ipynb"
TRAIN = ROOT / "notebooks" / "01-train-conv.ipynb"
# Smoke-size values the training notebook may hold instead of ConvConfig's defaults.
SMOKE_FIELDS = {"n_train", "depth", "width", "epochs", "progress"}


def _outputs(path, output_type):
    nb = nbformat.read(path, as_version=4)
    return [o for cell in nb.cells for o in cell.get("outputs", []) if o.output_type == output_type]


def _files(run_dir: Path) -> dict:
    """name -> (bytes, mtime_ns) of every file in a run directory: what 'unchanged' means."""
    return {p.relative_to(run_dir).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.fixture
def no_kernel(monkeypatch):
    """Fail the test if anything tries to start papermill (a kernel)."""
    def refuse(*args, **kwargs):
        raise AssertionError("a kernel was started")

    monkeypatch.setattr(lab.notebook, "_papermill", refuse)


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
    assert values["omp_threads"] == values["numba_threads"] == "1"
    # The kernel knows its run directory is locked for it (the trainer's hold() is a no-op).
    assert values["run_lock"] == str((tmp_path / "run").resolve())
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
    old = os.umask(0o022)
    try:
        execute(ECHO, tmp_path / "run", {"x": 2})
    finally:
        os.umask(old)
    # Run files follow the user's umask (a private 0600 temp file is not renamed into place).
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "run").rglob("*")
             if p.is_file()}
    assert modes and set(modes.values()) == {0o644}, modes
    record = records.load_record(tmp_path / "run")
    assert record["status"] == "complete" and record["kind"] == "notebook"
    assert record["run_id"] == "run"
    # Numeric values (NaN included: a result, kept) become the final metrics; text does not.
    final = record["final"]
    assert math.isnan(final.pop("nan"))
    assert final == {"x": 102, "twice": 4, "scaled": 2, "nested": {"list": [1, 2.5],
                                                                    "none": None}}
    # The record holds the resolved parameters: the notebook's defaults filled in.
    assert record["config"] == {"x": 2, "fail_on": -1, "write_record": False,
                                "opts": {"scale": 1, "label": "a"}}


def test_unknown_parameter_is_refused_before_running(tmp_path):
    with pytest.raises(ParameterError) as err:
        execute(ECHO, tmp_path / "run", {"x": 1, "learning_rate": 0.1})
    message = str(err.value)
    assert "'learning_rate'" in message
    # out_dir is declared but refused as a parameter, so it is not offered.
    assert message.endswith("declared: x, fail_on, write_record, opts")
    assert not (tmp_path / "run").exists()
    with pytest.raises(ParameterError, match="out_dir='elsewhere' was given as a parameter"):
        execute(ECHO, tmp_path / "run", {"out_dir": "elsewhere"})
    assert not (tmp_path / "run").exists()
    with pytest.raises(NotebookError, match="does not exist"):
        execute(tmp_path / "nope.ipynb", tmp_path / "run", {})


def test_failing_cell_before_any_record(tmp_path):
    result = execute(ECHO, tmp_path / "run", {"x": 3, "fail_on": 3})
    assert result.status == "failed" and not result.ok
    assert "ValueError: asked to fail at x=3" in result.error
    # The cell is named by its position in the source notebook (papermill's index
    # counts the parameters cell it injects) and its first line is quoted.
    source = nbformat.read(ECHO, as_version=4).cells
    position = next(i for i, c in enumerate(source, 1) if "raise ValueError" in c.source)
    first = source[position - 1].source.splitlines()[0]
    assert f"(in cell {position} of echo.ipynb, counting every cell from 1, which starts " \
           f"`{first}`)" in result.error
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
    # A later attempt with the same parameters resumes in the same directory.
    again = execute(ECHO, tmp_path / "run", {"x": 3, "fail_on": 3, "write_record": True})
    assert again.status == "failed" and not again.skipped


def _data_files(run_dir: Path) -> dict:
    return {k: v for k, v in _files(run_dir).items()
            if k not in (runlock.LOCK_FILE, runlock.PID_FILE)}


def test_a_finished_run_is_never_modified_by_a_refused_attempt(tmp_path, monkeypatch):
    run = tmp_path / "run"
    assert execute(ECHO, run, {"x": 1}).status == "complete"
    created = records.load_record(run)["created"]
    before = _files(run)
    with monkeypatch.context() as patch:
        patch.setattr(lab.notebook, "_papermill", lambda *a, **k: pytest.fail("kernel started"))
        # The same parameters, spelled with explicit defaults: nothing to do.
        same = execute(ECHO, run, {"x": 1, "fail_on": -1, "opts.scale": 1})
        assert same.skipped and same.status == "complete"
        # Other parameters: refused, naming each difference and what to do.
        with pytest.raises(RunConflict) as err:
            execute(ECHO, run, {"x": 2, "opts.label": "b"})
        message = str(err.value)
        assert "already holds a complete run with other parameters (opts.label: 'a' there " \
               "vs 'b' now; x: 1 there vs 2 now)" in message
        assert "nothing was changed" in message and "--force" in message
        assert _files(run) == before
    # Replacing moves the old run aside, intact, and runs afresh.
    fresh = execute(ECHO, run, {"x": 2}, replace="conflicting")
    assert fresh.status == "complete" and fresh.moved_aside.name.startswith("run.old-")
    assert fresh.moved_aside.parent == tmp_path
    assert _data_files(fresh.moved_aside) == {k: v for k, v in before.items()
                                              if k not in (runlock.LOCK_FILE, runlock.PID_FILE)}
    assert records.load_record(run)["config"]["x"] == 2
    assert records.load_record(fresh.moved_aside)["created"] == created


def test_created_survives_refinalisation(tmp_path):
    run = tmp_path / "run"
    record = records.new_record(run_id="run", kind="echo", config={"x": 1})
    record["created"] = "2020-01-02T03:04:05+00:00"
    records.save_run(run, record)
    mark_failed(run, "run", {"x": 1}, "a worker died")
    again = records.load_record(run)
    assert again["status"] == "failed" and again["error"] == "a worker died"
    assert again["created"] == "2020-01-02T03:04:05+00:00"
    assert again["updated"] != again["created"]
    # A notebook that writes no record: its re-execution keeps the first attempt's time.
    assert execute(ECHO, tmp_path / "e", {"x": 1, "fail_on": 1}).status == "failed"
    first = records.load_record(tmp_path / "e")["created"]
    record = records.load_record(tmp_path / "e")
    record["created"] = first = "2021-01-01T00:00:00+00:00"
    records.save_run(tmp_path / "e", record)
    execute(ECHO, tmp_path / "e", {"x": 1, "fail_on": 1})
    assert records.load_record(tmp_path / "e")["created"] == first


# ---------------------------------------------------------------------------
# parameters checked against the notebook's config class before any kernel starts


def test_parameters_are_built_into_the_config_class(tmp_path, no_kernel):
    resolved = resolve_parameters(TRAIN, {"epochs": 3, "rule": "kp",
                                          "rule_params.feedback_scale": 0.5})
    # The oracle: ConvConfig built from the notebook's defaults and the same values.
    defaults = {k: v for k, v in notebook_defaults(TRAIN).items() if k != "out_dir"}
    expected = ConvConfig(**{**defaults, "epochs": 3, "rule": "kp",
                             "rule_params": {"feedback_scale": 0.5}})
    assert resolved.full and resolved.config == json.loads(json.dumps(
        dataclasses.asdict(expected)))
    assert resolved.params == {"epochs": 3, "rule": "kp", "rule_params": {"feedback_scale": 0.5}}


@pytest.mark.parametrize("params, message", [
    ({"epochs": -3}, r"ConvConfig.epochs=-3 is out of range; allowed: \[1, inf\)"),
    ({"rule": "nosuch"}, r"ConvConfig.rule='nosuch' is unknown; known rules: bp, "),
    ({"lr": "abc"}, r"ConvConfig.lr must be float, got 'abc' \(str\)"),
    ({"lr.x": 1}, r"lr.x=1 sets a key inside lr, but lr is 0.1 \(float\), not a dict"),
    ({"nosuch": 1}, r"does not declare parameter\(s\) 'nosuch'"),
])
def test_bad_values_never_reach_a_kernel(tmp_path, no_kernel, capsys, params, message):
    with pytest.raises(ConfigError, match=message):
        execute(TRAIN, tmp_path / "run", params)
    (key, value), = params.items()
    assert cli_main(["run", str(TRAIN), "--out", str(tmp_path / "run"), "-p", key,
                     str(value)]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and err.count("\n") == 1  # one paragraph
    assert not (tmp_path / "run").exists()


def test_an_unknown_dotted_key_lists_the_allowed_names(tmp_path, no_kernel):
    allowed = field_names(RULES["kp"].Params)
    with pytest.raises(ConfigError) as err:
        execute(TRAIN, tmp_path / "run", {"rule": "kp", "rule_params.nosuch": 1})
    message = str(err.value)
    assert "'nosuch'" in message and "(given by rule_params.nosuch)" in message
    assert all(name in message for name in allowed), (allowed, message)
    assert not (tmp_path / "run").exists()


def test_a_dotted_key_is_not_blamed_for_another_fields_error(tmp_path, no_kernel):
    with pytest.raises(ConfigError) as err:
        execute(TRAIN, tmp_path / "run", {"rule": "kp", "rule_params.feedback_scale": 1.0,
                                          "epochs": 0})
    assert str(err.value) == "ConvConfig.epochs=0 is out of range; allowed: [1, inf)"
    with pytest.raises(ConfigError, match=r"feedback_scale=-1.0 is out of range.* \(given by "
                                          r"rule_params.feedback_scale\)$"):
        execute(TRAIN, tmp_path / "run", {"rule": "kp", "rule_params.feedback_scale": -1.0})
    # Another leaf of the same dict (here a default the data refuses) is not its doing.
    with pytest.raises(ConfigError) as err:
        execute(TRAIN, tmp_path / "run", {"rule": "kp_traffic", "n_train": 256,
                                          "rule_params.traffic_rule": "matched"})
    assert "traffic_calibration_examples=512" in str(err.value)
    assert "given by" not in str(err.value)


def test_apply_params_sets_one_key_inside_a_dict():
    base = {"opts": {"scale": 1, "label": "a"}, "x": 1}
    out = apply_params(base, {"opts.scale": 3, "x": 2, "deep.a.b": 1})
    assert out == {"opts": {"scale": 3, "label": "a"}, "x": 2, "deep": {"a": {"b": 1}}}
    assert base == {"opts": {"scale": 1, "label": "a"}, "x": 1}  # not changed
    # A whole dict, then a dotted key inside it.
    assert apply_params(base, {"opts": {"k": 0}, "opts.scale": 2}) == \
        {"opts": {"k": 0, "scale": 2}, "x": 1}


def test_config_differences_ignore_display_only_fields():
    assert config_differences({"a": 1, "progress": True}, {"a": 1, "progress": False}) == []
    # the checkpoint cadence changes what is saved, never what is computed
    assert config_differences({"a": 1, "checkpoint_every": 5}, {"a": 1, "checkpoint_every": 0}) \
        == []
    assert config_differences({"a": 1}, {"a": 1.0, "b": 2}) == ["b: (absent) there vs 2 now"]
    assert config_differences({"a": 1}, {"a": 1, "b": 2}, full=False) == []
    assert config_differences({"t": (1, 2)}, {"t": [1, 2]}) == []


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


def _foreign_kernel(tmp_path, monkeypatch) -> Path:
    spec = tmp_path / "jp" / "kernels" / "python3" / "kernel.json"
    spec.parent.mkdir(parents=True)
    spec.write_text(json.dumps({"argv": ["/usr/bin/python3", "-m", "ipykernel_launcher", "-f",
                                         "{connection_file}"], "display_name": "other",
                                "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jp"))
    return spec


@pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="needs a virtual environment")
def test_a_kernel_found_through_jupyter_path_is_named(tmp_path, monkeypatch):
    # A foreign "python3" spec on JUPYTER_PATH wins over the venv's: the advice to
    # register the venv's kernel changed nothing, and the message did not say where the
    # foreign spec was.
    import ipykernel.kernelspec

    spec = _foreign_kernel(tmp_path, monkeypatch)
    installs = []
    monkeypatch.setattr(ipykernel.kernelspec, "install", lambda **kw: installs.append(kw))
    with pytest.raises(NotebookError) as err:
        ensure_kernel.__wrapped__()  # (ensure_kernel is cached per process)
    text = " ".join(str(err.value).split())
    assert installs == [{"kernel_name": "python3", "prefix": sys.prefix}]
    assert f"kernel 'python3' runs /usr/bin/python3 (its spec: {spec.parent}, found through " \
           f"JUPYTER_PATH={tmp_path / 'jp'}, which comes before this environment's kernels: " \
           "remove that spec or unset JUPYTER_PATH), not this interpreter" in text


@pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="needs a virtual environment")
def test_a_kernel_that_cannot_be_registered_is_explained(tmp_path, monkeypatch):
    # Registering into an environment this user cannot write raised a bare PermissionError.
    import ipykernel.kernelspec

    _foreign_kernel(tmp_path, monkeypatch)

    def refused(**kw):
        raise PermissionError(13, "Permission denied", "kernel.json")
    monkeypatch.setattr(ipykernel.kernelspec, "install", refused)
    with pytest.raises(NotebookError) as err:
        ensure_kernel.__wrapped__()
    text = " ".join(str(err.value).split())
    assert f"not this interpreter ({sys.executable}), and it could not be registered in " \
           f"{sys.prefix} (Permission denied); ask whoever owns that environment to run " \
           f"`{sys.executable} -m ipykernel install --sys-prefix --name python3`" in text


def test_same_file_needs_no_stat_for_the_same_path(tmp_path):
    from lab.notebook import _same_file

    ghost = str(tmp_path / "gone" / "python")  # cannot be stat-ed (as under a 0700 home)
    assert _same_file(ghost, ghost) and not _same_file(ghost, sys.executable)
    link = tmp_path / "py"
    link.symlink_to(sys.executable)
    assert _same_file(str(link), sys.executable)


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
    # its own folder beside it: the three training notebooks run by hand never share one
    assert defaults["out_dir"] == "run-01-train-conv"


def test_training_notebook_names_its_config_class():
    assert lab.notebook.config_class(TRAIN) is ConvConfig


def test_training_notebook_with_injected_small_parameters(tiny, tmp_path, capsys):
    params = {**tiny, "epochs": 2, "seed": 1, "threads": 1}
    result = execute(TRAIN, tmp_path / "bp-s1", params)
    assert result.status == "complete", result.error
    # Fault 1: the same run with another epoch count is refused and changes nothing;
    # toggling the display-only progress flag is the same run.
    before = _files(tmp_path / "bp-s1")
    args = ["run", str(TRAIN), "--out", str(tmp_path / "bp-s1")]
    args += [a for k, v in params.items() for a in ("-p", k, str(v))
             if k not in ("epochs", "progress")]
    assert cli_main([*args, "-p", "epochs", "3"]) == 2
    err = capsys.readouterr().err
    assert "already holds a complete run with other parameters (epochs: 2 there vs 3 now)" \
        in err and "--force" in err
    assert cli_main([*args, "-p", "epochs", "2", "-p", "progress", "true"]) == 0
    assert "already complete with these parameters; nothing to do" in capsys.readouterr().out
    assert _files(tmp_path / "bp-s1") == before
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
    # kill -9 after the trainer finished but before the notebook's last cell (its
    # metadata.lab is written last): the notebook is executed again to finish, and the
    # trainer's record, which its trainer finds complete and leaves, is kept as it was.
    path = tmp_path / "bp-s1" / "notebook.ipynb"
    nb = json.loads(path.read_text())
    del nb["metadata"]["lab"]
    path.write_text(json.dumps(nb))
    again = execute(TRAIN, tmp_path / "bp-s1", params)
    assert not again.skipped and again.status == "complete", again.error
    kept = records.load_record(tmp_path / "bp-s1")
    assert kept["kind"] == "conv" and kept["rows"] == record["rows"] == {"epoch": 2}
    for key in ("expect", "work", "data", "final", "created", "config"):
        assert kept[key] == record[key], key


def test_a_finished_run_whose_notebook_never_finished_is_executed_again(tmp_path):
    # kill -9 after the trainer's record says complete but before the notebook's end:
    # the executed notebook has no metadata.lab (written last). `lab run` and sweeps
    # must finish it, not call the run done.
    run = tmp_path / "run"
    assert execute(ECHO, run, {"x": 1}).status == "complete"
    path = run / "notebook.ipynb"
    nb = json.loads(path.read_text())
    del nb["metadata"]["lab"]
    path.write_text(json.dumps(nb))
    again = execute(ECHO, run, {"x": 1})
    assert not again.skipped and again.status == "complete"
    assert json.loads(path.read_text())["metadata"]["lab"]["status"] == "complete"
    assert execute(ECHO, run, {"x": 1}).skipped
    path.write_text('{"cells": [')  # cut off mid-write: executed again too
    assert not execute(ECHO, run, {"x": 1}).skipped
    path.unlink()  # a run made without a notebook (the Python API) counts as finished
    assert execute(ECHO, run, {"x": 1}).skipped


def test_a_failed_write_does_not_hide_the_error_that_ended_the_run(tmp_path, monkeypatch,
                                                                   capsys):
    # A run directory made read-only mid-run: the record and the notebook cannot be
    # written. The cell's error comes first, each failed write after it; exit 1.
    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(tmp_path / "run" / "x.tmp"))

    monkeypatch.setattr(lab.notebook, "mark_failed", denied)
    monkeypatch.setattr(lab.notebook, "_finish_notebook", denied)
    result = execute(ECHO, tmp_path / "run", {"x": 3, "fail_on": 3})
    lines = result.error.splitlines()
    assert result.status == "failed" and "asked to fail at x=3" in result.error
    assert lines[-2] == ("the run's record could not be written: PermissionError: [Errno 13] "
                         f"Permission denied: '{tmp_path / 'run' / 'x.tmp'}'")
    assert lines[-1].startswith("the executed notebook could not be updated: PermissionError")
    monkeypatch.setattr(lab.notebook, "execute", denied)
    assert cli_main(["run", str(ECHO), "--out", str(tmp_path / "r2")]) == 1
    assert "error: PermissionError: [Errno 13] Permission denied" in capsys.readouterr().err


def _with_own_parameters(path: Path) -> Path:
    """The training notebook with parameters of its own beyond ConvConfig (as a
    researcher extends it): a note and a list of tags."""
    nb = nbformat.read(TRAIN, as_version=4)
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    cell.source += '\nnote = "default note"\ntags = []\n'
    nbformat.write(nb, str(path))
    return path


def test_a_notebooks_own_parameters_are_part_of_the_run(tiny, tmp_path, capsys):
    # They were dropped from the run's identity: a rerun with another note said
    # "already complete with these parameters", and the analysis saw the protocol's
    # note "(absent)" in the record and called the runs stale.
    notebook = _with_own_parameters(tmp_path / "mine.ipynb")
    params = {**tiny, "epochs": 1, "threads": 1, "note": "hello", "tags": ["a"]}
    run = tmp_path / "run"
    assert execute(notebook, run, params).status == "complete"
    record = records.load_record(run)
    assert record["notebook_params"] == {"note": "hello", "tags": ["a"]}
    assert "note" not in record["config"] and record["kind"] == "conv"
    assert records.run_params(record)["note"] == "hello"
    table = records.load_runs(run)
    assert table["config.note"].tolist() == ["hello"] and table["config.tags"].tolist() == [("a",)]
    assert execute(notebook, run, params).skipped
    with pytest.raises(RunConflict, match=r"other parameters \(note: 'hello' there vs "
                                          r"'something else' now\)"):
        execute(notebook, run, {**params, "note": "something else"})
    # A default is a value too: leaving the note out asks for "default note".
    with pytest.raises(RunConflict, match=r"note: 'hello' there vs 'default note' now"):
        execute(notebook, run, {k: v for k, v in params.items() if k != "note"})
    # The trainer called directly (no notebook holding the run) records none, even with
    # the variable set in its environment for another run directory.
    from lab.train import train_conv

    os.environ[runlock.PARAMS_ENV] = '{"note": "elsewhere"}'
    try:
        direct = train_conv(ConvConfig(**{**tiny, "epochs": 1}), tmp_path / "direct")
    finally:
        del os.environ[runlock.PARAMS_ENV]
    assert "notebook_params" not in direct
    assert "notebook_params" not in records.load_record(tmp_path / "direct")


def test_a_computed_default_is_refused_naming_the_cell(tmp_path, no_kernel):
    # `epochs = 1 + 1` was read as the string '1 + 1' ("must be int, got '1 + 1' (str)").
    nb = nbformat.read(TRAIN, as_version=4)
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    cell.source = re.sub(r"(?m)^epochs = .*$", "epochs = 1 + 1", cell.source)
    assert "epochs = 1 + 1" in cell.source
    path = tmp_path / "computed.ipynb"
    nbformat.write(nb, str(path))
    with pytest.raises(ParameterError, match=rf"the parameters cell of {re.escape(str(path))} "
                                             r"computes its default for epochs = 1 \+ 1; .*must "
                                             r"be a literal"):
        resolve_parameters(path, {"n_train": 256})
    # Given explicitly, the default is not used: fine.
    assert resolve_parameters(path, {"epochs": 2}).config["epochs"] == 2


def test_a_parameters_cell_missing_a_config_field_is_refused_before_a_kernel(
        tmp_path, no_kernel, capsys):
    # The field fell back to its class default in the pre-check, so the run started, and
    # the kernel's config_from failed: a failed run left behind, exit 1.
    nb = nbformat.read(TRAIN, as_version=4)
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    cell.source = re.sub(r"(?m)^grad_clip = .*\n", "", cell.source)
    assert "grad_clip" not in cell.source
    path = tmp_path / "removed.ipynb"
    nbformat.write(nb, str(path))
    message = (rf"notebook {re.escape(str(path))}: its parameters cell does not declare "
               r"ConvConfig field\(s\) grad_clip \(its config class, named in its metadata "
               r"'lab_config'\); .*declare every field there, e.g. `grad_clip = 0.0` "
               r"\(the default\)")
    with pytest.raises(ParameterError, match=message):
        resolve_parameters(path, {"n_train": 256})
    # Given as a parameter, the same answer (not "does not declare parameter 'grad_clip'").
    with pytest.raises(ParameterError, match=message):
        resolve_parameters(path, {"grad_clip": 0.5})
    out = tmp_path / "run"
    assert cli_main(["run", str(path), "--out", str(out)]) == 2
    assert re.search(message, capsys.readouterr().err)
    assert not out.exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("notebook", ["01-train-conv", "02-train-ep-transformer",
                                      "03-train-cfc-aux"])
def test_a_device_the_machine_lacks_is_refused_before_a_kernel(notebook, tmp_path, no_kernel):
    path = ROOT / "notebooks" / f"{notebook}.ipynb"
    with pytest.raises(ConfigError, match=r"device='cuda' was asked for but torch sees no CUDA "
                                          r"device; use device='cpu' or 'auto'"):
        execute(path, tmp_path / "run", {"device": "cuda"})
    assert not (tmp_path / "run").exists()


def test_data_dir_blank_is_the_directory_it_stands_for(tmp_path, monkeypatch):
    # data_dir "" means $LAB_DATA_DIR: the same run as one given that directory by name,
    # another run when $LAB_DATA_DIR points elsewhere.
    from lab.notebook import Resolved, asked_differences

    used, other = tmp_path / "data", tmp_path / "elsewhere"
    used.mkdir()
    other.mkdir()
    named = {"data_dir": str(used), "lr": 0.1}
    blank = {"data_dir": "", "lr": 0.1}
    read = {"dataset": "mnist1d", "dir": str(used), "sha256": "0" * 64}

    def differences(then: dict, now: dict, data=None) -> list[str]:
        record = {"config": then, **({"data": data} if data else {})}
        return asked_differences(record, Resolved({}, now, full=True))

    monkeypatch.setenv("LAB_DATA_DIR", str(used))
    assert differences(named, blank) == []
    assert differences(blank, named, read) == []  # the directory the run read, recorded
    assert differences(blank, {**named, "data_dir": str(tmp_path / "data" / ".")}, read) == []
    assert differences(named, {**blank, "lr": 0.2}) == ["lr: 0.1 there vs 0.2 now"]
    monkeypatch.setenv("LAB_DATA_DIR", str(other))
    assert differences(named, blank) == [f"data_dir: {str(used)!r} there vs '' now"]
    # A blank run that read `used` (its $LAB_DATA_DIR then) is not one in `other`.
    assert differences(blank, {**named, "data_dir": str(other)}, read) == \
        [f"data_dir: '' there vs {str(other)!r} now"]
    assert differences(blank, named, read) == []
    monkeypatch.delenv("LAB_DATA_DIR")
    monkeypatch.setenv("HOME", str(tmp_path))  # the default: ~/.cache/lab
    cache = tmp_path / ".cache" / "lab"
    assert differences({**named, "data_dir": str(cache)}, blank) == []
    assert differences(named, blank) != []


def test_a_kernel_dying_of_the_same_ctrl_c_is_an_interrupt_not_a_failure(tmp_path,
                                                                          monkeypatch):
    # Ctrl-C reaches the kernel too; when its death won the race against asyncio's
    # cancellation, papermill raised DeadKernelError and the run was marked failed with
    # "Kernel died" (plus an asyncio traceback).
    import signal

    import papermill

    from lab import notebook as nb

    def dies_of_the_interrupt(*args, **kwargs):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        except KeyboardInterrupt:  # what asyncio's cancellation did with it
            pass
        raise RuntimeError("Kernel died")

    monkeypatch.setattr(papermill, "execute_notebook", dies_of_the_interrupt)
    with pytest.raises(KeyboardInterrupt):
        nb._papermill(TRAIN, tmp_path / "x.ipynb", {}, None, False)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

    def fails(*args, **kwargs):  # no Ctrl-C: a failure stays a failure
        raise RuntimeError("a cell raised")

    monkeypatch.setattr(papermill, "execute_notebook", fails)
    assert "a cell raised" in nb._papermill(TRAIN, tmp_path / "x.ipynb", {}, None, False)


FIXTURE_RUNS = {"conv": ROOT / "tests/fixtures/summary/runs/lr-0.05_rule-bp_seed-0",
                "ep": ROOT / "tests/fixtures/ep/runs/beta-0.1_seed-0",
                "cfc_aux": ROOT / "tests/fixtures/cfc-aux/runs/aux-lift_seed-0"}
TRAINING = {"conv": TRAIN, "ep": ROOT / "notebooks/02-train-ep-transformer.ipynb",
            "cfc_aux": ROOT / "notebooks/03-train-cfc-aux.ipynb"}


@pytest.mark.parametrize("kind", sorted(TRAINING))
def test_each_training_notebook_knows_the_kind_its_trainer_records(kind):
    # The oracle: the kind in a record the trainer actually wrote (the fixture runs).
    assert records.load_record(FIXTURE_RUNS[kind])["kind"] == kind
    cls = lab.notebook.config_class(TRAINING[kind])
    assert lab.notebook.trainer_kind(cls) == kind


def test_a_run_of_another_kind_is_named_in_one_line(tmp_path, capsys, no_kernel):
    # A CfC notebook pointed at a conv run listed ~57 "X there vs Y now" fields and
    # never said the directory holds another trainer's run.
    import shutil

    run = tmp_path / "conv-run"
    shutil.copytree(FIXTURE_RUNS["conv"], run)
    before = _files(run)
    assert cli_main(["run", str(TRAINING["cfc_aux"]), "--out", str(run)]) == 2
    err = capsys.readouterr().err
    assert f"{run} holds a conv run; this notebook makes cfc_aux runs: give it another " \
        "--out (or out_dir" in err
    assert "there vs" not in err and len(err.strip().splitlines()) == 1
    assert _files(run) == before
    # --force still moves the other run aside (the kind check only words the refusal).
    decision, _ = lab.notebook.decide(run, resolve_parameters(TRAINING["cfc_aux"]),
                                      "conflicting")
    assert decision == "replace"
    # A run of the notebook's own kind still gets the field diff.
    with pytest.raises(RunConflict, match=r"other parameters \(.* there vs .* now"):
        lab.notebook.decide(run, resolve_parameters(TRAIN, {"width": 3}), "never")


def _with_typed_parameters(path: Path, base: Path = ECHO) -> Path:
    nb = nbformat.read(base, as_version=4)
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    cell.source += ('\nsmooth: int = 3\nnote = "hello"\nlr = 0.5\nflag = False\n'
                    'ratio: float = 1\ntags = []\nmaybe = None\nlabel: str = None\n')
    nbformat.write(nb, str(path))
    return path


@pytest.mark.parametrize("name, value, want", [
    ("smooth", "abc", "int"), ("smooth", True, "int"), ("smooth", 2.0, "int"),
    ("note", 5, "str"), ("lr", "0.1", "float"), ("lr", False, "float"),
    ("flag", 1, "bool"), ("ratio", "x", "float"), ("label", 3, "str"), ("x", "abc", "int")])
def test_a_notebooks_own_parameter_of_the_wrong_type_is_refused(tmp_path, no_kernel, name,
                                                                value, want):
    # `smooth: int = 3` took -p smooth abc and the run recorded smooth=abc.
    path = _with_typed_parameters(tmp_path / "typed.ipynb")
    message = (rf"^{re.escape(str(path))} parameter {name} must be {want}, got "
               rf"{re.escape(repr(value))} \({type(value).__name__}\)$")
    with pytest.raises(ParameterError, match=message):
        resolve_parameters(path, {name: value})


def test_a_notebooks_own_parameters_of_the_right_type_are_taken(tmp_path, no_kernel):
    path = _with_typed_parameters(tmp_path / "typed.ipynb")
    good = {"smooth": 5, "note": "n", "lr": 1, "flag": True, "ratio": 0.25, "tags": "any",
            "maybe": {"a": 1}, "label": "l", "x": -2, "opts.scale": "anything"}
    resolved = resolve_parameters(path, good)
    assert {k: resolved.config[k] for k in good if "." not in k} == \
        {k: v for k, v in good.items() if "." not in k}
    assert resolved.config["opts"] == {"scale": "anything", "label": "a"}
    # Beside a config class too, and on the CLI: exit 2, nothing created.
    train = _with_typed_parameters(tmp_path / "train.ipynb", TRAIN)
    assert resolve_parameters(train, {"smooth": 4}).extras["smooth"] == 4
    with pytest.raises(ParameterError, match=r"parameter smooth must be int, got 'abc' \(str\)"):
        resolve_parameters(train, {"smooth": "abc", "width": 4})


def test_cli_refuses_a_mistyped_own_parameter_before_anything(tmp_path, capsys, no_kernel):
    path = _with_typed_parameters(tmp_path / "typed.ipynb")
    out = tmp_path / "r"
    assert cli_main(["run", str(path), "--out", str(out), "-p", "smooth", "abc"]) == 2
    assert f"{path} parameter smooth must be int, got 'abc' (str)" in capsys.readouterr().err
    assert not out.exists()


def test_a_failed_run_that_never_trained_gives_way_to_corrected_parameters(tiny, tmp_path):
    # A run refused inside its kernel leaves a failed record with no rows; the corrected
    # command was refused as if a real run stood there, and needed --force.
    params = {**tiny, "epochs": 1, "threads": 1}
    resolved = resolve_parameters(TRAIN, params)
    mark_failed(tmp_path / "r", "r", {**resolved.config, "epochs": 2}, "ConfigError: no")
    assert lab.notebook.decide(tmp_path / "r", resolved, "never")[0] == "replace"
    # One that trained a step holds rows worth keeping: still refused without --force.
    record = records.load_record(tmp_path / "r", rows=False)
    records.save_run(tmp_path / "r", {**record, "rows": {"epoch": 1}})
    with pytest.raises(RunConflict, match=r"already holds a failed run with other parameters "
                                          r"\(epochs: 2 there vs 1 now\); nothing was changed"):
        lab.notebook.decide(tmp_path / "r", resolved, "never")


def test_a_directory_given_as_notebook_is_named_a_directory(tmp_path):
    folder = tmp_path / "notebooks"
    folder.mkdir()
    with pytest.raises(NotebookError, match=rf"notebook {folder} is a directory; give the "
                                            r"notebook \(\.ipynb\)"):
        execute(folder, tmp_path / "out")
    with pytest.raises(NotebookError, match=rf"notebook {tmp_path / 'no.ipynb'} does not exist"):
        execute(tmp_path / "no.ipynb", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_decide_names_what_would_make_the_run(tmp_path):
    run = tmp_path / "ep-run"
    record = records.new_record(run_id="ep-run", kind="ep", config={})
    record["status"] = "complete"
    records.save_run(run, record)
    resolved = resolve_parameters(TRAIN, {"width": 3})
    with pytest.raises(RunConflict, match=rf"{run} holds an ep run; `lab train` makes conv runs"):
        lab.notebook.decide(run, resolved, "never", maker="`lab train`")
    with pytest.raises(RunConflict, match="holds an ep run; this notebook makes conv runs"):
        lab.notebook.decide(run, resolved, "never")


def test_a_kernel_that_dies_before_starting_is_started_again(tmp_path, monkeypatch):
    # Two kernels starting at once can pick the same port and die before kernel_info: no
    # cell ran, so another start is safe; a cell's error is never retried.
    import papermill

    calls = []

    def execute(*args, **kwargs):
        calls.append(1)
        if len(calls) < outcome["fail"]:
            raise outcome["error"]

    outcome = {"fail": 2, "error": RuntimeError("Kernel died before replying to kernel_info")}
    monkeypatch.setattr(papermill, "execute_notebook", execute)
    nb, target = tmp_path / "n.ipynb", tmp_path / "out.ipynb"
    assert lab.notebook._papermill(nb, target, {}, None, False) is None and len(calls) == 2
    calls.clear()
    outcome["fail"] = 99  # never starts: the error after KERNEL_STARTS tries
    assert "kernel_info" in lab.notebook._papermill(nb, target, {}, None, False)
    assert len(calls) == lab.notebook.KERNEL_STARTS
    calls.clear()
    outcome["error"] = ValueError("asked to fail")  # a cell's error: one try
    assert "asked to fail" in lab.notebook._papermill(nb, target, {}, None, False)
    assert len(calls) == 1


def test_kernels_talk_over_unix_sockets_that_go_with_them():
    # TCP ports chosen free could be taken by another process's connection before the
    # kernel bound them ("Address already in use"; the run failed after 60 s, in a sweep).
    import asyncio

    from lab.notebook import _kernel_manager_class

    km = _kernel_manager_class()(kernel_name="python3")
    assert km.transport == "ipc" and km.ip.startswith(km._socket_dir)
    assert len(km.ip) + len("-65535") < 100  # under the ~107-byte limit of a socket path
    # and its connection file beside them (a killed sweep left /tmp/tmp*.json files)
    assert Path(km.connection_file).parent == Path(km._socket_dir)

    async def start_and_stop():
        await km.start_kernel()
        info = km.get_connection_info()
        assert (info["transport"], info["ip"]) == ("ipc", km.ip)
        client = km.client()
        client.start_channels()
        await client.wait_for_ready(timeout=60)  # it answers over those sockets
        assert any(p.name.startswith("k-") for p in Path(km._socket_dir).iterdir())
        assert Path(km.connection_file).is_file()
        client.stop_channels()
        await km.shutdown_kernel(now=True)

    asyncio.run(start_and_stop())
    assert not Path(km._socket_dir).exists()


def test_socket_dirs_of_killed_processes_are_removed_by_the_next_kernel(tmp_path, monkeypatch):
    # A SIGKILLed `lab run` cannot remove its kernel's socket directory; the next one does.
    from lab.notebook import _kernel_manager_class

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead = tmp_path / f"lab-kernel-{int(gone.stdout)}-abc123"
    alive = tmp_path / f"lab-kernel-{os.getppid()}-def456"  # a living process's
    other = tmp_path / "lab-kernel-xyz"  # not named after a pid: not ours to judge
    for d in (dead, alive, other):
        (d / "sub").mkdir(parents=True)
    km = _kernel_manager_class()(kernel_name="python3")
    assert not dead.exists()
    assert alive.exists() and other.exists()
    assert Path(km._socket_dir).parent == tmp_path
    assert Path(km._socket_dir).name.startswith(f"lab-kernel-{os.getpid()}-")


def test_a_trainers_refusal_leaves_the_run_as_it_was(tmp_path):
    # A foreign checkpoint in an interrupted run: the trainer refuses before touching it,
    # so the run must stay interrupted (resumable once the file is removed), not "failed".
    from lab.lifecycle import CHECKPOINT
    from lab.notebook import _settle_record
    from lab.train.synthetic import SyntheticConfig, train_synthetic

    run = tmp_path / "r"
    train_synthetic(SyntheticConfig(steps=10, checkpoint_every=5), run)
    record = records.load_record(run, rows=False)
    record["status"] = "running"  # as a killed run leaves it
    records.save_run(run, record)
    (run / CHECKPOINT).unlink()
    before = (run / records.RECORD_FILE).read_bytes()
    started = time.time() + 1  # the kernel started after the record was last written
    error = f"CheckpointError: checkpoint {run / CHECKPOINT} cannot be read (...)"
    assert _settle_record(run, "r", {}, {}, error, started) == ("failed", error)
    assert (run / records.RECORD_FILE).read_bytes() == before
    # any other error, or a refusal after the trainer wrote its record, marks it failed
    for err, at in (("ValueError: broken", started), (error, started - 10)):
        assert _settle_record(run, "r", {}, {}, err, at) == ("failed", err)
        assert records.load_record(run, rows=False)["status"] == "failed"
        (run / records.RECORD_FILE).write_bytes(before)


def test_an_executed_notebook_cut_short_by_a_full_disk_says_so(tmp_path, monkeypatch):
    # papermill's last write of the executed notebook, cut short by a full disk, was
    # reported as "cannot be read as a Jupyter notebook" with exit 2 (a bad value), and
    # the record was left "running".
    import shutil as shutil_module

    import lab.notebook as nb_module

    def truncated(notebook, target, params, timeout, log_output):
        target.write_text('{"cells": [{"cell_type": "co')
        return None
    monkeypatch.setattr(nb_module, "_papermill", truncated)
    real = shutil_module.disk_usage
    monkeypatch.setattr(shutil_module, "disk_usage",
                        lambda p: real(p)._replace(free=4096))
    result = execute(ECHO, tmp_path / "run", {"x": 3}, threads=1)
    assert result.status == "failed"
    text = " ".join(result.error.split())
    assert f"notebook {tmp_path / 'run' / 'notebook.ipynb'} cannot be read as a Jupyter " \
           "notebook" in text
    assert f"(the disk holding {tmp_path / 'run'} has 4,096 bytes free: full? Free some " \
           "space and run the same command again to resume)" in text
    assert records.load_record(tmp_path / "run")["status"] == "failed"
    # the cut notebook is replaced by its source (readable), its outcome in the metadata
    kept = nbformat.read(tmp_path / "run" / "notebook.ipynb", as_version=4)
    assert kept.metadata["lab"]["status"] == "failed"
    monkeypatch.setattr(shutil_module, "disk_usage", real)  # room enough: no such note
    result = execute(ECHO, tmp_path / "run2", {"x": 3}, threads=1)
    assert result.status == "failed" and "bytes free" not in result.error
