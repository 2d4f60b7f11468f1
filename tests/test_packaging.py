"""A wheel holds every subpackage: pyproject.toml lists packages one by one (the repository root is the `kvtier`
package), so a folder added without its line would install without that code (and editable installs, which
tests use, would not notice)."""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NOT_SHIPPED = {"tests", "benchmarks", "scripts", "out", "docs"}


def _package_folders() -> set[str]:
    found = set()
    for init in REPO.rglob("__init__.py"):
        rel = init.parent.relative_to(REPO)
        parts = rel.parts
        if parts and (parts[0] in NOT_SHIPPED or parts[0].startswith(".")):
            continue
        found.add(".".join(("kvtier", *parts)))
    return found


def test_pyproject_lists_every_subpackage_and_nothing_else():
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = _package_folders()
    assert folders - listed == set(), f"folders missing from pyproject.toml's packages: {sorted(folders - listed)}"
    assert listed - folders == set(), f"pyproject.toml lists packages that do not exist: {sorted(listed - folders)}"
