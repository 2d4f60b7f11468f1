"""The worker side's transfer thread: KV loads and saves off the engine step, one job at a time, in order.

vLLM's asynchronous connector protocol lets a load finish after the step that asked for it (`get_finished` ->
`finished_recving`) and a save read its blocks after the step that computed them, as long as the blocks stay
untouched until the save has read them (`request_finished` -> delay_free_blocks for finished requests,
`handle_preemptions` for preempted ones). `TransferQueue` runs those jobs on one thread (a copy stream on GPU, the
thread itself on CPU), so the forward pass never waits for them:

- `submit(job)`: queued behind every job submitted before it (FIFO: a save of step N reads before a load of step
  N+1 writes). A `StreamFence` taken on the engine's thread orders a GPU job after the work that stream had queued
  when the job was submitted (the forward that computed a save's KV, the zeroing of a load's new blocks); on CPU
  the engine's work is done by then and the fence is empty.
- `pending(req_id)` / `wait_for(req_ids)`: jobs of a request not finished yet; preemption waits for them.
- `take_done()`: finished jobs and their results, for the engine thread to report.
- `has_done()` and the `on_done` callback (run on the transfer thread after each job): the worker's idle wait
  (`WorkerSide.get_finished`) sleeps until a job ends instead of letting the engine spin.
- Held jobs (tests only: `WorkerSide.timing`, `connector/transfer_timing.py`, holds none in production): a job
  submitted with `hold_steps=k` does not start before `tick()` (once per engine step) was called k times, or
  `release()` lets every held job go (a preemption, a flush, close). A held job holds the ones behind it too
  (FIFO). This makes "a load still in flight while other requests step" and "a save still in flight when its
  request finishes or is preempted" deterministic, without sleeping.

Every LMCache engine call of a job runs under `engine_lock`, which the worker also takes for the loads it runs
synchronously, so LMCache's engine never runs two stores or retrieves at once. A job that raises is logged and
reported done with `result=None` (the worker treats a load without a result as failed: its blocks are recomputed).
A job with `delay_s` (tests only, through the same timing) sleeps that long first, outside the lock: a load in
flight for a known time.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)


class StreamFence:
    """Taken on the engine's thread: on CUDA, an event recorded on its current stream (what a job must wait for);
    on CPU, nothing (the engine's work is finished when the fence is taken)."""

    __slots__ = ("event",)

    def __init__(self, device: torch.device | None) -> None:
        self.event = None
        if device is not None and device.type == "cuda":
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(device))


@dataclass
class TransferJob:
    """One load or save of one request."""

    kind: str  #: "load" | "save"
    req_id: str
    run: Callable[[], Any]
    #: the spec the job was made from (returned with the result)
    spec: Any = None
    fence: StreamFence | None = None
    #: engine steps (`TransferQueue.tick`) the job waits before it runs (tests: a held-back read or copy)
    hold_steps: int = 0
    #: seconds the job sleeps when it starts, before it takes the engine lock (tests: a slow read)
    delay_s: float = 0.0
    submitted: float = field(default_factory=time.monotonic)
    started: float = 0.0
    finished: float = 0.0
    result: Any = None


class TransferQueue:
    """One thread running `TransferJob`s in submission order."""

    def __init__(self, engine_lock: threading.Lock, device: torch.device | None = None,
                 name: str = "kvtier-transfer", on_done: Callable[[], None] | None = None) -> None:
        self.engine_lock = engine_lock
        self.device = device
        #: called on the transfer thread after each job finished (the worker's idle wait wakes on it)
        self._on_done = on_done
        self._cond = threading.Condition()
        self._queue: collections.deque[TransferJob] = collections.deque()
        self._pending: dict[str, int] = {}
        self._inflight = {"load": 0, "save": 0}
        self._done: list[TransferJob] = []
        self._closed = False
        self._stream: Any = None
        self._running: TransferJob | None = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ engine thread
    def submit(self, job: TransferJob) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("the transfer queue is closed")
            self._queue.append(job)
            self._pending[job.req_id] = self._pending.get(job.req_id, 0) + 1
            self._inflight[job.kind] = self._inflight.get(job.kind, 0) + 1
            self._cond.notify_all()

    def pending(self, req_id: str) -> int:
        with self._cond:
            return self._pending.get(req_id, 0)

    def inflight(self, kind: str) -> int:
        with self._cond:
            return self._inflight.get(kind, 0)

    def has_done(self) -> bool:
        """Whether a finished job waits for `take_done`."""
        with self._cond:
            return bool(self._done)

    def __len__(self) -> int:
        with self._cond:
            return sum(self._pending.values())

    def wait_for(self, req_ids: Any, timeout: float | None = None) -> bool:
        """Block until no job of `req_ids` is queued or running; False if `timeout` passed first."""
        ids = list(req_ids)
        self.release()
        with self._cond:
            return self._cond.wait_for(lambda: not any(self._pending.get(r, 0) for r in ids), timeout)

    def drain(self, timeout: float | None = None) -> bool:
        """Block until every submitted job has finished; False if `timeout` passed first."""
        self.release()
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending, timeout)

    def tick(self) -> None:
        """One engine step passed: held jobs are one step closer to running."""
        with self._cond:
            if any(j.hold_steps for j in self._queue) or (self._running is not None and self._running.hold_steps):
                for j in self._queue:
                    j.hold_steps = max(j.hold_steps - 1, 0)
                if self._running is not None:
                    self._running.hold_steps = max(self._running.hold_steps - 1, 0)
                self._cond.notify_all()

    def release(self) -> None:
        """Every held job may run now (before waiting for jobs: nothing may wait on a step that cannot come)."""
        with self._cond:
            for j in self._queue:
                j.hold_steps = 0
            if self._running is not None:
                self._running.hold_steps = 0
            self._cond.notify_all()

    def take_done(self) -> list[TransferJob]:
        with self._cond:
            out, self._done = self._done, []
        return out

    def close(self, timeout: float = 60.0) -> bool:
        """Finish what is queued (at most `timeout` seconds), then stop the thread."""
        drained = self.drain(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=5)
        return drained

    # ------------------------------------------------------------------ transfer thread
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                job = self._running = self._queue.popleft()
                while job.hold_steps > 0:
                    self._cond.wait()
            self._execute(job)
            with self._cond:
                n = self._pending.get(job.req_id, 0) - 1
                if n > 0:
                    self._pending[job.req_id] = n
                else:
                    self._pending.pop(job.req_id, None)
                self._inflight[job.kind] -= 1
                self._running = None
                self._done.append(job)
                self._cond.notify_all()
            if self._on_done is not None:
                self._on_done()

    def _execute(self, job: TransferJob) -> None:
        job.started = time.monotonic()
        if job.delay_s > 0:
            time.sleep(job.delay_s)
        try:
            with self.engine_lock:
                if job.fence is not None and job.fence.event is not None:
                    if self._stream is None:
                        self._stream = torch.cuda.Stream(device=self.device)
                    self._stream.wait_event(job.fence.event)
                    with torch.cuda.stream(self._stream):
                        job.result = job.run()
                    self._stream.synchronize()
                else:
                    job.result = job.run()
        except Exception:  # never into the engine: the worker reports the job as failed
            logger.exception("kvtier: %s of %s failed", job.kind, job.req_id)
            job.result = None
        job.finished = time.monotonic()
