"""`kvtier demo-vllm`: the main job. Replays multi-turn conversations of the Mooncake trace through real vLLM,
three times.

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

Run 3 (`--lmcache-mp`, on by default) is the same engine with LMCache's multiprocess mode instead: LMCache's
`LMCacheMPConnector` and a real `lmcache server` (L1 = the kvtier host tier's size, evicting half of itself above
50%: LMCache's defaults, 0.8 / 0.2, leave too little room for this workload's requests, and LMCache then drops
stores and prefetches) with LMCache's own `fs` L2 adapter on the same disk. Its engine core runs in its own process
(LMCache's connector cannot run in-process), so its engine start is longer; vLLM reports its reuse as one number per
request, and the L1 / L2 split comes from the server's metrics.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import random
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.testing.demo_model import KV_BYTES_PER_TOKEN, MODEL, VOCAB
from kvtier.testing.demo_model import build as build_model
from kvtier.testing.lmcache_yaml import write_lmcache_yaml
from kvtier.testing.vllm_engine import end_process_group

logger = logging.getLogger(__name__)

PROGRESS_FD_ENV = "KVTIER_DEMO_PROGRESS_FD"
LMCACHE_CPU_NOTE = (
    "LMCache's in-process connector (LMCacheConnectorV1) is not compared here: it does not run on vLLM's CPU build "
    "(its worker logs \"No supported cpu connector found\" and vLLM silently continues with zero hits), so that "
    "column is absent on CPU.")
LMCACHE_MP_NOTE = (
    "LMCache's multiprocess mode does run on CPU: the third column is vLLM + LMCache's `LMCacheMPConnector` + "
    "`lmcache server` (L1 = the kvtier host tier's size) with LMCache's own `fs` L2 adapter on the same disk.")


def add_conversation_arguments(p: argparse.ArgumentParser, *, conversations: int, max_prompt_tokens: int,
                               answer_tokens: int) -> None:
    """The replayed conversations' options, shared by `demo-vllm` and `demo-shared` (their defaults differ)."""
    from kvtier.demo_data import path as data_path

    p.add_argument("--trace", default=data_path("mooncake_conversation_sessions.jsonl"),
                   help="Mooncake-format JSONL (default: 60 whole conversations shipped with kvtier)")
    p.add_argument("--conversations", type=int, default=conversations, help="conversations to replay")
    p.add_argument("--turns", type=int, default=4, help="turns per conversation (conversations with fewer are skipped)")
    p.add_argument("--block-tokens", type=int, default=64, help="token ids per 512-token trace block")
    p.add_argument("--max-prompt-tokens", type=int, default=max_prompt_tokens,
                   help="skip conversations whose last replayed prompt would be longer")
    p.add_argument("--answer-tokens", type=int, default=answer_tokens,
                   help="upper bound of a scaled answer (greedy, no EOS)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_conversation_arguments(p, conversations=16, max_prompt_tokens=3072, answer_tokens=24)
    p.add_argument("--concurrency", type=int, default=2, help="requests in flight at once")
    p.add_argument("--gpu-blocks", type=int, default=None,
                   help="vLLM KV-cache budget in blocks of --page-tokens (default: room for --concurrency of the "
                        "longest requests, at most a third of the replay's history, at least one longest request)")
    p.add_argument("--page-tokens", type=int, default=32, help="vLLM block size (tokens)")
    p.add_argument("--chunk-tokens", type=int, default=64, help="LMCache/kvtier chunk size (multiple of the page)")
    p.add_argument("--host-mb", type=float, default=None,
                   help="kvtier host tier (LMCache local CPU) size; default: half of the replay's history (at least "
                        "three of the longest requests), so part of it comes back from the SSD tier")
    p.add_argument("--ssd-mb", type=float, default=256, help="kvtier SSD tier size")
    p.add_argument("--ssd-path", default=None, help="SSD tier directory (default: inside the work directory)")
    p.add_argument("--workdir", default=None, help="keep the model, configs, engine logs and results here "
                                                   "(default: a temporary directory, removed at the end)")
    p.add_argument("--plot", default="kvtier-demo.png", help="PNG plot of TTFT per turn (both runs)")
    p.add_argument("--json", default=None, help="also write all per-request results to this JSON file")
    p.add_argument("--timeout", type=float, default=420, help="seconds one engine run may take")
    p.add_argument("--lmcache-mp", action=argparse.BooleanOptionalAction, default=True,
                   help="also run vLLM + LMCache's multiprocess server with LMCache's own `fs` L2 adapter (a third "
                        "column; its L1 is the kvtier host tier's size)")
    p.add_argument("--mp-port", type=int, default=0, help="port of that `lmcache server` (default: a free one)")
    p.add_argument("--mp-http-port", type=int, default=0, help="its HTTP admin port (default: a free one)")
    p.add_argument("--repeat", type=int, default=1,
                   help="run the whole comparison this many times (fresh engines and SSD tier each time) and print "
                        "the spread: min / median / max of the mean follow-up speed-up and each side's slowest "
                        "follow-up turn (the full tables are printed for the last run)")


# --------------------------------------------------------------------------------------------- workload
@dataclass
class Turn:
    conv: int  #: position of the conversation in the replay (0..)
    session: int  #: session id in the trace
    turn: int  #: 1-based
    index: int  #: trace line (arrival order)
    new_tokens: list[int]  #: turn 1: the whole prompt; later turns: the new user message
    max_tokens: int
    trace_input: int  #: the trace's prompt length (512-token blocks world)


def _block_tokens(hash_id: int, n: int) -> list[int]:
    """Token ids standing for one 512-token trace block: equal ids give equal blocks (prefix reuse preserved)."""
    rng = random.Random(hashlib.sha256(f"block-{hash_id}".encode()).digest())
    return [rng.randrange(1, VOCAB) for _ in range(n)]


def _message_tokens(session: int, turn: int, new_ids: tuple[int, ...], n: int) -> list[int]:
    rng = random.Random(hashlib.sha256(f"msg-{session}-{turn}-{new_ids}".encode()).digest())
    return [rng.randrange(1, VOCAB) for _ in range(n)]


def build_workload(trace: str, conversations: int, turns: int, block_tokens: int, max_prompt: int,
                   answer_tokens: int) -> tuple[list[Turn], int]:
    """The replayed turns in trace arrival order, and the longest prompt + answer (tokens)."""
    from kvtier.replay.traces import read_mooncake

    scale = block_tokens / 512
    reqs = read_mooncake(trace)
    by_session: dict[int, list] = {}
    for r in reqs:
        by_session.setdefault(r.session, []).append(r)
    out: list[Turn] = []
    longest = 0
    chosen = 0
    for session in sorted(by_session, key=lambda s: by_session[s][0].index):
        chain = sorted(by_session[session], key=lambda r: r.turn)[:turns]
        if len(chain) < turns or [r.turn for r in chain] != list(range(1, turns + 1)):
            continue
        answers = [max(4, min(answer_tokens, round(r.output_length * scale))) for r in chain]
        plan: list[Turn] = []
        length = 0
        for k, r in enumerate(chain):
            if k == 0:
                n = max(block_tokens, round(r.input_length * scale))
                toks = [t for h in r.hash_ids for t in _block_tokens(h, block_tokens)][:n]
            else:
                prev = chain[k - 1]
                new_input = r.input_length - prev.input_length - prev.output_length
                n = max(8, round(new_input * scale))
                shared = 0
                while shared < min(len(prev.hash_ids), len(r.hash_ids)) and \
                        prev.hash_ids[shared] == r.hash_ids[shared]:
                    shared += 1
                toks = _message_tokens(session, r.turn, r.hash_ids[shared:], n)
            length += len(toks)
            plan.append(Turn(chosen, session, r.turn, r.index, toks, answers[k], r.input_length))
            if k + 1 < len(chain):
                length += answers[k]
        if length > max_prompt:
            continue
        longest = max(longest, length + answers[-1])
        out.extend(plan)
        chosen += 1
        if chosen == conversations:
            break
    if chosen < conversations:
        logger.warning("only %d conversations of %s have %d turns and fit --max-prompt-tokens %d",
                       chosen, trace, turns, max_prompt)
    out.sort(key=lambda t: t.index)
    return out, longest


# --------------------------------------------------------------------------------------------- engine side
def engine_main(args_path: str) -> None:
    """Body of one engine subprocess: `python -c 'from kvtier.cli.demo_vllm import engine_main; engine_main(PATH)'`."""
    import faulthandler

    args = json.loads(Path(args_path).read_text())
    faulthandler.dump_traceback_later(args["watchdog_s"], exit=True)  # a hang shows its stacks
    fd = int(os.environ.get(PROGRESS_FD_ENV, "-1"))
    progress = os.fdopen(fd, "w", buffering=1) if fd >= 0 else open(os.devnull, "w")

    def say(*parts: Any) -> None:
        progress.write(" ".join(str(p) for p in parts) + "\n")

    t0 = time.perf_counter()
    if not os.path.exists(os.path.join(args["model"], "config.json")):
        say("phase building the tiny model")
    build_model(args["model"])
    say("phase starting vLLM")
    from vllm import LLM, SamplingParams

    kw: dict[str, Any] = {}
    if args.get("kv_transfer_config"):
        kw["kv_transfer_config"] = args["kv_transfer_config"]
    if args.get("scheduler_cls"):
        kw["scheduler_cls"] = args["scheduler_cls"]
    if args.get("lmcache_mp_url"):
        kw["distributed_executor_backend"] = "uni"  # LMCache's MP connector: engine core in its own process
    llm = LLM(model=args["model"], skip_tokenizer_init=True, load_format="auto", dtype="float32", enforce_eager=True,
              block_size=args["page_tokens"], max_model_len=args["max_model_len"], enable_prefix_caching=True,
              num_gpu_blocks_override=args["gpu_blocks"], max_num_seqs=max(4, args["concurrency"]),
              disable_log_stats=False, seed=0, **kw)
    engine = llm.llm_engine
    core = getattr(engine.engine_core, "engine_core", None)  # None when the engine core runs in its own process
    conn = core.scheduler.connector if core is not None else None
    admitted: dict[str, tuple[int, int, int]] = {}  # request id -> (vLLM prefix-cache, host, SSD) tokens
    if conn is not None and getattr(conn, "scheduler_side", None) is not None:
        ss = conn.scheduler_side
        original = conn.update_state_after_alloc

        def update_state_after_alloc(request: Any, blocks: Any, num_external_tokens: int) -> None:
            st = ss.reqs.get(request.request_id)
            gpu = int(st.gpu_tokens) if st is not None else 0
            disk = int(st.sources.get("disk", 0)) if st is not None and num_external_tokens > 0 else 0
            admitted.setdefault(request.request_id, (gpu, int(num_external_tokens) - disk, disk))
            return original(request, blocks, num_external_tokens)

        conn.update_state_after_alloc = update_state_after_alloc  # instance attribute: the scheduler calls this
    start_s = time.perf_counter() - t0

    # warm-up outside the measurement (first forward passes, first loads and saves)
    rng = random.Random(7)
    warm = [rng.randrange(1, VOCAB) for _ in range(4 * args["chunk_tokens"] + 5)]
    wsp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for p in (warm, warm + warm[:40]):
        llm.generate([{"prompt_token_ids": p}], wsp, use_tqdm=False)
    admitted.clear()
    mp_before = _mp_counters(args.get("lmcache_mp_url"), llm)
    say("ready", f"{start_s:.1f}")

    turns = args["turns"]
    hist: dict[int, list[int]] = {}
    done_turns: dict[int, int] = {}
    pending = list(range(len(turns)))
    inflight: dict[str, int] = {}
    recs: list[dict[str, Any]] = [{} for _ in turns]
    t_run = time.perf_counter()
    while pending or inflight:
        for i in list(pending):
            if len(inflight) >= args["concurrency"]:
                break
            t = turns[i]
            if t["turn"] != done_turns.get(t["conv"], 0) + 1:
                continue  # the previous turn of this conversation has not finished
            prompt = hist.get(t["conv"], []) + t["new_tokens"]
            rid = f"conv{t['conv']}-turn{t['turn']}"
            sp = SamplingParams(temperature=0.0, max_tokens=t["max_tokens"], ignore_eos=True)
            recs[i] = {"conv": t["conv"], "turn": t["turn"], "prompt_len": len(prompt), "rid": rid,
                       "arrival": time.perf_counter()}
            recs[i]["internal_id"] = engine.add_request(rid, {"prompt_token_ids": prompt}, sp)
            recs[i]["_prompt"] = prompt
            inflight[rid] = i
            pending.remove(i)
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            i = inflight.get(o.request_id)
            if i is None:
                continue
            rec = recs[i]
            toks = list(o.outputs[0].token_ids) if o.outputs else []
            if "ttft" not in rec and toks:
                rec["ttft"] = now - rec["arrival"]
                rec["cached"] = int(o.num_cached_tokens or 0)
            if o.finished:
                rec["tokens"] = toks
                rec["latency"] = now - rec["arrival"]
                t = turns[i]
                hist[t["conv"]] = rec.pop("_prompt") + toks
                done_turns[t["conv"]] = t["turn"]
                del inflight[o.request_id]
                say("done", i)
    wall = time.perf_counter() - t_run
    for rec in recs:
        rec["arrival"] -= t_run
        gpu, host, ssd = admitted.get(rec["internal_id"], (rec.get("cached", 0), 0, 0))
        rec.update(gpu_hit=gpu, host_hit=host, ssd_hit=ssd)
    out: dict[str, Any] = {"requests": recs, "wall_s": wall, "start_s": start_s}
    if conn is not None and getattr(conn, "scheduler_side", None) is not None:
        from kvtier.connector.metrics import kvtier_samples

        snap = conn.scheduler_side.snapshot()
        out.update(counters=snap["counters"], storage=snap["storage"], policy=snap["policy"])
        out["metrics"] = kvtier_samples()
    src: dict[str, float] = {}
    for x in llm.get_metrics():
        if x.name == "vllm:prompt_tokens_cached_by_source":
            src[x.labels.get("source", "?")] = x.value
    out["cached_by_source"] = src
    out["scheduler"] = type(core.scheduler).__name__ if core is not None else "vLLM's (engine core process)"
    if args.get("lmcache_mp_url"):
        after = _mp_counters(args["lmcache_mp_url"], llm)
        out["lmcache_mp"] = {k: after[k] - mp_before.get(k, 0.0) for k in after}
    Path(args["out"]).write_text(json.dumps(out))
    say("phase shutting down")
    engine.engine_core.shutdown()


def _mp_counters(url: str | None, llm: Any) -> dict[str, float]:
    """For the LMCache MP run: vLLM's cached tokens by source and the server's L1/L2 lookup hits, cumulative."""
    if not url:
        return {}
    out: dict[str, float] = {}
    for x in llm.get_metrics():
        if x.name == "vllm:prompt_tokens_cached_by_source":
            key = "vllm_" + x.labels.get("source", "?")
            out[key] = out.get(key, 0.0) + float(x.value)
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            for name in ("lmcache_mp_lookup_hit_l1_keys_total", "lmcache_mp_lookup_hit_l2_keys_total",
                         "lmcache_mp_l2_store_completed_objects_chunks_total"):
                if line.startswith(name):
                    out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


# --------------------------------------------------------------------------------------------- driver side
@dataclass
class RunResult:
    name: str
    requests: list[dict[str, Any]] = field(default_factory=list)
    wall_s: float = 0.0
    start_s: float = 0.0
    raw: dict[str, Any] = field(default_factory=dict)

    def hits(self, key: str, min_turn: int = 1) -> int:
        return sum(r[key] for r in self.requests if r["turn"] >= min_turn)

    def ttft(self, min_turn: int = 1, max_turn: int | None = None) -> list[float]:
        return [r["ttft"] for r in self.requests
                if r["turn"] >= min_turn and (max_turn is None or r["turn"] <= max_turn)]


def _engine_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update({"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "LMCACHE_TRACK_USAGE": "false",
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TRITON_INTERPRET": "0", "TQDM_DISABLE": "1",
                # One unbound compute thread: two OpenMP threads pinned to the two cores stall at every barrier
                # (~80 ms steps) as soon as anything else runs; the tiny model gains nothing from the second one.
                "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"})
    env.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    return env


def _run_engine(name: str, label: str, workdir: Path, args: dict[str, Any], n_turns: int, timeout: float,
                env_extra: dict[str, str] | None = None) -> RunResult:
    from tqdm import tqdm

    args = dict(args, out=str(workdir / f"{name}.out.json"), watchdog_s=max(60, int(timeout) - 10))
    args_path = workdir / f"{name}.args.json"
    args_path.write_text(json.dumps(args))
    log_path = workdir / f"{name}.log"
    r_fd, w_fd = os.pipe()
    env = _engine_env()
    env.update(env_extra or {})
    env[PROGRESS_FD_ENV] = str(w_fd)
    code = ("if __name__ == '__main__':\n    from kvtier.cli.demo_vllm import engine_main\n"
            f"    engine_main({str(args_path)!r})")
    bar = tqdm(total=n_turns, desc=f"{label:>22}", unit="turn", leave=True, dynamic_ncols=True)
    bar.set_postfix_str("starting")
    deadline = time.monotonic() + timeout
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=workdir, env=env, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, pass_fds=(w_fd,),
                                start_new_session=True)
    os.close(w_fd)
    buf = b""
    try:
        with os.fdopen(r_fd, "rb", buffering=0) as rd:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    end_process_group(proc)
                    raise RuntimeError(f"{label}: the engine run took longer than {timeout:.0f} s (log: {log_path})")
                ready, _, _ = select.select([rd], [], [], min(1.0, left))
                if not ready:
                    continue
                chunk = rd.read(4096)
                if not chunk:
                    break
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    kind, _, rest = line.decode().partition(" ")
                    if kind == "phase":
                        bar.set_postfix_str(rest)
                    elif kind == "ready":
                        bar.set_postfix_str(f"engine up in {float(rest):.0f} s")
                        bar.reset(total=n_turns)
                    elif kind == "done":
                        bar.update(1)
        rc = proc.wait(timeout=max(5.0, deadline - time.monotonic()))
    finally:
        end_process_group(proc)  # also after a normal exit: nothing of the engine may outlive its run
        bar.close()
    out_path = workdir / f"{name}.out.json"
    if rc != 0 or not out_path.exists():
        tail = log_path.read_text(errors="replace")[-4000:]
        raise RuntimeError(f"{label}: the engine exited with status {rc} (log: {log_path}); its end:\n{tail}")
    raw = json.loads(out_path.read_text())
    return RunResult(label, raw["requests"], raw["wall_s"], raw["start_s"], raw)


def _lmcache_yaml(path: Path, chunk: int, host_mb: float, ssd_dir: str, ssd_mb: float) -> None:
    """The shipped `configs/lmcache-kvtier.yaml` with the demo's sizes and paths, page-first chunks."""
    write_lmcache_yaml(path, ssd_path=ssd_dir, chunk_size=chunk, host_gb=f"{host_mb / 1024:.9f}",
                       ssd_capacity_gb=f"{ssd_mb / 1024:.9f}", extra={"chunk_format": "page_first"})


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _ratio(a: float, b: float) -> str:
    if not b or math.isnan(a) or math.isnan(b):
        return "n/a"
    return f"{a / b:.2f}x"


def _faster(base: float, other: float) -> str:
    """`other` against `base` (both times) in words: "2.10x faster" or "1.85x slower"."""
    if not base or not other or math.isnan(base) or math.isnan(other):
        return "n/a"
    return f"{base / other:.2f}x faster" if other <= base else f"{other / base:.2f}x slower"


@dataclass(frozen=True)
class FollowUps:
    """One run's follow-up turns (turn >= 2), vLLM alone against vLLM + kvtier."""

    speedup_mean: float  #: mean TTFT without kvtier / mean TTFT with it (> 1: kvtier faster)
    speedup_median: float
    slowest_base_s: float  #: the slowest follow-up turn's TTFT without kvtier
    slowest_kvtier_s: float
    slowest_kvtier_turn: tuple[int, int]  #: (conversation, turn) of kvtier's slowest follow-up

    @classmethod
    def of(cls, base: "RunResult", kvt: "RunResult") -> "FollowUps":
        b, k = base.ttft(2), kvt.ttft(2)
        worst = max((r for r in kvt.requests if r["turn"] >= 2), key=lambda r: r["ttft"])
        return cls(statistics.mean(b) / statistics.mean(k), _pct(b, 0.5) / _pct(k, 0.5), max(b), max(k),
                   (worst["conv"], worst["turn"]))


def _print_spread(runs: list[FollowUps]) -> None:
    """The repeated comparison: min / median / max over runs."""
    def mmm(xs: list[float], fmt: str) -> str:
        return " / ".join(fmt.format(x) for x in (min(xs), statistics.median(xs), max(xs)))

    n = len(runs)
    print(f"\nrepeated {n} times (fresh engines and SSD tier each run): follow-up turns (turn >= 2), "
          "min / median / max over runs")
    print(f"  mean TTFT speed-up (vLLM alone / kvtier): {mmm([r.speedup_mean for r in runs], '{:.2f}x')}")
    print(f"  median TTFT speed-up:                     {mmm([r.speedup_median for r in runs], '{:.2f}x')}")
    print(f"  slowest follow-up, vLLM alone:            "
          f"{mmm([1000 * r.slowest_base_s for r in runs], '{:.0f}')} ms")
    print(f"  slowest follow-up, vLLM + kvtier:         "
          f"{mmm([1000 * r.slowest_kvtier_s for r in runs], '{:.0f}')} ms")
    for i, r in enumerate(runs, 1):
        print(f"  run {i:>2}: mean {_faster(1.0, 1.0 / r.speedup_mean)}, median "
              f"{_faster(1.0, 1.0 / r.speedup_median)}; slowest follow-up {1000 * r.slowest_base_s:.0f} ms alone, "
              f"{1000 * r.slowest_kvtier_s:.0f} ms with kvtier (conversation {r.slowest_kvtier_turn[0]} turn "
              f"{r.slowest_kvtier_turn[1]})")
    slower = sum(1 for r in runs if r.speedup_mean < 1)
    worse_tail = sum(1 for r in runs if r.slowest_kvtier_s > r.slowest_base_s)
    print(f"  kvtier slower on average in {slower} of {n} runs; its slowest follow-up slower than vLLM alone's "
          f"slowest in {worse_tail} of {n} runs")


def run(args: argparse.Namespace) -> int:
    t_all = time.perf_counter()
    if args.chunk_tokens % args.page_tokens:
        print(f"--chunk-tokens {args.chunk_tokens} must be a multiple of --page-tokens {args.page_tokens}")
        return 2
    if args.repeat < 1:
        print(f"--repeat must be at least 1, got {args.repeat}")
        return 2
    turns, longest = build_workload(args.trace, args.conversations, args.turns, args.block_tokens,
                                    args.max_prompt_tokens, args.answer_tokens)
    if not turns:
        print("no conversation of the trace fits the options; raise --max-prompt-tokens or lower --turns")
        return 2
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
    _lmcache_yaml(yaml_path, args.chunk_tokens, host_mb, ssd_dir, args.ssd_mb)
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
          f"{ssd_dir}; {args.chunk_tokens}-token chunks")
    print(f"  {LMCACHE_CPU_NOTE}")
    if args.lmcache_mp:
        print(f"  {LMCACHE_MP_NOTE}")
    sys.stdout.flush()
    rc = 0
    spread: list[FollowUps] = []
    for i in range(args.repeat):
        mp = None
        last = i == args.repeat - 1
        if args.repeat > 1:
            print(f"\n== run {i + 1} of {args.repeat}", flush=True)
            if args.ssd_path is None:  # every run starts from an empty SSD tier, as the first one does
                shutil.rmtree(ssd_dir, ignore_errors=True)
        try:
            base = _run_engine("baseline", "vLLM, no connector", workdir, base_args, len(turns), args.timeout)
            kvt = _run_engine("kvtier", "vLLM + kvtier", workdir, dict(
                base_args, kv_transfer_config=dict(kv_cfg, engine_id=f"{kv_cfg['engine_id']}-{i}"),
                scheduler_cls="kvtier.scheduler_hooks.DualQueueScheduler"), len(turns), args.timeout)
            if args.lmcache_mp:
                mp = _run_lmcache_mp(workdir, base_args, host_mb, args, len(turns))
        except RuntimeError as e:
            print(f"\nERROR: {e}")
            if own:
                print(f"(work directory kept: {workdir})")
            return 1
        rc = max(rc, _report(base, kvt, turns, args, full=last))
        if mp is not None:
            rc = max(rc, _report_lmcache_mp(base, kvt, mp, turns))
        spread.append(FollowUps.of(base, kvt))
    if args.repeat > 1:
        _print_spread(spread)
    if args.json:
        Path(args.json).write_text(json.dumps({"baseline": base.raw, "kvtier": kvt.raw,
                                               **({"lmcache_mp": mp.raw} if mp is not None else {})}, indent=1))
    _plot(base, kvt, args.plot, mp)
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
    from kvtier.testing.lmcache_mp import MPServer

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
        return _run_engine("lmcache_mp", "vLLM + LMCache MP (fs)", workdir,
                           dict(base_args, kv_transfer_config=kv, lmcache_mp_url=srv.url), n_turns, args.timeout,
                           env_extra={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})


def _report_lmcache_mp(base: RunResult, kvt: RunResult, mp: RunResult, turns: list[Turn]) -> int:
    """The third column: vLLM + LMCache MP (`fs` L2), against the same turns of the two other runs."""
    key = lambda r: (r["conv"], r["turn"])  # noqa: E731
    b_by, m_by = {key(r): r for r in base.requests}, {key(r): r for r in mp.requests}
    print("\nvLLM + LMCache MP (LMCache's `fs` L2 adapter), the same conversations: TTFT per turn (ms; mean / "
          "median) and cached prompt tokens (vLLM's prefix cache + LMCache)")
    head = (f"{'turn':>4} {'no connector':>16} {'kvtier':>16} {'LMCache MP (fs)':>16} {'MP cached':>10} "
            f"{'kvtier speed-up':>16}")
    print(head)
    print("-" * len(head))
    for n in range(1, max(t.turn for t in turns) + 1):
        bt, kt, mt = base.ttft(n, n), kvt.ttft(n, n), mp.ttft(n, n)
        cached = sum(r.get("cached", 0) for r in mp.requests if r["turn"] == n)
        print(f"{n:>4} {1000 * statistics.mean(bt):>8.1f} / {1000 * statistics.median(bt):>5.1f} "
              f"{1000 * statistics.mean(kt):>8.1f} / {1000 * statistics.median(kt):>5.1f} "
              f"{1000 * statistics.mean(mt):>8.1f} / {1000 * statistics.median(mt):>5.1f} {cached:>10} "
              f"{_ratio(statistics.mean(mt), statistics.mean(kt)):>16}")
    c = mp.raw.get("lmcache_mp", {})
    ext = sum(v for k, v in c.items() if k.startswith("vllm_external"))
    l1, l2 = int(c.get("lmcache_mp_lookup_hit_l1_keys_total", 0)), int(c.get("lmcache_mp_lookup_hit_l2_keys_total", 0))
    print(f"LMCache MP hits (the replay, warm-up excluded): vLLM prefix cache {int(c.get('vllm_device', 0))} tokens, "
          f"from LMCache {int(ext)} tokens; the server's lookups found {l1} chunks in L1 and loaded {l2} from the "
          f"`fs` L2, which stored {int(c.get('lmcache_mp_l2_store_completed_objects_chunks_total', 0))}")
    later_k, later_m = kvt.ttft(2), mp.ttft(2)
    if later_k and later_m:
        print(f"TTFT of follow-up turns: kvtier {_faster(statistics.mean(later_m), statistics.mean(later_k))} "
              f"than LMCache MP (fs) on average ({_faster(_pct(later_m, 0.5), _pct(later_k, 0.5))} at the median)")
    diff = [k for k in b_by if b_by[k]["tokens"] != m_by[k]["tokens"]]
    if diff:
        print(f"LMCache MP generated tokens: DIFFERENT from the run without a connector in {len(diff)} of "
              f"{len(turns)} requests (first: conversation {diff[0][0]} turn {diff[0][1]})")
        return 1
    print(f"LMCache MP generated tokens: identical to the run without a connector ({len(turns)} requests)")
    return 0


def _report(base: RunResult, kvt: RunResult, turns: list[Turn], args: argparse.Namespace, full: bool = True) -> int:
    """Prints the comparison (with `full`, the per-request and per-turn tables and the cross-checks too);
    returns 1 if the generated tokens differ."""
    key = lambda r: (r["conv"], r["turn"])  # noqa: E731
    b_by = {key(r): r for r in base.requests}
    k_by = {key(r): r for r in kvt.requests}
    if full:
        _print_tables(base, kvt, turns, b_by, k_by)
    return _print_summary(base, kvt, turns, b_by, k_by, full)


def _print_tables(base: RunResult, kvt: RunResult, turns: list[Turn], b_by: dict, k_by: dict) -> None:
    print("\nper request (arrival order; hits in tokens: GPU = vLLM's own prefix cache, host / SSD = kvtier)")
    head = (f"{'conv':>4} {'turn':>4} {'prompt':>6} | {'TTFT ms':>8} {'GPU hit':>7} | {'TTFT ms':>8} {'GPU hit':>7} "
            f"{'host hit':>8} {'SSD hit':>7} | {'speed-up':>8}")
    print(f"{'':16} | {'vLLM, no connector':^16} | {'vLLM + kvtier':^34} |")
    print(head)
    print("-" * len(head))
    for t in turns:
        b, k = b_by[(t.conv, t.turn)], k_by[(t.conv, t.turn)]
        print(f"{t.conv:>4} {t.turn:>4} {b['prompt_len']:>6} | {1000 * b['ttft']:>8.1f} {b['gpu_hit']:>7} | "
              f"{1000 * k['ttft']:>8.1f} {k['gpu_hit']:>7} {k['host_hit']:>8} {k['ssd_hit']:>7} | "
              f"{b['ttft'] / k['ttft']:>7.2f}x")

    max_turn = max(t.turn for t in turns)
    print("\nTTFT per turn (ms; mean / median over conversations)")
    head = f"{'turn':>4} {'no connector':>16} {'kvtier':>16} {'speed-up (mean)':>16} {'kvtier hits host+SSD':>21}"
    print(head)
    print("-" * len(head))
    for n in range(1, max_turn + 1):
        bt, kt = base.ttft(n, n), kvt.ttft(n, n)
        hits = sum(r["host_hit"] + r["ssd_hit"] for r in kvt.requests if r["turn"] == n)
        print(f"{n:>4} {1000 * statistics.mean(bt):>8.1f} / {1000 * statistics.median(bt):>5.1f} "
              f"{1000 * statistics.mean(kt):>8.1f} / {1000 * statistics.median(kt):>5.1f} "
              f"{_ratio(statistics.mean(bt), statistics.mean(kt)):>16} {hits:>21}")


def _print_summary(base: RunResult, kvt: RunResult, turns: list[Turn], b_by: dict, k_by: dict, full: bool) -> int:
    key = lambda r: (r["conv"], r["turn"])  # noqa: E731
    rows = []
    for r in (base, kvt):
        later = r.ttft(2)
        hit = r.hits("gpu_hit") + r.hits("host_hit") + r.hits("ssd_hit")
        prompt = sum(x["prompt_len"] for x in r.requests)
        rows.append({
            "name": r.name, "prompt": prompt, "gpu": r.hits("gpu_hit"), "host": r.hits("host_hit"),
            "ssd": r.hits("ssd_hit"), "hit": hit, "computed": prompt - hit,
            "mean2": statistics.mean(later) if later else float("nan"), "p50_2": _pct(later, 0.5),
            "p90_2": _pct(later, 0.9), "mean1": statistics.mean(r.ttft(1, 1)), "wall": r.wall_s,
            "start": r.start_s})
    print("\nsummary (TTFT of turns >= 2 in ms; wall = the replay, engine start excluded)")
    head = (f"{'run':<20}{'prompt tok':>11}{'GPU hits':>9}{'host hits':>10}{'SSD hits':>9}{'prefilled':>10}"
            f"{'TTFT t1':>8}{'mean':>8}{'p50':>8}{'p90':>8}{'wall s':>8}")
    print(head)
    print("-" * len(head))
    for x in rows:
        print(f"{x['name']:<20}{x['prompt']:>11}{x['gpu']:>9}{x['host']:>10}{x['ssd']:>9}{x['computed']:>10}"
              f"{1000 * x['mean1']:>8.1f}{1000 * x['mean2']:>8.1f}{1000 * x['p50_2']:>8.1f}{1000 * x['p90_2']:>8.1f}"
              f"{x['wall']:>8.1f}")
    a, b = rows
    print(f"{'kvtier vs none':<20}{'':>11}{'':>9}{'':>10}{'':>9}{_ratio(b['computed'], a['computed']):>10}"
          f"{'':>8}{_ratio(a['mean2'], b['mean2']):>8}{_ratio(a['p50_2'], b['p50_2']):>8}"
          f"{_ratio(a['p90_2'], b['p90_2']):>8}{_ratio(a['wall'], b['wall']):>8}")
    print("(ratio row: prefilled tokens kvtier / none; TTFT and wall time none / kvtier, i.e. kvtier's speed-up)")
    print(f"\nkvtier: TTFT of follow-up turns {_faster(a['mean2'], b['mean2'])} on average "
          f"({_faster(a['p50_2'], b['p50_2'])} at the median); cached prompt tokens {b['hit']} vs {a['hit']} "
          f"({_ratio(b['hit'], a['hit'])}), {b['host']} from the host tier and {b['ssd']} from the SSD tier; "
          f"prefilled tokens {b['computed']} vs {a['computed']}; replay wall time {_faster(a['wall'], b['wall'])}.")
    ok = _print_token_check(base, kvt, turns, b_by, k_by)
    if not full:
        return 0 if ok else 1

    # cross-checks
    src = kvt.raw.get("cached_by_source", {})
    vh, vd = int(src.get("host", 0)), int(src.get("disk", 0))
    print(f"vLLM's own counter vllm:prompt_tokens_cached_by_source (kvtier run, warm-up included): host {vh}, "
          f"disk {vd}")
    st = kvt.raw.get("storage", {}).get("ssd", {})
    cnt = kvt.raw.get("counters", {})
    m = kvt.raw.get("metrics", {})
    print(f"kvtier: scheduler {kvt.raw.get('scheduler')}, {cnt.get('prefetches', 0)} SSD prefetches "
          f"({cnt.get('none_answers', 0)} 'not yet' answers while they ran), SSD tier {st.get('hits', 0)} chunk "
          f"hits, {st.get('corrupt', 0)} corrupt, load errors "
          f"{int(m.get('kvtier_connector_load_error_blocks_total', 0))} blocks; {cnt.get('idle_steps', 0)} engine "
          f"steps with nothing to compute ({cnt.get('steps_during_async_loads', 0)} steps while "
          f"{cnt.get('async_loads', 0)} asynchronous loads were in flight)")
    for r in (base, kvt):
        by = {key(x): x for x in r.requests}
        lost = []
        for x in r.requests:
            prev = by.get((x["conv"], x["turn"] - 1))
            if prev is not None and x["gpu_hit"] + x["host_hit"] + x["ssd_hit"] < (prev["prompt_len"] + len(
                    prev["tokens"])) // 2:
                lost.append(f"{x['conv']}/{x['turn']}")
        print(f"{r.name}: {len(lost)} of {sum(1 for x in r.requests if x['turn'] >= 2)} follow-up turns recomputed "
              f"more than half of their history" + (f" (conversation/turn {', '.join(lost[:12])}"
                                                    f"{', ...' if len(lost) > 12 else ''})" if lost else ""))
    print(f"engine start: {base.start_s:.0f} s (no connector), {kvt.start_s:.0f} s (kvtier)")
    print(LMCACHE_CPU_NOTE)
    return 0 if ok else 1


def _print_token_check(base: RunResult, kvt: RunResult, turns: list[Turn], b_by: dict, k_by: dict) -> bool:
    """Whether both runs generated the same tokens for every request (printed either way)."""
    diff = [(t.conv, t.turn) for t in turns if b_by[(t.conv, t.turn)]["tokens"] != k_by[(t.conv, t.turn)]["tokens"]]
    if diff:
        print(f"generated tokens: DIFFERENT in {len(diff)} of {len(turns)} requests (first: conversation "
              f"{diff[0][0]} turn {diff[0][1]})")
        return False
    n_tok = sum(len(r["tokens"]) for r in base.requests)
    print(f"generated tokens: identical in both runs ({len(turns)} requests, {n_tok} tokens, greedy)")
    return True


def _plot(base: RunResult, kvt: RunResult, path: str, mp: RunResult | None = None) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot written ({path})")
        return
    fig, ax = plt.subplots(figsize=(7, 4.2))
    runs = [(base, "tab:gray", -0.08), (kvt, "tab:blue", 0.08)] + ([(mp, "tab:orange", 0.0)] if mp else [])
    for r, color, dx in runs:
        max_turn = max(x["turn"] for x in r.requests)
        xs = [x["turn"] + dx for x in r.requests]
        ys = [1000 * x["ttft"] for x in r.requests]
        ax.scatter(xs, ys, s=14, alpha=0.45, color=color)
        turns = list(range(1, max_turn + 1))
        means = [1000 * statistics.mean(r.ttft(n, n)) for n in turns]
        ax.plot(turns, means, marker="o", color=color, label=f"{r.name} (mean)")
    ax.set_xlabel("turn of the conversation")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("Mooncake conversations on vLLM (CPU, tiny Llama): TTFT per turn")
    ax.set_xticks(range(1, max(x["turn"] for x in base.requests) + 1))
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot: {os.path.abspath(path)}")
