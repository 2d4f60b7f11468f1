"""The storage RPC between the connector's scheduler side and its worker side(s).

vLLM only carries scheduler -> worker data once per engine step (the connector metadata), but tier lookups must
be answered when a request arrives and prefetches must start immediately. So each worker rank serves a small
request/reply endpoint (ZeroMQ REP over an `ipc://` socket named after vLLM's `engine_id` and the rank), and the
scheduler side keeps one REQ socket per rank. It works the same whether scheduler and worker share a process
(vLLM's single-process executor) or not. Messages are msgpack dictionaries (msgspec); every call has a timeout,
after which the socket is rebuilt and the caller treats the answer as a miss.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from typing import Any, Callable

import msgspec
import zmq

logger = logging.getLogger(__name__)

Handler = Callable[[dict[str, Any]], dict[str, Any]]


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
        self._dec = msgspec.msgpack.Decoder()
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
            except Exception:  # pragma: no cover - malformed message
                logger.exception("kvtier rpc: cannot decode a request")
                self._sock.send(self._enc.encode({"error": "bad request"}))
                continue
            try:
                rep = self.handler(req)
            except Exception as e:
                logger.exception("kvtier rpc: %s failed", req.get("op"))
                rep = {"error": f"{type(e).__name__}: {e}"}
            self._sock.send(self._enc.encode(rep))
        self._sock.close(0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        path = self.address[len("ipc://"):] if self.address.startswith("ipc://") else None
        if path and os.path.exists(path):
            try:
                os.unlink(path)
            except OSError:
                pass


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
        self._dec = msgspec.msgpack.Decoder()

    def _sock(self, i: int) -> zmq.Socket:
        s = self._socks[i]
        if s is None:
            s = self._ctx.socket(zmq.REQ)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(self.addresses[i])
            self._socks[i] = s
        return s

    def call(self, msg: dict[str, Any], timeout_ms: int | None = None) -> list[dict[str, Any]]:
        data = self._enc.encode(msg)
        for i in range(len(self.addresses)):
            self._sock(i).send(data)
        out = []
        for i in range(len(self.addresses)):
            s = self._sock(i)
            if not s.poll(self.timeout_ms if timeout_ms is None else timeout_ms, zmq.POLLIN):
                for j in range(i, len(self.addresses)):  # a REQ socket without its reply is unusable: rebuild
                    if self._socks[j] is not None:
                        self._socks[j].close(0)  # type: ignore[union-attr]
                        self._socks[j] = None
                raise RPCError(f"no answer from the kvtier storage side at {self.addresses[i]} within "
                               f"{(timeout_ms or self.timeout_ms) / 1000:.1f} s")
            rep = self._dec.decode(s.recv())
            if "error" in rep:
                raise RPCError(f"kvtier storage side (rank {i}) failed: {rep['error']}")
            out.append(rep)
        return out

    def close(self) -> None:
        for s in self._socks:
            if s is not None:
                s.close(0)
        self._socks = [None] * len(self.addresses)
