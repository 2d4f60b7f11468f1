"""Process-wide fan-out of session signals to every live eviction policy (host tier and SSD tier).

The vLLM connector learns when a request arrives and how long its answer was; LMCache-only use infers the
chain from lookups. Both report here, in LMCache keys; each registered policy receives the chain in its own key
space (the SSD tier keys by `CacheEngineKey.to_string()`, LMCache's host tier by the key objects themselves).
A signal is advice: a sink that fails is logged and skipped, the other sinks still receive the signal, and the
caller (a lookup, a finished request) never sees the error.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol

logger = logging.getLogger(__name__)


class SignalSink(Protocol):
    """What receives session signals: an eviction policy, or an object that forwards to one (a recorder)."""

    @property
    def name(self) -> str: ...

    def on_request(self, chain: Sequence[Hashable], now: float | None = None) -> None: ...

    def on_request_finished(self, chain: Sequence[Hashable], answer_tokens: int, now: float | None = None
                            ) -> None: ...


_lock = threading.Lock()
_failures: weakref.WeakKeyDictionary[SignalSink, int] = weakref.WeakKeyDictionary()
_sinks: weakref.WeakKeyDictionary[SignalSink, tuple[Callable[[Any], Hashable], threading.RLock | None]] = (
    weakref.WeakKeyDictionary())


def register(policy: SignalSink, key_of: Callable[[Any], Hashable] = lambda k: k,
             lock: threading.RLock | None = None) -> None:
    """Let `policy` receive session signals; `key_of` maps an LMCache key to the policy's key; `lock` is the
    lock the policy's owner holds around policy calls."""
    with _lock:
        _sinks[policy] = (key_of, lock)


def _fan_out(call: Callable[[SignalSink, list[Hashable]], None], chain: Sequence[Any]) -> None:
    with _lock:
        sinks = list(_sinks.items())
    for policy, (key_of, lock) in sinks:
        try:
            keys = [key_of(k) for k in chain]
            if lock is None:
                call(policy, keys)
            else:
                with lock:
                    call(policy, keys)
        except Exception:
            _failed(policy)


def _failed(policy: SignalSink) -> None:
    """Log a sink's failure: the first with its traceback, then every 1,000th with the count."""
    with _lock:
        n = _failures[policy] = _failures.get(policy, 0) + 1
    if n == 1:
        logger.exception("kvtier: a session signal to the %s eviction policy failed; the signal is dropped for that "
                         "policy (it evicts without it)", policy.name)
    elif n % 1000 == 0:
        logger.warning("kvtier: %d session signals to the %s eviction policy failed so far", n, policy.name)


def request_arrived(chain: Sequence[Any], now: float | None = None) -> None:
    """A request that reads/extends the prefix chain `chain` (LMCache keys, in order) arrived."""
    t = time.monotonic() if now is None else now
    _fan_out(lambda p, keys: p.on_request(keys, t), chain)


def request_finished(chain: Sequence[Any], answer_tokens: int, now: float | None = None) -> None:
    """The request over `chain` finished after generating `answer_tokens` tokens."""
    t = time.monotonic() if now is None else now
    _fan_out(lambda p, keys: p.on_request_finished(keys, answer_tokens, t), chain)
