"""The HRRN order of the ready queue, vectorized: `DualQueuePolicy(ready_order="hrrn")` keeps its ready requests here.

A request's response ratio is `(now + eps - arrival) / service`; ratios of different requests grow at different
rates, so there is no static order and every scheduling step must look at every ready request. In CPython a loop
over 1,000 of them costs more than the whole step's budget (0.62 ms); here arrival, 1 / service, GPU need and the
delay-hit deferral live in numpy arrays (one slot per request), so `best` is an argmax and `order` an argsort plus
a greedy walk over free GPU memory done on prefix sums. Plain Python + numpy; no vLLM import.
"""

from __future__ import annotations

import numpy as np

__all__ = ["RatioIndex"]


class RatioIndex:
    def __init__(self, eps_s: float, capacity: int = 256) -> None:
        self.eps = float(eps_s)
        self._arr = np.zeros(capacity)
        self._inv = np.zeros(capacity)
        self._need = np.zeros(capacity)
        self._defer = np.zeros(capacity, dtype=bool)
        self._valid = np.zeros(capacity, dtype=bool)
        self._rids: list[str | None] = [None] * capacity
        self._slot: dict[str, int] = {}
        self._free = list(range(capacity - 1, -1, -1))

    def __len__(self) -> int:
        return len(self._slot)

    def _grow(self) -> None:
        n = len(self._rids)
        for name in ("_arr", "_inv", "_need", "_defer", "_valid"):
            a = getattr(self, name)
            b = np.zeros(2 * n, dtype=a.dtype)
            b[:n] = a
            setattr(self, name, b)
        self._rids.extend([None] * n)
        self._free.extend(range(2 * n - 1, n - 1, -1))

    def put(self, rid: str, arrival: float, inv_service: float, gpu_need: float, deferred: bool) -> None:
        """Add a ready request or update one."""
        i = self._slot.get(rid)
        if i is None:
            if not self._free:
                self._grow()
            i = self._free.pop()
            self._slot[rid] = i
            self._rids[i] = rid
            self._valid[i] = True
        self._arr[i] = arrival
        self._inv[i] = inv_service
        self._need[i] = gpu_need
        self._defer[i] = deferred

    def remove(self, rid: str) -> None:
        i = self._slot.pop(rid, None)
        if i is not None:
            self._valid[i] = False
            self._rids[i] = None
            self._free.append(i)

    def _keys(self, now: float) -> np.ndarray:
        return (now + self.eps - self._arr) * self._inv

    def best(self, now: float, free_gpu: float) -> tuple[str | None, int, int]:
        """(the admissible request of highest ratio or None, deferred and oversized requests ranked above it)."""
        keys = self._keys(now)
        ok = self._valid & ~self._defer & (self._need <= free_gpu)
        if not ok.any():
            return None, int((self._valid & self._defer).sum()), int((self._valid & ~self._defer).sum())
        i = int(np.argmax(np.where(ok, keys, -np.inf)))
        above = self._valid & (keys > keys[i])
        return self._rids[i], int((above & self._defer).sum()), int((above & ~self._defer).sum())

    def order(self, now: float, free_gpu: float) -> tuple[list[str], list[str]]:
        """(admissible requests in ratio order, each counted against `free_gpu` as if admitted; the others, in ratio
        order: deferred ones and those that do not fit)."""
        idx = np.flatnonzero(self._valid)
        if not len(idx):
            return [], []
        o = idx[np.argsort(-self._keys(now)[idx], kind="stable")]
        take = ~self._defer[o]
        if free_gpu != float("inf"):
            pos = np.flatnonzero(take)
            needs = self._need[o[pos]]
            cs = np.cumsum(needs)
            n_ok = int(np.searchsorted(cs, free_gpu, side="right"))
            rem = free_gpu - (cs[n_ok - 1] if n_ok else 0.0)
            tail, tneeds = pos[n_ok:], needs[n_ok:]
            take[tail] = False
            while len(tail) and rem > 0:  # greedy: the next one that still fits
                fits = tneeds <= rem
                if not fits.any():
                    break
                j = int(np.argmax(fits))
                take[tail[j]] = True
                rem -= tneeds[j]
                tail, tneeds = tail[j + 1:], tneeds[j + 1:]
        rids = self._rids
        ol = o.tolist()
        tl = take.tolist()
        return [rids[i] for i, t in zip(ol, tl) if t], [rids[i] for i, t in zip(ol, tl) if not t]
