"""The package layering, checked over every module's imports (lazy ones, inside functions and `TYPE_CHECKING`,
included), from the source alone (nothing is imported):

- each package imports only the packages `ALLOWED` names (docs/development.md's layering list): production
  packages never import the tools (`cli`, `sim`, `replay`, `testing`), `sim` and `replay` never `cli`, `kernels`
  no storage module;
- no two modules of different packages import each other;
- no production module is over 600 lines.

What does not hold yet is listed in `DEBT`, each entry exactly: a new violation fails, and so does a listed one that
is gone (take it off the list). docs/development.md's layout section states the same rules.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NOT_PACKAGES = {"tests", "benchmarks", "scripts", "out", "docs"}
MAX_LINES = 600
_BASE = {"identity", "telemetry", "compat", "kernels"}
_PRODUCTION = _BASE | {"storage_backends", "scheduler_hooks", "connector", "configs", "demo_data", "launch"}
#: package -> the other kvtier packages it may import ("" is the package root, `kvtier/__init__.py`)
ALLOWED: dict[str, set[str]] = {
    "": set(), "identity": set(), "telemetry": set(), "compat": set(), "kernels": set(), "configs": set(),
    "demo_data": set(), "scheduler_hooks": set(),
    "storage_backends": set(_BASE),
    "connector": _BASE | {"storage_backends", "scheduler_hooks"},
    "launch": _PRODUCTION - {"launch"},  # what the demos start; only the tools (`cli`, ...) import it
    "replay": set(_PRODUCTION),
    "sim": _PRODUCTION | {"replay"},
    "cli": _PRODUCTION | {"sim", "replay"},
    "testing": _PRODUCTION | {"sim", "replay", "cli"},
}

#: imports against the layering that do not hold yet (none today)
DEBT_IMPORTS: set[tuple[str, str]] = set()
#: modules over MAX_LINES, each held at most at its length today (they may only shrink)
DEBT_LINES: dict[str, int] = {}


def modules(root: Path = REPO) -> dict[str, Path]:
    """Every module of the `kvtier` package (the repository root is the package), by dotted name."""
    out: dict[str, Path] = {}
    for dirpath, dirs, files in os.walk(root):
        rel = Path(dirpath).relative_to(root)
        if rel.parts and (rel.parts[0] in NOT_PACKAGES or rel.parts[0].startswith(".")):
            dirs[:] = []
            continue
        if not (Path(dirpath) / "__init__.py").exists():
            dirs[:] = []
            continue
        dirs[:] = [d for d in dirs if not d.startswith((".", "__"))]
        for f in files:
            if f.endswith(".py"):
                parts = ["kvtier", *rel.parts] + ([] if f == "__init__.py" else [f[:-3]])
                out[".".join(parts)] = Path(dirpath) / f
    return out


def imports(mods: dict[str, Path]) -> set[tuple[str, str]]:
    """(importer, imported module) for every kvtier import statement anywhere in each module."""
    edges = set()
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in mods:  # a name imported from a module, or a package's attribute
                    t = t.rpartition(".")[0]
                if t.startswith("kvtier") and t != name:
                    edges.add((name, t))
    return edges


def package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def violations(mods: dict[str, Path], edges: set[tuple[str, str]]) -> set[tuple[str, str]]:
    out = set()
    for a, b in edges:
        pa, pb = package(a), package(b)
        if pa != pb and pb not in ALLOWED.get(pa, set()):
            out.add((a, b))

    def home(m: str) -> str:
        return m if mods[m].name == "__init__.py" else m.rpartition(".")[0]

    out |= {(a, b) for a, b in edges if (b, a) in edges and home(a) != home(b)}
    return out


def test_imports_follow_the_layering():
    mods = modules()
    assert len(mods) > 100 and "kvtier.storage_backends.ssd.tier" in mods and "kvtier.cli.main" in mods
    found = violations(mods, imports(mods))
    new, gone = found - DEBT_IMPORTS, DEBT_IMPORTS - found
    assert not new, f"imports against the layering: {sorted(new)}"
    assert not gone, f"fixed, take them off DEBT_IMPORTS: {sorted(gone)}"


def test_no_production_module_over_600_lines():
    long = {}
    for name, path in modules().items():
        if package(name) in ("testing",):
            continue
        n = len(path.read_text().splitlines())
        if n > MAX_LINES:
            long[name] = n
    grown = {m: n for m, n in long.items() if n > DEBT_LINES.get(m, MAX_LINES)}
    assert not grown, f"over {MAX_LINES} lines (or longer than their DEBT_LINES entry): {grown}"
    gone = {m for m in DEBT_LINES if m not in long}
    assert not gone, f"now within {MAX_LINES} lines, take them off DEBT_LINES: {sorted(gone)}"


def test_the_checker_sees_lazy_relative_and_type_checking_imports(tmp_path):
    """The graph is only as good as its parser: a lazy import inside a function, a relative one and one under
    `TYPE_CHECKING` are all edges, and a production module importing `kvtier.testing` is a violation."""
    root = tmp_path / "kvtier"
    for d in ("", "kernels", "storage_backends", "storage_backends/ssd", "testing", "cli"):
        (root / d).mkdir(parents=True, exist_ok=True)
        (root / d / "__init__.py").write_text("")
    (root / "storage_backends/ssd/tier.py").write_text("def f():\n    from kvtier.testing import fakes\n")
    (root / "testing/fakes.py").write_text("")
    (root / "kernels/crc.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..storage_backends.ssd import tier\n")
    (root / "cli/main.py").write_text("from . import demo\n")
    (root / "cli/demo.py").write_text("import kvtier.cli.main\n")
    mods = modules(root)
    edges = imports(mods)
    assert ("kvtier.kernels.crc", "kvtier.storage_backends.ssd.tier") in edges
    assert ("kvtier.cli.main", "kvtier.cli.demo") in edges and ("kvtier.cli.demo", "kvtier.cli.main") in edges
    tier, crc = "kvtier.storage_backends.ssd.tier", "kvtier.kernels.crc"
    assert violations(mods, edges) == {  # `from package import module` imports both
        (tier, "kvtier.testing"), (tier, "kvtier.testing.fakes"),
        (crc, "kvtier.storage_backends.ssd"), (crc, tier)}


def test_the_type_check_covers_every_production_package():
    """scripts/test.sh runs mypy over pyproject's `[tool.mypy] packages`: exactly the production packages that hold
    Python modules (a new production package is type-checked from its first commit)."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mypy"]["packages"])
    with_code = {f"kvtier.{p}" for p in _PRODUCTION if any(package(m) == p for m in modules())}
    assert listed == with_code
