"""The connector's scheduler side: tier hints, eager SSD prefetch in disk-HRRN order, load/save planning.

- `on_new_request`: looks the prompt up across tiers (RPC to the worker ranks), publishes a `TierHint`
  (`tier_hint(request_id)`) and, when part of the prefix is only on SSD or only in the shared tier (state REMOTE),
  queues a prefetch into host memory.
- Prefetches are issued at most `prefetch_concurrency` at a time, in disk-HRRN order (the scheduling policy's
  `next_prefetch` when kvtier's dual-queue scheduler hands its policy over, else a local `DiskHRRNQueue`).
- `get_num_new_matched_tokens` answers `None` while the request's SSD data is being prefetched (the request waits
  without GPU blocks; others run), then the host-resident prefix (chunk-aligned) beyond vLLM's own cache hit.
- `build_connector_meta` turns admitted loads, newly completed chunks and finished requests (answer length and
  token chain) into the step's `KVTierConnectorMetadata`.
- Hints count `inflight_tokens`: an admitted request's prompt chunks are *computing* until it saves them; a
  waiting request whose prefix continues into them sees them in flight (kvtier's dual-queue policy defers it
  rather than recomputing them: while the policy `holds` it, `get_num_new_matched_tokens` answers "not yet").
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any

from kvtier.connector import metrics as M
from kvtier.connector.config import ConnectorConfig
from kvtier.connector.messages import (
    FinishedSpec,
    KVTierConnectorMetadata,
    LoadSpec,
    LookupResult,
    PrefetchResult,
    SaveSpec,
)
from kvtier.connector.rpc import RPCClient, RPCError, endpoint
from kvtier.scheduler_hooks.hrrn import DiskHRRNQueue
from kvtier.scheduler_hooks.tier_hint import TierHint, classify

logger = logging.getLogger(__name__)


@dataclass
class _Req:
    request: Any
    arrival: float
    lookup: LookupResult = field(default_factory=LookupResult)
    gpu_tokens: int = 0
    prefetch: str = "none"  # none | queued | inflight | done | failed
    prefetch_ssd_tokens: int = 0  # tokens that were only on SSD when the prefetch was queued
    prefetch_remote_tokens: int = 0  # tokens that were only in the shared tier then
    share: bool = True  # its saved chunks go to the shared tier too (`kvtier.shared.writes`)
    partial: dict[int, PrefetchResult] = field(default_factory=dict)
    pending_load: tuple[int, int] | None = None  # (gpu_cached, load_end) between lookup and allocation
    load_spec: LoadSpec | None = None
    sources: dict[str, int] = field(default_factory=dict)
    block_ids: list[int] = field(default_factory=list)
    computed: int = 0
    saved_upto: int = 0
    chunk_keys: list[int] | None = None  # one key per full prompt chunk, naming the prefix up to its end


def prefix_chunk_keys(tokens: Any, chunk: int) -> list[int]:
    """A key per full chunk of `tokens`, naming the whole prefix up to that chunk's end (chained hashes): two
    prompts share key i exactly when (up to hash collisions, harmless in a scheduling hint) they share their
    first (i + 1) * chunk tokens."""
    keys, h = [], 0
    for i in range(len(tokens) // chunk):
        h = hash((h, tuple(tokens[i * chunk:(i + 1) * chunk])))
        keys.append(h)
    return keys


class SchedulerSide:
    #: vLLM steps in a tight loop while requests wait for prefetches: poll the worker ranks at most this often
    POLL_INTERVAL_S = 0.002

    def __init__(self, vllm_config: Any, cfg: ConnectorConfig) -> None:
        self._last_poll = 0.0
        self.cfg = cfg
        self.chunk = cfg.chunk_size
        self.block_size = int(vllm_config.cache_config.block_size)
        world = int(vllm_config.parallel_config.world_size)
        engine_id = str(vllm_config.kv_transfer_config.engine_id)
        self.client = RPCClient([endpoint(engine_id, r) for r in range(world)], cfg.options.rpc_timeout_s)
        self.reqs: dict[str, _Req] = {}
        self.hints: dict[str, TierHint] = {}
        #: prompt chunks that admitted requests are computing right now (not yet saved): chunk key -> request
        self.computing: dict[int, str] = {}
        self.hrrn = DiskHRRNQueue()
        self.policy: Any = None
        self.inflight: dict[str, float] = {}
        self.finished: list[FinishedSpec] = []
        #: recent admissions (first prompt tokens, tokens loaded, of which from SSD), oldest first
        self.admitted: collections.deque[tuple[list[int], int, int]] = collections.deque(maxlen=4096)
        self.counters = {"lookups": 0, "rpc_errors": 0, "prefetches": 0, "prefetch_failures": 0, "none_answers": 0,
                         "delay_hit_waits": 0}

    # ------------------------------------------------------------------ hints
    def set_scheduling_policy(self, policy: Any) -> None:
        """kvtier's dual-queue scheduler hands over its policy: prefetches then follow its disk-HRRN order."""
        self.policy = policy
        for rid in list(self.hrrn.ordered(time.time())):  # move what is already queued
            self.hrrn.remove(rid)
            st = self.reqs.get(rid)
            if st is not None:
                self.policy.update(self._publish(st))

    def tier_hint(self, request_id: str) -> TierHint | None:
        """The request's latest hint, with `inflight_tokens` counted now: prompt tokens past its resident
        prefix that another admitted request is computing at this moment (Strata's delay hit: they land in the
        host tier once that request saves them, so waiting beats recomputing them)."""
        hint = self.hints.get(request_id)
        st = self.reqs.get(request_id)
        if hint is None or st is None:
            return hint
        n = self._inflight_tokens(st, hint.gpu_tokens + hint.host_tokens + hint.ssd_tokens + hint.remote_tokens)
        return hint if n == hint.inflight_tokens else replace(hint, inflight_tokens=n)

    def _keys(self, st: _Req) -> list[int]:
        if st.chunk_keys is None:
            st.chunk_keys = prefix_chunk_keys(st.request.prompt_token_ids, self.chunk)
        return st.chunk_keys

    def _inflight_tokens(self, st: _Req, resident: int) -> int:
        if not self.computing:
            return 0
        keys, rid, n = self._keys(st), st.request.request_id, 0
        for key in keys[-(-resident // self.chunk):]:
            owner = self.computing.get(key)
            if owner is None or owner == rid:
                break
            n += self.chunk
        return n

    def _computing_from(self, st: _Req, start: int) -> None:
        """`st` (admitted) computes its prompt chunks from token `start` on: other requests sharing them wait."""
        rid = st.request.request_id
        for key in self._keys(st)[start // self.chunk:]:
            self.computing.setdefault(key, rid)

    def _computed_upto(self, st: _Req, end: int | None = None) -> None:
        """`st`'s prompt chunks below token `end` (all of them if None) are saved or abandoned."""
        rid = st.request.request_id
        keys = self._keys(st)
        for key in keys[:len(keys) if end is None else end // self.chunk]:
            if self.computing.get(key) == rid:
                del self.computing[key]

    def _publish(self, st: _Req) -> TierHint:
        res = st.lookup
        gpu = st.gpu_tokens
        pending = st.prefetch in ("none", "queued", "inflight")
        ssd = res.ssd_tokens if pending else 0
        remote = res.remote_tokens if pending else 0
        ssd_bytes = res.ssd_bytes if ssd else 0
        host = (max(0, res.hit_end - res.ssd_tokens - res.remote_tokens - gpu) if ssd or remote
                else max(0, res.host_end - gpu))
        state = classify(gpu, host, ssd, loading=st.prefetch == "inflight", remote_tokens=remote)
        hint = TierHint(st.request.request_id, gpu_tokens=gpu, host_tokens=host, ssd_tokens=ssd,
                        ssd_bytes=ssd_bytes, state=state, arrival=st.arrival, remote_tokens=remote,
                        remote_bytes=res.remote_bytes if remote else 0)
        self.hints[st.request.request_id] = hint
        return hint

    def _lookup(self, st: _Req, tokens: list[int], pin: bool, first: bool = False) -> LookupResult:
        self.counters["lookups"] += 1
        msg = {"op": "lookup", "rid": st.request.request_id, "tokens": tokens, "pin": pin, "first": first}
        # Answers of requests finished since the last engine step travel ahead of a new request's first lookup:
        # on an idle engine the next step only comes with the next request, and a conversation's next turn must
        # not reach the eviction policies before the answer of the turn it follows.
        sent, self.finished = (self.finished, []) if first else ([], self.finished)
        if sent:
            msg["finished"] = [dataclasses.asdict(f) for f in sent]
        try:
            reps = self.client.call(msg)
        except RPCError as e:
            self.counters["rpc_errors"] += 1
            self.finished = sent + self.finished  # they go with the next step's metadata instead
            logger.warning("kvtier: lookup failed (%s); treated as a miss", e)
            return LookupResult()
        return LookupResult.combine([LookupResult.from_dict(r) for r in reps])

    def _release(self, rid: str) -> None:
        try:
            self.client.call({"op": "release", "rid": rid})
        except RPCError as e:
            logger.warning("kvtier: release of %s failed (%s)", rid, e)

    # ------------------------------------------------------------------ prefetch
    def _enqueue(self, st: _Req) -> None:
        st.prefetch = "queued"
        st.prefetch_ssd_tokens = st.lookup.ssd_tokens
        st.prefetch_remote_tokens = st.lookup.remote_tokens
        hint = self._publish(st)
        if self.policy is not None:
            self.policy.update(hint)
        else:
            self.hrrn.push(st.request.request_id, st.arrival, hint.prefetch_bytes)

    def _next_prefetch(self, now: float) -> str | None:
        if self.policy is not None:
            return self.policy.next_prefetch(now)
        return self.hrrn.pop(now)

    def pump(self) -> None:
        """Collect finished prefetches and issue queued ones (at most `prefetch_concurrency` in flight)."""
        now = time.time()
        if self.inflight and time.monotonic() - self._last_poll >= self.POLL_INTERVAL_S:
            self._last_poll = time.monotonic()
            try:
                reps = self.client.call({"op": "poll", "rids": list(self.inflight)})
            except RPCError as e:
                logger.warning("kvtier: prefetch poll failed (%s)", e)
                reps = []
            for rank, rep in enumerate(reps):
                for rid, d in rep.get("done", {}).items():
                    st = self.reqs.get(rid)
                    if st is not None:
                        st.partial[rank] = PrefetchResult.from_dict(d)
            for rid, issued in list(self.inflight.items()):
                st = self.reqs.get(rid)
                if st is None:
                    del self.inflight[rid]
                    continue
                if len(st.partial) == len(self.client.addresses):
                    self._prefetched(st, all(r.ok for r in st.partial.values()), now)
                elif now - issued > self.cfg.options.prefetch_timeout_s:
                    logger.warning("kvtier: prefetch of %s timed out after %.0f s; its SSD part is recomputed",
                                   rid, now - issued)
                    self._prefetched(st, False, now)
        limit = self.cfg.options.prefetch_concurrency
        while len(self.inflight) < limit:
            rid = self._next_prefetch(now)
            if rid is None:
                break
            st = self.reqs.get(rid)
            if st is None or st.prefetch != "queued":
                continue
            try:
                self.client.call({"op": "prefetch", "rid": rid, "tokens": list(st.request.all_token_ids)})
            except RPCError as e:
                logger.warning("kvtier: cannot issue the prefetch of %s (%s)", rid, e)
                self._prefetched(st, False, now)
                continue
            st.prefetch = "inflight"
            self.inflight[rid] = now
            self.counters["prefetches"] += 1
            self._publish(st)
        M.PREFETCH_INFLIGHT.set(len(self.inflight))
        M.PREFETCH_QUEUE.set(len(self.hrrn) if self.policy is None else
                             sum(1 for s in self.reqs.values() if s.prefetch == "queued"))

    def _prefetched(self, st: _Req, ok: bool, now: float) -> None:
        rid = st.request.request_id
        self.inflight.pop(rid, None)
        st.prefetch = "done" if ok else "failed"
        if not ok:
            self.counters["prefetch_failures"] += 1
        M.PREFETCH_WAIT.observe(max(0.0, now - st.arrival))
        st.lookup = self._lookup(st, list(st.request.all_token_ids), pin=False)
        hint = self._publish(st)
        if self.policy is not None:
            self.policy.prefetch_done(rid, now, hint=hint)

    # ------------------------------------------------------------------ vLLM scheduler hooks
    def on_new_request(self, request: Any) -> None:
        st = _Req(request, float(getattr(request, "arrival_time", 0.0) or time.time()))
        self.reqs[request.request_id] = st
        st.lookup = self._lookup(st, list(request.all_token_ids), pin=False, first=True)
        self._publish(st)
        if st.lookup.prefetch_tokens > 0:
            self._enqueue(st)
        self.pump()

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        rid = request.request_id
        st = self.reqs.get(rid)
        if st is None:  # not seen by on_new_request (e.g. created before the connector)
            st = self.reqs[rid] = _Req(request, float(getattr(request, "arrival_time", 0.0) or time.time()))
        st.gpu_tokens = num_computed_tokens
        self.pump()
        if st.prefetch in ("queued", "inflight"):
            self.counters["none_answers"] += 1
            self._publish(st)
            return None, False
        holds = getattr(self.policy, "holds", None)
        if num_computed_tokens == 0 and holds is not None and holds(rid, time.time()):
            self.counters["delay_hit_waits"] += 1  # its prefix is being computed by another request: wait
            return None, False
        tokens = list(request.all_token_ids)
        res = st.lookup = self._lookup(st, tokens, pin=True)
        if res.prefetch_tokens and st.prefetch == "none" and res.hit_end > max(num_computed_tokens, res.host_end):
            self._enqueue(st)  # SSD / shared data would lengthen the hit: wait for it in host memory
            self.pump()
            if st.prefetch in ("queued", "inflight"):
                self.counters["none_answers"] += 1
                return None, False
            res = st.lookup
        st.saved_upto = max(st.saved_upto, res.hit_end // self.chunk * self.chunk)
        self._publish(st)
        hit = res.host_end
        ext = min(hit, request.num_tokens - 1) - num_computed_tokens
        if ext <= 0:
            if res.host_end:
                self._release(rid)
            st.pending_load = None
            return 0, False
        st.pending_load = (num_computed_tokens, hit)
        disk = min(ext, st.prefetch_ssd_tokens) if st.prefetch == "done" else 0
        remote = min(ext - disk, st.prefetch_remote_tokens) if st.prefetch == "done" else 0
        st.sources = {"host": ext - disk - remote, "disk": disk, "remote": remote}
        return ext, False

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict[Any, int]:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        if num_external_tokens <= 0:
            return {}
        st = self.reqs.get(request.request_id)
        src = dict(st.sources) if st is not None and st.sources else {"host": num_external_tokens}
        disk = min(src.get("disk", 0), num_external_tokens)
        remote = min(src.get("remote", 0), num_external_tokens - disk)  # vLLM's name for a remote store
        out = {CacheHitSource.HOST: num_external_tokens - disk - remote, CacheHitSource.DISK: disk,
               CacheHitSource.EXTERNAL_UNSPECIFIED: remote}
        return {k: v for k, v in out.items() if v > 0}

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        st = self.reqs.get(request.request_id)
        if st is None:
            return
        if num_external_tokens > 0 and st.pending_load is not None:
            gpu_cached, load_end = st.pending_load
            block_ids = list(blocks.get_block_ids()[0])
            st.load_spec = LoadSpec(request.request_id, list(request.all_token_ids)[:load_end], block_ids,
                                    gpu_cached, load_end)
            st.saved_upto = max(st.saved_upto, load_end // self.chunk * self.chunk)
            disk = st.sources.get("disk", 0)
            remote = st.sources.get("remote", 0)
            M.HIT_TOKENS.labels("host").inc(num_external_tokens - disk - remote)
            M.HIT_TOKENS.labels("ssd").inc(disk)
            M.HIT_TOKENS.labels("remote").inc(remote)
        self.admitted.append((list(request.prompt_token_ids[:4]), int(num_external_tokens),
                              int(st.sources.get("disk", 0)) if num_external_tokens else 0,
                              int(st.sources.get("remote", 0)) if num_external_tokens else 0))
        st.share = self._shares(st, num_external_tokens)
        M.HIT_TOKENS.labels("gpu").inc(st.gpu_tokens)
        M.HIT_TOKENS.labels("miss").inc(max(0, request.num_tokens - st.gpu_tokens - num_external_tokens))
        M.QUERY_TOKENS.inc(request.num_tokens)
        st.pending_load = None
        self._computing_from(st, max(st.saved_upto, st.gpu_tokens + num_external_tokens))

    def _shares(self, st: _Req, num_external_tokens: int) -> bool:
        """Whether an admitted request's new chunks go to the shared tier (`kvtier.shared.writes`): `all`, `none`,
        or `continuing`: only when it continues an earlier turn (enough of its prompt was cached at arrival:
        the chance of yet another turn grows with the conversation's depth)."""
        opts = self.cfg.shared
        if opts is None or opts.writes == "all":
            return True
        if opts.writes == "none":
            return False
        cached = max(st.lookup.hit_end, st.gpu_tokens + num_external_tokens)
        return cached // self.chunk >= opts.min_history_chunks

    def build_connector_meta(self, so: Any) -> KVTierConnectorMetadata:
        self.pump()
        md = KVTierConnectorMetadata()
        for nr in so.scheduled_new_reqs:
            st = self.reqs.get(nr.req_id)
            if st is None:
                continue
            st.block_ids = list(nr.block_ids[0]) if nr.block_ids else []
            st.computed = int(nr.num_computed_tokens)
            if st.load_spec is not None:
                md.loads.append(replace(st.load_spec, block_ids=list(st.block_ids)))
                st.load_spec = None
        cached = so.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set()) or set()
        for i, rid in enumerate(cached.req_ids):
            st = self.reqs.get(rid)
            if st is None:
                continue
            nb = cached.new_block_ids[i]
            if rid in resumed:
                st.block_ids = list(nb[0]) if nb else []
            elif nb:
                st.block_ids.extend(nb[0])
            st.computed = int(cached.num_computed_tokens[i])
            if st.load_spec is not None:
                md.loads.append(replace(st.load_spec, block_ids=list(st.block_ids)))
                st.load_spec = None
        for rid, n in so.num_scheduled_tokens.items():
            st = self.reqs.get(rid)
            if st is None:
                continue
            toks = st.request.all_token_ids
            kv_end = min(st.computed + int(n), len(toks), len(st.block_ids) * self.block_size)
            save_end = kv_end // self.chunk * self.chunk
            if save_end > st.saved_upto:
                md.saves.append(SaveSpec(rid, list(toks[:save_end]), list(st.block_ids), st.saved_upto, st.share))
                st.saved_upto = save_end
                self._computed_upto(st, save_end)
        md.finished, self.finished = self.finished, []
        return md

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        st = self.reqs.pop(rid, None)
        if st is not None:
            self._computed_upto(st)
        self.hints.pop(rid, None)
        self.hrrn.remove(rid)
        self.inflight.pop(rid, None)
        self.finished.append(FinishedSpec(rid, list(request.all_token_ids), int(request.num_prompt_tokens),
                                          int(request.num_output_tokens), time.time()))
        return False, None

    def snapshot(self) -> dict[str, Any]:
        """Counters of this side and the workers' storage stats, after the workers' queued saves have landed."""
        self.client.call({"op": "flush", "timeout": 60})
        return {"counters": dict(self.counters), "admitted": [list(a) for a in self.admitted],
                "storage": self.client.call({"op": "stats"})[0], "policy": type(self.policy).__name__}

    def close(self) -> None:
        self.client.close()
