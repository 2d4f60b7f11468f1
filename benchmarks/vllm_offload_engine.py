"""The engine-level run of vLLM's own offloading path with kvtier's secondary tier and CPU policy (issue 27).

vLLM's `OffloadingConnector` refuses to start on vLLM's CPU platform ("CPU Offloading is currently only supported
on CUDA-alike and XPU GPUs"), so this run needs a GPU machine with vLLM; `benchmarks/gpu_check.sh` runs it where
vLLM imports. Three engine processes over the tests' tiny random Llama (no download), three conversations of two
turns, one request at a time, greedy:

1. **baseline**: no connector.
2. **kvtier**: `OffloadingConnector` + `TieringOffloadingSpec` exactly as `configs/vllm-offloading-kvtier.json` (a
   small CPU primary tier, kvtier's `KVTierAdaptive` policy, kvtier's secondary tier on `--ssd-path`).
3. **restart**: a new engine over the same SSD directory; the turn-2 prompts only (GPU and CPU caches are empty,
   so every offloaded token comes from kvtier's tier).

Checked: identical greedy tokens in every run; in the restart run every turn-2 prompt has its history's full blocks
cached (vLLM's `num_cached_tokens`), the tier's load jobs all succeeded (`kvtier_vllm_tier_jobs_total`), and no
store job failed. Prints one line per check and exits 1 when one fails, 3 when this machine cannot run the
engine (no GPU platform).

    python benchmarks/vllm_offload_engine.py --ssd-path /var/tmp/kvtier-offload-check
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import shutil
import sys
import tempfile
from pathlib import Path

from kvtier.testing.vllm_engine import EngineFailed, EngineProcess, run_conversations, tiny_llama

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "vllm-offloading-kvtier.json"
BLOCK = 32
#: two turns per conversation: a long first turn so the history spans many blocks, then a short follow-up
TURNS = (400, 40)
ANSWER = 16
SCHEDULE = [[0], [1], [2], [0], [1], [2]]
ENGINE_ENV = {"VLLM_TARGET_DEVICE": "cuda"}
LLM_KW = {"block_size": BLOCK, "enable_prefix_caching": True, "dtype": "float16", "max_model_len": 2048,
          "gpu_memory_utilization": 0.3, "disable_log_stats": False}


def kv_transfer_config(ssd_path: Path, cpu_bytes: int) -> dict:
    cfg = copy.deepcopy(json.loads(CONFIG.read_text()))
    extra = cfg["kv_connector_extra_config"]
    extra["cpu_bytes_to_use"] = cpu_bytes
    extra["secondary_tiers"][0].update(ssd_path=str(ssd_path), ssd_capacity_gb=1)
    return cfg


def engine(work: Path, name: str, model: Path, kv: dict | None) -> EngineProcess:
    llm = dict(LLM_KW, kv_transfer_config=kv)
    return EngineProcess(work, name, model, llm=llm, env=ENGINE_ENV, watchdog_s=900)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ssd-path", default=None, help="directory of kvtier's tier (default: a temporary one)")
    ap.add_argument("--cpu-mib", type=int, default=64, help="vLLM's CPU primary tier (cpu_bytes_to_use)")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="kvtier-offload-engine-"))
    work.mkdir(parents=True, exist_ok=True)
    ssd = Path(args.ssd_path or work / "ssd")
    shutil.rmtree(ssd, ignore_errors=True)
    rng = random.Random(3)
    convs = [[[rng.randrange(1, 1000) for _ in range(n)] for n in TURNS] for _ in range(3)]
    model = Path(tiny_llama(work / "model"))
    kv = kv_transfer_config(ssd, args.cpu_mib << 20)
    runs = {}
    try:
        for name, cfg in (("baseline", None), ("kvtier", kv)):
            with engine(work, name, model, cfg) as eng:
                eng.ready(900)
                runs[name] = {"batches": run_conversations(eng, convs, SCHEDULE, ANSWER), **eng.stats()}
        hist = [b[0] for b in runs["baseline"]["batches"][:3]]
        turn2 = [convs[i][0] + h["tokens"] + convs[i][1] for i, h in enumerate(hist)]
        with engine(work, "restart", model, kv) as eng:
            eng.ready(900)
            runs["restart"] = {"outputs": [eng.generate([p], ANSWER)["outputs"][0] for p in turn2], **eng.stats()}
    except EngineFailed as e:
        if "only supported on CUDA-alike" in str(e):
            print("not runnable here: vLLM's CPU offloading needs a CUDA-alike or XPU platform")
            return 3
        raise
    base = [[x["tokens"] for x in b] for b in runs["baseline"]["batches"]]
    ok = True

    def check(name: str, cond: bool, detail: object) -> None:
        nonlocal ok
        ok &= cond
        print(f"[{'ok' if cond else 'FAIL'}] {name}: {detail}")

    check("tokens equal baseline (kvtier run)", [[x["tokens"] for x in b] for b in runs["kvtier"]["batches"]] == base,
          "6 requests")
    check("tokens equal baseline (restart, turn 2)", [o["tokens"] for o in runs["restart"]["outputs"]] ==
          [b[0]["tokens"] for b in runs["baseline"]["batches"][3:]], "3 requests")
    want = [(len(p) - 1) // BLOCK * BLOCK for p in turn2]
    history_blocks = [(TURNS[0] + ANSWER) // BLOCK * BLOCK] * 3
    got = [o["cached"] for o in runs["restart"]["outputs"]]
    check("restart: turn-2 histories cached from kvtier's tier", all(g >= h for g, h in zip(got, history_blocks)),
          f"cached {got}, histories' full blocks {history_blocks}, prompts' full blocks {want}")
    m = runs["restart"]["metrics"]
    jobs = {k.split("/", 1)[1]: v for k, v in m.items() if k.startswith("kvtier_vllm_tier_jobs_total/")}
    check("restart: every load job of kvtier's tier succeeded",
          jobs.get("kind=load/result=ok", 0) > 0 and not any(v for k, v in jobs.items()
                                                              if k.startswith("kind=load") and "ok" not in k), jobs)
    m1 = runs["kvtier"]["metrics"]
    failed = sum(v for k, v in m1.items() if k.startswith("kvtier_vllm_tier_jobs_total/kind=store/result=failed"))
    check("kvtier run: no failed store job", failed == 0, f"{failed} failed")
    print(f"cached by source (restart): {runs['restart'].get('cached_by_source')}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
