"""A model of vLLM's own prefix cache (the GPU KV cache in front of kvtier's host tier), for the engine walk
(`kvtier.replay.engine_walk`).

What it keeps of vLLM's block pool (`vllm/v1/core/block_pool.py`, `kv_cache_manager.py`): a fixed number of pages;
a page is cached under its prefix key once a request has filled it; a request's hit is the longest run of cached
leading pages, never its last prompt token (vLLM computes that one); a running request holds its pages; a finished
request's cached pages go to the tail of the free queue *last page first* (so a prefix's tail is reused first and
its head survives longest), its uncached pages (a partial last page) to the head; a new page is taken from the head
of the free queue, which drops the cached prefix it held. vLLM's null page is not among `pages` (vLLM's
`--num-gpu-blocks-override N` leaves N - 1). Plain Python, no vLLM import.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass


@dataclass
class _Run:
    pages: list[int]  #: the page ids the request holds, in token order


class GpuPrefixCache:
    """`pages` pages of `page_tokens` tokens; keys are the prompt's whole pages' prefix keys."""

    def __init__(self, pages: int, page_tokens: int) -> None:
        if pages < 1 or page_tokens < 1:
            raise ValueError(f"GpuPrefixCache: pages ({pages}) and page_tokens ({page_tokens}) must be >= 1")
        self.page_tokens = page_tokens
        self.pages = pages
        self._free: OrderedDict[int, None] = OrderedDict((p, None) for p in range(pages))  # head: next taken
        self._key_of: dict[int, Hashable] = {}  #: page -> the prefix key it holds
        self._page_of: dict[Hashable, int] = {}  #: prefix key -> page
        self._refs = [0] * pages
        self._runs: dict[Hashable, _Run] = {}

    def hit_tokens(self, keys: Sequence[Hashable], prompt_tokens: int) -> int:
        """Tokens of a prompt whose whole pages have prefix keys `keys` that the cache would reuse now."""
        limit = (prompt_tokens - 1) // self.page_tokens
        n = 0
        for k in keys[:limit]:
            if k not in self._page_of:
                break
            n += 1
        return n * self.page_tokens

    def start(self, rid: Hashable, keys: Sequence[Hashable], prompt_tokens: int, total_tokens: int) -> int:
        """Admit request `rid` (prompt pages' prefix keys `keys`, `total_tokens` = prompt + answer) and run its
        prefill: it holds its hit pages and takes new ones for the rest, and its whole prompt pages are cached.
        Returns its hit tokens. ValueError when the pages it needs are not free (more than the cache)."""
        hit = self.hit_tokens(keys, prompt_tokens)
        held = [self._page_of[k] for k in keys[:hit // self.page_tokens]]
        need = -(-total_tokens // self.page_tokens) - len(held)
        for p in held:
            if self._refs[p] == 0:
                del self._free[p]
            self._refs[p] += 1
        if need > len(self._free):
            raise ValueError(f"GpuPrefixCache: a request of {total_tokens} tokens needs {need} free pages, "
                             f"{len(self._free)} free of {self.pages}")
        new = []
        for _ in range(need):
            p, _ = self._free.popitem(last=False)
            old = self._key_of.pop(p, None)
            if old is not None:
                del self._page_of[old]
            self._refs[p] = 1
            new.append(p)
        pages = held + new
        # vLLM caches every page that fills up (prompt pages under their prefix keys; pages filled by the answer
        # under keys no prompt has: they never hit, but they are cached); the request's last token has no KV
        full = (total_tokens - 1) // self.page_tokens
        for i in range(len(held), full):
            k = keys[i] if i < len(keys) and i < prompt_tokens // self.page_tokens else ("answer", rid, i)
            if k not in self._page_of:  # a twin already cached keeps its page (vLLM caches the first)
                self._page_of[k] = pages[i]
                self._key_of[pages[i]] = k
        self._runs[rid] = _Run(pages)
        return hit

    def finish(self, rid: Hashable) -> None:
        """Request `rid` ends: its cached pages go to the free queue's tail, last page first; its pages that hold
        no whole page's prefix go to the head (taken first), as vLLM's `BlockPool.free_blocks` does."""
        run = self._runs.pop(rid)
        first: list[int] = []
        for p in reversed(run.pages):
            self._refs[p] -= 1
            if self._refs[p] == 0:
                if p in self._key_of:
                    self._free[p] = None
                else:
                    first.append(p)
        for p in reversed(first):
            self._free[p] = None
            self._free.move_to_end(p, last=False)

    @property
    def running(self) -> int:
        return len(self._runs)
