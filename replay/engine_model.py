"""How the host tier of `kvtier replay` and of `kvtier simulate` differs from the engine's (kvtier's connector over
LMCache's host tier), printed by both commands under their tables so that nobody reads a replay figure as an engine
figure (issue 50; measured side by side in docs/results/2026-12-07-eviction-in-the-engine.md, and one difference at
a time by `benchmarks/replay_engine_gap.py` with the engine walk, `kvtier.replay.engine_walk`:
docs/results/2026-12-07-replay-engine-gap.md).

Each difference names what the offline model does and what the engine does. The engine's stream itself can be
replayed exactly (`kvtier replay-stream`, `kvtier.record_host_policy`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Tool = Literal["replay", "simulate"]


@dataclass(frozen=True)
class ModelDifference:
    aspect: str
    offline: str  #: what the offline model does
    engine: str  #: what the engine's host tier sees
    tools: tuple[Tool, ...] = ("replay", "simulate")


DIFFERENCES: tuple[ModelDifference, ...] = (
    ModelDifference(
        "GPU prefix cache", "none: every prompt block is looked up in the host tier",
        "vLLM's own prefix cache answers first; the host tier sees only what the GPU lost", ("replay",)),
    ModelDifference(
        "unit", "one trace block (512 tokens) per entry",
        "one LMCache chunk (the YAML's chunk_size tokens) per entry; a request's partial last chunk is not stored",
        ("replay",)),
    ModelDifference(
        "order of a request's hits", "each block touched as it is walked, head of the prefix first",
        "the chunks a load read, reported after the load, last chunk first (LMCache's order): the prefix's head "
        "is the most recent"),
    ModelDifference(
        "when new blocks enter", "at the request's arrival, as the walk misses them",
        "when their save lands, after the prefill", ("replay",)),
    ModelDifference(
        "SSD hits", "copied into the host tier at once, without a hit",
        "prefetched into the host tier (a put) before the load, whose read of them is no hit; with device reads "
        "(kvikio) not staged at all", ("replay",)),
    ModelDifference(
        "prefix rule", "every block looked up, also past a miss",
        "the walk stops at the first chunk in no tier; what follows is computed", ("replay",)),
    ModelDifference(
        "pins", "none: any entry may be a victim",
        "chunks pinned for waiting or loading requests are skipped", ("replay",)),
    ModelDifference(
        "concurrency", "one request at a time, in arrival order",
        "requests overlap: saves, prefetches and session signals interleave", ("replay",)),
)


def differences(tool: Tool) -> list[ModelDifference]:
    return [d for d in DIFFERENCES if tool in d.tools]


def format_differences(tool: Tool) -> str:
    """The printed note: one line per difference that applies to `tool`."""
    lines = [f"how this {tool}'s host tier differs from the engine's (replay the engine's own stream exactly: "
             "kvtier.record_host_policy + `kvtier replay-stream`; each difference's effect on host hits: "
             "benchmarks/replay_engine_gap.py):"]
    for d in differences(tool):
        lines.append(f"  - {d.aspect}: {tool} {d.offline}; engine: {d.engine}")
    return "\n".join(lines)
