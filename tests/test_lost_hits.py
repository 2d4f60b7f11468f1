"""The lost-hit ledger (`kvtier.telemetry.lost_hits`) on its own: the limit, each reason, the partition, tenants,
bounded memory. Plain Python (the engine-level check: test_lost_hits_engine.py, and the demo's ideal column)."""

from __future__ import annotations

import random

import pytest

from kvtier.telemetry.lost_hits import REASONS, LostHitLedger, LostHits

PAGE, CHUNK = 16, 32


def toks(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 50_000) for _ in range(n)]


def turn(led: LostHitLedger, rid: str, tokens: list[int], answer: int = 0, tag: str = "") -> None:
    """`rid` computed its prompt and `answer` tokens (KV for all but the last one)."""
    led.computed(rid, tag, tokens, len(tokens) + max(answer - 1, 0))


def test_the_limit_is_the_longest_computed_page_prefix_leaving_one_token() -> None:
    led = LostHitLedger(PAGE, CHUNK)
    a = toks(1, 100)
    turn(led, "a", a)  # pages 0..5 (96 tokens)
    assert led.ideal_tokens("b", "", a + toks(2, 10), 110) == 96
    assert led.ideal_tokens("c", "", a[:96], 96) == 80  # one prompt token is always computed
    assert led.ideal_tokens("d", "", a[:40] + toks(3, 60), 100) == 32  # diverges in page 2
    assert led.ideal_tokens("e", "tenant-2", a + [1], 101) == 0  # another tenant's pages are not its limit


@pytest.mark.parametrize("state, reason", [("issued", "save_in_flight"), ("landed", "evicted"),
                                           ("dropped", "not_saved"), ("never", "not_saved")])
def test_the_first_missing_chunk_names_the_reason(state: str, reason: str) -> None:
    led = LostHitLedger(PAGE, CHUNK)
    a = toks(1, 100)
    turn(led, "a", a, answer=3)  # 102 tokens of KV: 6 pages, 3 chunks
    if state != "never":
        led.save_issued(1, "a", "", a, 0, 96)
    if state == "landed":
        led.save_done(1)
    if state == "dropped":
        led.save_done(1, stored=0)
    b = a + toks(2, 20)
    acc = led.admitted("b", "", b, len(b), hit=0, found_end=0)
    assert acc == LostHits(96, 0, **{reason: 96})


def test_found_but_not_loaded_is_recomputed_and_the_rest_follows_the_next_chunk() -> None:
    led = LostHitLedger(PAGE, CHUNK)
    a = toks(1, 120)
    turn(led, "a", a)  # 7 pages (112 tokens) in the limit
    led.save_issued(1, "a", "", a, 0, 96)
    led.save_done(1, stored=2)  # chunks 0, 1 landed; chunk 2 not stored
    b = a + toks(2, 30)
    acc = led.admitted("b", "", b, len(b), hit=16, found_end=64)  # vLLM's page, the lookup found 2 chunks
    # [16, 64) recomputed; chunk 2 [64, 96) not saved; [96, 112) is no whole chunk: not found
    assert acc == LostHits(112, 16, recomputed=48, not_saved=32, not_found=16)


def test_a_landed_chunk_stays_landed_when_a_later_save_of_it_is_dropped() -> None:
    led = LostHitLedger(PAGE, CHUNK)
    a = toks(1, 70)
    turn(led, "a", a)
    led.save_issued(1, "a", "", a, 0, 64)
    led.save_done(1)
    led.save_issued(2, "a2", "", a, 0, 64)  # another request stores the same prefix again: not stored
    led.save_done(2, stored=0)
    acc = led.admitted("b", "", a + [5] * 20, 90, hit=0, found_end=0)
    assert acc.evicted == 64 and acc.not_saved == 0


def test_hits_past_the_limit_are_counted_apart() -> None:
    led = LostHitLedger(PAGE, CHUNK)
    a = toks(1, 80)  # nothing computed in this process: KV from before it (the SSD tier outlives it)
    acc = led.admitted("a", "", a, 80, hit=64, found_end=64)
    assert acc == LostHits(0, 64, beyond_ideal=64) and acc.lost == 0


def test_seeded_fuzz_the_reasons_partition_the_shortfall() -> None:
    """Random conversations, saves issued / landed / dropped at random, random hits and lookups: for every
    admission lost - beyond == ideal - hit, every reason >= 0, and the totals add up alike."""
    rng = random.Random(52)
    led = LostHitLedger(PAGE, CHUNK, capacity=64)  # small: forgetting must not break the partition
    hist: dict[int, list[int]] = {}
    job = 0
    for i in range(400):
        conv = rng.randrange(12)
        tokens = hist.get(conv, toks(1000 + conv, rng.randrange(1, 90))) + toks(i, rng.randrange(1, 50))
        rid = f"r{i}"
        ideal = led.ideal_tokens(rid, "", tokens, len(tokens))
        hit = rng.choice([0, ideal, rng.randrange(0, ideal + 1) // PAGE * PAGE, ideal + PAGE])
        found = rng.randrange(0, len(tokens) + 1) // CHUNK * CHUNK
        acc = led.admitted(rid, "", tokens, len(tokens), hit, found)
        assert all(getattr(acc, r) >= 0 for r in REASONS) and acc.beyond_ideal >= 0
        assert acc.lost - acc.beyond_ideal == acc.ideal - acc.hit
        answer = rng.randrange(1, 20)
        full = tokens + toks(-i, answer)
        led.computed(rid, "", full, len(full) - 1)
        end = (len(full) - 1) // CHUNK * CHUNK
        if end and rng.random() < 0.8:
            job += 1
            led.save_issued(job, rid, "", full, 0, end)
            if rng.random() < 0.7:
                led.save_done(job, rng.choice([None, 0, end // CHUNK // 2]))
        led.forget(rid)
        hist[conv] = full
    t = led.totals
    assert sum(t[r] for r in REASONS) - t["beyond_ideal"] == t["ideal"] - t["hit"]
    assert len(led._computed) <= 64 and len(led._saves) <= 64


def test_chunk_must_be_a_multiple_of_the_page() -> None:
    with pytest.raises(ValueError, match="multiple of the page"):
        LostHitLedger(16, 40)
