"""An online reuse predictor: P(keeping a chunk until its next access pays off | what is known about it now).

Training data are labelled samples from the ghost cache (`ghost_cache.GhostBelady`): a sampled past access, its
features at the time, and whether Belady, replayed over the window of the past at this tier's capacity, hit its
next access (Learning Relaxed Belady's idea, NSDI'20: imitate the optimum's keep/evict decisions instead of
predicting reuse distances). Features are categorical: each sample is a tuple with one value index per feature
group (`FeatureSpace`); the model is a logistic regression over the one-hot encoding (plus optional crosses of two
groups), refitted by a few damped Newton steps with an L2 penalty on a sliding window of the latest `window`
samples. With `offset_of`, it is a *residual* model: the log-odds of another estimate of the same probability
(e.g. a class-based hazard model's) is a fixed offset per sample, and the weights learn only what the features add
to it; with no labels or no signal the correction stays at zero.
Samples with identical feature tuples are aggregated, so a refit costs O(distinct tuples x features^2) in numpy,
whatever the window; a prediction is a sum of a few weights (cached per tuple until the next refit).

Memory: the window of samples (`window` tuples), the aggregated counts (at most as many entries), the weights.
No future information: only samples handed in through `add` are used.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FeatureSpace:
    """Named categorical feature groups (group name -> number of values) and crosses of two groups."""

    groups: tuple[tuple[str, int], ...]
    crosses: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        names = [g for g, _ in self.groups]
        for a, b in self.crosses:
            if a not in names or b not in names:
                raise ValueError(f"cross ({a}, {b}) names an unknown feature group; groups: {names}")

    def offsets(self) -> tuple[list[int], list[tuple[int, int, int, int]], int]:
        """(offset per group, (group a, group b, size of b, offset) per cross, total number of columns)."""
        offs, n = [], 0
        for _, size in self.groups:
            offs.append(n)
            n += size
        pos = {g: i for i, (g, _) in enumerate(self.groups)}
        crosses = []
        for a, b in self.crosses:
            ia, ib = pos[a], pos[b]
            crosses.append((ia, ib, self.groups[ib][1], n))
            n += self.groups[ia][1] * self.groups[ib][1]
        return offs, crosses, n


class ReusePredictor:
    """Online logistic regression over categorical features, trained from labelled samples."""

    def __init__(
        self,
        space: FeatureSpace,
        offset_of: Callable[[tuple[int, ...]], float] | None = None,
        window: int = 16384,
        refit_every: int = 256,
        l2: float = 1.0,
        prior: float = 0.3,
        newton_steps: int = 4,
        min_samples: int = 64,
    ) -> None:
        self.space = space
        self.offset_of = offset_of
        self.window = int(window)
        self.refit_every = int(refit_every)
        self.l2 = float(l2)
        self.newton_steps = int(newton_steps)
        self.min_samples = int(min_samples)
        self._offs, self._crosses, self.n_columns = space.offsets()
        self._n_groups = len(space.groups)
        self._samples: deque[tuple[tuple[int, ...], bool]] = deque()
        self._counts: dict[tuple[int, ...], list[float]] = {}  # tuple -> [positives, negatives] in the window
        self.w = np.zeros(self.n_columns)
        #: intercept; before any fit: 0 around an offset, else the prior's log-odds
        self.bias = 0.0 if offset_of is not None else math.log(prior / (1.0 - prior))
        self._wl: list[float] = [0.0] * self.n_columns
        self._cache: dict[tuple[int, ...], float] = {}
        self._since = 0
        self.fits = 0
        self.samples_seen = 0

    def __len__(self) -> int:
        return len(self._samples)

    # ------------------------------------------------------------------ training
    def add(self, x: tuple[int, ...], label: bool) -> bool:
        """One labelled sample; refits when due. True when it refitted."""
        if len(x) != self._n_groups:
            raise ValueError(f"sample has {len(x)} features, the space has {self._n_groups} groups")
        self._samples.append((x, label))
        c = self._counts.get(x)
        if c is None:
            c = self._counts[x] = [0.0, 0.0]
        c[0 if label else 1] += 1.0
        if len(self._samples) > self.window:
            ox, ol = self._samples.popleft()
            oc = self._counts[ox]
            oc[0 if ol else 1] -= 1.0
            if oc[0] <= 0.0 and oc[1] <= 0.0:
                del self._counts[ox]
        self.samples_seen += 1
        self._since += 1
        if self._since >= self.refit_every and len(self._samples) >= self.min_samples:
            self.refit()
            return True
        return False

    def _columns(self, x: Sequence[int]) -> list[int]:
        """The one-hot columns of x (one per group, one per cross)."""
        cols = [self._offs[g] + v for g, v in enumerate(x)]
        for ia, ib, nb, off in self._crosses:
            cols.append(off + x[ia] * nb + x[ib])
        return cols

    def refit(self) -> None:
        """A few damped Newton steps of L2-penalised logistic regression on the aggregated window (warm-started).
        The design is one-hot, so gradient and Hessian are sums over each row's few active columns (bincount):
        O(distinct tuples x active columns^2), independent of the number of feature values."""
        self._since = 0
        if not self._counts:
            return
        rows = list(self._counts.items())
        F = self.n_columns
        cols = np.array([self._columns(x) + [F] for x, _ in rows], dtype=np.int64)  # + the intercept column
        counts = np.array([c for _, c in rows], dtype=float)
        pos = counts[:, 0]
        tot = counts[:, 0] + counts[:, 1]
        off = np.array([self.offset_of(x) for x, _ in rows]) if self.offset_of is not None else 0.0
        U, A = cols.shape
        flat = cols.ravel()
        pairs = (cols[:, :, None] * (F + 1) + cols[:, None, :]).ravel()
        beta = np.concatenate([self.w, [self.bias]])
        pen = np.full(F + 1, self.l2)
        pen[F] = 1e-3

        def loss(b: np.ndarray) -> tuple[float, np.ndarray]:
            z = b[cols].sum(axis=1) + off
            return float(np.sum(tot * np.logaddexp(0.0, z) - pos * z) + 0.5 * np.sum(pen * b * b)), z

        cur, z = loss(beta)
        for _ in range(self.newton_steps):
            mu = 1.0 / (1.0 + np.exp(-np.clip(z, -30, 30)))
            grad = np.bincount(flat, weights=np.repeat(tot * mu - pos, A), minlength=F + 1) + pen * beta
            wts = tot * mu * (1.0 - mu)
            H = np.bincount(pairs, weights=np.repeat(wts, A * A), minlength=(F + 1) ** 2).reshape(F + 1, F + 1)
            H[np.diag_indices_from(H)] += pen
            try:
                step = np.linalg.solve(H, grad)
            except np.linalg.LinAlgError:
                logger.debug("reuse predictor: singular Hessian, refit skipped")
                return
            t = 1.0
            while True:  # damped Newton: halve the step until the penalised loss falls
                cand = beta - t * step
                val, zc = loss(cand)
                if val <= cur or t < 1e-3:
                    break
                t *= 0.5
            if val > cur:
                break
            beta, cur, z = cand, val, zc
            if float(np.max(np.abs(t * step))) < 1e-4:
                break
        self.w = beta[:F]
        self.bias = float(beta[F])
        self._wl = self.w.tolist()
        self._cache.clear()
        self.fits += 1

    # ------------------------------------------------------------------ prediction
    def shift(self, x: tuple[int, ...]) -> float:
        """The model's log-odds for x, without any offset (the correction, for a residual model)."""
        z = self._cache.get(x)
        if z is not None:
            return z
        wl = self._wl
        z = self.bias
        for c in self._columns(x):
            z += wl[c]
        if len(self._cache) < 65536:
            self._cache[x] = z
        return z

    def predict(self, x: tuple[int, ...], offset: float = 0.0) -> float:
        """P(label | x) (around `offset`, the other estimate's log-odds, for a residual model)."""
        z = self.shift(x) + offset
        return 1.0 / (1.0 + math.exp(-max(-30.0, min(30.0, z))))

    def base_rate(self) -> float:
        """Share of positive labels in the window (for reports)."""
        pos = sum(c[0] for c in self._counts.values())
        tot = pos + sum(c[1] for c in self._counts.values())
        return pos / tot if tot else float("nan")

    def memory_items(self) -> int:
        return len(self._samples) + len(self._counts)
