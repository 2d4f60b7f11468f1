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
        self._svc = np.zeros(capacity)  # service seconds (the starvation lookahead's job lengths)
        self._defer = np.zeros(capacity, dtype=bool)
        self._valid = np.zeros(capacity, dtype=bool)
        self._rids: list[str | None] = [None] * capacity
        self._slot: dict[str, int] = {}
        self._free = list(range(capacity - 1, -1, -1))

    def __len__(self) -> int:
        return len(self._slot)

    def _grow(self) -> None:
        n = len(self._rids)
        for name in ("_arr", "_inv", "_need", "_svc", "_defer", "_valid"):
            a = getattr(self, name)
            b = np.zeros(2 * n, dtype=a.dtype)
            b[:n] = a
            setattr(self, name, b)
        self._rids.extend([None] * n)
        self._free.extend(range(2 * n - 1, n - 1, -1))

    def put(self, rid: str, arrival: float, inv_service: float, gpu_need: float, deferred: bool,
            service: float = 0.0) -> None:
        """Add a ready request or update one (`service`: its estimated GPU seconds, for `allowed`)."""
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
        self._svc[i] = service
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

    def allowed(self, now: float, bound_s: float, counted: np.ndarray | None = None) -> np.ndarray | None:
        """The starvation lookahead: which ready requests may go next without making an older one wait past
        `bound_s` (its deadline: arrival + `bound_s`), a bool array over slots; None if the bound does not bind.

        In arrival order (ties: shorter service first), request j starts no earlier than now + the services of the
        requests before it (the queue served in arrival order from now on, the order that meets deadlines if any
        does): its slack is arrival_j + bound_s - now - that sum. Serving x first delays every older request by
        service_x, so x is allowed iff service_x <= the smallest slack of the requests before it; the oldest one
        always is. `counted` (bool over slots): the requests whose deadlines count (default: every ready one)."""
        idx = np.flatnonzero(self._valid if counted is None else (self._valid & counted))
        if len(idx) < 2:
            return None
        arr, svc = self._arr[idx], self._svc[idx]
        o = np.lexsort((svc, arr))
        svc_o = svc[o]
        slack = arr[o] + bound_s - now - (np.cumsum(svc_o) - svc_o)
        before = np.minimum.accumulate(slack)  # smallest slack of the first k + 1 in arrival order
        ok_o = np.empty(len(o), dtype=bool)
        ok_o[0] = True
        ok_o[1:] = svc_o[1:] <= before[:-1]
        if ok_o.all():
            return None
        out = np.zeros(len(self._valid), dtype=bool)
        out[idx[o[ok_o]]] = True
        return out

    def best_allowed(self, now: float, free_gpu: float, allowed: np.ndarray) -> str | None:
        """The admissible request of highest ratio among `allowed` (from `allowed`), or None."""
        ok = self._valid & ~self._defer & (self._need <= free_gpu) & allowed
        if not ok.any():
            return None
        return self._rids[int(np.argmax(np.where(ok, self._keys(now), -np.inf)))]

    def counted_mask(self, max_need: float) -> np.ndarray:
        """Slots whose GPU need is at most `max_need` (a request that can never run has no deadline)."""
        return self._need <= max_need

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
