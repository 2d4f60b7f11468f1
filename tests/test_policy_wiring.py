"""Eviction policies wired into the tiers they govern: kvtier's SSD tier and LMCache's host tier."""

from __future__ import annotations

import random
import sys
import threading
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from kvtier.storage_backends.eviction import session_signals
from kvtier.storage_backends.ssd.slot_format import HEADER_SIZE
from kvtier.storage_backends.ssd.tier import ChunkMeta, SSDTier

pytest.importorskip("lmcache", reason="needs lmcache: LMCache is not installed (kvtier[lmcache])")

from kvtier.launch.lmcache_engine import ModelShape, build_engine, destroy_engine
from kvtier.storage_backends.lmcache.backend import load_lmcache_config

pytestmark = pytest.mark.compat
CHUNK = 4096


def put(t, key, seed):
    data = np.full(CHUNK, seed % 256, dtype=np.uint8)
    assert t.submit_put(key, ChunkMeta(CHUNK, (CHUNK,), "torch.uint8", "KV_2LTD"), memoryview(data), lambda ok: None)
    assert t.flush(10)


def touch(t, key):
    buf = np.empty(CHUNK, dtype=np.uint8)
    assert t.read_batch([key], lambda k, m: (memoryview(buf), k), lambda h: None) == [key]


@pytest.mark.parametrize("policy, survivors", [("lru", ["a", "c", "d"]), ("fifo", ["b", "c", "d"]),
                                               ("answer-length", ["a", "c", "d"]), ("adaptive", ["a", "c", "d"])])
def test_ssd_tier_evicts_through_its_policy(tier_config, policy, survivors):
    t = SSDTier(tier_config(ssd_capacity_gb=3 * (HEADER_SIZE + CHUNK) / (1 << 30), eviction_policy=policy), CHUNK)
    try:
        assert t.policy.name == policy and t.policy.capacity == 3
        for i, k in enumerate("abc"):
            put(t, k, i)
        touch(t, "a")  # LRU keeps a (recently used), FIFO evicts it (oldest insert); answer-length: a chunk read
        # again has a wait ahead of it, the unread b and c are older waits of the same (orphan) class
        put(t, "d", 3)
        assert sorted(t.keys()) == survivors
    finally:
        t.close()


def test_session_signals_reach_the_ssd_policy_in_its_key_space(tier_config):
    seen = []
    t = SSDTier(tier_config(), CHUNK)
    try:
        t.policy.on_request_finished = lambda chain, n, now=None: seen.append((list(chain), n))

        class Key:  # an LMCache-like key
            def __init__(self, s):
                self.s = s

            def to_string(self):
                return self.s

        session_signals.request_finished([Key("m@1@0@aa@bf16"), Key("m@1@0@bb@bf16")], 57)
        assert seen == [(["m@1@0@aa@bf16", "m@1@0@bb@bf16"], 57)]
    finally:
        t.close()


@pytest.mark.parametrize("policy, present", [("fifo", [False, True, True, True]), ("lru", [True, False, True, True]),
                                             ("answer_length", [True, False, True, True]),
                                             ("adaptive", [True, False, True, True])])
def test_lmcache_host_tier_uses_a_kvtier_policy(tmp_path, policy, present):
    from lmcache.v1.storage_backend.cache_policy import POLICY_MAPPING

    shape = ModelShape("kvtier-test/host-policy", 2, 2, 16, torch.bfloat16)
    chunk_bytes = shape.chunk_bytes(16)
    cfg_path = tmp_path / "host.yaml"
    cfg_path.write_text(f"chunk_size: 16\nlocal_cpu: true\nmax_local_cpu_size: {3.5 * chunk_bytes / (1 << 30)}\n"
                        f"cache_policy: KVTIER_{policy.upper()}\n")
    e = build_engine(load_lmcache_config(str(cfg_path)), shape)
    try:
        assert "KVTIER_ANSWER_LENGTH" in POLICY_MAPPING
        host = e.storage_manager.storage_backends["LocalCPUBackend"]
        assert type(host.cache_policy).__name__ == f"KVTierHostPolicy_{policy}"
        seqs = [torch.arange(i * 1000, i * 1000 + 16) for i in range(4)]
        kv = torch.randn(2, 2, 16, 32).to(torch.bfloat16)
        for s in seqs[:3]:
            e.store(s, kvcaches=kv)
        # A request's lookup (pinned, as vLLM's) is a hit on the oldest chunk; LMCache reports it to the policy.
        assert e.lookup(seqs[0], pin=True, lookup_id="req-0") == 16
        e.lookup_unpin("req-0")
        e.store(seqs[3], kvcaches=kv)  # the pool holds 3 chunks: one must go
        assert [e.lookup(s) == 16 for s in seqs] == present
    finally:
        destroy_engine(e)


@dataclass(frozen=True)
class _ChunkKey:  # an LMCache-like key: hashable, and every session-signal sink can take it (`to_string`)
    chunk: int

    def to_string(self) -> str:
        return f"kvtier-test@1@0@{self.chunk:x}@bf16"


def test_a_failing_session_signal_sink_is_logged_and_skipped(caplog):
    """A signal is advice: one policy that raises must not keep it from the others, nor reach the caller (a lookup
    in the connector), and its failure is logged, with the traceback the first time."""
    from kvtier.storage_backends.eviction import make_policy

    broken, healthy = make_policy("lru"), make_policy("lru")
    seen = []

    def fail(chain, n, now=None):
        raise RuntimeError("policy bug")

    broken.on_request_finished = fail
    healthy.on_request_finished = lambda chain, n, now=None: seen.append((list(chain), n))
    session_signals.register(broken)
    session_signals.register(healthy)
    keys = [_ChunkKey(1), _ChunkKey(2)]
    with caplog.at_level("WARNING", logger=session_signals.__name__):
        for _ in range(1000):
            session_signals.request_finished(keys, 7)
    assert seen == [(keys, 7)] * 1000
    logged = [r for r in caplog.records if r.name == session_signals.__name__]
    assert [r.levelname for r in logged] == ["ERROR", "WARNING"]  # the first failure, then the 1,000th
    assert "policy bug" in str(logged[0].exc_info[1]) and "1000 session signals" in logged[1].getMessage()


@pytest.mark.parametrize("policy", ["adaptive", "answer_length"])
def test_host_policy_survives_session_signals_from_another_thread(policy, caplog):
    """LMCache calls its host tier's policy under its own lock; session signals come from the connector's threads
    without it. Both at once must raise nothing, and the policy must end holding exactly the cached keys (the whole
    capacity usable). Without the adapter's lock a signal rebuilt `adaptive`'s victim order mid-scan (KeyError)."""
    from kvtier.storage_backends.lmcache.host_policy import _adapter_class

    class Entry:
        can_evict = True

    adapter = _adapter_class(policy.replace("_", "-"))()
    cache = adapter.init_mutable_mapping()
    recent: list[_ChunkKey] = []
    errors: list[BaseException] = []
    done = threading.Event()

    def lmcache_side() -> None:  # what LocalCPUBackend does, under its own lock (one thread here)
        try:
            rnd = random.Random(1)
            for _ in range(40_000):
                key = _ChunkKey(rnd.randrange(2_000))
                if key in cache:
                    adapter.update_on_hit(key, cache)
                else:
                    if len(cache) >= 200:
                        for victim in adapter.get_evict_candidates(cache, 4):
                            del cache[victim]
                    cache[key] = Entry()
                    adapter.update_on_put(key)
                recent.append(key)
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)
        finally:
            done.set()

    def signals_side() -> None:
        try:
            rnd = random.Random(2)
            while not done.is_set():
                chain = recent[-rnd.randrange(1, 30):]
                session_signals.request_arrived(chain)
                session_signals.request_finished(chain, rnd.randrange(1, 500))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can: the race shows within seconds
    threads = [threading.Thread(target=lmcache_side), threading.Thread(target=signals_side)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        sys.setswitchinterval(old)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    dropped = [r for r in caplog.records if r.name == session_signals.__name__]
    assert dropped == [], dropped[0].exc_info  # a signal that failed inside the policy is dropped: none may be
    assert len(adapter.policy) == len(cache) and all(k in adapter.policy for k in cache)
    for victim in adapter.get_evict_candidates(cache, len(cache)):  # every cached chunk can still be evicted
        del cache[victim]
    assert len(cache) == 0 and len(adapter.policy) == 0


def test_vllm_plugin_entry_point_registers_lazily():
    """The general-plugin hook must not import LMCache (vLLM's CPU worker start trips over it) yet make
    KVTIER_* policies available as soon as LMCache's policy table is imported."""
    import subprocess
    import textwrap

    code = textwrap.dedent("""
        import sys
        from importlib.metadata import entry_points
        (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "kvtier_host_policies"]
        ep.load()()
        assert "lmcache" not in sys.modules, "the plugin imported LMCache"
        from lmcache.v1.storage_backend.cache_policy import get_cache_policy
        print(type(get_cache_policy("KVTIER_ANSWER_LENGTH")).__name__)
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "KVTierHostPolicy_answer_length" in res.stdout, res.stderr[-3000:]
