"""`kvtier replay`: replay a request trace through a host tier and an SSD tier, inclusive, for each eviction policy.

Model (one block = one prompt block of the trace, size 1): for each request, in arrival order, the policy hears
`on_request(chain, now)`; then each block of the prompt is read: a host hit (`on_access`), else an SSD hit (the block
is copied back into host memory), else a miss (the block is computed and written to both tiers). Writing into a
full tier asks its policy for victims. The tiers are inclusive: every host block has an SSD copy, so an SSD eviction
drops the host copy too. After the request, the policy hears `on_request_finished(chain, output_length, now)`.
`now` is the trace timestamp (seconds), also returned by the clock handed to the policies.

`hit_rate` = host hits / block accesses; `ssd_hit_rate` = SSD hits (host misses found on SSD) / block accesses.
With `score_from`, only requests from that time on are counted (earlier ones warm the tiers and the policies up).
The same policy objects run in production tiers; Belady gets the future host-tier key sequence via `set_future`.
A bounded SSD tier is the production SSD tier's own index (`SlotIndex`, one slot per block, no I/O): its slot
allocation, generations and eviction calls are the ones `SSDTier` runs.
`vllm-*` policies are vLLM's own CPU-offload manager, replayed by `kvtier.replay.vllm_offload` over the same model.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvtier.replay import vllm_offload
from kvtier.replay.engine_model import format_differences
from kvtier.replay.traces import TraceRequest, input_error, read_trace, unique_blocks
from kvtier.storage_backends.admission.base import ADMIT_ALL, AdmissionPolicy, AdmissionQuery, Decision
from kvtier.storage_backends.admission.config import POLICIES as ADMISSION_POLICIES
from kvtier.storage_backends.admission.config import make_policy as make_admission
from kvtier.storage_backends.base import ChunkMeta
from kvtier.storage_backends.eviction.base import (
    EvictionPolicy,
    make_policy,
    policy_class,
    policy_names,
)
from kvtier.storage_backends.ssd.index import SlotIndex

logger = logging.getLogger(__name__)

#: Default KV bytes of one 512-token block, used to turn GB capacities into blocks: Llama-3.1-8B in bf16
#: (32 layers x 8 KV heads x 128 dims x 2 (K and V) x 2 bytes = 128 KiB per token).
DEFAULT_BLOCK_BYTES = 512 * 128 * 1024

#: Aliases accepted by --policies.
POLICY_ALIASES = {"answer_length": "answer-length", "al": "answer-length", "opt": "belady", "s3-fifo": "s3fifo"}


class ReplayClock:
    """The replay's notion of now: the current request's trace timestamp (seconds)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass(frozen=True)
class Capacity:
    """A tier capacity as the user wrote it and in blocks."""

    label: str  #: "0.05", "20GB", "inf"
    blocks: int | None  #: None = unbounded
    fraction: float | None  #: of the trace's unique blocks, when given (or computable)


@dataclass
class ReplayResult:
    policy: str
    host_capacity: str  #: as given (fraction or size)
    host_capacity_blocks: int
    host_capacity_fraction: float
    ssd_capacity: str
    ssd_capacity_blocks: int | None
    requests: int
    accesses: int
    host_hits: int
    ssd_hits: int
    misses: int
    hit_rate: float
    ssd_hit_rate: float
    host_evictions: int
    seconds: float
    extra: dict = field(default_factory=dict)
    ssd_admission: str = "all"  #: the SSD tier's write admission policy
    ssd_writes: int = 0  #: blocks written to the SSD tier (scored requests)
    ssd_refused: int = 0  #: missed blocks the admission kept off the SSD (host only)


def parse_capacity(text: str, unique: int, block_bytes: int = DEFAULT_BLOCK_BYTES) -> Capacity:
    """'0.05' -> 5% of the unique blocks; '20GB'/'20GiB'/'20' (a number > 1) -> bytes / block_bytes;
    '1000blocks' -> blocks; 'inf'/'none' -> unbounded."""
    t = text.strip().lower()
    if t in ("inf", "none", "unbounded", ""):
        return Capacity(text, None, None)
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[-+]?\d+)?)\s*(gib|gb|g|mib|mb|m|blocks?|b|%)?", t)
    if not m:
        raise ValueError(f"capacity {text!r}: expected a fraction (0.05), a size (20GB), N blocks or 'inf'")
    value, unit = float(m.group(1)), m.group(2)
    if unit == "%":
        value, unit = value / 100.0, None
    if unit is None and value <= 1.0:
        blocks = max(1, int(round(value * unique)))
        return Capacity(text, blocks, value)
    if unit in ("block", "blocks", "b"):
        blocks = int(value)
    else:
        scale = {None: 1e9, "gb": 1e9, "g": 1e9, "gib": 2**30, "mb": 1e6, "m": 1e6, "mib": 2**20}[unit]
        blocks = int(value * scale // block_bytes)
    blocks = max(1, blocks)
    return Capacity(text, blocks, blocks / unique if unique else None)


def build_policy(name: str, clock: Callable[[], float], capacity: int | None, **kwargs) -> EvictionPolicy:
    name = POLICY_ALIASES.get(name, name)
    policy = make_policy(name, production=False, clock=clock, **kwargs)
    if capacity is not None:
        policy.set_capacity(capacity)
    return policy


def host_key_sequence(reqs: Sequence[TraceRequest]) -> list[int]:
    """The keys the host tier sees through on_access/on_insert: every block access, in order (Belady's future)."""
    return [h for r in reqs for h in r.hash_ids]


def simulate(
    reqs: Sequence[TraceRequest],
    host: EvictionPolicy,
    host_blocks: int,
    ssd: EvictionPolicy | None = None,
    ssd_blocks: int | None = None,
    clock: ReplayClock | None = None,
    progress: Callable[[int], None] | None = None,
    score_from: float | None = None,
    decision_ns: list[int] | None = None,
    host_flags: list[bool] | None = None,
    admission: AdmissionPolicy | None = None,
) -> dict:
    """Run the two-tier model; returns counters. `ssd=None` or `ssd_blocks=None` means an unbounded SSD.
    `score_from`: count hits and misses only for requests arriving at or after this time (seconds); earlier
    requests still run through the tiers (they warm the caches and the policies' online learning).
    `decision_ns`: when given, the wall time of every host eviction decision (victims() until it has freed
    enough, with the on_remove calls) is appended to it, in nanoseconds.
    `host_flags`: when given, whether each block access (every request, scored or not, in replay order) was a
    host-tier hit is appended to it (`tools.eviction_loss` reads where a policy's hits fall short from it).
    `admission`: the SSD tier's write admission (`kvtier.ssd_admission`'s policy objects), asked once per request
    with the request's depth (leading blocks in host or SSD at its arrival) and its block keys; a missed block it
    refuses goes to the host tier only (default: every missed block is written to SSD)."""
    clock = clock or ReplayClock()
    always = _always
    perf_ns = time.perf_counter_ns
    host_used = 0
    ssd_set: set[int] = set()  # an unbounded SSD tier: every block ever written
    bounded_ssd = ssd is not None and ssd_blocks is not None
    index = ssd_index(ssd, ssd_blocks, clock) if bounded_ssd else None
    if index is not None:
        def inclusive(v, _nbytes: int, _reason: str) -> None:  # an SSD eviction takes the host copy too
            nonlocal host_used
            if v in host:
                host.on_remove(v)
                host_used -= 1

        index.add_drop_listener(inclusive)
    accesses = host_hits = ssd_hits = misses = evictions = ssd_writes = ssd_refused = 0
    for r in reqs:
        clock.now = r.timestamp
        chain = r.hash_ids
        verdict = _admission(admission, chain, host, index if index is not None else ssd_set)
        host.on_request(chain, r.timestamp)
        scored = 1 if score_from is None or r.timestamp >= score_from else 0
        for i, k in enumerate(chain):
            accesses += scored
            if k in host:
                host_hits += scored
                host.on_access(k)
                if host_flags is not None:
                    host_flags.append(True)
                continue
            if host_flags is not None:
                host_flags.append(False)
            if index is not None:
                entries = index.begin_read((k,))
                if entries[0] is not None:
                    ssd_hits += scored
                    index.end_read((k,), entries, (None,), (True,))  # the SSD policy hears the hit
                elif not verdict.admits(i):
                    misses += scored
                    ssd_refused += scored
                else:
                    misses += scored
                    ssd_writes += scored
                    res = index.reserve()  # evicts by the SSD policy when the tier is full
                    if res is None:
                        raise RuntimeError(f"{ssd.name}: the SSD tier found no victim ({len(index)}/{ssd_blocks})")
                    index.commit(k, res, _BLOCK, 1)
            elif k in ssd_set:
                ssd_hits += scored
            elif not verdict.admits(i):
                misses += scored
                ssd_refused += scored
            else:
                misses += scored
                ssd_writes += scored
                ssd_set.add(k)
            if host_blocks <= 0:
                continue
            if host_used + 1 > host_blocks:
                t0 = perf_ns() if decision_ns is not None else 0
                for v in host.victims(host_used + 1 - host_blocks, always):
                    host.on_remove(v)
                    host_used -= 1
                    evictions += 1
                if decision_ns is not None:
                    decision_ns.append(perf_ns() - t0)
                if host_used + 1 > host_blocks:
                    raise RuntimeError(f"{host.name}: victims() freed too little ({host_used}/{host_blocks})")
            host.on_insert(k, 1)
            host_used += 1
        host.on_request_finished(chain, r.output_length, r.timestamp)
        if progress is not None:
            progress(1)
    out = {
        "accesses": accesses,
        "host_hits": host_hits,
        "ssd_hits": ssd_hits,
        "misses": misses,
        "host_evictions": evictions,
    }
    if admission is not None:  # blocks written to SSD, and missed blocks kept off it
        out.update(ssd_writes=ssd_writes, ssd_refused=ssd_refused)
    return out


def _admission(policy: AdmissionPolicy | None, chain: Sequence[int], host: EvictionPolicy, ssd: Any) -> Decision:
    """The SSD admission verdict for a request with block keys `chain` at its arrival."""
    if policy is None:
        return ADMIT_ALL
    depth = 0
    for k in chain:
        if k not in host and k not in ssd:
            break
        depth += 1
    return policy.decide(AdmissionQuery(depth, chain if policy.needs_keys else ()))


#: what the replay's SSD index records per block (one block = one slot; no bytes move)
_BLOCK = ChunkMeta(1, (1,), "uint8", "block")


def ssd_index(policy: EvictionPolicy, blocks: int, clock: Callable[[], float]) -> SlotIndex:
    """The production SSD tier's index (`SlotIndex`: slots, generations, eviction through its policy) with one
    slot per block and no I/O: the replay's SSD tier is the same object the SSD tier runs."""
    return SlotIndex(blocks, policy, slot_size=1, pin_timeout_s=0.0, clock=clock)


def _always(_key) -> bool:
    return True


def replay_one(
    reqs: Sequence[TraceRequest],
    policy: str,
    host: Capacity,
    ssd: Capacity | None = None,
    ssd_policy: str = "lru",
    policy_kwargs: dict | None = None,
    progress: Callable[[int], None] | None = None,
    score_from: float | None = None,
    decision_ns: list[int] | None = None,
    ssd_admission: str = "all",
) -> ReplayResult:
    """Replay `reqs` with `policy` governing the host tier (and `ssd_policy` a bounded SSD tier; `ssd_admission`
    its write admission). `vllm-*` policies are vLLM's own CPU-offload manager (`kvtier.replay.vllm_offload`), where
    vLLM can be imported."""
    name = POLICY_ALIASES.get(policy, policy)
    if vllm_offload.is_vllm_policy(name):
        if ssd_admission != "all":
            raise ValueError(f"{name}: vLLM's CPU-offload manager is replayed without SSD admission")
        return _replay_vllm(reqs, name, host, ssd, progress, score_from)
    clock = ReplayClock()
    hp = build_policy(name, clock, host.blocks, **(policy_kwargs or {}))
    if name == "belady":
        hp.set_future(host_key_sequence(reqs))  # type: ignore[attr-defined]
    sp = None
    if ssd is not None and ssd.blocks is not None:
        if ssd_policy == "belady":
            raise ValueError("belady cannot govern the SSD tier in a replay (its future depends on the host tier)")
        sp = build_policy(ssd_policy, clock, ssd.blocks)
    t0 = time.perf_counter()
    c = simulate(reqs, hp, host.blocks or 0, sp, ssd.blocks if ssd else None, clock, progress, score_from, decision_ns,
                 admission=make_admission(ssd_admission))
    dt = time.perf_counter() - t0
    n = max(c["accesses"], 1)
    extra = {}
    stats = getattr(hp, "stats", None)
    if callable(stats):
        extra = stats()
    uniq = unique_blocks(r for r in reqs if score_from is None or r.timestamp >= score_from)
    return ReplayResult(
        policy=name,
        host_capacity=host.label,
        host_capacity_blocks=host.blocks or 0,
        host_capacity_fraction=(host.blocks or 0) / uniq if uniq else 0.0,
        ssd_capacity=ssd.label if ssd else "inf",
        ssd_capacity_blocks=ssd.blocks if ssd else None,
        requests=len(reqs),
        accesses=c["accesses"],
        host_hits=c["host_hits"],
        ssd_hits=c["ssd_hits"],
        misses=c["misses"],
        hit_rate=c["host_hits"] / n,
        ssd_hit_rate=c["ssd_hits"] / n,
        host_evictions=c["host_evictions"],
        seconds=dt,
        extra=extra,
        ssd_admission=ssd_admission,
        ssd_writes=c["ssd_writes"],
        ssd_refused=c["ssd_refused"],
    )


def _replay_vllm(reqs, name, host, ssd, progress, score_from) -> ReplayResult:
    if ssd is not None and ssd.blocks is not None:
        raise ValueError(f"{name}: vLLM's CPU-offload manager is replayed over an unbounded SSD tier only "
                         f"(leave --ssd-capacity at inf)")
    if host.blocks is None:
        raise ValueError(f"{name}: needs a bounded host capacity")
    t0 = time.perf_counter()
    c = vllm_offload.simulate(reqs, name, host.blocks, score_from=score_from, progress=progress)
    dt = time.perf_counter() - t0
    n = max(c["accesses"], 1)
    uniq = unique_blocks(r for r in reqs if score_from is None or r.timestamp >= score_from)
    return ReplayResult(
        policy=name, host_capacity=host.label, host_capacity_blocks=host.blocks,
        host_capacity_fraction=host.blocks / uniq if uniq else 0.0, ssd_capacity="inf", ssd_capacity_blocks=None,
        requests=len(reqs), accesses=c["accesses"], host_hits=c["host_hits"], ssd_hits=c["ssd_hits"],
        misses=c["misses"], hit_rate=c["host_hits"] / n, ssd_hit_rate=c["ssd_hits"] / n,
        host_evictions=c["host_evictions"], seconds=dt, extra={"vllm": vllm_offload.vllm_version()},
    )


def known_policy(name: str) -> bool:
    return policy_class(name) is not None or vllm_offload.is_vllm_policy(name)


# ---------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", help="request trace (JSON lines)")
    parser.add_argument("--format", choices=["mooncake", "bailian"], default=None, help="default: sniffed")
    parser.add_argument(
        "--policies",
        default=None,
        help="comma list of policies (lru, fifo, lfu, arc, s3fifo, answer-length, adaptive, belady; and vLLM's own "
        "CPU-offload manager where vLLM can be imported: vllm-lru, vllm-arc, vllm-lru-t2, vllm-arc-t2); default: "
        f"{DEFAULT_POLICIES}, plus vllm-lru,vllm-arc when vLLM ships its CPU-offload manager here",
    )
    parser.add_argument(
        "--host-capacity",
        default="0.02,0.05",
        help="comma list; a number <= 1 is a fraction of the trace's unique blocks, else GB (or 20GiB, 500blocks)",
    )
    parser.add_argument("--ssd-capacity", default="inf", help="like --host-capacity; default unbounded")
    parser.add_argument("--ssd-policy", default=None, help="policy of a bounded SSD tier (default lru)")
    parser.add_argument("--kv-transfer-config", metavar="FILE", default=None,
                        help="replay the host tier's policy (the LMCache YAML's cache_policy) and a bounded SSD tier's "
                             "(kvtier.eviction_policy) that this vLLM --kv-transfer-config JSON (or LMCache YAML) "
                             "sets; not with --policies or --ssd-policy")
    parser.add_argument("--ssd-admission", default="all",
                        help="comma list of the SSD tier's write admission policies (kvtier.ssd_admission: "
                             f"{', '.join(ADMISSION_POLICIES)}); prints SSD bytes written, SSD hits and bytes "
                             "written per hit for each")
    parser.add_argument("--block-bytes", type=int, default=DEFAULT_BLOCK_BYTES, help="bytes per block for GB sizes")
    parser.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    parser.add_argument("--until", type=float, default=None,
                        help="replay only requests that arrive before this time (seconds from the trace start)")
    parser.add_argument("--score-from", type=float, default=None,
                        help="count hits only for requests from this time on (seconds); earlier ones warm the tiers "
                             "and the policies up. Fractional capacities are then fractions of the unique blocks "
                             "of the scored requests")
    parser.add_argument("--json", dest="json_out", default=None, help="write results as JSON here")
    parser.add_argument("--plot", default=None, help="write a PNG of hit rate against host capacity here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


DEFAULT_POLICIES = "lru,arc,s3fifo,answer-length,adaptive,belady"


def _file_policies(args: argparse.Namespace) -> tuple[str, str]:
    """(host policy, SSD policy) of --kv-transfer-config's file; a contradicting flag is an error naming both."""
    path = args.kv_transfer_config
    clash = [flag for flag, value in (("--policies", args.policies), ("--ssd-policy", args.ssd_policy))
             if value is not None]
    if clash:
        raise SystemExit(f"kvtier replay: {' and '.join(clash)} contradict --kv-transfer-config {path}: the file "
                         "sets the host and SSD tiers' policies; give one or the other")
    from kvtier.replay.transfer_config import load_transfer_config, unmodelled
    from kvtier.storage_backends.config import ConfigError

    try:
        tc = load_transfer_config(path)
    except ConfigError as e:
        raise SystemExit(f"kvtier replay: --kv-transfer-config {path}: {e}") from None
    host = (f"cache_policy {tc.cache_policy}" if tc.cache_policy is not None else
            "no cache_policy: LMCache's default LRU, which is kvtier's lru")
    bounded = parse_capacity(args.ssd_capacity, 1).blocks is not None
    print(f"--kv-transfer-config {path} (LMCache config {tc.lmcache_file}) in effect: host tier {tc.host_policy} "
          f"({host}), SSD tier {tc.ssd_policy} (kvtier.eviction_policy"
          f"{'' if bounded else '; unused: --ssd-capacity is unbounded'}); capacities from --host-capacity and "
          "--ssd-capacity")
    ignored = unmodelled(tc, ("cache_policy", "kvtier.eviction_policy"))
    if ignored:
        logger.warning("kvtier replay: %s sets keys the replay does not model, ignored: %s (the replay models the "
                       "tiers' eviction policies only: capacities come from --host-capacity and --ssd-capacity, "
                       "there is no scheduler, no cost and no transport)", path, ", ".join(ignored))
    return tc.host_policy, tc.ssd_policy


def run(args: argparse.Namespace) -> int:
    ssd_policy = args.ssd_policy if args.ssd_policy is not None else "lru"
    names = args.policies
    if args.kv_transfer_config is not None:
        names, ssd_policy = _file_policies(args)
    try:
        reqs = read_trace(args.trace, args.format, args.limit)
    except (OSError, ValueError) as e:
        raise SystemExit(f"kvtier replay: {input_error(e)}") from None
    if args.until is not None:
        reqs = [r for r in reqs if r.timestamp < args.until]
    if not reqs:
        print(f"{args.trace}: no requests", file=sys.stderr)
        return 1
    scored = reqs if args.score_from is None else [r for r in reqs if r.timestamp >= args.score_from]
    if not scored:
        print(f"{args.trace}: no requests at or after --score-from {args.score_from}", file=sys.stderr)
        return 1
    uniq = unique_blocks(scored)
    if names is None:
        names = DEFAULT_POLICIES + (",vllm-lru,vllm-arc" if vllm_offload.installed() else "")
    policies = [POLICY_ALIASES.get(p.strip(), p.strip()) for p in names.split(",") if p.strip()]
    for p in policies:  # fail before replaying anything
        if not known_policy(p):
            raise SystemExit(f"kvtier replay: unknown eviction policy {p!r}; choose from "
                             f"{policy_names() + sorted(vllm_offload.VLLM_POLICIES)}")
    if any(vllm_offload.is_vllm_policy(p) for p in policies) and not vllm_offload.available():
        vllm_offload.simulate([], next(p for p in policies if vllm_offload.is_vllm_policy(p)), 1)  # raises: why
    admissions = [a.strip() for a in args.ssd_admission.split(",") if a.strip()]
    bad = [a for a in admissions if a not in ADMISSION_POLICIES]
    if bad or not admissions:
        raise SystemExit(f"kvtier replay: --ssd-admission {args.ssd_admission!r}: choose from "
                         f"{', '.join(ADMISSION_POLICIES)}")
    try:
        hosts = [parse_capacity(c, uniq, args.block_bytes) for c in args.host_capacity.split(",") if c.strip()]
        ssd = parse_capacity(args.ssd_capacity, uniq, args.block_bytes)
    except ValueError as e:
        raise SystemExit(f"kvtier replay: {e}") from None
    logger.info(
        "%s: %d requests, %d block accesses, %d unique blocks", args.trace, len(reqs),
        sum(len(r.hash_ids) for r in reqs), unique_blocks(reqs),
    )
    results: list[ReplayResult] = []
    total = len(reqs) * len(policies) * len(hosts) * len(admissions)
    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="req", desc="replay", file=sys.stderr, dynamic_ncols=True)
    try:
        for host in hosts:
            for p in policies:
                for adm in admissions:
                    if bar is not None:
                        bar.set_postfix_str(f"{p}@{host.label}")
                    results.append(replay_one(reqs, p, host, ssd, ssd_policy, progress=bar.update if bar else None,
                                              score_from=args.score_from, ssd_admission=adm))
    finally:
        if bar is not None:
            bar.close()
    if args.score_from is not None:
        print(f"scored: requests from t = {args.score_from:g} s on ({len(scored)} of {len(reqs)}); capacities as "
              f"fractions of their {uniq} unique blocks")
    print(format_table(results))
    if admissions != ["all"]:
        print(format_admission(results, args.block_bytes))
    print(format_differences("replay"))
    versions = {r.extra["vllm"] for r in results if "vllm" in r.extra}
    if versions:
        print(f"vllm-* rows: vLLM {', '.join(sorted(versions))}'s own CPUOffloadingManager and cache policies")
    if args.json_out:
        write_json(args.json_out, args.trace, uniq, results)
        logger.info("wrote %s", args.json_out)
    if args.plot:
        plot(results, args.plot, title=args.trace)
        logger.info("wrote %s", args.plot)
    return 0


def format_table(results: Sequence[ReplayResult]) -> str:
    head = (f"{'policy':<14} {'host cap':>9} {'blocks':>8} {'hit rate':>9} {'ssd hits':>9} {'evictions':>10} "
            f"{'time s':>7}")
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(
            f"{r.policy:<14} {r.host_capacity:>9} {r.host_capacity_blocks:>8} {100 * r.hit_rate:>8.2f}% "
            f"{100 * r.ssd_hit_rate:>8.2f}% {r.host_evictions:>10} {r.seconds:>7.2f}"
        )
    return "\n".join(lines)


def format_admission(results: Sequence[ReplayResult], block_bytes: int) -> str:
    """SSD write admission per row: blocks and bytes written to SSD, SSD hits, bytes written per SSD hit."""
    head = (f"{'policy':<14} {'host cap':>9} {'ssd admission':<13} {'ssd writes':>10} {'GB written':>10} "
            f"{'ssd hits':>9} {'MB written/hit':>14}")
    lines = [head, "-" * len(head)]
    for r in results:
        per_hit = f"{r.ssd_writes * block_bytes / r.ssd_hits / 1e6:>14.2f}" if r.ssd_hits else f"{'-':>14}"
        lines.append(f"{r.policy:<14} {r.host_capacity:>9} {r.ssd_admission:<13} {r.ssd_writes:>10} "
                     f"{r.ssd_writes * block_bytes / 1e9:>10.3f} {r.ssd_hits:>9} {per_hit}")
    return "\n".join(lines)


def write_json(path: str, trace: str, uniq: int, results: Sequence[ReplayResult]) -> None:
    doc = {"trace": str(trace), "unique_blocks": uniq, "results": [asdict(r) for r in results]}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2, default=_json_default)


def _json_default(o):
    if isinstance(o, float) and math.isinf(o):
        return None
    return str(o)


def plot(results: Sequence[ReplayResult], path: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    by_policy: dict[str, list[ReplayResult]] = {}
    for r in results:
        by_policy.setdefault(r.policy, []).append(r)
    for name, rs in by_policy.items():
        rs = sorted(rs, key=lambda r: r.host_capacity_blocks)
        ax.plot(
            [100 * r.host_capacity_fraction for r in rs], [100 * r.hit_rate for r in rs], marker="o", label=name,
            linestyle="--" if name == "belady" else "-",
        )
    ax.set_xlabel("host capacity (% of unique blocks)")
    ax.set_ylabel("host hit rate (% of block accesses)")
    if title:
        ax.set_title(str(title).rsplit("/", 1)[-1], fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
