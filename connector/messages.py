"""Typed data that crosses the connector's boundaries.

Scheduler -> worker travels inside vLLM's per-step connector metadata (`KVTierConnectorMetadata`, pickled by vLLM
when scheduler and worker are different processes): KV to load (synchronously in the step, or asynchronously: the
request waits in vLLM's WAITING_FOR_REMOTE_KVS state), KV to save (asynchronous by default: each save is a job
whose completion the worker reports back in `KVTierWorkerMetadata`), requests preempted this step (their saves
must finish before their blocks are reused), finished requests whose blocks vLLM keeps until their saves are done,
and finished requests (answer-length feedback for the storage side's eviction policy). Scheduler <-> storage
lookups and prefetch commands travel over the connector's own RPC (`kvtier.connector.rpc`, typed msgspec requests
and replies), whose replies carry `LookupResult` / `PrefetchResult`.

Token ids in these messages are a request's *key tokens* (`RequestIdentity.key_tokens`: multimodal placeholders
replaced by ids of the items) and `tag` its identity tag (cache salt, LoRA adapter, prompt embeddings; "" for
none): the worker derives chunk keys from both and nothing else, so chunks of two requests are the same chunk
exactly when vLLM would share their KV.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass(frozen=True)
class LoadSpec:
    """Load `token_ids[gpu_cached:load_end]`'s KV (host tier, then the SSD stream from `stream_from`) into the
    request's blocks before its forward pass."""

    req_id: str
    token_ids: list[int]  # the first `load_end` tokens of the request (keys are prefix hashes over them)
    block_ids: list[int]  # the request's blocks, in token order
    gpu_cached: int  # tokens already in vLLM's GPU cache (block aligned); left untouched
    load_end: int  # chunk-aligned end of the hit
    #: loaded off the step: the request waits in WAITING_FOR_REMOTE_KVS until the worker reports it finished
    is_async: bool = False
    #: chunk-aligned token where the load stops reading the host tier and streams the rest from the SSD tier
    #: through the worker's bounded staging area (None: the whole load is in the host tier)
    stream_from: int | None = None
    tag: str = ""  # the request's identity tag (keys)


@dataclass(frozen=True)
class SaveSpec:
    """Store the KV of `token_ids[skip:]` (full chunks only) after this step's forward pass."""

    req_id: str
    token_ids: list[int]  # the first `save_end` tokens (a multiple of the chunk size)
    block_ids: list[int]
    skip: int  # chunk-aligned prefix already stored
    #: names the save in `KVTierWorkerMetadata.completed_saves` (unique per engine)
    job_id: int = 0
    share: bool = True  # also write the new chunks to the shared tier (if there is one)
    tag: str = ""  # the request's identity tag (keys)
    #: chunks (index = start token // chunk size) that the SSD tier does not write (`kvtier.ssd_admission`): they
    #: stay in the host tier only
    ssd_refused: tuple[int, ...] = ()


@dataclass(frozen=True)
class FinishedSpec:
    """A finished request: its token chain (the session it extends) and its answer length."""

    req_id: str
    token_ids: list[int]  # prompt + generated tokens
    prompt_tokens: int
    answer_tokens: int
    finished_at: float
    tag: str = ""  # the request's identity tag (keys)


@dataclass
class KVTierConnectorMetadata(KVConnectorMetadata):
    """Everything the worker side does in one engine step."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    finished: list[FinishedSpec] = field(default_factory=list)
    #: preempted this step: their saves in flight finish before this step's forward pass (`handle_preemptions`)
    preempted: list[str] = field(default_factory=list)
    #: finished requests whose blocks vLLM keeps (delay_free_blocks) until the worker reports their saves done
    held: list[str] = field(default_factory=list)
    #: the step schedules no token: the worker may wait (bounded) for kvtier work in flight to end rather than
    #: let the engine spin (`ConnectorOptions.idle_wait_ms`)
    idle: bool = False

    def is_empty(self) -> bool:
        return not (self.loads or self.saves or self.finished or self.preempted or self.held)


@dataclass
class KVTierWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, once per step: save jobs that finished on this rank (or, aggregated over ranks, how
    many ranks finished each). A save counts as done when every rank reported it: its chunks are stored (or the
    store failed: a future miss), and its blocks are no longer read."""

    completed_saves: dict[int, int] = field(default_factory=dict)
    #: finished save jobs that stored fewer chunks than asked (a failed store, no host room): job -> whole chunks
    #: stored from the job's first one (aggregated: the fewest over ranks)
    short_saves: dict[int, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVTierWorkerMetadata:
        if isinstance(other, KVTierWorkerMetadata):
            for job, n in other.completed_saves.items():
                self.completed_saves[job] = self.completed_saves.get(job, 0) + n
            for job, n in other.short_saves.items():
                self.short_saves[job] = min(n, self.short_saves.get(job, n))
        return self


@dataclass(frozen=True)
class LookupResult:
    """Where a token prefix lives in the storage side (one worker rank, or the minimum over ranks).

    Walked chunk by chunk from the first token: `host_end` is the end of the longest prefix that is entirely in
    the host tier; `hit_end` the end of the longest prefix present in host, SSD or the shared tier;
    `ssd_tokens`/`ssd_bytes` count the chunks of `[0, hit_end)` that are only on SSD, `remote_tokens` /
    `remote_bytes` those found only in the shared tier (what a prefetch must read).
    """

    host_end: int = 0
    hit_end: int = 0
    ssd_tokens: int = 0
    ssd_bytes: int = 0
    chunk_size: int = 0
    remote_tokens: int = 0
    remote_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LookupResult:
        return cls(**{k: int(d.get(k, 0)) for k in ("host_end", "hit_end", "ssd_tokens", "ssd_bytes", "chunk_size",
                                                      "remote_tokens", "remote_bytes")})

    @property
    def prefetch_tokens(self) -> int:
        """Tokens a prefetch must bring into host memory (SSD and shared tier)."""
        return self.ssd_tokens + self.remote_tokens

    @staticmethod
    def combine(results: list[LookupResult]) -> LookupResult:
        """The usable prefix over several ranks (each rank holds its own shard of every chunk)."""
        if not results:
            return LookupResult()
        hit = min(r.hit_end for r in results)
        host = min(r.host_end for r in results)
        worst = max(results, key=lambda r: r.ssd_tokens)
        remote = max(results, key=lambda r: r.remote_tokens)
        ssd = min(worst.ssd_tokens, hit)
        remote_tokens = max(0, min(remote.remote_tokens, hit - min(host, hit) - ssd))
        return LookupResult(min(host, hit), hit, ssd, worst.ssd_bytes, results[0].chunk_size, remote_tokens,
                            remote.remote_bytes * remote_tokens // max(1, remote.remote_tokens))


@dataclass(frozen=True)
class PrefetchResult:
    """Outcome of one request's SSD -> host prefetch on one rank."""

    ok: bool
    tokens: int = 0  # tokens whose chunks are now in host memory (pinned for the request)
    nbytes: int = 0
    seconds: float = 0.0
    error: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PrefetchResult:
        return cls(bool(d.get("ok")), int(d.get("tokens", 0)), int(d.get("nbytes", 0)), float(d.get("seconds", 0.0)),
                   str(d.get("error", "")))
