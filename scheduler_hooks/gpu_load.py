"""How busy the GPU has been lately: the share of the last `window_s` seconds it spent running work.

The idle-GPU re-plan (`DualQueuePolicy.replan_idle`) uses it as the rate at which work arrives while a request's
SSD read is in flight: recomputing that request's SSD part at an idle GPU takes GPU time that the work arriving
meanwhile would otherwise have had (`LoadPlanner.recompute_now`). In steady state the GPU's busy share is the
offered load in GPU seconds per second, prefills and decodes alike (an estimate from the arrivals' own prefill
estimates misses the decodes: on the shared-prefix workload it read 0.44 where the GPU was 70% busy).

The engine side reports its cumulative busy seconds (`observe(now, busy_s)`, monotonic in both); `load` is the
busy seconds added over the samples of the last `window_s` seconds divided by the time they span, in [0, 1].
No samples yet, or samples that span no time: 0 (no evidence of load: the re-plan keeps its idle-GPU rule).
Plain Python, amortised O(1) per sample.
"""

from __future__ import annotations

import logging
from collections import deque

logger = logging.getLogger(__name__)

__all__ = ["GpuLoad"]


class GpuLoad:
    """Sliding-window busy share of the GPU from cumulative busy-time samples."""

    __slots__ = ("window_s", "_samples")

    def __init__(self, window_s: float = 60.0) -> None:
        if not window_s > 0:
            raise ValueError(f"GpuLoad window_s must be > 0, got {window_s!r}")
        self.window_s = float(window_s)
        self._samples: deque[tuple[float, float]] = deque()

    def observe(self, now: float, busy_s: float) -> None:
        """At `now` the GPU has been busy `busy_s` seconds in total (since any fixed origin)."""
        s = self._samples
        if s and (now < s[-1][0] or busy_s < s[-1][1]):
            logger.debug("GpuLoad: sample (%s, %s) goes backwards; restarting the window", now, busy_s)
            s.clear()
        if s and now == s[-1][0]:
            s[-1] = (now, busy_s)
        else:
            s.append((float(now), float(busy_s)))
        while len(s) > 2 and s[1][0] <= now - self.window_s:
            s.popleft()  # keep one sample at or before the window's start

    @property
    def load(self) -> float:
        s = self._samples
        if len(s) < 2:
            return 0.0
        span = s[-1][0] - s[0][0]
        if span <= 0:
            return 0.0
        return min(max((s[-1][1] - s[0][1]) / span, 0.0), 1.0)
