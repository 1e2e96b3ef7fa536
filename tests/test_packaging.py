"""The two install routes agree: every dependency pyproject.toml declares is in
environment.yml (conda or its pip section), with the same lower bound."""

from __future__ import annotations

import re
from pathlib import Path

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
