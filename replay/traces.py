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
import math
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


def _open_lines(path: str | Path) -> Iterable[tuple[int, dict]]:
    """(line number, object) for each non-blank line; ValueError naming the line for one that is not a JSON object."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not a JSON line ({e})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{lineno}: not a JSON object")
            yield lineno, obj


def _fields(path: str | Path, lineno: int, o: dict, ms: bool) -> tuple[float, tuple[int, ...], int, int]:
    """(timestamp in seconds, hash_ids, input_length, output_length) of one line; ValueError naming the line and
    what is wrong with it (a field missing, not a number, `hash_ids` not a list of integers)."""
    where = f"{path}:{lineno}"
    missing = next((k for k in ("timestamp", "hash_ids") if k not in o), None)
    if missing is not None:
        raise ValueError(f"{where}: no {missing!r} field")
    chain = o["hash_ids"]
    if not isinstance(chain, list) or not all(type(h) is int for h in chain):
        raise ValueError(f"{where}: 'hash_ids' is not a list of integers")
    try:
        ts = float(o["timestamp"]) / (1000.0 if ms else 1.0)
        inp, out = int(o.get("input_length", 0)), int(o.get("output_length", 0))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: timestamp, input_length and output_length must be numbers ({e})") from None
    if not math.isfinite(ts):
        raise ValueError(f"{where}: the timestamp is not a finite number")
    return ts, tuple(chain), inp, out


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
    """Mooncake FAST'25 trace: {"timestamp": ms, "input_length", "output_length", "hash_ids"} per line. ValueError
    naming the line for a line that is not such an object."""
    rows: list[tuple[float, tuple[int, ...], int, int]] = []
    for lineno, obj in _open_lines(path):
        if limit is not None and len(rows) >= limit:
            break
        rows.append(_fields(path, lineno, obj, ms=True))
    sessions = recover_sessions([r[1] for r in rows])
    reqs = [
        TraceRequest(
            index=i,
            timestamp=ts,
            hash_ids=chain,
            input_length=inp,
            output_length=out,
            session=sessions[i][0],
            parent=sessions[i][1],
            turn=sessions[i][2],
        )
        for i, (ts, chain, inp, out) in enumerate(rows)
    ]
    logger.debug("read %d mooncake requests from %s", len(reqs), path)
    return reqs


def read_bailian(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Qwen-Bailian trace: chat_id / parent_chat_id (-1: first turn) / turn / timestamp (s) / hash_ids per line.
    ValueError naming the line for a line that is not such an object."""
    raw: list[tuple[dict, tuple[float, tuple[int, ...], int, int]]] = []
    for lineno, obj in _open_lines(path):
        if limit is not None and len(raw) >= limit:
            break
        if "chat_id" not in obj:
            raise ValueError(f"{path}:{lineno}: no 'chat_id' field")
        raw.append((obj, _fields(path, lineno, obj, ms=False)))
    raw.sort(key=lambda r: r[1][0])  # stable: equal timestamps keep file order
    by_chat: dict = {}
    reqs: list[TraceRequest] = []
    for i, (o, (ts, chain, inp, out)) in enumerate(raw):
        pid = o.get("parent_chat_id", -1)
        parent = by_chat.get(pid) if pid not in (-1, None, "-1") else None
        if parent is None:
            session, turn = i, int(o.get("turn", 1) or 1)
        else:
            session, turn = reqs[parent].session, int(o.get("turn", reqs[parent].turn + 1))
        reqs.append(
            TraceRequest(
                index=i,
                timestamp=ts,
                hash_ids=chain,
                input_length=inp,
                output_length=out,
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
        first = next(iter(_open_lines(path)), (0, {}))[1]
        fmt = "bailian" if "chat_id" in first else "mooncake"
    if fmt == "mooncake":
        return read_mooncake(path, limit)
    if fmt == "bailian":
        return read_bailian(path, limit)
    raise ValueError(f"unknown trace format {fmt!r} (mooncake or bailian)")


def input_error(e: OSError | ValueError) -> str:
    """One line, no traceback, for a file that cannot be read or written (OSError: the file and the reason) or a
    trace line that cannot be taken (ValueError: its message, naming file and line)."""
    if isinstance(e, OSError) and e.filename is not None:
        return f"{e.filename}: {e.strerror or e}"
    return str(e)


def unique_blocks(reqs: Iterable[TraceRequest]) -> int:
    return len({h for r in reqs for h in r.hash_ids})
