"""`KVTierSecondaryTier`: kvtier's SSD tier as a secondary tier of vLLM's own offloading (`TieringOffloadingSpec`).

vLLM loads it from the `secondary_tiers` list of `kv_connector_extra_config` (configs/vllm-offloading-kvtier.json):

    {"type": "KVTierSecondaryTier", "module_path": "kvtier.storage_backends.vllm_offload.secondary_tier",
     "ssd_path": "/var/cache/kvtier", "ssd_capacity_gb": 100}

The other keys are kvtier's own settings without the `kvtier.` prefix (docs/configuration.md), parsed strictly: an
unknown or wrong key stops the engine at start with a message naming `secondary_tiers[].<key>`.

A thin layer over `SSDTier` (slot files, CRCs, journal, restart recovery, the capacity bound and kvtier's eviction
policy, back-pressure). What it adds is vLLM's `SecondaryTierManager` contract:
- chunks: one primary-tier chunk (`primary_kv_view.strides[0]` bytes: every rank's blocks of one chunk) is one SSD
  chunk, keyed by the hex of vLLM's `OffloadKey` (block hash + KV-cache group). The tier's directory is
  `ssd_path/vllm-offload/<model>_<digest>`, the digest covering vLLM's own description of the layout (model, dtype,
  tokens per hash, blocks per chunk, parallelism, KV-cache groups: `FileMapper`'s run config) and the chunk size; a
  chunk of another layout is in another directory, and its slot header (`fmt`) is checked again on every read.
  vLLM's block hashes carry each request's cache salt, LoRA adapter and multimodal items; kvtier adds the KV
  identity of the weights (`kvtier.identity`: a fingerprint of the weight files' content and config.json, or
  `model_identity`) as the namespace of every key, so weights changed in place under the same model path are
  misses, their chunks reclaimed first.
- jobs: `submit_store`/`submit_load` only queue (they run on the scheduler thread). One dispatcher thread hands each
  store job's chunks to the tier, which may make it wait (back-pressure: `max_inflight_write_mb`,
  `backpressure_timeout_s`); a store job finishes when every chunk is committed (durable with `durable_writes`) or
  failed, so vLLM keeps the primary chunks pinned until the tier no longer reads them. Loads run on two threads
  straight into the primary chunks; a chunk that fails any check is a failed key of the job (vLLM recomputes it),
  never bytes in the primary tier.
- nothing raises into vLLM once the tier has started: a full disk, an I/O error or a damaged slot is a failed job
  or a miss, logged once per episode and counted in kvtier's metrics (`kvtier_ssd_*`, `kvtier_vllm_tier_*`).
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import queue
import threading
import time
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingSpec,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from kvtier.compat import guard
from kvtier.identity.model import ModelFingerprint, config_digest, read_config, weights_identity
from kvtier.storage_backends import metrics as M
from kvtier.storage_backends.base import ChunkMeta, ChunkTier
from kvtier.storage_backends.config import ConfigError, parse_adapter_params
from kvtier.storage_backends.ssd.directory import prepare_directory
from kvtier.storage_backends.vllm_offload import SUBDIR, tier_directory

logger = logging.getLogger(__name__)

#: the layout description kept beside the slot files, for an operator
LAYOUT_FILE = "layout.json"
_LOAD_THREADS = 2
#: the slot header's `fmt` of chunks this adapter writes: the prefix and the layout digest
FMT_PREFIX = "vllm-offload:"


@dataclass(frozen=True)
class ChunkLayout:
    """What tells one engine's primary-tier chunks apart from another's: vLLM's layout fields and the chunk size."""

    fields: Mapping[str, Any]
    chunk_bytes: int

    @classmethod
    def of(cls, spec: OffloadingSpec, chunk_bytes: int) -> ChunkLayout:
        mapper = FileMapper.from_offloading_spec(root_dir="", offloading_spec=spec,
                                                 blocks_per_file=spec.blocks_per_chunk, parallel_agnostic=True)
        return cls(mapper.get_run_config(), chunk_bytes)

    @property
    def digest(self) -> str:
        text = json.dumps({"fields": dict(self.fields), "chunk_bytes": self.chunk_bytes}, sort_keys=True,
                          separators=(",", ":"), default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def directory_name(self) -> str:
        model = str(self.fields.get("model_name", "model")).replace("/", "_").replace(".", "_")[:64]
        return f"{model}_{self.digest}"

    @property
    def fmt(self) -> str:
        return FMT_PREFIX + self.digest

    def fingerprint(self, declared: str = "") -> ModelFingerprint:
        """The KV identity of this layout's chunks: the weights and config of the model it names, and the layout
        (vLLM's own description: model, KV dtype, tokens per hash, blocks per chunk, parallelism, groups)."""
        model = str(self.fields.get("model_name", ""))
        tokens = int(self.fields.get("tokens_per_hash", 0) or 0) * int(self.fields.get("blocks_per_file", 0) or 0)
        return ModelFingerprint(weights_identity(model, declared), config_digest(read_config(model)),
                                str(self.fields.get("dtype", "")), "vllm-offload:" + self.digest, tokens,
                                int(self.fields.get("tp_size", 1) or 1), -1)


def key_string(key: OffloadKey) -> str:
    return bytes(key).hex()


@dataclass
class _StoreJob:
    job_id: int
    left: int
    ok: bool = True
    written: int = 0
    started: float = 0.0


class KVTierSecondaryTier(SecondaryTierManager):
    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(self, offloading_spec: OffloadingSpec, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: BackpressureDetector | None = None, locality: str | None = None,
                 **params: Any) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        where = f"secondary_tiers[type={tier_type}]"
        try:
            guard.check(guard.COMPONENT_VLLM_TIER)
        except guard.UnsupportedVersion as e:
            raise ConfigError(str(e)) from None
        self.locality = Locality(locality) if locality is not None else None
        cfg = parse_adapter_params(params, where=where)
        self.layout = ChunkLayout.of(offloading_spec, self.block_size_bytes)
        self._view = primary_kv_view.cast("B")  # (chunks, row bytes) -> bytes; chunk c at c * strides[0]
        prepare_directory(cfg.ssd_path)
        prepare_directory(tier_directory(cfg.ssd_path))
        fmt = self.layout.fmt
        self.fingerprint = self.layout.fingerprint(cfg.model_identity)
        logger.info("kvtier secondary tier '%s': KV identity %s", tier_type, self.fingerprint.describe())
        from kvtier.storage_backends.ssd.tier import SSDTier

        self.tier: ChunkTier = SSDTier(cfg, self.block_size_bytes, layout_ok=lambda meta: meta.fmt == fmt,
                                       subdir=f"{SUBDIR}/{self.layout.directory_name}",
                                       namespace=self.fingerprint.namespace)
        self._write_layout_file()
        self._meta = ChunkMeta(nbytes=self.block_size_bytes, shape=(self.block_size_bytes,), dtype="uint8", fmt=fmt)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._finished: list[JobResult] = []
        #: exact counts of finished jobs by (kind, result), as in `kvtier_vllm_tier_jobs_total`
        self.job_results: collections.Counter[tuple[str, str]] = collections.Counter()
        self._open_jobs = 0
        self._stores: queue.Queue[TransferJob | None] = queue.Queue()
        self._loads: queue.Queue[TransferJob | None] = queue.Queue()
        self._closed = False
        self._threads = [threading.Thread(target=self._store_loop, name="kvtier-vllm-tier-store", daemon=True)]
        self._threads += [threading.Thread(target=self._load_loop, name=f"kvtier-vllm-tier-load-{i}", daemon=True)
                          for i in range(_LOAD_THREADS)]
        for t in self._threads:
            t.start()
        logger.info("kvtier secondary tier '%s': %d chunks of %d bytes in %s (capacity %d slots, eviction %s)",
                    tier_type, len(self.tier), self.block_size_bytes, self.tier.directory, self.tier.max_slots,
                    cfg.eviction_policy)

    def _write_layout_file(self) -> None:
        from kvtier.storage_backends.ssd.directory import write_small_file

        text = json.dumps({"fields": dict(self.layout.fields), "chunk_bytes": self.layout.chunk_bytes}, indent=1,
                          sort_keys=True, default=str)
        try:
            write_small_file(f"{self.tier.directory}/{LAYOUT_FILE}", text.encode())
        except OSError as e:  # only a description for people: the tier works without it
            logger.warning("kvtier secondary tier: cannot write %s/%s (%s)", self.tier.directory, LAYOUT_FILE, e)

    # ------------------------------------------------------------------ scheduler-thread calls (never block)
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        try:
            found = self.tier.contains(key_string(key))
        except Exception:  # noqa: BLE001 - a lookup that cannot answer is a miss, never an error in vLLM
            logger.exception("kvtier secondary tier: lookup failed; treated as a miss")
            return LookupResult.MISS
        M.VLLM_TIER_LOOKUPS.labels("hit" if found else "miss").inc()
        return LookupResult.HIT if found else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._enqueue(self._stores, job_metadata)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._enqueue(self._loads, job_metadata)

    def _enqueue(self, q: queue.Queue, job: TransferJob) -> None:
        with self._lock:
            if self._closed:
                self._finished.append(JobResult(job.job_id, False))
                return
            self._open_jobs += 1
        q.put(job)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        with self._lock:
            done, self._finished = self._finished, []
        return done

    def has_pending_work(self) -> bool:
        with self._lock:
            return self._open_jobs > 0 or bool(self._finished)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """vLLM <= 0.33 tells secondary tiers of reuse; kvtier's policy learns it from the tier's own reads."""
        return

    def drain_jobs(self) -> None:
        """Wait until every submitted job has finished (its result waits for `get_finished_jobs`)."""
        with self._idle:
            while self._open_jobs:
                self._idle.wait()

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for q in (self._stores,) + (self._loads,) * _LOAD_THREADS:
            q.put(None)
        for t in self._threads:
            t.join()
        self.tier.close(drain=True)
        self._view.release()  # vLLM closes the primary tier's mmap after its tiers shut down

    # ------------------------------------------------------------------ worker threads
    def _chunk(self, chunk_id: int) -> memoryview:
        start = int(chunk_id) * self.block_size_bytes
        return self._view[start:start + self.block_size_bytes]

    def _store_loop(self) -> None:
        while (job := self._stores.get()) is not None:
            try:
                self._store(job)
            except Exception:  # noqa: BLE001 - a failed job, never an exception in vLLM
                logger.exception("kvtier secondary tier: store job %d failed", job.job_id)
                self._done("store", "failed", JobResult(job.job_id, False))

    def _store(self, job: TransferJob) -> None:
        keys = [key_string(k) for k in job.keys]
        state = _StoreJob(job.job_id, left=len(keys) + 1, started=time.monotonic())
        lock = threading.Lock()

        def settle(ok: bool, nbytes: int = 0) -> None:
            with lock:
                state.ok &= ok
                state.written += nbytes
                state.left -= 1
                last = state.left == 0
            if last:
                result = JobResult(job.job_id, state.ok, transfer_time=time.monotonic() - state.started,
                                   transfer_bytes=state.written or None)
                self._done("store", "ok" if state.ok else "failed", result)

        todo = []
        for key, chunk_id in zip(keys, job.chunk_ids):
            if self.tier.contains(key):
                settle(True)
                continue
            todo.append((key, self._meta, self._chunk(chunk_id),
                         lambda ok, n=self.block_size_bytes: settle(ok, n if ok else 0)))
        queued = self.tier.submit_puts(todo) if todo else []
        for (key, *_), q in zip(todo, queued):
            if not q:  # not queued: already queued by another job (it commits it) or dropped (counted by the tier)
                settle(self.tier.exists_in_put_tasks(key) or self.tier.contains(key))
        settle(True)  # the submission itself

    def _load_loop(self) -> None:
        while (job := self._loads.get()) is not None:
            try:
                self._load(job)
            except Exception:  # noqa: BLE001
                logger.exception("kvtier secondary tier: load job %d failed", job.job_id)
                self._done("load", "failed", JobResult(job.job_id, False))

    def _load(self, job: TransferJob) -> None:
        t0 = time.monotonic()
        keys = list(job.keys)
        targets = {key_string(k): self._chunk(c) for k, c in zip(keys, job.chunk_ids)}

        def alloc(key: str, meta) -> tuple[memoryview, str] | None:
            if meta.nbytes != self.block_size_bytes:
                return None
            return targets[key], key

        handles = self.tier.read_batch(list(targets), alloc, lambda _h: None)
        loaded = [k for k, h in zip(keys, handles) if h is not None]
        ok = len(loaded) == len(keys)
        M.VLLM_TIER_LOAD_CHUNKS.labels("loaded").inc(len(loaded))
        M.VLLM_TIER_LOAD_CHUNKS.labels("failed").inc(len(keys) - len(loaded))
        result = JobResult(job.job_id, ok, successful_keys=None if ok or not loaded else tuple(loaded),
                           transfer_time=time.monotonic() - t0,
                           transfer_bytes=len(loaded) * self.block_size_bytes or None)
        self._done("load", "ok" if ok else ("partial" if loaded else "failed"), result)

    def _done(self, kind: str, verdict: str, result: JobResult) -> None:
        M.VLLM_TIER_JOBS.labels(kind, verdict).inc()
        with self._lock:
            self.job_results[kind, verdict] += 1
            self._open_jobs -= 1
            self._finished.append(result)
            self._idle.notify_all()
