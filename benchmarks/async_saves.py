"""Benchmark: saves inside the engine step vs off it (#14), on a workload without reuse, vLLM CPU engine.

    .venv/bin/python benchmarks/async_saves.py [--rounds 5] [--prompts 8] [--prompt-tokens 512] [--max-tokens 32]

Three engines of the same tiny random Llama (no download), each in its own process, identical vLLM settings:
`base` (no connector), `sync` (kvtier, `async_saves: false`: each step copies its new chunks into the host tier
before it returns) and `async` (kvtier's default: the copies run on the worker's transfer thread while the next
steps run). All three are started first; then rounds are interleaved (one engine busy at a time, the order rotating
from round to round) so a drifting, shared machine hits each alike. Every round submits `--prompts`
new random prompts (no prefix is ever reused, so kvtier can only cost), after one warm-up round per engine.
After each round an engine's queued saves and SSD writes are flushed (outside its timed part, so deferred work
never runs during another engine's round; the time until they landed is printed too). Printed per engine: the
median over rounds of output tokens/s and of the round's wall time, and the medians of
the per-round ratios sync/base, async/base and async/sync (throughput; > 1 is faster).
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

REPO = Path(__file__).resolve().parent.parent

MODEL_SCRIPT = """
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=1024, max_position_embeddings=4096, initializer_range=0.2)
LlamaForCausalLM(cfg).save_pretrained(sys.argv[1])
"""

ENGINE_SCRIPT = """
import json, random, sys, time


def main():
    a = json.loads(open(sys.argv[1]).read())
    from vllm import LLM, SamplingParams

    kw = {"kv_transfer_config": a["ktc"]} if a.get("ktc") else {}
    llm = LLM(model=a["model"], skip_tokenizer_init=True, dtype="float32", enforce_eager=True, block_size=32,
              max_model_len=2048, enable_prefix_caching=False, max_num_seqs=a["prompts"], seed=0, **kw)
    sp = SamplingParams(temperature=0.0, max_tokens=a["max_tokens"], ignore_eos=True)
    rng = random.Random(a["seed"])
    print("ready", flush=True)
    for r in range(a["rounds"] + 1):  # round 0 warms up
        sys.stdin.readline()  # the driver's go
        prompts = [{"prompt_token_ids": [rng.randrange(1, 1000) for _ in range(a["prompt_tokens"])]}
                   for _ in range(a["prompts"])]
        t0 = time.perf_counter()
        out = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        conn = llm.llm_engine.engine_core.engine_core.scheduler.connector
        if conn is not None:  # the round's queued saves and SSD writes land before the next engine's round
            conn.scheduler_side.client.call({"op": "flush", "timeout": 120})
        print(json.dumps({"seconds": dt, "drained_seconds": time.perf_counter() - t0,
                          "output_tokens": sum(len(o.outputs[0].token_ids) for o in out)}), flush=True)
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
"""


def ktc(work: Path, async_saves: bool) -> dict:
    text = (REPO / "configs" / "lmcache-kvtier.yaml").read_text()
    text = text.replace("/var/cache/kvtier", str(work / f"ssd-{uuid.uuid4().hex[:6]}"))
    text = text.replace("chunk_size: 256", "chunk_size: 32")
    text = text.replace("kvtier.ssd_capacity_gb: 100", "kvtier.ssd_capacity_gb: 1")
    yml = work / f"lmcache-{uuid.uuid4().hex[:6]}.yaml"
    yml.write_text(text)
    return {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.connector", "kv_role": "kv_both",
            "engine_id": f"kvtier-bench-{uuid.uuid4().hex[:8]}",
            "kv_connector_extra_config": {"config_file": str(yml),
                                          "kvtier.connector": {"async_saves": async_saves}}}


def start(work: Path, name: str, args: argparse.Namespace, model: Path, ktc_: dict | None) -> subprocess.Popen:
    script = work / "engine.py"
    script.write_text(ENGINE_SCRIPT)
    spec = {"model": str(model), "ktc": ktc_, "rounds": args.rounds, "prompts": args.prompts,
            "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "seed": args.seed}
    (work / f"{name}.args.json").write_text(json.dumps(spec))
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="2", LMCACHE_TRACK_USAGE="false",
               VLLM_ENABLE_V1_MULTIPROCESSING="0")
    return subprocess.Popen([sys.executable, str(script), str(work / f"{name}.args.json")], cwd=work, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(work / f"{name}.log", "w"),
                            text=True)


def read_line(name: str, p: subprocess.Popen, work: Path) -> str:
    """The engine's next protocol line ("ready" or a round's JSON), skipping anything else it printed."""
    while True:
        line = p.stdout.readline()
        if not line:
            raise SystemExit(f"{name} stopped:\n{(work / f'{name}.log').read_text()[-4000:]}")
        if line.startswith("ready") or line.startswith("{"):
            return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvtier-async-saves-") as tmp:
        work = Path(tmp)
        model = work / "model"
        subprocess.run([sys.executable, "-c", MODEL_SCRIPT, str(model)], check=True, capture_output=True)
        procs = {"base": start(work, "base", args, model, None),
                 "sync": start(work, "sync", args, model, ktc(work, False)),
                 "async": start(work, "async", args, model, ktc(work, True))}
        res: dict[str, list[dict]] = {k: [] for k in procs}
        try:
            for k, p in procs.items():
                read_line(k, p, work)
            names = list(procs)
            for r in range(args.rounds + 1):
                for k in names[r % 3:] + names[:r % 3]:  # each engine goes first in every third round
                    p = procs[k]
                    p.stdin.write("go\n")
                    p.stdin.flush()
                    rec = json.loads(read_line(k, p, work))
                    if r:
                        res[k].append(rec)
            for p in procs.values():
                p.stdin.close()
                p.wait(timeout=120)
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
    med = {k: {"tok_s": statistics.median(r["output_tokens"] / r["seconds"] for r in v),
               "round_s": statistics.median(r["seconds"] for r in v),
               "drained_s": statistics.median(r["drained_seconds"] for r in v)} for k, v in res.items()}
    print(f"workload: {args.rounds} rounds x {args.prompts} new prompts of {args.prompt_tokens} tokens, "
          f"{args.max_tokens} output tokens each (no reuse)")
    for k, m in med.items():
        print(f"  {k:5s}: {m['tok_s']:8.1f} output tok/s (median), round {m['round_s']:.2f} s, "
              f"{m['drained_s']:.2f} s until its saves and SSD writes landed")
    def tps(r: dict) -> float:
        return r["output_tokens"] / r["seconds"]

    for a, b in (("sync", "base"), ("async", "base"), ("async", "sync")):
        ratio = statistics.median(tps(x) / tps(y) for x, y in zip(res[a], res[b]))
        med[f"{a}/{b}"] = ratio
        print(f"  {a}/{b} throughput: {ratio:.3f} (median of per-round ratios)")
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": res, "medians": med, "args": vars(args)}, indent=1))


if __name__ == "__main__":
    main()
