"""The connector's worker side: an in-process LMCache engine with kvtier's SSD tier and page-first GPU connector.

- `register_kv_caches`: builds the engine for this rank's KV tensors (layout detected from the attention backend),
  checks that LMCache really loaded the kvtier plugin (LMCache only logs a plugin's start-up error), and starts the
  storage RPC endpoint the scheduler side uses for lookups and prefetches.
- The RPC (`handle`, typed requests of `connector/rpc.py` dispatched by type) serves lookups, host-memory pins and
  prefetches (`connector/worker_storage.py`: host tier, then SSD, then the shared tier when the LMCache config
  names a remote store; prefetches read into the host tier on background threads, never in a forward pass),
  flushes and counters. The SSD tier is reached through one narrow handle (`SSDTierHandle`), built at start-up.
- Loads and saves live in `connector/worker_transfers.py` (`WorkerTransfers`, a part of `WorkerSide`):
  `start_load_kv` retrieves from the host tier through the page-first connector: small loads inside the step,
  before the forward pass; larger ones (`LoadSpec.is_async`) on the transfer thread (`connector/transfers.py`)
  while the request waits in vLLM's WAITING_FOR_REMOTE_KVS state, reported through `get_finished`. The part of a
  load past `LoadSpec.stream_from` (SSD chunks its prefetch found no host room for) streams from the SSD tier
  through a bounded staging area (`connector/ssd_stream.py`), always off the step. Any token that
  does not arrive marks its block (and every later one of that load) as a load error for vLLM to recompute, for
  an asynchronous load no later than the step that reports it finished: never wrong KV.
- `wait_for_save` (the same module) queues the step's newly completed chunks on the transfer thread (host tier,
  write-through to SSD asynchronously; to the shared tier from a helper thread, as `kvtier.shared.writes` says);
  the jobs that finished travel back in `KVTierWorkerMetadata`. A finished request's blocks are kept by vLLM until
  its saves are done (`finished_sending`); a preempted request's saves finish in `handle_preemptions`, before the
  step's forward pass may overwrite its blocks.
- Finished requests' answer lengths and chunk chains reach the SSD tier's eviction policy.
- Identity: chunk keys are LMCache's keys of a request's key tokens with its identity tag as a key tag
  (`request_configs`), in every lookup, prefetch, load, stream, save and shared write; LMCache's metadata names the
  model by this engine's fingerprint (`kvtier.identity.model`: weights, config, dtype, quantization, KV dtype,
  layout, chunk size, parallelism), so no chunk of another tenant or another model is ever found.
- A step that schedules no token (`KVTierConnectorMetadata.idle`) waits in `get_finished`, GIL released, until a
  transfer job or a prefetch ends, at most `idle_wait_ms`: an engine stepping in the caller's thread would
  otherwise spin, holding the GIL the transfer thread needs to finish the load the engine is waiting for.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from kvtier.connector import metrics as M
from kvtier.connector.config import ConnectorConfig
from kvtier.connector.messages import (
    FinishedSpec,
    KVTierConnectorMetadata,
    KVTierWorkerMetadata,
    SaveSpec,
)
from kvtier.connector.rpc import (
    Ack,
    Flush,
    Lookup,
    LookupReply,
    Ping,
    PingReply,
    Poll,
    PollReply,
    Prefetch,
    Release,
    Reply,
    Request,
    RPCServer,
    Stats,
    StatsReply,
    endpoint,
)
from kvtier.connector.ssd_stream import SSDStream
from kvtier.connector.transfer_timing import AT_ONCE, TransferTiming
from kvtier.connector.transfers import TransferQueue
from kvtier.connector.worker_storage import SSDTierHandle, WorkerStorage, request_configs
from kvtier.connector.worker_transfers import WorkerTransfers
from kvtier.identity.model import FINGERPRINT_PREFIX, ModelFingerprint
from kvtier.identity.vllm import engine_fingerprint
from kvtier.storage_backends.admission.gate import RefusedKeys
from kvtier.storage_backends.config import ConfigError
from kvtier.storage_backends.eviction import recording, session_signals

if TYPE_CHECKING:
    from kvtier.connector.shared_side import SharedSide
    from kvtier.storage_backends.base import HostTier

logger = logging.getLogger(__name__)

#: attention backend name -> the layouts of the per-layer KV tensor it registers (vLLM 0.31-0.33), in order:
#: the first one the tensor's shape fits (with the model's KV heads and head size) is used
BACKEND_LAYOUTS: dict[str, tuple[str, ...]] = {
    "CPU_ATTN": ("split_token_dim",),
    "TORCH_SDPA": ("split_token_dim",),
    "FLASH_ATTN": ("split_last_dim",),
    "TRITON_ATTN": ("split_last_dim",),
    "ROCM_ATTN": ("split_last_dim",),
    # K and V packed in the content dim; NVFP4 KV caches hold them in separate head slots instead
    "FLASHINFER": ("split_last_dim", "split_head_dim"),
}


def _rank(vllm_config: Any) -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:
        return int(vllm_config.parallel_config.rank)


class WorkerSide(WorkerTransfers):
    """One worker rank's connector: start-up, the storage RPC, the per-step bookkeeping; its loads and saves are
    `WorkerTransfers`' (`connector/worker_transfers.py`)."""

    #: when queued transfers and prefetches start: at once (tests replace it: `kvtier.testing.transfer_timing`)
    timing: TransferTiming = AT_ONCE

    def __init__(self, vllm_config: Any, cfg: ConnectorConfig) -> None:
        self.vllm_config = vllm_config
        self.cfg = cfg
        self.block_size = int(vllm_config.cache_config.block_size)
        self.rank = _rank(vllm_config)
        self.world = int(vllm_config.parallel_config.world_size)
        self.engine_id = str(vllm_config.kv_transfer_config.engine_id)
        self.instance_id = f"kvtier-{self.engine_id}-r{self.rank}"
        self.engine: Any = None
        #: what computes this rank's KV (set when the KV caches are registered)
        self.fingerprint: ModelFingerprint | None = None
        self.host: HostTier | None = None  # LMCache's LocalCPUBackend
        self.ssd: SSDTierHandle | None = None  # kvtier's SSD tier, through the LMCache plugin that owns it
        self.shared: SharedSide | None = None  # when the LMCache config names a shared store
        #: chunks the SSD tier must not write (`SaveSpec.ssd_refused`), handed to the LMCache plugin's puts
        self._ssd_refused: RefusedKeys | None = None
        #: lookups, pins and prefetches (built with the engine)
        self.storage: WorkerStorage | None = None
        #: the bounded staging area a load's SSD-resident rest streams through (None: `ssd_stream_chunks` 0)
        self.stream: SSDStream | None = None
        self.kv_list: list[torch.Tensor] = []
        self.server: RPCServer | None = None
        self.stats = M.KVTierConnectorStats()
        self._stats_lock = threading.Lock()
        self._rpc: dict[type[Request[Any]], Callable[[Any], Reply]] = {
            Ping: self._on_ping, Lookup: self._on_lookup, Prefetch: self._on_prefetch, Poll: self._on_poll,
            Release: self._on_release, Flush: self._on_flush, Stats: self._on_stats}
        self._load_errors: set[int] = set()
        self._metadata: KVTierConnectorMetadata | None = None
        self._closed = False
        #: LMCache engine stores and retrieves run under this lock (transfer thread and synchronous loads)
        self._engine_lock = threading.Lock()
        self.transfers: TransferQueue | None = None
        #: finished requests whose blocks vLLM keeps until their saves are done (reported in finished_sending)
        self._held: set[str] = set()
        #: requests whose asynchronous load is queued or running (their pins are released when it ends)
        self._loading: set[str] = set()
        self._completed_saves: dict[int, int] = {}
        self._short_saves: dict[int, int] = {}  # save job -> chunks it stored, when fewer than asked (lost hits)
        #: notified when a transfer job or a prefetch ends: an idle step's wait (`_wait_idle`) wakes on it
        self._progress = threading.Condition()

    # ------------------------------------------------------------------ start-up
    def _detect_layout(self, names: list[str], heads: int, head_dim: int) -> str:
        opt = self.cfg.options.kv_layout
        if opt != "auto":
            return opt
        from kvtier.kernels.layout import KVLayoutKind, LayoutError, canonical_view

        name = None
        try:
            ctx = self.vllm_config.compilation_config.static_forward_context
            name = ctx[names[0]].attn_backend.get_name()
        except Exception:
            logger.debug("kvtier: cannot read the attention backend of %s", names[0], exc_info=True)
        if name is None:
            from vllm.platforms import current_platform

            if current_platform.is_cpu():
                name = "CPU_ATTN"
        known = sorted({k for kinds in BACKEND_LAYOUTS.values() for k in kinds})
        if name not in BACKEND_LAYOUTS:
            raise ConfigError(f"kvtier does not know the KV layout of attention backend {name!r}; set "
                              f"kv_connector_extra_config['kvtier.connector']['kv_layout'] to one of "
                              f"{', '.join(known)}")
        tensor = self.kv_list[0]
        for kind in BACKEND_LAYOUTS[name]:
            try:
                if canonical_view(tensor, KVLayoutKind(kind), head_dim).shape[3] == heads:
                    return kind
            except LayoutError:
                continue
        raise ConfigError(f"kvtier: the KV tensor of attention backend {name} has shape {tuple(tensor.shape)}, which "
                          f"fits none of its known layouts ({', '.join(BACKEND_LAYOUTS[name])}) for {heads} KV heads "
                          f"of size {head_dim}; set kv_connector_extra_config['kvtier.connector']['kv_layout'] to one "
                          f"of {', '.join(known)}")

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from lmcache.v1.cache_engine import LMCacheEngineBuilder
        from lmcache.v1.metadata import LMCacheMetadata

        from kvtier.kernels.layout import KVLayoutKind, LayoutError
        from kvtier.storage_backends.lmcache.engine_access import hook_host_lookups, host_tier, kvtier_plugin
        from kvtier.storage_backends.lmcache.gpu_connector import PageFirstGPUConnector

        try:
            from vllm.model_executor.models.utils import extract_layer_index

            names = sorted(kv_caches, key=extract_layer_index)
        except Exception:
            names = list(kv_caches)
        self.kv_list = [kv_caches[n] for n in names]
        mc, pc = self.vllm_config.model_config, self.vllm_config.parallel_config
        heads, head_dim = mc.get_num_kv_heads(pc), mc.get_head_size()
        kind = KVLayoutKind(self._detect_layout(names, heads, head_dim))
        chunk = self.cfg.chunk_size
        self.fingerprint = engine_fingerprint(self.vllm_config, self.cfg, self.kv_list[0].dtype, self.rank)
        logger.info("kvtier: KV identity of rank %d: %s (weights fingerprinted in %.2f s)", self.rank,
                    self.fingerprint.describe(), self.fingerprint.weights.seconds)
        md = LMCacheMetadata(
            model_name=FINGERPRINT_PREFIX + self.fingerprint.digest, world_size=self.world,
            local_world_size=self.world, worker_id=self.rank,
            local_worker_id=self.rank, kv_dtype=self.kv_list[0].dtype,
            kv_shape=(len(self.kv_list), 2, chunk, heads, head_dim), chunk_size=chunk, role="worker",
        )
        gpu_conn = PageFirstGPUConnector.from_metadata(md, kind, self.cfg.page_tokens)
        try:
            gpu_conn._get_mover({"kvcaches": self.kv_list})  # validates the tensors against the layout now
        except LayoutError as e:
            raise ConfigError(f"kvtier: vLLM's KV tensors ({tuple(self.kv_list[0].shape)}, {kind.value}) do not fit "
                              f"the page-first connector: {e}") from None
        recording_before = recording.directory()
        if self.cfg.kvtier.record_host_policy:  # the host tier LMCache builds now records its policy stream
            recording.configure(self.cfg.kvtier.record_host_policy)
        try:
            self.engine = LMCacheEngineBuilder.get_or_create(self.instance_id, self.cfg.lmcache, md, gpu_conn,
                                                             lambda t, r: None, lambda o, r: o)
            self.engine.post_init()  # (LMCache builds its host tier here)
        finally:
            recording.configure(recording_before)
        plugin = kvtier_plugin(self.engine)
        if plugin is None or plugin.tier is None:
            self.close()
            raise ConfigError(f"LMCache did not start the kvtier SSD tier from {self.cfg.config_file} (its start-up "
                              "error is in the log above: LMCache only logs it); run `kvtier check-config "
                              f"{self.cfg.config_file}` to see the problem")
        self.ssd = SSDTierHandle(plugin)
        self._ssd_refused = plugin.refused
        try:
            self.host = host_tier(self.engine)
        except ConfigError:
            self.close()
            raise
        if isinstance(self.host.hot_cache, recording.LookupRecordingDict):
            hook_host_lookups(self.host, recording.lookup_scope)
        self.transfers = TransferQueue(self._engine_lock, self.kv_list[0].device, on_done=self._notify_progress)
        if self.cfg.options.ssd_stream_chunks > 0:
            self.stream = SSDStream(self.ssd, self.host, gpu_conn, self.cfg.options.ssd_stream_chunks,
                                    self.kv_list[0].device)
            logger.info("kvtier: loads stream SSD chunks the host tier has no room for through %d chunks (%.1f MiB) "
                        "of %s staging%s", self.stream.stage_chunks, self.stream.staging_bytes / (1 << 20),
                        "device" if self.stream.direct else "host",
                        " (kvikio reads; SSD chunks are not prefetched into the host tier)" if self.stream.direct
                        else "")
        if self.cfg.shared is not None:
            try:
                self.shared = self._attach_shared(md, heads, head_dim)
            except Exception:
                self.close()
                raise
        self.storage = WorkerStorage(self.host, self.ssd, self.shared, self._chunks, chunk, self.cfg.options,
                                     self._stat, self._notify_progress,
                                     direct_ssd=self.stream is not None and self.stream.direct, timing=self.timing)
        self.server = RPCServer(endpoint(self.engine_id, self.rank), self.handle)
        # LMCache keeps non-daemon threads until its engine is closed: close it before the interpreter joins
        # them, or an in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0) never exits.
        register = getattr(threading, "_register_atexit", None)
        if register is not None:
            with contextlib.suppress(RuntimeError):  # interpreter already shutting down
                register(self.close)
        logger.info("kvtier connector worker rank %d: %d layers, layout %s, chunk %d tokens, page %d tokens, SSD tier "
                    "at %s (%d chunks)", self.rank, len(self.kv_list), kind.value, chunk, self.cfg.page_tokens,
                    self.ssd.directory, len(self.ssd))

    def _attach_shared(self, md: Any, heads: int, head_dim: int) -> SharedSide:
        from kvtier.connector.shared_side import SharedSide
        from kvtier.storage_backends.lmcache.backend import expected_layout
        from kvtier.storage_backends.shared.tier import attach_shared_tier

        # the shared keys name kvtier's chunk layout: engines of another page size, chunk size or KV geometry (or
        # another model: LMCache's key names it) never read these chunks
        tag = f"pf{self.cfg.page_tokens}.c{self.cfg.chunk_size}.L{len(self.kv_list)}.H{heads}x{head_dim}"
        sealer = None
        if self.cfg.kvtier.encryption_key_file:  # the store holds sealed envelopes, under keys naming the secret
            from kvtier.identity.request import tenant_of_key
            from kvtier.storage_backends.config import load_secret
            from kvtier.storage_backends.ssd.sealing import ChunkSealer

            sealer = ChunkSealer(load_secret(self.cfg.kvtier.encryption_key_file), tenant_of_key)
        tier = attach_shared_tier(self.engine, expected_layout(md, "page_first", self.cfg.page_tokens), tag,
                                  self.cfg.shared, sealer)
        if tier is None:
            from kvtier.storage_backends.config import ConfigError

            raise ConfigError(f"{self.cfg.config_file}: LMCache did not start its remote backend (its error is in "
                              "the log above); check remote_url / remote_storage_plugins")
        return SharedSide(tier, self._chunks, self.cfg.chunk_size)

    # ------------------------------------------------------------------ RPC
    def handle(self, req: Request[Any]) -> Reply:
        """Answer one request of the scheduler side (the RPC server's thread; errors go back as `Failed`)."""
        handler = self._rpc.get(type(req))
        if handler is None:
            raise ValueError(f"no handler for {type(req).__name__}")
        return handler(req)

    def _storage(self) -> WorkerStorage:
        if self.storage is None:
            raise RuntimeError("the worker's storage side is not started (no KV caches registered)")
        return self.storage

    def _on_ping(self, req: Ping) -> PingReply:
        return PingReply(rank=self.rank, chunk_size=self.cfg.chunk_size)

    def _on_lookup(self, req: Lookup) -> LookupReply:
        if req.finished:
            self._feedback(req.finished)
        return LookupReply(self._storage().lookup(req.rid, req.tokens, req.pin, req.first, req.tag))

    def _on_prefetch(self, req: Prefetch) -> Ack:
        self._storage().submit_prefetch(req.rid, req.tokens, req.tag)
        return Ack()

    def _on_poll(self, req: Poll) -> PollReply:
        return PollReply(self._storage().take_results(req.rids))

    def _on_release(self, req: Release) -> Ack:
        self.release(req.rid)
        return Ack()

    def _on_flush(self, req: Flush) -> Ack:
        """The transfer thread's queued saves first, then the SSD tier's and the shared tier's writes."""
        ok = bool(self.transfers.drain(req.timeout)) if self.transfers is not None else True
        return Ack(ok=self._storage().flush(req.timeout) and ok)

    def _on_stats(self, req: Stats) -> StatsReply:
        return self._storage().stats()

    def _chunks(self, tokens: list[int], tag: str = "") -> list[tuple[int, int, Any]]:
        """(start, end, LMCache key) of each chunk of key tokens `tokens` of a request with identity tag `tag`."""
        if not tokens:
            return []
        t = torch.tensor(tokens, dtype=torch.long)
        return list(self.engine.token_database.process_tokens(tokens=t, request_configs=request_configs(tag)))

    def _full_chain(self, tokens: list[int], tag: str = "") -> list[Any]:
        """LMCache keys of the full chunks of a token sequence (the session chain it extends)."""
        c = self.cfg.chunk_size
        return [key for s, e, key in self._chunks(tokens, tag) if e - s == c]

    def release(self, rid: str) -> None:
        """Drop the request's host-memory pins (and its prefetch's result; a running prefetch releases them when
        it ends)."""
        if self.storage is not None:
            self.storage.release(rid)

    # ------------------------------------------------------------------ per step
    def bind(self, md: KVTierConnectorMetadata) -> None:
        self._metadata = md
        self._held.update(md.held)
        if self._ssd_refused is not None:
            self._refuse_ssd_writes(md.saves)
        if md.finished:
            self._feedback(md.finished)

    def _refuse_ssd_writes(self, saves: list[SaveSpec]) -> None:
        """Name the chunks of this step's saves that write admission keeps off the SSD (before the saves run)."""
        assert self._ssd_refused is not None
        c = self.cfg.chunk_size
        for spec in saves:
            if spec.ssd_refused:
                refused = set(spec.ssd_refused)
                self._ssd_refused.refuse(key.to_string() for s, e, key in self._chunks(spec.token_ids, spec.tag)
                                         if e - s == c and s // c in refused)

    def _feedback(self, finished: list[FinishedSpec]) -> None:
        for f in finished:
            if f.req_id not in self._loading:  # else the load releases its pins when it ends
                self.release(f.req_id)
            try:
                # the chain the request was announced with (its prompt's full chunks): the policies match the
                # answer to that session; the answer's own chunks belong to the next turn's prompt
                session_signals.request_finished(self._full_chain(f.token_ids[:f.prompt_tokens], f.tag),
                                                 f.answer_tokens)
                M.FEEDBACK.inc()
                self._stat(feedback=1)
            except Exception:
                logger.exception("kvtier: answer-length feedback for %s failed", f.req_id)

    def handle_preemptions(self, md: Any) -> None:
        """Before this step's forward pass: saves of requests preempted in this step's schedule read their blocks
        now, before the blocks are handed to other requests (vLLM freed them when it preempted)."""
        if not isinstance(md, KVTierConnectorMetadata) or not md.preempted or self.transfers is None:
            return
        waiting = [r for r in md.preempted if self.transfers.pending(r)]
        if not waiting:
            return
        t0 = time.monotonic()
        while not self.transfers.wait_for(waiting, timeout=10.0):
            logger.warning("kvtier: still waiting for the saves of preempted request(s) %s after %.0f s (their blocks "
                           "must not be reused before)", ", ".join(waiting), time.monotonic() - t0)
        dt = time.monotonic() - t0
        M.PREEMPTION_FLUSHES.inc(len(waiting))
        M.PREEMPTION_FLUSH_SECONDS.observe(dt)
        self._stat(preemption_flushes=len(waiting))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(finished sending, finished receiving): held finished requests whose saves are all done, and requests
        whose asynchronous load ended (its failed blocks are reported through `take_load_errors` in this same
        step)."""
        recving: set[str] = set()
        if self.transfers is not None:
            self.transfers.tick()
            md = self._metadata
            if md is not None and md.idle:
                self._wait_idle(self.cfg.options.idle_wait_ms / 1000.0)
            for job in self.transfers.take_done():
                M.TRANSFER_QUEUE_SECONDS.labels(job.kind).observe(job.finished - job.submitted)
                if job.kind == "load":
                    spec = job.spec  # result: (first token that did not arrive or None,); None: the job broke
                    bad_from = job.result[0] if job.result is not None else spec.gpu_cached
                    self._loading.discard(spec.req_id)
                    self._finish_load(spec, bad_from, job.finished - job.started, "async")
                    recving.add(spec.req_id)
                else:
                    self._completed_saves[job.spec.job_id] = 1
            for kind in ("load", "save"):
                M.TRANSFERS_INFLIGHT.labels(kind).set(self.transfers.inflight(kind))
        sending = {r for r in self._held if self.transfers is None or not self.transfers.pending(r)}
        self._held -= sending
        return sending or None, recving or None

    def _notify_progress(self) -> None:
        with self._progress:
            self._progress.notify_all()

    def _wait_idle(self, timeout: float) -> None:
        """A step with nothing to compute: wait up to `timeout` seconds (GIL released) until a transfer job or a
        prefetch has ended that the engine has not seen yet, or nothing is in flight any more. Without this wait an
        engine that steps in the caller's thread (vLLM's in-process mode) runs empty steps back to back, holding
        the GIL that the transfer thread needs to finish the very load the engine waits for."""
        if timeout <= 0 or self.transfers is None:
            return
        q = self.transfers

        storage = self.storage

        def news() -> bool:  # something to report, or nothing left to wait for
            if storage is None:
                return q.has_done() or not len(q)
            return q.has_done() or storage.has_results() or not (len(q) or storage.prefetching())

        t0 = time.monotonic()
        with self._progress:
            if news():
                return
            self._progress.wait_for(news, timeout)
        dt = time.monotonic() - t0
        M.IDLE_WAIT_SECONDS.observe(dt)
        self._stat(idle_waits=1, idle_wait_seconds=dt)

    def build_worker_meta(self) -> KVTierWorkerMetadata | None:
        if not self._completed_saves:
            return None
        done, self._completed_saves = self._completed_saves, {}
        # a job's shortfall is written by its save before the job counts as completed: never split from it
        short = {job: self._short_saves.pop(job) for job in done if job in self._short_saves}
        out = KVTierWorkerMetadata(done, short)
        return out

    def clear(self) -> None:
        self._metadata = None

    def _stat(self, **kw: float) -> None:
        with self._stats_lock:  # the transfer and prefetch threads count too
            self.stats.add(**kw)

    def take_stats(self) -> M.KVTierConnectorStats | None:
        with self._stats_lock:
            if self.stats.is_empty():
                return None
            out = M.KVTierConnectorStats(data=self.stats.snapshot())
            self.stats.reset()
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.storage is not None:
            self.storage.close()
        if self.transfers is not None and not self.transfers.close(60):
            logger.warning("kvtier: loads or saves still queued on the transfer thread after 60 s are dropped")
        if self.shared is not None:
            try:
                self.shared.close()  # before LMCache closes its backends (see SharedTier.close)
            except Exception:
                logger.exception("kvtier: closing the shared tier failed")
            self.shared = None
        if self.engine is not None:
            from lmcache.v1.cache_engine import LMCacheEngineBuilder

            try:
                flushed = self.ssd.flush(60) if self.ssd is not None else True
                chunks = len(self.ssd) if self.ssd is not None else 0
                LMCacheEngineBuilder.destroy(self.instance_id)
                logger.info("kvtier connector worker rank %d closed: %s, %d chunks on the SSD tier", self.rank,
                            "queued SSD writes committed" if flushed else "SSD writes still queued after 60 s lost",
                            chunks)
            except Exception:
                logger.exception("kvtier: closing the LMCache engine failed")
            self.engine = None
