"""kvtier's SSD tier as a secondary tier of vLLM's own offloading (`storage_backends/vllm_offload/`), driven by vLLM's
own tiering manager (`TieringOffloadingSpec.get_manager()`: its CPU primary tier on vLLM's shared region, its
promotion and cascade jobs) through `kvtier.testing.vllm_tiering`, in every environment whose vLLM has the tiering
path. Asserted: bit-exact loads after a restart, the capacity held under a store stream 3x the tier, a flipped byte
a miss (recomputed by vLLM, never served), a full disk a failed store job and never an exception into vLLM, another
layout never reading the chunks, strict configuration, and jobs drained at shutdown."""

from __future__ import annotations

import errno
import logging
import os

import numpy as np
import pytest

pytestmark = [pytest.mark.compat, pytest.mark.needs("vllm_tiering")]


@pytest.fixture(scope="module")
def vt():
    from kvtier.testing import vllm_tiering

    return vllm_tiering


def chunks_of(seed: int, n: int, nbytes: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, nbytes, dtype=np.uint8) for _ in range(n)]


def slots_gb(slots: int, block: int) -> float:
    from kvtier.storage_backends.ssd.slot_format import HEADER_SIZE

    return (slots * (HEADER_SIZE + block) + 1) / (1 << 30)


def test_stores_persist_and_load_bit_exact_after_a_restart(vt, tmp_path):
    """vLLM's cascade stores each primary chunk into kvtier's tier; a new manager on the same path (a restarted
    engine: an empty primary tier) finds every chunk and promotes it bit-exact into its primary chunks."""
    keys, data = vt.offload_keys("a", 6), chunks_of(1, 6, vt.BLOCK_BYTES)
    with vt.TieringHarness([vt.kvtier_tier(tmp_path / "ssd", 0.01)], cpu_chunks=8) as h:
        assert h.store(keys, data) == keys
        h.settle()
        tier = h.tiers[0]
        assert len(tier.tier) == 6 and tier.tier.stats.committed == 6
    with vt.TieringHarness([vt.kvtier_tier(tmp_path / "ssd", 0.01)], cpu_chunks=8) as h:
        tier = h.tiers[0]
        assert sorted(tier.tier.keys()) == sorted(k.hex() for k in keys)
        got = h.load(keys)
        for i, (g, d) in enumerate(zip(got, data)):
            assert g is not None and np.array_equal(g, d), f"chunk {i}"
        assert tier.tier.stats.hits == 6
        # now in the primary tier: a second request reads them there, the SSD tier is not asked again
        assert all(g is not None for g in h.load(keys)) and tier.tier.stats.hits == 6


def test_capacity_held_under_a_store_stream_three_times_the_tier(vt, tmp_path):
    """A stream of 3x the tier's capacity: the tier stays within its slots (kvtier's eviction; vLLM's `fs` tier has no
    bound by default), its files within the capacity, and the newest chunks survive a restart bit-exact."""
    cap = 10
    cfg = vt.kvtier_tier(tmp_path / "ssd", slots_gb(cap, vt.BLOCK_BYTES))
    keys, data = vt.offload_keys("s", 3 * cap), chunks_of(2, 3 * cap, vt.BLOCK_BYTES)
    with vt.TieringHarness([cfg], cpu_chunks=4) as h:
        tier = h.tiers[0]
        assert tier.tier.max_slots == cap
        for i in range(0, len(keys), 2):
            assert h.store(keys[i:i + 2], data[i:i + 2])
            h.settle()
            assert len(tier.tier) <= cap
        assert len(tier.tier) == cap and tier.tier.stats.evictions == 2 * cap
        files = [f for f in (tmp_path / "ssd").rglob("slots-*.dat")]
        assert sum(f.stat().st_size for f in files) <= cap * tier.tier.slot_size
    with vt.TieringHarness([cfg], cpu_chunks=cap + 2) as h:
        got = h.load(keys)
        assert [g is not None for g in got] == [False] * (2 * cap) + [True] * cap  # LRU kept the newest
        for g, d in zip(got[2 * cap:], data[2 * cap:]):
            assert np.array_equal(g, d)


def test_a_flipped_byte_is_a_miss_that_vllm_recomputes(vt, tmp_path):
    """One data byte flipped in every slot (headers intact): each promotion fails its CRC check, vLLM's lookup ends
    in MISS (it recomputes), no primary chunk is ever handed out, and the damaged chunks leave the tier."""
    from kvtier.testing.ssd import flip_a_byte_in_every_slot

    keys, data = vt.offload_keys("f", 4), chunks_of(3, 4, vt.BLOCK_BYTES)
    cfg = vt.kvtier_tier(tmp_path / "ssd", 0.01)
    with vt.TieringHarness([cfg]) as h:
        h.store(keys, data)
        h.settle()
    assert flip_a_byte_in_every_slot(tmp_path / "ssd") == 4
    with vt.TieringHarness([cfg]) as h:
        tier = h.tiers[0]
        assert len(tier.tier) == 4  # the index does not read data at start
        assert h.load(keys) == [None] * 4
        assert tier.tier.stats.corrupt == 4 and len(tier.tier) == 0
        assert h.load(keys) == [None] * 4  # and stays a miss


def test_a_full_disk_fails_store_jobs_without_an_exception_into_vllm(vt, tmp_path, monkeypatch, caplog):
    """A disk that refuses every grow: vLLM's store jobs finish as failed (the primary chunks are released), nothing
    raises into the manager, the episode is logged once; once the disk has room, stores commit again."""
    from kvtier.storage_backends.ssd import tier_writes

    def no_room(*_a):
        raise OSError(errno.ENOSPC, "No space left on device")

    real = os.posix_fallocate
    keys, data = vt.offload_keys("d", 6), chunks_of(4, 6, vt.BLOCK_BYTES)
    with vt.TieringHarness([vt.kvtier_tier(tmp_path / "ssd", 0.01, grow_step_mb=1)]) as h:
        tier = h.tiers[0]
        monkeypatch.setattr(os, "posix_fallocate", no_room)
        with caplog.at_level(logging.WARNING, logger="kvtier"):
            h.store(keys[:3], data[:3])
            h.settle()
        assert len(tier.tier) == 0 and tier.tier.stats.dropped_no_space == 3
        assert tier.job_results == {("store", "failed"): 1}
        assert [g is not None for g in h.load(keys[:3])] == [True] * 3  # still served from the primary tier
        monkeypatch.setattr(os, "posix_fallocate", real)
        monkeypatch.setattr(tier_writes, "DISK_FULL_RETRY_S", 0.0)
        h.store(keys[3:], data[3:])
        h.settle()
        assert sorted(tier.tier.keys()) == sorted(k.hex() for k in keys[3:])
        assert tier.job_results == {("store", "failed"): 1, ("store", "ok"): 1}
    assert len([r for r in caplog.records if "disk full" in r.getMessage()]) == 1


def test_another_layout_never_reads_the_chunks(vt, tmp_path):
    """Another model (or dtype, chunk size, parallelism) on the same ssd_path gets a directory of its own: it finds
    none of the first model's chunks, and the first model still finds all of them."""
    keys, data = vt.offload_keys("m", 3), chunks_of(5, 3, vt.BLOCK_BYTES)
    cfg = vt.kvtier_tier(tmp_path / "ssd", 0.01)
    with vt.TieringHarness([cfg], model="org/model-a") as h:
        h.store(keys, data)
        h.settle()
    with vt.TieringHarness([cfg], model="org/model-b") as h:
        assert len(h.tiers[0].tier) == 0 and h.load(keys) == [None] * 3
    with vt.TieringHarness([cfg], model="org/model-a", block_bytes=2 * vt.BLOCK_BYTES) as h:
        assert len(h.tiers[0].tier) == 0 and h.load(keys) == [None] * 3
    with vt.TieringHarness([cfg], model="org/model-a") as h:
        assert all(np.array_equal(g, d) for g, d in zip(h.load(keys), data))
    dirs = sorted(p.name for p in (tmp_path / "ssd" / "vllm-offload").iterdir())
    assert len(dirs) == 3 and all(d.startswith("org_model-") for d in dirs), dirs


def _vllm_block_keys(tokens: list[int], block: int, salt: str | None) -> list:
    """vLLM's own keys of a request's blocks (chained block hashes with vLLM's extra keys: here the cache salt)."""
    from types import SimpleNamespace

    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, hash_block_tokens, init_none_hash
    from vllm.v1.kv_offload.base import make_offload_key

    fn = get_hash_fn_by_name("sha256")
    init_none_hash(fn)
    req = SimpleNamespace(cache_salt=salt, lora_request=None, mm_features=[], prompt_embeds=None,
                          _prompt_embeds_per_block_hashes={})
    keys, parent = [], None
    for start in range(0, len(tokens) // block * block, block):
        extra, _ = generate_block_hash_extra_keys(req, start, start + block, 0)
        parent = hash_block_tokens(fn, parent, tokens[start:start + block], extra)
        keys.append(make_offload_key(parent, 0))
    return keys


def test_salted_requests_and_new_weights_never_share_chunks(vt, tmp_path):
    """vLLM's block hashes carry the cache salt: a tenant's chunks stored through vLLM's tiering manager are found
    for that tenant only. kvtier binds the model's weights into its keys: new weights written under the same model
    path find none of the old chunks (reclaimed first), the same weights after a restart find all of them."""
    import torch
    from safetensors.torch import save_file

    model = tmp_path / "model"
    model.mkdir()

    def weights(seed: int) -> None:
        save_file({"w": torch.randn(32, 32, generator=torch.Generator().manual_seed(seed))},
                  str(model / "model.safetensors"))
        (model / "config.json").write_text('{"hidden_size": 32}')

    weights(0)
    tokens = list(range(100, 164))
    a, b, plain = (_vllm_block_keys(tokens, 16, s) for s in ("tenant-A", "tenant-B", None))
    assert not set(a) & set(b) and not set(a) & set(plain)
    data = chunks_of(3, len(a), vt.BLOCK_BYTES)
    cfg = vt.kvtier_tier(tmp_path / "ssd", 0.01)
    with vt.TieringHarness([cfg], model=str(model)) as h:
        assert h.store(a, data) == a
        h.settle()
        assert h.load(b) == [None] * 4 and h.load(plain) == [None] * 4
    with vt.TieringHarness([cfg], model=str(model)) as h:  # restarted: tenant A's chunks are there, B's are not
        assert h.load(b) == [None] * 4
        assert all(np.array_equal(g, d) for g, d in zip(h.load(a), data))
    weights(1)
    with vt.TieringHarness([cfg], model=str(model)) as h:
        tier = h.tiers[0].tier
        assert tier.foreign_chunks() == 4 and tier.keys() == [] and h.load(a) == [None] * 4


@pytest.mark.parametrize("bad, message", [
    ({"ssd_capcity_gb": 1}, "ssd_capcity_gb"),
    ({"ssd_capacity_gb": "lots"}, "ssd_capacity_gb"),
    ({"eviction_policy": "mru"}, "eviction_policy"),
])
def test_a_bad_key_stops_the_manager_at_start_naming_it(vt, tmp_path, bad, message):
    from kvtier.storage_backends.config import ConfigError

    cfg = {**vt.kvtier_tier(tmp_path / "ssd", 0.01), **bad}
    with pytest.raises(ConfigError, match=message) as e:
        vt.TieringHarness([cfg])
    assert "secondary_tiers" in str(e.value)


def test_a_planted_symlink_is_refused_at_start(vt, tmp_path):
    from kvtier.storage_backends.config import ConfigError

    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "ssd")
    with pytest.raises(ConfigError, match="symbolic link"):
        vt.TieringHarness([vt.kvtier_tier(tmp_path / "ssd", 0.01)])


def test_shutdown_drains_the_jobs_in_flight(vt, tmp_path, monkeypatch):
    """`shutdown` (and vLLM's `reset_cache`, through `drain_jobs`) waits for every store in flight: all committed."""
    keys, data = vt.offload_keys("x", 8), chunks_of(6, 8, vt.BLOCK_BYTES)
    cfg = vt.kvtier_tier(tmp_path / "ssd", 0.01)
    h = vt.TieringHarness([cfg], cpu_chunks=8)
    h.store(keys, data)
    h.tiers[0].drain_jobs()
    assert not h.tiers[0]._open_jobs
    h.close()
    with vt.TieringHarness([cfg], cpu_chunks=8) as h:
        assert all(np.array_equal(g, d) for g, d in zip(h.load(keys), data))


def test_a_store_job_finishes_only_once_its_chunks_are_committed(vt, tmp_path, monkeypatch):
    """vLLM keeps a store job's primary chunks pinned until the job finishes; the tier still reads them until its
    writes commit, so the job must not finish earlier (a reused primary chunk would put other bytes on the disk)."""
    from kvtier.testing.ssd import hold_writer

    keys, data = vt.offload_keys("w", 3), chunks_of(7, 3, vt.BLOCK_BYTES)
    with vt.TieringHarness([vt.kvtier_tier(tmp_path / "ssd", 0.01)]) as h:
        tier = h.tiers[0]
        gate = hold_writer(monkeypatch, tier.tier)
        h.store(keys, data)
        for _ in range(20):
            h.step()
        assert tier.job_results == {} and h.manager.has_pending_work() and len(tier.tier) == 0
        gate.set()
        h.settle()
        assert tier.job_results == {("store", "ok"): 1} and len(tier.tier) == 3


@pytest.mark.parametrize("change, message", [
    (lambda x: x["secondary_tiers"][0].update(ssd_capcity_gb=3), "ssd_capcity_gb"),
    (lambda x: x["secondary_tiers"][0].update(module_path="kvtier.connector"), "module_path"),
    (lambda x: x.update(eviction_policy="KVTierMRU"), "eviction_policy"),
    (lambda x: x.update(spec_name="CPUOffloadingSpec"), "spec_name"),
    (lambda x: x.update(cpu_bytes_to_use=0), "cpu_bytes_to_use"),
    (lambda x: x["secondary_tiers"].append({"type": "nfs"}), "Unknown secondary tier"),
])
def test_check_config_names_the_bad_key_of_the_offloading_json(tmp_path, change, message):
    """`kvtier check-config` on configs/vllm-offloading-kvtier.json: OK as shipped, and each mistake named."""
    import json
    from pathlib import Path

    from kvtier.cli.check_config import check
    from kvtier.storage_backends.config import ConfigError

    shipped = json.loads((Path(__file__).resolve().parents[1] / "configs" / "vllm-offloading-kvtier.json").read_text())
    shipped["kv_connector_extra_config"]["secondary_tiers"][0]["ssd_path"] = str(tmp_path / "ssd")
    ok = tmp_path / "ok.json"
    ok.write_text(json.dumps(shipped))
    assert check(str(ok)).startswith("OK: ")
    change(shipped["kv_connector_extra_config"])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(shipped))
    with pytest.raises(ConfigError, match=message):
        check(str(bad))
