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
import time
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

    def _reset(self, i: int) -> None:
        """Drop rank i's socket: a REQ socket whose reply was not read (or that failed) cannot be used again."""
        s = self._socks[i]
        self._socks[i] = None
        if s is not None:
            try:
                s.close(0)
            except zmq.ZMQError:
                pass

    def call(self, msg: dict[str, Any], timeout_ms: int | None = None) -> list[dict[str, Any]]:
        """Send `msg` to every rank and return their replies in rank order. Every reply is read (or its socket
        rebuilt) before this returns, whatever the others answered, so one rank's error or silence never leaves
        a socket out of step for the next call. Raises RPCError only, naming each rank that failed."""
        data = self._enc.encode(msg)
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
        replies: list[dict[str, Any]] = [{} for _ in range(n)]
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
            if not isinstance(rep, dict):
                errors.append(f"rank {i}: malformed reply")
            elif "error" in rep:
                errors.append(f"rank {i} failed: {rep['error']}")
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
