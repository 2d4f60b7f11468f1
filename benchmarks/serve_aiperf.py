"""`vllm serve` with and without kvtier, driven by aiperf (NVIDIA's benchmark client, PyPI `aiperf`).

    python3 -m venv /tmp/aiperf-venv && /tmp/aiperf-venv/bin/pip install aiperf==0.13.0   # its own environment
    .venv/bin/python benchmarks/serve_aiperf.py --aiperf /tmp/aiperf-venv/bin/aiperf [--rounds 3] [--concurrency 4]
        [--workloads reuse] [--no-ideal] [--json out.json] [--kvtier-connector '{"async_saves": false}']
        [--ssd-admission all|continuing|second-sight|none] [--kvtier-variant 'NAME={"sync_load_budget_tokens": 0}']

Servers of the demo model (`kvtier demo-model`: tiny random Llama + the shipped tokenizer) on vLLM's CPU build,
with identical vLLM settings: `base` (vLLM alone, its own prefix cache of `--gpu-blocks`), `kvtier` (the same plus
kvtier's connector and `--scheduler-cls kvtier.scheduler_hooks.DualQueueScheduler`) and, unless `--no-ideal`,
`ideal` (vLLM alone with a KV cache that holds every request of one round: `ideal_blocks`, printed with its MiB;
the log's KV cache size is checked), plus one kvtier server per `--kvtier-variant NAME=JSON` (`kvtier-NAME`: other
connector options, its own SSD tier; reported against the same rounds' base and ideal runs). All run at the same
time but only one is loaded at a time; per round, each workload runs on each server, in an order that rotates by one
each round (`--workloads` picks the workloads):

- `reuse`: the shipped Mooncake conversation trace (`demo_data/mooncake_conversation_sessions.jsonl`, 60 whole
  conversations) replayed by aiperf's `mooncake_trace` loader at a fixed concurrency (equal load), with one
  512-token trace block scaled to `--block-tokens` tokens and answers scaled alike; requests whose scaled prompt
  exceeds `--max-prompt-tokens` are held out (reported). A *follow-up turn* is a request that shares at least
  two leading blocks with an earlier one (block 0 is the trace's common system prompt).
- `no-reuse`: the same requests (same lengths, same concurrency) with every block made unique: no prefix is
  ever reused, so what kvtier costs (lookups, saves, SSD writes) is all that differs. The ideal server skips it.

Every round uses a new `--random-seed` for aiperf (new prompt text), so no round finds the previous one's KV.
Printed (`serve_report.py`): TTFT mean / p50 / p99 of all requests, of follow-up turns and of first turns,
requests/s and output tokens/s per server, with base/kvtier TTFT ratios (speed-up) and kvtier/base throughput
ratios, per round, as the ratio of the medians and as the median of the per-round ratios (paired rounds: what the
targets are judged on); on `reuse`, kvtier's share of the achievable gain (base - kvtier) / (base - ideal) of
follow-up TTFT mean, p50 and p99 per round and as min / median / max, the hit tokens of each server per round
(/metrics deltas: vLLM's prefix-cache and external hits, kvtier's hits by tier) and kvtier's lost hits by reason
(`kvtier_connector_{ideal,lost,beyond_ideal}_hit_tokens_total`; zeros where the server has no such counters).
Targets: issue 16, follow-up-turn TTFT >= 2x better at equal load, <= 3% throughput lost without reuse; issue 52,
share of the achievable gain (follow-up mean) >= 0.85 and follow-up mean TTFT >= 3x vLLM alone, at the median of
>= 3 rounds, at concurrency 2 and 4.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from serve_report import LOST_REASONS, TIERS, report  # the sibling module (benchmarks/ is the script's sys.path[0])

from kvtier.cli.demo_vllm_report import quantile
from kvtier.demo_data import path as data_path
from kvtier.launch.demo_model import KV_BYTES_PER_TOKEN, build
from kvtier.testing.serve_process import ServeProcess, free_port

TRACE_BLOCK = 512  # tokens per Mooncake hash id
TOKENIZER_REPO = "local/kvtier-tiny"
SNAPSHOT = "0" * 40
Snapshot = dict[tuple[str, tuple], float]  # ServeProcess.metrics(): {(sample name, labels): value}


# --------------------------------------------------------------------------------------------- workloads
def read_trace(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def scale(rows: list[dict[str, Any]], block: int, max_prompt: int, max_answer: int
          ) -> tuple[list[dict[str, Any]], int]:
    """Rows with prompts and answers scaled from 512-token blocks to `block` tokens; (rows, held out)."""
    out, held = [], 0
    for r in rows:
        n = len(r["hash_ids"])
        last = r["input_length"] - (n - 1) * TRACE_BLOCK
        tokens = (n - 1) * block + max(1, min(block, round(last * block / TRACE_BLOCK)))
        if tokens > max_prompt:
            held += 1
            continue
        answer = max(2, min(max_answer, round(r["output_length"] * block / TRACE_BLOCK)))
        out.append({"timestamp": r["timestamp"], "input_length": tokens, "output_length": answer,
                    "hash_ids": list(r["hash_ids"])})
    return out, held


def follow_ups(rows: list[dict[str, Any]]) -> list[bool]:
    """Whether each row shares >= 2 leading blocks with an earlier row (a conversation's later turn)."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for r in rows:
        h = tuple(r["hash_ids"])
        out.append(len(h) >= 2 and h[:2] in seen)
        for k in range(1, len(h) + 1):
            seen.add(h[:k])
    return out


def without_reuse(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same requests with every block unique (no shared prefix at all)."""
    nxt = 0
    out = []
    for r in rows:
        ids = list(range(nxt, nxt + len(r["hash_ids"])))
        nxt += len(ids)
        out.append(dict(r, hash_ids=ids))
    return out


def ideal_blocks(rows: list[dict[str, Any]], block: int, page: int, concurrency: int) -> int:
    """vLLM KV blocks of `page` tokens that keep every request of `rows` (one round) in the prefix cache at once:
    the pages of each distinct prefix of trace blocks (`block` tokens each; shared turns counted once), per request
    the pages of its answer plus one (the BOS token shifts a prompt off the page boundaries), `concurrency` of the
    longest requests in flight on top, and vLLM's null block."""
    pages = lambda tokens: -(-tokens // page)  # noqa: E731
    prefixes = {tuple(r["hash_ids"][:k]) for r in rows for k in range(1, len(r["hash_ids"]) + 1)}
    answers = sum(pages(r["output_length"]) + 1 for r in rows)
    longest = max((pages(r["input_length"] + r["output_length"] + 1) for r in rows), default=0)
    return len(prefixes) * pages(block) + answers + concurrency * longest + 1


def reusable_tokens(rows: list[dict[str, Any]], block: int, page: int) -> int:
    """Prompt tokens a prefix cache that never evicts could reuse, requests run one at a time: per request, the
    leading trace blocks an earlier request held whole (a last, partial block is not reusable), in whole pages, and
    never the prompt's last token (vLLM computes it). An upper bound on the ideal server's hits."""
    seen: set[tuple[int, ...]] = set()
    total = 0
    for r in rows:
        h = tuple(r["hash_ids"])
        k = 0
        while k < len(h) and h[:k + 1] in seen:
            k += 1
        total += min(k * block, (r["input_length"] - 1)) // page * page
        whole = len(h) if r["input_length"] >= len(h) * block else len(h) - 1
        seen.update(h[:j] for j in range(1, whole + 1))
    return total


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def hf_cache(model: Path, hf_home: Path) -> None:
    """The tokenizer laid out as a Hugging Face hub cache entry (`local/kvtier-tiny`): aiperf is offline."""
    snap = hf_home / "hub" / f"models--{TOKENIZER_REPO.replace('/', '--')}" / "snapshots" / SNAPSHOT
    snap.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copyfile(model / name, snap / name)
    refs = snap.parent.parent / "refs"
    refs.mkdir(exist_ok=True)
    (refs / "main").write_text(SNAPSHOT)


# --------------------------------------------------------------------------------------------- aiperf
def run_aiperf(aiperf: str, srv: ServeProcess, trace: Path, out: Path, args: argparse.Namespace, seed: int,
               hf_home: Path) -> list[dict[str, Any]]:
    """One aiperf profile of every request of `trace` against `srv`; its per-request records."""
    n_requests = sum(1 for line in trace.read_text().splitlines() if line.strip())
    env = dict(os.environ, HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("PYTHONPATH", None)
    cmd = [aiperf, "profile", "--model", srv.model, "--url", srv.url, "--endpoint-type", "completions",
           "--streaming", "--tokenizer", TOKENIZER_REPO, "--input-file", str(trace), "--custom-dataset-type",
           "mooncake_trace", "--isl-block-size", str(args.block_tokens), "--no-fixed-schedule",
           "--concurrency", str(args.concurrency), "--request-count", str(n_requests), "--random-seed", str(seed),
           "--extra-inputs",
           "ignore_eos:true", "--output-artifact-dir", str(out), "--ui-type", "none"]
    t0 = time.monotonic()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    (out / "aiperf.stdout").parent.mkdir(parents=True, exist_ok=True)
    (out / "aiperf.stdout").write_text(p.stdout + "\n" + p.stderr)
    if p.returncode != 0:
        raise RuntimeError(f"aiperf failed ({p.returncode}) after {time.monotonic() - t0:.0f} s:\n"
                           f"{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    found = sorted(out.rglob("profile_export.jsonl"))
    if not found:
        raise RuntimeError(f"aiperf wrote no profile_export.jsonl under {out}")
    return [json.loads(line) for line in found[0].read_text().splitlines() if line.strip()]


def _metric(rec: dict[str, Any], name: str) -> float | None:
    m = (rec.get("metrics") or {}).get(name)
    if m is None:
        return None
    return float(m["value"] if isinstance(m, dict) else m)


def summarize(records: list[dict[str, Any]], follow: list[bool]) -> dict[str, float]:
    """TTFT (ms) stats overall / follow-up turns / first turns, requests/s and output tokens/s, and the client's
    side of the load: requests in flight on average over the run (at most the concurrency) and the mean time from
    aiperf's credit (a free slot) to the request's start (ms); here the client shares the cores with the servers,
    so these say whether it kept the load it was asked for."""
    recs = []
    for rec in records:  # aiperf's mooncake_trace loader makes row i the conversation "session_<i>"
        md = rec.get("metadata") or {}
        conv = str(md.get("conversation_id", ""))
        idx = int(conv.rsplit("_", 1)[1]) if conv.rsplit("_", 1)[-1].isdigit() else md.get("session_num")
        recs.append((idx, rec, md))
    ttft = {"all": [], "follow": [], "first": []}
    starts, ends, out_tokens, errors, lags = [], [], 0, 0, []
    for i, (idx, rec, md) in enumerate(recs):
        if rec.get("error"):
            errors += 1
            continue
        t = _metric(rec, "time_to_first_token")
        if t is None:
            errors += 1
            continue
        ttft["all"].append(t)
        row = int(idx) if isinstance(idx, int) and 0 <= idx < len(follow) else i
        ttft["follow" if follow[row] else "first"].append(t)
        out_tokens += int(_metric(rec, "usage_completion_tokens") or _metric(rec, "output_sequence_length") or 0)
        starts.append(int(md.get("request_start_ns", 0)))
        ends.append(int(md.get("request_end_ns", 0)))
        if md.get("credit_issued_ns") is not None:
            lags.append((int(md["request_start_ns"]) - int(md["credit_issued_ns"])) / 1e6)
    wall = (max(ends) - min(starts)) / 1e9 if starts else float("nan")
    busy = sum(e - s for s, e in zip(starts, ends)) / 1e9  # request-seconds in flight
    out: dict[str, float] = {"requests": len(ttft["all"]), "errors": errors, "wall_s": wall,
                             "req_per_s": len(ttft["all"]) / wall if wall else float("nan"),
                             "out_tok_per_s": out_tokens / wall if wall else float("nan"),
                             "in_flight": busy / wall if wall else float("nan"),
                             "credit_to_start_ms": statistics.mean(lags) if lags else float("nan")}
    for k, xs in ttft.items():
        out[f"ttft_{k}_mean"] = statistics.mean(xs) if xs else float("nan")
        out[f"ttft_{k}_p50"] = quantile(xs, 0.5)
        out[f"ttft_{k}_p99"] = quantile(xs, 0.99)
        out[f"n_{k}"] = len(xs)
    return out


def engine_steps(before: Snapshot, after: Snapshot) -> dict[str, float]:
    """The kvtier server's engine steps and asynchronous loads between two /metrics snapshots: all steps, steps
    that scheduled nothing, steps while an asynchronous load was in flight (and per load)."""
    steps = "kvtier_connector_engine_steps_total"
    loads = _delta(before, after, "kvtier_connector_loads_total", (("mode", "async"),))
    during = _delta(before, after, steps, (("kind", "during_async_load"),))
    return {"steps": _delta(before, after, steps, (("kind", "all"),)),
            "idle_steps": _delta(before, after, steps, (("kind", "idle"),)),
            "steps_during_async_loads": during, "async_loads": loads,
            "delayed_frees": _delta(before, after, "kvtier_connector_delayed_frees_total"),
            "steps_per_async_load": during / loads if loads else float("nan")}


def _delta(before: Snapshot, after: Snapshot, name: str, labels: tuple = ()) -> float:
    return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)


def vllm_hits(before: Snapshot, after: Snapshot) -> dict[str, float]:
    """A server's prompt tokens between two /metrics snapshots: looked up in vLLM's prefix cache, found there,
    and found by the connector (external: kvtier's host and SSD tiers)."""
    return {"hit_queried": _delta(before, after, "vllm:prefix_cache_queries_total"),
            "hit_prefix": _delta(before, after, "vllm:prefix_cache_hits_total"),
            "hit_external": _delta(before, after, "vllm:external_prefix_cache_hits_total")}


def vllm_engine(before: Snapshot, after: Snapshot) -> dict[str, float]:
    """A server's engine between two /metrics snapshots: vLLM's steps (`vllm:iteration_tokens_total`'s count) and
    preemptions."""
    return {"preemptions": _delta(before, after, "vllm:num_preemptions_total"),
            "vllm_steps": _delta(before, after, "vllm:iteration_tokens_total_count")}


def kvtier_hits(before: Snapshot, after: Snapshot) -> dict[str, float]:
    """kvtier's hit tokens by tier between two /metrics snapshots, and its lost-hit accounting where the server
    has it (zeros otherwise): the tokens an unbounded prefix cache would have reused, those lost by reason, and
    those reused beyond it; and what its SSD tier wrote (bytes) against its SSD hits (chunks)."""
    hits, lost = "kvtier_connector_hit_tokens_total", "kvtier_connector_lost_hit_tokens_total"
    out = {f"kvtier_{t}": _delta(before, after, hits, (("tier", t),)) for t in TIERS}
    out["ideal_hit"] = _delta(before, after, "kvtier_connector_ideal_hit_tokens_total")
    out["ssd_written_bytes"] = _delta(before, after, "kvtier_ssd_written_bytes_total")
    out["ssd_hits"] = _delta(before, after, "kvtier_ssd_hits_total")
    out["beyond_ideal"] = _delta(before, after, "kvtier_connector_beyond_ideal_hit_tokens_total")
    seen = {dict(labels).get("reason", "") for name, labels in after if name == lost}
    for reason in [*LOST_REASONS, *sorted(seen - set(LOST_REASONS) - {""})]:
        out[f"lost_{reason}"] = _delta(before, after, lost, (("reason", reason),))
    return out


def kv_cache_tokens(log: str) -> int | None:
    """The KV cache size vLLM logged at start-up ("CPU KV cache size: 67,744 tokens"), or None."""
    found = re.findall(r"KV cache size: ([\d,]+) tokens", log)
    return int(found[-1].replace(",", "")) if found else None


def run_order(names: list[str], rnd: int, workload: str) -> list[str]:
    """The servers in the order they run in round `rnd` (0-based): rotated by one each round, so that each goes
    first in some round and a machine that drifts hits all alike; the ideal server runs `reuse` only."""
    k = rnd % len(names)
    return [n for n in names[k:] + names[:k] if workload == "reuse" or n != "ideal"]


# --------------------------------------------------------------------------------------------- servers
def variant(text: str) -> tuple[str, dict[str, Any]]:
    """`--kvtier-variant NAME=JSON` -> (NAME, the JSON object)."""
    name, sep, raw = text.partition("=")
    opts = json.loads(raw) if sep else None
    if not re.fullmatch(r"[a-z0-9][a-z0-9_]*", name) or not isinstance(opts, dict):
        raise argparse.ArgumentTypeError(f"expected NAME=JSON (NAME: lower-case letters, digits, _; JSON: an object), "
                                         f"got {text!r}")
    return name, opts


def kvtier_yaml(path: Path, chunk: int, host_mb: float, ssd: str, ssd_mb: float, lmcache_lines: str = "",
                kvtier_lines: str = "") -> Path:
    """The LMCache YAML of a kvtier server (host tier `host_mb`, SSD tier `ssd_mb` at `ssd`); `lmcache_lines` /
    `kvtier_lines`: more top-level / `extra_config` lines."""
    path.write_text(f"chunk_size: {chunk}\nlocal_cpu: true\nmax_local_cpu_size: {host_mb / 1024:.9f}\n"
                    f"{lmcache_lines}pre_caching_hash_algorithm: sha256_cbor\nstorage_plugins: [\"kvtier\"]\n"
                    "extra_config:\n  storage_plugin.kvtier.module_path: kvtier.storage_backends\n"
                    "  storage_plugin.kvtier.class_name: KVTierBackend\n"
                    f"  kvtier.ssd_path: {ssd}\n  kvtier.ssd_capacity_gb: {ssd_mb / 1024:.9f}\n{kvtier_lines}")
    return path


def kvtier_server_args(yaml: Path, connector: dict[str, Any] | None = None) -> list[str]:
    """`vllm serve` arguments that add kvtier's connector (config `yaml`; `connector`: its `kvtier.connector`
    options) and the dual-queue scheduler hook."""
    extra: dict[str, Any] = {"config_file": str(yaml)}
    if connector:
        extra["kvtier.connector"] = connector
    kv = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.connector", "kv_role": "kv_both",
          "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}
    return ["--kv-transfer-config", json.dumps(kv), "--scheduler-cls", "kvtier.scheduler_hooks.DualQueueScheduler"]


def vllm_server_args(args: argparse.Namespace, page: int) -> list[str]:
    """The `vllm serve` settings every server of a run shares (the demo model on vLLM's CPU build)."""
    max_len = -(-(args.max_prompt_tokens + args.max_answer_tokens) // page) * page
    return ["--dtype", "float32", "--max-model-len", str(max_len), "--block-size", str(page),
            "--num-gpu-blocks-override", str(args.gpu_blocks), "--enforce-eager", "--seed", "0",
            "--max-num-seqs", str(max(4, args.concurrency)), "--shutdown-timeout", "10"]


# --------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--aiperf", default=shutil.which("aiperf") or "aiperf", help="the aiperf command")
    p.add_argument("--trace", default=data_path("mooncake_conversation_sessions.jsonl"))
    p.add_argument("--requests", type=int, default=0, help="use only the first N requests of the trace (0: all)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--workloads", default="reuse,no-reuse", help="comma-separated: reuse, no-reuse")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--block-tokens", type=int, default=32, help="tokens per 512-token trace block")
    p.add_argument("--max-prompt-tokens", type=int, default=1536, help="hold out longer (scaled) requests")
    p.add_argument("--max-answer-tokens", type=int, default=24)
    p.add_argument("--gpu-blocks", type=int, default=160, help="vLLM KV cache of both servers, in 32-token blocks")
    p.add_argument("--host-mb", type=float, default=32, help="kvtier's host tier")
    p.add_argument("--ssd-mb", type=float, default=1024, help="kvtier's SSD tier")
    p.add_argument("--ssd-path", default=None, help="SSD tier directory (default: in the work directory)")
    p.add_argument("--workdir", default=None, help="keep logs and aiperf artifacts here")
    p.add_argument("--port", type=int, default=18060, help="first port to try")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one aiperf run may take")
    p.add_argument("--json", default=None, help="write all summaries here")
    p.add_argument("--kvtier-variant", action="append", default=[], type=variant, metavar="NAME=JSON",
                   help="one more kvtier server, `kvtier-NAME`, with these `kvtier.connector` options (its own SSD "
                        "tier), measured in the same rounds as `kvtier` and reported against the same base and ideal "
                        "runs (repeatable)")
    p.add_argument("--kvtier-connector", type=json.loads, default=None, metavar="JSON",
                   help='the kvtier server\'s `kvtier.connector` options, e.g. \'{"async_saves": false}\'')
    p.add_argument("--ssd-admission", default=None, choices=("all", "continuing", "second-sight", "none"),
                   help="the kvtier server's `kvtier.ssd_admission.policy` (default: kvtier's, `all`)")
    p.add_argument("--ideal", action=argparse.BooleanOptionalAction, default=True,
                   help="a third server on `reuse`: vLLM alone with a KV cache that holds a whole round")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers (finally below) when killed
    if not shutil.which(args.aiperf) and not os.path.exists(args.aiperf):
        print(f"aiperf not found ({args.aiperf}); install it in its own environment (it pins other versions "
              "of prometheus_client, psutil, pyzmq, ... than vLLM): python3 -m venv /tmp/aiperf-venv && "
              "/tmp/aiperf-venv/bin/pip install aiperf==0.13.0, then --aiperf /tmp/aiperf-venv/bin/aiperf")
        return 2

    own = args.workdir is None
    work = Path(tempfile.mkdtemp(prefix="kvtier-serve-bench-") if own else args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    rows = read_trace(args.trace)[:args.requests or None]
    reuse, held = scale(rows, args.block_tokens, args.max_prompt_tokens, args.max_answer_tokens)
    follow = follow_ups(reuse)
    noreuse = without_reuse(reuse)
    write_jsonl(work / "reuse.jsonl", reuse)
    write_jsonl(work / "no-reuse.jsonl", noreuse)
    model = Path(build(str(work / "model")))
    hf_home = work / "hf"
    hf_cache(model, hf_home)
    page, chunk = 32, 64
    ssd = args.ssd_path or str(work / "ssd")
    admission = f"  kvtier.ssd_admission:\n    policy: {args.ssd_admission}\n" if args.ssd_admission else ""
    vllm_args = vllm_server_args(args, page)
    n_follow = sum(follow)
    n_ideal = ideal_blocks(reuse, args.block_tokens, page, args.concurrency)
    reusable = reusable_tokens(reuse, args.block_tokens, page)
    ideal_bytes = n_ideal * page * KV_BYTES_PER_TOKEN
    # vLLM's CPU build allocates the override, but keep its KV space (whole GiB) at least that large
    ideal_env = {"VLLM_CPU_KVCACHE_SPACE": str(max(1, -(-ideal_bytes // 2**30)))}
    ideal_args = [*vllm_args]
    ideal_args[ideal_args.index("--num-gpu-blocks-override") + 1] = str(n_ideal)
    print(f"serve benchmark: {len(reuse)} requests of {args.trace} ({held} held out: scaled prompt > "
          f"{args.max_prompt_tokens} tokens), {n_follow} follow-up turns; one 512-token block = {args.block_tokens} "
          f"tokens, answers <= {args.max_answer_tokens} tokens (ignore_eos); aiperf mooncake_trace, concurrency "
          f"{args.concurrency}, streaming completions, {args.rounds} round(s)")
    print(f"  base and kvtier: demo model, vLLM CPU, {args.gpu_blocks} x {page}-token KV blocks "
          f"({args.gpu_blocks * page} tokens, {args.gpu_blocks * page * KV_BYTES_PER_TOKEN / 2**20:.0f} MiB), "
          f"prefix caching on; kvtier: host tier {args.host_mb:g} MiB, SSD tier {args.ssd_mb:g} MiB at {ssd}, SSD "
          f"write admission {args.ssd_admission or 'all (default)'}")
    if args.ideal:
        print(f"  ideal server (reuse only): vLLM alone, the same settings but {n_ideal} KV blocks "
              f"({n_ideal * page} tokens, {ideal_bytes / 2**20:.0f} MiB): one round's distinct prefixes, answers and "
              f"{args.concurrency} of the longest requests in flight, so nothing of a round is evicted; at most "
              f"{reusable} of the round's {sum(r['input_length'] for r in reuse)} prompt tokens can hit")
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if not workloads or any(w not in ("reuse", "no-reuse") for w in workloads):
        raise SystemExit(f"--workloads: expected a comma-separated list of reuse, no-reuse; got {args.workloads!r}")
    variants = {f"kvtier-{n}": opts for n, opts in args.kvtier_variant}
    names = ["base", "kvtier", *variants, *(["ideal"] if args.ideal else [])]
    servers: dict[str, ServeProcess] = {}
    results: dict[str, dict[str, list[dict[str, float]]]] = {
        w: {n: [] for n in names if w == "reuse" or n != "ideal"} for w in workloads}
    ideal_tokens: int | None = None
    try:
        servers["base"] = ServeProcess("base", work, model, free_port(args.port), vllm_args)
        for kname, opts in {"kvtier": args.kvtier_connector, **variants}.items():  # each its own SSD tier
            yaml = kvtier_yaml(work / f"lmcache-{kname}.yaml", chunk, args.host_mb,
                               ssd if kname == "kvtier" else f"{ssd}-{kname}", args.ssd_mb, kvtier_lines=admission)
            servers[kname] = ServeProcess(kname, work, model, free_port(args.port), vllm_args,
                                          kvtier_server_args(yaml, opts))
        if args.ideal:
            servers["ideal"] = ServeProcess("ideal", work, model, free_port(args.port), ideal_args, env=ideal_env)
        deadline = time.monotonic() + 600
        for s in servers.values():
            s.wait_ready(deadline)
        if args.ideal:
            ideal_tokens = kv_cache_tokens(servers["ideal"].log())
            print(f"  ideal server's log: KV cache size {ideal_tokens} tokens ({n_ideal * page} asked for)")
            if ideal_tokens is None or ideal_tokens < n_ideal * page - page:
                print("  WARNING: the ideal server has less KV cache than asked for; its column is not ideal")
        for rnd in range(args.rounds):
            for wl in workloads:
                for name in run_order(names, rnd, wl):
                    results[wl][name].append(measure(servers, name, work / f"{wl}.jsonl", work / f"r{rnd}-{wl}-{name}",
                                                     follow, args, 1000 + rnd, hf_home))
                    r = results[wl][name][-1]
                    steps = (f", {r['async_loads']:.0f} async loads, {r['steps_per_async_load']:.1f} steps during "
                             f"each, {r['idle_steps']:.0f} idle steps of {r['steps']:.0f}, {r['delayed_frees']:.0f} "
                             "delayed frees") if name.startswith("kvtier") else ""
                    print(f"  round {rnd + 1} {wl:<8} {name:<6}: {r['requests']:.0f} requests ({r['errors']:.0f} "
                          f"errors) in {r['wall_s']:.0f} s, TTFT follow-up mean {r['ttft_follow_mean']:.0f} ms, p99 "
                          f"{r['ttft_follow_p99']:.0f} ms, {r['req_per_s']:.2f} req/s, prefix-cache hits "
                          f"{r['hit_prefix']:.0f} + external {r['hit_external']:.0f} of {r['hit_queried']:.0f} "
                          f"tokens, {r['vllm_steps']:.0f} engine steps, {r['preemptions']:.0f} preemptions{steps} "
                          f"[{r['bench_s']:.0f} s]", flush=True)
        final = servers["kvtier"].metrics()
    finally:
        for s in servers.values():
            s.stop()
    report(results, reusable if args.ideal else None)
    for vname in variants:
        print(f"\n=== {vname} (kvtier.connector {json.dumps(variants[vname])}) against the same base and ideal runs")
        report({wl: {n: (runs[vname] if n == "kvtier" else runs[n]) for n in runs if not n.startswith("kvtier-")}
                for wl, runs in results.items()}, reusable if args.ideal else None)
    hits = {t: final.get(("kvtier_connector_hit_tokens_total", (("tier", t),)), 0.0) for t in
            ("gpu", "host", "ssd", "miss")}
    print(f"\nkvtier server /metrics (whole run): hit tokens {hits}, host-pool exhausted "
          f"{ {k[1][0][1]: v for k, v in final.items() if k[0] == 'kvtier_host_pool_exhausted_total'} }, "
          f"lost {sum(v for k, v in final.items() if k[0] == 'kvtier_host_pool_lost_chunks_total'):.0f} chunks, "
          f"SSD puts {final.get(('kvtier_ssd_puts_total', ()), 0):.0f}, SSD hits "
          f"{final.get(('kvtier_ssd_hits_total', ()), 0):.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "held_out": held, "ideal_blocks": n_ideal,
                                               "ideal_kv_cache_tokens": ideal_tokens, "reusable_tokens": reusable,
                                               "results": results}, indent=1))
    if own:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def measure(servers: dict[str, ServeProcess], name: str, trace: Path, out: Path, follow: list[bool],
            args: argparse.Namespace, seed: int, hf_home: Path) -> dict[str, float]:
    """One aiperf run of `trace` on server `name`: its summary, with the server's hit tokens (and, for kvtier,
    its engine steps and lost hits) from /metrics before and after."""
    t0 = time.monotonic()
    srv = servers[name]
    before = srv.metrics()
    res = summarize(run_aiperf(args.aiperf, srv, trace, out, args, seed, hf_home), follow)
    after = srv.metrics()
    res.update(vllm_hits(before, after))
    res.update(vllm_engine(before, after))
    if name.startswith("kvtier"):
        res.update(engine_steps(before, after))
        res.update(kvtier_hits(before, after))
    res["bench_s"] = time.monotonic() - t0
    return res


if __name__ == "__main__":
    sys.exit(main())
