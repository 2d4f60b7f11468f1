"""KV identity across restarts of `kvtier serve` (vLLM's own `vllm serve`) on one SSD tier: the tier persists, and
new weights never get the old KV.

The demo model (random tiny Llama, seed 0, with the shipped tokenizer) served with kvtier's connector and
`--scheduler-cls kvtier.scheduler_hooks.DualQueueScheduler` from the shipped `configs/vllm-kv-transfer.json`, one
server at a time, the same SSD directory throughout:

1. a 900-token prompt for tenant A (`"cache_salt"` in the request body), then a clean stop (SIGINT);
2. restarted without a change: the same request gets its 14 full chunks (896 tokens) cached from the SSD tier, and
   the same answer;
3. new weights written in place into the model directory (the same path and config, seed 1: an operator updating a
   fine-tune), restarted: not one cached token, the start-up log reports the old chunks as another identity's, and
   the answer is the new model's own (the same prompt under a salt never seen, so nothing anywhere could serve it)
   and not the old one's.

Main environment only (not `compat`): three server starts one after the other; the tenant probe runs in every
combination in tests/test_serve_http.py.
"""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvtier.testing.serve_process import ServeProcess, free_port  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.needs("vllm_cpu_engine")]

REPO = Path(__file__).resolve().parent.parent
PAGE, CHUNK = 32, 64
PROMPT = [random.Random(47).randrange(3, 1000) for _ in range(900)]
HIT = len(PROMPT) // CHUNK * CHUNK  # 896
PORT_LO = 18100  # free_port shifts it by KVTIER_TEST_PORT_SHIFT (lane_port)
VLLM_ARGS = ["--dtype", "float32", "--max-model-len", "1024", "--block-size", str(PAGE), "--num-gpu-blocks-override",
             "34", "--enforce-eager", "--seed", "0", "--shutdown-timeout", "20", "--enable-prompt-tokens-details"]


def _cached(rep: dict) -> int:
    return int((rep["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def _text(rep: dict) -> str:
    return rep["choices"][0]["text"]


def _serve(work: Path, model: Path, kv: str, name: str) -> ServeProcess:
    srv = ServeProcess(name, work, model, free_port(PORT_LO), VLLM_ARGS, [
        "--kv-transfer-config", kv, "--scheduler-cls", "kvtier.scheduler_hooks.DualQueueScheduler"])
    try:
        srv.wait_ready(time.monotonic() + 420)
    except BaseException:
        srv.stop()
        raise
    return srv


def test_restart_serves_the_ssd_tier_and_new_weights_never_get_old_kv(tmp_path):
    from kvtier.launch.demo_model import build

    model = Path(build(str(tmp_path / "model")))
    yaml = tmp_path / "lmcache-kvtier.yaml"
    yaml.write_text((REPO / "configs" / "lmcache-kvtier.yaml").read_text().replace(
        "chunk_size: 256", f"chunk_size: {CHUNK}").replace("max_local_cpu_size: 5 ", "max_local_cpu_size: 0.01 ")
        .replace("/var/cache/kvtier", str(tmp_path / "ssd")).replace("kvtier.ssd_capacity_gb: 100",
                                                                    "kvtier.ssd_capacity_gb: 0.05"))
    kv = json.loads((REPO / "configs" / "vllm-kv-transfer.json").read_text())
    kv["kv_connector_extra_config"]["config_file"] = str(yaml)
    kv = json.dumps(kv)

    srv = _serve(tmp_path, model, kv, "first")
    try:
        first = srv.complete(PROMPT, cache_salt="tenant-A")
        assert _cached(first) == 0
        assert srv.stop() == 0, srv.log()[-3000:]
    finally:
        srv.stop()

    srv = _serve(tmp_path, model, kv, "restarted")
    try:
        again = srv.complete(PROMPT, cache_salt="tenant-A")
        assert _cached(again) >= HIT and _text(again) == _text(first)
        assert srv.stop() == 0
    finally:
        srv.stop()

    for f in model.glob("*.safetensors"):
        f.unlink()  # new files, as a fresh copy of a fine-tune would be
    (model / "config.json").unlink()
    build(str(model), seed=1)
    srv = _serve(tmp_path, model, kv, "new-weights")
    try:
        new = srv.complete(PROMPT, cache_salt="tenant-A")
        alone = srv.complete(PROMPT, cache_salt="never-seen")
        assert _cached(new) == 0 and _cached(alone) == 0
        assert _text(new) == _text(alone) != _text(first)
        assert re.search(r"SSD tier at .*worker0-of-1: \d+ chunk\(s\) .* of other KV identities", srv.log()), \
            srv.log()[-3000:]
    finally:
        srv.stop()
