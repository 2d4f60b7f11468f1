"""The storage RPC between the connector's scheduler side and its worker side(s): its messages and its transport.

vLLM only carries scheduler -> worker data once per engine step (the connector metadata), but tier lookups must
be answered when a request arrives and prefetches must start immediately. So each worker rank serves a small
request/reply endpoint (ZeroMQ REP over an `ipc://` socket named after vLLM's `engine_id` and the rank), and the
scheduler side keeps one REQ socket per rank. It works the same whether scheduler and worker share a process
(vLLM's single-process executor) or not. Every call has a timeout, after which the socket is rebuilt and the caller
treats the answer as a miss.

Messages are typed msgspec structs sent as msgpack. A request is one of the `Request` subclasses below (a tagged
union, `AnyRequest`, which the server decodes); `Request[R]` is answered by a reply of type `R`:

    Ping     -> PingReply    rank and chunk size
    Lookup   -> LookupReply  where a token prefix lives (`LookupResult`); carries finished requests' feedback
    Prefetch -> Ack          start reading a request's SSD / shared-tier chunks into host memory
    Poll     -> PollReply    prefetches that ended since the last poll (`PrefetchResult` per request)
    Release  -> Ack          drop a request's host-memory pins (and its prefetch, if any)
    Flush    -> Ack          queued saves and SSD / shared writes landed (`ok`: within the timeout)
    Stats    -> StatsReply   the rank's storage counters

A handler that raises answers `Failed`; the client turns it (and a timeout, a malformed or a mismatched reply)
into `RPCError`, naming each rank.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
import time
import typing
from collections.abc import Callable
from typing import Any, ClassVar, Generic, TypeVar

import msgspec
import zmq

from kvtier.connector.messages import FinishedSpec, LookupResult, PrefetchResult

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------- replies
class Reply(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """A worker rank's answer to one request (the tag names its type on the wire)."""


class Ack(Reply, tag="ack"):
    ok: bool = True


class PingReply(Reply, tag="pong"):
    rank: int
    chunk_size: int


class LookupReply(Reply, tag="found"):
    result: LookupResult


class PollReply(Reply, tag="polled"):
    #: request -> outcome of its prefetch on this rank (each reported once)
    done: dict[str, PrefetchResult] = {}


class StatsReply(Reply, tag="stats"):
    ssd: dict[str, Any]  # the SSD tier's counters (`TierStats.as_dict`)
    ssd_chunks: int
    host_chunks: int
    ssd_policy: dict[str, Any]  # the SSD eviction policy's name and counters
    shared: dict[str, Any] | None = None  # the shared tier's counters, if there is one


class Failed(Reply, tag="error"):
    """The handler raised (or the request could not be decoded): `error` says what."""

    error: str


R = TypeVar("R", bound=Reply)


# ---------------------------------------------------------------------------------------------------- requests
class Request(msgspec.Struct, Generic[R], tag=True, omit_defaults=True, gc=False, kw_only=True):
    """A call to every worker rank; `Request[R]` is answered by an `R` (`reply`, read from the class's base)."""

    reply: ClassVar[type[Reply]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for base in getattr(cls, "__orig_bases__", ()):
            if typing.get_origin(base) is Request:
                cls.reply = typing.get_args(base)[0]


class Ping(Request[PingReply], tag="ping"):
    pass


class Lookup(Request[LookupReply], tag="lookup"):
    rid: str
    tokens: list[int]  # key tokens (`RequestIdentity.key_tokens`)
    tag: str = ""  # the request's identity tag
    pin: bool = False  # pin the host-resident prefix for the request (until its load or release)
    first: bool = False  # the request's first lookup (it arrived): the eviction policies hear of it
    #: requests finished since the last engine step, sent ahead of a new request's first lookup
    finished: list[FinishedSpec] = []


class Prefetch(Request[Ack], tag="prefetch"):
    rid: str
    tokens: list[int]  # key tokens
    tag: str = ""  # the request's identity tag


class Poll(Request[PollReply], tag="poll"):
    rids: list[str]


class Release(Request[Ack], tag="release"):
    rid: str


class Flush(Request[Ack], tag="flush"):
    timeout: float = 60.0


class Stats(Request[StatsReply], tag="stats"):
    pass


#: every request a worker rank serves (the server decodes this union)
AnyRequest = Ping | Lookup | Prefetch | Poll | Release | Flush | Stats
#: every reply a client may read
AnyReply = Ack | PingReply | LookupReply | PollReply | StatsReply | Failed

Handler = Callable[[Request[Any]], Reply]  # called with one of AnyRequest's types


def endpoint(engine_id: str, rank: int) -> str:
    base = os.environ.get("KVTIER_RPC_DIR") or tempfile.gettempdir()
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in str(engine_id))[:80]
    return f"ipc://{os.path.join(base, f'kvtier-{safe}-r{rank}.ipc')}"


class RPCServer:
    """Serves `handler(request) -> reply` on a daemon thread until `close()`."""

    def __init__(self, address: str, handler: Handler) -> None:
        self.address = address
        self.handler = handler
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        path = address[len("ipc://"):] if address.startswith("ipc://") else None
        if path and os.path.exists(path):
            os.unlink(path)  # a stale socket file from a crashed run
        self._sock.bind(address)
        self._stop = threading.Event()
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(AnyRequest)
        self._thread = threading.Thread(target=self._loop, name="kvtier-rpc", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not dict(poller.poll(100)):
                continue
            try:
                req = self._dec.decode(self._sock.recv())
            except Exception as e:  # pragma: no cover - malformed message
                logger.exception("kvtier rpc: cannot decode a request")
                self._sock.send(self._enc.encode(Failed(f"bad request: {e}")))
                continue
            self._sock.send(self._answer(req))
        self._sock.close(0)

    def _answer(self, req: Request[Any]) -> bytes:
        """The encoded reply to `req`: the handler's, or `Failed` when it raises or returns no reply."""
        try:
            rep = self.handler(req)
            if not isinstance(rep, Reply):
                raise TypeError(f"the handler answered {type(rep).__name__}, not a Reply")
            return self._enc.encode(rep)
        except Exception as e:
            logger.exception("kvtier rpc: %s failed", type(req).__name__)
            return self._enc.encode(Failed(f"{type(e).__name__}: {e}"))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        path = self.address[len("ipc://"):] if self.address.startswith("ipc://") else None
        if path and os.path.exists(path):
            with contextlib.suppress(OSError):
                os.unlink(path)


class RPCError(RuntimeError):
    pass


class RPCClient:
    """One REQ socket per worker rank; `call` asks every rank and returns their replies in rank order."""

    def __init__(self, addresses: list[str], timeout_s: float) -> None:
        self.addresses = addresses
        self.timeout_ms = int(timeout_s * 1000)
        self._ctx = zmq.Context.instance()
        self._socks: list[zmq.Socket | None] = [None] * len(addresses)
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(AnyReply)

    def _sock(self, i: int) -> zmq.Socket:
        s = self._socks[i]
        if s is None:
            s = self._ctx.socket(zmq.REQ)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(self.addresses[i])
            self._socks[i] = s
        return s

    def _reset(self, i: int) -> None:
        """Drop rank i's socket: a REQ socket whose reply was not read (or that failed) cannot be used again."""
        s = self._socks[i]
        self._socks[i] = None
        if s is not None:
            with contextlib.suppress(zmq.ZMQError):
                s.close(0)

    def call(self, req: Request[R], timeout_ms: int | None = None) -> list[R]:
        """Send `req` to every rank and return their replies in rank order. Every reply is read (or its socket
        rebuilt) before this returns, whatever the others answered, so one rank's error or silence never leaves
        a socket out of step for the next call. Raises RPCError only, naming each rank that failed."""
        data = self._enc.encode(req)
        wait_ms = self.timeout_ms if timeout_ms is None else timeout_ms
        n = len(self.addresses)
        errors: list[str] = []
        sent = [False] * n
        for i in range(n):
            try:
                self._sock(i).send(data)
                sent[i] = True
            except zmq.ZMQError as e:
                self._reset(i)
                errors.append(f"rank {i} at {self.addresses[i]}: cannot send ({e})")
        replies: list[Any] = [None] * n
        deadline = time.monotonic() + wait_ms / 1000
        for i in range(n):
            if not sent[i]:
                continue
            s = self._socks[i]
            try:
                left = max(0, int((deadline - time.monotonic()) * 1000))
                if not s.poll(left, zmq.POLLIN):  # type: ignore[union-attr]
                    self._reset(i)
                    errors.append(f"no answer from rank {i} at {self.addresses[i]} within {wait_ms / 1000:.1f} s")
                    continue
                rep = self._dec.decode(s.recv())  # type: ignore[union-attr]
            except (zmq.ZMQError, msgspec.DecodeError) as e:
                self._reset(i)
                errors.append(f"rank {i} at {self.addresses[i]}: {type(e).__name__}: {e}")
                continue
            if isinstance(rep, Failed):
                errors.append(f"rank {i} failed: {rep.error}")
            elif not isinstance(rep, req.reply):
                errors.append(f"rank {i}: {type(rep).__name__} is no answer to {type(req).__name__}")
            else:
                replies[i] = rep
        if errors:
            raise RPCError("kvtier storage side: " + "; ".join(errors))
        return replies

    def close(self) -> None:
        for s in self._socks:
            if s is not None:
                s.close(0)
        self._socks = [None] * len(self.addresses)
