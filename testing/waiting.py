"""Waiting in tests without fixed sleeps.

`wait_until` polls a condition every few milliseconds and fails with a clear message at a deadline: a test waits as
long as the code under test needs and no longer, instead of asserting after a guessed `time.sleep` (too short under
load, so it flakes; or long enough that the code took another path, so it checks the wrong thing).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

#: how often `wait_until` asks by default
POLL_S = 0.005


def wait_until(predicate: Callable[[], T], timeout_s: float = 30.0, what: str | Callable[[], str] = "", *,
               poll_s: float = POLL_S) -> T:
    """Call `predicate` until it returns something truthy, and return that.

    Raises AssertionError naming `what` (a string, or a callable giving one, e.g. the state at that moment) once
    `timeout_s` has passed. The predicate is asked once more at the deadline, so a machine that gets there late
    still passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = predicate()
        if got:
            return got
        if time.monotonic() >= deadline:
            desc = what() if callable(what) else what
            raise AssertionError(f"gave up after {timeout_s:g} s waiting for "
                                 f"{desc or getattr(predicate, '__qualname__', repr(predicate))}")
        time.sleep(poll_s)
