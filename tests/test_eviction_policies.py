"""Baseline eviction policies (LRU, FIFO, LFU, ARC, S3-FIFO, Belady): exact hit counts on hand-computed traces,
Belady's optimality against brute force, and the tier contract every registered policy must keep."""

from __future__ import annotations

import functools
import random

import pytest

from kvtier.storage_backends.eviction import POLICY_REGISTRY, make_policy, production_policy_names
from kvtier.storage_backends.eviction.belady import BeladyPolicy, next_use_positions
from kvtier.storage_backends.eviction.ghost_cache import belady_hits


def run_keys(policy, keys, capacity, collect_first=False):
    """Single-tier demand cache over `keys`; returns the number of hits."""
    hits = used = 0
    for k in keys:
        if k in policy:
            hits += 1
            policy.on_access(k)
            continue
        if used + 1 > capacity:
            gen = policy.victims(used + 1 - capacity, lambda _k: True)
            victims = list(gen) if collect_first else gen
            for v in victims:
                policy.on_remove(v)
                used -= 1
        assert used + 1 <= capacity
        policy.on_insert(k, 1)
        used += 1
        assert len(policy) == used
    return hits


def belady(keys):
    return BeladyPolicy(future=keys)


def _reference_hits(keys, capacity, lru):
    """Textbook LRU / FIFO over an ordered dict: an independent count to compare the policies against."""
    from collections import OrderedDict

    cache: OrderedDict = OrderedDict()
    hits = 0
    for k in keys:
        if k in cache:
            hits += 1
            if lru:
                cache.move_to_end(k)
            continue
        if len(cache) >= capacity:
            cache.popitem(last=False)
        cache[k] = None
    return hits


# ------------------------------------------------------------------ exact hit counts, computed by hand

LRU_FIFO = list("ABCADAB")  # cap 3. LRU: A,B,C miss; A hit; D evicts B; A hit; B evicts C -> 2 hits.
# FIFO: A,B,C miss; A hit; D evicts A; A evicts B; B evicts C -> 1 hit.
SCAN = list("ABAB") + list("CDEFG") + list("AB")  # cap 4: A and B were reused before the scan
# LRU: 2 hits (the scan flushes A, B). ARC: A, B sit in T2 while the scan cycles through T1 -> 4 hits.
# S3-FIFO: A, B were hit in S, so they move to M when S is drained; the scan leaves through S -> 4 hits.
LFU_SEQ = list("AABCAB")  # cap 2. LFU: A, A hit, B, C evicts B (freq 1 < 2), A hit, B evicts C -> 2 hits.
# LRU on it: A, A hit, B, C evicts A, A evicts B, B evicts C -> 1 hit.
BELADY_SEQ = list("ABCAB")  # cap 2. Belady: C evicts B (next use 4 > 3), A hit, B evicts C -> 1 hit; LRU: 0.


@pytest.mark.parametrize(
    "name,keys,cap,expected",
    [
        ("lru", LRU_FIFO, 3, 2),
        ("fifo", LRU_FIFO, 3, 1),
        ("lru", SCAN, 4, 2),
        ("fifo", SCAN, 4, 2),
        ("arc", SCAN, 4, 4),
        ("s3fifo", SCAN, 4, 4),
        ("lfu", LFU_SEQ, 2, 2),
        ("lru", LFU_SEQ, 2, 1),
        ("lru", BELADY_SEQ, 2, 0),
    ],
)
@pytest.mark.parametrize("collect_first", [False, True])
def test_hand_computed_hits(name, keys, cap, expected, collect_first):
    p = make_policy(name)
    p.set_capacity(cap)
    assert run_keys(p, keys, cap, collect_first) == expected


def test_belady_hand_computed():
    assert run_keys(belady(BELADY_SEQ), BELADY_SEQ, 2) == 1
    # the scan trace: Belady keeps A and B through the scan (3 slots left for C..G) -> A,B hits twice = 4
    assert run_keys(belady(SCAN), SCAN, 4) == 4


def test_s3fifo_ghost_readmits_into_main():
    p = make_policy("s3fifo", capacity=4)
    run_keys(p, SCAN, 4)
    # C left S unread, so G remembers it; on return it goes straight to M
    assert "C" not in p and "C" in p._ghost
    p.on_remove("A")  # make room without an eviction (no ghost entry for A)
    p.on_insert("C", 1)
    assert "C" in p._main and "C" not in p._small


def test_arc_adapts_target_on_ghost_hits():
    p = make_policy("arc", capacity=2)
    run_keys(p, list("AABC"), 2)  # A is in T2; C evicts B from T1 -> B in B1
    assert "B" in p._b1 and "A" in p._t2
    p0 = p.p
    for v in list(p.victims(1, lambda _k: True)):
        p.on_remove(v)
    assert "B" in p._b1
    p.on_insert("B", 1)  # a B1 ghost hit: recency deserved more room
    assert p.p > p0 and "B" in p._t2


# ------------------------------------------------------------------ Belady vs brute force


def brute_force_best(keys, cap):
    """Max hits over every demand-paging eviction choice (always admit the missed key)."""

    @functools.cache
    def best(i, cache):
        if i == len(keys):
            return 0
        k = keys[i]
        if k in cache:
            return 1 + best(i + 1, cache)
        if len(cache) < cap:
            return best(i + 1, cache | {k})
        return max(best(i + 1, (cache - {v}) | {k}) for v in cache)

    return best(0, frozenset())


@pytest.mark.parametrize("seed", range(25))
def test_belady_is_optimal_on_small_random_traces(seed):
    rng = random.Random(seed)
    n_keys = rng.randint(3, 6)
    keys = [rng.randrange(n_keys) for _ in range(rng.randint(6, 14))]
    cap = rng.randint(1, 3)
    opt = brute_force_best(tuple(keys), cap)
    assert run_keys(belady(keys), keys, cap) == opt
    assert sum(belady_hits(keys, cap)) == opt  # the ghost cache's offline Belady agrees
    for name in ("lru", "fifo", "lfu", "arc", "s3fifo"):
        assert run_keys(make_policy(name, capacity=cap) if name in ("arc", "s3fifo") else make_policy(name),
                        keys, cap) <= opt


def test_belady_refuses_a_wrong_future():
    p = belady(list("AB"))
    p.on_insert("A")
    with pytest.raises(ValueError):
        p.on_insert("C")


def test_next_use_positions():
    assert next_use_positions(list("ABAB")) == [2, 3, float("inf"), float("inf")]


# ------------------------------------------------------------------ registry and contract


def test_the_lazy_registry_names_every_shipped_policy_and_imports_one_at_a_time():
    """`POLICY_MODULES` lists every module of the package that registers a policy, each under the name it
    registers, and `OFFLINE_POLICIES` exactly the ones whose class says they need the future; building one policy
    imports its module only (a fresh interpreter: belady is not loaded by building lru)."""
    import pathlib
    import subprocess
    import sys

    from kvtier.storage_backends.eviction import base

    pkg = pathlib.Path(base.__file__).parent
    registering = {f"kvtier.storage_backends.eviction.{p.relative_to(pkg).with_suffix('').as_posix().replace('/', '.')}"
                   for p in pkg.rglob("*.py") if "@register_policy" in p.read_text() and p.name != "base.py"}
    assert registering == set(base.POLICY_MODULES.values())
    for name in base.POLICY_MODULES:
        cls = base.policy_class(name)
        assert cls.name == name and cls.production == (name not in base.OFFLINE_POLICIES), name
    code = ("import sys\nfrom kvtier.storage_backends.eviction import make_policy\nmake_policy('lru')\n"
            "print(sorted(m for m in sys.modules if m.startswith('kvtier.storage_backends.eviction.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "belady" not in out and "adaptive" not in out and ".lru'" in out, out


def test_registry():
    for n in ("lru", "fifo", "lfu", "arc", "s3fifo", "belady", "answer-length"):
        assert n in POLICY_REGISTRY and make_policy(n, production=False).name == n
    assert "belady" not in production_policy_names()
    assert "answer-length" in production_policy_names() and "adaptive" in production_policy_names()
    with pytest.raises(ValueError):
        make_policy("belady")
    with pytest.raises(ValueError):
        make_policy("no-such-policy")


def _fresh(name, keys):
    if name == "belady":
        return BeladyPolicy(future=keys)
    return make_policy(name, production=False)


ALL = ["lru", "fifo", "lfu", "arc", "s3fifo", "answer-length", "adaptive", "belady"]


@pytest.mark.parametrize("name", ALL)
def test_victims_skip_unevictable_and_free_enough(name):
    keys = list(range(8))
    p = _fresh(name, keys)
    for k in keys:
        p.on_insert(k, 2)
    pinned = {0, 1, 2, 3}
    got = list(p.victims(5, lambda k: k not in pinned))
    assert got and not set(got) & pinned
    assert len(set(got)) == len(got) and 2 * len(got) >= 5
    for v in got:
        p.on_remove(v)
    assert len(p) == 8 - len(got)
    assert all(k in p for k in pinned)
    # nothing evictable: no victims, no endless loop
    assert list(p.victims(1, lambda _k: False)) == []
    p.on_remove("unknown")  # no-op
    assert len(p) == 8 - len(got)


@pytest.mark.parametrize("name", [n for n in ALL if n != "belady"])
@pytest.mark.parametrize("seed", range(3))
def test_random_workload_keeps_the_contract(name, seed):
    rng = random.Random(seed)
    keys = [rng.randrange(60) for _ in range(3000)]
    p = make_policy(name, production=False)
    p.set_capacity(16)
    hits = run_keys(p, keys, 16, collect_first=bool(seed % 2))
    # no online policy beats the offline optimum on the same accesses; LRU and FIFO are exact
    assert hits <= run_keys(belady(keys), keys, 16)
    if name in ("lru", "fifo"):
        assert hits == _reference_hits(keys, 16, lru=name == "lru")
    assert len(p) == 16
