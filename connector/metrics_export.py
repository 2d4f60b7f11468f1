"""kvtier's Prometheus series on the `/metrics` of vLLM's API server, through vLLM's KV-connector stats path.

Under `vllm serve` the connector runs in the engine-core process (scheduler role) and in the worker processes
(worker role, with the SSD tier), while `/metrics` is served by the API-server process from its own registry:
without help the API server shows kvtier's series at zero. vLLM 0.32/0.33 share metrics across processes in only
two ways, and kvtier uses whichever the server runs with:

- **Default set-up** (no `PROMETHEUS_MULTIPROC_DIR`, one API server): each engine-side process's `Exporter`
  puts the changes of its `kvtier_*` samples since its previous export (`kvtier.telemetry.series`) into the
  connector's stats
  (`get_kv_connector_stats`, every engine step, both roles); vLLM carries them to the API server with the step's
  scheduler stats and hands them to the connector's `build_prom_metrics` object there, which feeds a `Mirror`.
  The mirror replaces kvtier's own (idle) series in the API server's registry and exposes, per series, the local
  value plus what every engine-side process reported: counters and histograms as sums of the changes, gauges as
  the sum over processes of each one's latest value. Hit counters move in the same scheduler-stats message as
  vLLM's `vllm:prompt_tokens_cached_by_source`, so the two agree at every scrape.
- **Multiprocess mode** (`PROMETHEUS_MULTIPROC_DIR` set by the user, or by vLLM itself for
  `--api-server-count` > 1, before the processes start): prometheus_client keeps every process's values in
  that directory and `/metrics` reads them all; nothing is exported (that would count twice). LMCache's engine
  sets the variable inside the worker after prometheus_client was imported there: the worker's values stay in
  memory, so they are exported.

A process's own exports are ignored by its mirror (an in-process engine, `VLLM_ENABLE_V1_MULTIPROCESSING=0`,
already shows its values locally). Worker-side series (`kvtier_ssd_*`, loads, saves) move with engine steps: an
SSD commit that lands after the last step of a burst shows at the next step.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import socket
import threading
from collections.abc import Iterable
from typing import Any

from prometheus_client import REGISTRY
from prometheus_client.metrics_core import Metric

from kvtier.telemetry import series as metrics_core

#: family types whose samples only grow (sent as changes); gauges are sent as their latest value
_MONOTONIC_TYPES = ("counter", "histogram", "summary")
PAYLOAD_KEY = "prom"


def values_in_files() -> bool:
    """True when this process's prometheus_client values live in `PROMETHEUS_MULTIPROC_DIR` files, which the
    API server reads itself. prometheus_client decides that once, when it is imported: a later
    `PROMETHEUS_MULTIPROC_DIR` (LMCache's engine sets one in the worker) leaves values in memory."""
    from prometheus_client import values

    return getattr(values, "ValueClass", values.MutexValue) is not values.MutexValue


def serves_files() -> bool:
    """True when this process's /metrics reads multiprocess files (what vLLM's `get_prometheus_registry` does
    when `PROMETHEUS_MULTIPROC_DIR` is set)."""
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


def source_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


#: modules declaring kvtier's series (imported by the mirror, so every family exists in the API server)
SERIES_MODULES = ("kvtier.connector.metrics", "kvtier.storage_backends.metrics")


def _import_series() -> None:
    for name in SERIES_MODULES:
        importlib.import_module(name)


class Exporter:
    """One per process: this process's kvtier series changes since the previous `take()`."""

    def __init__(self) -> None:
        self.source = source_id()

    def take(self) -> dict[str, Any] | None:
        """A payload (msgpack/JSON-safe) of what changed, or None (nothing changed, or values in files)."""
        if values_in_files():
            metrics_core.take_changes()  # shared through the files: nothing to send, nothing to keep
            return None
        changes = metrics_core.take_changes()
        if not changes:
            return None
        fams = metrics_core.families()
        samples = [[fam, name, dict(items), value] for (fam, name, items), value in changes.items()]
        return {"src": self.source, "meta": {f: list(fams[f]) for f in {s[0] for s in samples} if f in fams},
                "samples": samples}


_EXPORTER: Exporter | None = None
_LOCK = threading.Lock()


def exporter() -> Exporter:
    global _EXPORTER
    with _LOCK:
        if _EXPORTER is None or _EXPORTER.source != source_id():  # a forked child starts its own
            _EXPORTER = Exporter()
        return _EXPORTER


def _samples(collectors: Iterable[Any]):
    """(family, type, documentation, sample name, labels, value) of every sample but `_created`."""
    for c in collectors:
        for fam in c.collect():
            for s in fam.samples:
                if not s.name.endswith("_created"):
                    yield fam.name, fam.type, fam.documentation, s.name, s.labels, s.value


class Mirror:
    """A Prometheus collector in the API server: kvtier's local series plus what engine-side processes sent."""

    def __init__(self, local: list[Any]) -> None:
        self.local = local
        self.source = source_id()
        self._lock = threading.Lock()
        self._meta: dict[str, tuple[str, str]] = {}
        self._sums: dict[tuple[str, str, tuple], float] = {}  # (family, sample, labels) -> total change
        self._gauges: dict[tuple[str, str, tuple], dict[str, float]] = {}  # ... -> source -> latest value
        self.applied = 0

    def apply(self, payload: dict[str, Any]) -> None:
        if payload.get("src") == self.source:
            return  # this process's own values are already in the local series
        src = str(payload.get("src"))
        meta = payload.get("meta", {})
        with self._lock:
            for fam, (typ, doc) in meta.items():
                self._meta.setdefault(fam, (typ, doc))
            for fam, name, labels, value in payload.get("samples", []):
                key = (fam, name, tuple(sorted(labels.items())))
                if self._meta.get(fam, ("gauge",))[0] in _MONOTONIC_TYPES:
                    self._sums[key] = self._sums.get(key, 0.0) + float(value)
                else:
                    self._gauges.setdefault(key, {})[src] = float(value)
            self.applied += 1

    def _remote(self, key: tuple[str, str, tuple]) -> float:
        return self._sums.get(key, 0.0) + sum(self._gauges.get(key, {}).values())

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            fams: dict[str, Metric] = {}
            seen: set[tuple[str, str, tuple]] = set()
            for fam, typ, doc, name, labels, value in _samples(self.local):
                m = fams.get(fam)
                if m is None:
                    m = fams[fam] = Metric(fam, doc, typ)
                key = (fam, name, tuple(sorted(labels.items())))
                seen.add(key)
                m.add_sample(name, dict(labels), value + self._remote(key))
            for key in list(self._sums) + list(self._gauges):
                if key in seen:
                    continue
                seen.add(key)
                fam, name, labels = key
                m = fams.get(fam)
                if m is None:
                    typ, doc = self._meta.get(fam, ("unknown", ""))
                    m = fams[fam] = Metric(fam, doc, typ)
                m.add_sample(name, dict(labels), self._remote(key))
        return list(fams.values())


_MIRROR: Mirror | None = None


def install_mirror(registry=REGISTRY) -> Mirror | None:
    """Put the mirror in place of kvtier's series in this process's registry (once); None when /metrics reads
    multiprocess files (they hold every process's values already)."""
    global _MIRROR
    if serves_files():
        return None
    with _LOCK:
        if _MIRROR is None:
            _import_series()
            local = [series.prom for series in metrics_core.all_series()]
            for c in local:
                with contextlib.suppress(KeyError):  # not registered there
                    registry.unregister(c)
            _MIRROR = Mirror(local)
            registry.register(_MIRROR)
        return _MIRROR


def payloads(data: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The exporter payloads inside a connector-stats dict."""
    return list((data or {}).get(PAYLOAD_KEY) or [])
