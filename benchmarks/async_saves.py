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
import random
import statistics
import tempfile
import uuid
from pathlib import Path

from kvtier.launch.lmcache_yaml import write_lmcache_yaml
from kvtier.testing.vllm_engine import EngineProcess, tiny_llama

#: a somewhat larger random Llama than the tests' (4 layers of 256): the engine step has work to hide saves behind
MODEL = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4}


def ktc(work: Path, async_saves: bool) -> dict:
    tag = uuid.uuid4().hex[:6]
    yml = write_lmcache_yaml(work / f"lmcache-{tag}.yaml", ssd_path=work / f"ssd-{tag}", chunk_size=32,
                             ssd_capacity_gb=1)
    return {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.connector", "kv_role": "kv_both",
            "engine_id": f"kvtier-bench-{uuid.uuid4().hex[:8]}",
            "kv_connector_extra_config": {"config_file": yml, "kvtier.connector": {"async_saves": async_saves}}}


def start(work: Path, name: str, args: argparse.Namespace, model: str, ktc_: dict | None) -> EngineProcess:
    return EngineProcess(work, name, model, env={"VLLM_CPU_KVCACHE_SPACE": "2"}, watchdog_s=None, llm={
        "max_model_len": 2048, "max_num_seqs": args.prompts, "kv_transfer_config": ktc_})


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
        model = tiny_llama(work / "model", **MODEL)
        procs: dict[str, EngineProcess] = {}
        res: dict[str, list[dict]] = {k: [] for k in ("base", "sync", "async")}
        try:
            procs["base"] = start(work, "base", args, model, None)
            procs["sync"] = start(work, "sync", args, model, ktc(work, False))
            procs["async"] = start(work, "async", args, model, ktc(work, True))
            for p in procs.values():
                p.ready()
            rngs = {k: random.Random(args.seed) for k in procs}  # every engine gets the same new prompts
            names = list(procs)
            for r in range(args.rounds + 1):  # round 0 warms up
                for k in names[r % 3:] + names[:r % 3]:  # each engine goes first in every third round
                    prompts = [[rngs[k].randrange(1, 1000) for _ in range(args.prompt_tokens)]
                               for _ in range(args.prompts)]
                    # the round's queued saves and SSD writes land before the next engine's round
                    out = procs[k].generate(prompts, args.max_tokens, flush=True)
                    rec = {"seconds": out["seconds"], "drained_seconds": out.get("drained_seconds", out["seconds"]),
                           "output_tokens": sum(len(o["tokens"]) for o in out["outputs"])}
                    if r:
                        res[k].append(rec)
        finally:
            for p in procs.values():
                p.close(timeout=120)
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
