"""The pure parts of `benchmarks/serve_aiperf.py` and `benchmarks/serve_report.py`: the ideal server's KV size,
the rotating run order, /metrics deltas, and kvtier's share of the achievable gain."""

from __future__ import annotations

import importlib
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def bench() -> tuple[ModuleType, ModuleType]:
    """(serve_aiperf, serve_report), imported as the script does: benchmarks/ first on sys.path."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module("serve_aiperf"), importlib.import_module("serve_report")
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_share_of_gain() -> None:
    """One definition for the demo and the serve benchmark (kvtier.cli.demo_vllm_report)."""
    from kvtier.cli.demo_vllm_report import share_of_gain as share

    assert share(300.0, 120.0, 100.0) == pytest.approx(0.9)
    assert share(300.0, 100.0, 100.0) == 1.0
    assert share(300.0, 50.0, 100.0) == pytest.approx(1.25)  # kvtier beat the ideal server
    assert share(300.0, 400.0, 100.0) == pytest.approx(-0.5)  # kvtier slower than vLLM alone
    assert math.isnan(share(100.0, 80.0, 100.0))  # nothing to gain
    assert math.isnan(share(100.0, 80.0, 120.0))
    assert math.isnan(share(300.0, float("nan"), 100.0))
    assert math.isnan(share(float("nan"), 80.0, 100.0))


def test_spread_and_shares_by_round(bench: tuple[ModuleType, ModuleType]) -> None:
    report = bench[1]
    assert report.spread([0.9, float("nan"), 0.5, 1.1]) == (0.5, 0.9, 1.1)
    assert all(math.isnan(x) for x in report.spread([float("nan")]))
    by = {"base": [{"k": 300.0}, {"k": 200.0}], "kvtier": [{"k": 120.0}, {"k": 150.0}],
          "ideal": [{"k": 100.0}, {"k": 250.0}]}
    per = report.shares(by, "k")
    assert per[0] == pytest.approx(0.9) and math.isnan(per[1])


def test_ideal_blocks(bench: tuple[ModuleType, ModuleType]) -> None:
    ideal_blocks = bench[0].ideal_blocks
    rows = [{"hash_ids": [0, 1], "input_length": 50, "output_length": 10},
            {"hash_ids": [0, 1, 2], "input_length": 80, "output_length": 40},  # a follow-up turn: 1 new prefix
            {"hash_ids": [0, 3], "input_length": 40, "output_length": 2}]
    # prefixes (0) (0,1) (0,1,2) (0,3) = 4 pages; answers 1+1, 2+1, 1+1 = 7; longest 80+40+1 -> 4 pages x 2; null 1
    assert ideal_blocks(rows, 32, 32, 2) == 4 + 7 + 8 + 1
    # 64-token trace blocks take two 32-token pages each
    assert ideal_blocks(rows, 64, 32, 2) == 8 + 7 + 8 + 1
    assert ideal_blocks([], 32, 32, 4) == 1


def test_ideal_blocks_hold_the_shipped_round(bench: tuple[ModuleType, ModuleType]) -> None:
    aiperf = bench[0]
    rows, _ = aiperf.scale(aiperf.read_trace(aiperf.data_path("mooncake_conversation_sessions.jsonl")), 32, 1536, 24)
    n = aiperf.ideal_blocks(rows, 32, 32, 4)
    # at least every prompt's and answer's distinct tokens, far more than the 160 blocks of the other servers
    distinct = len({tuple(r["hash_ids"][:k]) for r in rows for k in range(1, len(r["hash_ids"]) + 1)})
    assert n > distinct + sum(-(-r["output_length"] // 32) for r in rows) > 160


def test_run_order_rotates(bench: tuple[ModuleType, ModuleType]) -> None:
    order = bench[0].run_order
    three = ["base", "kvtier", "ideal"]
    firsts = {order(three, rnd, "reuse")[0] for rnd in range(3)}
    assert firsts == set(three)
    assert order(three, 1, "reuse") == ["kvtier", "ideal", "base"]
    assert order(three, 1, "no-reuse") == ["kvtier", "base"]
    assert [order(["base", "kvtier"], rnd, "reuse") for rnd in range(2)] == [["base", "kvtier"], ["kvtier", "base"]]


def test_kvtier_variants_parse_and_run_in_the_rotation(bench: tuple[ModuleType, ModuleType]) -> None:
    """`--kvtier-variant NAME=JSON`: one more kvtier server per variant, in every round's rotation."""
    import argparse

    aiperf, _ = bench
    assert aiperf.variant('inside={"sync_load_budget_tokens": 1048576}') == (
        "inside", {"sync_load_budget_tokens": 1048576})
    assert aiperf.variant("measured={}") == ("measured", {})
    for bad in ("inside", "Inside={}", "x=[1]", "x={", "=", "a-b={}"):
        with pytest.raises((argparse.ArgumentTypeError, ValueError)):
            aiperf.variant(bad)
    names = ["base", "kvtier", "kvtier-inside", "ideal"]
    firsts = {aiperf.run_order(names, rnd, "reuse")[0] for rnd in range(4)}
    assert firsts == set(names)
    assert aiperf.run_order(names, 2, "no-reuse") == ["kvtier-inside", "base", "kvtier"]


def test_hit_deltas(bench: tuple[ModuleType, ModuleType]) -> None:
    aiperf = bench[0]
    before = {("vllm:prefix_cache_queries_total", ()): 100.0, ("vllm:prefix_cache_hits_total", ()): 40.0,
              ("kvtier_connector_hit_tokens_total", (("tier", "host"),)): 10.0}
    after = {("vllm:prefix_cache_queries_total", ()): 400.0, ("vllm:prefix_cache_hits_total", ()): 100.0,
             ("vllm:external_prefix_cache_hits_total", ()): 64.0,
             ("kvtier_connector_hit_tokens_total", (("tier", "host"),)): 74.0,
             ("kvtier_connector_ideal_hit_tokens_total", ()): 200.0,
             ("kvtier_connector_lost_hit_tokens_total", (("reason", "evicted"),)): 32.0,
             ("kvtier_connector_lost_hit_tokens_total", (("reason", "other"),)): 5.0,
             ("vllm:num_preemptions_total", ()): 2.0, ("vllm:iteration_tokens_total_count", ()): 90.0,
             ("kvtier_ssd_written_bytes_total", ()): 4096.0, ("kvtier_ssd_hits_total", ()): 3.0}
    before[("vllm:iteration_tokens_total_count", ())] = 30.0
    assert aiperf.vllm_hits(before, after) == {"hit_queried": 300.0, "hit_prefix": 60.0, "hit_external": 64.0}
    assert aiperf.vllm_engine(before, after) == {"preemptions": 2.0, "vllm_steps": 60.0}
    k = aiperf.kvtier_hits(before, after)
    assert k["kvtier_host"] == 64.0 and k["kvtier_ssd"] == 0.0 and k["ideal_hit"] == 200.0
    assert k["lost_evicted"] == 32.0 and k["lost_not_saved"] == 0.0 and k["lost_other"] == 5.0
    assert k["beyond_ideal"] == 0.0 and k["ssd_written_bytes"] == 4096.0 and k["ssd_hits"] == 3.0
    # a server without the lost-hit counters: zeros, no failure
    assert not any(aiperf.kvtier_hits({}, {}).values())


def test_kv_cache_tokens(bench: tuple[ModuleType, ModuleType]) -> None:
    log = "INFO ... [kv_cache_utils.py:1] CPU KV cache size: 67,744 tokens, Maximum concurrency for 1,568 ..."
    assert bench[0].kv_cache_tokens(log) == 67744
    assert bench[0].kv_cache_tokens("nothing") is None


def test_reusable_tokens(bench: tuple[ModuleType, ModuleType]) -> None:
    reusable = bench[0].reusable_tokens
    rows = [{"hash_ids": [0, 1], "input_length": 50},  # block 1 partial: only (0,) is held whole
            {"hash_ids": [0, 1, 2], "input_length": 96},  # reuses block 0: 32
            {"hash_ids": [0, 1, 2, 3], "input_length": 100},  # reuses 0, 1, 2 (whole in the row before): 96
            {"hash_ids": [0, 1, 2], "input_length": 96},  # all of it is cached: the last token is computed, 64
            {"hash_ids": [5], "input_length": 20}]  # nothing
    assert reusable(rows, 32, 32) == 32 + 96 + 64
    assert reusable([], 32, 32) == 0


def test_engine_table_prints_written_bytes_per_ssd_hit(bench: tuple[ModuleType, ModuleType],
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    report = bench[1]
    base = [{"vllm_steps": 100.0, "preemptions": 0.0}, {"vllm_steps": 110.0, "preemptions": 1.0}]
    kvtier = [{"vllm_steps": 120.0, "preemptions": 2.0, "delayed_frees": 7.0, "ssd_written_bytes": 6 * 2**20,
               "ssd_hits": 4.0},
              {"vllm_steps": 130.0, "preemptions": 0.0, "delayed_frees": 0.0, "ssd_written_bytes": 2**20,
               "ssd_hits": 0.0}]
    report.engine_table({"base": base, "kvtier": kvtier})
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line[:1].isdigit()]
    assert rows[0] == ["1", "100", "120", "0", "/", "2", "7", "6.0", "4", "1.50"]
    assert rows[1] == ["2", "110", "130", "1", "/", "0", "0", "1.0", "0", "n/a"]


def test_summary_counts_requests_in_flight_and_the_clients_start_lag(bench: tuple[ModuleType, ModuleType]) -> None:
    aiperf = bench[0]

    def rec(conv: int, credit: float, start: float, end: float) -> dict:
        ns = 1_000_000_000
        return {"metadata": {"conversation_id": f"session_{conv}", "credit_issued_ns": int(credit * ns),
                             "request_start_ns": int(start * ns), "request_end_ns": int(end * ns)},
                "metrics": {"time_to_first_token": {"value": 10.0}, "usage_completion_tokens": {"value": 4}}}

    # two slots: [0, 4] and [0, 2] then [2.5, 4]: 7.5 request-seconds over a 4-second run
    out = aiperf.summarize([rec(0, 0.0, 0.0, 4.0), rec(1, 0.0, 0.0, 2.0), rec(2, 2.0, 2.5, 4.0)],
                           [False, False, True])
    assert out["wall_s"] == pytest.approx(4.0) and out["req_per_s"] == pytest.approx(0.75)
    assert out["in_flight"] == pytest.approx(7.5 / 4.0)
    assert out["credit_to_start_ms"] == pytest.approx(500.0 / 3)
    assert out["n_follow"] == 1 and out["out_tok_per_s"] == pytest.approx(3.0)
