"""The engine walk: a replay of a conversation trace that models, one difference at a time, what the engine's host
tier sees under kvtier's connector (issue 50: why `kvtier replay` and the engine disagree on host hits).

`kvtier replay` walks trace blocks through the host tier one request at a time (`kvtier.replay.runner.simulate`).
The engine differs in the ways `kvtier.replay.engine_model.DIFFERENCES` names; this module models the ones that
can be modelled offline, switched on in steps (`Step`), so that each one's effect on host hits is measured:

- `chunks`: LMCache chunks (`chunk_tokens`, a prefix of whole trace blocks) instead of trace blocks, a request's
  partial last chunk never stored; the engine's capacity in chunks; the serve benchmark's rounds (each round new
  text: new keys, the earlier rounds' chunks still in the tiers). Otherwise the replay's walk
  (`runner.simulate`, the same function).
- `gpu`: vLLM's prefix cache in front (`GpuPrefixCache`): the host tier is looked up only past what the GPU holds.
- `engine`: the connector's calls, through the same `HostPolicyCalls` object the engine's host tier uses: the
  lookup walks chunks from the prompt's first until the first in neither tier; when that reaches past the GPU's
  hit and the host run, the prefetch stages every chunk only the SSD tier holds into the host tier (a `put`), those
  under the GPU's hit too; the load reports the chunks it read as hits, last chunk first, but for those its own
  prefetch staged (`WorkerStorage.after_retrieve`); the save puts
  the chunks past the lookup's hit after the prefill; pins keep a request's chunks from eviction while it loads.
- `concurrency`: requests overlap as under aiperf's fixed concurrency: up to `concurrency` hold their GPU pages at
  once, and a request's answer-length signal arrives when it leaves.

Not modelled (named by `engine_model`): the order in which overlapping requests' saves, prefetches and signals
interleave in time, and the scheduler's load plans (a load the plan recomputes).

Host hit tokens count as the connector's `kvtier_connector_hit_tokens_total{tier="host"}` does: tokens past the
GPU's hit, up to the prompt's last token, less those of the SSD-only chunks, which the connector counts as one run
right past the host run (`scheduler_side`: `disk = overlap(gpu, end, prefetch_from, prefetch_from + ssd_tokens)`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Literal

from kvtier.replay.gpu_prefix_cache import GpuPrefixCache
from kvtier.replay.runner import ReplayClock, build_policy, simulate
from kvtier.replay.traces import TraceRequest
from kvtier.scheduler_hooks.prefix_walk import overlap
from kvtier.storage_backends.eviction.host_calls import BUSY, EVICTABLE, GONE, HostPolicyCalls

Step = Literal["chunks", "gpu", "engine", "concurrency"]
STEPS: tuple[Step, ...] = ("chunks", "gpu", "engine", "concurrency")


@dataclass(frozen=True)
class Turn:
    """One request as the engine receives it: trace blocks already scaled to `block_tokens` tokens each."""

    timestamp: float  #: seconds
    hash_ids: tuple[int, ...]  #: the trace's blocks, in prefix order
    prompt_tokens: int
    answer_tokens: int


@dataclass(frozen=True)
class EngineShape:
    """The engine's sizes (defaults: `benchmarks/serve_eviction.py`'s servers)."""

    host_chunks: int  #: the host tier's capacity in chunks
    block_tokens: int = 32  #: tokens per (scaled) trace block
    chunk_tokens: int = 64  #: LMCache's chunk_size
    page_tokens: int = 32  #: vLLM's block size
    gpu_pages: int = 159  #: vLLM's KV cache, in pages (the benchmark's 160 less vLLM's null page)
    concurrency: int = 4  #: requests in flight under the `concurrency` step
    rounds: int = 3  #: the trace replayed this many times, new keys each time


@dataclass
class RoundHits:
    """One round's tokens, as the connector's counters count them."""

    prompt_tokens: int = 0
    gpu: int = 0
    host: int = 0
    ssd: int = 0
    staged: int = 0  #: chunks prefetches read from the SSD tier into the host tier (`engine` steps)
    staged_under_gpu: int = 0  #: of those, chunks wholly under the GPU's hit: read for nothing


def _chunk_keys(turn: Turn, rnd: int, shape: EngineShape) -> list[Hashable]:
    per = shape.chunk_tokens // shape.block_tokens
    whole = turn.prompt_tokens // shape.chunk_tokens
    return [(rnd, turn.hash_ids[:per * (c + 1)]) for c in range(whole) if per * (c + 1) <= len(turn.hash_ids)]


def _page_keys(turn: Turn, rnd: int, shape: EngineShape) -> list[Hashable]:
    per = shape.page_tokens / shape.block_tokens
    whole = turn.prompt_tokens // shape.page_tokens
    return [(rnd, turn.hash_ids[:max(1, round(per * (p + 1)))]) for p in range(whole)
            if round(per * (p + 1)) <= len(turn.hash_ids)]


def walk(turns: Sequence[Turn], policy: str, shape: EngineShape, step: Step,
         policy_kwargs: dict | None = None) -> list[RoundHits]:
    """Host, SSD and GPU hit tokens per round of `turns` replayed `shape.rounds` times with `policy` in the host
    tier, with the engine's differences up to `step` modelled. The SSD tier is unbounded (the benchmark's is roomy)."""
    if step not in STEPS:
        raise ValueError(f"step {step!r}: choose from {', '.join(STEPS)}")
    if shape.chunk_tokens % shape.block_tokens:
        raise ValueError(f"chunk_tokens {shape.chunk_tokens} is no whole number of {shape.block_tokens}-token blocks")
    if step == "chunks":
        return _replay_walk(turns, policy, shape, policy_kwargs)
    return _engine_walk(turns, policy, shape, STEPS.index(step), policy_kwargs)


def _span(turns: Sequence[Turn]) -> float:
    return (max(t.timestamp for t in turns) - min(t.timestamp for t in turns) + 1.0) if turns else 1.0


def _replay_walk(turns, policy, shape, policy_kwargs) -> list[RoundHits]:
    """`runner.simulate` itself over chunk keys, one request at a time, every chunk accessed head first. Round r is
    scored by replaying rounds 0..r with a fresh policy and `score_from` at round r's start."""
    span = _span(turns)
    t0 = min((t.timestamp for t in turns), default=0.0)
    reqs: list[TraceRequest] = []
    out = []
    for rnd in range(shape.rounds):
        for t in turns:
            keys = tuple(_chunk_keys(t, rnd, shape))
            reqs.append(TraceRequest(len(reqs), t.timestamp + rnd * span, keys,  # type: ignore[arg-type]
                                     t.prompt_tokens, t.answer_tokens, 0, None, 1))
        clock = ReplayClock()
        host = build_policy(policy, clock, shape.host_chunks, **(policy_kwargs or {}))
        c = simulate(reqs, host, shape.host_chunks, clock=clock, score_from=t0 + rnd * span)
        out.append(RoundHits(sum(t.prompt_tokens for t in turns), 0, c["host_hits"] * shape.chunk_tokens,
                             c["ssd_hits"] * shape.chunk_tokens))
    return out


def _engine_walk(turns, policy, shape, level: int, policy_kwargs) -> list[RoundHits]:
    engine, concurrent = level >= STEPS.index("engine"), level >= STEPS.index("concurrency")
    span = _span(turns)
    clock = ReplayClock()
    calls = HostPolicyCalls(build_policy(policy, clock, shape.host_chunks, **(policy_kwargs or {})))
    gpu = GpuPrefixCache(shape.gpu_pages, shape.page_tokens)
    host: set[Hashable] = set()  # what the host tier holds (LMCache's dict; the policy keeps the order)
    ssd: set[Hashable] = set()
    pinned: set[Hashable] = set()
    flight: deque[tuple[int, list[Hashable], int]] = deque()  # (request id, chunk keys, answer tokens)
    width = shape.concurrency if concurrent else 1
    out = []

    def state(k: Hashable) -> str:
        return GONE if k not in host else BUSY if k in pinned else EVICTABLE

    def put(k: Hashable) -> None:
        if k in host:
            calls.put(k)
            return
        while len(host) >= shape.host_chunks:
            victims = calls.evict_candidates(1, state)  # type: ignore[arg-type]
            if not victims:
                return  # nothing evictable: LMCache's store of this chunk fails (the save skips it)
            host.discard(victims[0])
        host.add(k)
        calls.put(k)

    def finish() -> None:
        rid, keys, answer = flight.popleft()
        gpu.finish(rid)
        calls.on_request_finished(keys, answer, clock.now)

    rid = 0
    for rnd in range(shape.rounds):
        hits = RoundHits()
        for t in turns:
            clock.now = t.timestamp + rnd * span
            if len(flight) >= width:
                finish()
            keys = _chunk_keys(t, rnd, shape)
            hits.prompt_tokens += t.prompt_tokens
            calls.on_request(keys, clock.now)
            pages = _page_keys(t, rnd, shape)
            g = gpu.hit_tokens(pages, t.prompt_tokens)
            if engine:
                h = _lookup_and_load(keys, t, g, shape, calls, host, ssd, pinned, put, hits)
            else:
                h = _walk_every_chunk(keys, t, g, shape, calls, host, ssd, put, hits)
            gpu.start(rid, pages, t.prompt_tokens, t.prompt_tokens + t.answer_tokens)
            hits.gpu += g
            for k in keys[h:]:  # the save: the chunks past the lookup's hit
                put(k)
                ssd.add(k)
            flight.append((rid, keys, t.answer_tokens))
            if not concurrent:
                finish()
            rid += 1
        out.append(hits)
    while flight:
        finish()
    return out


def _walk_every_chunk(keys, t: Turn, g: int, shape: EngineShape, calls: HostPolicyCalls, host: set, ssd: set,
                      put: Callable[[Hashable], None], hits: RoundHits) -> int:
    """The replay's walk past the GPU's hit: each chunk past it accessed head first (a host hit, else an SSD hit
    copied into the host tier); returns the chunks found in a tier, from the head, without a gap."""
    c = shape.chunk_tokens
    end = t.prompt_tokens - 1
    found = 0
    for i, k in enumerate(keys):
        if k not in host and k not in ssd:
            break
        found = i + 1
        span = overlap(i * c, (i + 1) * c, g, end)
        if not span:
            continue
        if k in host:
            hits.host += span
            calls.hit(k)
        else:
            hits.ssd += span
            put(k)
    return found


def _lookup_and_load(keys, t: Turn, g: int, shape: EngineShape, calls: HostPolicyCalls, host: set, ssd: set,
                     pinned: set, put: Callable[[Hashable], None], hits: RoundHits) -> int:
    """The connector's lookup, prefetch and load for one request; returns the chunks of its hit (the save starts
    past them)."""
    c = shape.chunk_tokens
    host_run = 0  # the lookup walks from the prompt's first chunk, whatever the GPU holds
    while host_run < len(keys) and keys[host_run] in host:
        host_run += 1
    found = host_run
    ssd_only: list[int] = []  # positions of the chunks only the SSD tier holds
    while found < len(keys) and (keys[found] in host or keys[found] in ssd):
        if keys[found] not in host:
            ssd_only.append(found)
        found += 1
    end = min(found * c, t.prompt_tokens - 1)
    if end <= g:
        return found
    pinned.update(keys[:found])
    try:
        first = g // c
        staged: set[Hashable] = set()
        if found * c > max(g, host_run * c) and ssd_only:
            # the prefetch reads every chunk only the SSD tier holds, from the first (those the GPU holds too)
            staged = {keys[i] for i in ssd_only}
            for i in ssd_only:
                put(keys[i])
            hits.staged += len(ssd_only)
            hits.staged_under_gpu += sum(i < first for i in ssd_only)
        # the connector's count: the SSD tokens as one run right past the host run
        disk = overlap(g, end, host_run * c, (host_run + len(ssd_only)) * c)
        hits.ssd += disk
        hits.host += end - g - disk
        last = -(-end // c)
        for k in reversed(keys[first:last]):  # the load's report: last chunk first, not what it staged
            if k in host and k not in staged:
                calls.hit(k)
    finally:
        pinned.clear()
    return found
