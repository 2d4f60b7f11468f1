"""The prefix walk: where a request's prompt is resident, chunk by chunk from its first token. One rule, used by the
connector's worker (`connector/worker_storage.py`, its lookups) and by the simulator (`walk_prefix`).

Per chunk, in prompt order, its place (`locate`):
- `HOST`: usable without an SSD read (host tier, or already on the GPU). While every chunk before it was `HOST`
  (the host run), it extends `host_end`.
- `RESIDENT`: in the host tier but not taken into the host run: counts to `hit_end` only and leaves the run as
  it is (the worker's answer for a host-tier chunk after the run ended, where it equals `HOST`, and for one it
  found only after its pin or first look missed it: it arrived meanwhile).
- `SSD`: only on the SSD: breaks the host run; counted in `ssd_tokens` / `ssd_bytes`.
- None: resident nowhere: the walk stops there (`PrefixWalk.stop`).
`hit_end` is the end of the last chunk walked. A shared-tier part (`remote_tokens` / `remote_bytes`) is what the
worker finds past the walk's stop in the shared tier; the walk itself covers the local tiers.

Plain Python: no vLLM import.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol, TypeVar

__all__ = [
    "HOST",
    "RESIDENT",
    "SSD",
    "PrefixResidency",
    "PrefixWalk",
    "Residency",
    "overlap",
    "walk_chunks",
    "walk_prefix",
]

#: per-chunk places (see the module docstring)
HOST, SSD, RESIDENT = "host", "ssd", "resident"

Chunk = TypeVar("Chunk")


class PrefixResidency(Protocol):
    """A prefix walk's result as `derive_tier_hint` reads it (the connector's `LookupResult`, `Residency`)."""

    @property
    def host_end(self) -> int: ...

    @property
    def hit_end(self) -> int: ...

    @property
    def ssd_tokens(self) -> int: ...

    @property
    def ssd_bytes(self) -> int: ...

    @property
    def remote_tokens(self) -> int:
        """Tokens of `[0, hit_end)` only the shared tier holds (0 without one)."""
        ...

    @property
    def remote_bytes(self) -> int: ...


@dataclass(frozen=True, slots=True)
class Residency:
    """A prefix walk's result (the fields of `kvtier.connector.messages.LookupResult` but its chunk size)."""

    host_end: int = 0
    hit_end: int = 0
    ssd_tokens: int = 0
    ssd_bytes: int = 0
    remote_tokens: int = 0
    remote_bytes: int = 0


@dataclass(frozen=True, slots=True)
class PrefixWalk:
    """`walk_chunks`' answer: the local tiers' residency, and the index of the first chunk resident nowhere (None:
    every chunk is resident)."""

    residency: Residency
    stop: int | None


def overlap(a0: int, a1: int, b0: int, b1: int) -> int:
    """Tokens the ranges [a0, a1) and [b0, b1) share."""
    return max(0, min(a1, b1) - max(a0, b0))


def walk_chunks(chunks: Iterable[Chunk], locate: Callable[[Chunk, bool], tuple[str | None, int, int]]
                ) -> PrefixWalk:
    """Walk `chunks` in prompt order: `locate(chunk, in_host_run)` gives each one's `(place, tokens, nbytes)`,
    asked lazily (nothing past the stop), with whether every chunk before it was `HOST`."""
    pos = host_end = hit_end = ssd_tokens = ssd_bytes = 0
    host_run = True
    stop = None
    for i, chunk in enumerate(chunks):
        where, tokens, nbytes = locate(chunk, host_run)
        if where == HOST:
            if host_run:
                host_end = pos + tokens
        elif where == SSD:
            host_run = False
            ssd_tokens += tokens
            ssd_bytes += nbytes
        elif where != RESIDENT:
            stop = i
            break
        pos += tokens
        hit_end = pos
    return PrefixWalk(Residency(host_end, hit_end, ssd_tokens, ssd_bytes), stop)


def walk_prefix(chunks: Iterable[tuple[str | None, int, int]]) -> Residency:
    """Walk `(where, tokens, nbytes)` per chunk, in prompt order (`where`: "host" for a chunk usable without an SSD
    read - host tier, or already on the GPU - "ssd" for an SSD-only chunk, None for a chunk resident nowhere)."""
    return walk_chunks(chunks, lambda chunk, _in_host_run: chunk).residency
