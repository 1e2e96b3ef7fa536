"""Every committed notebook: thin, numbered, output-free, and runs under ``pytest --nbval-lax``.

nbval starts each kernel in the notebook's own directory, and the training
notebooks write their run into ``out_dir`` (by default ``run-<notebook stem>``
beside the notebook, so the three trainers' runs never share a folder); each
notebook runs from a copy in its own temporary directory, beside a link to
``tests/`` that keeps its relative fixture paths valid.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    names = [p.name for p in NOTEBOOKS]
    for name in ("01-train-conv", "02-train-ep-transformer", "03-train-cfc-aux", "10-summary",
                 "11-compare-rules", "12-mt1", "20-ep-summary", "30-cfc-summary"):
        assert f"{name}.ipynb" in names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_committed_clean_and_thin(path):
    assert re.fullmatch(r"\d\d-[a-z0-9-]+\.ipynb", path.name), "notebooks are numbered: NN-name"
    nb = nbformat.read(path, as_version=4)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    dirty = [i for i, cell in enumerate(code) if cell.outputs or cell.execution_count]
    assert not dirty, f"{path.name}: code cells {dirty} hold outputs; clear them before committing"
    assert nb.metadata["kernelspec"]["name"] == "python3"
    tagged = [cell for cell in code if "parameters" in cell.metadata.get("tags", [])]
    assert len(tagged) == 1 and code[0] is tagged[0], "one parameters cell, the first code cell"
    for node in ast.parse(tagged[0].source).body:
        assert isinstance(node, ast.Assign), f"{path.name}: only assignments in parameters"
        ast.literal_eval(node.value)  # literals only: papermill can override each one


def test_notebooks_run_under_nbval(tmp_path):
    targets = []
    for path in NOTEBOOKS:
        home = tmp_path / path.stem
        (home / "notebooks").mkdir(parents=True)
        shutil.copy(path, home / "notebooks" / path.name)
        os.symlink(ROOT / "tests", home / "tests")
        targets.append(str(home / "notebooks" / path.name))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax",
         "--nbval-current-env", "--rootdir", str(tmp_path), *targets],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert re.search(r"\b\d+ passed\b", done.stdout) and "failed" not in done.stdout
    # The training notebooks left their runs: a complete record each.
    from lab import records

    for stem in ("01-train-conv", "02-train-ep-transformer", "03-train-cfc-aux"):
        run = tmp_path / stem / "notebooks" / f"run-{stem}"
        assert records.load_record(run)["status"] == "complete", stem
