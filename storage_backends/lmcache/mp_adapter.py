"""`KVTierL2Adapter`: kvtier's SSD tier as an L2 adapter of LMCache's multiprocess server (`lmcache server`).

Loaded by LMCache 0.5.6's `plugin` adapter type:

    lmcache server ... --l2-adapter '{"type": "plugin",
        "module_path": "kvtier.storage_backends.lmcache_mp_adapter", "class_name": "KVTierL2Adapter",
        "adapter_params": {"ssd_path": "/var/cache/kvtier", "ssd_capacity_gb": 100}}'

`adapter_params` are kvtier's own keys without the `kvtier.` prefix (docs/configuration.md, "adapter_params"),
validated strictly by `KVTierL2AdapterConfig.from_dict` (LMCache finds it by the `<class_name>Config`
convention): an unknown or wrong key stops the server at start with a message naming `adapter_params.<key>`.

A thin layer over `SSDTier` (slot files, CRCs, journal, restart recovery, capacity bound and eviction policy,
O_DIRECT/kvikio, back-pressure). What it adds is LMCache's contract (`L2AdapterInterface`):
- keys: `ObjectKey` -> a reversible string with every field that tells KV apart (the fingerprint of the model's
  weights and config, model, kv_rank, which packs world size and rank, object group, chunk hash, cache salt:
  `mp_keys`); chunks of a model's other fingerprints (weights changed in place) or of kvtier's older key format are
  never found and are reclaimed first (`SSDTier.demote`); the chunk's layout (shapes, dtypes, format, size) travels
  in the slot header and is compared with each load's destination: a chunk of another layout is a miss (a 0 bit),
  never bytes in the wrong buffer.
- tasks: stores are queued to one dispatcher thread, which hands each task's chunks to the tier in one call (its
  writers then commit them together; the tier may make it wait: back-pressure); a task completes when
  every chunk is committed (durable when `durable_writes`) or failed; lookups pin what they find (the pin is the
  lock; `submit_unlock` releases it, and a pin nobody releases expires after `pin_timeout_s`); loads run on two
  threads, straight into LMCache's L1 buffers, and set a bit only for a chunk that passed every check.
- byte accounting (`_notify_keys_stored/_deleted`, `max_capacity_bytes`): a chunk counts once committed, and
  stops counting when the tier drops it for any reason (eviction by kvtier's policy, removal, corruption), learnt
  through `SSDTier.add_drop_listener`. The tier evicts by itself: no LMCache `eviction` block is needed.
- the slot size: LMCache hands no chunk size to an adapter, so the tier is opened with the first chunk size seen
  (a lookup's layout or a store's objects), remembered in `ssd_path/lmcache-mp/layout.json`, and reopened from it
  after a restart. A later, larger chunk does not fit (its store fails, logged); give such a model its own path.

Threads: LMCache's store and prefetch controllers call in concurrently; the adapter never calls the tier while
holding its own lock, and the tier's callbacks (under the tier's lock) only record events, which a separate
thread hands to LMCache's listeners (`mp_events.EventRelay`). The slot-size record is `mp_config`'s, the keys and
their listing `mp_keys`'.
"""

from __future__ import annotations

from kvtier.compat.extras import require_lmcache
from kvtier.compat.guard import COMPONENT_MP_ADAPTER

require_lmcache(COMPONENT_MP_ADAPTER)  # before LMCache's imports: without LMCache, one line naming kvtier[lmcache]

import collections
import logging
import os
import queue
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.api import KeyListPage, MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.platform import create_event_notifier

from kvtier.compat import guard
from kvtier.storage_backends import metrics as M
from kvtier.storage_backends.base import ChunkMeta, ChunkTier
from kvtier.storage_backends.config import ConfigError
from kvtier.storage_backends.lmcache.mp_config import (
    LAYOUT_FILE,
    KVTierL2AdapterConfig,
    adapter_key_names,
    claim_directory,
    record_chunk_bytes,
    saved_chunk_bytes,
    show_logs,
)
from kvtier.storage_backends.lmcache.mp_events import EventRelay
from kvtier.storage_backends.lmcache.mp_keys import (
    Layout,
    ModelWeights,
    desc_bytes,
    key_page,
    key_string,
    meta_ok,
    parse_key_string,
    parse_key_weights,
)
from kvtier.storage_backends.ssd.tier import SSDTier

logger = logging.getLogger(__name__)

#: the tier's directory under ssd_path (kept apart from the in-process plugin's worker<r>-of-<w> directories)
SUBDIR = "lmcache-mp"
_LOAD_THREADS = 2


# ------------------------------------------------------------------------------------------------ tasks
@dataclass
class _StoreTask:
    task_id: L2TaskId
    left: int
    ok: bool = True
    bytes_written: int = 0


class KVTierL2Adapter(L2AdapterInterface):
    config_class_name = "KVTierL2AdapterConfig"

    def __init__(self, config: KVTierL2AdapterConfig | Mapping[str, Any], l1_memory_desc: Any = None) -> None:
        if not isinstance(config, KVTierL2AdapterConfig):
            config = KVTierL2AdapterConfig.from_dict(dict(config))
        self.kvtier_config = cfg = config.kvtier
        show_logs()
        try:
            guard.check(guard.COMPONENT_MP_ADAPTER)
        except guard.UnsupportedVersion as e:
            logger.error("kvtier: %s", e)
            raise ConfigError(str(e)) from None
        super().__init__(max_capacity_bytes=cfg.capacity_bytes)
        self.directory = os.path.join(cfg.ssd_path, SUBDIR)
        self._lock_fd = claim_directory(cfg.ssd_path, self.directory, cfg.o_direct)
        self._lock = threading.Lock()  # adapter state; never held while calling the tier
        self._tier_lock = threading.Lock()  # opening the tier
        self._tier: ChunkTier | None = None
        self.open_error: str | None = None
        self._next_id = 0
        self._done_stores: dict[L2TaskId, L2StoreResult] = {}
        self._done_lookups: dict[L2TaskId, Bitmap] = {}
        self._done_loads: dict[L2TaskId, Bitmap] = {}
        self._writing: dict[str, list[_StoreTask]] = {}  # keys whose put is queued -> tasks also waiting on it
        self._sizes: dict[str, int] = {}  # committed chunks -> the size reported to LMCache
        #: the tier's callbacks record stored/deleted chunks there; its thread tells LMCache's listeners
        self._relay = EventRelay(self._notify_keys_stored, self._notify_keys_deleted)
        self._warned_too_large = False
        self._closed = False
        #: model name -> fingerprint of its weights (part of every key)
        self._weights = ModelWeights(on_new=self._reclaim_stale)
        self._store_fd = create_event_notifier()
        self._lookup_fd = create_event_notifier()
        self._load_fd = create_event_notifier()
        self._store_q: queue.Queue = queue.Queue()
        self._loads = ThreadPoolExecutor(max_workers=_LOAD_THREADS, thread_name_prefix="kvtier-mp-load")
        self._store_thread = threading.Thread(target=self._store_loop, name="kvtier-mp-store", daemon=True)
        try:
            saved = saved_chunk_bytes(self.directory)
            if saved is not None:  # a restart: the previous run's chunks are served from the start
                self._open_tier(saved, strict=True)
        except BaseException:
            self._release_resources()
            raise
        self._store_thread.start()
        self._relay.start()
        logger.info("kvtier L2 adapter at %s (%.3g GiB, eviction %s): %s", self.directory, cfg.ssd_capacity_gb,
                    cfg.eviction_policy, f"{len(self._tier)} chunks of a previous run" if self._tier is not None
                    else "the tier opens with the first chunk size seen")

    # ------------------------------------------------------------------ the tier
    @property
    def tier(self) -> ChunkTier | None:
        return self._tier

    def tier_key(self, key: ObjectKey) -> str:
        """The tier key of an object (with the fingerprint of its model's weights)."""
        return key_string(key, self._weights(key.model_name))

    def _reclaim_stale(self, model: str, weights: str) -> None:
        """`model`'s fingerprint is known: its chunks of other fingerprints (weights changed in place) are never
        found again; they stop counting for LMCache and are reclaimed first."""
        tier = self._tier
        if tier is None:
            return
        stale = []
        for s in tier.keys():
            parsed = parse_key_weights(s)
            if parsed is not None and parsed[0].model_name == model and parsed[1] != weights:
                stale.append((s, parsed[0]))
        self._demote(tier, stale, f"of model {model} with other weights or config than now (fingerprint {weights})")

    def _demote(self, tier: ChunkTier, stale: list[tuple[str, ObjectKey | None]], what: str) -> None:
        if not stale:
            return
        gone: list[tuple[ObjectKey, int]] = []
        with self._lock:
            for s, k in stale:
                size = self._sizes.pop(s, None)
                if k is not None and size is not None:
                    gone.append((k, size))
        n = tier.demote([s for s, _ in stale])
        logger.warning("kvtier L2 adapter: %d chunk(s) %s are never served; they are reclaimed first", n, what)
        if gone:
            self._relay.deleted(gone)

    def _open_tier(self, chunk_bytes: int, strict: bool = False) -> ChunkTier | None:
        """Open the tier for chunks of `chunk_bytes`. A configuration that cannot hold them raises at start
        (`strict`); found later, with the first chunk, it is logged and the adapter stores and serves nothing."""
        with self._tier_lock:
            if self._tier is not None or self.open_error is not None:
                return self._tier
            try:
                tier = SSDTier(self.kvtier_config, chunk_bytes, layout_ok=meta_ok, subdir=SUBDIR)
            except ConfigError as e:
                self.open_error = adapter_key_names(str(e))
                if strict:
                    raise ConfigError(self.open_error) from None
                logger.error("kvtier L2 adapter cannot open its SSD tier: %s; it stores and serves nothing",
                             self.open_error)
                return None
            record_chunk_bytes(self.directory, chunk_bytes)
            recovered: list[tuple[ObjectKey, int]] = []
            old_format: list[tuple[str, ObjectKey | None]] = []
            present = tier.keys()
            with self._lock:
                for s in present:  # a previous run's chunks count at the recorded chunk size
                    k = parse_key_string(s)
                    if k is not None:
                        recovered.append((k, chunk_bytes))
                        self._sizes[s] = chunk_bytes
                    else:
                        old_format.append((s, None))
            tier.add_drop_listener(self._on_drop)
            self._tier = tier
            self._demote(tier, old_format, "in an older key format (without the weights' fingerprint)")
        if recovered:
            keys, sizes = zip(*recovered)
            self._notify_keys_stored(list(keys), list(sizes))
        logger.info("kvtier L2 adapter: SSD tier open with %d-byte slots (%d max), %d chunks present",
                    tier.slot_size, tier.max_slots, len(recovered))
        return tier

    def _tier_for(self, chunk_bytes: int) -> ChunkTier | None:
        tier = self._tier
        if tier is None and chunk_bytes > 0:
            tier = self._open_tier(chunk_bytes)
        return tier

    # ------------------------------------------------------------------ event fds
    def get_store_event_fd(self) -> int:
        return self._store_fd.fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._lookup_fd.fileno()

    def get_load_event_fd(self) -> int:
        return self._load_fd.fileno()

    def _new_id(self) -> L2TaskId:
        with self._lock:
            self._next_id += 1
            return self._next_id

    # ------------------------------------------------------------------ store
    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        task_id = self._new_id()
        if len(keys) != len(objects):
            logger.error("store task with %d keys and %d objects; failed", len(keys), len(objects))
            self._finish_store(_StoreTask(task_id, 0, ok=False))
        else:
            self._store_q.put((task_id, list(keys), list(objects)))
        return task_id

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        with self._lock:
            done, self._done_stores = self._done_stores, {}
        return done

    def _store_loop(self) -> None:
        while True:
            item = self._store_q.get()
            try:
                if item is None:
                    return
                task_id, keys, objects = item
                task = _StoreTask(task_id, len(keys))
                try:
                    self._store(task, keys, objects)
                except Exception:
                    logger.exception("kvtier L2 store task %d failed", task_id)
                    with self._lock:
                        finish = task.left > 0
                        task.ok, task.left = False, 0
                    if finish:
                        self._finish_store(task)
            finally:
                self._store_q.task_done()

    def _store(self, task: _StoreTask, keys: list[ObjectKey], objects: list[MemoryObj]) -> None:
        if not keys:
            self._finish_store(task)
            return
        layouts = [Layout.of_object(o) for o in objects]
        tier = self._tier_for(max(lay.nbytes for lay in layouts))
        puts = []  # one submit for the whole task: the tier's writers take its chunks together (one sync)
        for key, obj, lay in zip(keys, objects, layouts):
            s = self.tier_key(key)
            if tier is None or not lay.consistent():
                if tier is not None:
                    logger.error("object for %s has an inconsistent layout %s; not stored", s, lay)
                self._resolve(task, False, 0)
                continue
            with self._lock:
                waiting = self._writing.get(s)
                if waiting is not None:  # an earlier put of the same chunk is queued: share its outcome
                    waiting.append(task)
                    continue
                self._writing[s] = []
            puts.append((s, lay, (s, lay.chunk_meta(), obj.byte_array, self._put_done(key, s, lay.nbytes, task))))
        if not puts or tier is None:
            return
        for (s, lay, _), queued in zip(puts, tier.submit_puts([p for _, _, p in puts])):
            if queued:
                continue
            with self._lock:
                others = self._writing.pop(s, [])
            ok = tier.contains(s)  # already stored: a success that wrote nothing
            if not ok and lay.nbytes > tier.slot_size - 4096 and not self._warned_too_large:
                self._warned_too_large = True
                logger.error("a %d-byte chunk does not fit the %d-byte slots of %s (sized by the first chunks "
                             "it stored, see %s); such chunks are not stored: give this model its own "
                             "adapter_params.ssd_path", lay.nbytes, tier.slot_size, self.directory, LAYOUT_FILE)
            for t in [task, *others]:
                self._resolve(t, ok, 0)

    def _put_done(self, key: ObjectKey, s: str, nbytes: int, task: _StoreTask):
        def done(ok: bool) -> None:  # the tier's writer thread, under the tier's lock: record only
            with self._lock:
                others = self._writing.pop(s, [])
                if ok:
                    self._sizes[s] = nbytes
            if ok:
                self._relay.stored([(key, nbytes)])
            self._resolve(task, ok, nbytes if ok else 0)
            for t in others:
                self._resolve(t, ok, 0)
        return done

    def _resolve(self, task: _StoreTask, ok: bool, nbytes: int) -> None:
        with self._lock:
            task.ok &= ok
            task.bytes_written += nbytes
            task.left -= 1
            last = task.left == 0
        if last:
            self._finish_store(task)

    def _finish_store(self, task: _StoreTask) -> None:
        with self._lock:
            self._done_stores[task.task_id] = L2StoreResult(task.ok, task.bytes_written)
        M.MP_STORE_TASKS.labels("ok" if task.ok else "failed").inc()
        self._store_fd.notify()

    # ------------------------------------------------------------------ lookup and lock
    def submit_lookup_and_lock_task(self, keys: list[ObjectKey],
                                    group_layout_descs: dict[int, MemoryLayoutDesc]) -> L2TaskId:
        task_id = self._new_id()
        bitmap = Bitmap(len(keys))
        try:
            sizes = [desc_bytes(d) for d in (group_layout_descs or {}).values() if d.shapes]
            tier = self._tier_for(max(sizes, default=0))
            if tier is not None and keys:
                strs = [self.tier_key(k) for k in keys]
                first = keys[0]
                chain = [s for k, s in zip(keys, strs)
                         if (k.model_name, k.kv_rank, k.object_group_id) ==
                         (first.model_name, first.kv_rank, first.object_group_id)]
                tier.prefix_contains(chain, False, request=True)  # a request's prefix chain, for the policy
                hits = 0
                for i, s in enumerate(strs):
                    if tier.contains(s, pin=True):
                        bitmap.set(i)
                        hits += 1
                M.MP_LOOKUP_CHUNKS.labels("hit").inc(hits)
                M.MP_LOOKUP_CHUNKS.labels("miss").inc(len(keys) - hits)
        except Exception:
            logger.exception("kvtier L2 lookup failed; answering misses")
            bitmap = Bitmap(len(keys))
        with self._lock:
            self._done_lookups[task_id] = bitmap
        self._lookup_fd.notify()
        return task_id

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._done_lookups.pop(task_id, None)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        tier = self._tier
        if tier is None:
            return
        for k in keys:
            try:
                tier.unpin(self.tier_key(k))
            except Exception:  # must not fail; an unreleased pin expires after pin_timeout_s
                logger.exception("kvtier L2 unlock of %s failed; its pin expires by itself", k)

    # ------------------------------------------------------------------ load
    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        task_id = self._new_id()
        try:
            self._loads.submit(self._load, task_id, list(keys), list(objects))
        except RuntimeError:  # closed
            self._finish_load(task_id, Bitmap(len(keys)))
        return task_id

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._done_loads.pop(task_id, None)

    def _load(self, task_id: L2TaskId, keys: list[ObjectKey], objects: list[MemoryObj]) -> None:
        bitmap = Bitmap(len(keys))
        loaded: list[ObjectKey] = []
        try:
            tier = self._tier
            if tier is not None and len(keys) == len(objects):
                strs = [self.tier_key(k) for k in keys]
                slots: dict[str, collections.deque[int]] = {}
                for i, s in enumerate(strs):
                    slots.setdefault(s, collections.deque()).append(i)
                mismatched: list[str] = []

                def alloc(s: str, meta: ChunkMeta):
                    i = slots[s].popleft()
                    want = Layout.of_object(objects[i])
                    if Layout.of_meta(meta) != want:
                        mismatched.append(s)
                        return None
                    return objects[i].byte_array, i

                for i in tier.read_batch(strs, alloc, lambda i: None):
                    if i is not None:
                        bitmap.set(i)
                        loaded.append(keys[i])
                for s in mismatched:  # this key now means another layout: make room for the engine's re-store
                    logger.warning("kvtier L2: stored chunk %s has another layout than the buffer it was asked "
                                   "into; treated as a miss and removed", s)
                    tier.remove(s)
                M.MP_LOAD_CHUNKS.labels("layout_mismatch").inc(len(mismatched))
            M.MP_LOAD_CHUNKS.labels("hit").inc(len(loaded))
            M.MP_LOAD_CHUNKS.labels("miss").inc(len(keys) - len(loaded))
        except Exception:
            logger.exception("kvtier L2 load task %d failed; its chunks are misses", task_id)
            bitmap, loaded = Bitmap(len(keys)), []
        if loaded:
            self._notify_keys_accessed(loaded)
        self._finish_load(task_id, bitmap)

    def _finish_load(self, task_id: L2TaskId, bitmap: Bitmap) -> None:
        with self._lock:
            self._done_loads[task_id] = bitmap
        self._load_fd.notify()

    # ------------------------------------------------------------------ deletion, listing, status
    def _on_drop(self, s: str, nbytes: int, reason: str) -> None:  # under the tier's lock: record only
        key = parse_key_string(s)
        with self._lock:
            size = self._sizes.pop(s, None)
        if key is not None and size is not None:
            self._relay.deleted([(key, size)])

    def delete(self, keys: list[ObjectKey]) -> None:
        tier = self._tier
        if tier is None:
            return
        for k in keys:
            tier.remove(self.tier_key(k))
        self._deliver_events()  # listeners hear of the deletion before this returns

    def list_l2_keys(self, model_name: str | None = None, page_size: int = 500,
                     cursor: str | None = None) -> KeyListPage:
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        if cursor is not None and parse_key_string(cursor) is None:
            raise ValueError(f"malformed cursor {cursor!r}")
        with self._lock:
            items = sorted(self._sizes.items())
        return key_page(items, model_name, page_size, cursor)

    def report_status(self) -> dict:
        tier = self._tier
        st: dict[str, Any] = {
            "is_healthy": self.open_error is None and self._store_thread.is_alive() and self._relay.alive,
            "type": "KVTierL2Adapter",
            "ssd_path": self.directory,
            "capacity_bytes": self.kvtier_config.capacity_bytes,
            "eviction_policy": self.kvtier_config.eviction_policy,
            "tier_open": tier is not None,
        }
        if self.open_error is not None:
            st["error"] = self.open_error
        if tier is not None:
            st.update(chunks=len(tier), used_bytes=tier.used_bytes(), slot_bytes=tier.slot_size,
                      max_slots=tier.max_slots, io_engine=tier.io_engine, stats=tier.stats.as_dict())
        return st

    def _deliver_events(self) -> None:
        """Tell LMCache's listeners of the stored and deleted chunks recorded so far, now."""
        self._relay.deliver()

    # ------------------------------------------------------------------ lifecycle
    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted store task has completed (tests, benchmarks)."""
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                busy = bool(self._writing)
            if not busy and self._store_q.unfinished_tasks == 0 and (self._tier is None
                                                                      or self._tier.flush(0)):
                return True
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.01)

    def close(self) -> None:
        if self._closed:
            return
        self._store_q.put(None)
        self._store_thread.join()
        tier = self._tier
        if tier is not None and not tier.flush(timeout=60):
            logger.warning("kvtier L2 adapter closing with SSD writes still queued; those chunks are not stored")
        self._loads.shutdown(wait=True)
        if tier is not None:
            tier.close()
        self._relay.close()
        self._release_resources()
        logger.info("kvtier L2 adapter closed")

    def _release_resources(self) -> None:
        self._closed = True
        self._loads.shutdown(wait=False)
        for fd in (self._store_fd, self._lookup_fd, self._load_fd):
            fd.close()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


__all__ = ["KVTierL2Adapter", "KVTierL2AdapterConfig", "key_string", "parse_key_string", "Layout", "SUBDIR"]
