"""The write-admission contract shared by the SSD tier (`kvtier.ssd_admission`) and the shared tier
(`kvtier.shared.writes`): given what kvtier knows of a request when it arrives, which of its chunks are worth
writing to a tier that costs I/O (and endurance) for every chunk it stores.

A policy sees one `AdmissionQuery` per request, at its arrival:

- `cached_chunks`: the conversation's depth, i.e. how many chunks of its prompt were cached (GPU, host, SSD or
  shared) when it arrived;
- `keys`: one key per full prompt chunk, naming the prefix up to that chunk's end (chained hashes: two prompts share
  key i exactly when they share their first i + 1 chunks). Only policies with `needs_keys` get them (computing
  them costs a pass over the prompt).

It answers with a `Decision`: a verdict per prompt chunk and one for every chunk beyond the prompt (the answer's
chunks, saved as the request runs). A policy may keep state between queries (a doorkeeper's ghost keys); it is
called from one thread.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class AdmissionQuery:
    cached_chunks: int = 0  # chunks of the prompt cached somewhere at arrival (the conversation's depth)
    keys: Sequence[Hashable] = ()  # a key per full prompt chunk (only for policies with `needs_keys`)


@dataclass(frozen=True)
class Decision:
    """Which chunks of one request to write: `prompt[i]` for its i-th full prompt chunk, `rest` for the others."""

    rest: bool = True
    prompt: tuple[bool, ...] = field(default=())

    def admits(self, index: int) -> bool:
        """Whether chunk `index` (counted from the request's first token) is written."""
        return self.prompt[index] if index < len(self.prompt) else self.rest

    @property
    def uniform(self) -> bool | None:
        """True / False when every chunk gets the same verdict, else None."""
        return self.rest if all(p == self.rest for p in self.prompt) else None

    def refused(self, first: int, end: int) -> tuple[int, ...]:
        """Indices of the chunks in [first, end) that are not written."""
        if self.uniform is not None:
            return () if self.rest else tuple(range(first, end))
        return tuple(i for i in range(first, end) if not self.admits(i))


ADMIT_ALL = Decision(True)
REFUSE_ALL = Decision(False)


class AdmissionPolicy(Protocol):
    """Decides, once per request, which of its chunks a tier writes."""

    name: str
    needs_keys: bool  # whether `decide` reads `AdmissionQuery.keys`

    def decide(self, query: AdmissionQuery) -> Decision: ...
