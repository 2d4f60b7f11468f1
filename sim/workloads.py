"""Synthetic request traces for `kvtier simulate` (not production code): a shared-prefix (agent-style) workload.

    kvtier workload shared-prefix out/shared.jsonl [--requests 2000] [--seed 0]
    kvtier simulate out/shared.jsonl --scheduler dual-queue,dual-queue+delay-hit

Why: on the Mooncake conversation trace delay-hit avoidance never fires (consecutive turns of a conversation are
separated by the user's reading time, so no request's prefix is still being computed when a sibling arrives).
Strata reports that in Mooncake's *agent* trace 38% of requests share >= 6K prefix tokens with another request
that arrives within 1 s (agents fan out several calls over the same context). This generator reproduces that
property with documented, seeded parameters; the agent trace itself is not shipped with the project.

The model (`SharedPrefixSpec`, defaults in brackets):
- Tasks arrive as a Poisson process of `task_rate` per second [0.5]. A task is a *fan-out* with probability
  `p_group` (chosen so that `shared_fraction` [0.38] of all requests belong to a fan-out), otherwise a single
  request.
- A fan-out has `k` requests, 2 + Poisson(`extra_members` [1.5]) capped at `max_members` [8], arriving within
  `window_s` [1.0] s of its first one (uniform offsets). They share a new prefix of `prefix_tokens` uniform in
  [`prefix_min`, `prefix_max`] [6,144, 16,384] tokens (the agent's context: system prompt, tools, task state);
  each adds its own suffix of uniform [`suffix_min`, `suffix_max`] [128, 2,048] tokens.
- A single request is a new prompt of uniform [`single_min`, `single_max`] [1,024, 12,288] tokens.
- With probability `reuse_p` [0.3] a task reuses the prefix of an earlier fan-out (a later step of the same
  agent), so host and SSD tiers get hits too.
- Output lengths are uniform [`output_min`, `output_max`] [32, 512] tokens.
- Every prompt starts with one shared 512-token system block (hash id 0), as in the Mooncake traces.

Output: Mooncake-format JSONL (`timestamp` ms, `input_length`, `output_length`, `hash_ids` of 512-token blocks;
equal ids = identical prefix blocks), sorted by arrival. `shared_prefix_stats` measures the property Strata
reports on any trace in that format.
"""

from __future__ import annotations

import argparse
import bisect
import json
import logging
import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from kvtier.replay.traces import input_error

logger = logging.getLogger(__name__)

__all__ = ["SharedPrefixSpec", "add_arguments", "generate_shared_prefix", "run", "shared_prefix_stats"]

BLOCK = 512


@dataclass(frozen=True, slots=True)
class SharedPrefixSpec:
    """Parameters of the shared-prefix workload (see the module docstring)."""

    requests: int = 2000
    seed: int = 0
    task_rate: float = 0.5
    shared_fraction: float = 0.38
    extra_members: float = 1.5
    max_members: int = 8
    window_s: float = 1.0
    prefix_min: int = 6144
    prefix_max: int = 16384
    suffix_min: int = 128
    suffix_max: int = 2048
    single_min: int = 1024
    single_max: int = 12288
    reuse_p: float = 0.3
    output_min: int = 32
    output_max: int = 512

    def __post_init__(self) -> None:
        if self.requests < 1 or self.task_rate <= 0 or self.window_s < 0:
            raise ValueError("requests >= 1, task_rate > 0 and window_s >= 0 are required")
        if not 0 <= self.shared_fraction < 1 or not 0 <= self.reuse_p <= 1:
            raise ValueError("shared_fraction must be in [0, 1) and reuse_p in [0, 1]")
        for lo, hi in (("prefix_min", "prefix_max"), ("suffix_min", "suffix_max"), ("single_min", "single_max"),
                       ("output_min", "output_max")):
            if not 1 <= getattr(self, lo) <= getattr(self, hi):
                raise ValueError(f"{lo} must be >= 1 and <= {hi}")
        if self.max_members < 2:
            raise ValueError("max_members must be >= 2")

    def mean_members(self) -> float:
        """Expected fan-out size: 2 + Poisson(extra_members) capped at max_members."""
        lam, cap = self.extra_members, self.max_members - 2
        p = [math.exp(-lam) * lam**i / math.factorial(i) for i in range(cap)]
        return 2 + sum(i * pi for i, pi in enumerate(p)) + cap * (1 - sum(p))

    def p_group(self) -> float:
        """Probability that a task is a fan-out, so that `shared_fraction` of the requests are in fan-outs."""
        f, m = self.shared_fraction, self.mean_members()
        return f / (m - f * (m - 1))


def _poisson(rng: random.Random, lam: float) -> int:
    k, p, limit = 0, 1.0, math.exp(-lam)
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


class _Blocks:
    def __init__(self) -> None:
        self.next = 1

    def new(self, tokens: int) -> list[int]:
        n = -(-tokens // BLOCK)
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def generate_shared_prefix(spec: SharedPrefixSpec | None = None) -> list[dict]:
    """The workload's requests as Mooncake-format dicts, sorted by timestamp (`spec`: the defaults when None)."""
    spec = SharedPrefixSpec() if spec is None else spec
    rng = random.Random(spec.seed)
    ids = _Blocks()
    p_group = spec.p_group()
    out: list[dict] = []
    prefixes: list[tuple[int, list[int]]] = []  # earlier fan-outs' (tokens, blocks), for reuse
    t = 0.0

    def prompt(shared_tokens: int, shared_blocks: list[int], own_tokens: int) -> tuple[int, list[int]]:
        # the shared part is whole blocks (a prefix match is block-granular); the request's own tokens follow
        return BLOCK + shared_tokens + own_tokens, [0] + shared_blocks + ids.new(own_tokens)

    while len(out) < spec.requests:
        t += rng.expovariate(spec.task_rate)
        if rng.random() < p_group:
            k = min(2 + _poisson(rng, spec.extra_members), spec.max_members)
            if prefixes and rng.random() < spec.reuse_p:
                shared_tokens, shared = prefixes[rng.randrange(len(prefixes))]
            else:
                shared_tokens = rng.randint(spec.prefix_min, spec.prefix_max) // BLOCK * BLOCK
                shared = ids.new(shared_tokens)
                prefixes.append((shared_tokens, shared))
            offsets = sorted([0.0] + [rng.uniform(0, spec.window_s) for _ in range(k - 1)])
            for off in offsets:
                n, blocks = prompt(shared_tokens, shared, rng.randint(spec.suffix_min, spec.suffix_max))
                out.append(_line(t + off, n, rng.randint(spec.output_min, spec.output_max), blocks))
        else:
            if prefixes and rng.random() < spec.reuse_p:  # a later single step over an earlier agent context
                shared_tokens, shared = prefixes[rng.randrange(len(prefixes))]
                n, blocks = prompt(shared_tokens, shared, rng.randint(spec.suffix_min, spec.suffix_max))
            else:
                n, blocks = prompt(0, [], rng.randint(spec.single_min, spec.single_max))
            out.append(_line(t, n, rng.randint(spec.output_min, spec.output_max), blocks))
    out = out[:spec.requests]
    out.sort(key=lambda o: o["timestamp"])
    return out


def _line(t: float, input_tokens: int, output_tokens: int, blocks: list[int]) -> dict:
    return {"timestamp": int(round(t * 1000)), "input_length": input_tokens, "output_length": output_tokens,
            "hash_ids": blocks}


def shared_prefix_stats(lines: Sequence[dict], min_tokens: int = 6144, window_s: float = 1.0) -> dict[str, float]:
    """Fraction of requests that share >= `min_tokens` prefix tokens (block-granular) with another request arriving
    within `window_s` (before or after it): the property Strata reports for Mooncake's agent trace."""
    need = -(-min_tokens // BLOCK)
    times = [o["timestamp"] / 1000.0 for o in lines]
    by_key: dict[tuple[int, ...], list[float]] = {}
    for o, ts in zip(lines, times):
        if len(o["hash_ids"]) >= need:
            by_key.setdefault(tuple(o["hash_ids"][:need]), []).append(ts)
    for v in by_key.values():
        v.sort()
    hits = 0
    for o, ts in zip(lines, times):
        if len(o["hash_ids"]) < need:
            continue
        v = by_key[tuple(o["hash_ids"][:need])]
        lo, hi = bisect.bisect_left(v, ts - window_s), bisect.bisect_right(v, ts + window_s)
        hits += (hi - lo) > 1
    return {"requests": len(lines), "share_fraction": hits / max(len(lines), 1),
            "mean_input_tokens": sum(o["input_length"] for o in lines) / max(len(lines), 1),
            "span_s": (max(times) - min(times)) if times else 0.0}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("kind", choices=["shared-prefix"], help="which workload")
    parser.add_argument("out", help="output JSONL (Mooncake format)")
    for f in fields(SharedPrefixSpec):
        parser.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default,
                            help=f"(default {f.default})")


def run(args: argparse.Namespace) -> int:
    try:
        spec = SharedPrefixSpec(**{f.name: getattr(args, f.name) for f in fields(SharedPrefixSpec)})
    except ValueError as e:
        raise SystemExit(f"kvtier workload: {e}") from None
    lines = generate_shared_prefix(spec)
    path = Path(args.out)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(o) + "\n" for o in lines))
    except OSError as e:
        raise SystemExit(f"kvtier workload: cannot write {path}: {input_error(e)}") from None
    st = shared_prefix_stats(lines)
    print(f"wrote {path}: {st['requests']} requests over {st['span_s']:.0f} s, mean prompt "
          f"{st['mean_input_tokens']:.0f} tokens; {st['share_fraction']:.1%} share >= 6K prefix tokens with another "
          f"request within 1 s (spec {spec.shared_fraction:.0%}); parameters {json.dumps(asdict(spec))}")
    return 0
