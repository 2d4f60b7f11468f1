"""The worker side's use of the shared tier (`kvtier.storage_backends.shared.tier.SharedTier`), kept apart from
the rest of the worker: lookups of the chunks the local tiers lack, reads into the host tier for a prefetch, and
the shared writes of saved chunks.

- Lookups ask the store only for the chunks that neither the host tier nor the SSD tier holds, and remember the
  answer per request (vLLM asks about a waiting request at every step; the store is asked once).
- Writes leave `wait_for_save` at once: the saved chunks' keys are hashed and queued on a helper thread, and the
  shared tier's writer sends them (never the forward pass).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvtier.storage_backends.shared.tier import SharedTier

logger = logging.getLogger(__name__)


class SharedSide:
    def __init__(self, tier: SharedTier, chunks: Callable[[list[int], str], list[tuple[int, int, Any]]],
                 chunk_size: int) -> None:
        self.tier = tier
        self._chunks = chunks
        self.chunk_size = chunk_size
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[tuple[str, ...], int]] = {}  # request -> (keys asked, leading hits)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-shared-save")

    def prefix(self, rid: str, keys: Sequence[Any]) -> int:
        """Leading chunks of `keys` (LMCache keys the local tiers lack) held by the store, cached per request."""
        if not keys:
            return 0
        sig = tuple(k.to_string() for k in keys)
        with self._lock:
            got = self._seen.get(rid)
        if got is not None and got[0] == sig:
            return got[1]
        n = self.tier.prefix_contains(keys)
        if self.tier.up:
            with self._lock:
                self._seen[rid] = (sig, n)
        return n

    def read(self, keys: Sequence[Any]) -> list[Any]:
        return self.tier.read(keys)

    def forget(self, rid: str) -> None:
        with self._lock:
            self._seen.pop(rid, None)

    def share_saved(self, token_ids: list[int], skip: int, tag: str = "") -> None:
        """Queue the full chunks of key tokens `token_ids` (identity tag `tag`) from token `skip` on for the store
        (returns at once)."""
        self._pool.submit(self._share, list(token_ids), int(skip), tag)

    def _share(self, token_ids: list[int], skip: int, tag: str) -> None:
        try:
            keys = [k for s, e, k in self._chunks(token_ids, tag) if s >= skip and e - s == self.chunk_size]
            self.tier.submit_writes(keys)
        except Exception:  # noqa: BLE001 - a lost shared write is a later miss elsewhere, never an engine error
            logger.exception("kvtier: queueing shared writes failed")

    def flush(self, timeout: float = 30.0) -> bool:
        self._pool.submit(lambda: None).result(timeout)
        return self.tier.flush(timeout)

    def stats(self) -> dict[str, Any]:
        return self.tier.as_dict()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=False)
        self.tier.close()
