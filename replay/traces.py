"""Request-trace readers for replays: Mooncake FAST'25 JSONL and Alibaba Qwen-Bailian JSONL.

Both formats become a list of `TraceRequest`s with seconds-based timestamps, the prompt's block ids (`hash_ids`, one
per prompt block; equal ids = identical prefix block) and the conversation structure (session id, parent request,
turn/depth).

Mooncake lines carry no session ids; they are recovered from prefix chains (see `recover_sessions`): the parent of a
request is the latest earlier request that touched the last block of the longest already-seen prefix, *provided*
that prefix covers the parent's whole prompt except its (partial) last block and at least two blocks. A match that
only covers a shared system prompt (hash id 0) is not a follow-up turn but a new conversation.

Qwen-Bailian lines (alibaba-edu/qwen-bailian-usagetraces-anon) carry `chat_id`, `parent_chat_id` (-1 for a first
turn), `turn`, `timestamp` (seconds), `input_length`, `output_length` and `hash_ids`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

logger = logging.getLogger(__name__)

TraceFormat = Literal["mooncake", "bailian"]


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace, normalised."""

    index: int  #: position in the trace (arrival order)
    timestamp: float  #: arrival time, seconds from the trace start
    hash_ids: tuple[int, ...]  #: prompt blocks, in prefix order
    input_length: int  #: prompt tokens
    output_length: int  #: answer tokens
    session: int  #: conversation id (index of the conversation's first request for recovered sessions)
    parent: int | None  #: index of the previous turn of the conversation, None for a first turn
    turn: int  #: 1 for a first turn, depth in the conversation otherwise


def _open_lines(path: str | Path) -> Iterable[dict]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not a JSON line ({e})") from None


def recover_sessions(chains: Sequence[Sequence[int]]) -> list[tuple[int, int | None, int]]:
    """(session, parent, turn) for each request of a Mooncake-style trace, from its prefix chains alone.

    Only the past is used: request i's parent is chosen among requests 0..i-1.
    """
    toucher: dict[int, int] = {}  # block id -> latest request that touched it
    out: list[tuple[int, int | None, int]] = []
    for i, chain in enumerate(chains):
        matched = 0
        while matched < len(chain) and chain[matched] in toucher:
            matched += 1
        parent: int | None = None
        if matched:
            cand = toucher[chain[matched - 1]]
            # A follow-up turn repeats the parent's whole prompt (its partial last block aside); one matched
            # block alone is a shared system prompt, not a conversation.
            if matched >= max(2, len(chains[cand]) - 1):
                parent = cand
        if parent is None:
            out.append((i, None, 1))
        else:
            session, _, turn = out[parent]
            out.append((session, parent, turn + 1))
        for h in chain:
            toucher[h] = i
    return out


def read_mooncake(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Mooncake FAST'25 trace: {"timestamp": ms, "input_length", "output_length", "hash_ids"} per line."""
    raw: list[dict] = []
    for obj in _open_lines(path):
        if limit is not None and len(raw) >= limit:
            break
        raw.append(obj)
    chains = [tuple(int(h) for h in o["hash_ids"]) for o in raw]
    sessions = recover_sessions(chains)
    reqs = [
        TraceRequest(
            index=i,
            timestamp=float(o["timestamp"]) / 1000.0,
            hash_ids=chains[i],
            input_length=int(o.get("input_length", 0)),
            output_length=int(o.get("output_length", 0)),
            session=sessions[i][0],
            parent=sessions[i][1],
            turn=sessions[i][2],
        )
        for i, o in enumerate(raw)
    ]
    logger.debug("read %d mooncake requests from %s", len(reqs), path)
    return reqs


def read_bailian(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Qwen-Bailian trace: chat_id / parent_chat_id (-1: first turn) / turn / timestamp (s) / hash_ids per line."""
    raw: list[dict] = []
    for obj in _open_lines(path):
        if limit is not None and len(raw) >= limit:
            break
        raw.append(obj)
    raw.sort(key=lambda o: float(o["timestamp"]))  # stable: equal timestamps keep file order
    by_chat: dict = {}
    reqs: list[TraceRequest] = []
    for i, o in enumerate(raw):
        pid = o.get("parent_chat_id", -1)
        parent = by_chat.get(pid) if pid not in (-1, None, "-1") else None
        if parent is None:
            session, turn = i, int(o.get("turn", 1) or 1)
        else:
            session, turn = reqs[parent].session, int(o.get("turn", reqs[parent].turn + 1))
        reqs.append(
            TraceRequest(
                index=i,
                timestamp=float(o["timestamp"]),
                hash_ids=tuple(int(h) for h in o["hash_ids"]),
                input_length=int(o.get("input_length", 0)),
                output_length=int(o.get("output_length", 0)),
                session=session,
                parent=parent,
                turn=turn,
            )
        )
        by_chat[o["chat_id"]] = i
    logger.debug("read %d bailian requests from %s", len(reqs), path)
    return reqs


def read_trace(path: str | Path, fmt: TraceFormat | None = None, limit: int | None = None) -> list[TraceRequest]:
    """Read a trace; `fmt=None` sniffs the first line (a `chat_id` field means Bailian)."""
    if fmt is None:
        first = next(iter(_open_lines(path)), {})
        fmt = "bailian" if "chat_id" in first else "mooncake"
    if fmt == "mooncake":
        return read_mooncake(path, limit)
    if fmt == "bailian":
        return read_bailian(path, limit)
    raise ValueError(f"unknown trace format {fmt!r} (mooncake or bailian)")


def unique_blocks(reqs: Iterable[TraceRequest]) -> int:
    return len({h for r in reqs for h in r.hash_ids})
