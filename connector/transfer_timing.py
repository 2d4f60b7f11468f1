"""When the worker's transfer work starts: at once in production; held or slowed in tests.

`TransferTiming` answers, per request, how many engine steps an asynchronous load or a save waits on the transfer
thread before it runs (`TransferJob.hold_steps`), how long an asynchronous load sleeps first (`TransferJob.delay_s`,
outside the engine lock) and how long a prefetch sleeps before it reads. This class answers 0 everywhere and is
what every engine runs with (`WorkerSide.timing`); no configuration key reaches it. Tests replace it on the worker
(`kvtier.testing.transfer_timing`, before vLLM builds the connector) to make "a load still in flight while other
requests step", "a save still in flight when its request finishes" or "a slow SSD" deterministic.
"""

from __future__ import annotations

__all__ = ["AT_ONCE", "TransferTiming"]


class TransferTiming:
    """Every transfer starts at once (production)."""

    def prefetch_delay_s(self, rid: str) -> float:
        """Seconds the prefetch of `rid` sleeps before it looks up and reads its chunks."""
        return 0.0

    def load_delay_s(self, req_id: str) -> float:
        """Seconds an asynchronous load of `req_id` sleeps on the transfer thread before it runs."""
        return 0.0

    def load_hold_steps(self, req_id: str) -> int:
        """Engine steps an asynchronous load of `req_id` waits on the transfer thread before it runs."""
        return 0

    def save_hold_steps(self, req_id: str) -> int:
        """Engine steps a save of `req_id` waits on the transfer thread before it runs."""
        return 0


#: the production timing
AT_ONCE = TransferTiming()
