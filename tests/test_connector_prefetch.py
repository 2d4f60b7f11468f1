"""SSD prefetches of two waiting requests that share chunks read each shared chunk from the SSD once.

The connector's worker role over real KV tensors and a real LMCache engine with kvtier's SSD tier (the
`Worker` harness of test_compat.py, vLLM's own factory and allocator): a 96-token prompt (3 chunks) is saved
and written to the SSD tier, the host tier is cleared, then two requests continuing that prompt are prefetched
at once (two prefetch threads). The first prefetch's SSD read is held at a gate until the second has either
issued its own read of the same chunks (the bug) or joined the first one's read; then the read goes on. Counted
exactly: chunks the SSD tier served (its own stats) and chunks asked of it, both 3 (not 6); both prefetches
report the whole prompt in host memory, pinned once for each request.
"""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("vllm")

from kvtier.tests.test_compat import (  # noqa: E402  (the real-connector harness)
    CHUNK,
    Worker,
    backend_class,
    declared_layouts,
    host_pin_counts,
    kv_cache_config_for,
    platform_backend,
    vllm_config_from_shipped_json,
)


def _wait(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.005)


def test_two_prefetches_of_shared_chunks_read_them_from_ssd_once(tmp_path, monkeypatch):
    from kvtier.connector.messages import KVTierConnectorMetadata, SaveSpec
    from kvtier.connector.rpc import Poll

    vllm_config = vllm_config_from_shipped_json(tmp_path, monkeypatch, async_saves=False, prefetch_concurrency=2)
    backend = platform_backend()
    layout = declared_layouts(backend_class(backend))[0]
    worker = Worker(vllm_config, kv_cache_config_for(vllm_config, layout), backend, layout)
    try:
        ws = worker.conn.worker_side
        prompt = [(5 * i + 11) % 1000 + 1 for i in range(3 * CHUNK)]
        blocks = list(range(1, 1 + 3 * CHUNK // 16))
        worker.write(blocks, 0, len(prompt), seed=4)
        worker.step(KVTierConnectorMetadata(saves=[SaveSpec("a", prompt, blocks, 0, job_id=1, share=False)]))
        assert ws.ssd.flush(30) and len(ws.ssd) == 3
        ws.host.clear()
        hits0 = ws.ssd.stats.hits

        asked: list[list] = []  # the chunks each SSD read asked for
        entered, go = threading.Event(), threading.Event()
        real_read = ws.ssd.read

        def gated_read(keys, **kw):
            asked.append(list(keys))
            entered.set()
            assert go.wait(30), "the test never opened the gate"
            return real_read(keys, **kw)

        ws.ssd.read = gated_read
        ws.storage.submit_prefetch("r1", prompt + [7] * 10)
        _wait(entered.is_set, "the first prefetch's SSD read")
        ws.storage.submit_prefetch("r2", prompt + [8] * 10)
        # the second prefetch either asks the SSD for the same chunks (held at the gate too) or waits for the
        # first one's read
        _wait(lambda: len(asked) > 1 or ws.stats.data.get("prefetch_shared_chunks", 0) >= 3,
              "the second prefetch to read or to join the first one's read")
        go.set()
        done: dict = {}

        def both_done() -> bool:
            done.update(ws.handle(Poll(rids=["r1", "r2"])).done)
            return len(done) == 2

        _wait(both_done, "both prefetches")
        assert sum(len(k) for k in asked) == 3, f"the SSD was asked for {[len(k) for k in asked]} chunks"
        assert ws.ssd.stats.hits - hits0 == 3
        for rid in ("r1", "r2"):
            assert done[rid].ok and done[rid].tokens == len(prompt), (rid, done[rid])
        assert host_pin_counts(worker, prompt) == [2, 2, 2]  # each request holds its own pin until its load
        assert ws.stats.data.get("prefetch_shared_chunks", 0) == 3
        ws.release("r1")
        ws.release("r2")
        assert host_pin_counts(worker, prompt) == [0, 0, 0]
        assert not ws.storage._reading  # nothing left registered as being read
    finally:
        worker.conn.shutdown()
