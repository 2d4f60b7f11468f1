"""`kvtier demo-vllm`: the main job. Replays multi-turn conversations of the Mooncake trace through real vLLM,
four times.

Run 1 is vLLM alone (its own prefix caching, with a small KV-cache budget, as on a busy server where a
conversation's history does not stay in GPU memory between turns). Run 2 is the same engine with kvtier: the KV
connector (`kvtier.connector.KVTierConnector`: LMCache's host tier + kvtier's SSD tier) and the dual-queue scheduler
hook (`kvtier.scheduler_hooks.DualQueueScheduler`). Each engine runs in its own subprocess on vLLM's CPU build with a
tiny random Llama (built with transformers, no download), prompts as token ids.

The workload: whole conversations of the shipped Mooncake conversation trace (read with `read_mooncake`, sessions
recovered from the prefix chains), scaled to the tiny model: a turn-1 prompt is its trace blocks (one 512-token hash
id -> `--block-tokens` token ids, so the shared system-prompt block is shared here too); a follow-up turn is the
previous prompt + the answer the model generated + a new user message (the trace's new input, scaled). Timing is
compressed: requests keep their trace arrival order, at most `--concurrency` are in flight, and a turn is sent only
after the previous turn of its conversation finished. TTFT is measured per request (engine step loop driven here).

Run 3 (`--ideal`, on by default) is the limit: vLLM alone with a KV budget that holds every conversation, so every
follow-up turn prefills only its new tokens; the demo prints kvtier's share of the achievable gain,
(TTFT alone - TTFT kvtier) / (TTFT alone - TTFT ideal), and where each hit kvtier missed went (the connector's
lost-hit ledger, `kvtier.telemetry.lost_hits`).

Run 4 (`--lmcache-mp`, on by default) is the same engine with LMCache's multiprocess mode instead: LMCache's
`LMCacheMPConnector` and a real `lmcache server` (L1 = the kvtier host tier's size, evicting half of itself above
50%: LMCache's defaults, 0.8 / 0.2, leave too little room for this workload's requests, and LMCache then drops
stores and prefetches) with LMCache's own `fs` L2 adapter on the same disk. Its engine core runs in its own process
(LMCache's connector cannot run in-process), so its engine start is longer; vLLM reports its reuse as one number per
request, and the L1 / L2 split comes from the server's metrics.

This module parses the options and runs the comparison; `conversations` builds the workload, `demo_vllm_engine`
runs one engine process, `demo_vllm_report` prints the tables and draws the plot.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvtier.cli.conversations import workload_of
from kvtier.cli.demo_vllm_engine import RunResult, engine_main, run_engine
from kvtier.cli.demo_vllm_report import (
    LMCACHE_CPU_NOTE,
    FollowUps,
    plot,
    print_spread,
    report,
    report_ideal,
    report_lmcache_mp,
    report_lost_hits,
)
from kvtier.cli.engine_args import add_engine_arguments
from kvtier.launch.demo_model import KV_BYTES_PER_TOKEN, MODEL
from kvtier.launch.lmcache_yaml import write_lmcache_yaml
from kvtier.storage_backends.eviction import production_policy_names
from kvtier.storage_backends.lmcache.host_policy import lmcache_name

# engine_main: the engine process's entry point, importable from here as before
__all__ = ["add_arguments", "engine_main", "run"]

LMCACHE_MP_NOTE = (
    "LMCache's multiprocess mode does run on CPU: the third column is vLLM + LMCache's `LMCacheMPConnector` + "
    "`lmcache server` (L1 = the kvtier host tier's size) with LMCache's own `fs` L2 adapter on the same disk.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p, block_tokens=64, host_mb=None, ssd_mb=256, conversations=16, max_prompt_tokens=3072,
                         answer_tokens=24)
    p.add_argument("--concurrency", type=int, default=2, help="requests in flight at once")
    p.add_argument("--gpu-blocks", type=int, default=None,
                   help="vLLM KV-cache budget in blocks of --page-tokens (default: room for --concurrency of the "
                        "longest requests, at most a third of the replay's history, at least one longest request)")
    p.add_argument("--ssd-path", default=None, help="SSD tier directory (default: inside the work directory)")
    p.add_argument("--plot", default="kvtier-demo.png", help="PNG plot of TTFT per turn (both runs)")
    p.add_argument("--timeout", type=float, default=420, help="seconds one engine run may take")
    p.add_argument("--lmcache-mp", action=argparse.BooleanOptionalAction, default=True,
                   help="also run vLLM + LMCache's multiprocess server with LMCache's own `fs` L2 adapter (a third "
                        "column; its L1 is the kvtier host tier's size)")
    p.add_argument("--mp-port", type=int, default=0, help="port of that `lmcache server` (default: a free one)")
    p.add_argument("--mp-http-port", type=int, default=0, help="its HTTP admin port (default: a free one)")
    p.add_argument("--ideal", action=argparse.BooleanOptionalAction, default=True,
                   help="also run the limit: vLLM alone with a KV budget that holds every conversation (prefix "
                        "caching on, nothing evicted); prints kvtier's share of the achievable gain and where the "
                        "hits kvtier missed went")
    p.add_argument("--eviction-policy", default=None, metavar="NAME",
                   help="kvtier's eviction policy in both tiers (the host tier's cache_policy KVTIER_<NAME> and "
                        "kvtier.eviction_policy), e.g. adaptive; default: the shipped YAML's (LRU in both)")
    p.add_argument("--record-host-policy", default=None, metavar="DIR",
                   help="record the host tier's policy stream into DIR (kvtier.record_host_policy; needs "
                        "--eviction-policy); replay it with `kvtier replay-stream DIR/host-policy-*.jsonl`")
    p.add_argument("--repeat", type=int, default=1,
                   help="run the whole comparison this many times (fresh engines and SSD tier each time) and print "
                        "the spread: min / median / max of the mean follow-up speed-up and each side's slowest "
                        "follow-up turn (the full tables are printed for the last run)")


def run(args: argparse.Namespace) -> int:
    t_all = time.perf_counter()
    if args.chunk_tokens % args.page_tokens:
        print(f"--chunk-tokens {args.chunk_tokens} must be a multiple of --page-tokens {args.page_tokens}")
        return 2
    if args.repeat < 1:
        print(f"--repeat must be at least 1, got {args.repeat}")
        return 2
    if args.eviction_policy is not None and args.eviction_policy not in production_policy_names():
        print(f"--eviction-policy {args.eviction_policy!r}: choose one of {', '.join(production_policy_names())}")
        return 2
    if args.record_host_policy is not None and args.eviction_policy is None:
        print("--record-host-policy records a kvtier policy in the host tier: name it with --eviction-policy")
        return 2
    workload = workload_of(args)
    if isinstance(workload, str):
        print(workload)
        return 2
    turns, longest = workload
    n_conv = len({t.conv for t in turns})
    page = args.page_tokens
    max_model_len = -(-longest // page) * page
    # the history the replay builds up: the final prompt + answer of every conversation
    history_tokens = sum(len(t.new_tokens) + t.max_tokens for t in turns)
    history_mb = history_tokens * KV_BYTES_PER_TOKEN / 2**20
    # vLLM's KV budget: room for `concurrency` of the longest requests, but at most a third of the history (as on a
    # busy server, a conversation's history does not stay in vLLM's cache until its next turn), and never less
    # than one longest request (vLLM refuses to start otherwise)
    longest_blocks = max_model_len // page
    gpu_blocks = args.gpu_blocks or max(longest_blocks + 1, min(args.concurrency * longest_blocks + 1,
                                                                 -(-history_tokens // page) // 3))
    # the limit: room for every conversation's whole history, the requests in flight and the warm-up
    by_conv: dict[int, int] = {}
    for t in turns:
        by_conv[t.conv] = by_conv.get(t.conv, 0) + len(t.new_tokens) + t.max_tokens
    ideal_blocks = sum(-(-n // page) for n in by_conv.values()) + (args.concurrency + 1) * longest_blocks + 16
    # host tier: half of the history (the rest comes back from the SSD tier), and room for a few of the longest
    # requests at least (LMCache only stores what it can first place in host memory)
    host_mb = args.host_mb if args.host_mb is not None else round(
        max(history_mb / 2, 3 * longest * KV_BYTES_PER_TOKEN / 2**20), 2)

    own = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-demo-vllm-") if own else args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    ssd_dir = args.ssd_path or str(workdir / "ssd")
    if os.path.exists(ssd_dir) and args.ssd_path is None:
        shutil.rmtree(ssd_dir)
    yaml_path = workdir / "lmcache-kvtier.yaml"
    _lmcache_yaml(yaml_path, args.chunk_tokens, host_mb, ssd_dir, args.ssd_mb, args.eviction_policy,
                  args.record_host_policy)
    kv_cfg = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.connector",
              "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
              "engine_id": f"kvtier-demo-{os.getpid()}", "kv_connector_extra_config": {"config_file": str(yaml_path)}}
    base_args = {
        "model": str(workdir / "model"), "page_tokens": page, "chunk_tokens": args.chunk_tokens,
        "max_model_len": max_model_len, "gpu_blocks": gpu_blocks, "concurrency": args.concurrency,
        "turns": [{"conv": t.conv, "turn": t.turn, "new_tokens": t.new_tokens, "max_tokens": t.max_tokens}
                  for t in turns],
    }
    print(f"kvtier vLLM demo: {n_conv} conversations x {args.turns} turns ({len(turns)} requests) of {args.trace}")
    print(f"  workload: one 512-token trace block -> {args.block_tokens} token ids; a follow-up turn = history "
          f"(previous prompt + generated answer) + new message; answers {min(t.max_tokens for t in turns)}-"
          f"{max(t.max_tokens for t in turns)} tokens (greedy); {args.concurrency} requests in flight, trace "
          f"arrival order, a turn waits for its conversation's previous turn")
    print(f"  model: random {MODEL['num_hidden_layers']}-layer Llama (hidden {MODEL['hidden_size']}, fp32, "
          f"{KV_BYTES_PER_TOKEN} B of KV per token) on vLLM's CPU build; vLLM KV budget {gpu_blocks} blocks x "
          f"{page} tokens = {gpu_blocks * page} tokens (the replay's history: {history_tokens} tokens, "
          f"{history_mb:.1f} MiB), prefix caching on")
    print(f"  kvtier: connector + DualQueueScheduler; host tier {host_mb:g} MiB, SSD tier {args.ssd_mb:g} MiB at "
          f"{ssd_dir}; {args.chunk_tokens}-token chunks; eviction "
          f"{args.eviction_policy or 'lru (the shipped YAML)'} in both tiers")
    print(f"  {LMCACHE_CPU_NOTE}")
    if args.ideal:
        print(f"  the limit (column 'ideal'): vLLM alone with {ideal_blocks} blocks ({ideal_blocks * page} tokens), "
              "room for every conversation: nothing evicted, every follow-up turn prefills only its new tokens")
    if args.lmcache_mp:
        print(f"  {LMCACHE_MP_NOTE}")
    sys.stdout.flush()
    rc = 0
    spread: list[FollowUps] = []
    for i in range(args.repeat):
        mp = ideal = None
        last = i == args.repeat - 1
        if args.repeat > 1:
            print(f"\n== run {i + 1} of {args.repeat}", flush=True)
            if args.ssd_path is None:  # every run starts from an empty SSD tier, as the first one does
                shutil.rmtree(ssd_dir, ignore_errors=True)
        try:
            base = run_engine("baseline", "vLLM, no connector", workdir, base_args, len(turns), args.timeout)
            kvt = run_engine("kvtier", "vLLM + kvtier", workdir, dict(
                base_args, kv_transfer_config=dict(kv_cfg, engine_id=f"{kv_cfg['engine_id']}-{i}"),
                scheduler_cls="kvtier.scheduler_hooks.DualQueueScheduler"), len(turns), args.timeout)
            if args.ideal:
                ideal = run_engine("ideal", "vLLM, room for all", workdir, dict(base_args, gpu_blocks=ideal_blocks),
                                   len(turns), args.timeout)
            if args.lmcache_mp:
                mp = _run_lmcache_mp(workdir, base_args, host_mb, args, len(turns))
        except RuntimeError as e:
            print(f"\nERROR: {e}")
            if own:
                print(f"(work directory kept: {workdir})")
            return 1
        rc = max(rc, report(base, kvt, turns, args, full=last))
        if ideal is not None:
            rc = max(rc, report_ideal(base, kvt, ideal, turns))
        report_lost_hits(kvt, ideal)
        if mp is not None:
            rc = max(rc, report_lmcache_mp(base, kvt, mp, turns))
        spread.append(FollowUps.of(base, kvt, ideal))
    if args.repeat > 1:
        print_spread(spread)
    if args.json:
        Path(args.json).write_text(json.dumps({"baseline": base.raw, "kvtier": kvt.raw,
                                               **({"ideal": ideal.raw} if ideal is not None else {}),
                                               **({"lmcache_mp": mp.raw} if mp is not None else {})}, indent=1))
    plot(base, kvt, args.plot, mp, ideal)
    if own and rc == 0:
        shutil.rmtree(workdir, ignore_errors=True)
    elif own:
        print(f"(work directory kept: {workdir})")
    print(f"\ndemo wall time {time.perf_counter() - t_all:.0f} s")
    return rc


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_lmcache_mp(workdir: Path, base_args: dict[str, Any], host_mb: float, args: argparse.Namespace,
                    n_turns: int) -> RunResult:
    """vLLM + LMCache's multiprocess server with LMCache's own `fs` L2 adapter, on the same conversations."""
    from kvtier.launch.lmcache_server import MPServer

    fs_dir = workdir / "lmcache-fs"
    shutil.rmtree(fs_dir, ignore_errors=True)
    fs_dir.mkdir(parents=True)
    # LMCache evicts L1 once a second above the watermark; 0.5 / 0.5 keeps room for the next stores and prefetches
    srv = MPServer(args.mp_port or _free_port(), args.mp_http_port or _free_port(),
                   [{"type": "fs", "base_path": str(fs_dir)}], str(workdir / "lmcache-server.log"),
                   l1_gb=host_mb / 1024, chunk_size=args.chunk_tokens, eviction_watermark=0.5, eviction_ratio=0.5)
    kv = {"kv_connector": "LMCacheMPConnector",
          "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector", "kv_role": "kv_both",
          "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": srv.port}}
    with srv:
        return run_engine("lmcache_mp", "vLLM + LMCache MP (fs)", workdir,
                          dict(base_args, kv_transfer_config=kv, lmcache_mp_url=srv.url), n_turns, args.timeout,
                          env_extra={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})


def _lmcache_yaml(path: Path, chunk: int, host_mb: float, ssd_dir: str, ssd_mb: float,
                  eviction_policy: str | None = None, record_host_policy: str | None = None) -> None:
    """The shipped `configs/lmcache-kvtier.yaml` with the demo's sizes and paths, page-first chunks,
    `eviction_policy` (a production policy's name) in both tiers when given, and the directory where the host tier
    records its policy stream (`kvtier.record_host_policy`) when given."""
    extra: dict[str, str] = {"chunk_format": "page_first"}
    if record_host_policy is not None:
        extra["record_host_policy"] = str(Path(record_host_policy).resolve())
    replace = None
    if eviction_policy is not None:
        extra["eviction_policy"] = eviction_policy
        replace = {"# cache_policy: KVTIER_ADAPTIVE": f"cache_policy: {lmcache_name(eviction_policy)}"}
    write_lmcache_yaml(path, ssd_path=ssd_dir, chunk_size=chunk, host_gb=f"{host_mb / 1024:.9f}",
                       ssd_capacity_gb=f"{ssd_mb / 1024:.9f}", extra=extra, replace=replace)

