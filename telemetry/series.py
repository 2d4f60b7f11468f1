"""kvtier's Prometheus series: `prometheus_client` metrics that also keep the changes not yet exported.

Every kvtier series (`kvtier_ssd_*`, `kvtier_connector_*`, ...) is declared with `counter`, `gauge` or
`histogram` from here. Each is a real `prometheus_client` metric in the process's registry (scraped as usual, and
shared through `PROMETHEUS_MULTIPROC_DIR` when that is set), and each update is also noted, per sample, in one
process-wide change set that `take_changes()` hands over and clears: O(what changed), so an exporter can run at
every engine step (see `kvtier.connector.metrics_export`, which carries them to vLLM's API server).

Plain Python and prometheus_client only: the storage side uses it without vLLM.
"""

from __future__ import annotations

import bisect
import os
import threading
from collections.abc import Sequence
from typing import Any, Self

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.utils import floatToGoString

_lock = threading.Lock()
#: (family, sample name, sorted label items) -> change since the last take (counters, histograms) or last value
_changes: dict[tuple[str, str, tuple], float] = {}
_SERIES: list[Series] = []


class Series:
    """One kvtier metric: `prom` is the prometheus_client object; updates also go to the change set."""

    kind = ""
    family: str

    def __init__(self, prom: MetricWrapperBase, name: str, doc: str, labelnames: Sequence[str] = (),
                 labelvalues: tuple[str, ...] = (), parent: Series | None = None) -> None:
        self.prom, self.doc, self.labelnames, self.labelvalues = prom, doc, tuple(labelnames), labelvalues
        # the family name prometheus_client exposes (a counter's without its "_total")
        self.family = parent.family if parent is not None else (
            name[:-len("_total")] if self.kind == "counter" and name.endswith("_total") else name)
        self._label_items = tuple(sorted(zip(self.labelnames, labelvalues))) if parent is not None else ()
        if parent is None:
            _SERIES.append(self)

    def labels(self, *values: Any) -> Self:
        values = tuple(str(v) for v in values)
        return type(self)(self.prom.labels(*values), "", self.doc, self.labelnames, values, parent=self)

    def _add(self, sample: str, amount: float, items: tuple = ()) -> None:
        key = (self.family, sample, items or self._label_items)
        _changes[key] = _changes.get(key, 0.0) + amount


class CounterSeries(Series):
    kind = "counter"
    prom: Counter

    def inc(self, amount: float = 1.0) -> None:
        self.prom.inc(amount)
        with _lock:
            self._add(self.family + "_total", float(amount))


class GaugeSeries(Series):
    kind = "gauge"
    prom: Gauge

    def set(self, value: float) -> None:
        self.prom.set(value)
        with _lock:
            _changes[(self.family, self.family, self._label_items)] = float(value)


class HistogramSeries(Series):
    kind = "histogram"
    prom: Histogram
    bounds: list[float]

    def __init__(self, prom: MetricWrapperBase, name: str, doc: str, labelnames: Sequence[str] = (),
                 labelvalues: tuple[str, ...] = (), parent: Series | None = None,
                 buckets: Sequence[float] = ()) -> None:
        super().__init__(prom, name, doc, labelnames, labelvalues, parent)
        self.bounds = list(parent.bounds) if isinstance(parent, HistogramSeries) else [float(b) for b in buckets]
        if not self.bounds or self.bounds[-1] != float("inf"):
            self.bounds.append(float("inf"))
        self._le = [floatToGoString(b) for b in self.bounds]

    def labels(self, *values: Any) -> HistogramSeries:
        values = tuple(str(v) for v in values)
        return HistogramSeries(self.prom.labels(*values), "", self.doc, self.labelnames, values, parent=self)

    def observe(self, value: float) -> None:
        self.prom.observe(value)
        first = bisect.bisect_left(self.bounds, value)
        with _lock:
            for le in self._le[first:]:  # buckets are cumulative: every bound >= value counts it
                self._add(self.family + "_bucket", 1.0, tuple(sorted(self._label_items + (("le", le),))))
            self._add(self.family + "_count", 1.0)
            self._add(self.family + "_sum", float(value))


def counter(name: str, doc: str, labelnames: Sequence[str] = ()) -> CounterSeries:
    return CounterSeries(Counter(name, doc, labelnames), name, doc, labelnames)


def gauge(name: str, doc: str, labelnames: Sequence[str] = ()) -> GaugeSeries:
    return GaugeSeries(Gauge(name, doc, labelnames), name, doc, labelnames)


def histogram(name: str, doc: str, buckets: Sequence[float], labelnames: Sequence[str] = ()) -> HistogramSeries:
    return HistogramSeries(Histogram(name, doc, labelnames, buckets=buckets), name, doc, labelnames,
                           buckets=buckets)


def all_series() -> list[Series]:
    """Every kvtier series declared in this process."""
    return list(_SERIES)


def families() -> dict[str, tuple[str, str]]:
    """family -> (type, documentation) of every series declared in this process."""
    return {s.family: (s.kind, s.doc) for s in _SERIES}


def _forget_changes() -> None:
    global _changes
    _changes = {}


# A forked child exports its own changes only (the parent's pending ones are the parent's to export).
os.register_at_fork(after_in_child=_forget_changes)


def take_changes() -> dict[tuple[str, str, tuple], float]:
    """The changes since the previous call (counter and histogram samples: increments; gauges: latest value)."""
    global _changes
    with _lock:
        out, _changes = _changes, {}
    return out
