"""kvtier's L2 adapter for LMCache's multiprocess server, driven in-process through LMCache's own L2 contract.

The adapter is built by LMCache's own `plugin` factory from the same JSON a user passes to `lmcache server
--l2-adapter`; objects are real L1 objects of LMCache's `L1MemoryManager`; completions are awaited on the event fds
the way LMCache's store and prefetch controllers do. The real server, the harness and vLLM are in
`test_lmcache_mp_server.py`.
"""

from __future__ import annotations

import json
import os
import random
import select
import threading

import pytest
import torch

pytestmark = pytest.mark.compat

pytest.importorskip("lmcache", reason="needs lmcache: LMCache is not installed (kvtier[lmcache])")

from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.config import L1MemoryManagerConfig
from lmcache.v1.distributed.internal_api import L2AdapterListener
from lmcache.v1.distributed.l2_adapters import create_l2_adapter
from lmcache.v1.distributed.l2_adapters.plugin_l2_adapter import PluginL2AdapterConfig
from lmcache.v1.distributed.memory_manager.l1_memory_manager import L1MemoryManager
from lmcache.v1.platform import consume_fd

from kvtier.storage_backends.config import ConfigError
from kvtier.storage_backends.lmcache.mp_adapter import (
    SUBDIR,
    KVTierL2Adapter,
    key_string,
    parse_key_string,
)
from kvtier.storage_backends.lmcache.mp_keys import parse_key_weights

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = torch.Size([2, 2, 16, 64])  # K/V x layers x tokens x hidden: a 16 KiB fp32 chunk
LAYOUT = MemoryLayoutDesc([SHAPE], [torch.float32])
NBYTES = SHAPE.numel() * 4
SLOT = NBYTES + 4096


def spec(path, **params) -> dict:
    """The shipped configs/lmcache-mp-l2-kvtier.json with its path (and extra adapter_params) replaced."""
    d = json.load(open(os.path.join(REPO, "configs", "lmcache-mp-l2-kvtier.json")))
    d["adapter_params"]["ssd_path"] = str(path)
    d["adapter_params"]["ssd_capacity_gb"] = 1 / 16  # 64 MiB (~3,000 chunks): 64 MiB files, not 1 GiB, per test
    d["adapter_params"].update(params)
    return d


def build(path, **params) -> KVTierL2Adapter:
    """The adapter exactly as `lmcache server` builds it: LMCache's plugin config and factory."""
    d = spec(path, **params)
    cfg = PluginL2AdapterConfig.from_dict({k: v for k, v in d.items() if k != "type"})
    return create_l2_adapter(cfg)


@pytest.fixture
def l1():
    mgr = L1MemoryManager(L1MemoryManagerConfig(64 << 20, False, align_bytes=4096, shm_name=""))
    made = []

    def alloc(n: int, layout: MemoryLayoutDesc = LAYOUT, fill: int | None = None):
        err, objs = mgr.allocate(layout, n)
        assert objs, err
        made.extend(objs)
        for _i, o in enumerate(objs):
            v = o.raw_data.view(torch.uint8)
            if fill is None:
                v.copy_(torch.randint(0, 256, v.shape, dtype=torch.uint8))
            else:
                v.fill_(fill)
        return objs

    yield alloc
    mgr.free(made)


@pytest.fixture
def adapters(tmp_path):
    made = []

    def make(path=None, **params):
        a = build(path or tmp_path / "ssd", **params)
        made.append(a)
        return a

    yield make
    for a in made:
        a.close()


def keys_for(n: int, start: int = 0, model: str = "org/model", rank: int = 0x01000100, salt: str = "") -> list:
    return [ObjectKey(chunk_hash=(start + i).to_bytes(16, "big"), model_name=model, kv_rank=rank, cache_salt=salt)
            for i in range(n)]


def wait(fd: int, timeout: float = 30.0) -> None:
    p = select.poll()
    p.register(fd, select.POLLIN)
    assert p.poll(timeout * 1000), "no completion signalled"
    consume_fd(fd)


def store(a, keys, objs, timeout: float = 30.0):
    tid = a.submit_store_task(keys, objs)
    done = {}
    while tid not in done:
        wait(a.get_store_event_fd(), timeout)
        done.update(a.pop_completed_store_tasks())
    return done[tid]


def _bits(bm, n: int) -> list[bool]:
    return [bm.test(i) for i in range(n)]  # LMCache <= 0.5.5's Bitmap has no len()


def lookup(a, keys, layout=LAYOUT) -> list[bool]:
    tid = a.submit_lookup_and_lock_task(keys, {0: layout})
    while (bm := a.query_lookup_and_lock_result(tid)) is None:
        wait(a.get_lookup_and_lock_event_fd())
    return _bits(bm, len(keys))


def load(a, keys, objs) -> list[bool]:
    tid = a.submit_load_task(keys, objs)
    while (bm := a.query_load_result(tid)) is None:
        wait(a.get_load_event_fd())
    return _bits(bm, len(keys))


def same(x, y) -> bool:
    return torch.equal(x.raw_data.view(torch.uint8)[:x.get_size()], y.raw_data.view(torch.uint8)[:y.get_size()])


class Recorder(L2AdapterListener):
    def __init__(self):
        self.stored, self.deleted, self.accessed = [], [], []

    def on_l2_keys_stored(self, keys, sizes):
        self.stored += list(zip(keys, sizes))

    def on_l2_keys_accessed(self, keys):
        self.accessed += keys

    def on_l2_keys_deleted(self, keys):
        self.deleted += keys


def test_key_strings_round_trip_every_field():
    for k in [ObjectKey(b"\x00" * 3 + b"\xff", "meta-llama/Llama-3-8B", ObjectKey.ComputeKVRank(8, 5, 4, 1), 2,
                        "user-7"), ObjectKey(b"\x01", "m", 0), ObjectKey(bytes(32), "a.b_c-d", 7, 0, "")]:
        assert parse_key_string(key_string(k, "0123abcd")) == k
        assert parse_key_weights(key_string(k, "0123abcd")) == (k, "0123abcd")
    a, b = keys_for(1, rank=1)[0], keys_for(1, rank=2)[0]
    salted = keys_for(1, salt="x")[0]
    plain = keys_for(1)[0]
    # every field that tells KV apart, the weights' fingerprint included, makes another key
    assert len({key_string(a, "w"), key_string(b, "w"), key_string(salted, "w"), key_string(plain, "w"),
                key_string(plain, "w2")}) == 5
    assert parse_key_string("model@1@0@ab") is None and parse_key_string("mp2@w@m@zz@0@ab@") is None
    assert parse_key_string("mp1@m@1@0@ab@") is None  # kvtier's older keys (no fingerprint): never parsed


@pytest.mark.parametrize("params, key", [
    ({"ssd_capacity": 1}, "adapter_params.ssd_capacity"),
    ({"io_threads": "four"}, "adapter_params.io_threads"),
    ({"o_direct": "maybe"}, "adapter_params.o_direct"),
    ({"eviction_policy": "mru"}, "adapter_params.eviction_policy"),
    ({"chunk_format": "KV_2LTD"}, "adapter_params.chunk_format"),
    ({"kvtier.io_threads": 2}, "adapter_params.kvtier.io_threads"),
])
def test_bad_adapter_params_fail_naming_the_key(tmp_path, params, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        build(tmp_path / "ssd", **params)


def test_missing_path_and_capacity_fail(tmp_path):
    cfg = PluginL2AdapterConfig.from_dict({"module_path": "kvtier.storage_backends.lmcache_mp_adapter",
                                           "class_name": "KVTierL2Adapter", "adapter_params": {}})
    with pytest.raises(ConfigError, match=r"adapter_params\.ssd_path, adapter_params\.ssd_capacity_gb"):
        create_l2_adapter(cfg)


def test_second_adapter_on_the_same_path_is_refused(adapters, tmp_path):
    adapters()
    with pytest.raises(ConfigError, match=r"adapter_params\.ssd_path: .* is in use by another kvtier process"):
        build(tmp_path / "ssd")


def test_event_fds_are_distinct(adapters, tmp_path):
    a, b = adapters(), adapters(tmp_path / "other")
    fds = [f() for x in (a, b) for f in (x.get_store_event_fd, x.get_lookup_and_lock_event_fd,
                                          x.get_load_event_fd)]
    assert len(set(fds)) == 6


def test_round_trip_bit_exact_listing_and_restart(adapters, l1, tmp_path):
    a = adapters()
    rec = Recorder()
    a.register_listener(rec)
    keys, objs = keys_for(6), l1(6)
    res = store(a, keys, objs)
    assert res.is_successful() and res.bytes_transferred() == 6 * NBYTES
    a._deliver_events()
    assert sorted(k.chunk_hash for k, _ in rec.stored) == sorted(k.chunk_hash for k in keys)
    assert a.get_usage().total_bytes_used == 6 * NBYTES and a.get_usage().total_capacity_bytes == 1 << 26
    # stored again: a success that writes nothing
    again = store(a, keys[:2], objs[:2])
    assert again.is_successful() and again.bytes_transferred() == 0
    probe = keys + keys_for(2, start=100)
    assert lookup(a, probe) == [True] * 6 + [False] * 2
    out = l1(6, fill=0)
    assert load(a, keys, out) == [True] * 6
    assert all(same(x, y) for x, y in zip(objs, out))
    a.submit_unlock(keys)
    assert not any(a.tier.is_pinned(a.tier_key(k)) for k in keys)
    pages, cursor = [], None
    while True:
        page = a.list_l2_keys(model_name="org/model", page_size=4, cursor=cursor)
        pages.append(page.entries)
        if page.next_page_token is None:
            break
        cursor = page.next_page_token
    assert [len(p) for p in pages] == [4, 2]
    assert {e.key.to_object_key() for p in pages for e in p} == set(keys)
    assert all(e.size_bytes == NBYTES for p in pages for e in p)
    assert a.list_l2_keys(model_name="other").entries == ()
    a.close()

    b = adapters()  # a new server process on the same path: the index comes back from the journal
    assert b.tier is not None and len(b.tier) == 6
    assert b.get_usage().total_bytes_used == 6 * NBYTES
    assert lookup(b, keys) == [True] * 6
    out2 = l1(6, fill=0)
    assert load(b, keys, out2) == [True] * 6
    assert all(same(x, y) for x, y in zip(objs, out2))
    b.submit_unlock(keys)
    assert b.report_status()["is_healthy"] and b.report_status()["chunks"] == 6


def test_other_layout_is_a_miss_that_never_touches_the_buffer(adapters, l1):
    a = adapters()
    keys, objs = keys_for(2), l1(2)
    assert store(a, keys, objs).is_successful()
    bf16 = MemoryLayoutDesc([torch.Size([2, 2, 16, 128])], [torch.bfloat16])  # same byte count, other layout
    other = l1(2, layout=bf16, fill=0x5A)
    assert other[0].get_size() == NBYTES
    assert lookup(a, keys) == [True, True]
    assert load(a, keys[:1], other[:1]) == [False]
    assert bool((other[0].raw_data.view(torch.uint8)[:NBYTES] == 0x5A).all()), "a mismatched load wrote bytes"
    a.submit_unlock(keys)
    # the key now means the other layout: its chunk was dropped, so the engine's re-store replaces it
    assert lookup(a, keys) == [False, True]
    a.submit_unlock(keys[1:])
    assert store(a, keys[:1], other[:1]).is_successful()
    back = l1(1, layout=bf16, fill=0)
    assert load(a, keys[:1], back) == [True] and same(back[0], other[0])
    smaller = l1(1, layout=MemoryLayoutDesc([torch.Size([2, 2, 8, 64])], [torch.float32]), fill=0x33)
    assert load(a, keys[1:], smaller) == [False]  # a buffer too small is never written past
    assert bool((smaller[0].raw_data.view(torch.uint8)[:smaller[0].get_size()] == 0x33).all())


def test_flipped_byte_on_disk_is_a_miss(adapters, l1, tmp_path):
    a = adapters()
    keys, objs = keys_for(3), l1(3)
    assert store(a, keys, objs).is_successful()
    a.close()
    d = tmp_path / "ssd" / SUBDIR
    [slots] = [p for p in os.listdir(d) if p.startswith("slots-")]
    with open(d / slots, "r+b") as f:  # slot 1: header (4 KiB), then the chunk
        f.seek(SLOT + 4096 + 1000)
        b = f.read(1)
        f.seek(SLOT + 4096 + 1000)
        f.write(bytes([b[0] ^ 0x01]))
    b = adapters()
    rec = Recorder()
    b.register_listener(rec)
    assert lookup(b, keys) == [True] * 3  # the index cannot know; the read checks the CRCs
    out = l1(3, fill=0)
    got = load(b, keys, out)
    assert got.count(False) == 1
    bad = got.index(False)
    assert all(same(objs[i], out[i]) for i in range(3) if i != bad)
    b.submit_unlock(keys)
    b._deliver_events()
    assert rec.deleted == [keys[bad]] and b.get_usage().total_bytes_used == 2 * NBYTES
    assert b.tier.stats.corrupt == 1
    assert lookup(b, keys) == [i != bad for i in range(3)]
    b.submit_unlock(keys)


def test_full_tier_evicts_by_its_policy_and_accounts_every_drop(adapters, l1):
    cap_gb = 4 * SLOT / (1 << 30)  # room for four chunks
    a = adapters(ssd_capacity_gb=cap_gb, eviction_policy="lru")
    rec = Recorder()
    a.register_listener(rec)
    keys, objs = keys_for(10), l1(10)
    for k, o in zip(keys[:4], objs[:4]):
        assert store(a, [k], [o]).is_successful()
    assert lookup(a, keys[:1]) == [True]  # locked by a lookup: never evicted while the lock is held
    for k, o in zip(keys[4:], objs[4:]):
        assert store(a, [k], [o]).is_successful()
    present = [k for k in keys if a.tier.contains(a.tier_key(k))]
    assert present == [keys[0]] + keys[7:]  # LRU kept the newest, and the locked chunk
    a.submit_unlock(keys[:1])
    a._deliver_events()
    assert len(a.tier) == 4 and a.tier.used_bytes() <= a.kvtier_config.capacity_bytes
    assert a.get_usage().total_bytes_used == 4 * NBYTES
    assert sorted(rec.deleted, key=keys.index) == keys[1:7]
    files = [p for p in os.listdir(a.directory) if p.startswith("slots-")]
    assert sum(os.stat(os.path.join(a.directory, p)).st_blocks * 512 for p in files) <= a.kvtier_config.capacity_bytes
    assert store(a, keys[1:2], objs[1:2]).is_successful()  # unlocked now: keys[0] is the LRU victim
    assert not a.tier.contains(a.tier_key(keys[0]))


def test_delete_notifies_before_returning(adapters, l1):
    a = adapters()
    rec = Recorder()
    a.register_listener(rec)
    keys = keys_for(3)
    assert store(a, keys, l1(3)).is_successful()
    a.delete(keys[:2])
    assert rec.deleted == keys[:2] and a.get_usage().total_bytes_used == NBYTES
    assert lookup(a, keys) == [False, False, True]
    a.submit_unlock(keys)
    a.submit_unlock(keys_for(2, start=50))  # unknown keys: unlock never fails


def test_chunk_larger_than_the_slots_fails_its_store_task(adapters, l1):
    a = adapters()
    assert store(a, keys_for(1), l1(1)).is_successful()  # the first chunks size the tier's slots
    big = l1(1, layout=MemoryLayoutDesc([torch.Size([2, 2, 32, 64])], [torch.float32]))
    res = store(a, keys_for(1, start=9), big)
    assert not res.is_successful()
    assert lookup(a, keys_for(1, start=9)) == [False]


def test_slot_size_comes_from_the_first_lookup_layout(adapters, l1, tmp_path):
    a = adapters()
    assert a.tier is None
    assert lookup(a, keys_for(1)) == [False]
    assert a.tier is not None and a.tier.slot_size == SLOT
    assert json.load(open(tmp_path / "ssd" / SUBDIR / "layout.json")) == {"chunk_bytes": NBYTES}


def test_two_controller_threads_at_once(adapters, l1):
    """LMCache's store controller and prefetch controller call the adapter from two threads at once."""
    a = adapters(ssd_capacity_gb=24 * SLOT / (1 << 30))
    n = 48
    keys, objs = keys_for(n), l1(n)
    errors: list[BaseException] = []
    verified = [0]
    stored = threading.Event()

    def storer():
        try:
            for i in range(0, n, 2):
                res = store(a, keys[i:i + 2], objs[i:i + 2])
                assert res.is_successful()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
        finally:
            stored.set()

    def prefetcher():
        rng = random.Random(1)
        try:
            rounds = 0
            while not stored.is_set() or rounds < 60:
                rounds += 1
                pick = rng.sample(range(n), 4)
                ks = [keys[i] for i in pick]
                found = [i for i, hit in zip(pick, lookup(a, ks)) if hit]
                if found:
                    dest = l1(len(found), fill=0)
                    # a locked chunk cannot be evicted: every load succeeds
                    assert load(a, [keys[i] for i in found], dest) == [True] * len(found)
                    assert all(same(objs[i], d) for i, d in zip(found, dest))
                    verified[0] += len(found)
                a.submit_unlock(ks)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=storer), threading.Thread(target=prefetcher)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert verified[0] > 0
    a._deliver_events()
    assert not any(a.tier.is_pinned(a.tier_key(k)) for k in keys), "a lock was not released"
    assert len(a.tier) == 24 and a.get_usage().total_bytes_used == 24 * NBYTES


def test_check_config_accepts_the_shipped_json_and_names_bad_keys(tmp_path):
    from kvtier.cli.check_config import check

    good = tmp_path / "l2.json"
    good.write_text(open(os.path.join(REPO, "configs", "lmcache-mp-l2-kvtier.json")).read()
                     .replace("/var/cache/kvtier", str(tmp_path / "ssd")))
    assert check(str(good)).startswith(f"OK: {good}: LMCache L2 adapter KVTierL2Adapter")
    assert (tmp_path / "ssd" / SUBDIR).is_dir()
    for change, message in [({"adapter_params": {"ssd_path": str(tmp_path), "ssd_capacity_gb": 1, "io_blocks": 8}},
                             r"adapter_params\.io_blocks \(did you mean adapter_params\.io_block_mb\?\)"),
                            ({"adapter_params": {"ssd_path": str(tmp_path), "ssd_capacity_gb": -1}},
                             r"adapter_params\.ssd_capacity_gb must be > 0"),
                            ({"class_name": "KVTierBackend"}, r"\"class_name\" must be 'KVTierL2Adapter'"),
                            ({"type": "fs", "base_path": str(tmp_path)}, r"\"type\" must be \"plugin\""),
                            ({"ssd_path": str(tmp_path)}, r"ssd_path belong under \"adapter_params\"")]:
        d = spec(tmp_path / "ssd")
        d.update(change)
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps(d))
        with pytest.raises(ConfigError, match=message):
            check(str(bad))
    # kvtier's settings given with a "type" of their own: named as kvtier's adapter, not LMCache's "no such type"
    bad.write_text(json.dumps({"type": "kvtier", "ssd_path": str(tmp_path), "ssd_capacity_gb": 1}))
    with pytest.raises(ConfigError, match=r"\"type\" must be \"plugin\" for kvtier's adapter, with \"module_path\": "
                                          r"'kvtier\.storage_backends\.lmcache_mp_adapter'.*got 'kvtier'$"):
        check(str(bad))


def test_capacity_below_one_chunk_is_reported_not_silent(adapters, l1):
    a = adapters(ssd_capacity_gb=NBYTES / 2 / (1 << 30))
    assert not store(a, keys_for(1), l1(1)).is_successful()
    st = a.report_status()
    assert not st["is_healthy"] and "adapter_params.ssd_capacity_gb" in st["error"]
    assert lookup(a, keys_for(1)) == [False]


def test_a_store_task_commits_its_chunks_together(adapters, l1):
    """A store task's chunks reach the tier in one call, so one writer commits them with one journal append
    (one fdatasync and one journal fsync for the task, not one per chunk), all durable before the task completes."""
    a = adapters()
    assert lookup(a, keys_for(1, start=900)) == [False]  # the lookup's layout opens the tier
    commits: list[int] = []
    real = a.tier.io.commit

    def commit(records):
        real(records)
        commits.append(len(records))

    a.tier.io.commit = commit
    submit = a.tier.queue.submit_many

    def slow_submit(tasks):  # the writers get time to start on what was handed over before the rest arrives
        out = submit(tasks)
        threading.Event().wait(0.05)
        return out

    a.tier.queue.submit_many = slow_submit
    keys, objs = keys_for(6), l1(6)
    res = store(a, keys, objs)
    assert res.is_successful() and res.bytes_transferred() == 6 * NBYTES
    assert commits == [6]
    assert all(a.tier.contains(a.tier_key(k)) for k in keys)


def test_check_config_accepts_lmcaches_own_adapter_shipped_beside_kvtiers(tmp_path):
    """The shipped `resp` spec (LMCache's Redis adapter, listed after kvtier's) passes LMCache's parser and says kvtier
    does not run it; the same spec with a port LMCache refuses fails naming LMCache's reason."""
    from kvtier.cli.check_config import check

    shipped = os.path.join(REPO, "configs", "lmcache-mp-l2-redis.json")
    assert check(shipped).startswith(f"OK: {shipped}: LMCache's own L2 adapter 'resp'")
    bad = tmp_path / "resp.json"
    bad.write_text(json.dumps(dict(json.load(open(shipped)), port=-1)))
    with pytest.raises(ConfigError, match=r"LMCache rejects this --l2-adapter spec: .*port"):
        check(str(bad))


def test_salts_keep_tenants_apart_and_new_weights_under_the_same_path_miss(adapters, l1, tmp_path):
    """LMCache's MP keys carry the request's cache salt: another tenant (or none) never finds a tenant's chunks.
    They carry no trace of the weights: kvtier's keys add a fingerprint of the model's files, so after new weights
    are written under the same model path the old chunks are misses, reclaimed first, and no longer listed."""
    from safetensors.torch import save_file

    model = tmp_path / "model"
    model.mkdir()

    def weights(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        save_file({"w": torch.randn(64, 64, generator=g)}, str(model / "model.safetensors"))
        (model / "config.json").write_text('{"hidden_size": 64}')

    weights(0)
    keys = lambda salt: keys_for(3, model=str(model), salt=salt)  # noqa: E731
    a = adapters()
    assert store(a, keys("tenant-A"), l1(3)).is_successful()
    assert lookup(a, keys("tenant-A")) == [True] * 3
    assert lookup(a, keys("tenant-B")) == [False] * 3 and lookup(a, keys("")) == [False] * 3
    a.submit_unlock(keys("tenant-A"))
    a.close()
    a = adapters()  # restarted, same weights: found
    assert lookup(a, keys("tenant-A")) == [True] * 3
    a.submit_unlock(keys("tenant-A"))
    a.close()
    weights(1)
    a = adapters()
    assert lookup(a, keys("tenant-A")) == [False] * 3
    assert a.tier.foreign_chunks() == 3 and a.list_l2_keys().entries == ()
