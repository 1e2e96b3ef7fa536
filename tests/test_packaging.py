"""The install routes: every dependency pyproject.toml declares is in environment.yml
(conda or its pip section), with the same lower bound; `make install` stops where pip
fails."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import tomllib
import yaml

ROOT = Path(__file__).resolve().parents[1]


def _name(spec: str) -> tuple[str, str]:
    """(normalised name, version part) of a requirement such as 'numba-cuda[cu13]>=0.20'."""
    match = re.match(r"^\s*([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?\s*(.*)$", spec)
    return match.group(1).lower().replace("_", "-"), match.group(2).strip()


def test_environment_yml_holds_every_dependency_of_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    env = yaml.safe_load((ROOT / "environment.yml").read_text())["dependencies"]
    conda = dict(_name(item) for item in env if isinstance(item, str))
    pip = [item for item in env if isinstance(item, dict)][0]["pip"]
    from_pip = dict(_name(item) for item in pip if not item.startswith("-e"))
    editable = [item for item in pip if item.startswith("-e")]
    assert editable == ["-e .[test]"]  # installs the project and its test extra
    for spec in project["dependencies"]:
        name, version = _name(spec)
        have = conda.get(name, from_pip.get(name))
        assert have is not None, f"{name} is in pyproject.toml but not environment.yml"
        if name != "torch":  # pinned to the CPU wheel in the pip section
            assert have == version, f"{name}: {have!r} in environment.yml, {version!r} in " \
                                    "pyproject.toml"


FAKE_PYTHON = """#!/bin/bash
echo "$*" >> "$(dirname "$0")/calls"
case "$*" in
  "-c import torch") exit 1 ;;                      # no torch yet
  *"pip install -q torch"*) echo "ERROR: No matching distribution found for $5"; exit 1 ;;
  *) exit 0 ;;
esac
"""


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_install_stops_when_torch_cannot_be_installed(tmp_path):
    # The torch step's output went through `grep ... || true`, which also swallowed pip's
    # failure: the next step then resolved torch from PyPI (a multi-GB CUDA build).
    shutil.copy(ROOT / "Makefile", tmp_path)
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    fake = tmp_path / "v" / "bin" / "python"
    fake.parent.mkdir(parents=True)
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    run = subprocess.run(["make", "install", "VENV=v", "TORCH_SPEC=torch==0.0.1"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60)
    calls = (fake.parent / "calls").read_text().splitlines()
    assert run.returncode != 0, run.stdout + run.stderr
    assert "No matching distribution found for torch==0.0.1" in run.stdout + run.stderr
    assert calls == ["-c import torch", "-m pip install -q torch==0.0.1"]  # nothing after
    assert not (tmp_path / "v" / ".installed").exists()
    # with torch installable, every step runs and the stamp is made
    fake.write_text(FAKE_PYTHON.replace('"-c import torch") exit 1', '"-c import torch") exit 0'))
    (fake.parent / "calls").unlink()
    run = subprocess.run(["make", "install", "VENV=v"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "v" / ".installed").exists()
    assert "-m numba_kernels.warm" in (fake.parent / "calls").read_text().splitlines()
