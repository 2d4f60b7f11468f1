"""The lost-hit ledger in a real vLLM CPU engine with kvtier's connector (issue 52): each admission is accounted
against an engine cache that held everything, and the reason of a shortfall is the true one.

One engine process (the tests' tiny random Llama; vLLM's prefix cache off, so every reuse is kvtier's; 32-token
chunks = pages), `holdA`'s saves held on the transfer thread for 8 engine steps (`HeldTransfers`):

1. `holdA`: a 96-token prompt P, 2 output tokens; it finishes with its save still held.
2. `earlyE` = P + 16 new tokens, sent at once: its history is computed but its save has not landed. vLLM's default
   scheduler (no dual-queue policy holding it back) recomputes it: the ledger says 96 tokens lost, all
   `save_in_flight`.
3. After every save landed (flush): `followF` = P + 16 other tokens loads its 96 tokens from the host tier: nothing
   lost; `saltG`, the same prompt under another cache salt (another tenant), has no limit at all (ideal 0).

Checked: each request's account (ideal, hit, reasons), the partition (lost - beyond = ideal - hit) and the
`/metrics` counters equal to the sums. Broken on purpose: with a save counted as landed when it is issued,
`earlyE` read `evicted` and this test failed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvtier.testing.transfer_timing import HeldTransfers  # noqa: E402
from kvtier.testing.vllm_engine import ENGINE_ENV, tiny_llama  # noqa: E402
from kvtier.tests.test_connector_vllm import kv_config, lmcache_yaml  # noqa: E402

pytestmark = pytest.mark.slow

ENGINE_SCRIPT = r'''
import json, random, sys


def main():
    a = json.loads(open(sys.argv[1]).read())
    import faulthandler

    faulthandler.dump_traceback_later(300, exit=True)
    from kvtier.testing.transfer_timing import install_dict

    install_dict(a["timing"])
    from vllm import LLM, SamplingParams

    llm = LLM(model=a["model"], skip_tokenizer_init=True, dtype="float32", enforce_eager=True, block_size=32,
              max_model_len=256, enable_prefix_caching=False, max_num_seqs=4, seed=0,
              num_gpu_blocks_override=16, kv_transfer_config=a["ktc"])
    eng = llm.llm_engine
    conn = eng.engine_core.engine_core.scheduler.connector
    rng = random.Random(11)
    P = [rng.randrange(1, 1000) for _ in range(96)]
    E = P + [rng.randrange(1, 1000) for _ in range(16)]
    F = P + [rng.randrange(1, 1000) for _ in range(16)]
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    ids = {}

    def run(todo):
        for name, prompt in todo:
            ids[eng.add_request(name, prompt, sp)] = name
        while eng.has_unfinished_requests():
            eng.step()

    run([("holdA", {"prompt_token_ids": P})])
    run([("earlyE", {"prompt_token_ids": E})])  # holdA's save is still held (8 steps)
    assert conn.scheduler_side.flush(60)
    run([("followF", {"prompt_token_ids": F})])
    run([("saltG", {"prompt_token_ids": F, "cache_salt": "tenant-2"})])
    snap = conn.scheduler_side.snapshot()
    acc = snap["lost_hits"]["requests"]
    from kvtier.connector.metrics import kvtier_samples

    out = {"accounts": {ids[r]: a for r, a in acc.items() if r in ids}, "totals": snap["lost_hits"]["totals"],
           "metrics": kvtier_samples()}
    open(a["out"], "w").write(json.dumps(out))
    eng.engine_core.shutdown()


if __name__ == "__main__":
    main()
'''


def test_each_admission_accounted_against_the_limit(tmp_path: Path) -> None:
    script = tmp_path / "engine_lost_hits.py"
    script.write_text(ENGINE_SCRIPT)
    model = tmp_path / "model"
    tiny_llama(model)
    ktc = kv_config(lmcache_yaml(tmp_path, tmp_path / "ssd", host_chunks=64), sync_load_budget_tokens=0)
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"model": str(model), "ktc": ktc, "out": str(tmp_path / "out.json"),
                                "timing": HeldTransfers(requests=("holdA",), save_hold=8).as_dict()}))
    p = subprocess.run([sys.executable, str(script), str(args)], cwd=tmp_path, env={**os.environ, **ENGINE_ENV},
                       capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, (p.stdout + p.stderr)[-6000:]
    got = json.loads((tmp_path / "out.json").read_text())
    acc = got["accounts"]
    assert set(acc) == {"holdA", "earlyE", "followF", "saltG"}, acc
    zero = {"recomputed": 0, "save_in_flight": 0, "not_saved": 0, "evicted": 0, "not_found": 0, "beyond_ideal": 0}
    assert acc["holdA"] == {"ideal": 0, "hit": 0, **zero}
    assert acc["earlyE"] == {"ideal": 96, "hit": 0, **dict(zero, save_in_flight=96)}
    assert acc["followF"] == {"ideal": 96, "hit": 96, **zero}
    assert acc["saltG"] == {"ideal": 0, "hit": 0, **zero}  # another tenant: P's pages are not its limit
    tot, m = got["totals"], got["metrics"]
    reasons = ("recomputed", "save_in_flight", "not_saved", "evicted", "not_found")
    assert sum(tot[r] for r in reasons) - tot["beyond_ideal"] == tot["ideal"] - tot["hit"]
    assert m["kvtier_connector_ideal_hit_tokens_total"] == tot["ideal"]
    for r in reasons:
        assert m[f"kvtier_connector_lost_hit_tokens_total/reason={r}"] == tot[r], (r, m)
