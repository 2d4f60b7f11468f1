"""Benchmark: does the engine spin past a starved transfer? Idle steps, load time and TTFT of asynchronous loads.

    .venv/bin/python benchmarks/idle_steps.py [--rounds 3] [--conversations 8] [--history 768] [--json F]

The question behind it (a follow-up turn of the demo once waited 7-9 s for its first token): vLLM's in-process
engine steps in the caller's thread, and a step with nothing to compute returns at once. While a request waits
for its asynchronous load on kvtier's transfer thread, the engine therefore runs empty steps back to back, each
holding the GIL for most of its length; the transfer thread, whose load is mostly Python (LMCache's retrieve), gets
the GIL back only when CPython's switch interval (5 ms) forces the engine thread to drop it, once per GIL release
of its own (a convoy). The experiment separates the suspects:

- `wait 0`: kvtier's idle wait off (`kvtier.connector.idle_wait_ms: 0`, the behaviour before the fix);
- `wait 0, switch 0.5 ms`: the same with CPython's switch interval at 0.5 ms (`sys.setswitchinterval`, set in the
  engine process by a `sitecustomize` module): if the load time falls with the switch interval, the transfer
  thread was waiting for the GIL, not for the disk or a lock of kvtier's;
- `wait 20`: the default (an idle step waits on the worker, GIL released, at most 20 ms, for a load, prefetch or
  save in flight to end).

Workload (one engine process per configuration, the same tiny random Llama, vLLM's prefix cache off, a host tier
that holds everything, `sync_load_budget_tokens: 0` so every load runs off the step): `--conversations` first turns
of `--history` tokens run and their saves land (untimed); then, timed, each conversation's second turn (history +
32 new tokens, 8 output tokens) runs alone, so while its load is in flight nothing else is runnable. Measured per
configuration and round: engine steps with nothing scheduled per asynchronous load (the connector's counters), the
mean load time on the transfer thread (its job's start to end), and the median and slowest follow-up TTFT (the
`generate` call of one request with `max_tokens=1`, a separate request from the 8-token one). Printed: each
configuration's min / median / max over rounds, and the per-round ratios against `wait 0` (the old behaviour).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import uuid
from pathlib import Path

from kvtier.tools.lmcache_yaml import write_lmcache_yaml
from kvtier.tools.vllm_engine import EngineProcess, tiny_llama

CHUNK = 32
#: (name, idle_wait_ms, switch interval in seconds or None for CPython's default)
CONFIGS = [("wait 0", 0.0, None), ("wait 0, switch 0.5 ms", 0.0, 0.0005), ("wait 20", 20.0, None)]
SITECUSTOMIZE = """import os, sys
v = os.environ.get("KVTIER_BENCH_SWITCH_INTERVAL_S")
if v:
    sys.setswitchinterval(float(v))
"""


def _one(work: Path, model: str, name: str, wait_ms: float, switch: float | None, args: argparse.Namespace,
         seed: int) -> dict:
    rng = random.Random(seed)
    hist = [[rng.randrange(1, 1000) for _ in range(args.history)] for _ in range(args.conversations)]
    tag = uuid.uuid4().hex[:6]
    yaml_path = write_lmcache_yaml(work / f"lmcache-{tag}.yaml", ssd_path=work / f"ssd-{tag}", chunk_size=CHUNK,
                                   host_gb=0.5, ssd_capacity_gb=0.5)
    ktc = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.connector", "kv_role": "kv_both",
           "kv_load_failure_policy": "recompute", "engine_id": f"kvtier-idle-{tag}",
           "kv_connector_extra_config": {"config_file": str(yaml_path), "kvtier.connector": {
               "sync_load_budget_tokens": 0, "idle_wait_ms": wait_ms}}}
    site = work / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {"PYTHONPATH": os.pathsep.join([str(site)] + [p for p in os.environ.get("PYTHONPATH", "").split(
        os.pathsep) if p])}
    if switch is not None:
        env["KVTIER_BENCH_SWITCH_INTERVAL_S"] = str(switch)
    llm = {"kv_transfer_config": ktc, "max_model_len": args.history + 128, "max_num_seqs": 4}
    with EngineProcess(work, f"{name.replace(' ', '_').replace(',', '')}-{tag}", model, llm=llm, env=env,
                       watchdog_s=900) as eng:
        eng.ready()
        for p in hist:  # first turns: their chunks land in the host tier
            eng.generate([p], max_tokens=1, flush=True)
        before = eng.stats()["counters"]
        ttft = []
        for i, p in enumerate(hist):
            follow = p + [rng.randrange(1, 1000) for _ in range(32)]
            ttft.append(eng.generate([follow], max_tokens=1)["seconds"])
            eng.generate([follow + [7]], max_tokens=8, flush=True)  # decode work between the timed requests
        st = eng.stats()
    c = {k: st["counters"][k] - before.get(k, 0) for k in st["counters"]}
    m = st["metrics"]
    loads = max(c["async_loads"], 1)
    return {"idle_steps_per_load": c["idle_steps"] / loads, "steps_during_loads_per_load":
            c["steps_during_async_loads"] / loads, "async_loads": c["async_loads"],
            "load_ms": 1000 * m.get("kvtier_connector_load_seconds_sum", 0.0) /
            max(m.get("kvtier_connector_load_seconds_count", 0.0), 1.0),
            "ttft_ms_median": 1000 * statistics.median(ttft), "ttft_ms_max": 1000 * max(ttft)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--history", type=int, default=768, help="tokens of each first turn (the loaded history)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvtier-idle-steps-"))
    model = tiny_llama(work / "model")
    res: dict[str, list[dict]] = {n: [] for n, _, _ in CONFIGS}
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    total = args.rounds * len(CONFIGS)
    bar = tqdm(total=total, desc="engine runs", file=sys.stderr) if tqdm else None
    for r in range(args.rounds):
        order = CONFIGS[r % len(CONFIGS):] + CONFIGS[:r % len(CONFIGS)]  # rotate: drift hits each alike
        for name, wait, switch in order:
            res[name].append(_one(work, str(model), name, wait, switch, args, seed=r))
            if bar:
                bar.update(1)
    if bar:
        bar.close()

    def mmm(xs: list[float]) -> str:
        return f"{min(xs):8.1f} {statistics.median(xs):8.1f} {max(xs):8.1f}"

    print(f"\n{args.conversations} follow-ups a round, history {args.history} tokens, {args.rounds} rounds; "
          "min / median / max over rounds")
    for key, label in (("idle_steps_per_load", "idle steps per async load"),
                       ("load_ms", "load time on the transfer thread (ms)"),
                       ("ttft_ms_median", "follow-up TTFT, median (ms)"), ("ttft_ms_max", "follow-up TTFT, max (ms)")):
        print(f"\n{label}")
        for name, _, _ in CONFIGS:
            print(f"  {name:<24}{mmm([x[key] for x in res[name]])}")
    print("\nper-round ratios against 'wait 0' (median over rounds; < 1: less than before the fix)")
    ref = res[CONFIGS[0][0]]
    for name, _, _ in CONFIGS[1:]:
        parts = []
        for key in ("idle_steps_per_load", "load_ms", "ttft_ms_median", "ttft_ms_max"):
            ratios = [x[key] / max(y[key], 1e-9) for x, y in zip(res[name], ref)]
            parts.append(f"{key} {statistics.median(ratios):.3f}x")
        print(f"  {name:<24}" + ", ".join(parts))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
