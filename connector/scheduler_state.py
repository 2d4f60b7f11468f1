"""What the connector's scheduler side keeps per request and per engine, apart from its decisions.

- `RequestState`: one waiting or running request as the scheduler side sees it (its identity, lookup, prefetch
  phase, plan, blocks, what is saved and what is being loaded).
- `ComputingChunks`: the prompt chunks admitted requests are computing right now (not yet saved); a waiting
  request whose prefix continues into them counts them in flight (`TierHint.inflight_tokens`: Strata's delay hit).
- `SaveJobs`: save jobs sent to the worker ranks and not yet reported done by every rank, and the finished
  requests whose blocks vLLM keeps until theirs are (delay_free_blocks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvtier.connector.messages import LoadSpec, LookupResult, PrefetchResult
from kvtier.identity.request import RequestIdentity
from kvtier.scheduler_hooks.hint_derivation import count_inflight
from kvtier.scheduler_hooks.load_plan import LoadPlan
from kvtier.storage_backends.admission.base import Decision

__all__ = ["ComputingChunks", "FixedPlan", "RequestState", "SaveJobs", "prefix_chunk_keys"]


@dataclass
class RequestState:
    request: Any  # vLLM's Request
    arrival: float
    #: what its chunk keys are derived from besides its tokens (None: its identity could not be read; the request
    #: then neither reads nor writes kvtier's tiers)
    identity: RequestIdentity | None = field(default_factory=RequestIdentity)
    lookup: LookupResult = field(default_factory=LookupResult)
    gpu_tokens: int = 0
    prefetch: str = "none"  # none | queued | inflight | done | failed
    prefetch_from: int = 0  # end of the host-resident prefix when the prefetch was queued
    prefetch_ssd_tokens: int = 0  # tokens that were only on SSD when the prefetch was queued
    prefetch_remote_tokens: int = 0  # tokens that were only in the shared tier then
    share: bool = True  # its saved chunks go to the shared tier too (`kvtier.shared.writes`)
    #: which of its chunks the SSD tier writes (`kvtier.ssd_admission`; None: not decided yet, all are written)
    ssd_admission: Decision | None = None
    partial: dict[int, PrefetchResult] = field(default_factory=dict)  # rank -> its prefetch's outcome
    #: (gpu_cached, load_end, stream_from) between lookup and allocation; stream_from: where the SSD stream takes
    #: over from the host tier (None: the whole load is host-resident)
    pending_load: tuple[int, int, int | None] | None = None
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
    accounted: bool = False  # its admission went into the lost-hit ledger (once, not again when resumed)

    @property
    def rid(self) -> str:
        return self.request.request_id

    @property
    def tag(self) -> str:
        return self.identity.tag if self.identity is not None else ""

    def key_tokens(self, tokens: Any = None) -> list[int]:
        """The key tokens of `tokens` (default: all of the request's tokens so far)."""
        toks = self.request.all_token_ids if tokens is None else tokens
        return self.identity.key_tokens(toks) if self.identity is not None else list(toks)


class FixedPlan:
    """Hands `derive_tier_hint` a plan already made (a re-derived hint whose inputs did not change keeps its
    decision instead of counting a new one)."""

    __slots__ = ("_plan",)

    def __init__(self, plan: LoadPlan) -> None:
        self._plan = plan

    def plan(self, **_: Any) -> LoadPlan:
        return self._plan


def prefix_chunk_keys(tokens: Any, chunk: int, tag: str = "") -> list[int]:
    """A key per full chunk of `tokens` (key tokens), naming the whole prefix up to that chunk's end and the
    request's identity `tag` (chained hashes): two prompts share key i exactly when (up to hash collisions,
    harmless in a scheduling hint) they share their first (i + 1) * chunk key tokens and their tag, so a request
    never waits for chunks another tenant computes."""
    keys, h = [], hash(tag) if tag else 0
    for i in range(len(tokens) // chunk):
        h = hash((h, tuple(tokens[i * chunk:(i + 1) * chunk])))
        keys.append(h)
    return keys


class ComputingChunks:
    """Prompt chunks that admitted requests are computing right now (not yet saved): chunk key -> request."""

    def __init__(self, chunk: int) -> None:
        self.chunk = chunk
        self.owner: dict[int, str] = {}

    def __bool__(self) -> bool:
        return bool(self.owner)

    def keys(self, st: RequestState) -> list[int]:
        if st.chunk_keys is None:
            st.chunk_keys = (prefix_chunk_keys(st.key_tokens(st.request.prompt_token_ids), self.chunk, st.tag)
                             if st.identity is not None else [])
        return st.chunk_keys

    def inflight_tokens(self, st: RequestState, resident: int) -> int:
        """Tokens of `st`'s prompt past its `resident` prefix that another admitted request is computing."""
        if not self.owner:
            return 0
        keys = self.keys(st)[-(-resident // self.chunk):]
        return count_inflight(((self.owner.get(k), self.chunk) for k in keys), st.rid)

    def start(self, st: RequestState, start: int) -> None:
        """`st` (admitted) computes its prompt chunks from token `start` on: other requests sharing them wait."""
        rid = st.rid
        for key in self.keys(st)[start // self.chunk:]:
            self.owner.setdefault(key, rid)

    def done(self, st: RequestState, end: int | None = None, start: int = 0) -> None:
        """`st`'s prompt chunks in tokens [start, end) (to the end if None) are saved or abandoned."""
        rid = st.rid
        keys = self.keys(st)
        for key in keys[start // self.chunk:len(keys) if end is None else end // self.chunk]:
            if self.owner.get(key) == rid:
                del self.owner[key]


class SaveJobs:
    """Save jobs sent to the worker ranks (numbered per engine) until every rank reported them done, and the
    finished requests whose blocks vLLM keeps until their saves are done."""

    def __init__(self, world: int) -> None:
        self.world = world
        #: save job -> [request, start, end of the chunks it stores, ranks that reported it done]
        self._jobs: dict[int, list[Any]] = {}
        self._seq = 0
        self._held_new: list[str] = []  # delay-freed since the last metadata
        self._held: set[str] = set()  # delay-freed, not reported in finished_sending yet

    def issue(self, st: RequestState, start: int, end: int) -> int:
        """A new save job for `st`'s chunks in tokens [start, end); returns its number."""
        self._seq += 1
        job = self._seq
        self._jobs[job] = [st, start, end, 0]
        st.pending_saves.add(job)
        return job

    def report(self, completed: dict[int, int]) -> list[tuple[int, RequestState, int]]:
        """Ranks' reports of finished jobs (job -> ranks); returns (job, request, end) of each job now done on
        every rank, in report order."""
        done = []
        for job, n in completed.items():
            rec = self._jobs.get(job)
            if rec is None:
                continue
            rec[3] += n
            if rec[3] >= self.world:
                del self._jobs[job]
                st = rec[0]
                st.pending_saves.discard(job)
                done.append((job, st, rec[2]))
        return done

    def pending_end(self, st: RequestState) -> int:
        """The end of the chunks `st`'s pending saves store (0: none pending)."""
        return max((self._jobs[j][2] for j in st.pending_saves if j in self._jobs), default=0)

    def hold(self, rid: str) -> None:
        """A finished request keeps its blocks until its saves are done."""
        self._held_new.append(rid)
        self._held.add(rid)

    def take_new_held(self) -> list[str]:
        """Requests held since the last call (they go out with the next metadata)."""
        out, self._held_new = self._held_new, []
        return out

    def released(self, rid: str) -> None:
        """The workers reported the request's saves done (finished_sending): vLLM frees its blocks."""
        self._held.discard(rid)

    def holding(self) -> bool:
        return bool(self._held)
