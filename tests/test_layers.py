"""The import contracts of pyproject.toml ([tool.importlinter]) hold, and are live: the same
contracts run on a copy of the packages with one forbidden import added report it broken."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("lab", "numba_kernels", "analysis")
LINT = ("import sys; from importlinter.cli import lint_imports_command; "
        "sys.exit(lint_imports_command())")


def lint(root: Path, *args: str) -> subprocess.CompletedProcess:
    # A child process with ``root`` first on the path: this process has the real `lab`
    # imported already, and import-linter finds a package where `import` would.
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([sys.executable, "-c", LINT, "--no-cache", "--no-logo", *args],
                          cwd=root, env=env, capture_output=True, text=True, timeout=60)


def test_the_contracts_hold():
    done = lint(REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    assert " 0 broken." in done.stdout, done.stdout


@pytest.fixture
def copy(tmp_path):
    for name in PACKAGES:
        shutil.copytree(REPO / name, tmp_path / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    return tmp_path


def test_the_copy_holds_them_too(copy):
    # The control for the next test: the copy itself breaks nothing.
    done = lint(copy)
    assert done.returncode == 0, done.stdout + done.stderr


# (contract id, file, the import added at its top, what the report must name)
BREAKS = [
    ("core", "lab/rules/common.py", "import lab.records", "lab.rules.common -> lab.records"),
    # a chain counts: the trainers import lab.device, which is in neither wing
    ("core", "lab/device.py", "import lab.lifecycle", "lab.device -> lab.lifecycle"),
    ("config-bottom", "lab/config.py", "import lab.data.identity",
     "lab.config -> lab.data.identity"),
    ("diagnostics-above-rules", "lab/rules/bp.py", "import lab.diagnostics.work",
     "lab.rules.bp -> lab.diagnostics.work"),
    # (through the sweep: the direct runlock -> records import is ignored, whatever its line)
    ("lock-below-records", "lab/runlock.py", "import lab.sweep", "lab.sweep -> lab.records"),
    ("analysis-no-torch", "analysis/summary.py", "import torch", "analysis.summary -> torch"),
    ("analysis-no-torch", "analysis/checks.py", "from lab.data import DataError",
     "analysis.checks -> lab.data"),
    ("acyclic", "lab/models/layers.py", "import lab.rules.common", ".models -> .rules"),
    ("experiment-interface", "lab/experiment.py", "import lab.records",
     "lab.experiment -> lab.records"),
    ("configs-light", "lab/train/configs.py", "import torch", "lab.train.configs -> torch"),
    # (a chain: the rules import numba through numba_kernels)
    ("configs-light", "lab/train/configs.py", "import lab.rules.bp", "lab.rules.bp -> torch"),
    ("configs-light", "lab/train/configs.py", "from lab.train import conv",
     "lab.train.configs -> lab.train.conv"),
]


@pytest.mark.parametrize("contract, path, line, named", BREAKS,
                         ids=[f"{b[0]}:{b[1]}" for b in BREAKS])
def test_a_forbidden_import_breaks_its_contract(copy, contract, path, line, named):
    source = copy / path
    text = source.read_text()
    # after the `from __future__` line, which must stay first
    head, sep, rest = text.partition("from __future__ import annotations\n")
    source.write_text(f"{head}{sep}{line}\n{rest}" if sep else f"{line}\n{text}")
    done = lint(copy, "--contract", contract)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "0 kept, 1 broken" in done.stdout, done.stdout
    assert named in done.stdout, done.stdout
