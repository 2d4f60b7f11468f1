"""Shared fixtures: SSD-tier configs in temporary directories, and LMCache YAMLs derived from the shipped one.

Also the compatibility matrix's hooks: `@pytest.mark.needs("feature", ...)` skips a test (with the reason) where
the installed stack lacks a feature (`kvtier.compat.features`), and with `KVTIER_COMPAT_REPORT=FILE` every test's
outcome, `compat`/`needs` markers and skip reason go to FILE (JSON) for the compatibility table
(`compat/table.py`).
"""

from __future__ import annotations

import json
import os
import pathlib

import pytest

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture
def tier_config(tmp_path):
    """Factory: a KVTierConfig rooted in tmp_path, with overrides given as keyword arguments."""
    from kvtier.storage_backends.config import parse_kvtier_config

    def make(**over):
        extra = {"kvtier.ssd_path": str(tmp_path / "ssd"), "kvtier.ssd_capacity_gb": 0.01}
        extra.update({f"kvtier.{k}": v for k, v in over.items()})
        return parse_kvtier_config(extra)

    return make


@pytest.fixture
def lmcache_yaml(tmp_path):
    """Factory: a shipped LMCache YAML (`configs/lmcache-kvtier.yaml`, or `base`) with its SSD path (tmp_path/ssd,
    or `ssd`), chunk size, host pool and SSD capacity replaced (`kvtier.launch.lmcache_yaml`); keyword arguments
    add `kvtier.<key>` lines, `lmcache_lines` raw lines."""
    from kvtier.launch.lmcache_yaml import write_lmcache_yaml

    made: list[None] = []

    def make(chunk_size: int = 16, host_gb: float = 0.05, lmcache_lines: str = "", *,
             base: str = "lmcache-kvtier.yaml", ssd: str | os.PathLike | None = None, redis_port: int | None = None,
             **kvtier_keys) -> str:
        made.append(None)
        return write_lmcache_yaml(tmp_path / f"lmcache-{len(made)}.yaml", base=base,
                                  ssd_path=ssd or tmp_path / "ssd", chunk_size=chunk_size, host_gb=host_gb,
                                  ssd_capacity_gb=0.05, redis_port=redis_port, extra=kvtier_keys,
                                  lines=lmcache_lines)

    return make


@pytest.fixture
def lmcache_engines():
    """Factory: a real LMCacheEngine from a YAML path (`kvtier.launch.lmcache_engine`, the tiny test model unless
    `shape` is given; other keywords go to `post_init`), closed at teardown (remote backends detached first:
    LMCache 0.5.6's own close of a redis:// backend never returns). Skips the test where LMCache is not installed."""
    pytest.importorskip("lmcache", reason="needs lmcache: LMCache is not installed (kvtier[lmcache])")
    from kvtier.launch.lmcache_engine import build_engine, destroy_engine
    from kvtier.storage_backends.lmcache.backend import load_lmcache_config
    from kvtier.testing.engine_factory import TINY

    made = []

    def make(yaml_path: str, shape=None, **post_init):
        e = build_engine(load_lmcache_config(yaml_path), shape or TINY, **post_init)
        made.append(e)
        return e

    yield make
    from kvtier.storage_backends.shared.tier import detach_remote_backends

    for e in made:
        detach_remote_backends(e)
        destroy_engine(e)


@pytest.fixture
def ssd():
    """Helpers for SSD-tier tests (`kvtier.testing.ssd`)."""
    from kvtier.testing import ssd as ssd_testing

    return ssd_testing


def pytest_runtest_setup(item):
    from kvtier.compat import features

    for mark in item.iter_markers("needs"):
        for name in mark.args:
            why = features.missing(name)
            if why is not None:
                pytest.skip(f"needs {name}: {why}")


_outcomes: dict[str, dict] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if not os.environ.get("KVTIER_COMPAT_REPORT"):
        return
    rep = outcome.get_result()
    rec = _outcomes.setdefault(item.nodeid, {
        "nodeid": item.nodeid, "outcome": "passed", "compat": item.get_closest_marker("compat") is not None,
        "needs": sorted({n for m in item.iter_markers("needs") for n in m.args}),
        "doc": ((getattr(item.function, "__doc__", None) or "").strip().splitlines() or [""])[0]})
    if rep.skipped:
        rec["outcome"] = "skipped"
        rec["reason"] = str(rep.longrepr[2]) if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
    elif rep.failed:
        rec["outcome"] = "failed" if rep.when == "call" else "error"


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("KVTIER_COMPAT_REPORT")
    if not path:
        return
    import importlib.metadata
    import platform

    from kvtier.compat.guard import installed_versions

    v = installed_versions()
    try:
        torch = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch = None
    with open(path, "w") as f:
        json.dump({"installed": {"build": v.build, "vllm": v.vllm, "lmcache": v.lmcache, "torch": torch,
                                 "python": platform.python_version()},
                   "tests": list(_outcomes.values())}, f, indent=1)


@pytest.fixture(autouse=True)
def _episodes_settle_at_once(monkeypatch):
    """In-process tests see an episode end at the first success after it (servers they start keep SETTLE_S);
    tests/test_ssd_reliability.py checks the settling time itself."""
    from kvtier.storage_backends.ssd import episodes

    monkeypatch.setattr(episodes, "SETTLE_S", 0.0)
