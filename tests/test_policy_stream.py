"""The host tier's recorded policy stream (`kvtier.record_host_policy`) and its exact offline replay
(`kvtier.replay.policy_stream`), on synthetic streams: what the recorder writes, that the replay of a recording
reproduces its victims and its lookups' hits for every production policy, that it finds a tampered stream's first
divergence, and the key's validation."""

from __future__ import annotations

import json
import random

import pytest

from kvtier.replay.policy_stream import StreamKey, read_stream, replay_stream
from kvtier.storage_backends.config import ConfigError, parse_adapter_params, parse_kvtier_config
from kvtier.storage_backends.eviction import make_policy, production_policy_names, recording, session_signals
from kvtier.storage_backends.eviction.host_calls import BUSY, EVICTABLE, GONE, ChunkState

POLICIES = ("lru", "answer-length", "adaptive")


class _Key:
    """A chunk key like LMCache's: hashable, equal by value, hashing its own way."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __hash__(self) -> int:
        return hash(("chunk", self.n))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Key) and other.n == self.n


def _drive(tmp_path, policy_name: str, seed: int = 1, capacity: int = 24) -> tuple[recording.StreamRecorder, int]:
    """A host tier of `capacity` chunks driven as LMCache drives it: conversations whose turns look up their
    history, store what is missing (evicting first when full), read what they found and report their answers.
    Returns the recorder and the number of lookups that hit."""
    rec = recording.StreamRecorder(tmp_path / f"{policy_name}.jsonl", policy_name)
    calls = recording.RecordingHostPolicyCalls(make_policy(policy_name, clock=rec.clock), rec)
    calls.register_signals()
    store = recording.LookupRecordingDict(rec)
    pinned: set[_Key] = set()
    rnd = random.Random(seed)
    chains = {c: [_Key(c * 1000 + i) for i in range(rnd.randrange(2, 6))] for c in range(8)}
    hits = 0

    def state(k: object) -> ChunkState:
        if k not in dict.keys(store):
            return GONE
        return BUSY if k in pinned else EVICTABLE

    for _ in range(120):
        c = rnd.randrange(8)
        chain = chains[c]
        session_signals.request_arrived(chain)
        found = []
        for k in chain:
            with recording.lookup_scope("pin" if rnd.random() < 0.5 else "contains"):
                hit = k in store
            hits += hit
            if hit:
                found.append(k)
        pinned.update(found[:1])
        for k in found:
            calls.hit(k)
        for k in chain:
            if dict.__contains__(store, k):
                continue
            while len(store) >= capacity:
                victims = calls.evict_candidates(1, state)
                assert victims
                for v in victims:
                    store.pop(v)
            store[k] = object()
            calls.put(k)
        if rnd.random() < 0.05 and store:  # a forced removal (LMCache's remove(force=True))
            k = rnd.choice(list(dict.keys(store)))
            if k not in pinned:
                store.pop(k)
                calls.force_evict(k)
        if rnd.random() < 0.05 and store:  # a stale entry: LMCache dropped it without telling the policy
            k = rnd.choice(list(dict.keys(store)))
            if k not in pinned:
                store.pop(k)
        pinned.clear()
        session_signals.request_finished(chain, rnd.randrange(1, 400))
        chains[c] = chain + [_Key(c * 1000 + len(chain) + i) for i in range(rnd.randrange(1, 3))]
    rec.close()
    return rec, hits


@pytest.mark.parametrize("policy", POLICIES)
def test_replay_of_a_recording_equals_it(tmp_path, policy):
    rec, hits = _drive(tmp_path, policy)
    records = read_stream(rec.path)
    ops = {r["op"] for r in records}
    assert {"start", "key", "put", "hit", "evict", "request", "finished", "lookup", "force_evict", "drop"} <= ops, ops
    assert any(s == GONE for r in records if r["op"] == "evict" for _, s in r["asked"])  # stale entries recorded
    res = replay_stream(rec.path)
    assert res.first_divergence is None, res.report()
    assert res.engine_hits == res.offline_hits == hits and res.engine_misses == res.offline_misses > 0
    assert res.victims > 0 and res.signals == 240 and res.equal
    assert "no divergence" in res.report()


def test_every_production_policy_replays_exactly(tmp_path):
    for name in production_policy_names():
        res = replay_stream(_drive(tmp_path, name, seed=3)[0].path)
        assert res.equal, (name, res.report())


def test_replay_names_the_first_divergence(tmp_path):
    """A recording whose victims were changed, or whose session signals were dropped, does not replay equal: the
    replay says where it first diverged."""
    rec, _ = _drive(tmp_path, "lru")
    records = read_stream(rec.path)
    n = next(i for i, r in enumerate(records) if r["op"] == "evict" and r["victims"])
    records[n] = dict(records[n], victims=[records[n]["victims"][0] + 10_000])
    res = replay_stream(records)
    assert res.first_divergence is not None and res.first_divergence[0] == n + 1, res.report()
    assert "victims" in res.first_divergence[1]

    rec, _ = _drive(tmp_path, "answer-length", seed=2)
    without_signals = [r for r in read_stream(rec.path) if r["op"] not in ("request", "finished")]
    res = replay_stream(without_signals)
    assert not res.equal and res.first_divergence is not None, res.report()


def test_replay_of_another_policy_is_a_what_if(tmp_path, capsys):
    from kvtier.cli import main

    rec, _ = _drive(tmp_path, "answer-length")
    assert main(["replay-stream", str(rec.path)]) == 0
    out = capsys.readouterr().out
    assert "policy answer-length" in out and "no divergence" in out
    assert main(["replay-stream", str(rec.path), "--policy", "lru"]) == 0  # a what-if never fails
    out = capsys.readouterr().out
    assert "policy lru" in out and "engine :" in out and "offline:" in out


def test_recorder_writes_key_ids_hashes_and_clock_reads(tmp_path):
    rec = recording.StreamRecorder(tmp_path / "s.jsonl", "lru")
    calls = recording.RecordingHostPolicyCalls(make_policy("lru", clock=rec.clock), rec)
    a, b = _Key(1), _Key(2)
    calls.put(a)
    calls.put(b)
    calls.put(a)  # a touch of a held entry
    calls.on_request([a, b], 5.0)
    assert calls.evict_candidates(1, lambda k: BUSY if k == b else EVICTABLE) == [a]
    rec.close()
    lines = [json.loads(x) for x in rec.path.read_text().splitlines()]
    assert lines[0]["op"] == "start" and lines[0]["policy"] == "lru"
    assert lines[1] == {"op": "key", "k": 0, "h": hash(a)}
    assert [r["op"] for r in lines[2:]] == ["put", "key", "put", "put", "request", "evict"]
    ev = lines[-1]
    assert ev["victims"] == [0] and ev["n"] == 1 and [0, EVICTABLE] in ev["asked"] and ev["t"] == []
    assert lines[-2]["chain"] == [0, 1] and lines[-2]["now"] == 5.0
    assert StreamKey(0, hash(a)) == StreamKey(0, 7) and hash(StreamKey(0, hash(a))) == hash(a)


def test_a_cut_last_line_is_left_out(tmp_path):
    rec, _ = _drive(tmp_path, "lru")
    text = rec.path.read_text()
    rec.path.write_text(text + '{"op": "lookup", "k"')
    assert len(read_stream(rec.path)) == len(text.splitlines())
    (tmp_path / "other.jsonl").write_text('{"op": "put", "k": 0}\n')
    with pytest.raises(ValueError, match="start record"):
        read_stream(tmp_path / "other.jsonl")


def test_record_host_policy_key(tmp_path):
    base = {"kvtier.ssd_path": str(tmp_path / "ssd"), "kvtier.ssd_capacity_gb": 1}
    assert parse_kvtier_config(base).record_host_policy == ""
    cfg = parse_kvtier_config({**base, "kvtier.record_host_policy": str(tmp_path / "new" / "rec")})
    assert cfg.record_host_policy == str(tmp_path / "new" / "rec")
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="kvtier.record_host_policy: .* not a directory"):
        parse_kvtier_config({**base, "kvtier.record_host_policy": str(tmp_path / "file")})
    with pytest.raises(ConfigError, match="kvtier.record_host_policy must be a non-empty string"):
        parse_kvtier_config({**base, "kvtier.record_host_policy": 3})
    with pytest.raises(ConfigError, match="adapter_params.record_host_policy has no meaning"):
        parse_adapter_params({"ssd_path": str(tmp_path), "ssd_capacity_gb": 1, "record_host_policy": str(tmp_path)})


def test_check_config_and_the_demo_pass_the_key(tmp_path, capsys):
    """The demo's `--record-host-policy DIR` reaches its YAML, `kvtier check-config` reports it, and refuses it
    where the host tier does not run a kvtier policy; the demo refuses it without `--eviction-policy`."""
    pytest.importorskip("lmcache", reason="check-config loads the YAML as LMCache does")
    from kvtier.cli import main
    from kvtier.cli.check_config import check
    from kvtier.cli.demo_vllm import _lmcache_yaml
    from kvtier.launch.lmcache_yaml import write_lmcache_yaml

    rec = tmp_path / "rec"
    path = tmp_path / "a.yaml"
    _lmcache_yaml(path, 64, 8, str(tmp_path / "ssd"), 64, "adaptive", str(rec))
    assert f"host policy stream recorded into {rec}" in check(str(path))
    lru = write_lmcache_yaml(tmp_path / "b.yaml", ssd_path=tmp_path / "ssd", extra={"record_host_policy": str(rec)})
    with pytest.raises(ConfigError, match="cache_policy is LRU; set cache_policy: KVTIER_<NAME>"):
        check(lru)
    assert main(["demo-vllm", "--record-host-policy", str(rec)]) == 2
    assert "--eviction-policy" in capsys.readouterr().out
