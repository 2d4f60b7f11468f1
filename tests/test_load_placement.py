"""`kvtier.connector.load_placement`: the budget of host-tier loads inside one engine step, in KV bytes of the
model (or tokens when set), and one step's account of it. Plain Python; the scheduler side's use of it inside
vLLM's real scheduler is in `test_connector_scheduler.py`."""

from __future__ import annotations

from types import SimpleNamespace as NS

from kvtier.connector.load_placement import UNKNOWN_KV_SYNC_TOKENS, LoadPlacement, sync_budget_tokens
from kvtier.scheduler_hooks.kv_cache_size import kv_bytes_per_token


def test_the_budget_is_bytes_of_the_models_kv_unless_tokens_are_set():
    """128 MiB is 1024 tokens of Llama-3-8B (128 KiB of KV per token, the budget measured on it) and 32,768 tokens
    of the demo model (4 KiB per token)."""
    assert sync_budget_tokens(128.0, None, 131_072) == 1024
    assert sync_budget_tokens(128.0, None, 4096) == 32_768
    assert sync_budget_tokens(128.0, None, None) == UNKNOWN_KV_SYNC_TOKENS == 1024  # an engine that does not say
    assert sync_budget_tokens(0, None, 4096) == 0  # every load off the step
    assert sync_budget_tokens(1.5, None, 4096) == 384
    assert sync_budget_tokens(128.0, 0, 4096) == 0  # tokens, when set, replace the bytes
    assert sync_budget_tokens(1, 700, 131_072) == 700


def test_kv_bytes_per_token_reads_every_layer_of_every_group():
    spec = NS(page_size_bytes=32 * 4096 // 2, block_size=32)  # one layer's page: 2 KiB per token
    cfg = NS(kv_cache_groups=[NS(layer_names=["l0", "l1"], kv_cache_spec=spec),
                              NS(layer_names=["l2"], kv_cache_spec=spec)])
    assert kv_bytes_per_token(cfg) == 3 * 2048
    assert kv_bytes_per_token(None) is None
    assert kv_bytes_per_token(NS(kv_cache_groups=[])) is None  # says nothing
    assert kv_bytes_per_token(NS()) is None


def test_a_step_counts_the_tokens_placed_inside_it_and_the_next_starts_afresh():
    p = LoadPlacement(1000)
    assert p.inside(600)
    assert not p.inside(600)  # 1200 > 1000: a load fits whole or not at all
    assert p.inside(400)
    assert not p.inside(1)
    p.new_step()
    assert p.inside(1000)
    assert not LoadPlacement(0).inside(1)
