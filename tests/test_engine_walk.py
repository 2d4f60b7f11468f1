"""The engine walk (`kvtier.replay.engine_walk`) and its model of vLLM's prefix cache (`replay/gpu_prefix_cache.py`):
the replay of the engine's host tier that `benchmarks/replay_engine_gap.py` compares with the engine (issue 50)."""

from __future__ import annotations

import json

import pytest

from kvtier.demo_data import path as data_path
from kvtier.replay import engine_walk as ew
from kvtier.replay.gpu_prefix_cache import GpuPrefixCache
from kvtier.storage_backends.eviction.lru import LRUPolicy


def test_a_prefix_is_reused_but_never_its_last_token():
    gpu = GpuPrefixCache(8, 4)
    assert gpu.start("a", ["k0", "k1", "k2"], 12, 14) == 0
    gpu.finish("a")
    assert gpu.hit_tokens(["k0", "k1", "k2"], 12) == 8  # the last token is computed
    assert gpu.hit_tokens(["k0", "k1", "k2", "k3"], 16) == 12
    assert gpu.hit_tokens(["k0", "x1", "k2"], 12) == 4  # the run stops at the first page not cached


def test_a_finished_prefix_loses_its_tail_first_and_partial_pages_go_first():
    """vLLM's free queue: a finished request's cached pages join the tail last page first; its uncached page (the
    answer's partial one) goes to the head. New pages are taken from the head."""
    gpu = GpuPrefixCache(5, 4)
    gpu.start("a", ["a0", "a1", "a2"], 12, 14)  # pages: a0 a1 a2 + one partial (answer) page
    gpu.finish("a")  # free queue: [partial, unused, a2, a1, a0]
    gpu.start("b", [], 2, 3)  # one page: takes the partial page
    assert gpu.hit_tokens(["a0", "a1", "a2"], 13) == 12
    gpu.start("c", [], 2, 3)  # the unused page
    assert gpu.hit_tokens(["a0", "a1", "a2"], 13) == 12
    gpu.start("d", [], 2, 3)  # a2, the prefix's tail
    assert gpu.hit_tokens(["a0", "a1", "a2"], 13) == 8
    gpu.start("e", [], 2, 3)
    assert gpu.hit_tokens(["a0", "a1", "a2"], 13) == 4
    with pytest.raises(ValueError, match="free pages"):
        gpu.start("f", [], 6, 8)  # two pages, one free
    assert gpu.running == 4


def test_held_pages_are_never_taken():
    gpu = GpuPrefixCache(3, 4)
    gpu.start("a", ["a0", "a1"], 8, 9)  # 3 pages, all held
    with pytest.raises(ValueError):
        gpu.start("b", [], 2, 3)
    gpu.finish("a")
    gpu.start("b", ["a0"], 5, 6)  # reuses a0 (held again), takes the partial page
    gpu.start("c", [], 2, 3)  # a1 is the only free page left
    assert gpu.hit_tokens(["a0", "a1"], 9) == 4


@pytest.fixture(scope="module")
def turns():
    """The serve benchmark's requests: the shipped conversations, one 512-token block = 32 tokens, prompts over
    1,536 tokens held out (`benchmarks/serve_aiperf.py`'s `scale`, repeated here without its imports)."""
    out = []
    with open(data_path("mooncake_conversation_sessions.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            n = len(r["hash_ids"])
            last = r["input_length"] - (n - 1) * 512
            tokens = (n - 1) * 32 + max(1, min(32, round(last * 32 / 512)))
            if tokens <= 1536:
                answer = max(2, min(24, round(r["output_length"] * 32 / 512)))
                out.append(ew.Turn(r["timestamp"] / 1000, tuple(r["hash_ids"]), tokens, answer))
    assert len(out) == 232
    return out


@pytest.mark.parametrize("step", ew.STEPS)
def test_every_prompt_token_is_counted_once(turns, step):
    rounds = ew.walk(turns, "lru", ew.EngineShape(94, rounds=2), step)
    assert len(rounds) == 2
    for r in rounds:
        assert r.prompt_tokens == sum(t.prompt_tokens for t in turns)
        assert 0 < r.host + r.ssd + r.gpu <= r.prompt_tokens


def test_a_host_tier_smaller_than_the_gpu_cache_gets_no_lru_hits(turns):
    """The serve benchmark's 2% host tier (37 chunks) under LRU: the replay's walk finds hits in it, but behind
    vLLM's prefix cache (159 pages = 79 chunks) it holds only what the GPU still holds: no host hit at all, as
    the engine measured (docs/results/2026-12-07-eviction-in-the-engine.md)."""
    shape = ew.EngineShape(37)
    assert all(r.host > 0 for r in ew.walk(turns, "lru", shape, "chunks"))
    assert all(r.host == 0 and r.ssd > 0 for r in ew.walk(turns, "lru", shape, "gpu"))
    assert all(r.host == 0 for r in ew.walk(turns, "lru", shape, "engine"))


class _Spy(LRUPolicy):
    """LRU that records the calls the walk makes."""

    def __init__(self, *a, **k) -> None:
        super().__init__(*a, **k)
        self.calls: list[tuple[str, object]] = []

    def on_insert(self, key, size=1):
        self.calls.append(("insert", key))
        super().on_insert(key, size)

    def on_access(self, key):
        self.calls.append(("hit", key))
        super().on_access(key)


@pytest.fixture
def spies(monkeypatch) -> list[_Spy]:
    """The walk's host policies, each an LRU `_Spy` (one per walk, in order)."""
    made: list[_Spy] = []

    def build(name, clock, capacity, **kw):
        spy = _Spy(clock=clock)
        spy.set_capacity(capacity)
        made.append(spy)
        return spy

    monkeypatch.setattr(ew, "build_policy", build)
    return made


def test_a_chunk_staged_from_ssd_is_a_put_not_a_hit(spies):
    """The engine step: a follow-up turn whose history the host tier lost is staged from the SSD tier (a put of
    each chunk) and its load reports no hit for them (`WorkerStorage.after_retrieve`); a chunk the host tier
    still held is reported, last chunk first."""
    first = ew.Turn(0.0, (1, 2, 3, 4, 5), 160, 2)  # chunks (1,2) and (1,2,3,4)
    other = ew.Turn(1.0, (9, 8, 7, 6, 5, 4), 192, 2)  # 3 chunks of its own: a 2-chunk host tier drops turn 1's
    again = ew.Turn(2.0, (1, 2, 3, 4, 5, 6), 192, 2)  # turn 1's history again
    shape = ew.EngineShape(2, gpu_pages=7, rounds=1)  # `other` takes every page: the GPU keeps nothing of turn 1
    (r,) = ew.walk([first, other, again], "lru", shape, "engine")
    k = [(0, (1, 2)), (0, (1, 2, 3, 4)), (0, (1, 2, 3, 4, 5, 6))]
    assert r.gpu == 0 and r.host == 0 and r.ssd == 128
    calls = spies[0].calls
    tail = calls[calls.index(("insert", k[0]), 1):]  # from the staging of turn 3's first chunk on
    assert tail == [("insert", k[0]), ("insert", k[1]), ("insert", k[2])]  # staged, staged, saved: no hit

    spies.clear()
    shape = ew.EngineShape(5, gpu_pages=7, rounds=1)  # the host tier keeps turn 1's chunks
    (r,) = ew.walk([first, other, again], "lru", shape, "engine")
    assert r.gpu == 0 and r.host == 128 and r.ssd == 0
    calls = spies[0].calls
    assert calls[-3:] == [("hit", k[1]), ("hit", k[0]), ("insert", k[2])]  # last chunk first, then the save


def test_host_chunks_past_an_ssd_gap_count_as_host_as_the_connector_counts_them(spies):
    """A host run broken at its first chunk (only the SSD tier holds it) sends the request to the prefetch; the
    connector counts the SSD-only tokens as one run right past the host run, so the host-resident chunks past the gap
    are host hits, reported last chunk first; the prefetch's put of the gap chunk finds every other chunk pinned and
    stores nothing, and the resident chunks get no put."""
    first = ew.Turn(0.0, (1, 2, 3, 4, 5, 6), 192, 2)  # 3 chunks; a 2-chunk host tier keeps the last two
    filler = ew.Turn(1.0, (9, 8), 60, 224)  # no whole chunk (no save), but every GPU page
    again = ew.Turn(2.0, (1, 2, 3, 4, 5, 6, 7, 8), 256, 2)
    shape = ew.EngineShape(2, gpu_pages=9, rounds=1)
    (r,) = ew.walk([first, filler, again], "lru", shape, "engine")
    k = [(0, (1, 2, 3, 4, 5, 6, 7, 8)[:2 * (i + 1)]) for i in range(4)]
    assert (r.gpu, r.host, r.ssd) == (0, 128, 64)
    assert (r.staged, r.staged_under_gpu) == (1, 0)
    calls = spies[0].calls
    assert calls[-3:] == [("hit", k[2]), ("hit", k[1]), ("insert", k[3])]
