"""The connector's metrics: Prometheus series (process-wide) and `KVTierConnectorStats` for vLLM's stats path.

Scheduler side: hit tokens per tier at admission, prefetch queue depth and wait, delayed block frees. Worker side:
load/save/prefetch latency and bytes, loads by mode (inside or off the step), transfers in flight and their queueing,
preemption flushes, blocks reported as load errors. The SSD tier's own series
(`kvtier_ssd_*`, incl. corrupt-chunk drops) come from `kvtier.storage_backends.metrics`.

`KVTierConnectorStats` carries the interval's counters for vLLM's "KV Transfer metrics" log line and, under
`data["prom"]`, the engine-side processes' changes of these series to the API server (`KVTierPromMetrics`, see
`kvtier.connector.metrics_export`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvtier.connector import metrics_export
from kvtier.telemetry.series import counter, gauge, histogram


def kvtier_samples() -> dict[str, float]:
    """Every `kvtier_*` Prometheus sample of this process, flattened to `name/label=value...` -> value."""
    from prometheus_client import REGISTRY

    out: dict[str, float] = {}
    for fam in REGISTRY.collect():
        if fam.name.startswith("kvtier_"):
            for s in fam.samples:
                out[s.name + "".join(f"/{k}={v}" for k, v in sorted(s.labels.items()))] = s.value
    return out


_LAT = (0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)

HIT_TOKENS = counter("kvtier_connector_hit_tokens_total",
                     "Prompt tokens of admitted requests by where their KV came from (gpu = vLLM prefix cache)",
                     ["tier"])
IDEAL_HIT_TOKENS = counter("kvtier_connector_ideal_hit_tokens_total",
                           "Prompt tokens of admitted requests that an engine whose own cache held everything it ever "
                           "computed would have reused (the limit; kvtier.telemetry.lost_hits)")
LOST_HIT_TOKENS = counter("kvtier_connector_lost_hit_tokens_total",
                          "Prompt tokens the limit reused and this engine recomputed, by reason: found but recomputed "
                          "(load plan), save in flight, not saved, evicted, not found (no whole chunk)", ["reason"])
BEYOND_IDEAL_HIT_TOKENS = counter("kvtier_connector_beyond_ideal_hit_tokens_total",
                                  "Prompt tokens reused past the limit (KV stored before this process started)")
QUERY_TOKENS = counter("kvtier_connector_query_tokens_total", "Prompt tokens of admitted requests")
PREFETCH_QUEUE = gauge("kvtier_connector_prefetch_queue_depth", "SSD prefetches waiting to be issued")
PREFETCH_INFLIGHT = gauge("kvtier_connector_prefetch_inflight", "SSD prefetches issued and not finished")
PREFETCH_WAIT = histogram("kvtier_connector_prefetch_wait_seconds",
                          "From a request's arrival to its SSD data being in host memory", buckets=_LAT)
PREFETCH_SECONDS = histogram("kvtier_connector_prefetch_seconds", "One SSD -> host prefetch (worker)", buckets=_LAT)
PREFETCH_BYTES = counter("kvtier_connector_prefetch_bytes_total", "Bytes prefetched from SSD into host memory")
PREFETCH_SHARED_CHUNKS = counter("kvtier_connector_prefetch_shared_chunks_total",
                                 "Chunks a prefetch took from another prefetch's SSD read in flight instead of "
                                 "reading them again")
LOAD_SECONDS = histogram("kvtier_connector_load_seconds", "Host -> KV cache load of one step", buckets=_LAT)
SAVE_SECONDS = histogram("kvtier_connector_save_seconds", "KV cache -> host save of one step", buckets=_LAT)
LOOKUP_SECONDS = histogram("kvtier_connector_lookup_seconds",
                           "One tier lookup (scheduler -> worker RPC, every rank); the scheduler waits for it",
                           buckets=_LAT)
LOAD_BYTES = counter("kvtier_connector_load_bytes_total", "Bytes loaded into vLLM's KV cache")
SAVE_BYTES = counter("kvtier_connector_save_bytes_total", "Bytes saved from vLLM's KV cache")
STREAMED_TOKENS = counter("kvtier_connector_ssd_streamed_tokens_total",
                          "Tokens a load streamed from the SSD tier through the staging area (no host room for them)")
LOAD_ERROR_BLOCKS = counter("kvtier_connector_load_error_blocks_total",
                            "KV blocks that failed to load and were handed back to vLLM for recomputation")
LOADS = counter("kvtier_connector_loads_total",
                "Loads into vLLM's KV cache by how they ran: inside the engine step (sync) or off it (async)", ["mode"])
TRANSFERS_INFLIGHT = gauge("kvtier_connector_transfers_inflight",
                           "Loads and saves queued or running on the worker's transfer thread", ["op"])
TRANSFER_QUEUE_SECONDS = histogram("kvtier_connector_transfer_queue_seconds",
                                   "From a load's or save's submission to the end of its run on the transfer thread",
                                   buckets=_LAT, labelnames=["op"])
DELAYED_FREES = counter("kvtier_connector_delayed_frees_total",
                        "Finished requests whose blocks vLLM kept (delay_free_blocks) until their saves were done")
PREEMPTION_FLUSHES = counter("kvtier_connector_preemption_flushes_total",
                             "Preempted requests whose saves in flight finished before their blocks were reused")
PREEMPTION_FLUSH_SECONDS = histogram("kvtier_connector_preemption_flush_seconds",
                                     "Time the step waited for preempted requests' saves in flight", buckets=_LAT)
ENGINE_STEPS = counter("kvtier_connector_engine_steps_total",
                       "Engine steps the scheduler side saw: all of them (kind=all), those that scheduled no token "
                       "(idle) and those that ran while an asynchronous load was in flight (during_async_load)",
                       ["kind"])
IDLE_WAIT_SECONDS = histogram("kvtier_connector_idle_wait_seconds",
                              "Engine steps with nothing to compute: time the worker waited (GIL released) for a "
                              "load, prefetch or save in flight to end", buckets=_LAT)
FEEDBACK = counter("kvtier_connector_answer_feedback_total",
                   "Finished requests whose answer length reached the eviction policy")

_SUM_KEYS = ("loads", "loaded_tokens", "load_seconds", "saves", "saved_tokens", "save_seconds", "load_error_blocks",
             "prefetches", "prefetched_tokens", "prefetch_seconds", "feedback", "async_loads", "preemption_flushes",
             "prefetch_shared_chunks", "idle_waits", "idle_wait_seconds", "streamed_tokens")


@dataclass
class KVTierConnectorStats(KVConnectorStats):
    """Counters of one interval (worker side), summed over workers and steps."""

    def __post_init__(self) -> None:
        for k in _SUM_KEYS:
            self.data.setdefault(k, 0)

    def add(self, **kw: float) -> None:
        for k, v in kw.items():
            self.data[k] = self.data.get(k, 0) + v

    def add_export(self, payload: dict[str, Any] | None) -> KVTierConnectorStats:
        """Attach a `metrics_export.Exporter` payload (this process's series changes) for the API server."""
        if payload:
            self.data.setdefault(metrics_export.PAYLOAD_KEY, []).append(payload)
        return self

    def reset(self) -> None:
        fresh: dict[str, Any] = dict.fromkeys(_SUM_KEYS, 0)
        self.data = fresh

    def aggregate(self, other: KVConnectorStats) -> KVTierConnectorStats:
        for k, v in (other.data or {}).items():
            if k == metrics_export.PAYLOAD_KEY:
                self.data.setdefault(k, []).extend(v)  # changes of different processes or steps: keep them all
            elif isinstance(v, (int, float)):
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = {
            "kvtier_loads": int(d["loads"]), "kvtier_loaded_tokens": int(d["loaded_tokens"]),
            "kvtier_saved_tokens": int(d["saved_tokens"]), "kvtier_prefetched_tokens": int(d["prefetched_tokens"]),
            "kvtier_load_error_blocks": int(d["load_error_blocks"]), "kvtier_async_loads": int(d["async_loads"]),
            "kvtier_streamed_tokens": int(d["streamed_tokens"]),
        }
        if d["loads"]:
            out["kvtier_avg_load_ms"] = round(1000 * d["load_seconds"] / d["loads"], 3)
        if d["saves"]:
            out["kvtier_avg_save_ms"] = round(1000 * d["save_seconds"] / d["saves"], 3)
        if d["prefetches"]:
            out["kvtier_avg_prefetch_ms"] = round(1000 * d["prefetch_seconds"] / d["prefetches"], 3)
        if d["idle_waits"]:
            out["kvtier_idle_waits"] = int(d["idle_waits"])
            out["kvtier_avg_idle_wait_ms"] = round(1000 * d["idle_wait_seconds"] / d["idle_waits"], 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in _SUM_KEYS) and not self.data.get(metrics_export.PAYLOAD_KEY)

    def snapshot(self) -> dict[str, Any]:
        return dict(self.data)


class KVTierPromMetrics(KVConnectorPromMetrics):
    """The API server's end of the stats path: hands each step's exporter payloads to the process's mirror."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.mirror = metrics_export.install_mirror()

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        if self.mirror is None:
            return
        for payload in metrics_export.payloads(transfer_stats_data):
            self.mirror.apply(payload)
