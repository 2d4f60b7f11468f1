"""`KVTierBackend`: the LMCache storage plugin (`storage_plugins: [kvtier]`), a thin adapter over `SSDTier`.

LMCache contracts honoured here (see LMCache 0.5.6 `StoragePluginInterface` and `StorageManager`):
- Puts are write-through from LMCache's host tier: each object is `ref_count_up()`'d before the asynchronous
  write and released when it is committed or dropped, so LMCache can reuse its memory safely.
- Sync gets allocate from `local_cpu_backend` (LMCache promotes a complete result into its host tier without a
  copy). Async gets (`enable_async_loading`) return the hit prefix and release this plugin's lookup pins.
- The plugin owns its capacity (LMCache never asks it to evict).
- Chunks are stored under the engine's KV identity (`kv_identity.plugin_fingerprint`: the weights' content, the
  config, KV dtype, layout, parallelism, chunk size): after any change the old chunks are misses, reclaimed first.
  LMCache 0.5.x's own in-process keys do not carry a request's cache salt or LoRA adapter: outside kvtier's
  connector (which adds them) the plugin says so at start.
- LMCache asks its remote backends (`remote_url`, `remote_storage_plugins`) before storage plugins; the plugin moves
  itself ahead of them once its engine is built (`backend_order.LocalFirstOrder`), so the SSD tier is read before the
  network.
"""

from __future__ import annotations

from kvtier.compat.extras import require_lmcache
from kvtier.compat.guard import COMPONENT_PLUGIN

require_lmcache(COMPONENT_PLUGIN)  # before LMCache's imports: without LMCache, one line naming kvtier[lmcache]

import asyncio
import logging
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface

from kvtier.compat import guard
from kvtier.storage_backends import metrics as SM
from kvtier.storage_backends.admission.gate import RefusedKeys
from kvtier.storage_backends.base import ChunkMeta, ChunkTier, HostTier
from kvtier.storage_backends.config import ConfigError, parse_kvtier_config
from kvtier.storage_backends.lmcache.engine_access import run_before_host_closes
from kvtier.storage_backends.lmcache.host_pool import HostPoolWatch
from kvtier.storage_backends.lmcache.kv_identity import plugin_fingerprint, under_kvtier_connector
from kvtier.storage_backends.shared.config import remote_configured

if TYPE_CHECKING:
    from kvtier.storage_backends.lmcache.backend_order import LocalFirstOrder

logger = logging.getLogger(__name__)

#: LMCache MemoryFormat that kvtier's page-first chunks carry (see kvtier.storage_backends.lmcache.gpu_connector).
PAGE_FIRST_FORMAT = "KV_2TD"

_DTYPES = {str(d): d for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8,
                               torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)}


def chunk_bytes_of(metadata: Any) -> int:
    """Bytes of one full chunk, from LMCache's metadata (kv_shape = (layers, 2, chunk_size, heads, head_dim))."""
    return math.prod(metadata.kv_shape) * torch.empty((), dtype=metadata.kv_dtype).element_size()


def expected_layout(metadata: Any, chunk_format: str, page_tokens: int = 16) -> Callable[[ChunkMeta], bool]:
    """A predicate accepting only chunks this engine can consume: same dtype, layout and per-token shape."""
    layers, kv, chunk_size, heads, head_dim = metadata.kv_shape
    dtype = str(metadata.kv_dtype)
    if chunk_format == "page_first":
        from kvtier.kernels.layout import LayoutError, PageFirstLayout

        pages = PageFirstLayout(layers, heads, head_dim, page_tokens, metadata.kv_dtype)

        def ok_page_first(meta: ChunkMeta) -> bool:
            if meta.dtype != dtype or meta.fmt != PAGE_FIRST_FORMAT:
                return False
            try:
                return pages.check_chunk_shape(meta.shape, metadata.kv_dtype) <= chunk_size
            except LayoutError:
                return False

        return ok_page_first

    def ok(meta: ChunkMeta) -> bool:
        if meta.dtype != dtype or meta.fmt != chunk_format:
            return False
        if chunk_format == "KV_2LTD":
            return (len(meta.shape) == 4 and meta.shape[0] == (1 if metadata.use_mla else 2)
                    and meta.shape[1] == layers and 0 < meta.shape[2] <= chunk_size
                    and meta.shape[3] == (head_dim if metadata.use_mla else heads * head_dim))
        return True

    return ok


def _inflight_cap(config) -> int | None:
    """Half of LMCache's host pool. Queued writes hold their chunks in that pool (a reference each); were they
    allowed to fill it, LMCache could not allocate the next store's chunks and would skip that store without a
    word, before kvtier ever sees it. Capped here, the store that would overfill waits (back-pressure) instead."""
    gb = getattr(config, "max_local_cpu_size", None)
    if not gb or gb <= 0:
        return None
    return int(gb * (1 << 30)) // 2


class KVTierBackend(StoragePluginInterface):
    def __init__(self, config=None, dst_device: str = "cpu", metadata=None, local_cpu_backend=None, loop=None):
        try:
            guard.check(guard.COMPONENT_PLUGIN)
        except guard.UnsupportedVersion as e:
            logger.error("kvtier: %s", e)  # LMCache only logs a plugin's start-up error: say it plainly
            raise
        super().__init__(dst_device=dst_device, config=config, metadata=metadata,
                         local_cpu_backend=local_cpu_backend, loop=loop)
        self.kvtier_config = parse_kvtier_config(getattr(config, "extra_config", None))
        self._lookup_pins: dict[str, list[str]] = {}
        #: chunks whose SSD write the connector's write admission refused (named by the worker before the store)
        self.refused = RefusedKeys()
        #: puts this plugin ahead of LMCache's remote backends (None: no remote backend, or the scheduler role)
        self.local_first: LocalFirstOrder | None = None
        if local_cpu_backend is None:
            # Scheduler role: LMCache's scheduler never reads or writes chunks itself.
            self.tier: ChunkTier | None = None
            logger.debug("kvtier plugin in scheduler role: storage disabled in this process")
            return
        if metadata is None or not getattr(metadata, "kv_shape", None):
            raise ConfigError("kvtier needs LMCache metadata with kv_shape to size its slots")
        #: failed host-pool allocations are counted and logged once per episode (LMCache only logs attempts)
        self.pool_watch = HostPoolWatch(local_cpu_backend, getattr(config, "max_local_cpu_size", None))
        #: what computed this engine's KV: the namespace of every chunk the tier stores for it
        self.fingerprint = plugin_fingerprint(metadata, self.kvtier_config)
        if not under_kvtier_connector(metadata):
            logger.warning("kvtier: LMCache's in-process engine (%s) keys chunks by their tokens (and multimodal "
                           "hashes) only: a request's cache_salt and LoRA adapter are not part of LMCache 0.5.x's "
                           "keys, so chunks kvtier stores here are shared between tenants (and adapters) that send "
                           "the same tokens. Where tenants must be isolated, use kvtier's connector "
                           "(KVTierConnector) or LMCache's multiprocess mode (its keys carry the salt); see "
                           "docs/design/identity.md", metadata.model_name)
        if self.kvtier_config.record_host_policy and not under_kvtier_connector(metadata):
            logger.warning("kvtier: kvtier.record_host_policy records only under kvtier's connector (it must be on "
                           "before LMCache builds its host tier); nothing is recorded here")
        # (inside kvtier's connector, the connector logs the engine's fingerprint)
        logger.log(logging.DEBUG if under_kvtier_connector(metadata) else logging.INFO,
                   "kvtier: KV identity of worker %d: %s", metadata.worker_id, self.fingerprint.describe())
        from kvtier.storage_backends.ssd.tier import SSDTier

        self.tier = SSDTier(
            self.kvtier_config,
            chunk_bytes_of(metadata),
            layout_ok=expected_layout(metadata, self.kvtier_config.chunk_format, self.kvtier_config.page_tokens),
            subdir=f"worker{metadata.worker_id}-of-{metadata.world_size}",
            max_inflight_bytes=_inflight_cap(config),
            namespace=self.fingerprint.namespace,
        )
        # (under kvtier's connector the namespace is the connector's own fingerprint: one name in every log line)
        _end_writes_before_pool_closes(local_cpu_backend, self.tier)
        if remote_configured(config):
            from kvtier.storage_backends.lmcache.backend_order import LocalFirstOrder  # only where a store is

            self.local_first = LocalFirstOrder(self)
            if loop is not None:
                self.local_first.start(loop)
        logger.debug("kvtier SSD tier ready for %s (dst_device=%s)", metadata.model_name, dst_device)

    def __str__(self) -> str:
        return "KVTierBackend"

    def _ensure_local_first(self) -> None:
        if self.local_first is not None:
            self.local_first.ensure()

    # ----------------------------------------------------------------- lookups
    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        self._ensure_local_first()
        return self.tier is not None and self.tier.contains(key.to_string(), pin)

    def batched_contains(self, keys: list[CacheEngineKey], pin: bool = False) -> int:
        if self.tier is None:
            return 0
        self._ensure_local_first()
        # A pinned lookup is a request's lookup of its prefix chain (LMCache's retrieve-time checks do not pin).
        return self.tier.prefix_contains([k.to_string() for k in keys], pin, request=pin)

    async def batched_async_contains(self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False) -> int:
        if self.tier is None:
            return 0
        self._ensure_local_first()
        strs = [k.to_string() for k in keys]
        n = self.tier.prefix_contains(strs, pin, request=True)
        if pin and n:
            self._lookup_pins.setdefault(lookup_id, []).extend(strs[:n])
        return n

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        return self.tier is not None and self.tier.exists_in_put_tasks(key.to_string())

    def pin(self, key: CacheEngineKey) -> bool:
        return self.tier is not None and self.tier.pin(key.to_string())

    def unpin(self, key: CacheEngineKey) -> bool:
        return self.tier is not None and self.tier.unpin(key.to_string())

    def remove(self, key: CacheEngineKey, force: bool = True) -> bool:
        return self.tier is not None and self.tier.remove(key.to_string())

    def touch_cache(self) -> None:
        pass

    # ----------------------------------------------------------------- puts
    def batched_submit_put_task(self, keys: Sequence[CacheEngineKey], objs: list[MemoryObj],
                                transfer_spec: Any = None,
                                on_complete_callback: Callable[[CacheEngineKey], None] | None = None) -> None:
        if self.tier is None:
            return None
        self._ensure_local_first()
        puts = []
        kept = []
        for key, obj in zip(keys, objs, strict=True):
            if self.refused.take(key.to_string()):  # kept off the SSD by write admission (kvtier.ssd_admission)
                continue
            kept.append(obj)
            extra = {}
            cached = getattr(obj.metadata, "cached_positions", None)
            if cached is not None:
                extra["cached_positions"] = [int(x) for x in cached.tolist()]
            meta = ChunkMeta(obj.get_size(), tuple(obj.get_shape()), str(obj.get_dtype()),
                             obj.get_memory_format().name, extra)
            obj.ref_count_up()
            puts.append((key.to_string(), meta, obj.byte_array, self._on_put_done(key, obj, on_complete_callback)))
        if len(kept) < len(objs):
            SM.SSD_ADMISSION_SKIPPED.inc(len(objs) - len(kept))
        for obj, queued in zip(kept, self.tier.submit_puts(puts) if puts else []):
            if not queued:
                obj.ref_count_down()
        return None

    @staticmethod
    def _on_put_done(key, obj, callback):
        def done(ok: bool) -> None:
            obj.ref_count_down()
            if ok and callback is not None:
                callback(key)
        return done

    # ----------------------------------------------------------------- gets
    def _alloc(self, key: str, meta: ChunkMeta, busy_loop: bool):
        with self.pool_watch.scope("ssd_read"):
            obj = self.local_cpu_backend.allocate(torch.Size(meta.shape), _DTYPES[meta.dtype],
                                                  MemoryFormat[meta.fmt], busy_loop=busy_loop)
        if obj is None:  # counted (and logged once per episode) by the pool watch
            logger.debug("host pool exhausted: cannot stage SSD chunk %s; treated as a miss", key)
            return None
        if "cached_positions" in meta.extra:
            obj.metadata.cached_positions = torch.tensor(meta.extra["cached_positions"], dtype=torch.long)
        return obj.byte_array, obj

    def read(self, keys: Sequence[CacheEngineKey], *, wait_for_memory: bool = True) -> list[MemoryObj | None]:
        """Read chunks into LMCache host objects (one batched request). `wait_for_memory=False` never waits for
        room in a full host pool: those chunks come back as None (misses) instead."""
        return self._read(keys, wait_for_memory)

    def _read(self, keys: Sequence[CacheEngineKey], busy_loop: bool) -> list[MemoryObj | None]:
        if self.tier is None:
            return [None] * len(keys)
        return self.tier.read_batch([k.to_string() for k in keys],
                                    lambda k, m: self._alloc(k, m, busy_loop),
                                    lambda obj: obj.ref_count_down())

    def get_blocking(self, key: CacheEngineKey) -> MemoryObj | None:
        self._ensure_local_first()
        return self._read([key], True)[0]

    def batched_get_blocking(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        self._ensure_local_first()
        return self._read(keys, True)

    async def batched_get_non_blocking(self, lookup_id: str, keys: list[CacheEngineKey],
                                       transfer_spec: Any = None) -> list[MemoryObj]:
        self._ensure_local_first()
        try:
            loop = asyncio.get_running_loop()
            objs = await loop.run_in_executor(None, self._read, keys, False)
        finally:
            for k in self._lookup_pins.pop(lookup_id, []):
                self.tier.unpin(k)  # type: ignore[union-attr]
        out: list[MemoryObj] = []
        for i, obj in enumerate(objs):
            if obj is None:
                for rest in objs[i + 1:]:
                    if rest is not None:
                        rest.ref_count_down()
                break
            out.append(obj)
        return out

    # ----------------------------------------------------------------- lifecycle
    def get_allocator_backend(self):
        return self.local_cpu_backend

    def flush(self, timeout: float | None = None) -> bool:
        return self.tier is None or self.tier.flush(timeout)

    def close(self) -> None:  # usually after LMCache's host tier closed (which ended the SSD writes already)
        if self.tier is not None:
            if not self.tier.flush(timeout=60):
                logger.warning("closing with SSD writes still queued; those chunks are not stored")
            self.tier.close()


#: when LMCache closes its host tier, how long queued SSD writes may still take before the rest is dropped
CLOSE_FLUSH_S = 10.0


def _end_writes_before_pool_closes(local_cpu_backend: HostTier, tier: ChunkTier) -> None:
    """LMCache's StorageManager closes its backends in order, LocalCPUBackend first, and that close frees the host
    pool (`MixedMemoryAllocator.close` unmaps it) while this plugin's queued SSD writes still read chunks there:
    a writer then crashed the process in the CRC, or could have written reused memory. So the SSD tier's writes
    end (flushed for up to CLOSE_FLUSH_S, the rest dropped and counted) before LocalCPUBackend's own close runs."""

    def end_writes() -> None:
        try:
            if not tier.flush(timeout=CLOSE_FLUSH_S):
                logger.warning("LMCache is closing its host tier with SSD writes still queued after %.0f s; "
                               "those chunks are not stored", CLOSE_FLUSH_S)
            tier.close(drain=False)
        except Exception:
            logger.exception("ending the SSD tier's writes before LMCache's host pool closes failed")

    run_before_host_closes(local_cpu_backend, end_writes)


def load_lmcache_config(path: str | None = None, overrides: dict[str, Any] | None = None):
    """Load an LMCache config exactly as LMCache does (file, then LMCACHE_* environment, then overrides)."""
    from lmcache.v1.config import load_engine_config_with_overrides

    return load_engine_config_with_overrides(config_file_path=path, overrides=overrides)

