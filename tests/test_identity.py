"""A run's identity includes its notebook's code; a run is never made inside another run,
even one killed before its first record (issue 35, faults 3 and 4)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import nbformat
import pytest
import yaml

import lab.notebook
from lab import records, runlock
from lab.cli import main as cli_main
from lab.notebook import CODE_KEY, RunConflict, code_identity, execute
from lab.sweep import load_protocol, run_sweep, stale_runs

ROOT = Path(__file__).resolve().parents[1]
ECHO = ROOT / "tests" / "fixtures" / "notebooks" / "echo.ipynb"
TRAIN = ROOT / "notebooks" / "01-train-conv.ipynb"


def _copy(notebook: Path, path: Path, edit=None) -> Path:
    """``notebook`` copied to ``path``; ``edit(cells)`` changes the copy's cells."""
    nb = nbformat.read(notebook, as_version=4)
    if edit is not None:
        edit(nb.cells)
    nbformat.write(nb, str(path))
    return path


def _code_cells(cells) -> list:
    return [c for c in cells if c.cell_type == "code" and "parameters" not in c.metadata.get(
        "tags", [])]


def _edit_code(cells) -> None:  # a real edit of the first code cell after the parameters
    cell = _code_cells(cells)[0]
    cell.source = cell.source.replace('record_value("twice", 2 * x)',
                                      'record_value("twice", 3 * x)')


def _respace(cells) -> None:  # whitespace only: trailing blanks, blank lines, CRLF
    for cell in _code_cells(cells):
        cell.source = "\n\n" + cell.source.replace("\n", "   \r\n\n") + "\n\n  \n"


def _files(run_dir: Path) -> dict:
    return {p.relative_to(run_dir).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.fixture
def no_kernel(monkeypatch):
    monkeypatch.setattr(lab.notebook, "_papermill",
                        lambda *a, **k: pytest.fail("a kernel was started"))


# ---------------------------------------------------------------------------
# fault 3: the notebook's code


def test_code_identity_is_the_code_cells_normalised(tmp_path):
    import hashlib

    base = code_identity(ECHO)
    cells = _code_cells(nbformat.read(ECHO, as_version=4).cells)
    # Oracle: sha256 of the code cells, each with trailing blanks and blank lines dropped.
    texts = ["\n".join(line.rstrip() for line in c.source.splitlines() if line.strip())
             for c in cells]
    assert base.sha256 == hashlib.sha256("\n\0\n".join(texts).encode()).hexdigest()
    assert len(base.cells) == 2 and base.cells[0][:2] == (3, "import math")
    # Whitespace, outputs, metadata and the parameters cell are not the code...
    def noise(cells):
        _respace(cells)
        cells[1].source = "x = 5  # another default"
        for cell in cells:
            cell.metadata["collapsed"] = True
            if cell.cell_type == "code":
                cell.outputs = [nbformat.v4.new_output("stream", text="old output")]
        cells.insert(1, nbformat.v4.new_markdown_cell("a note"))
        cells.append(nbformat.v4.new_code_cell("   \n"))  # an empty code cell
    same = code_identity(_copy(ECHO, tmp_path / "same.ipynb", noise))
    assert same.sha256 == base.sha256
    assert [c[2] for c in same.cells] == [c[2] for c in base.cells]
    # ...but a changed expression is, and so is indentation (Python reads it).
    assert code_identity(_copy(ECHO, tmp_path / "e.ipynb", _edit_code)).sha256 != base.sha256

    def indent(cells):
        cell = _code_cells(cells)[1]
        cell.source = cell.source.replace("    raise ValueError", "        raise ValueError")
    assert code_identity(_copy(ECHO, tmp_path / "i.ipynb", indent)).sha256 != base.sha256


def test_a_finished_run_of_other_code_is_stale_and_whitespace_is_not(tmp_path, monkeypatch):
    notebook = _copy(ECHO, tmp_path / "echo.ipynb")
    run = tmp_path / "run"
    assert execute(notebook, run, {"x": 1}).status == "complete"
    record = records.load_record(run, rows=False)
    assert record[CODE_KEY] == code_identity(notebook).as_record()
    before = _files(run)
    monkeypatch.setattr(lab.notebook, "_papermill",
                        lambda *a, **k: pytest.fail("a kernel was started"))
    _copy(ECHO, notebook, _respace)
    assert execute(notebook, run, {"x": 1}).skipped  # whitespace only: the same run
    _copy(ECHO, notebook, _edit_code)
    with pytest.raises(RunConflict) as err:
        execute(notebook, run, {"x": 1})
    message = str(err.value)
    assert err.value.reason == "stale"
    assert ("already holds a complete run made with other code (echo.ipynb's code changed "
            "since: cell 3 (`import math`), counting every cell from 1, is not the code the "
            "run was made with); nothing was changed") in message
    assert "--force" in message and "restore the notebook's code" in message
    assert _files(run) == before  # refused: the finished run is byte-identical
    # A record from before the code was recorded is "code unknown": not stale for that.
    records.write_record(run, {k: v for k, v in record.items() if k != CODE_KEY})
    assert execute(notebook, run, {"x": 1}).skipped


def test_an_unfinished_run_of_other_code_is_not_resumed_with_it(tmp_path):
    notebook = _copy(ECHO, tmp_path / "echo.ipynb")
    run = tmp_path / "run"
    asked = {"x": 3, "fail_on": 3, "write_record": True}  # fails after its first rows
    assert execute(notebook, run, asked).status == "failed"
    record = records.load_record(run, rows=False)
    assert record[CODE_KEY] == code_identity(notebook).as_record()
    _copy(ECHO, notebook, _edit_code)
    with pytest.raises(RunConflict, match=r"already holds a failed run made with other code "
                                          r"\(echo.ipynb's code changed since: cell 3 "
                                          r"\(`import math`\).*\); resuming it would mix two "
                                          r"versions of the code in one run; nothing was"):
        execute(notebook, run, asked)
    assert records.load_record(run, rows=False) == record
    _copy(ECHO, notebook, _respace)  # whitespace only: the same code, resumed
    again = execute(notebook, run, asked)
    assert again.status == "failed" and not again.skipped


def _sweep_protocol(tmp_path: Path, notebook: Path, seeds: list[int]) -> Path:
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({"name": "t", "notebook": str(notebook), "out": "runs",
                                    "grid": {"x": seeds}, "threads_per_run": 1}))
    return path


def test_a_sweep_calls_runs_of_edited_code_stale_and_a_report_refuses_to_mix(tmp_path,
                                                                             capsys):
    from analysis import MixedCodeError, load_protocol_runs

    notebook = _copy(ECHO, tmp_path / "echo.ipynb")
    path = _sweep_protocol(tmp_path, notebook, [1, 2])
    assert cli_main(["sweep", str(path), "--workers", "1", "-q"]) == 0
    old = records.load_record(tmp_path / "runs" / "x-1", rows=False)[CODE_KEY]
    # Whitespace-only edits: every run is the same run, nothing executes.
    _copy(ECHO, notebook, _respace)
    report = run_sweep(load_protocol(path), workers=1, progress=False)
    assert [(o.status, o.skipped) for o in report.outcomes] == [("complete", True)] * 2
    assert stale_runs(load_protocol(path)) == {}
    # A code cell edited and a seed added: the old runs are stale, not "already finished".
    _copy(ECHO, notebook, _edit_code)
    path = _sweep_protocol(tmp_path, notebook, [1, 2, 3])
    capsys.readouterr()
    assert cli_main(["sweep", str(path), "--workers", "1", "-q"]) == 1
    out = capsys.readouterr().out
    assert "3 runs, 1 executed, 0 already finished" in out and "2 left alone" in out
    report = run_sweep(load_protocol(path), workers=1, progress=False)
    status = {o.run_id: o.status for o in report.outcomes}
    assert status == {"x-1": "stale", "x-2": "stale", "x-3": "complete"}
    stale = report.outcomes[0].error
    assert "echo.ipynb's code changed since: cell 3 (`import math`)" in stale
    why = stale_runs(load_protocol(path))
    assert set(why) == {"x-1", "x-2"} and "cell 3 (`import math`)" in why["x-1"]
    assert stale_runs(load_protocol(path), mixed_code=True) == {}
    new = records.load_record(tmp_path / "runs" / "x-3", rows=False)[CODE_KEY]
    assert new == code_identity(notebook).as_record() and new["sha256"] != old["sha256"]
    # The analysis refuses the two versions together, naming both, unless told.
    with pytest.raises(MixedCodeError) as err:
        load_protocol_runs(path)
    message = str(err.value)
    assert "were made with 2 versions of its notebook's code" in message
    assert f"version {old['sha256'][:12]}: 2 run(s): x-1, x-2" in message
    assert f"version {new['sha256'][:12]} (the notebook now): 1 run(s): x-3" in message
    assert "mixed_code=True" in message
    loaded = load_protocol_runs(path, mixed_code=True)
    assert sorted(loaded.runs["run_id"]) == ["x-1", "x-2", "x-3"]
    with pytest.raises(TypeError, match="mixed_code must be a bool"):
        load_protocol_runs(path, mixed_code="yes")
    # lab report: refused as stale, and --mixed-code only with a notebook that takes it.
    capsys.readouterr()
    summary = ROOT / "notebooks" / "10-summary.ipynb"
    assert cli_main(["report", str(path), "--notebook", str(summary),
                     "--out", str(tmp_path / "reports")]) == 2
    err = capsys.readouterr().err
    assert "x-1: echo.ipynb's code changed" in err and "--mixed-code" in err
    older = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        'protocol = ""\nruns_dir = ""', metadata={"tags": ["parameters"]})])
    older.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                    "language": "python"}
    nbformat.write(older, str(tmp_path / "older-report.ipynb"))
    assert cli_main(["report", str(path), "--notebook", str(tmp_path / "older-report.ipynb"),
                     "--mixed-code", "--out", str(tmp_path / "reports")]) == 2
    assert "does not take a mixed_code parameter" in capsys.readouterr().err
    # --force replaces the stale runs (kept aside); then one version, no refusal.
    report = run_sweep(load_protocol(path), workers=1, progress=False, force=True)
    assert [o.status for o in report.outcomes] == ["complete"] * 3
    assert len(load_protocol_runs(path).runs) == 3


def test_a_trainers_record_holds_the_code_it_was_made_with(tiny, tmp_path):
    params = {k: v for k, v in tiny.items() if k in ("n_train", "depth", "width", "epochs",
                                                     "batch_size")}
    result = execute(TRAIN, tmp_path / "run", params)
    assert result.status == "complete", result.error
    record = records.load_record(tmp_path / "run", rows=False)
    assert record["kind"] == "conv"
    assert record[CODE_KEY] == code_identity(TRAIN).as_record()


# ---------------------------------------------------------------------------
# fault 4: --out inside a run killed before its first record

HOLD = textwrap.dedent("""
    import sys, time
    from lab import runlock
    lock = runlock.acquire(sys.argv[1])
    print("held", flush=True)
    time.sleep(600)
""")


def _killed_before_its_first_record(run_dir: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.mark.parametrize("marker", [".lock", "checkpoint.pt", "rows"])
def test_out_inside_a_run_killed_before_its_first_record_is_refused(tmp_path, capsys,
                                                                    monkeypatch, marker):
    early = tmp_path / "early"
    if marker == ".lock":
        _killed_before_its_first_record(early)
        assert sorted(p.name for p in early.iterdir()) == [".lock", ".lock.pid"]
    elif marker == "rows":
        (early / "rows" / "epoch").mkdir(parents=True)
    else:
        early.mkdir()
        (early / marker).write_bytes(b"\x80\x02}q\x00.")
    inner = early / "sub"
    with monkeypatch.context() as patch:
        patch.setattr(lab.notebook, "_papermill", lambda *a, **k: pytest.fail("kernel started"))
        start = time.monotonic()
        assert cli_main(["run", str(ECHO), "--out", str(inner), "-p", "x", "1"]) == 2
        assert time.monotonic() - start < 5
    err = capsys.readouterr().err
    assert f"--out {inner} lies inside the run directory {early}, so the new run would be " \
           "nested in that run" in err and f"it holds {marker}: a run's" in err
    assert not inner.exists()
    # The outer run is still resumable where it was.
    assert cli_main(["run", str(ECHO), "--out", str(early), "-p", "x", "1"]) == 0
    assert records.load_record(early)["status"] == "complete"


def test_another_tools_lock_file_does_not_make_a_run(tmp_path):
    # pytest's numbered directories hold a .lock with its pid in it; ours is empty.
    (tmp_path / "tool").mkdir()
    (tmp_path / "tool" / ".lock").write_text("12345")
    assert runlock.enclosing_run(tmp_path / "tool" / "x") is None
    runlock.check_run_dir(tmp_path / "tool" / "x")
    runlock.acquire(tmp_path / "run").release()
    assert runlock.enclosing_run(tmp_path / "run" / "x") == tmp_path / "run"


def test_the_lock_does_not_import_records():
    # records imports the lock (live status); the lock reads a record's status as JSON.
    code = ("import sys; import lab.runlock; "
            "print(sorted(m for m in sys.modules if m.startswith('lab.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
    assert json.loads(out.replace("'", '"')) == ["lab.config", "lab.runlock"]
