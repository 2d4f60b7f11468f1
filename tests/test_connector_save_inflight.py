"""A save still in flight when its request finishes is neither lost nor overwritten (real vLLM CPU engine, #14).

One engine process (a tiny random Llama, no download; vLLM's prefix cache off; 8 usable KV blocks of 32 tokens)
with kvtier's connector, saves off the step, and request `holdA`'s saves held on the transfer thread for 8
engine steps (`kvtier.testing.transfer_timing.HeldTransfers`). Driven through `LLMEngine.step`:

1. `holdA`: a 96-token prompt P (3 chunks), 2 output tokens. Right after its prefill, its 96 prompt tokens' KV
   is copied out of vLLM's KV cache (the reference). It finishes while its save is still held.
2. `other-B` and `other-C`: other 96-token prompts, 8 output tokens. With holdA's 4 blocks kept
   (delay_free_blocks) only 4 are free: B runs, C waits until holdA's save has read its blocks. Had they been
   freed at once, C would be computed into them before the held save read them.
3. After every save landed: `followD` = P + 16 new tokens. Its history is only in kvtier's host tier (vLLM's
   prefix cache is off), so kvtier loads it (off the step); right after D's first token the KV of its first
   96 positions is copied out of vLLM's cache.

Checked: holdA's blocks were held (`delayed_frees`), D loaded exactly its 96 tokens from the host tier without a
load error, and D's loaded KV equals holdA's computed KV bit for bit, chunk by chunk (nothing lost, nothing
overwritten). Broken on purpose once (`request_finished` never delaying the free): C took holdA's freed blocks,
the held save stored C's KV, and the bit-exact check failed (all 3 chunks differed). (Model outputs equal to no
connector with held saves: test_connector_vllm.py's tight run.)
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

    faulthandler.dump_traceback_later(300, exit=True)  # a hang shows its stacks
    from kvtier.testing.transfer_timing import install_dict

    install_dict(a["timing"])  # holdA's saves held on the transfer thread (before the engine starts)
    import torch
    from vllm import LLM, SamplingParams

    llm = LLM(model=a["model"], skip_tokenizer_init=True, dtype="float32", enforce_eager=True, block_size=32,
              max_model_len=256, enable_prefix_caching=False, max_num_seqs=4, seed=0,
              num_gpu_blocks_override=9, kv_transfer_config=a["ktc"])
    eng = llm.llm_engine
    core = eng.engine_core.engine_core
    conn = core.scheduler.connector
    rng = random.Random(7)
    P, Q, R = ([rng.randrange(1, 1000) for _ in range(96)] for _ in range(3))
    D = P + [rng.randrange(1, 1000) for _ in range(16)]

    def sp(n):
        return SamplingParams(temperature=0.0, max_tokens=n, logprobs=0, ignore_eos=True)

    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from kvtier.kernels.layout import canonical_view

    ws = get_kv_transfer_group().worker_side  # the worker role of the connector (in-process engine)
    kind = ws.engine.gpu_connector.kind
    head = ws.vllm_config.model_config.get_head_size()
    views = [canonical_view(t, kind, head) for t in ws.kv_list]

    def kv_of(rid, n_blocks):
        """The KV of a running request's first n_blocks blocks, copied out of vLLM's cache."""
        blocks = list(core.scheduler.kv_cache_manager.get_block_ids(rid)[0])[:n_blocks]
        return torch.stack([v[blocks].clone() for v in views])

    out = {"requests": {}}
    def run(todo, on_step=None):
        ids = {eng.add_request(name, {"prompt_token_ids": p}, sp(n)): name for name, p, n in todo}
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    if o.request_id == "holdA":  # its saves wait on the transfer thread (held 8 steps)
                        out["saves_in_flight_at_holdA_finish"] = ws.transfers.inflight("save")
                    c = o.outputs[0]
                    out["requests"][o.request_id] = {  # outputs carry the id given to add_request
                        "tokens": list(c.token_ids),
                        "logprobs": [float(d[t].logprob) for t, d in zip(c.token_ids, c.logprobs)]}
            if on_step is not None:
                on_step(ids)
        return ids

    kv = {}
    def snap(key, name, n_blocks):
        def on_step(ids):
            rid = next(r for r, x in ids.items() if x == name)
            if key not in kv and rid in core.scheduler.requests and \
                    core.scheduler.requests[rid].num_output_tokens >= 1:
                kv[key] = kv_of(rid, n_blocks)
        return on_step

    run([("holdA", P, 2)], snap("A", "holdA", 3))
    run([("other-B", Q, 8), ("other-C", R, 8)])
    # every save has landed (a flush releases nothing held: the hold ended steps ago)
    assert conn.scheduler_side.flush(60)
    run([("followD", D, 8)], snap("D", "followD", 3))
    out["counters"] = dict(conn.scheduler_side.counters)
    out["admitted"] = [list(x) for x in conn.scheduler_side.admitted]
    out["kv_equal"] = bool(torch.equal(kv["A"].view(torch.int32), kv["D"].view(torch.int32)))
    out["kv_blocks_equal"] = [bool(torch.equal(kv["A"][:, i].view(torch.int32), kv["D"][:, i].view(torch.int32)))
                              for i in range(3)]
    from kvtier.connector.metrics import kvtier_samples

    out["metrics"] = kvtier_samples()
    open(a["out"], "w").write(json.dumps(out))
    core.shutdown()


if __name__ == "__main__":
    main()
'''


def _run(work: Path, name: str, model: Path, ktc: dict, timing: HeldTransfers) -> dict:
    script = work / "engine_inflight.py"
    script.write_text(ENGINE_SCRIPT)
    args = work / f"{name}.args.json"
    tiny_llama(model)  # the tests' tiny random Llama (no download)
    args.write_text(json.dumps({"model": str(model), "ktc": ktc, "timing": timing.as_dict(),
                                "out": str(work / f"{name}.out.json")}))
    p = subprocess.run([sys.executable, str(script), str(args)], cwd=work, env={**os.environ, **ENGINE_ENV},
                       capture_output=True, text=True, timeout=400)
    (work / f"{name}.log").write_text(p.stdout + p.stderr)
    assert p.returncode == 0, f"{name} failed (rc {p.returncode}):\n{(p.stdout + p.stderr)[-6000:]}"
    return json.loads((work / f"{name}.out.json").read_text())


def test_save_in_flight_at_finish_is_neither_lost_nor_overwritten(tmp_path):
    got = _run(tmp_path, "kvtier", tmp_path / "model", kv_config(
        lmcache_yaml(tmp_path, tmp_path / "ssd", host_chunks=64), sync_load_budget_tokens=0),
        HeldTransfers(requests=("holdA",), save_hold=8))
    c = got["counters"]
    assert got["admitted"][-1][1:] == [96, 0, 0], got["admitted"]  # D, the last admission: 96 tokens from host
    assert got["kv_blocks_equal"] == [True, True, True], "D's KV loaded from kvtier differs from holdA's " \
        "(per chunk of P)"
    assert got["kv_equal"]
    # holdA finished with its save in flight (held 8 steps; it finished in its 2nd): vLLM kept its blocks (B's
    # saves, queued behind holdA's, may still be running when B finishes too)
    assert c["delayed_frees"] >= 1, c
    assert got["saves_in_flight_at_holdA_finish"] >= 1, "holdA's held save was not in flight when it finished"
    assert c["async_loads"] == 1 and c["sync_loads"] == 0, c
    assert got["metrics"].get("kvtier_connector_hit_tokens_total/tier=host", 0) == 96, got["metrics"]
    assert got["metrics"].get("kvtier_connector_load_error_blocks_total", 0) == 0
    assert set(got["requests"]) == {"holdA", "other-B", "other-C", "followD"}
