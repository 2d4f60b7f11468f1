"""A real in-process `LMCacheEngine` with the kvtier plugin on any machine (CPU included), for `kvtier demo`, the
tests and the benchmarks.

The engine is LMCache's own (`LMCacheEngineBuilder`, `StorageManager`, plugin loading from the YAML); only the
GPU connector is kvtier's dense CPU one, so chunks move bit for bit between a `[2, layers, tokens, hidden]`
tensor and LMCache's host tier. Without LMCache, importing this module stops in one line naming `kvtier[lmcache]`.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvtier.compat.extras import require_lmcache
from kvtier.compat.guard import COMPONENT_PLUGIN

if TYPE_CHECKING:
    from lmcache.v1.cache_engine import LMCacheEngine

require_lmcache(COMPONENT_PLUGIN)  # the engine runs kvtier's storage plugin: without LMCache, one line


@dataclass(frozen=True)
class ModelShape:
    """The KV geometry of a model, as LMCache's metadata needs it."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16

    @property
    def hidden(self) -> int:
        return self.num_kv_heads * self.head_dim

    def chunk_bytes(self, chunk_size: int) -> int:
        return 2 * self.num_layers * chunk_size * self.hidden * torch.empty((), dtype=self.dtype).element_size()


def build_engine(config: Any, shape: ModelShape, *, instance_id: str | None = None,
                 world_size: int = 1, worker_id: int = 0, **post_init_kwargs: Any) -> LMCacheEngine:
    """A post-initialised LMCacheEngine for `shape`, using `config` (LMCache's `LMCacheEngineConfig`, a class
    LMCache builds at run time); end it with `destroy_engine`."""
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    from kvtier.storage_backends.lmcache.host_policy import register_host_policies

    register_host_policies()  # `cache_policy: KVTIER_<NAME>` selects a kvtier policy for LMCache's host tier
    from lmcache.v1.metadata import LMCacheMetadata

    from kvtier.storage_backends.lmcache.dense_cpu_connector import DenseCPUConnector

    metadata = LMCacheMetadata(
        model_name=shape.name, world_size=world_size, local_world_size=world_size, worker_id=worker_id,
        local_worker_id=worker_id, kv_dtype=shape.dtype,
        kv_shape=(shape.num_layers, 2, config.chunk_size, shape.num_kv_heads, shape.head_dim),
        chunk_size=config.chunk_size, role="worker",
    )
    engine = LMCacheEngineBuilder.get_or_create(
        instance_id or f"kvtier-{uuid.uuid4().hex[:8]}", config, metadata,
        DenseCPUConnector(shape.num_layers, shape.hidden), lambda t, r: None, lambda o, r: o,
    )
    engine.post_init(**post_init_kwargs)
    return engine


def destroy_engine(engine: LMCacheEngine) -> None:
    """Close an engine of `build_engine` (and take it off LMCacheEngineBuilder's instances)."""
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    for iid, e in list(LMCacheEngineBuilder._instances.items()):
        if e is engine:
            LMCacheEngineBuilder.destroy(iid)
            return
    engine.close()
