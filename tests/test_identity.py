"""KV identity: no chunk crosses tenants (cache salt, LoRA adapter, multimodal items, prompt embeddings) or model
builds (weights, config, KV dtype, layout, chunk size, parallelism), on every path that stores chunks.

- `RequestIdentity` and the scheduler side's chunk keys: each part of a request's identity makes other keys;
  multimodal items change the keys from the chunk that holds them on, and only from there.
- Weights fingerprints: content, not path or modification time; Hugging Face cache blobs by their hash; a declared
  identity; and the fingerprint's every part changes the namespace.
- The SSD tier's namespaces: persistence under the same identity, misses under another, foreign chunks reported,
  reclaimed before any chunk of the tier's own, kept across a journal compaction.
- A real LMCache engine with kvtier's plugin (the connector's keys: LMCache key tags): chunks stored for one tenant
  are found for it alone, in the host tier and on SSD, bit-exact; a model rewritten in place finds none.
(LMCache's MP-mode L2 adapter: tests/test_lmcache_mp_adapter.py; vLLM's offloading tier:
tests/test_vllm_offload_tier.py; the HTTP server: tests/test_serve_http.py; two engines and a shared store:
tests/test_shared_vllm.py.)
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.identity.model import ModelFingerprint, WeightsIdentity, config_digest, files_fingerprint, weights_identity
from kvtier.identity.namespace import UNNAMED, KeyNamespace, namespace_of
from kvtier.identity.request import RequestIdentity, adapter_fingerprint

pytestmark = pytest.mark.compat


# ------------------------------------------------------------------------------------------------ requests
@dataclass
class Pos:
    offset: int
    length: int


@dataclass
class Feature:
    identifier: str
    mm_position: Pos


@dataclass
class LoRA:
    lora_name: str
    lora_path: str


@dataclass
class Req:
    """The fields of vLLM's Request that `RequestIdentity.of` reads (the Protocol `IdentitySource`)."""

    cache_salt: str | None = None
    lora_request: LoRA | None = None
    mm_features: list[Feature] = field(default_factory=list)
    prompt_embeds: Any = None


def test_plain_requests_keep_plain_keys():
    ident = RequestIdentity.of(Req())
    tokens = list(range(100))
    assert ident.tag == "" and not ident
    assert ident.key_tokens(tokens) is tokens  # no copy on the common path


def test_each_part_of_a_requests_identity_makes_another_tag(tmp_path):
    embeds = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    reqs = {
        "plain": Req(),
        "salt A": Req(cache_salt="tenant-A"),
        "salt B": Req(cache_salt="tenant-B"),
        "lora": Req(lora_request=LoRA("sql", "/adapters/sql")),
        "lora other path": Req(lora_request=LoRA("sql", "/adapters/sql-v2")),
        "lora + salt A": Req(cache_salt="tenant-A", lora_request=LoRA("sql", "/adapters/sql")),
        "embeds": Req(prompt_embeds=embeds),
        "other embeds": Req(prompt_embeds=embeds + 1),
    }
    tags = {name: RequestIdentity.of(r).tag for name, r in reqs.items()}
    assert len(set(tags.values())) == len(tags), tags
    assert tags["plain"] == ""
    # the same identity gives the same tag (every process: no per-process seed)
    assert RequestIdentity.of(Req(cache_salt="tenant-A")).tag == tags["salt A"]
    assert RequestIdentity.of(Req(prompt_embeds=embeds.clone())).tag == tags["embeds"]


def test_a_lora_adapter_rewritten_in_place_is_another_adapter(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "adapter"
    path.mkdir()
    save_file({"lora_A": torch.zeros(8, 8)}, str(path / "adapter_model.safetensors"))
    first = RequestIdentity.of(Req(lora_request=LoRA("a", str(path)))).tag
    save_file({"lora_A": torch.ones(8, 8)}, str(path / "adapter_model.safetensors"))
    adapter_fingerprint.cache_clear()  # (a new process: the fingerprint is computed once per path and process)
    assert RequestIdentity.of(Req(lora_request=LoRA("a", str(path)))).tag != first


def test_multimodal_items_change_the_keys_from_their_chunk_on():
    from kvtier.connector.scheduler_state import prefix_chunk_keys

    tokens = [7] * 300  # placeholder ids are the same for every image
    cat = RequestIdentity.of(Req(mm_features=[Feature("img-cat", Pos(100, 50))]))
    dog = RequestIdentity.of(Req(mm_features=[Feature("img-dog", Pos(100, 50))]))
    kc, kd = cat.key_tokens(tokens), dog.key_tokens(tokens)
    assert tokens == [7] * 300, "the request's own tokens are never changed"
    assert kc[:100] == kd[:100] == tokens[:100] and kc[150:] == kd[150:] == tokens[150:]
    assert all(t < 0 for t in kc[100:150]) and len(set(kc[100:150])) == 50 and set(kc[100:150]).isdisjoint(kd)
    assert RequestIdentity.of(Req(mm_features=[Feature("img-cat", Pos(100, 50))])).key_tokens(tokens) == kc
    ck, dk, pk = (prefix_chunk_keys(t, 64) for t in (kc, kd, tokens))
    assert ck[0] == dk[0] == pk[0]  # tokens 0-63: no image, shared
    assert all(a != b for a, b in zip(ck[1:], dk[1:])) and all(a != b for a, b in zip(ck[1:], pk[1:]))
    # an item past the end of a shorter token list changes nothing there
    assert cat.key_tokens(tokens[:90]) == tokens[:90]


def test_scheduler_chunk_keys_carry_the_identity_tag():
    from kvtier.connector.scheduler_state import prefix_chunk_keys

    tokens = list(range(256))
    plain, a, b = (prefix_chunk_keys(tokens, 64, tag) for tag in ("", "a" * 32, "b" * 32))
    assert len(plain) == 4 and not set(plain) & set(a) and not set(a) & set(b)
    assert prefix_chunk_keys(tokens, 64, "a" * 32) == a


# ------------------------------------------------------------------------------------------------ fingerprints
def write_model(path: Path, seed: int, config: dict | None = None) -> Path:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {f"model.layers.{i}.{n}": torch.randn(64, 64, generator=g) for i in range(2) for n in ("q", "k", "v")}
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config or {"hidden_size": 64, "num_hidden_layers": 2,
                                                            "transformers_version": "4.99", "_name_or_path": "x"}))
    return path


def test_weights_fingerprint_follows_content_not_path_or_time(tmp_path):
    a = write_model(tmp_path / "a", seed=0)
    base = files_fingerprint(str(a))
    assert base.source == "files" and base.files == 1 and base.nbytes == os.path.getsize(a / "model.safetensors")
    shutil.copytree(a, tmp_path / "copy")
    os.utime(tmp_path / "copy" / "model.safetensors", (1, 1))
    assert files_fingerprint(str(tmp_path / "copy")).digest == base.digest  # elsewhere, another mtime: the same
    assert files_fingerprint(str(write_model(tmp_path / "b", seed=1))).digest != base.digest  # new weights
    # one tensor changed (a fine-tune of one layer) is seen too
    from safetensors.torch import load_file, save_file

    t = load_file(str(a / "model.safetensors"))
    t["model.layers.1.v"] = t["model.layers.1.v"] + 1e-3
    save_file(t, str(tmp_path / "one.safetensors"))
    shutil.copytree(a, tmp_path / "tuned")
    shutil.copyfile(tmp_path / "one.safetensors", tmp_path / "tuned" / "model.safetensors")
    assert files_fingerprint(str(tmp_path / "tuned")).digest != base.digest


def test_hub_cache_files_are_known_by_their_blob_hash(tmp_path):
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
    blobs.mkdir()
    snap.mkdir(parents=True)
    sha = "ab" * 32
    (blobs / sha).write_bytes(b"weights")
    (snap / "model.safetensors").symlink_to(blobs / sha)
    ident = files_fingerprint(str(snap))
    assert ident.source == "hub"
    (blobs / sha).write_bytes(b"WEIGHTS")  # the hub names a blob by its content's hash: not read again
    assert files_fingerprint(str(snap)).digest == ident.digest
    sha2 = "cd" * 32
    (blobs / sha2).write_bytes(b"weights")
    (snap / "model.safetensors").unlink()
    (snap / "model.safetensors").symlink_to(blobs / sha2)
    assert files_fingerprint(str(snap)).digest != ident.digest


def test_unreadable_weights_fall_back_to_the_name_and_say_so(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="kvtier.identity.model"):
        ident = weights_identity("org/not-here-anywhere")
    assert ident.source == "name" and "set kvtier.model_identity" in caplog.text
    declared = weights_identity(str(write_model(tmp_path / "m", 0)), declared="llama-ft-v3")
    assert declared.source == "declared" and declared == weights_identity("/elsewhere", declared="llama-ft-v3")


def test_every_part_of_the_fingerprint_changes_the_namespace(tmp_path):
    w = WeightsIdentity("files", "0" * 32, 1, 10)
    base = ModelFingerprint(w, config_digest({"hidden_size": 64}), "torch.float16", "page_first/p16", 256, 2, 0,
                            {"dtype": "torch.float16"})
    variants = [replace(base, weights=WeightsIdentity("files", "1" * 32, 1, 10)),
                replace(base, config=config_digest({"hidden_size": 65})), replace(base, kv_dtype="torch.bfloat16"),
                replace(base, layout="page_first/p32"), replace(base, chunk_tokens=128), replace(base, tp_size=4),
                replace(base, tp_rank=1), replace(base, compute={"dtype": "torch.float16", "quantization": "fp8"}),
                replace(base, format_version=2)]
    names = {base.namespace} | {v.namespace for v in variants}
    assert len(names) == len(variants) + 1
    assert base.namespace == replace(base).namespace and len(base.namespace) == 21
    # config keys that name where or with what the config was saved do not count
    assert config_digest({"hidden_size": 64, "transformers_version": "5.0", "_name_or_path": "/a"}) == base.config


# ------------------------------------------------------------------------------------------------ SSD tier
def _tier(cfg, ns: str, **kw):
    from kvtier.storage_backends.ssd.tier import SSDTier

    return SSDTier(cfg, 4096, namespace=ns, **kw)


def _put(tier, keys):
    from kvtier.storage_backends.ssd.index import ChunkMeta

    meta = ChunkMeta(4096, (4096,), "uint8", "raw")
    for k in keys:
        assert tier.submit_put(k, meta, memoryview(bytearray(k.encode().ljust(4096, b"."))), lambda ok: None)
    assert tier.flush(10)


def _read(tier, key):
    buf = bytearray(4096)
    got = tier.read_batch([key], lambda k, m: (memoryview(buf), 1), lambda h: None)[0]
    return bytes(buf).rstrip(b".").decode() if got is not None else None


NS_A, NS_B = "m" + "a" * 20, "m" + "b" * 20


def test_namespaces_persist_separate_and_report_foreign_chunks(tier_config, caplog):
    cfg = tier_config(ssd_capacity_gb=8 * 8192 / (1 << 30))  # 8 slots of 8 KiB
    t = _tier(cfg, NS_A)
    _put(t, ["k1", "k2", "k3"])
    assert t.keys() == ["k1", "k2", "k3"] and _read(t, "k2") == "k2"
    t.close()
    t = _tier(cfg, NS_A)  # a restart without a change: everything found
    assert sorted(t.keys()) == ["k1", "k2", "k3"] and t.foreign_chunks() == 0 and _read(t, "k3") == "k3"
    t.close()
    with caplog.at_level(logging.WARNING, logger="kvtier.storage_backends.ssd.tier"):
        t = _tier(cfg, NS_B)  # another identity over the same directory
    try:
        assert t.keys() == [] and t.foreign_chunks() == 3 and len(t) == 3
        assert not t.contains("k1") and _read(t, "k1") is None and t.stats.hits == 0
        assert f"3 chunk(s) (0.0 MiB) of other KV identities ({NS_A}: 3)" in caplog.text
        _put(t, ["k1"])  # the same key under B is another chunk
        assert _read(t, "k1") == "k1" and sorted(namespace_of(k) for k in t.index.keys()) == [NS_A] * 3 + [NS_B]
    finally:
        t.close()


def test_foreign_chunks_are_reclaimed_before_any_chunk_of_the_tiers_own(tier_config):
    cfg = tier_config(ssd_capacity_gb=4 * 8192 / (1 << 30))  # 4 slots
    t = _tier(cfg, NS_A)
    _put(t, ["a1", "a2", "a3"])
    t.close()
    t = _tier(cfg, NS_B)
    try:
        dropped = []
        t.add_drop_listener(lambda k, n, why: dropped.append((k, why)))
        _put(t, ["b1"])  # the free slot
        assert t.foreign_chunks() == 3
        _put(t, ["b2", "b3"])  # LRU alone would evict b1 (older than nothing: the foreign ones are not in it)
        assert t.foreign_chunks() == 1 and sorted(t.keys()) == ["b1", "b2", "b3"]
        assert t.stats.foreign_evicted == 2 and dropped == []  # foreign drops are not the adapter's keys
        _put(t, ["b4", "b5"])  # the last foreign chunk, then the policy's own victim (b1, the oldest)
        assert t.foreign_chunks() == 0 and sorted(t.keys()) == ["b2", "b3", "b4", "b5"]
        assert dropped == [("b1", "evicted")]
        t.index.check_invariants()
    finally:
        t.close()


def test_chunks_written_before_namespaces_are_foreign(tier_config):
    cfg = tier_config()
    t = _tier(cfg, "")  # no namespace: keys as the adapters gave them (kvtier before identities)
    _put(t, ["model@1@0@ab@bfloat16"])
    t.close()
    t = _tier(cfg, NS_A)
    try:
        assert t.foreign_chunks() == 1 and not t.contains("model@1@0@ab@bfloat16")
        assert namespace_of(t.index.foreign_keys()[0]) == UNNAMED
    finally:
        t.close()


def test_demoted_chunks_are_never_served_and_go_first(tier_config):
    t = _tier(tier_config(ssd_capacity_gb=3 * 8192 / (1 << 30)), "")
    try:
        _put(t, ["old1", "new1", "old2"])
        assert t.demote(["old1", "old2", "missing"]) == 2
        assert not t.contains("old1") and _read(t, "old2") is None and _read(t, "new1") == "new1"
        _put(t, ["new2", "new3"])
        assert sorted(t.keys()) == ["new1", "new2", "new3"] and t.stats.foreign_evicted == 2
    finally:
        t.close()


def test_key_namespace_refuses_separators():
    with pytest.raises(ValueError):
        KeyNamespace("a/b")
    with pytest.raises(ValueError):
        KeyNamespace("a@b")
    ns = KeyNamespace(NS_A)
    assert ns.strip(ns.qualify("x/y@z")) == "x/y@z" and ns.owns(ns.qualify("k")) and not ns.owns("k")


# ------------------------------------------------------------------------------------------------ LMCache engine
def _configs(tag: str):
    from kvtier.connector.worker_storage import request_configs

    return request_configs(tag)


def test_lmcache_keys_with_identity_tags_keep_tenants_apart_in_host_and_ssd(lmcache_yaml, lmcache_engines):
    """The connector's keys (LMCache's keys of the key tokens, the identity tag as a key tag) through a real engine
    with kvtier's plugin: stored for tenant A, found for A alone, from the host tier and from SSD, bit-exact."""
    from kvtier.storage_backends.lmcache.engine_access import kvtier_plugin
    from kvtier.testing.engine_factory import TINY, random_kv

    e = lmcache_engines(lmcache_yaml())
    b = kvtier_plugin(e)
    tokens, kv = torch.arange(64), random_kv(TINY, 64, seed=5)
    a, bb = "a" * 32, "b" * 32
    e.store(tokens, kvcaches=kv, request_configs=_configs(a))
    assert b.flush(30) and b.tier.stats.committed == 4
    keys = {t: [k for _, _, k in e.token_database.process_tokens(tokens=tokens, request_configs=_configs(t))]
            for t in (a, bb, "")}
    assert all(k.to_string().endswith(f"@kvtier_id%{a}") for k in keys[a])
    assert not set(keys[a]) & set(keys[bb]) and not set(keys[a]) & set(keys[""])
    for host in (True, False):  # first from the host tier, then (host tier cleared) from SSD
        if not host:
            e.storage_manager.storage_backends["LocalCPUBackend"].clear()
        for tag, want in ((bb, 0), ("", 0), (a, 64)):
            out = torch.zeros_like(kv)
            got = int(e.retrieve(tokens, kvcaches=out, request_configs=_configs(tag)).sum())
            assert got == want, (host, tag, got)
            if want:
                assert torch.equal(out.view(torch.int16), kv.view(torch.int16))
            else:
                assert torch.count_nonzero(out) == 0
    assert b.tier.stats.hits == 4


def test_plugin_weights_rewritten_in_place_are_misses_and_a_restart_keeps_them(lmcache_yaml, lmcache_engines,
                                                                                tmp_path, caplog):
    """vLLM's `LMCacheConnectorV1` path: LMCache names the model by its path. The plugin binds the weights'
    content into the tier's namespace: the same files after a restart hit, new files at the same path miss."""
    from kvtier.storage_backends.lmcache.engine_access import kvtier_plugin
    from kvtier.testing.engine_factory import TINY, random_kv

    model = write_model(tmp_path / "model", seed=0)
    shape = replace(TINY, name=str(model))
    yaml = lmcache_yaml()
    tokens, kv = torch.arange(48), random_kv(TINY, 48, seed=2)

    def run(want: int) -> Any:
        e = lmcache_engines(yaml, shape)
        b = kvtier_plugin(e)
        out = torch.zeros_like(kv)
        assert int(e.retrieve(tokens, kvcaches=out).sum()) == want
        return e, b

    e, b = run(0)
    e.store(tokens, kvcaches=kv)
    assert b.flush(30) and b.tier.stats.committed == 3
    from kvtier.launch.lmcache_engine import destroy_engine

    destroy_engine(e)
    e, b = run(48)  # restarted, same weights: served from SSD
    destroy_engine(e)
    write_model(model, seed=1)  # a fine-tune written over the old files
    with caplog.at_level(logging.WARNING):
        e, b = run(0)
    assert b.tier.foreign_chunks() == 3 and "of other KV identities" in caplog.text


# ------------------------------------------------------------------------------------------------ configuration
def test_declaring_and_checking_identities(tmp_path):
    from kvtier.cli.check_config import identity_report
    from kvtier.storage_backends.config import ConfigError, parse_adapter_params, parse_kvtier_config
    from kvtier.storage_backends.shared.config import SharedTierOptions

    model = write_model(tmp_path / "m", seed=0)
    assert parse_kvtier_config({"kvtier.ssd_path": str(tmp_path), "kvtier.ssd_capacity_gb": 1,
                                "kvtier.model_identity": "ft-v3"}).model_identity == "ft-v3"
    with pytest.raises(ConfigError, match="adapter_params.model_identity"):
        parse_adapter_params({"ssd_path": str(tmp_path), "ssd_capacity_gb": 1, "model_identity": "x"})
    with pytest.raises(ConfigError, match="kvtier.shared.model_id is gone.*kvtier.model_identity"):
        SharedTierOptions.parse({"model_id": "llama"})
    report = identity_report(str(model))
    weights = files_fingerprint(str(model))
    assert f"weights: {weights.digest[:12]} (1 files" in report and "the weight files' content" in report
    assert f"config:  {config_digest(json.loads((model / 'config.json').read_text()))[:12]}" in report
    assert "declared: kvtier.model_identity = 'ft-v3'" in identity_report(str(model), "ft-v3")
