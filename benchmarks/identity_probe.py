"""The tenant and weight-swap probes of kvtier's KV identity (docs/design/identity.md), end to end, printed as tables.

    .venv/bin/python benchmarks/identity_probe.py [--stages connector,weights,mp] [--workdir DIR]

Not a performance benchmark: it shows what an outside tester sees, on the real servers, with plain vLLM beside
each as the reference. A 900-token prompt (14 full 64-token chunks: 896 tokens kvtier can serve):

- `connector`: `kvtier serve` (kvtier's connector + dual-queue scheduler, the shipped JSON) and plain `vllm serve`
  of the demo model, small GPU caches (vLLM's own cache loses the prompt to the next one). Tenant A
  (`"cache_salt": "tenant-A"`), then tenant B, then no salt, then tenant A again: cached prompt tokens per request
  (`--enable-prompt-tokens-details`) and whether the answers agree.
- `weights` (after `connector`, same SSD tier): the kvtier server stopped cleanly and restarted without a change
  (tenant A's prompt again: from the SSD tier); then new weights written in place into the model directory (another
  seed, same config) and both servers restarted: cached tokens and the greedy answer against plain vLLM on the new
  weights.
- `mp`: `lmcache server` with kvtier's L2 adapter, vLLM through LMCache's `LMCacheMPConnector`: tenant A, then
  (LMCache's L1 cleared before each request, so only kvtier's L2 can serve) tenant B, no salt, tenant A again:
  cached tokens and kvtier's L2 hits.

The two-engine shared-store probe and vLLM's offloading tier are tests (`tests/test_shared_vllm.py`,
`tests/test_vllm_offload_tier.py`): vLLM's CPU build has no CPU offloading engine path.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from kvtier.launch.demo_model import KV_BYTES_PER_TOKEN, build
from kvtier.testing.serve_process import ServeProcess, free_port

REPO = Path(__file__).resolve().parent.parent
CHUNK, PAGE, GPU_BLOCKS = 64, 32, 34
PROMPT = [random.Random(47).randrange(3, 1000) for _ in range(900)]
VLLM_ARGS = ["--dtype", "float32", "--max-model-len", "1024", "--block-size", str(PAGE), "--num-gpu-blocks-override",
             str(GPU_BLOCKS), "--enforce-eager", "--seed", "0", "--shutdown-timeout", "20",
             "--enable-prompt-tokens-details"]
PROBES = [("tenant A", "tenant-A"), ("tenant B", "tenant-B"), ("no salt", None), ("tenant A again", "tenant-A")]


def cached(rep: dict[str, Any]) -> int:
    return int((rep["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def kv_json(work: Path, ssd: Path) -> str:
    yaml = work / "lmcache-kvtier.yaml"
    text = (REPO / "configs" / "lmcache-kvtier.yaml").read_text()
    yaml.write_text(text.replace("chunk_size: 256", f"chunk_size: {CHUNK}").replace(
        "max_local_cpu_size: 5 ", "max_local_cpu_size: 0.01 ").replace("/var/cache/kvtier", str(ssd)).replace(
        "kvtier.ssd_capacity_gb: 100", "kvtier.ssd_capacity_gb: 0.1"))
    kv = json.loads((REPO / "configs" / "vllm-kv-transfer.json").read_text())
    kv["kv_connector_extra_config"]["config_file"] = str(yaml)
    return json.dumps(kv)


def start(work: Path, model: Path, name: str, kv: str | None) -> ServeProcess:
    extra = ["--kv-transfer-config", kv, "--scheduler-cls", "kvtier.scheduler_hooks.DualQueueScheduler"] if kv else []
    srv = ServeProcess(name, work, model, free_port(18140), VLLM_ARGS, extra)
    try:
        srv.wait_ready(time.monotonic() + 600)
    except BaseException:
        srv.stop()
        raise
    return srv


def table(title: str, header: list[str], rows: list[list[Any]]) -> None:
    print(f"\n{title}")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        print("| " + " | ".join(str(x) for x in r) + " |")


def connector_stage(work: Path, model: Path, ssd: Path) -> dict[str, Any]:
    kv = kv_json(work, ssd)
    base, kvt = start(work, model, "base", None), start(work, model, "kvtier", kv)
    try:
        got = {name: [srv.complete(PROMPT, cache_salt=salt) if salt else srv.complete(PROMPT)
                      for _, salt in PROBES] for name, srv in (("base", base), ("kvtier", kvt))}
    finally:
        kvt.stop()
        base.stop()
    rows = [[label, cached(got["base"][i]), cached(got["kvtier"][i]),
             got["base"][i]["choices"][0]["text"] == got["kvtier"][i]["choices"][0]["text"]]
            for i, (label, _) in enumerate(PROBES)]
    table("connector (vllm serve, KVTierConnector): cached prompt tokens of a 900-token prompt",
          ["request", "vLLM alone", "kvtier", "same answer"], rows)
    return {"rows": rows, "old_answer": got["base"][0]["choices"][0]["text"], "kv": kv}


def weights_stage(work: Path, model: Path, kv: str, old_answer: str) -> None:
    kvt = start(work, model, "kvtier-restart", kv)
    try:
        again = kvt.complete(PROMPT, cache_salt="tenant-A")
    finally:
        kvt.stop()
    for f in model.glob("*.safetensors"):
        f.unlink()
    (model / "config.json").unlink()
    build(str(model), seed=1)
    base, kvt = start(work, model, "base-new", None), start(work, model, "kvtier-new", kv)
    try:
        new_base, new_kvt = base.complete(PROMPT, cache_salt="tenant-A"), kvt.complete(PROMPT, cache_salt="tenant-A")
        foreign = [ln for ln in kvt.log().splitlines() if "of other KV identities" in ln]
    finally:
        kvt.stop()
        base.stop()
    text = lambda r: r["choices"][0]["text"]  # noqa: E731
    table("weights: the same SSD tier across restarts (tenant A's prompt)",
          ["server", "cached tokens", "answer = vLLM alone on the weights it runs", "answer = old weights' answer"],
          [["kvtier, restarted, same weights", cached(again), text(again) == old_answer, text(again) == old_answer],
           ["kvtier, new weights in place", cached(new_kvt), text(new_kvt) == text(new_base),
            text(new_kvt) == old_answer]])
    print(f"  start-up report of the new server: {foreign[0].split('] ', 1)[-1] if foreign else '(none)'}")


def mp_stage(work: Path, model: Path) -> None:
    from kvtier.launch.lmcache_server import MPServer, kvtier_adapter_spec
    from kvtier.testing.vllm_engine import EngineProcess, tiny_llama

    tiny = Path(tiny_llama(work / "tiny"))
    del model  # the MP engine runs the tests' token-id Llama (no tokenizer needed)
    chunk_bytes = 2 * 2 * CHUNK * 2 * 32 * 4
    srv = MPServer(16512, 18512, [kvtier_adapter_spec(work / "ssd-mp", 0.05)], str(work / "lmcache-server.log"),
                   l1_gb=64 * chunk_bytes / (1 << 30), chunk_size=CHUNK, start_timeout=400).start()
    llm = {"max_model_len": 1024, "max_num_seqs": 4, "distributed_executor_backend": "uni",
           "kv_transfer_config": {"kv_connector": "LMCacheMPConnector",
                                  "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector",
                                  "kv_role": "kv_both", "kv_connector_extra_config": {
                                      "lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": srv.port}}}
    rows = []
    try:
        with EngineProcess(work, "mp", tiny, llm=llm, env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"},
                           watchdog_s=900) as eng:
            eng.ready(600)
            for label, salt in PROBES:
                srv.clear_l1()
                hits = srv.l2_status(0).get("stats", {}).get("hits", 0)
                [o] = eng.generate([PROMPT], 16, salts=[salt], timeout=300)["outputs"]
                srv.wait_l2_idle()
                rows.append([label, o["cached"], srv.l2_status(0).get("stats", {}).get("hits", 0) - hits])
    finally:
        srv.stop()
    table("LMCache MP mode (lmcache server + kvtier's L2 adapter, LMCache's L1 cleared before each request)",
          ["request", "cached tokens", "kvtier L2 chunk hits"], rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", default="connector,weights,mp")
    p.add_argument("--workdir", help="keep the servers' logs and files here (default: a temporary directory)")
    a = p.parse_args()
    stages = a.stages.split(",")
    work = Path(a.workdir or tempfile.mkdtemp(prefix="kvtier-identity-"))
    work.mkdir(parents=True, exist_ok=True)
    model = Path(build(str(work / "model")))
    print(f"demo model {model} ({KV_BYTES_PER_TOKEN} KV bytes per token), prompt {len(PROMPT)} tokens "
          f"({len(PROMPT) // CHUNK * CHUNK} in full {CHUNK}-token chunks)")
    try:
        if "connector" in stages:
            res = connector_stage(work, model, work / "ssd")
            if "weights" in stages:
                weights_stage(work, model, res["kv"], res["old_answer"])
        if "mp" in stages:
            mp_stage(work, model)
    finally:
        if not a.workdir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
