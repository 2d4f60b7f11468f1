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


class SSDKit:
    """Helpers for SSD-tier tests: deterministic payloads, blocking put/get, invariant checks."""

    @staticmethod
    def payload(seed: int, n: int):
        import numpy as np

        return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)

    @staticmethod
    def meta(n: int, fmt: str = "KV_2LTD"):
        from kvtier.storage_backends.ssd_index import ChunkMeta

        return ChunkMeta(n, (n,), "torch.uint8", fmt)

    @classmethod
    def put(cls, tier, key: str, data, fmt: str = "KV_2LTD") -> bool:
        done: list[bool] = []
        ok = tier.submit_put(key, cls.meta(len(data), fmt), memoryview(data), done.append)
        assert tier.flush(30)
        return ok and done == [True]

    @staticmethod
    def get(tier, key: str):
        """The chunk's bytes (a numpy array), or None for a miss."""
        import numpy as np

        bufs = {}

        def alloc(k, m):
            bufs[k] = np.zeros(m.nbytes, dtype=np.uint8)
            return memoryview(bufs[k]), k

        res = tier.read_batch([key], alloc, lambda h: None)[0]
        return None if res is None else bufs[key]

    @classmethod
    def fill_fresh(cls, tier, prefix: str, n: int) -> int:
        """Store `n` new chunks and return how many committed: proves the tier's full capacity is usable."""
        ok = 0
        for i in range(n):
            ok += cls.put(tier, f"{prefix}{i}", cls.payload(10_000 + i, tier.chunk_bytes))
        return ok


@pytest.fixture
def ssd():
    return SSDKit
