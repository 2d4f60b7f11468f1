"""Trace readers and the `kvtier replay` tool: hand-computed two-tier replays, capacity parsing, session recovery,
the CLI end to end (table, JSON, PNG), the shipped demo slice, and the shared full trace when it is present."""

from __future__ import annotations

import json
import random
from collections import OrderedDict
from pathlib import Path

import pytest

from kvtier.replay import runner as replay
from kvtier.replay import vllm_offload
from kvtier.replay.runner import ReplayClock, parse_capacity, replay_one, simulate
from kvtier.replay.traces import TraceRequest, read_trace, recover_sessions, unique_blocks
from kvtier.storage_backends.eviction import make_policy
from kvtier.storage_backends.ssd.index import SlotIndex

REPO = Path(__file__).resolve().parents[1]
SLICE = REPO / "demo_data" / "mooncake_conversation_slice.jsonl"
FULL = REPO.parent / "shared" / "traces" / "mooncake_conversation_first30min.jsonl"


def reqs_of(chains, step=1.0):
    return [TraceRequest(i, i * step, tuple(c), 512 * len(c), 10, 0, None, 1) for i, c in enumerate(chains)]


CHAINS = [[1, 2], [1, 2, 3], [4, 5], [1, 6]]


def test_two_tier_replay_hand_computed():
    # host LRU of 3 blocks, unbounded SSD:
    # r0: 1,2 miss | r1: 1,2 hit, 3 miss | r2: 4 evicts 1, 5 evicts 2 | r3: 1 from SSD (evicts 3), 6 evicts 4
    clock = ReplayClock()
    host = make_policy("lru", clock=clock)
    c = simulate(reqs_of(CHAINS), host, 3, clock=clock)
    assert c == {"accesses": 9, "host_hits": 2, "ssd_hits": 1, "misses": 6, "host_evictions": 4}
    assert sorted(host._order) == [1, 5, 6]


def test_bounded_ssd_is_the_ssd_tiers_own_index(monkeypatch):
    """A bounded SSD tier in the replay is `SlotIndex`, the production SSD tier's index: its counters match a
    hand-written two-tier LRU model on a random trace, its invariants hold, and it really evicted."""
    made: list[SlotIndex] = []

    class Recorded(SlotIndex):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self)

    monkeypatch.setattr(replay, "SlotIndex", Recorded)
    rng = random.Random(7)
    # two hot blocks live in the host tier while the SSD tier's LRU order ages them out: inclusive drops happen
    chains = [[rng.choice((0, 1)) if rng.random() < 0.5 else rng.randrange(2, 40) for _ in range(rng.randint(1, 6))]
              for _ in range(300)]
    clock = ReplayClock()
    host, ssd = make_policy("lru", clock=clock), make_policy("lru", clock=clock)
    got = simulate(reqs_of(chains), host, 3, ssd, 8, clock=clock)
    [index] = made
    index.check_invariants()
    assert len(index) == 8 and index.stats.evictions > 100 and index.stats.hits == got["ssd_hits"]

    h: OrderedDict[int, None] = OrderedDict()
    d: OrderedDict[int, None] = OrderedDict()
    want = dict.fromkeys(("accesses", "host_hits", "ssd_hits", "misses", "host_evictions"), 0)
    for chain in chains:
        for k in chain:
            want["accesses"] += 1
            if k in h:
                want["host_hits"] += 1
                h.move_to_end(k)
                continue
            if k in d:
                want["ssd_hits"] += 1
                d.move_to_end(k)
            else:
                want["misses"] += 1
                if len(d) == 8:
                    v, _ = d.popitem(last=False)
                    h.pop(v, None)  # inclusive
                d[k] = None
            if len(h) == 3:
                h.popitem(last=False)
                want["host_evictions"] += 1
            h[k] = None
    assert got == want


def test_inclusive_ssd_drops_host_copies():
    # host 2, SSD 2 (LRU, host hits do not touch it): every SSD eviction takes the host copy along;
    # r1: 3 pushes 1 out of the SSD and so out of host memory; ... r3: 1 is gone from both tiers -> a miss
    clock = ReplayClock()
    host, ssd = make_policy("lru", clock=clock), make_policy("lru", clock=clock)
    c = simulate(reqs_of(CHAINS), host, 2, ssd, 2, clock=clock)
    assert c == {"accesses": 9, "host_hits": 2, "ssd_hits": 0, "misses": 7, "host_evictions": 0}
    assert all(k in ssd for k in host._order) and len(host) <= 2


def test_parse_capacity():
    assert parse_capacity("0.05", 1000).blocks == 50
    assert parse_capacity("5%", 1000).blocks == 50
    assert parse_capacity("300blocks", 1000).blocks == 300
    c = parse_capacity("2GB", 1000, block_bytes=10**8)
    assert c.blocks == 20 and c.fraction == pytest.approx(0.02)
    assert parse_capacity("3", 1000, block_bytes=10**9).blocks == 3  # a bare number > 1 is GB
    assert parse_capacity("inf", 1000).blocks is None
    with pytest.raises(ValueError):
        parse_capacity("lots", 1000)


def test_recover_sessions_from_prefix_chains():
    chains = [
        [0, 1, 2, 3],  # conversation A, turn 1
        [0, 7, 8],  # shares only the system prompt: conversation B
        [0, 1, 2, 4, 5],  # A, turn 2 (A's partial last chunk 3 is not repeated)
        [0, 7, 9],  # B's prompt had 3 chunks; 2 repeated (0, 7): B, turn 2
        [0, 1, 2, 4, 5, 6],  # A, turn 3 (the previous last chunk 5 was full)
    ]
    out = recover_sessions(chains)
    assert out == [(0, None, 1), (1, None, 1), (0, 0, 2), (1, 1, 2), (0, 2, 3)]


def test_readers(tmp_path):
    moon = tmp_path / "m.jsonl"
    moon.write_text(
        "\n".join(
            json.dumps({"timestamp": t, "input_length": 512 * len(h), "output_length": 7, "hash_ids": h})
            for t, h in [(0, [0, 1, 2]), (3000, [0, 5]), (6000, [0, 1, 2, 4])]
        )
        + "\n"
    )
    r = read_trace(moon)
    assert [x.timestamp for x in r] == [0.0, 3.0, 6.0]
    assert [(x.parent, x.turn) for x in r] == [(None, 1), (None, 1), (0, 2)]
    assert unique_blocks(r) == 5
    bai = tmp_path / "b.jsonl"
    rows = [
        {"chat_id": 11, "parent_chat_id": -1, "timestamp": 1.5, "input_length": 40, "output_length": 9,
         "type": "text", "turn": 1, "hash_ids": [1, 2, 3]},
        {"chat_id": 12, "parent_chat_id": -1, "timestamp": 1.0, "input_length": 20, "output_length": 3,
         "type": "text", "turn": 1, "hash_ids": [7]},
        {"chat_id": 13, "parent_chat_id": 11, "timestamp": 9.0, "input_length": 60, "output_length": 4,
         "type": "text", "turn": 2, "hash_ids": [1, 2, 3, 4]},
    ]
    bai.write_text("\n".join(json.dumps(x) for x in rows) + "\n")
    b = read_trace(bai)  # sniffed; sorted by time
    assert [x.hash_ids[0] for x in b] == [7, 1, 1]
    assert b[2].parent == 1 and b[2].session == b[1].session and b[2].turn == 2
    lim = read_trace(bai, "bailian", limit=2)
    assert len(lim) == 2 and lim[0].timestamp == 1.0
    with pytest.raises(ValueError):
        read_trace(bai, "nope")


def test_cli_end_to_end(tmp_path, capsys):
    from kvtier.cli import main

    trace = tmp_path / "t.jsonl"
    lines = []
    nid, t = 1, 0
    for _s in range(60):  # 60 two-turn conversations on a shared system prompt
        first = [0] + list(range(nid, nid + 4))
        nid += 4
        lines.append((t, first))
        lines.append((t + 45_000, first[:-1] + list(range(nid, nid + 3))))
        nid += 3
        t += 3000
    lines.sort(key=lambda x: x[0])
    trace.write_text(
        "\n".join(json.dumps({"timestamp": ts, "input_length": 512 * len(h) - 100, "output_length": 50,
                              "hash_ids": h}) for ts, h in lines) + "\n"
    )
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    rc = main(["replay", str(trace), "--policies", "lru,s3fifo,answer-length,belady", "--host-capacity",
               "0.05,0.2", "--json", str(out), "--plot", str(png), "--no-progress"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "hit rate" in printed and "answer-length" in printed
    # how its host tier differs from the engine's, every difference that applies to the replay (issue 50)
    from kvtier.replay.engine_model import differences

    assert len(differences("replay")) >= 5
    assert all(f"- {d.aspect}: replay" in printed for d in differences("replay")), printed
    doc = json.loads(out.read_text())
    res = doc["results"]
    assert len(res) == 8 and doc["unique_blocks"] == 60 * 7 + 1
    for r in res:
        assert {"policy", "host_capacity", "hit_rate", "ssd_hit_rate"} <= set(r)
        assert r["hit_rate"] == pytest.approx(r["host_hits"] / r["accesses"])
        assert r["ssd_hit_rate"] == pytest.approx(r["ssd_hits"] / r["accesses"])
        assert r["host_hits"] + r["ssd_hits"] + r["misses"] == r["accesses"] == 60 * 12
        # unbounded inclusive SSD: every repeat access hits one tier or the other
        assert r["misses"] == doc["unique_blocks"]
    for cap in ("0.05", "0.2"):
        by = {r["policy"]: r["hit_rate"] for r in res if r["host_capacity"] == cap}
        assert by["belady"] >= max(by.values())
    small = {r["policy"]: r["hit_rate"] for r in res if r["host_capacity"] == "0.05"}
    big = {r["policy"]: r["hit_rate"] for r in res if r["host_capacity"] == "0.2"}
    assert all(big[p] >= small[p] for p in ("lru", "belady"))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_rejects_unknown_policy(tmp_path):
    from kvtier.cli import main

    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1]}) + "\n")
    with pytest.raises(SystemExit, match=r"^kvtier replay: unknown eviction policy 'nope'; choose from .*'lru'"):
        main(["replay", str(trace), "--policies", "nope", "--no-progress"])
    with pytest.raises(SystemExit, match=r"^kvtier replay: capacity '5xx': expected a fraction"):
        main(["replay", str(trace), "--host-capacity", "5xx", "--no-progress"])


GOOD_LINE = json.dumps({"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1, 2]})


@pytest.mark.parametrize("second_line, said", [
    ("not json", r"t\.jsonl:2: not a JSON line"),
    ("[1, 2]", r"t\.jsonl:2: not a JSON object"),
    (json.dumps({"timestamp": 5}), r"t\.jsonl:2: no 'hash_ids' field"),
    (json.dumps({"hash_ids": [1]}), r"t\.jsonl:2: no 'timestamp' field"),
    (json.dumps({"timestamp": 5, "hash_ids": "123"}), r"t\.jsonl:2: 'hash_ids' is not a list of integers"),
    (json.dumps({"timestamp": 5, "hash_ids": [1, 2.5]}), r"t\.jsonl:2: 'hash_ids' is not a list of integers"),
    (json.dumps({"timestamp": "soon", "hash_ids": [1]}), r"t\.jsonl:2: timestamp, input_length and output_length "
                                                         r"must be numbers"),
    ('{"timestamp": NaN, "hash_ids": [1]}', r"t\.jsonl:2: the timestamp is not a finite number"),
])
def test_a_bad_trace_line_is_named_in_one_line_by_the_reader_and_both_commands(tmp_path, second_line, said):
    """A trace line the readers cannot take is a ValueError naming file and line, and `kvtier replay` /
    `kvtier simulate` print it as one line and exit 1, no traceback (never a silently wrong request)."""
    from kvtier.cli import main

    trace = tmp_path / "t.jsonl"
    trace.write_text(GOOD_LINE + "\n" + second_line + "\n")
    with pytest.raises(ValueError, match=said):
        read_trace(trace, "mooncake")
    for command in ("replay", "simulate"):
        with pytest.raises(SystemExit, match=rf"^kvtier {command}: .*{said}") as e:
            main([command, str(trace), "--no-progress"])
        assert isinstance(e.value.code, str)  # printed by Python as one line on stderr, exit status 1


def test_a_missing_trace_is_one_line(tmp_path):
    from kvtier.cli import main

    for command in ("replay", "simulate"):
        with pytest.raises(SystemExit, match=rf"^kvtier {command}: .*nope\.jsonl: No such file or directory$"):
            main([command, str(tmp_path / "nope.jsonl"), "--no-progress"])
    bai = tmp_path / "b.jsonl"
    bai.write_text(json.dumps({"chat_id": 1, "timestamp": 0, "hash_ids": [1]}) + "\n"
                   + json.dumps({"timestamp": 1, "hash_ids": [1, 2]}) + "\n")
    with pytest.raises(ValueError, match=r"b\.jsonl:2: no 'chat_id' field"):
        read_trace(bai, "bailian")


@pytest.mark.parametrize("command", ["demo", "demo-vllm", "demo-shared"])
def test_the_demos_name_a_bad_trace_line_and_start_nothing(tmp_path, capsys, command):
    """`--trace` pointing at a missing file or a bad line: exit status 2 and one line naming it, before any engine,
    server or SSD directory is made."""
    from kvtier.cli import main

    bad = tmp_path / "t.jsonl"
    bad.write_text(GOOD_LINE + "\n" + json.dumps({"timestamp": 5}) + "\n")
    for trace, said in ((bad, "t.jsonl:2: no 'hash_ids' field"), (tmp_path / "nope.jsonl", "No such file")):
        assert main([command, "--trace", str(trace)]) == 2
        out = capsys.readouterr().out
        assert out.startswith("--trace: ") and said in out and out.count("\n") == 1, out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.jsonl"]


def test_demo_slice_replay():
    reqs = read_trace(SLICE)
    assert len(reqs) == 400 and any(r.parent is not None for r in reqs)
    cap = parse_capacity("0.05", unique_blocks(reqs))
    rates = {p: replay_one(reqs, p, cap).hit_rate for p in ("lru", "fifo", "lfu", "arc", "s3fifo", "answer-length",
                                                              "belady")}
    assert rates["belady"] >= max(rates.values())
    assert 0.0 < rates["lru"] < rates["belady"]


@pytest.mark.skipif(not FULL.exists(), reason="shared traces not present (../shared)")
def test_full_conversation_trace_matches_the_readme_facts():
    reqs = read_trace(FULL)
    accesses = sum(len(r.hash_ids) for r in reqs)
    u = unique_blocks(reqs)
    assert 1 - u / accesses == pytest.approx(0.34, abs=0.01)  # "34% of block accesses can hit at all"
    cap = parse_capacity("0.05", u)
    assert replay_one(reqs, "belady", cap).hit_rate == pytest.approx(0.32, abs=0.01)  # "the optimum ~32%"
    assert replay_one(reqs, "fifo", cap).hit_rate == pytest.approx(0.10, abs=0.01)  # LRU-like ~10%


# ------------------------------------------------------------------ vLLM's own CPU-offload policies as baselines

vllm_needed = pytest.mark.skipif(not vllm_offload.installed(), reason="vLLM's kv_offload is not installed here")


@pytest.mark.compat
@vllm_needed
def test_vllm_offload_policies_hand_computed():
    """vLLM's real CPUOffloadingManager, driven by the replay: hit counts worked out from its documented rules."""
    # Its LRU ranks a request's chunks head-last (the tail goes first): r0 1,2 | r1 1,2 hit, 3 stored (full) |
    # r2 4 evicts 3, 5 evicts 2 (1, the head, is more recent) | r3 1 hit, 6 evicts 5. kvtier's plain LRU: 2 hits.
    assert vllm_offload.simulate(reqs_of(CHAINS), "vllm-lru", 3) == {
        "accesses": 9, "host_hits": 3, "ssd_hits": 0, "misses": 6, "host_evictions": 3}
    # store_threshold=2 admits a chunk on its second offer only: r1 stores 1 and 2 (from the SSD), r3 hits 1.
    assert vllm_offload.simulate(reqs_of(CHAINS), "vllm-lru-t2", 3) == {
        "accesses": 9, "host_hits": 1, "ssd_hits": 2, "misses": 6, "host_evictions": 0}
    # A scan: LRU lets 3 push out the once-reused 1; ARC keeps it in T2 and evicts 2 from T1.
    scan = reqs_of([[1], [1], [2], [3], [1]])
    assert vllm_offload.simulate(scan, "vllm-lru", 2)["host_hits"] == 1
    assert vllm_offload.simulate(scan, "vllm-arc", 2)["host_hits"] == 2


@pytest.mark.compat
@vllm_needed
def test_cli_table_includes_vllm_policies(tmp_path, capsys):
    from kvtier.cli import main

    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps({"timestamp": 1000 * i, "input_length": 1024, "output_length": 5,
                                           "hash_ids": c}) for i, c in enumerate(CHAINS * 5)) + "\n")
    out = tmp_path / "r.json"
    assert main(["replay", str(trace), "--policies", "lru,vllm-lru,vllm-arc-t2", "--host-capacity", "3blocks",
                 "--json", str(out), "--no-progress", "--score-from", "4"]) == 0
    printed = capsys.readouterr().out
    assert "vllm-lru " in printed and "vllm-arc-t2" in printed and "CPUOffloadingManager" in printed
    assert "scored: requests from t = 4 s on" in printed
    res = {r["policy"]: r for r in json.loads(out.read_text())["results"]}
    assert res["vllm-lru"]["extra"]["vllm"].startswith("0.3")
    assert all(r["accesses"] == sum(len(c) for c in (CHAINS * 5)[4:]) for r in res.values())  # scored part only
