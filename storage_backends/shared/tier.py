"""`SharedTier`: kvtier's use of LMCache's remote backend (Redis, Valkey, Mooncake store, ...) as a tier shared by
several engines, behind the engine's own host and SSD tiers.

LMCache builds the remote backend from its own settings (`remote_url` or `remote_storage_plugins`, every URL scheme
it speaks). LMCache 0.5.6 builds and walks its backends in a fixed order (host, ..., remote, then storage plugins),
so a chunk held both on kvtier's SSD and in the store would be read over the network. The kvtier connector
therefore takes the remote backend out of LMCache's own walk (`StorageManager.set_backend_bypass`, LMCache's switch
for skipping a backend) and uses it here, in kvtier's order: host, SSD, then the store. In engines kvtier's connector
does not build (vLLM's `LMCacheConnectorV1`), kvtier's storage plugin moves itself ahead of the remote backends
(`storage_backends/lmcache/backend_order.py`), so that LMCache's own walk reads host, SSD, then the store.

What this layer adds to LMCache's remote backend:
- **Keys** carry the engine's KV fingerprint (the weights' content, config, dtypes, chunk size: the connector's
  LMCache model name), the world size and rank, the request's identity tag (LMCache's key and its tags) and
  kvtier's chunk layout (`key_tag`: page size, chunk size, KV geometry), so engines of another build, tenants of
  another salt and engines of another layout never read each other's chunks. Every
  chunk read is also checked against this engine's layout (`layout_ok`) before it reaches the host tier.
- **Faults**: every operation has a time limit (an error other than a timeout is retried once: the client
  replaces a pooled connection broken by a store restart); a store that fails is marked down (`StoreHealth`:
  logged once, counted), skipped without network waits while down, probed every `retry_s`, and used again once it
  answers. Failures are misses: the request recomputes, never wrong KV, never an exception into the engine.
- **Writes** never run on the forward path: `submit_writes` takes a reference on each chunk in the host tier and
  queues it (bounded by `max_queued_write_mb`, beyond which writes are dropped and counted); a writer thread sends
  them. Which chunks are written is the connector's policy (`kvtier.shared.writes`).
- **Counters and metrics** (`kvtier_shared_*`).
- **Encryption** (`kvtier.encryption_key_file`): chunks go to the store sealed, as envelopes (`shared/sealed.py`),
  under keys that name the secret's id (a replica without it, or with another, finds none of them).

What this needs of LMCache's internals (the remote backend, its connector, the manager's list) it reaches through
`storage_backends/lmcache/engine_access.py`.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.storage_backends.base import ChunkMeta, HostTier
from kvtier.storage_backends.config import ConfigError
from kvtier.storage_backends.lmcache.engine_access import (
    bypass_backend,
    close_store_client,
    drop_backend,
    find_host_tier,
    remote_backends,
    remote_serde,
    stage_reads_without_waiting,
    store_client,
    store_name,
)
from kvtier.storage_backends.shared import metrics as M
from kvtier.storage_backends.shared.config import SharedTierOptions
from kvtier.storage_backends.shared.health import StoreHealth
from kvtier.storage_backends.shared.sealed import open_envelope, seal_envelope
from kvtier.storage_backends.ssd.sealing import ChunkSealer

logger = logging.getLogger(__name__)

#: errors a bad chunk raises inside a connector (wrong sizes, undecodable metadata): that chunk is a miss, the
#: store stays up; anything else counts as the store failing
_DATA_ERRORS = (ValueError, TypeError, AssertionError, KeyError, IndexError)


@dataclass
class SharedStats:
    lookups: int = 0  #: prefix lookups that asked the store
    found: int = 0  #: chunks the store held (lookups)
    hits: int = 0  #: chunks read into the host tier
    misses: int = 0  #: chunks asked for and not delivered (absent, layout, bad, error)
    layout_mismatch: int = 0
    bad_chunks: int = 0
    writes: int = 0  #: chunks written
    write_bytes: int = 0
    read_bytes: int = 0
    dropped_writes: int = 0
    queued_writes: int = 0  #: chunks handed to the writer

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def attach_shared_tier(engine: Any, layout_ok: Callable[[ChunkMeta], bool], key_tag: str,
                       options: SharedTierOptions, sealer: ChunkSealer | None = None) -> SharedTier | None:
    """The engine's remote backend as kvtier's shared tier, or None when the LMCache config names no store.

    The remote backend leaves LMCache's own walk (kvtier routes host, SSD, then the store itself) and the store is
    probed (`SharedTier.start`: a ConfigError if it does not answer, unless `on_unavailable: degrade`)."""
    found = remote_backends(engine)
    if not found:
        return None
    if len(found) > 1:
        raise ConfigError(f"kvtier.shared: LMCache has {len(found)} remote backends ({', '.join(n for n, _ in found)});"
                          " kvtier uses one shared store: keep one of remote_url / remote_storage_plugins")
    name, remote = found[0]
    serde = remote_serde(engine)
    if serde not in (None, "naive"):
        raise ConfigError(f"kvtier.shared: remote_serde is {serde!r}; kvtier stores chunks as they are in host "
                          "memory (it checks their layout on every read): set remote_serde: naive")
    host = find_host_tier(engine)
    if host is None:
        raise ConfigError("kvtier.shared needs LMCache's host tier (local_cpu: true) to stage shared chunks")
    bypass_backend(engine, name)  # kvtier, not LMCache's walk, decides when to use it

    def detach() -> None:  # LMCache then never calls the backend's close (see SharedTier.close)
        drop_backend(engine, name)

    tier = SharedTier(remote, host, layout_ok, key_tag, options, detach=detach, sealer=sealer)
    tier.start()
    return tier


def detach_remote_backends(engine: Any) -> int:
    """Close every LMCache RemoteBackend of an engine kvtier's way and take it out of the engine's backends, so
    that closing the engine does not hang in LMCache 0.5.6's Redis `close()`; returns how many. For engines
    built by other code (tests, tools); kvtier's connector does this through `SharedTier.close`."""
    found = remote_backends(engine)
    for name, remote in found:
        close_store_client(remote)
        drop_backend(engine, name)
    return len(found)


class SharedTier:
    """One engine rank's view of the shared store (see the module docstring)."""

    def __init__(self, remote: Any, host: HostTier, layout_ok: Callable[[ChunkMeta], bool], key_tag: str,
                 options: SharedTierOptions, *, name: str | None = None,
                 detach: Callable[[], None] | None = None, sealer: ChunkSealer | None = None) -> None:
        self.remote = remote
        self._detach = detach
        self.host = host
        self.layout_ok = layout_ok
        self.key_tag = key_tag
        self.options = options
        self.sealer = sealer  #: chunks go to the store sealed (None: as they are)
        self.name = name or store_name(remote)
        self.stats = SharedStats()
        self.health = StoreHealth(self.name, options.retry_s, on_change=lambda up: M.UP.set(1 if up else 0))
        self._loop = remote.loop
        inner = store_client(remote)
        if inner is not None:
            stage_reads_without_waiting(inner, host)
        self._inner = inner  # writes go to the connector itself: its instrumented wrapper swallows put errors
        self._known: collections.OrderedDict[str, None] = collections.OrderedDict()  # remote keys seen in the store
        self._queue: collections.deque[tuple[Any, Any, int]] = collections.deque()
        self._queued_bytes = 0
        self._queue_full_episode = False  #: writes are being dropped for want of queue room (logged once)
        self._cv = threading.Condition()
        self._busy = 0
        self._closed = False
        self._writer = threading.Thread(target=self._write_loop, name="kvtier-shared-writer", daemon=True)
        self._writer.start()
        M.UP.set(1)

    # ------------------------------------------------------------------ start-up
    def start(self) -> None:
        """Probe the store; raises ConfigError if it does not answer (unless `on_unavailable: degrade`)."""
        err = None
        if self.remote.connection is None:
            err = "LMCache could not create its connection (see the log above)"
        else:
            try:
                self._run(self.remote.connection.exists(self._probe_key()))
            except Exception as e:  # noqa: BLE001 - whatever the store's client raises
                err = f"{type(e).__name__}: {e}"
        if err is None:
            logger.info("kvtier: shared store %s answers; key prefix %s, writes: %s", self.name,
                        self._remote_model("")[:120], self.options.writes)
            return
        if self.options.on_unavailable == "fail":
            self.close()
            raise ConfigError(
                f"kvtier.shared: the shared store {self.name} does not answer at start ({err}); start it or fix "
                "remote_url / remote_storage_plugin.<name>.*_url, or set kvtier.shared.on_unavailable: degrade to "
                "start with the local tiers only and use the store once it answers")
        self.health.mark_down(err, "start")

    # ------------------------------------------------------------------ keys
    def _remote_model(self, model_name: str) -> str:
        sealed = f"|s{self.sealer.key_id}" if self.sealer is not None else ""
        return f"kvtier2|{model_name}|{self.key_tag}{sealed}"

    def remote_key(self, key: Any) -> Any:
        """The key of an LMCache chunk key in the shared store (model, world size, rank, hash, dtype and tags of
        LMCache's key, plus kvtier's layout tag). In kvtier's connector the model is the engine's KV fingerprint and
        the tags carry the request's identity (`kvtier.identity`)."""
        return dataclasses.replace(key, model_name=self._remote_model(key.model_name))

    def _probe_key(self) -> Any:
        import torch
        from lmcache.utils import CacheEngineKey

        return CacheEngineKey(model_name="kvtier1|probe", world_size=1, worker_id=0, chunk_hash=0, dtype=torch.uint8)

    def _remember(self, rkey_str: str) -> None:
        self._known[rkey_str] = None
        self._known.move_to_end(rkey_str)
        while len(self._known) > 65536:
            self._known.popitem(last=False)

    # ------------------------------------------------------------------ running operations on LMCache's loop
    def _run(self, coro: Any, timeout: float | None = None) -> Any:
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout or self.options.timeout_s)
        except BaseException:
            fut.cancel()
            raise

    def _guarded(self, op: str, coro_factory: Callable[[], Any], timeout: float | None = None) -> tuple[bool, Any]:
        """(ok, result) of one store operation under the health state; a failure marks the store down."""
        if self.remote.connection is None or not self.health.attempt():
            return False, None
        # A pooled connection to a store that restarted fails once and is then replaced by the client: while the
        # store counts as up, a failure that is not a timeout is tried once more before the store is marked down.
        tries = 2 if self.health.up else 1
        for i in range(tries):
            try:
                out = self._run(coro_factory(), timeout)
            except _DATA_ERRORS as e:
                self.health.succeeded()
                raise _BadChunk(e) from e
            except Exception as e:  # noqa: BLE001 - connection refused, timeouts, the client's own errors
                if i + 1 < tries and not isinstance(e, TimeoutError):
                    continue
                self.health.failed(e, op)
                M.ERRORS.labels(op).inc()
                return False, None
            self.health.succeeded()
            return True, out
        return False, None

    @property
    def up(self) -> bool:
        return self.health.up

    # ------------------------------------------------------------------ lookups
    def prefix_contains(self, keys: Sequence[Any]) -> int:
        """How many leading chunks of `keys` (LMCache keys) the store holds; 0 while it is down."""
        if not keys:
            return 0
        conn = self.remote.connection
        rkeys = [self.remote_key(k) for k in keys]

        async def exists_all() -> list[bool]:
            return list(await asyncio.gather(*(conn.exists(k) for k in rkeys)))

        try:
            ok, found = self._guarded("lookup", exists_all)
        except _BadChunk:
            return 0
        if not ok:
            return 0
        n = 0
        for f in found:
            if not f:
                break
            n += 1
        self.stats.lookups += 1
        self.stats.found += n
        for k in rkeys[:n]:
            self._remember(k.to_string())
        return n

    # ------------------------------------------------------------------ reads
    def read(self, keys: Sequence[Any]) -> list[Any]:
        """Read chunks (LMCache keys, a prefix run) into new host-tier objects; None where a chunk is absent, of
        another layout, bad, or the store failed (and for every chunk after the first None: a prefix is only
        usable up to its first hole). The caller owns one reference of each object returned."""
        if not keys:
            return []
        conn = self.remote.connection
        rkeys = [self.remote_key(k) for k in keys]
        t0 = time.monotonic()

        async def get_all() -> list[Any]:
            res = await asyncio.gather(*(conn.get(k) for k in rkeys), return_exceptions=True)
            return list(res)

        try:
            ok, objs = self._guarded("read", get_all, timeout=self.options.timeout_s * max(1, len(keys) // 8 + 1))
        except _BadChunk:
            ok, objs = True, [None] * len(keys)
        if not ok:
            objs = [None] * len(keys)
        out: list[Any] = []
        hole = False
        for obj in objs:
            if isinstance(obj, BaseException):
                if not isinstance(obj, _DATA_ERRORS):
                    self.health.failed(obj, "read")
                    M.ERRORS.labels("read").inc()
                else:
                    self.stats.bad_chunks += 1
                    M.MISSES.labels("bad").inc()
                obj = None
            if obj is not None and self.sealer is not None:
                opened = open_envelope(self.sealer, rkeys[len(out)].to_string(), obj, self.host)
                obj.ref_count_down()
                if opened is None:
                    self.stats.bad_chunks += 1
                    M.MISSES.labels("bad").inc()
                obj = opened
            if obj is not None and not hole and not self._fits(obj):
                self.stats.layout_mismatch += 1
                M.MISSES.labels("layout").inc()
                obj.ref_count_down()
                obj = None
            if obj is None or hole:
                if obj is not None:
                    obj.ref_count_down()
                hole = True
                out.append(None)
                continue
            out.append(obj)
        got = sum(1 for o in out if o is not None)
        self.stats.hits += got
        self.stats.misses += len(out) - got
        nbytes = sum(o.get_size() for o in out if o is not None)
        self.stats.read_bytes += nbytes
        M.HITS.inc(got)
        if len(out) - got:
            M.MISSES.labels("absent" if ok else "unavailable").inc(len(out) - got)
        M.READ_BYTES.inc(nbytes)
        M.READ_SECONDS.observe(time.monotonic() - t0)
        return out

    def _fits(self, obj: Any) -> bool:
        try:
            meta = ChunkMeta(obj.get_size(), tuple(obj.get_shape()), str(obj.get_dtype()),
                             obj.get_memory_format().name, {})
            return bool(self.layout_ok(meta))
        except Exception:  # noqa: BLE001 - an object we cannot even describe is not ours
            return False

    # ------------------------------------------------------------------ writes
    def submit_writes(self, keys: Iterable[Any]) -> int:
        """Queue the host-tier chunks of `keys` (LMCache keys) for the store; returns how many were queued.
        Never blocks: chunks not in the host tier, already in the store, beyond the queue's memory bound, or met
        while the store is down are dropped (counted)."""
        cap = self.options.max_queued_write_mb << 20
        queued = 0
        for key in keys:
            rkey = self.remote_key(key)
            if rkey.to_string() in self._known:
                continue
            if not self.health.up:
                self._drop("store_down")
                continue
            obj = self.host.get_blocking(key)  # takes a reference: the chunk stays valid until written
            if obj is None:
                self._drop("not_in_host")
                continue
            size = obj.get_size()
            with self._cv:
                if self._queued_bytes + size > cap:
                    obj.ref_count_down()
                    self._drop("queue_full")
                    if not self._queue_full_episode:  # once per episode; the metric counts every chunk
                        self._queue_full_episode = True
                        logger.warning("kvtier: shared store writes fall behind: %d MiB queued, new writes are "
                                       "dropped (counted in kvtier_shared_dropped_writes_total{reason=\"queue_full\"}"
                                       "); raise kvtier.shared.max_queued_write_mb or use writes: continuing",
                                       self._queued_bytes >> 20)
                    continue
                if self._queue_full_episode:
                    self._queue_full_episode = False
                    logger.info("kvtier: shared store writes are queued again")
                self._queue.append((rkey, obj, size))
                self._queued_bytes += size
                self._cv.notify()
            queued += 1
        self.stats.queued_writes += queued
        M.QUEUED_BYTES.set(self._queued_bytes)
        return queued

    def _drop(self, reason: str) -> None:
        self.stats.dropped_writes += 1
        M.DROPPED_WRITES.labels(reason).inc()

    def _write_loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue and self._closed:
                    return
                batch: list[tuple[Any, Any, int]] = []
                while self._queue and len(batch) < 16:
                    batch.append(self._queue.popleft())
                self._busy += 1
            try:
                self._write_batch(batch)
            except Exception:  # noqa: BLE001 - the writer never dies
                logger.exception("kvtier: shared writes failed")
            finally:
                with self._cv:
                    self._busy -= 1
                    for _, _, size in batch:
                        self._queued_bytes -= size
                    self._cv.notify_all()
                M.QUEUED_BYTES.set(self._queued_bytes)

    def _write_batch(self, batch: list[tuple[Any, Any, int]]) -> None:
        inner = self._inner
        if inner is None or not self.health.attempt():
            for _, obj, _ in batch:
                obj.ref_count_down()
                self._drop("store_down")
            return
        t0 = time.monotonic()
        sent = [self._sealed(k, o) for k, o, _ in batch]

        async def put_all() -> list[Any]:
            return list(await asyncio.gather(*(inner.put(k, o) if o is not None else _unsealed()
                                               for (k, _, _), o in zip(batch, sent)), return_exceptions=True))

        fut = asyncio.run_coroutine_threadsafe(put_all(), self._loop)

        def release(_f: Any) -> None:  # only once the sends are over: the store reads the chunks' memory
            for (_, obj, _), env in zip(batch, sent):
                obj.ref_count_down()
                if env is not None and env is not obj:
                    env.ref_count_down()

        fut.add_done_callback(release)
        try:
            res = fut.result(self.options.timeout_s * max(1, len(batch) // 4 + 1))
        except Exception as e:  # noqa: BLE001 - timeout or the loop's own failure
            fut.cancel()
            self.health.failed(e, "write")
            M.ERRORS.labels("write").inc()
            for _ in batch:
                self._drop("store_down")
            return
        failed = None
        for (rkey, _obj, size), r in zip(batch, res):
            if isinstance(r, BaseException):
                if not isinstance(r, _DATA_ERRORS):
                    failed = r
                self._drop("error")
                continue
            self.stats.writes += 1
            self.stats.write_bytes += size
            M.WRITES.inc()
            M.WRITE_BYTES.inc(size)
            self._remember(rkey.to_string())
        if failed is not None:
            self.health.failed(failed, "write")
            M.ERRORS.labels("write").inc()
        else:
            self.health.succeeded()
        M.WRITE_SECONDS.observe(time.monotonic() - t0)

    def _sealed(self, rkey: Any, obj: Any) -> Any | None:
        """What is sent for a chunk: itself, or its sealed envelope (None: it could not be sealed)."""
        if self.sealer is None:
            return obj
        try:
            return seal_envelope(self.sealer, rkey.to_string(), obj, self.host)
        except Exception:  # noqa: BLE001 - that chunk is not sent
            logger.exception("kvtier: sealing a chunk for the shared store failed; not sent")
            return None

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued write was sent (or dropped)."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def as_dict(self) -> dict[str, Any]:
        return {"up": self.health.up, "name": self.name, **self.stats.as_dict(),
                "health": self.health.counters.as_dict(), "queued_bytes": self._queued_bytes}

    def close(self) -> None:
        """Send what is queued, then close the store's connection.

        LMCache 0.5.6's Redis connectors deadlock in their own `close()` (a coroutine on the backend's event loop
        that calls the blocking `AsyncPQExecutor.shutdown`, which waits for that same loop), so an engine with a
        `redis://` backend never finishes closing. kvtier closes those connections itself, from this thread, and
        takes the backend out of LMCache's list so that LMCache does not call that `close()` again; other
        connectors are closed through LMCache in a helper thread with a time limit."""
        if self._closed:
            return
        self.flush(10.0)
        with self._cv:
            self._closed = True
            pending = list(self._queue)
            self._queue.clear()
            self._cv.notify_all()
        for _, obj, _ in pending:
            obj.ref_count_down()
        self._writer.join(timeout=10.0)
        self._close_connection()
        if self._detach is not None:
            self._detach()

    def _close_connection(self) -> None:
        close_store_client(self.remote, self._inner, self._loop)


async def _unsealed() -> None:
    raise ValueError("the chunk could not be sealed (no host room for its envelope)")


class _BadChunk(Exception):
    """A data-level error inside the store's client (that chunk is unusable; the store is fine)."""
