"""The scheduler side's lost-hit accounting: feeds `kvtier.telemetry.lost_hits.LostHitLedger` from the connector's
events (pages computed, save jobs issued and reported, admissions, finished requests) and counts each admitted
request's reuse against the limit in `/metrics` (`kvtier_connector_ideal_hit_tokens_total`,
`kvtier_connector_lost_hit_tokens_total{reason}`, `kvtier_connector_beyond_ideal_hit_tokens_total`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from kvtier.connector import metrics as M
from kvtier.connector.messages import KVTierWorkerMetadata
from kvtier.connector.scheduler_state import RequestState
from kvtier.telemetry.lost_hits import REASONS, LostHitLedger


class LostHitFeed:
    def __init__(self, page: int, chunk: int) -> None:
        self.ledger = LostHitLedger(page, chunk)
        self._short: dict[int, int] = {}  # save job -> fewest chunks a rank stored, until every rank reported

    def computed(self, st: RequestState, tokens: Sequence[int], kv_end: int) -> None:
        """`st`'s KV is computed (or loaded) up to token `kv_end` (`tokens`: its tokens so far)."""
        if self.ledger.joins(st.rid, kv_end):
            self.ledger.computed(st.rid, st.tag, st.key_tokens(tokens[:kv_end]), kv_end)

    def save_issued(self, job: int, st: RequestState, key_tokens: Sequence[int], start: int, end: int) -> None:
        self.ledger.save_issued(job, st.rid, st.tag, key_tokens, start, end)

    def reported(self, meta: KVTierWorkerMetadata) -> None:
        """A step's worker report: remember the saves some rank stored only in part."""
        for job, n in meta.short_saves.items():
            self._short[job] = min(n, self._short.get(job, n))

    def save_done(self, job: int) -> None:
        """Every rank reported save job `job`."""
        self.ledger.save_done(job, self._short.pop(job, None))

    def admitted(self, st: RequestState, num_external_tokens: int, allocated_tokens: int) -> None:
        """`st` is admitted (first time) with vLLM's `st.gpu_tokens` and `num_external_tokens` from kvtier, into
        blocks for `allocated_tokens`. Its full pages there join the limit at once, as vLLM caches a block when it
        allocates it: a request admitted later in the same step finds them."""
        request: Any = st.request
        key_tokens = st.key_tokens()
        acc = self.ledger.admitted(st.rid, st.tag, key_tokens, int(request.num_tokens),
                                   st.gpu_tokens + int(num_external_tokens), st.lookup.hit_end)
        self.ledger.computed(st.rid, st.tag, key_tokens, min(int(request.num_tokens), allocated_tokens))
        M.IDEAL_HIT_TOKENS.inc(acc.ideal)
        M.BEYOND_IDEAL_HIT_TOKENS.inc(acc.beyond_ideal)
        for reason, n in acc.reasons().items():
            M.LOST_HIT_TOKENS.labels(reason).inc(n)

    def forget(self, rid: str) -> None:
        self.ledger.forget(rid)

    def snapshot(self) -> dict[str, Any]:
        """Totals (tokens: ideal, hit, beyond_ideal and each reason) and the recent requests' accounts."""
        return {"totals": {k: int(self.ledger.totals[k]) for k in ("ideal", "hit", "beyond_ideal", *REASONS)},
                "requests": {rid: asdict(a) for rid, a in self.ledger.recent.items()}}
