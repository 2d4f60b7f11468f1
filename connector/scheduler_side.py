"""The connector's scheduler side: tier hints, eager SSD prefetch in disk-HRRN order, load/save planning.

- `on_new_request`: looks the prompt up across tiers (RPC to the worker ranks), publishes a `TierHint`
  (`tier_hint(request_id)`) and, when part of the prefix is only on SSD or only in the shared tier (state REMOTE),
  queues a prefetch into host memory.
- Prefetches are issued at most `prefetch_concurrency` at a time, in disk-HRRN order (the scheduling policy's
  `next_prefetch` when kvtier's dual-queue scheduler hands its policy over, else a local `DiskHRRNQueue`).
- `get_num_new_matched_tokens` answers `None` while the request's SSD data is being prefetched (the request waits
  without GPU blocks; others run), then the host-resident prefix (chunk-aligned) beyond vLLM's own cache hit:
  `(n, False)` (loaded inside the step, before its forward pass) while the step's `sync_load_budget_tokens` has
  room for it, else `(n, True)` (the request waits in WAITING_FOR_REMOTE_KVS holding its blocks while the worker
  loads it off the step).
- Load or recompute: with kvtier's dual-queue scheduler the hints carry the policy planner's `LoadPlan`
  (`derive_tier_hint(..., planner=policy.planner)`; re-planned when the request's residency or prefetch phase
  changes, not every step). An SSD part the plan recomputes is not prefetched and only the host prefix is
  matched; on a step where nothing runs or is admitted, `policy.replan_idle` may recompute the SSD part of a
  request still waiting for its read. Prefetch byte counts and durations calibrate the planner's SSD bandwidth.
- `build_connector_meta` turns admitted loads, newly completed chunks (save jobs, numbered), requests preempted
  this step, finished requests whose blocks are held, and finished requests (answer length and token chain) into
  the step's `KVTierConnectorMetadata`, marked `idle` when the step schedules no token (the worker then waits,
  bounded, for its transfers instead of letting the engine spin). `update_connector_output` collects the save jobs
  the workers finished.
- `request_finished` keeps a finished request's blocks (delay_free_blocks) while one of its saves is not done;
  the worker reports it in `finished_sending` once they are.
- Hints count `inflight_tokens`: an admitted request's prompt chunks are *computing* until their save is done; a
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

from kvtier.compat.vllm_hit_sources import hit_source_labels
from kvtier.connector import metrics as M
from kvtier.connector.config import ConnectorConfig
from kvtier.connector.messages import (
    FinishedSpec,
    KVTierConnectorMetadata,
    KVTierWorkerMetadata,
    LoadSpec,
    LookupResult,
    PrefetchResult,
    SaveSpec,
)
from kvtier.connector.rpc import RPCClient, RPCError, endpoint
from kvtier.scheduler_hooks.hint_derivation import count_inflight, derive_tier_hint
from kvtier.scheduler_hooks.hrrn import DiskHRRNQueue
from kvtier.scheduler_hooks.load_plan import LoadAction, LoadPlan, PlanContext
from kvtier.scheduler_hooks.tier_hint import TierHint

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
    pending_saves: set[int] = field(default_factory=set)  # save jobs issued and not reported done by every rank
    loading: bool = False  # an asynchronous load is in flight (vLLM frees its blocks when it ends)
    recompute_ssd: bool = False  # its SSD part is recomputed (re-planned at an idle GPU)
    plan_key: tuple | None = None  # what `plan` was made from
    async_answer: bool = False  # the last get_num_new_matched_tokens answered "load asynchronously"
    #: admitted with an asynchronous load: vLLM allocates for it once more (0 external tokens) when it resumes
    reallocating: bool = False
    plan: LoadPlan | None = None


class _FixedPlan:
    """Hands `derive_tier_hint` a plan already made (a re-derived hint whose inputs did not change keeps its
    decision instead of counting a new one)."""

    __slots__ = ("_plan",)

    def __init__(self, plan: LoadPlan) -> None:
        self._plan = plan

    def plan(self, **_: Any) -> LoadPlan:
        return self._plan


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
                         "delay_hit_waits": 0, "async_loads": 0, "sync_loads": 0, "delayed_frees": 0,
                         "plan_recompute_ssd": 0, "idle_replans": 0, "ssd_observations": 0,
                         "steps_during_async_loads": 0, "tokens_during_async_loads": 0, "idle_steps": 0}
        self.world = world
        #: save job -> (request, end of the chunks it stores, ranks that reported it done)
        self._save_jobs: dict[int, list] = {}
        self._job_seq = 0
        self._async_loads: list[LoadSpec] = []  # allocated this step, go out with the next metadata
        #: the GPU's busy seconds (time from a step that scheduled tokens to the next step), for the policy's
        #: idle-GPU re-plan (`DualQueuePolicy.observe_gpu_busy`)
        self._busy_s = 0.0
        self._step_t: float | None = None
        self._step_busy = False
        self._held_new: list[str] = []  # delay-freed since the last metadata
        self._held: set[str] = set()  # delay-freed, not reported in finished_sending yet
        self._sync_budget_used = 0  # tokens answered "load inside the step" since the last metadata

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
        keys = self._keys(st)[-(-resident // self.chunk):]
        return count_inflight(((self.computing.get(k), self.chunk) for k in keys), st.request.request_id)

    def _computing_from(self, st: _Req, start: int) -> None:
        """`st` (admitted) computes its prompt chunks from token `start` on: other requests sharing them wait."""
        rid = st.request.request_id
        for key in self._keys(st)[start // self.chunk:]:
            self.computing.setdefault(key, rid)

    def _computed_upto(self, st: _Req, end: int | None = None, start: int = 0) -> None:
        """`st`'s prompt chunks in tokens [start, end) (to the end if None) are saved or abandoned."""
        rid = st.request.request_id
        keys = self._keys(st)
        for key in keys[start // self.chunk:len(keys) if end is None else end // self.chunk]:
            if self.computing.get(key) == rid:
                del self.computing[key]

    def _planner(self) -> Any:
        return getattr(self.policy, "planner", None)

    def _residency(self, st: _Req) -> LookupResult:
        """The lookup the hint is derived from: without its SSD part once that is to be recomputed."""
        r = st.lookup
        if st.recompute_ssd and r.ssd_tokens:
            return LookupResult(r.host_end, r.host_end, 0, 0, r.chunk_size)
        return r

    def _plan_context(self, rid: str) -> PlanContext:
        """What the policy knows of the engine: ready work queued ahead (the GPU wait; vLLM's running requests are
        not counted) and SSD reads queued ahead."""
        pol, planner = self.policy, self._planner()
        ssd_ahead = pol.ssd_backlog_bytes(rid) if hasattr(pol, "ssd_backlog_bytes") else 0
        estimate = getattr(pol, "gpu_wait_estimate", None)
        return PlanContext(gpu_wait_s=pol.gpu_backlog_s(rid) if hasattr(pol, "gpu_backlog_s") else 0.0,
                           gpu_wait_fn=(lambda service: estimate(service, rid)) if estimate is not None else None,
                           ssd_wait_s=ssd_ahead / planner.cost.ssd_read_bytes_per_s)

    def _publish(self, st: _Req) -> TierHint:
        rid = st.request.request_id
        res = self._residency(st)
        planner = self._planner()
        plan_src = None
        if planner is not None:
            # the SSD read's phase matters to the plan only once it has landed (or failed)
            landed = st.prefetch in ("done", "failed")
            key = (st.gpu_tokens, res, landed)
            plan_src = _FixedPlan(st.plan) if key == st.plan_key and st.plan is not None else planner
            st.plan_key = key
        hint = derive_tier_hint(rid, st.arrival, gpu_tokens=st.gpu_tokens, residency=res,
                                prefetch="none" if st.recompute_ssd else st.prefetch,
                                prompt_tokens=int(st.request.num_prompt_tokens), planner=plan_src,
                                context=self._plan_context(rid) if plan_src is planner and planner is not None
                                else None)
        st.plan = hint.plan
        self.hints[rid] = hint
        if hint.plan is not None and hint.plan.ssd is LoadAction.RECOMPUTE and st.prefetch == "queued":
            st.prefetch = "none"  # no longer worth its read
            self.hrrn.remove(rid)
        return hint

    def _wants_prefetch(self, st: _Req, hint: TierHint) -> bool:
        """Whether the request should wait for a prefetch into host memory rather than recompute: for a part only
        in the shared tier always (the load plan does not model the shared tier: such a hint carries no plan), for
        an SSD part when the plan says so."""
        if st.recompute_ssd:
            return False
        if st.lookup.remote_tokens > 0:
            return True
        return st.lookup.ssd_tokens > 0 and (hint.plan is None or hint.plan.waits_for_ssd)

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
        planner = self._planner()
        reads = [r for r in st.partial.values() if r.ok and r.nbytes > 0 and r.seconds > 0]
        if ok and planner is not None and reads:  # the slowest rank decides when the request can run
            slowest = max(reads, key=lambda r: r.seconds)
            planner.observe_ssd_read(slowest.nbytes, slowest.seconds)
            self.counters["ssd_observations"] += 1
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
        hint = self._publish(st)
        if self._wants_prefetch(st, hint):
            self._enqueue(st)
        elif st.lookup.ssd_tokens > 0:
            self.counters["plan_recompute_ssd"] += 1
        self.pump()

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        rid = request.request_id
        st = self.reqs.get(rid)
        if st is None:  # not seen by on_new_request (e.g. created before the connector)
            st = self.reqs[rid] = _Req(request, float(getattr(request, "arrival_time", 0.0) or time.time()))
        st.gpu_tokens = num_computed_tokens
        self.pump()
        if st.prefetch in ("queued", "inflight") and not st.recompute_ssd:
            self.counters["none_answers"] += 1
            self._publish(st)
            return None, False
        holds = getattr(self.policy, "holds", None)
        if num_computed_tokens == 0 and holds is not None and holds(rid, time.time()):
            self.counters["delay_hit_waits"] += 1  # its prefix is being computed by another request: wait
            return None, False
        tokens = list(request.all_token_ids)
        res = st.lookup = self._lookup(st, tokens, pin=True)
        hint = self._publish(st)
        if res.hit_end > max(num_computed_tokens, res.host_end) and st.prefetch == "none":
            if self._wants_prefetch(st, hint):
                self._enqueue(st)  # SSD / shared data would lengthen the hit: wait for it in host memory
                self.pump()
                if st.prefetch in ("queued", "inflight"):
                    self.counters["none_answers"] += 1
                    return None, False
                res = st.lookup
                hint = self.hints[rid]
            elif res.ssd_tokens and not st.recompute_ssd:
                self.counters["plan_recompute_ssd"] += 1
        st.saved_upto = max(st.saved_upto, res.hit_end // self.chunk * self.chunk)
        plan = hint.plan
        hit = 0 if plan is not None and plan.host is LoadAction.RECOMPUTE else res.host_end
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
        # Loads that fit in the step's synchronous budget run inside the step; the others off it.
        sync = ext <= self.cfg.options.sync_load_budget_tokens - self._sync_budget_used
        if sync:
            self._sync_budget_used += ext
        st.async_answer = not sync
        return ext, not sync

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict[Any, int]:
        """The host/SSD split of an admission's external hits, under vLLM's labels (vLLM >= 0.32 asks; 0.31
        never does and has no labels: `kvtier.compat.vllm_hit_sources`)."""
        labels = hit_source_labels()
        if num_external_tokens <= 0 or labels is None:
            return {}
        st = self.reqs.get(request.request_id)
        src = dict(st.sources) if st is not None and st.sources else {"host": num_external_tokens}
        disk = min(src.get("disk", 0), num_external_tokens)
        remote = min(src.get("remote", 0), num_external_tokens - disk)  # vLLM's name for a remote store
        out = {labels.host: num_external_tokens - disk - remote, labels.disk: disk, labels.remote: remote}
        return {k: v for k, v in out.items() if v > 0}

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        st = self.reqs.get(request.request_id)
        if st is None:
            return
        if st.reallocating:
            st.reallocating = False
            if num_external_tokens == 0:  # resumed after its asynchronous load: admitted (and counted) already
                return
        if num_external_tokens > 0 and st.pending_load is not None:
            gpu_cached, load_end = st.pending_load
            block_ids = list(blocks.get_block_ids()[0])
            # vLLM keeps an asynchronous answer asynchronous unless it drops the external hit altogether
            is_async = st.async_answer
            if len(block_ids) * self.block_size < load_end:  # vLLM trimmed the hit: load what it expects
                load_end = gpu_cached + num_external_tokens
            spec = LoadSpec(request.request_id, list(request.all_token_ids)[:load_end], block_ids, gpu_cached,
                            load_end, is_async=is_async)
            if is_async:  # vLLM parks the request (WAITING_FOR_REMOTE_KVS): its blocks are final now
                self._async_loads.append(spec)
                st.loading = st.reallocating = True
                self.counters["async_loads"] += 1
            else:
                st.load_spec = spec
                self.counters["sync_loads"] += 1
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
        self._observe_busy(bool(so.num_scheduled_tokens))
        md = KVTierConnectorMetadata()
        # steps that run while an asynchronous load issued by an earlier step is still in flight (this step's own
        # new loads start after its forward pass), and the tokens they compute for other requests
        fresh = {spec.req_id for spec in self._async_loads}
        loading = {rid for rid, st in self.reqs.items() if st.loading and rid not in fresh}
        M.ENGINE_STEPS.labels("all").inc()
        if loading:
            M.ENGINE_STEPS.labels("during_async_load").inc()
            self.counters["steps_during_async_loads"] += 1
            self.counters["tokens_during_async_loads"] += sum(
                int(n) for rid, n in so.num_scheduled_tokens.items() if rid not in loading)
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
                self._job_seq += 1
                job = self._job_seq
                md.saves.append(SaveSpec(rid, list(toks[:save_end]), list(st.block_ids), st.saved_upto, job_id=job,
                                          share=st.share))
                self._save_jobs[job] = [st, st.saved_upto, save_end, 0]
                st.pending_saves.add(job)
                st.saved_upto = save_end
        for rid in getattr(so, "preempted_req_ids", None) or ():
            md.preempted.append(rid)  # the worker finishes their saves before this step's forward pass
            st = self.reqs.get(rid)
            if st is not None:
                st.pending_saves.clear()
        md.loads.extend(self._async_loads)
        self._async_loads = []
        md.held, self._held_new = self._held_new, []
        md.finished, self.finished = self.finished, []
        self._sync_budget_used = 0
        if not so.num_scheduled_tokens:
            md.idle = True  # the worker waits (bounded) for its loads, prefetches or saves rather than spin
            self.counters["idle_steps"] += 1
            M.ENGINE_STEPS.labels("idle").inc()
            self._replan_idle()
        return md

    def update_connector_output(self, output: Any) -> None:
        """The workers' report of a step: save jobs done (on every rank: their chunks landed, so requests waiting
        for them stop counting them in flight), asynchronous loads ended, held requests freed."""
        meta = getattr(output, "kv_connector_worker_meta", None)
        if isinstance(meta, KVTierWorkerMetadata):
            for job, n in meta.completed_saves.items():
                rec = self._save_jobs.get(job)
                if rec is None:
                    continue
                rec[3] += n
                if rec[3] >= self.world:
                    del self._save_jobs[job]
                    st = rec[0]
                    st.pending_saves.discard(job)
                    self._computed_upto(st, rec[2])
        for rid in getattr(output, "finished_recving", None) or ():
            st = self.reqs.get(rid)
            if st is not None:
                st.loading = False
        for rid in getattr(output, "finished_sending", None) or ():
            self._held.discard(rid)

    def has_pending_block_frees(self) -> bool:
        """Blocks of finished requests come back once their saves are done: vLLM waits for them rather than
        preempting a running request."""
        return bool(self._held)

    # ------------------------------------------------------------------ load or recompute at an idle GPU
    def _observe_busy(self, busy: bool) -> None:
        """One scheduler step: the time since the previous one was busy if that one scheduled tokens; the total
        goes to the policy (its recent busy share is the load the idle-GPU re-plan charges a recompute with)."""
        now = time.monotonic()
        if self._step_t is not None and self._step_busy:
            self._busy_s += now - self._step_t
        self._step_t, self._step_busy = now, busy
        observe = getattr(self.policy, "observe_gpu_busy", None)
        if observe is not None:
            observe(now, self._busy_s)

    def _read_s(self, hint: TierHint) -> float:
        """Seconds until `hint`'s SSD part is in host memory, at best: its read's remainder if issued, else the
        reads in flight and its own."""
        bw = self._planner().cost.ssd_read_bytes_per_s
        now = time.time()
        issued = self.inflight.get(hint.request_id)
        if issued is not None:
            return max(hint.ssd_bytes / bw - (now - issued), 0.0)
        ahead = sum(h.ssd_bytes for r in self.inflight if (h := self.hints.get(r)) is not None)
        return (ahead + hint.ssd_bytes) / bw

    def _replan_idle(self) -> None:
        """Nothing ran or was admitted this step: let the policy recompute the SSD part of a request whose read has
        not landed, where that gives an earlier first token (its read, if issued, still lands in host memory)."""
        replan = getattr(self.policy, "replan_idle", None)
        if replan is None or self._planner() is None:
            return
        if not any(st.prefetch in ("queued", "inflight") and not st.recompute_ssd for st in self.reqs.values()):
            return
        rid = replan(self._read_s)
        st = self.reqs.get(rid) if rid is not None else None
        if st is None:
            return
        st.recompute_ssd = True
        if st.prefetch == "queued":
            st.prefetch = "none"
            self.hrrn.remove(rid)
        self.counters["idle_replans"] += 1
        self.policy.update(self._publish(st))

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """A finished request keeps its blocks (delay_free_blocks) while one of its saves is not done; the worker
        reports it in finished_sending when they are. Never for a request whose asynchronous load is in flight:
        vLLM frees those blocks itself when the load ends."""
        rid = request.request_id
        st = self.reqs.pop(rid, None)
        delay = False
        if st is not None:
            delay = bool(st.pending_saves) and not st.loading
            # chunks no pending save covers will never land: nobody waits for them any more
            pending_end = max((self._save_jobs[j][2] for j in st.pending_saves if j in self._save_jobs), default=0)
            self._computed_upto(st, None, start=pending_end)
        self.hints.pop(rid, None)
        self.hrrn.remove(rid)
        self.inflight.pop(rid, None)
        self.finished.append(FinishedSpec(rid, list(request.all_token_ids), int(request.num_prompt_tokens),
                                          int(request.num_output_tokens), time.time()))
        if delay:
            self._held_new.append(rid)
            self._held.add(rid)
            self.counters["delayed_frees"] += 1
            M.DELAYED_FREES.inc()
        return delay, None

    def snapshot(self) -> dict[str, Any]:
        """Counters of this side and the workers' storage stats, after the workers' queued saves have landed."""
        self.client.call({"op": "flush", "timeout": 60})
        return {"counters": dict(self.counters), "admitted": [list(a) for a in self.admitted],
                "storage": self.client.call({"op": "stats"})[0], "policy": type(self.policy).__name__}

    def close(self) -> None:
        self.client.close()
