"""`second-sight`: a doorkeeper (TinyLFU's, vLLM offloading's `store_threshold=2`, Dynamo KVBM's disk tier): a
chunk is written only the second time it is seen. It remembers the prompt chunk keys of recent requests in a
bounded ghost set (keys only, no data; the oldest are forgotten first). At a request's arrival:

- a prompt chunk whose key is in the ghost set was seen before: written (a prefix computed again after it left
  every tier, or a prefix that several conversations share);
- when at least `min_seen_chunks` of its prompt's chunks were seen before, the request continues something seen
  (a conversation's next turn): all its chunks are written, its answer's too;
- otherwise (a first sight) nothing is written; its prompt keys enter the ghost set, so the next turn writes.

Unlike `continuing` the verdict does not depend on what the tiers still hold: a conversation whose earlier turns
were evicted still counts as seen while its keys are in the ghost set.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Hashable

from kvtier.storage_backends.admission.base import ADMIT_ALL, AdmissionQuery, Decision

logger = logging.getLogger(__name__)


class SecondSight:
    name = "second-sight"
    needs_keys = True

    def __init__(self, ghost_chunks: int = 65536, min_seen_chunks: int = 1) -> None:
        self.capacity = int(ghost_chunks)
        self.min_seen_chunks = int(min_seen_chunks)
        self._ghost: OrderedDict[Hashable, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._ghost)

    def decide(self, query: AdmissionQuery) -> Decision:
        seen = tuple(k in self._ghost for k in query.keys)
        for k in query.keys:
            self._ghost[k] = None
            self._ghost.move_to_end(k)
        while len(self._ghost) > self.capacity:
            self._ghost.popitem(last=False)
        if sum(seen) >= self.min_seen_chunks:
            return ADMIT_ALL
        return Decision(False, seen)
