"""Whether a conversation comes back in time: an online logistic model over what its finished turn shows.

A *wait* starts when a follow-up turn finishes: the session's history now waits for the next turn. Its features are
numbers known at that moment (the answer's length in tokens, the seconds since the turn before, the conversation's
depth, the chunks the turn added, the chunks in its chain), each as log(1 + x) and standardised on the window. Its
label is whether the next turn came within `horizon_s`; it is known when that turn arrives or when the horizon has
passed without one (no future information: a label exists only once it has happened). The model is an L2-penalised
logistic regression, refitted by Newton steps on a sliding window of the latest `window` labelled waits every
`refit` new labels.

What the eviction policy takes from it is an odds ratio: the model's odds for a new wait over the odds of the
window's base rate. It multiplies the odds of the policy's class-based hit chance, so a wait the model finds twice
as likely as the average follow-up to come back doubles the odds that keeping it pays off. The class model already
splits by depth and the answer/pace buckets; this adds what continuous values and their combination say beyond
the buckets (on the tuning half of the Mooncake conversation trace a follow-up's features reach an AUC of about
0.66-0.70 for "back within 120-300 s", measured on turns the model was not fitted on: `benchmarks/
eviction_ceiling.py`).

Memory: at most `max_pending` waits without a label (the oldest are dropped beyond it) and `window` labelled rows.
Cost: O(1) per turn; a refit is a few 6x6 solves over the window in numpy.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np

logger = logging.getLogger(__name__)

@dataclass
class Wait:
    """One session's wait for its next turn, from the finish of a follow-up turn."""

    start: float
    x: tuple[float, ...]
    back: float | None = None  #: when the next turn came (None: not yet)
    done: bool = False  #: labelled or cancelled


def fit_logistic(x: np.ndarray, y: np.ndarray, l2: float = 1.0) -> tuple[float, np.ndarray, float] | None:
    """L2-penalised logistic regression of labels y in [0, 1] (soft labels allowed) on the rows of x, fitted by
    damped Newton steps on standardised features: (intercept, weight per raw feature, mean label), so that the
    log-odds of a row v is intercept + v @ weights. None when there is nothing to tell apart (every label the same)
    or the fit fails."""
    base = float(y.mean()) if len(y) else 0.0
    if base <= 0.0 or base >= 1.0:
        return None
    mu, sd = x.mean(axis=0), x.std(axis=0)
    sd = np.where(sd > 1e-6, sd, 1.0)  # a constant feature standardises to 0 (its weight stays at 0)
    z = np.c_[np.ones(len(x)), (x - mu) / sd]
    reg = l2 * np.eye(z.shape[1])
    reg[0, 0] = 1e-6  # keeps the Hessian invertible when every prediction saturates
    w = np.zeros(z.shape[1])
    w[0] = math.log(base / (1.0 - base))
    try:
        for _ in range(12):
            p = 1.0 / (1.0 + np.exp(-np.clip(z @ w, -30.0, 30.0)))
            step = np.linalg.solve((z.T * (p * (1.0 - p))) @ z + reg, z.T @ (p - y) + reg @ w)
            big = float(np.abs(step).max())
            if big > 4.0:  # damped: a separable window must not throw the weights far in one step
                step *= 4.0 / big
            w -= step
            if big < 1e-6:
                break
    except np.linalg.LinAlgError:
        w = np.full(z.shape[1], np.nan)
    if not np.all(np.isfinite(w)):
        logger.warning("logistic refit on %d labels failed; no correction until the next refit", len(y))
        return None
    coef = w[1:] / sd
    return float(w[0] - coef @ mu), coef, base


class ReturnModel:
    def __init__(self, horizon_s: float = 300.0, window: int = 4096, refit: int = 64, min_labels: int = 100,
                 l2: float = 1.0, max_pending: int = 100_000, max_ratio: float = 20.0,
                 label_of: Callable[[float], float] | None = None) -> None:
        if horizon_s <= 0 or window < 2 or refit < 1 or min_labels < 2:
            raise ValueError("return model: horizon_s > 0, window >= 2, refit >= 1 and min_labels >= 2 are required")
        self.horizon_s = float(horizon_s)
        self.refit_every = int(refit)
        self.min_labels = min(int(min_labels), int(window))  #: a window smaller than this would never fit
        self.l2 = float(l2)
        self.max_pending = int(max_pending)
        self.max_ratio = float(max_ratio)
        #: a returned wait's label from its gap (seconds), in [0, 1]; default: 1 within the horizon
        self.label_of = label_of
        self._rows: deque[tuple[tuple[float, ...], float]] = deque(maxlen=int(window))
        self._pending: deque[Wait] = deque()
        self._since_fit = 0
        self._coef: tuple[float, ...] | None = None  #: the fit's weight per feature (None: no correction)
        self._const = 0.0  #: the fit's intercept minus the window's base log-odds
        self.labels = 0
        self.fits = 0

    @staticmethod
    def features(answer_tokens: int, prev_gap_s: float, depth: int, new_chunks: int, chain_chunks: int
                 ) -> tuple[float, ...]:
        """A wait's features: log(1 + x) of each value."""
        return (math.log1p(max(0, answer_tokens)), math.log1p(max(0.0, prev_gap_s)), math.log1p(max(0, depth)),
                math.log1p(max(0, new_chunks)), math.log1p(max(0, chain_chunks)))

    # ------------------------------------------------------------------ waits and labels
    def start(self, now: float, x: tuple[float, ...]) -> Wait:
        """A wait begins (a follow-up turn finished at `now`); returns its handle for `returned`."""
        self.expire(now)
        w = Wait(now, x)
        self._pending.append(w)
        if len(self._pending) > self.max_pending:
            self._pending.popleft().done = True
        return w

    def returned(self, w: Wait | None, now: float) -> None:
        """The session's next turn arrived at `now` (the wait is labelled once its horizon has passed)."""
        if w is not None and w.back is None:
            w.back = now
        self.expire(now)

    def cancel(self, w: Wait | None) -> None:
        if w is not None:
            w.done = True

    def expire(self, now: float) -> None:
        """Label the waits whose horizon has passed, in the order they started: yes if the next turn came within
        it. Every label waits the whole horizon, returns included: a return known early is not labelled before
        the non-returns of the same age, so the window's base rate is not biased towards returns while it fills
        (or when the rate of new conversations changes)."""
        pending = self._pending
        limit = now - self.horizon_s
        while pending and (pending[0].done or pending[0].start <= limit):
            w = pending.popleft()
            if not w.done:
                w.done = True
                if w.back is None or w.back - w.start > self.horizon_s:
                    self._label(w.x, 0.0)
                elif self.label_of is None:
                    self._label(w.x, 1.0)
                else:
                    self._label(w.x, min(1.0, max(0.0, float(self.label_of(w.back - w.start)))))

    def _label(self, x: tuple[float, ...], y: float) -> None:
        self._rows.append((x, y))
        self.labels += 1
        self._since_fit += 1
        if self._since_fit >= self.refit_every and len(self._rows) >= self.min_labels:
            self._fit()

    # ------------------------------------------------------------------ the model
    def _fit(self) -> None:
        self._since_fit = 0
        x = np.array([r[0] for r in self._rows], dtype=float)
        y = np.array([r[1] for r in self._rows], dtype=float)
        fit = fit_logistic(x, y, self.l2)
        if fit is None:
            self._coef = None
            return
        intercept, coef, base = fit
        self._coef = tuple(float(c) for c in coef)
        self._const = intercept - math.log(base / (1.0 - base))
        self.fits += 1

    def odds_ratio(self, x: tuple[float, ...]) -> float | None:
        """The model's odds for a wait with features x over the window's base odds (None before the first fit)."""
        coef = self._coef
        if coef is None:
            return None
        z = self._const + sum(c * v for c, v in zip(coef, x))
        r = math.exp(max(-50.0, min(50.0, z)))
        return min(self.max_ratio, max(1.0 / self.max_ratio, r))

    def memory_items(self) -> dict[str, int]:
        return {"return_rows": len(self._rows), "return_pending": len(self._pending)}
