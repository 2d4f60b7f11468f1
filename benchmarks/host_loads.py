"""Benchmark: host-tier loads inside the engine step vs off it (`sync_load_budget_tokens`, #14), vLLM CPU engine.

    .venv/bin/python benchmarks/host_loads.py [--rounds 5] [--budgets 0,256,1024,4096] [--no-base] [--json F]

The question: should small host-resident loads stay synchronous? A load inside the step (`(n, False)`) makes
that step's forward pass wait for the copy, so every running request's next token waits too; a load off the
step (`(n, True)`, the default budget 0) leaves the step alone but parks the request in WAITING_FOR_REMOTE_KVS
until the worker reports the load (at least one more engine step before its prefill runs).

One engine per budget (kvtier's connector, `kvtier.connector.sync_load_budget_tokens: B`) plus `base` (no
connector: vLLM recomputes every follow-up, the no-cache reference), each in its own process, the same tiny
random Llama (no download) and identical vLLM settings; vLLM's own prefix cache is off, so a follow-up's history
is only in kvtier's host tier (as when vLLM's GPU/CPU cache evicted it). Rounds are interleaved (one engine busy
at a time, the order rotating) so a drifting, shared machine hits each alike. Every round, with new random tokens:

1. untimed: `len(--history)` first turns (prompts of those lengths, one output token) run and their saves land
   in the host tier (flushed);
2. timed: `--background` requests of `--bg-prompt` tokens decode `--bg-tokens` tokens each (the traffic a
   synchronous load stalls) while the follow-ups (history + `--new-tokens` new tokens, `--fu-tokens` output
   tokens) arrive one every `--gap-steps` engine steps. Measured: each follow-up's TTFT (its arrival to its
   first token), the background requests' inter-token latency (ITL), and output tokens/s of the whole phase.

Printed per engine: medians over rounds of the round's median follow-up TTFT, median background ITL and output
tok/s; loads inside/off the step and host-tier hit tokens (the workload really hits the host tier); whether the
follow-ups' tokens equal `base`'s in every round; then the medians of per-round ratios against budget 0 (the
current default) and against `base`. TTFT/ITL ratio < 1 and throughput ratio > 1 mean better than the reference.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

from kvtier.testing.vllm_engine import tiny_llama

REPO = Path(__file__).resolve().parent.parent

#: the benchmark's random Llama (larger than the tests': 4 layers, hidden 256)
MODEL_CONFIG = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
                "num_key_value_heads": 2, "vocab_size": 1024, "max_position_embeddings": 8192}

ENGINE_SCRIPT = """
import hashlib, json, random, statistics, sys, time


def main():
    a = json.loads(open(sys.argv[1]).read())
    from vllm import LLM, SamplingParams

    kw = {"kv_transfer_config": a["ktc"]} if a.get("ktc") else {}
    llm = LLM(model=a["model"], skip_tokenizer_init=True, dtype="float32", enforce_eager=True, block_size=32,
              max_model_len=a["max_model_len"], enable_prefix_caching=False, max_num_seqs=a["max_num_seqs"], seed=0,
              **kw)
    eng = llm.llm_engine
    core = eng.engine_core.engine_core
    conn = core.scheduler.connector
    rng = random.Random(a["seed"])
    first_turn = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    sp_bg = SamplingParams(temperature=0.0, max_tokens=a["bg_tokens"], ignore_eos=True)
    sp_fu = SamplingParams(temperature=0.0, max_tokens=a["fu_tokens"], ignore_eos=True)
    print("ready", flush=True)
    for r in range(a["rounds"] + 1):  # round 0 warms up
        sys.stdin.readline()  # the driver's go
        hist = [[rng.randrange(1, 1000) for _ in range(n)] for n in a["history"]]
        news = [[rng.randrange(1, 1000) for _ in range(a["new_tokens"])] for _ in hist]
        bg = [[rng.randrange(1, 1000) for _ in range(a["bg_prompt"])] for _ in range(a["background"])]
        llm.generate([{"prompt_token_ids": h} for h in hist], first_turn, use_tqdm=False)
        before = dict(conn.scheduler_side.counters) if conn is not None else {}
        if conn is not None:  # the first turns' KV is in the host tier before the timed part
            conn.scheduler_side.flush(120)
        arrivals = {a["first_step"] + i * a["gap_steps"]: i for i in range(len(hist))}
        added, first, last, ntok, itl, fu_tokens = {}, {}, {}, {}, [], {}
        t0 = time.perf_counter()
        for j, p in enumerate(bg):
            eng.add_request(f"r{r}-bg{j}", {"prompt_token_ids": p}, sp_bg)
        step = 0
        while len(added) < len(hist) or eng.has_unfinished_requests():
            if not eng.has_unfinished_requests():  # idle until the next arrival: skip ahead
                step = min(s for s in arrivals if s >= step)
            if step in arrivals:
                i = arrivals[step]
                rid = f"r{r}-fu{i}"
                eng.add_request(rid, {"prompt_token_ids": hist[i] + news[i]}, sp_fu)
                added[rid] = time.perf_counter()
            outs = eng.step()
            now = time.perf_counter()
            for o in outs:
                n = len(o.outputs[0].token_ids)
                k = ntok.get(o.request_id, 0)
                if n <= k:
                    continue
                if k == 0:
                    first[o.request_id] = now
                elif "-bg" in o.request_id:
                    itl.append((now - last[o.request_id]) / (n - k))
                last[o.request_id] = now
                ntok[o.request_id] = n
                if "-fu" in o.request_id:
                    fu_tokens[o.request_id] = list(o.outputs[0].token_ids)
            step += 1
        dt = time.perf_counter() - t0
        after = dict(conn.scheduler_side.counters) if conn is not None else {}
        ttft = [first[rid] - added[rid] for rid in sorted(added)]
        digest = hashlib.sha256(json.dumps([fu_tokens[rid] for rid in sorted(added)]).encode()).hexdigest()[:16]
        print(json.dumps({"seconds": dt, "steps": step, "output_tokens": sum(ntok.values()),
                          "ttft": ttft, "ttft_median": statistics.median(ttft),
                          "itl_median": statistics.median(itl) if itl else 0.0, "digest": digest,
                          "sync_loads": after.get("sync_loads", 0) - before.get("sync_loads", 0),
                          "async_loads": after.get("async_loads", 0) - before.get("async_loads", 0)}), flush=True)
    out = {}
    if conn is not None:
        from kvtier.connector.metrics import kvtier_samples

        m = kvtier_samples()
        out = {"host_hit_tokens": m.get("kvtier_connector_hit_tokens_total/tier=host", 0),
               "load_error_blocks": m.get("kvtier_connector_load_error_blocks_total", 0)}
    print(json.dumps({"final": out}), flush=True)
    core.shutdown()


if __name__ == "__main__":
    main()
"""


def ktc(work: Path, budget: int) -> dict:
    text = (REPO / "configs" / "lmcache-kvtier.yaml").read_text()
    text = text.replace("/var/cache/kvtier", str(work / f"ssd-{uuid.uuid4().hex[:6]}"))
    text = text.replace("chunk_size: 256", "chunk_size: 32")
    text = text.replace("max_local_cpu_size: 5 ", "max_local_cpu_size: 1 ")
    text = text.replace("kvtier.ssd_capacity_gb: 100", "kvtier.ssd_capacity_gb: 1")
    yml = work / f"lmcache-{uuid.uuid4().hex[:6]}.yaml"
    yml.write_text(text)
    return {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.connector", "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute", "engine_id": f"kvtier-bench-{uuid.uuid4().hex[:8]}",
            "kv_connector_extra_config": {"config_file": str(yml),
                                          "kvtier.connector": {"sync_load_budget_tokens": budget}}}


def start(work: Path, name: str, args: argparse.Namespace, model: Path, ktc_: dict | None) -> subprocess.Popen:
    script = work / "engine.py"
    script.write_text(ENGINE_SCRIPT)
    spec = {"model": str(model), "ktc": ktc_, "rounds": args.rounds, "history": args.history,
            "new_tokens": args.new_tokens, "fu_tokens": args.fu_tokens, "background": args.background,
            "bg_prompt": args.bg_prompt, "bg_tokens": args.bg_tokens, "gap_steps": args.gap_steps,
            "first_step": 2, "seed": args.seed, "max_num_seqs": args.background + len(args.history),
            "max_model_len": max(args.history) + args.new_tokens + args.fu_tokens + 64}
    (work / f"{name}.args.json").write_text(json.dumps(spec))
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="1", LMCACHE_TRACK_USAGE="false",
               VLLM_ENABLE_V1_MULTIPROCESSING="0")
    return subprocess.Popen([sys.executable, str(script), str(work / f"{name}.args.json")], cwd=work, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(work / f"{name}.log", "w"),
                            text=True)


def read_line(name: str, p: subprocess.Popen, work: Path) -> str:
    """The engine's next protocol line ("ready" or a JSON record), skipping anything else it printed."""
    while True:
        line = p.stdout.readline()
        if not line:
            raise SystemExit(f"{name} stopped:\n{(work / f'{name}.log').read_text()[-4000:]}")
        if line.startswith("ready") or line.startswith("{"):
            return line


def uptime() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg()) + f" ({os.cpu_count()} CPUs)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--budgets", default="0,256,1024,4096", help="sync_load_budget_tokens values (0 first)")
    ap.add_argument("--no-base", action="store_true", help="leave out the engine without a connector")
    ap.add_argument("--history", default="192,768,3072,192,768,3072",
                    help="history lengths of the follow-ups (multiples of the 32-token chunk)")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--fu-tokens", type=int, default=8)
    ap.add_argument("--background", type=int, default=4)
    ap.add_argument("--bg-prompt", type=int, default=64)
    ap.add_argument("--bg-tokens", type=int, default=48)
    ap.add_argument("--gap-steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json")
    args = ap.parse_args()
    args.history = [int(x) for x in args.history.split(",")]
    budgets = [int(x) for x in args.budgets.split(",")]
    if budgets[0] != 0:
        raise SystemExit("--budgets must start with 0 (the reference: every load off the step)")
    print(f"load average at start: {uptime()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="async-host-loads-") as tmp:
        work = Path(tmp)
        model = work / "model"
        tiny_llama(model, **MODEL_CONFIG)
        procs: dict[str, subprocess.Popen] = {}
        if not args.no_base:
            procs["base"] = start(work, "base", args, model, None)
        for b in budgets:
            procs[f"B{b}"] = start(work, f"B{b}", args, model, ktc(work, b))
        res: dict[str, list[dict]] = {k: [] for k in procs}
        final: dict[str, dict] = {}
        try:
            for k, p in procs.items():
                read_line(k, p, work)
            names = list(procs)
            for r in range(args.rounds + 1):
                s = r % len(names)
                for k in names[s:] + names[:s]:  # each engine goes first in turn
                    p = procs[k]
                    p.stdin.write("go\n")
                    p.stdin.flush()
                    rec = json.loads(read_line(k, p, work))
                    if r:
                        res[k].append(rec)
            for k, p in procs.items():
                final[k] = json.loads(read_line(k, p, work))["final"]
                p.stdin.close()
                p.wait(timeout=120)
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
    print(f"load average at end: {uptime()}")
    print(f"workload: {args.rounds} rounds; follow-ups with histories {args.history} (+{args.new_tokens} new "
          f"tokens, {args.fu_tokens} output tokens, one every {args.gap_steps} steps) while {args.background} "
          f"requests decode {args.bg_tokens} tokens")

    def tps(x: dict) -> float:
        return x["output_tokens"] / x["seconds"]

    med: dict[str, dict] = {}
    ref_digests = [x["digest"] for x in res.get("base", [])]
    for k, v in res.items():
        m = med[k] = {"ttft_ms": 1000 * statistics.median(x["ttft_median"] for x in v),
                      "itl_ms": 1000 * statistics.median(x["itl_median"] for x in v),
                      "tok_s": statistics.median(tps(x) for x in v),
                      "sync_loads": sum(x["sync_loads"] for x in v), "async_loads": sum(x["async_loads"] for x in v),
                      **final.get(k, {})}
        same = "" if not ref_digests else (", tokens = base's" if [x["digest"] for x in v] == ref_digests
                                           else ", TOKENS DIFFER from base's")
        loads = (f", loads {m['sync_loads']} in / {m['async_loads']} off the step, host hits "
                 f"{int(m.get('host_hit_tokens', 0))} tokens" if k != "base" else "")
        print(f"  {k:6s}: follow-up TTFT {m['ttft_ms']:7.1f} ms, background ITL {m['itl_ms']:6.1f} ms, "
              f"{m['tok_s']:7.1f} output tok/s{loads}{same}")
    ratios: dict[str, dict] = {}
    for ref in ("B0", "base"):
        if ref not in res:
            continue
        for k in res:
            if k == ref:
                continue
            a, b = res[k], res[ref]
            rr = ratios[f"{k}/{ref}"] = {
                "ttft": statistics.median(x["ttft_median"] / y["ttft_median"] for x, y in zip(a, b)),
                "itl": statistics.median(x["itl_median"] / y["itl_median"] for x, y in zip(a, b) if y["itl_median"]),
                "tok_s": statistics.median(tps(x) / tps(y) for x, y in zip(a, b))}
            print(f"  {k}/{ref}: TTFT {rr['ttft']:.3f}, ITL {rr['itl']:.3f}, throughput {rr['tok_s']:.3f} "
                  "(medians of per-round ratios)")
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": res, "medians": med, "ratios": ratios,
                                               "args": vars(args)}, indent=1))


if __name__ == "__main__":
    main()
