"""Prometheus series of the shared tier (`kvtier_shared_*`), process-wide."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_LAT = (0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)

UP = Gauge("kvtier_shared_up", "1 while the shared store answers, 0 while kvtier treats it as down")
HITS = Counter("kvtier_shared_hits_total", "Chunks read from the shared store into the host tier")
MISSES = Counter("kvtier_shared_misses_total", "Chunks asked of the shared store and not delivered", ["reason"])
ERRORS = Counter("kvtier_shared_errors_total", "Shared-store operations that failed (connection, timeout)", ["op"])
WRITES = Counter("kvtier_shared_writes_total", "Chunks written to the shared store")
WRITE_BYTES = Counter("kvtier_shared_write_bytes_total", "Bytes written to the shared store")
READ_BYTES = Counter("kvtier_shared_read_bytes_total", "Bytes read from the shared store")
DROPPED_WRITES = Counter("kvtier_shared_dropped_writes_total", "Chunks not written to the shared store", ["reason"])
QUEUED_BYTES = Gauge("kvtier_shared_queued_write_bytes", "Host memory held by chunks waiting for their shared write")
READ_SECONDS = Histogram("kvtier_shared_read_seconds", "One batched read from the shared store", buckets=_LAT)
WRITE_SECONDS = Histogram("kvtier_shared_write_seconds", "One batch of writes to the shared store", buckets=_LAT)
