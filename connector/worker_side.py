"""The connector's worker side: an in-process LMCache engine with kvtier's SSD tier and page-first GPU connector.

- `register_kv_caches`: builds the engine for this rank's KV tensors (layout detected from the attention backend),
  checks that LMCache really loaded the kvtier plugin (LMCache only logs a plugin's start-up error), and starts the
  storage RPC endpoint the scheduler side uses for lookups and prefetches.
- Lookups walk a request's chunk keys: host tier (LMCache's `LocalCPUBackend`), then the SSD tier, then the shared
  tier when the LMCache config names a remote store (`connector/shared_side.py`: local tiers always first).
- Prefetches read SSD-only and shared-only chunks into the host tier on a background thread (never inside a
  forward pass) and pin them for the request until its load.
- `start_load_kv` retrieves from the host tier through the page-first connector; any token that does not arrive
  marks its block (and every later one of that load) as a load error for vLLM to recompute: never wrong KV.
- `wait_for_save` stores newly completed chunks (host tier, write-through to SSD asynchronously; to the shared tier
  from a helper thread, as `kvtier.shared.writes` says).
- Finished requests' answer lengths and chunk chains reach the SSD tier's eviction policy.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from kvtier.connector import metrics as M
from kvtier.connector.config import ConnectorConfig
from kvtier.connector.messages import FinishedSpec, KVTierConnectorMetadata, LookupResult, PrefetchResult
from kvtier.connector.rpc import RPCServer, endpoint
from kvtier.storage_backends import session_signals
from kvtier.storage_backends.config import ConfigError

logger = logging.getLogger(__name__)

#: attention backend name -> layout of the per-layer KV tensor it registers (vLLM 0.32 / 0.33)
BACKEND_LAYOUTS = {
    "CPU_ATTN": "split_token_dim",
    "TORCH_SDPA": "split_token_dim",
    "FLASH_ATTN": "split_last_dim",
    "TRITON_ATTN": "split_last_dim",
    "ROCM_ATTN": "split_last_dim",
    "FLASHINFER": "split_head_dim",
}


def _rank(vllm_config: Any) -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:
        return int(getattr(vllm_config.parallel_config, "rank", 0) or 0)


def slot_mapping(block_ids: list[int], block_size: int, num_tokens: int) -> torch.Tensor:
    """vLLM slot of each of the first `num_tokens` tokens of a request with these blocks."""
    pos = torch.arange(num_tokens, dtype=torch.long)
    blocks = torch.as_tensor(block_ids, dtype=torch.long)
    if len(block_ids) * block_size < num_tokens:
        raise ValueError(f"{len(block_ids)} blocks of {block_size} cannot hold {num_tokens} tokens")
    return blocks[pos // block_size] * block_size + pos % block_size


class WorkerSide:
    def __init__(self, vllm_config: Any, cfg: ConnectorConfig) -> None:
        self.vllm_config = vllm_config
        self.cfg = cfg
        self.block_size = int(vllm_config.cache_config.block_size)
        self.rank = _rank(vllm_config)
        self.world = int(vllm_config.parallel_config.world_size)
        self.engine_id = str(vllm_config.kv_transfer_config.engine_id)
        self.instance_id = f"kvtier-{self.engine_id}-r{self.rank}"
        self.engine: Any = None
        self.host: Any = None  # LMCache LocalCPUBackend
        self.ssd: Any = None  # KVTierBackend
        self.shared: Any = None  # SharedSide, when the LMCache config names a shared store
        self.kv_list: list[torch.Tensor] = []
        self.server: RPCServer | None = None
        self.stats = M.KVTierConnectorStats()
        self._lock = threading.RLock()
        self._pins: dict[str, dict[Any, None]] = {}
        self._prefetch_done: dict[str, PrefetchResult] = {}
        self._prefetching: set[str] = set()
        self._cancelled: set[str] = set()
        self._prefetch_pool = ThreadPoolExecutor(max_workers=cfg.options.prefetch_concurrency,
                                                 thread_name_prefix="kvtier-prefetch")
        self._load_errors: set[int] = set()
        self._metadata: KVTierConnectorMetadata | None = None
        self._closed = False

    # ------------------------------------------------------------------ start-up
    def _detect_layout(self, names: list[str]) -> str:
        opt = self.cfg.options.kv_layout
        if opt != "auto":
            return opt
        name = None
        try:
            ctx = self.vllm_config.compilation_config.static_forward_context
            layer = ctx[names[0]]
            backend = getattr(layer, "attn_backend", None) or layer.get_attn_backend()
            name = backend.get_name()
        except Exception:
            logger.debug("kvtier: cannot read the attention backend of %s", names[0], exc_info=True)
        if name in BACKEND_LAYOUTS:
            return BACKEND_LAYOUTS[name]
        from vllm.platforms import current_platform

        if name is None and current_platform.is_cpu():
            return "split_token_dim"
        raise ConfigError(f"kvtier does not know the KV layout of attention backend {name!r}; set "
                          f"kv_connector_extra_config['kvtier.connector']['kv_layout'] to one of "
                          f"{', '.join(sorted(set(BACKEND_LAYOUTS.values())))}")

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from lmcache.v1.cache_engine import LMCacheEngineBuilder
        from lmcache.v1.metadata import LMCacheMetadata

        from kvtier.kernels.layout import KVLayoutKind, LayoutError
        from kvtier.kernels.lmcache_connector import PageFirstGPUConnector
        from kvtier.storage_backends.lmcache_backend import kvtier_backend

        try:
            from vllm.model_executor.models.utils import extract_layer_index

            names = sorted(kv_caches, key=extract_layer_index)
        except Exception:
            names = list(kv_caches)
        self.kv_list = [kv_caches[n] for n in names]
        kind = KVLayoutKind(self._detect_layout(names))
        mc, pc = self.vllm_config.model_config, self.vllm_config.parallel_config
        heads, head_dim = mc.get_num_kv_heads(pc), mc.get_head_size()
        chunk = self.cfg.chunk_size
        md = LMCacheMetadata(
            model_name=str(mc.model), world_size=self.world, local_world_size=self.world, worker_id=self.rank,
            local_worker_id=self.rank, kv_dtype=self.kv_list[0].dtype,
            kv_shape=(len(self.kv_list), 2, chunk, heads, head_dim), chunk_size=chunk, role="worker",
        )
        gpu_conn = PageFirstGPUConnector.from_metadata(md, kind, self.cfg.page_tokens)
        try:
            gpu_conn._get_mover({"kvcaches": self.kv_list})  # validates the tensors against the layout now
        except LayoutError as e:
            raise ConfigError(f"kvtier: vLLM's KV tensors ({tuple(self.kv_list[0].shape)}, {kind.value}) do not fit "
                              f"the page-first connector: {e}") from None
        self.engine = LMCacheEngineBuilder.get_or_create(self.instance_id, self.cfg.lmcache, md, gpu_conn,
                                                         lambda t, r: None, lambda o, r: o)
        self.engine.post_init()
        self.ssd = kvtier_backend(self.engine)
        if self.ssd is None or getattr(self.ssd, "tier", None) is None:
            self.close()
            raise ConfigError(f"LMCache did not start the kvtier SSD tier from {self.cfg.config_file} (its start-up "
                              "error is in the log above: LMCache only logs it); run `kvtier check-config "
                              f"{self.cfg.config_file}` to see the problem")
        self.host = self.engine.storage_manager.storage_backends.get("LocalCPUBackend")
        if self.host is None:
            self.close()
            raise ConfigError("LMCache started without its host tier (LocalCPUBackend); set local_cpu: true")
        if self.cfg.shared is not None:
            try:
                self.shared = self._attach_shared(md, heads, head_dim)
            except Exception:
                self.close()
                raise
        self.server = RPCServer(endpoint(self.engine_id, self.rank), self.handle)
        # LMCache keeps non-daemon threads until its engine is closed: close it before the interpreter joins
        # them, or an in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0) never exits.
        register = getattr(threading, "_register_atexit", None)
        if register is not None:
            try:
                register(self.close)
            except RuntimeError:  # interpreter already shutting down
                pass
        logger.info("kvtier connector worker rank %d: %d layers, layout %s, chunk %d tokens, page %d tokens, SSD tier "
                    "at %s (%d chunks)", self.rank, len(self.kv_list), kind.value, chunk, self.cfg.page_tokens,
                    self.ssd.tier.directory, len(self.ssd.tier))

    def _attach_shared(self, md: Any, heads: int, head_dim: int) -> Any:
        from kvtier.connector.shared_side import SharedSide
        from kvtier.storage_backends.lmcache_backend import expected_layout
        from kvtier.storage_backends.shared_tier import attach_shared_tier

        # the shared keys name kvtier's chunk layout: engines of another page size, chunk size or KV geometry (or
        # another model: LMCache's key names it) never read these chunks
        tag = f"pf{self.cfg.page_tokens}.c{self.cfg.chunk_size}.L{len(self.kv_list)}.H{heads}x{head_dim}"
        tier = attach_shared_tier(self.engine, expected_layout(md, "page_first", self.cfg.page_tokens), tag,
                                  self.cfg.shared, model_id=self.cfg.shared.model_id)
        if tier is None:
            from kvtier.storage_backends.config import ConfigError

            raise ConfigError(f"{self.cfg.config_file}: LMCache did not start its remote backend (its error is in "
                              "the log above); check remote_url / remote_storage_plugins")
        return SharedSide(tier, self._chunks, self.cfg.chunk_size)

    # ------------------------------------------------------------------ RPC
    def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        op = req.get("op")
        if op == "ping":
            return {"ok": True, "rank": self.rank, "chunk_size": self.cfg.chunk_size}
        if op == "lookup":
            if req.get("finished"):
                self._feedback([FinishedSpec(**d) for d in req["finished"]])
            return self.lookup(str(req["rid"]), list(req["tokens"]), bool(req.get("pin")),
                               bool(req.get("first"))).to_dict()
        if op == "prefetch":
            self.submit_prefetch(str(req["rid"]), list(req["tokens"]))
            return {"ok": True}
        if op == "poll":
            with self._lock:
                done = {rid: self._prefetch_done.pop(rid).to_dict() for rid in req.get("rids", [])
                        if rid in self._prefetch_done}
            return {"done": done}
        if op == "release":
            self.release(str(req["rid"]))
            return {"ok": True}
        if op == "flush":
            ok = bool(self.ssd.flush(float(req.get("timeout", 60))))
            if self.shared is not None:
                ok = self.shared.flush(float(req.get("timeout", 60))) and ok
            return {"ok": ok}
        if op == "stats":
            policy_stats = getattr(self.ssd.tier.policy, "stats", None)
            return {"ssd": self.ssd.tier.stats.as_dict(), "ssd_chunks": len(self.ssd.tier),
                    "host_chunks": len(self.host.hot_cache),
                    "ssd_policy": {"name": self.ssd.tier.policy.name,
                                   **(policy_stats() if callable(policy_stats) else {})},
                    "shared": self.shared.stats() if self.shared is not None else None}
        raise ValueError(f"unknown op {op!r}")

    def _chunks(self, tokens: list[int]) -> list[tuple[int, int, Any]]:
        if not tokens:
            return []
        t = torch.tensor(tokens, dtype=torch.long)
        return list(self.engine.token_database.process_tokens(tokens=t))

    def _full_chain(self, tokens: list[int]) -> list[Any]:
        """LMCache keys of the full chunks of a token sequence (the session chain it extends)."""
        c = self.cfg.chunk_size
        return [key for s, e, key in self._chunks(tokens) if e - s == c]

    def _pin(self, rid: str, key: Any) -> bool:
        pins = self._pins.setdefault(rid, {})
        if key in pins:
            return self.host.contains(key)
        if self.host.pin(key):
            pins[key] = None
            return True
        return False

    def lookup(self, rid: str, tokens: list[int], pin: bool = False, first: bool = False) -> LookupResult:
        tier = self.ssd.tier
        host_end = hit_end = ssd_tokens = ssd_bytes = remote_tokens = 0
        host_run = True
        chunks = self._chunks(tokens)
        missing = None  # first chunk in neither local tier
        with self._lock:
            for i, (start, end, key) in enumerate(chunks):
                if host_run and (self._pin(rid, key) if pin else self.host.contains(key)):
                    host_end = end
                elif self.host.contains(key):
                    pass
                elif tier.contains(key.to_string()):
                    host_run = False
                    ssd_tokens += end - start
                    ssd_bytes += tier.chunk_bytes
                else:
                    missing = i
                    break
                hit_end = end
        if missing is not None and self.shared is not None:  # the network only for what the local tiers lack
            rest = chunks[missing:]
            for start, end, key in rest[:self.shared.prefix(rid, [k for _, _, k in rest])]:
                remote_tokens += end - start
                hit_end = end
        if first:
            session_signals.request_arrived([k for s, e, k in chunks if e - s == self.cfg.chunk_size])
        return LookupResult(host_end, hit_end, ssd_tokens, ssd_bytes, self.cfg.chunk_size, remote_tokens,
                            remote_tokens // self.cfg.chunk_size * tier.chunk_bytes)

    def release(self, rid: str) -> None:
        with self._lock:
            for key in self._pins.pop(rid, {}):
                self.host.unpin(key)
            self._prefetch_done.pop(rid, None)
            if self.shared is not None:
                self.shared.forget(rid)
            if rid in self._prefetching:
                self._cancelled.add(rid)  # the prefetch releases its pins when it ends

    def submit_prefetch(self, rid: str, tokens: list[int]) -> None:
        with self._lock:
            self._prefetching.add(rid)
            self._cancelled.discard(rid)
        self._prefetch_pool.submit(self._prefetch, rid, tokens)

    def _prefetch(self, rid: str, tokens: list[int]) -> None:
        t0 = time.monotonic()
        if self.cfg.options.debug_prefetch_delay_s:
            time.sleep(self.cfg.options.debug_prefetch_delay_s)
        try:
            todo, chunks, missing = [], self._chunks(tokens), None
            with self._lock:
                for i, (start, end, key) in enumerate(chunks):
                    # Pin what is already in host memory: the chunks this prefetch brings in must not evict it.
                    if self._pin(rid, key):
                        continue
                    if not self.ssd.tier.contains(key.to_string()):
                        missing = i
                        break
                    todo.append((start, end, key))
            objs = self.ssd.read([k for _, _, k in todo], wait_for_memory=False) if todo else []
            if missing is not None and self.shared is not None and all(o is not None for o in objs):
                rest = chunks[missing:]
                remote = rest[:self.shared.prefix(rid, [k for _, _, k in rest])]
                if remote:  # the chunks only the shared tier holds, after the local ones
                    todo += remote
                    objs += self.shared.read([k for _, _, k in remote])
            nbytes, ntok, ok = 0, 0, True
            with self._lock:
                for (start, end, key), obj in zip(todo, objs):
                    if obj is None:
                        ok = False
                        break
                    self.host.submit_put_task(key, obj)
                    self._pin(rid, key)
                    nbytes += obj.get_size()
                    ntok += end - start
                for obj in objs:
                    if obj is not None:
                        obj.ref_count_down()
                host_end = 0
                for _, end, key in self._chunks(tokens):
                    if not self._pin(rid, key):
                        break
                    host_end = end
            dt = time.monotonic() - t0
            M.PREFETCH_SECONDS.observe(dt)
            M.PREFETCH_BYTES.inc(nbytes)
            self.stats.add(prefetches=1, prefetched_tokens=ntok, prefetch_seconds=dt)
            res = PrefetchResult(ok, host_end, nbytes, dt, "" if ok else "a chunk could not be read (SSD or shared "
                                 "tier)")
        except Exception as e:  # the request then recomputes what is not in host memory
            logger.exception("kvtier: prefetch of %s failed", rid)
            res = PrefetchResult(False, 0, 0, time.monotonic() - t0, f"{type(e).__name__}: {e}")
        with self._lock:
            self._prefetching.discard(rid)
            if rid in self._cancelled:
                self._cancelled.discard(rid)
                self.release(rid)
            else:
                self._prefetch_done[rid] = res

    # ------------------------------------------------------------------ per step
    def bind(self, md: KVTierConnectorMetadata) -> None:
        self._metadata = md
        if md.finished:
            self._feedback(md.finished)

    def _feedback(self, finished: list[FinishedSpec]) -> None:
        for f in finished:
            self.release(f.req_id)
            try:
                # the chain the request was announced with (its prompt's full chunks): the policies match the
                # answer to that session; the answer's own chunks belong to the next turn's prompt
                session_signals.request_finished(self._full_chain(f.token_ids[:f.prompt_tokens]), f.answer_tokens)
                M.FEEDBACK.inc()
                self.stats.add(feedback=1)
            except Exception:
                logger.exception("kvtier: answer-length feedback for %s failed", f.req_id)

    def start_load(self) -> None:
        md = self._metadata
        if md is None or not md.loads:
            return
        for spec in md.loads:
            t0 = time.monotonic()
            n = spec.load_end
            try:
                tokens = torch.tensor(spec.token_ids[:n], dtype=torch.long)
                mask = torch.ones(n, dtype=torch.bool)
                skip = spec.gpu_cached // self.cfg.chunk_size * self.cfg.chunk_size
                mask[:skip] = False
                ret = self.engine.retrieve(tokens, mask, kvcaches=self.kv_list,
                                           slot_mapping=slot_mapping(spec.block_ids, self.block_size, n),
                                           vllm_cached_tokens=spec.gpu_cached, req_id=spec.req_id)
                got = ret[spec.gpu_cached:n]
                bad_from = None if bool(got.all()) else spec.gpu_cached + int((~got).nonzero()[0])
            except Exception:
                logger.exception("kvtier: load for %s failed; its blocks will be recomputed", spec.req_id)
                bad_from = spec.gpu_cached
            if bad_from is not None:
                blocks = spec.block_ids[bad_from // self.block_size:-(-n // self.block_size)]
                self._load_errors.update(blocks)
                M.LOAD_ERROR_BLOCKS.inc(len(blocks))
                self.stats.add(load_error_blocks=len(blocks))
                logger.warning("kvtier: %s: tokens %d..%d did not load; %d blocks go back to vLLM for recomputation",
                               spec.req_id, bad_from, n, len(blocks))
            dt = time.monotonic() - t0
            loaded = (bad_from if bad_from is not None else n) - spec.gpu_cached
            M.LOAD_SECONDS.observe(dt)
            M.LOAD_BYTES.inc(max(loaded, 0) * self._token_bytes())
            self.stats.add(loads=1, loaded_tokens=max(loaded, 0), load_seconds=dt)
            self.release(spec.req_id)

    def _token_bytes(self) -> int:
        t = self.kv_list[0]
        return 2 * len(self.kv_list) * self.vllm_config.model_config.get_num_kv_heads(
            self.vllm_config.parallel_config) * self.vllm_config.model_config.get_head_size() * t.element_size()

    def wait_for_save(self) -> None:
        md = self._metadata
        if md is None or not md.saves:
            return
        for spec in md.saves:
            t0 = time.monotonic()
            n = len(spec.token_ids)
            try:
                mask = torch.ones(n, dtype=torch.bool)
                mask[:spec.skip] = False
                self.engine.store(torch.tensor(spec.token_ids, dtype=torch.long), mask=mask, kvcaches=self.kv_list,
                                  slot_mapping=slot_mapping(spec.block_ids, self.block_size, n), req_id=spec.req_id)
            except Exception:  # a lost save is a future miss, never wrong KV
                logger.exception("kvtier: save for %s failed", spec.req_id)
                continue
            if self.shared is not None and spec.share:
                self.shared.share_saved(spec.token_ids, spec.skip)  # queued for a helper thread: returns at once
            dt = time.monotonic() - t0
            M.SAVE_SECONDS.observe(dt)
            M.SAVE_BYTES.inc((n - spec.skip) * self._token_bytes())
            self.stats.add(saves=1, saved_tokens=n - spec.skip, save_seconds=dt)

    def clear(self) -> None:
        self._metadata = None

    def take_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def take_stats(self) -> M.KVTierConnectorStats | None:
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
        self._prefetch_pool.shutdown(wait=True, cancel_futures=True)
        if self.shared is not None:
            try:
                self.shared.close()  # before LMCache closes its backends (see SharedTier.close)
            except Exception:
                logger.exception("kvtier: closing the shared tier failed")
            self.shared = None
        if self.engine is not None:
            from lmcache.v1.cache_engine import LMCacheEngineBuilder

            try:
                if self.ssd is not None:
                    self.ssd.flush(60)
                LMCacheEngineBuilder.destroy(self.instance_id)
            except Exception:
                logger.exception("kvtier: closing the LMCache engine failed")
            self.engine = None
