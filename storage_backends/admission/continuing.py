"""`continuing`: only the chunks of requests that continue an earlier turn, i.e. at least `min_history_chunks` of
their prompt were cached when they arrived (the chance of yet another turn grows with the conversation's depth).
The shared tier's `writes: continuing` rule, moved here."""

from __future__ import annotations

import logging

from kvtier.storage_backends.admission.base import ADMIT_ALL, REFUSE_ALL, AdmissionQuery, Decision

logger = logging.getLogger(__name__)


class Continuing:
    name = "continuing"
    needs_keys = False

    def __init__(self, min_history_chunks: int = 2) -> None:
        self.min_history_chunks = int(min_history_chunks)

    def decide(self, query: AdmissionQuery) -> Decision:
        return ADMIT_ALL if query.cached_chunks >= self.min_history_chunks else REFUSE_ALL
