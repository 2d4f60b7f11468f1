"""Where `kvtier replay` and the engine part on host hits (issue 50): the serve eviction benchmark's requests
replayed offline, the engine's differences switched on one at a time (`kvtier.replay.engine_walk`).

    .venv/bin/python benchmarks/replay_engine_gap.py [--engine-json evict.json ...] [--json gap.json]

The requests are `benchmarks/serve_eviction.py`'s (the shipped conversations scaled as `serve_aiperf.scale` does:
one 512-token trace block = 32 tokens), the sizes its host tiers (fractions of the run's unique chunks, three
rounds), the policies its three. Per policy and size, the host tier's hit tokens as a share of the prompt tokens
(what the engine's `kvtier_connector_hit_tokens_total{tier="host"}` counts), min / median / max over rounds, after
each step:

- `blocks`: `kvtier replay` as a user runs it: trace blocks, one round, the host capacity three times the size's
  fraction of one round's unique blocks (host hits / block accesses);
- `chunks`, `gpu`, `engine`, `concurrency`: the engine walk's steps (see its docstring).

With `--engine-json` (the `--json` of `serve_eviction.py`), the engine's own figures per size and policy (`measured`),
and each step's median minus the engine's median (points). Nothing here is timed: the figures are counts and do not
depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from serve_aiperf import read_trace, scale  # the sibling modules (benchmarks/ is the script's sys.path[0])
from serve_eviction import CHUNK, PAGE, unique_chunks
from serve_report import spread

from kvtier.demo_data import path as data_path
from kvtier.replay.engine_walk import STEPS, EngineShape, Turn, walk
from kvtier.replay.runner import Capacity, replay_one
from kvtier.replay.traces import TraceRequest, unique_blocks

FIRST = "blocks"
MEASURED = "measured"  #: the engine's own figures (--engine-json)


def turns_of(rows: list[dict[str, Any]]) -> list[Turn]:
    return [Turn(r["timestamp"] / 1000.0, tuple(r["hash_ids"]), r["input_length"], r["output_length"]) for r in rows]


def blocks_step(rows: list[dict[str, Any]], policy: str, frac: float, rounds: int) -> float:
    """`kvtier replay`'s host hit rate (percent of block accesses) on the same requests, one round."""
    reqs = [TraceRequest(i, r["timestamp"] / 1000.0, tuple(r["hash_ids"]), r["input_length"], r["output_length"],
                         0, None, 1) for i, r in enumerate(rows)]
    uniq = unique_blocks(reqs)
    cap = max(1, round(frac * rounds * uniq))
    return 100 * replay_one(reqs, policy, Capacity(f"{frac * rounds:g}", cap, cap / uniq)).hit_rate


def engine_figures(paths: list[str]) -> dict[tuple[float, str], list[float]]:
    """{(fraction, policy): host hit percent per round} from serve_eviction.py's --json files (a later file's
    size and policy replaces an earlier one's)."""
    out: dict[tuple[float, str], list[float]] = {}
    for path in paths:
        doc = json.loads(Path(path).read_text())
        prompt = _prompt_tokens(doc)
        fracs = [float(x) for x in str(doc["args"]["host_fractions"]).split(",") if x.strip()]
        for frac, by in zip(fracs, doc["results"].values(), strict=True):
            for pol, runs in by.items():
                out[(frac, pol)] = [100 * r["kvtier_host"] / prompt for r in runs]
    return out


def _prompt_tokens(doc: dict[str, Any]) -> int:
    a = doc["args"]
    rows, _ = scale(read_trace(a["trace"])[:a["requests"] or None], a["block_tokens"], a["max_prompt_tokens"],
                    a["max_answer_tokens"])
    return sum(r["input_length"] for r in rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default=data_path("mooncake_conversation_sessions.jsonl"))
    p.add_argument("--policies", default="lru,answer-length,adaptive")
    p.add_argument("--host-fractions", default="0.02,0.05,0.10")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--block-tokens", type=int, default=32)
    p.add_argument("--max-prompt-tokens", type=int, default=1536)
    p.add_argument("--max-answer-tokens", type=int, default=24)
    p.add_argument("--gpu-blocks", type=int, default=160,
                   help="vLLM's KV cache, in 32-token pages (one is vLLM's null page)")
    p.add_argument("--engine-json", action="append", default=[],
                   help="serve_eviction.py's --json, for the engine's figures (repeat to merge runs of other sizes)")
    p.add_argument("--json", default=None, help="write every figure here")
    args = p.parse_args(argv)
    rows, held = scale(read_trace(args.trace), args.block_tokens, args.max_prompt_tokens, args.max_answer_tokens)
    turns = turns_of(rows)
    per_round = unique_chunks(rows, args.block_tokens, CHUNK)
    engine = engine_figures(args.engine_json)
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    print(f"replay vs engine: {len(turns)} requests of {args.trace} ({held} held out), "
          f"{sum(t.prompt_tokens for t in turns)} prompt tokens a round, {per_round} unique chunks a round, "
          f"{args.rounds} rounds; GPU {args.gpu_blocks} x {PAGE}-token pages, {CHUNK}-token chunks; host hit "
          "tokens as % of prompt tokens, min / median / max over rounds")
    steps = [FIRST, *STEPS]
    head = f"{'size':>5} {'policy':<14}" + "".join(f"{s:>20}" for s in steps) + (f"{MEASURED:>20}" if engine else "")
    print(head)
    print("-" * len(head))
    out: list[dict[str, Any]] = []
    for frac in [float(x) for x in args.host_fractions.split(",") if x.strip()]:
        shape = EngineShape(int(frac * per_round * args.rounds), args.block_tokens, CHUNK, PAGE, args.gpu_blocks - 1,
                            args.concurrency, args.rounds)
        for pol in policies:
            cells: dict[str, list[float]] = {FIRST: [blocks_step(rows, pol, frac, args.rounds)]}
            for step in STEPS:
                cells[step] = [100 * r.host / r.prompt_tokens for r in walk(turns, pol, shape, step)]
            if (frac, pol) in engine:
                cells[MEASURED] = engine[(frac, pol)]
            line = f"{frac:>5.0%} {pol:<14}"
            for vals in cells.values():
                lo, md, hi = spread(vals)
                line += f"{f'{lo:.1f} / {md:.1f} / {hi:.1f}':>20}" if len(vals) > 1 else f"{md:>20.1f}"
            print(line)
            if MEASURED in cells:
                em = statistics.median(cells[MEASURED])
                print(f"{'':>5} {'':<14}" + "".join(f"{statistics.median(cells[s]) - em:>+20.1f}" for s in steps)
                      + f"{'(points)':>20}")
            out.append({"fraction": frac, "policy": pol, "host_chunks": shape.host_chunks, "host_percent": cells})
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
