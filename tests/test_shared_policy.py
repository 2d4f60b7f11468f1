"""The REMOTE tier state (KV only in the tier shared by several engines): tier hints, the connector's lookup
combination, and the scheduling policies treating it like SSD-resident KV (plain Python, no engine)."""

from __future__ import annotations

from kvtier.connector.messages import LookupResult
from kvtier.scheduler_hooks.dual_queue_policy import DualQueuePolicy, make_scheduling_policy
from kvtier.scheduler_hooks.hrrn import GiB
from kvtier.scheduler_hooks.tier_hint import TierHint, TierState, classify

MiB = 1 << 20


def remote(rid: str, arrival: float, nbytes: int, ssd_bytes: int = 0) -> TierHint:
    return TierHint(rid, host_tokens=64, ssd_tokens=32 if ssd_bytes else 0, ssd_bytes=ssd_bytes,
                    remote_tokens=max(nbytes // (128 * 1024), 1), remote_bytes=nbytes,
                    state=TierState.REMOTE, arrival=arrival)


def ready(rid: str, arrival: float) -> TierHint:
    return TierHint(rid, host_tokens=512, state=TierState.READY, arrival=arrival)


def test_remote_state_classified_and_sized():
    assert classify(0, 64, 0, remote_tokens=32) is TierState.REMOTE
    assert classify(0, 64, 32, remote_tokens=32) is TierState.REMOTE
    assert classify(0, 64, 0, remote_tokens=32, loading=True) is TierState.LOADING
    assert classify(0, 64, 32) is TierState.PREPARING  # unchanged without shared tokens
    h = remote("r", 1.0, 8 * MiB, ssd_bytes=2 * MiB)
    assert h.needs_remote and h.prefetch_bytes == 10 * MiB and h.cached_tokens == 64 + 32 + h.remote_tokens
    assert not TierState.REMOTE.schedulable and TierState.REMOTE.waits_for_prefetch
    # hints built without the new fields (older callers) are unchanged
    assert TierHint("x", ssd_tokens=4, ssd_bytes=100).prefetch_bytes == 100


def test_lookup_results_combine_remote_tokens_over_ranks():
    a = LookupResult(host_end=64, hit_end=192, ssd_tokens=64, ssd_bytes=2, chunk_size=32, remote_tokens=64,
                     remote_bytes=2)
    b = LookupResult(host_end=64, hit_end=160, ssd_tokens=32, ssd_bytes=1, chunk_size=32, remote_tokens=64,
                     remote_bytes=2)
    c = LookupResult.combine([a, b])
    assert (c.hit_end, c.ssd_tokens, c.remote_tokens) == (160, 64, 32)  # never more than the shortest rank's hit
    assert c.prefetch_tokens == 96
    assert LookupResult.from_dict(a.to_dict()) == a
    assert LookupResult.from_dict({"host_end": 1, "hit_end": 2}).remote_tokens == 0  # older workers' answers


def test_remote_request_prefetched_in_hrrn_order_without_blocking_ready_ones():
    p = DualQueuePolicy()
    p.add(remote("big", 1.0, GiB), 1)
    p.add(remote("small", 1.0, 8 * MiB), 1)
    p.add(ready("r", 2.0), 1)
    assert sorted(p.preparing_ids(3.0)) == ["big", "small"]
    assert p.pick(3.0) == "r"  # the host-resident request is not held up by the shared-tier reads
    p.dispatched("r", 3.0)
    assert p.pick(3.0) is None
    assert p.next_prefetch(3.0) == "small"  # same wait, smaller read: higher response ratio
    assert p.hint("small").state is TierState.LOADING
    p.prefetch_done("small", 4.0)
    h = p.hint("small")
    assert h.state is TierState.READY and h.host_tokens == 64 + remote("x", 0, 8 * MiB).remote_tokens
    assert p.pick(4.0) == "small"


def test_fcfs_prefetch_baseline_also_prefetches_remote_requests():
    f = make_scheduling_policy("fcfs+prefetch")
    f.add(remote("s", 1.0, GiB), 1)
    assert f.pick(2.0) is None and f.next_prefetch(2.0) == "s"


def test_shipped_redis_config_checks_and_a_bad_shared_key_is_named(tmp_path):
    import pytest

    from kvtier.cli.check_config import check
    from kvtier.storage_backends.config import ConfigError

    repo = __import__("pathlib").Path(__file__).resolve().parent.parent
    text = (repo / "configs" / "lmcache-kvtier-redis.yaml").read_text().replace("/var/cache/kvtier",
                                                                              str(tmp_path / "ssd"))
    good = tmp_path / "good.yaml"
    good.write_text(text)
    assert "shared store redis://127.0.0.1:6379 (writes: all" in check(str(good))
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace("writes: all ", "write: all "))
    with pytest.raises(ConfigError, match=r"kvtier\.shared\.write \(did you mean kvtier\.shared\.writes\?\)"):
        check(str(bad))
    bad.write_text(text.replace("on_unavailable: fail", "on_unavailable: maybe"))
    with pytest.raises(ConfigError, match=r"kvtier\.shared\.on_unavailable must be fail or degrade"):
        check(str(bad))
