"""LMCache's own MP client against a running `lmcache server` (`kvtier.launch.lmcache_server.MPServer`), for tests
and benchmarks: seeded KV stored and retrieved, checked by checksums."""

from __future__ import annotations

from kvtier.launch.lmcache_server import MPServer


class BenchClient:
    """LMCache's own MP client (`lmcache bench server`'s `ServerBenchClient`, CPU, engine-driven transfers):
    seeded KV tensors in this process, stored into and retrieved from a running server, checked by checksums."""

    def __init__(self, server: MPServer, spec: str = "(2,1024,16,2,64):float32:2", num_tokens: int = 1024,
                 num_blocks: int = 1024, block_size: int = 16) -> None:
        from lmcache.cli.commands.bench.server_bench.client import ServerBenchClient
        from lmcache.cli.commands.bench.server_bench.config import BenchConfig

        cfg = BenchConfig(rpc_url=server.rpc_url, http_url=server.url, mode="cpu", transfer_mode="engine_driven",
                          tp_size=1, use_mla=False, num_tokens=num_tokens, kvcache_shape_spec=spec,
                          num_blocks=num_blocks, block_size=block_size)
        self.client = ServerBenchClient(cfg, log=lambda msg: None)
        self.client.start()
        self._n = 0

    def _request(self, seq: int, kind: str):
        self._n += 1
        return self.client.create_request(seq, f"seq{seq}-{kind}-{self._n}", kind)

    def store(self, seq: int) -> tuple[int, bool]:
        """Look a sequence up and store what was missing; returns (hit chunks, store succeeded)."""
        r = self._request(seq, "cold")
        hit = self.client.lookup(r).hit_chunks
        ok = True
        if hit < r.total_chunks:
            res = self.client.store(r, hit * r.chunk_size, r.num_full_tokens - hit * r.chunk_size)
            ok = bool(res and res.succeeded)
        self.client.end_session(r)
        return hit, ok

    def fetch(self, seq: int) -> tuple[int, int, bool]:
        """Look a sequence up and retrieve its hit prefix into zeroed blocks; returns (hit chunks, total chunks,
        every retrieved chunk bit-exact with the seeded data)."""
        r = self._request(seq, "warm")
        expect = self.client.compute_checksums(r, 0, r.num_full_tokens)
        hit = self.client.lookup(r).hit_chunks
        exact = True
        if hit:
            self.client.zero_destination(r, 0, hit * r.chunk_size)
            res = self.client.retrieve(r, 0, hit * r.chunk_size)
            got = self.client.compute_checksums(r, 0, hit * r.chunk_size)
            exact = bool(res and res.succeeded) and got == expect[:hit]
        self.client.end_session(r)
        return hit, r.total_chunks, exact

    def close(self) -> None:
        self.client.close()
