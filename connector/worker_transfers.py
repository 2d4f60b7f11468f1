"""The worker side's loads and saves: what moves KV between vLLM's blocks and kvtier's tiers, each step.

`WorkerTransfers` is a part of `WorkerSide` (`connector/worker_side.py`, which holds the state it uses):

- `start_load` retrieves from the host tier through the page-first connector: small loads inside the step,
  before the forward pass; larger ones (`LoadSpec.is_async`) on the transfer thread (`connector/transfers.py`),
  reported through `get_finished`. The part of a load past `LoadSpec.stream_from` streams from the SSD tier
  through the bounded staging area (`connector/ssd_stream.py`). Any token that does not arrive marks its block
  (and every later one of that load) as a load error for vLLM to recompute: never wrong KV.
- `wait_for_save` queues the step's newly completed chunks on the transfer thread (or stores them inside the step
  without `async_saves`); a store that finds LMCache's host pool full waits for queued SSD writes and retries.
- When a queued job starts is `WorkerSide.timing`'s answer (`connector/transfer_timing.py`): at once, except in
  tests.
"""

from __future__ import annotations

import logging
import threading
import time
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from kvtier.connector import metrics as M
from kvtier.connector.messages import KVTierConnectorMetadata, LoadSpec, SaveSpec
from kvtier.connector.transfers import StreamFence, TransferJob, TransferQueue
from kvtier.connector.worker_storage import request_configs

if TYPE_CHECKING:
    from kvtier.connector.config import ConnectorConfig
    from kvtier.connector.shared_side import SharedSide
    from kvtier.connector.ssd_stream import SSDStream
    from kvtier.connector.transfer_timing import TransferTiming
    from kvtier.connector.worker_storage import SSDTierHandle, WorkerStorage

logger = logging.getLogger(__name__)

__all__ = ["WorkerTransfers", "slot_mapping"]


def slot_mapping(block_ids: list[int], block_size: int, num_tokens: int) -> torch.Tensor:
    """vLLM slot of each of the first `num_tokens` tokens of a request with these blocks."""
    pos = torch.arange(num_tokens, dtype=torch.long)
    blocks = torch.as_tensor(block_ids, dtype=torch.long)
    if len(block_ids) * block_size < num_tokens:
        raise ValueError(f"{len(block_ids)} blocks of {block_size} cannot hold {num_tokens} tokens")
    return blocks[pos // block_size] * block_size + pos % block_size


class WorkerTransfers:
    """Loads and saves of one worker rank (mixed into `WorkerSide`, which sets every attribute below)."""

    vllm_config: Any
    cfg: ConnectorConfig
    block_size: int
    rank: int
    engine: Any
    ssd: SSDTierHandle | None
    shared: SharedSide | None
    storage: WorkerStorage | None
    stream: SSDStream | None
    kv_list: list[torch.Tensor]
    transfers: TransferQueue | None
    timing: TransferTiming
    _engine_lock: threading.Lock
    _metadata: KVTierConnectorMetadata | None
    _loading: set[str]
    _load_errors: set[int]
    _completed_saves: dict[int, int]
    _short_saves: dict[int, int]

    if TYPE_CHECKING:  # WorkerSide's
        def _stat(self, **kw: float) -> None: ...

        def _chunks(self, tokens: list[int], tag: str = "") -> list[tuple[int, int, Any]]:
            raise NotImplementedError

        def release(self, rid: str) -> None: ...

    # ------------------------------------------------------------------ loads
    def start_load(self) -> None:
        md = self._metadata
        if md is None or not md.loads:
            return
        fence = None
        for spec in md.loads:
            if spec.is_async and self.transfers is not None:
                if fence is None:  # after this step's zeroing of new blocks (GPU)
                    fence = StreamFence(self.kv_list[0].device)
                self.transfers.submit(TransferJob("load", spec.req_id, partial(self._load_job, spec), spec=spec,
                                                  fence=fence, hold_steps=self.timing.load_hold_steps(spec.req_id),
                                                  delay_s=self.timing.load_delay_s(spec.req_id)))
                self._loading.add(spec.req_id)
                continue
            t0 = time.monotonic()
            with self._engine_lock:
                bad_from = self._load(spec)
            self._finish_load(spec, bad_from, time.monotonic() - t0, "sync")

    def _load_job(self, spec: LoadSpec) -> tuple[int | None]:
        """An asynchronous load's job: `_load`'s answer, as the transfer thread hands it back."""
        return (self._load(spec),)

    def _load(self, spec: LoadSpec) -> int | None:
        """Retrieve `spec`'s tokens into its blocks (host tier, then the SSD stream from `spec.stream_from`);
        returns the first token that did not arrive (None: all did)."""
        n, cached = spec.load_end, spec.gpu_cached
        try:
            skip = cached // self.cfg.chunk_size * self.cfg.chunk_size
            host_end = n if spec.stream_from is None or self.stream is None else max(spec.stream_from, skip)
            slots = slot_mapping(spec.block_ids, self.block_size, n)
            if host_end > cached:
                tokens = torch.tensor(spec.token_ids[:host_end], dtype=torch.long)
                mask = torch.ones(host_end, dtype=torch.bool)
                mask[:skip] = False
                ret = self.engine.retrieve(tokens, mask, kvcaches=self.kv_list, slot_mapping=slots[:host_end],
                                           vllm_cached_tokens=cached, req_id=spec.req_id,
                                           request_configs=request_configs(spec.tag))
                if self.storage is not None:
                    self.storage.after_retrieve(spec.req_id, spec.token_ids[:host_end], ret, skip, spec.tag)
                got = ret[cached:host_end]
                if not bool(got.all()):
                    return cached + int((~got).nonzero()[0])
            if host_end >= n:
                return None
            return self._stream(spec, host_end, slots)
        except Exception:
            logger.exception("kvtier: load for %s failed; its blocks will be recomputed", spec.req_id)
            return cached

    def _stream(self, spec: LoadSpec, start: int, slots: torch.Tensor) -> int | None:
        """The SSD-resident rest of a load, from `start` (chunk-aligned), through the bounded staging area."""
        assert self.stream is not None
        chunks = [c for c in self._chunks(spec.token_ids[:spec.load_end], spec.tag) if c[0] >= start]
        res = self.stream.load(chunks, kvcaches=self.kv_list, slot_mapping=slots, vllm_cached_tokens=spec.gpu_cached)
        streamed = (res.bad_from if res.bad_from is not None else spec.load_end) - start
        M.STREAMED_TOKENS.inc(max(streamed, 0))
        self._stat(streamed_tokens=max(streamed, 0))
        if res.bad_from is None:
            return None
        logger.info("kvtier: %s: the SSD stream stopped at token %d (its chunk is in no local tier, failed its "
                    "checksum or has another model's format)", spec.req_id, res.bad_from)
        return max(res.bad_from, spec.gpu_cached)

    def _finish_load(self, spec: LoadSpec, bad_from: int | None, seconds: float, mode: str) -> None:
        """On the engine thread: report a load's failed blocks (before vLLM reads this step's errors), count it,
        release its pins."""
        n = spec.load_end
        if bad_from is not None:
            blocks = spec.block_ids[bad_from // self.block_size:-(-n // self.block_size)]
            self._load_errors.update(blocks)
            M.LOAD_ERROR_BLOCKS.inc(len(blocks))
            self._stat(load_error_blocks=len(blocks))
            logger.warning("kvtier: %s: tokens %d..%d did not load; %d blocks go back to vLLM for recomputation",
                           spec.req_id, bad_from, n, len(blocks))
        loaded = (bad_from if bad_from is not None else n) - spec.gpu_cached
        M.LOAD_SECONDS.observe(seconds)
        M.LOAD_BYTES.inc(max(loaded, 0) * self._token_bytes())
        M.LOADS.labels(mode).inc()
        self._stat(loads=1, loaded_tokens=max(loaded, 0), load_seconds=seconds,
                       async_loads=1 if mode == "async" else 0)
        self.release(spec.req_id)

    # ------------------------------------------------------------------ saves
    def wait_for_save(self) -> None:
        md = self._metadata
        if md is None or not md.saves:
            return
        if not self.cfg.options.async_saves or self.transfers is None:
            for spec in md.saves:
                with self._engine_lock:
                    self._save(spec)
                self._completed_saves[spec.job_id] = 1
            return
        fence = StreamFence(self.kv_list[0].device)  # after this step's forward pass computed the KV (GPU)
        for spec in md.saves:
            self.transfers.submit(TransferJob("save", spec.req_id, partial(self._save, spec), spec=spec,
                                              fence=fence, hold_steps=self.timing.save_hold_steps(spec.req_id)))

    def _save(self, spec: SaveSpec) -> None:
        t0 = time.monotonic()
        n = len(spec.token_ids)
        try:
            stored_end = self._store(spec, n)
        except Exception:  # a lost save is a future miss, never wrong KV
            logger.exception("kvtier: save for %s failed", spec.req_id)
            self._short_saves[spec.job_id] = 0
            return
        if stored_end < n // self.cfg.chunk_size * self.cfg.chunk_size:
            self._short_saves[spec.job_id] = max(0, stored_end - spec.skip) // self.cfg.chunk_size
        if self.shared is not None and spec.share and stored_end > spec.skip:
            # queued for the shared tier's helper thread: returns at once
            self.shared.share_saved(spec.token_ids[:stored_end], spec.skip, spec.tag)
        dt = time.monotonic() - t0
        M.SAVE_SECONDS.observe(dt)
        M.SAVE_BYTES.inc((stored_end - spec.skip) * self._token_bytes())
        self._stat(saves=1, saved_tokens=stored_end - spec.skip, save_seconds=dt)

    #: a store that found LMCache's host pool full waits at most this long for queued SSD writes, then retries
    STORE_RETRY_WAIT_S = 1.0

    def _store(self, spec: Any, n: int) -> int:
        """Store `spec`'s chunks; returns the end of what LMCache stored. LMCache stores chunks in order and
        skips the rest at the first one its host pool has no room for (nothing evictable): queued SSD writes
        hold part of that pool, so the store waits for them and retries from that chunk, as long as each retry
        stores something (a save larger than the pool's free room goes through it a part at a time); what still
        does not fit (the pool held by pins) is counted (`kvtier_host_pool_lost_chunks_total`)."""
        tokens = torch.tensor(spec.token_ids, dtype=torch.long)
        slots = slot_mapping(spec.block_ids, self.block_size, n)
        ssd = self.ssd
        assert ssd is not None, "saves run once register_kv_caches opened the SSD tier"
        watch, skip = ssd.pool_watch, spec.skip
        retried = False
        while True:
            mask = torch.ones(n, dtype=torch.bool)
            mask[:skip] = False
            with watch.scope("store") as sc:
                self.engine.store(tokens, mask=mask, kvcaches=self.kv_list, slot_mapping=slots, req_id=spec.req_id,
                                  request_configs=request_configs(spec.tag))
            skip += sc.ok * self.cfg.chunk_size
            if not sc.failed or skip >= n:
                return n
            if retried and not sc.ok:  # waiting for the SSD writes freed nothing: the pool is held otherwise
                break
            retried = True
            ssd.flush(self.STORE_RETRY_WAIT_S)
        watch.report_lost("store", -(-(n - skip) // self.cfg.chunk_size))
        return skip

    def _token_bytes(self) -> int:
        t = self.kv_list[0]
        return 2 * len(self.kv_list) * self.vllm_config.model_config.get_num_kv_heads(
            self.vllm_config.parallel_config) * self.vllm_config.model_config.get_head_size() * t.element_size()

    def take_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out
