"""Shared fixtures: SSD-tier configs in temporary directories, and LMCache YAMLs derived from the shipped one."""

from __future__ import annotations

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
    """Factory: the shipped configs/lmcache-kvtier.yaml with its SSD path (and other lines) replaced."""
    made: list[None] = []

    def make(chunk_size: int = 16, host_gb: float = 0.05, lmcache_lines: str = "", **kvtier_keys) -> str:
        text = (REPO / "configs" / "lmcache-kvtier.yaml").read_text()
        text = text.replace("/var/cache/kvtier", str(tmp_path / "ssd"))
        text = text.replace("chunk_size: 256", f"chunk_size: {chunk_size}")
        text = text.replace("max_local_cpu_size: 5 ", f"max_local_cpu_size: {host_gb} ")
        text = text.replace("kvtier.ssd_capacity_gb: 100", "kvtier.ssd_capacity_gb: 0.05")
        for k, v in kvtier_keys.items():
            text += f"  kvtier.{k}: {v}\n"
        text += lmcache_lines
        made.append(None)
        path = tmp_path / f"lmcache-{len(made)}.yaml"
        path.write_text(text)
        return str(path)

    return make



@pytest.fixture
def ssd():
    """Helpers for SSD-tier tests (`kvtier.tools.ssd_testing`)."""
    from kvtier.tools import ssd_testing

    return ssd_testing
