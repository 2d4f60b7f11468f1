"""SSD write admission (`kvtier.ssd_admission`) and the shared tier's `writes`, one mechanism
(`kvtier.storage_backends.admission`): strict parsing, each policy's exact decisions, the shared tier's rule
unchanged through the new objects, the scheduler's per-save refusals, the worker's hand-over to the plugin's puts,
and the replay's counts on a crafted trace."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvtier.storage_backends.admission.admit_all import AdmitAll
from kvtier.storage_backends.admission.admit_none import AdmitNone
from kvtier.storage_backends.admission.base import ADMIT_ALL, REFUSE_ALL, AdmissionQuery, Decision
from kvtier.storage_backends.admission.config import AdmissionOptions, make_policy, policy_for, shared_policy
from kvtier.storage_backends.admission.continuing import Continuing
from kvtier.storage_backends.admission.gate import RefusedKeys
from kvtier.storage_backends.admission.second_sight import SecondSight
from kvtier.storage_backends.config import ConfigError, parse_kvtier_config
from kvtier.storage_backends.shared.config import SharedTierOptions

# ------------------------------------------------------------------ parsing


def test_parse_defaults_and_a_full_mapping():
    assert AdmissionOptions.parse(None) == AdmissionOptions("all", 2, 65536, 1)
    got = AdmissionOptions.parse({"policy": "second-sight", "min_history_chunks": 0, "ghost_chunks": 10,
                                  "min_seen_chunks": 3})
    assert got == AdmissionOptions("second-sight", 0, 10, 3)
    assert isinstance(policy_for(got), SecondSight) and policy_for(got).capacity == 10


@pytest.mark.parametrize("raw, message", [
    ("second-sight", r"kvtier\.ssd_admission must be a mapping"),
    ({"polciy": "all"},
     r"unknown key\(s\) kvtier\.ssd_admission\.polciy \(did you mean kvtier\.ssd_admission\.policy\?\)"),
    ({"policy": "lru"}, r"kvtier\.ssd_admission\.policy must be one of all, continuing, second-sight, none, got 'lru'"),
    ({"policy": 2}, r"kvtier\.ssd_admission\.policy must be one of"),
    ({"min_history_chunks": -1}, r"kvtier\.ssd_admission\.min_history_chunks must be an integer >= 0, got -1"),
    ({"min_history_chunks": "2"}, r"kvtier\.ssd_admission\.min_history_chunks must be an integer >= 0, got '2'"),
    ({"min_history_chunks": True}, r"kvtier\.ssd_admission\.min_history_chunks must be an integer"),
    ({"ghost_chunks": 0}, r"kvtier\.ssd_admission\.ghost_chunks must be an integer >= 1, got 0"),
    ({"ghost_chunks": 1.5}, r"kvtier\.ssd_admission\.ghost_chunks must be an integer >= 1"),
    ({"min_seen_chunks": 0}, r"kvtier\.ssd_admission\.min_seen_chunks must be an integer >= 1, got 0"),
])
def test_parse_names_each_bad_key(raw, message):
    with pytest.raises(ConfigError, match=message):
        AdmissionOptions.parse(raw)


def test_the_section_is_not_an_ssd_key():
    """`kvtier.ssd_admission` is a section (parsed by its own options), not an unknown SSD-tier key."""
    cfg = parse_kvtier_config({"kvtier.ssd_path": "/tmp/kvtier-adm", "kvtier.ssd_capacity_gb": 1,
                               "kvtier.ssd_admission": {"policy": "none"}})
    assert cfg.ssd_capacity_gb == 1


# ------------------------------------------------------------------ policies


def test_all_none_continuing_decide_exactly():
    assert AdmitAll().decide(AdmissionQuery(0)) == ADMIT_ALL
    assert AdmitNone().decide(AdmissionQuery(9)) == REFUSE_ALL
    c = Continuing(2)
    assert [c.decide(AdmissionQuery(d)).rest for d in range(5)] == [False, False, True, True, True]
    assert Continuing(0).decide(AdmissionQuery(0)) == ADMIT_ALL


def test_second_sight_writes_on_the_second_sight_only():
    p = SecondSight(ghost_chunks=3, min_seen_chunks=1)
    q = lambda *keys: p.decide(AdmissionQuery(0, keys))  # noqa: E731
    assert q(1, 2) == Decision(False, (False, False))  # first sight: nothing written
    assert q(1, 2, 3) == ADMIT_ALL  # continues a prefix seen: all, its answer's chunks too
    assert q(9) == Decision(False, (False,))  # first sight; the ghost holds 2, 3, 9 now (1 forgotten: capacity 3)
    assert len(p) == 3
    assert q(1) == Decision(False, (False,))  # forgotten: a first sight again
    assert q(9, 7) == ADMIT_ALL


def test_second_sight_per_chunk_below_min_seen():
    p = SecondSight(ghost_chunks=100, min_seen_chunks=2)
    assert p.decide(AdmissionQuery(0, (1, 2))) == Decision(False, (False, False))
    d = p.decide(AdmissionQuery(0, (1, 5)))  # one chunk seen: that chunk only
    assert d == Decision(False, (True, False))
    assert [d.admits(i) for i in range(4)] == [True, False, False, False]
    assert d.refused(0, 4) == (1, 2, 3) and d.uniform is None
    assert p.decide(AdmissionQuery(0, (1, 5, 8))) == ADMIT_ALL


def test_decision_refused_ranges():
    assert ADMIT_ALL.refused(2, 6) == ()
    assert REFUSE_ALL.refused(2, 6) == (2, 3, 4, 5)
    assert Decision(True, (False, True)).refused(0, 3) == (0,)


# ------------------------------------------------------------------ the shared tier, through the same objects


def _old_shares(opts, cached_tokens: int, chunk: int) -> bool:
    """The rule `SchedulerSide._shares` applied before the admission objects (kept here as the reference)."""
    if opts is None or opts.writes == "all":
        return True
    if opts.writes == "none":
        return False
    return cached_tokens // chunk >= opts.min_history_chunks


def test_shared_writes_unchanged_through_the_policy_objects():
    from kvtier.connector.scheduler_admission import WriteAdmission

    chunk = 256
    cases = [None] + [SharedTierOptions(writes=w, min_history_chunks=m) for w in ("all", "continuing", "none")
                      for m in (0, 1, 2, 3)]
    for opts in cases:
        adm = WriteAdmission(opts, None, chunk)
        for cached in (0, 1, 255, 256, 511, 512, 767, 768, 1200):
            st = SimpleNamespace(share=None, ssd_admission=None)
            adm.admit(st, cached, lambda: ())
            assert st.share is _old_shares(opts, cached, chunk), (opts, cached)
            assert st.ssd_admission == ADMIT_ALL  # the SSD default: every chunk written
    assert shared_policy(SharedTierOptions(writes="continuing", min_history_chunks=3)).min_history_chunks == 3


def test_scheduler_refuses_per_save_and_decides_the_ssd_once():
    from kvtier.connector.metrics import kvtier_samples
    from kvtier.connector.scheduler_admission import WriteAdmission

    adm = WriteAdmission(None, AdmissionOptions(policy="second-sight"), 256)
    before = kvtier_samples()
    first = SimpleNamespace(share=None, ssd_admission=None)
    adm.admit(first, 0, lambda: [11, 12])
    assert first.share is True and adm.refused(first, 0, 1024) == (0, 1, 2, 3)
    adm.admit(first, 0, lambda: [11, 12])  # admitted again (resumed): its own keys are no second sight
    assert adm.refused(first, 1024, 1536) == (4, 5)
    second = SimpleNamespace(share=None, ssd_admission=None)
    adm.admit(second, 512, lambda: [11, 12, 13])
    assert adm.refused(second, 512, 1280) == ()
    after = kvtier_samples()
    diff = {k: after.get(k, 0) - before.get(k, 0) for k in after if k.startswith("kvtier_ssd_admission_chunks_total")}
    assert diff == {"kvtier_ssd_admission_chunks_total/decision=refused": 6,
                    "kvtier_ssd_admission_chunks_total/decision=admitted": 3}


def test_save_spec_carries_the_refusals_typed():
    from kvtier.connector.messages import SaveSpec

    spec = SaveSpec("r", [1] * 512, [0], 0, ssd_refused=(0, 1))
    assert spec.ssd_refused == (0, 1) and SaveSpec("r", [], [], 0).ssd_refused == ()


# ------------------------------------------------------------------ the worker's hand-over to the plugin


def test_refused_keys_are_taken_once_and_bounded():
    g = RefusedKeys(capacity=2)
    g.refuse(["a", "b", "c"])
    assert len(g) == 2 and not g.take("a") and g.take("b") and not g.take("b") and g.take("c")
    assert not g.take("x")


class _Obj:
    def __init__(self) -> None:
        self.refs = 0
        self.metadata = SimpleNamespace(cached_positions=None)
        self.byte_array = b"x"

    def ref_count_up(self) -> None:
        self.refs += 1

    def ref_count_down(self) -> None:
        self.refs -= 1

    def get_size(self) -> int:
        return 1

    def get_shape(self):
        return (1,)

    def get_dtype(self):
        return "torch.uint8"

    def get_memory_format(self):
        return SimpleNamespace(name="KV_2TD")


def test_plugin_put_skips_the_refused_chunks():
    pytest.importorskip("lmcache", reason="the LMCache plugin")
    from kvtier.storage_backends.lmcache.backend import KVTierBackend

    submitted: list[str] = []
    plugin = KVTierBackend.__new__(KVTierBackend)
    plugin.local_first = None
    plugin.refused = RefusedKeys()
    plugin.tier = SimpleNamespace(submit_puts=lambda puts: [submitted.extend(p[0] for p in puts)] and
                                  [True] * len(puts))
    keys = [SimpleNamespace(to_string=lambda s=s: s) for s in ("k0", "k1", "k2")]
    objs = [_Obj(), _Obj(), _Obj()]
    plugin.refused.refuse(["k1"])
    plugin.batched_submit_put_task(keys, objs)
    assert submitted == ["k0", "k2"]
    assert [o.refs for o in objs] == [1, 0, 1]  # the refused chunk is never held for a write
    assert len(plugin.refused) == 0


# ------------------------------------------------------------------ replay


CHAINS = [[1, 2], [1, 2, 3], [4, 5], [1, 6]]


def _replay(admission: str) -> dict:
    from kvtier.replay.runner import ReplayClock, simulate
    from kvtier.replay.traces import TraceRequest
    from kvtier.storage_backends.eviction import make_policy as make_eviction

    reqs = [TraceRequest(i, float(i), tuple(c), 512 * len(c), 10, 0, None, 1) for i, c in enumerate(CHAINS)]
    clock = ReplayClock()
    return simulate(reqs, make_eviction("lru", clock=clock), 3, clock=clock, admission=make_policy(admission))


def test_replay_counts_on_a_crafted_trace():
    # host LRU of 3 blocks, unbounded SSD. all: r0 writes 1, 2 | r1 hits 1, 2, writes 3 | r2 writes 4, 5 (evicting
    # 1, 2) | r3 reads 1 from SSD, writes 6
    base = {"accesses": 9, "host_hits": 2, "host_evictions": 4}
    assert _replay("all") == {**base, "ssd_hits": 1, "misses": 6, "ssd_writes": 6, "ssd_refused": 0}
    # second-sight: r0 first sight (refused) | r1 continues 1, 2: 3 written | r2 first sight | r3 key 1 seen: 1, 6
    # written (1 is a miss: it was never on SSD)
    assert _replay("second-sight") == {**base, "ssd_hits": 0, "misses": 7, "ssd_writes": 3, "ssd_refused": 4}
    # continuing (2 chunks cached at arrival): only r1 (1, 2 in host)
    assert _replay("continuing") == {**base, "ssd_hits": 0, "misses": 7, "ssd_writes": 1, "ssd_refused": 6}
    assert _replay("none") == {**base, "ssd_hits": 0, "misses": 7, "ssd_writes": 0, "ssd_refused": 7}


def test_replay_table_prints_bytes_written_per_hit():
    from kvtier.replay.runner import Capacity, format_admission, replay_one
    from kvtier.replay.traces import TraceRequest

    reqs = [TraceRequest(i, float(i), tuple(c), 512 * len(c), 10, 0, None, 1) for i, c in enumerate(CHAINS)]
    rows = [replay_one(reqs, "lru", Capacity("3blocks", 3, None), ssd_admission=a) for a in ("all", "none")]
    assert [(r.ssd_writes, r.ssd_hits, r.ssd_refused) for r in rows] == [(6, 1, 0), (0, 0, 7)]
    table = format_admission(rows, 1_000_000).splitlines()
    assert table[2].split() == ["lru", "3blocks", "all", "6", "0.006", "1", "6.00"]
    assert table[3].split() == ["lru", "3blocks", "none", "0", "0.000", "0", "-"]


def test_check_config_reports_the_policy_and_names_a_bad_key(lmcache_yaml):
    pytest.importorskip("lmcache", reason="check-config loads the YAML as LMCache does")
    from kvtier.cli.check_config import check

    assert "SSD admission all," in check(lmcache_yaml())
    assert "SSD admission second-sight," in check(lmcache_yaml(ssd_admission={"policy": "second-sight"}))
    with pytest.raises(ConfigError, match=r"kvtier\.ssd_admission\.ghost_chunks must be an integer >= 1"):
        check(lmcache_yaml(ssd_admission={"policy": "second-sight", "ghost_chunks": 0}))


def test_the_connector_reads_the_section_inline_over_the_yaml(lmcache_yaml):
    pytest.importorskip("lmcache", reason="the connector's config loads the YAML as LMCache does")
    from kvtier.connector.config import load_connector_config

    path = lmcache_yaml(ssd_admission={"policy": "continuing"})
    assert load_connector_config({"config_file": path}, 16, prepare_dir=False).ssd_admission.policy == "continuing"
    inline = {"config_file": path, "kvtier.ssd_admission": {"policy": "none"}}
    assert load_connector_config(inline, 16, prepare_dir=False).ssd_admission.policy == "none"
    assert load_connector_config({"config_file": lmcache_yaml()}, 16, prepare_dir=False).ssd_admission.policy == "all"
    with pytest.raises(ConfigError, match=r"kvtier\.ssd_admission\.policy must be one of"):
        load_connector_config({"config_file": path, "kvtier.ssd_admission": {"policy": "lru"}}, 16, prepare_dir=False)


def test_the_worker_names_the_refused_chunks_keys_before_the_save():
    from kvtier.connector.messages import KVTierConnectorMetadata, SaveSpec
    from kvtier.connector.worker_side import WorkerSide

    w = WorkerSide.__new__(WorkerSide)
    w.cfg = SimpleNamespace(chunk_size=2)
    w._held = set()
    w._ssd_refused = RefusedKeys()
    asked: list[tuple[list[int], str]] = []

    def chunks(tokens, tag=""):
        asked.append((list(tokens), tag))
        return [(0, 2, SimpleNamespace(to_string=lambda: "a")), (2, 4, SimpleNamespace(to_string=lambda: "b")),
                (4, 6, SimpleNamespace(to_string=lambda: "c"))]

    w._chunks = chunks
    md = KVTierConnectorMetadata(saves=[SaveSpec("r", [1] * 6, [0], 2, ssd_refused=(1, 2), tag="t"),
                                        SaveSpec("s", [2] * 6, [0], 0)])
    w.bind(md)
    assert asked == [([1] * 6, "t")]  # a save without refusals costs no key derivation
    assert not w._ssd_refused.take("a") and w._ssd_refused.take("b") and w._ssd_refused.take("c")
