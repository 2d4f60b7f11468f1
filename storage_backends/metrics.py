"""Prometheus metrics of kvtier's storage side (process-wide; per-tier exact counts live in `TierStats`); declared
through `kvtier.telemetry.series`, so vLLM's API server can show them (`kvtier.connector.metrics_export`)."""

from __future__ import annotations

from kvtier.telemetry.series import counter, gauge, histogram

SSD_PUTS = counter("kvtier_ssd_puts_total", "Chunks committed to the SSD tier")
SSD_DROPPED = counter("kvtier_ssd_dropped_puts_total", "Chunks not stored on the SSD tier", ["reason"])
SSD_HITS = counter("kvtier_ssd_hits_total", "Chunks served from the SSD tier")
SSD_MISSES = counter("kvtier_ssd_misses_total", "SSD-tier lookups or reads that found no usable chunk")
SSD_CORRUPT = counter("kvtier_ssd_corrupt_chunks_total", "Chunks dropped on read: checksum, torn, wrong key "
                      "or layout", ["reason"])
SSD_EVICTIONS = counter("kvtier_ssd_evictions_total", "Chunks evicted from the SSD tier for capacity")
SSD_BYTES_READ = counter("kvtier_ssd_read_bytes_total", "Bytes read from the SSD tier")
SSD_BYTES_WRITTEN = counter("kvtier_ssd_written_bytes_total", "Bytes written to the SSD tier")
SSD_USED_BYTES = gauge("kvtier_ssd_used_bytes", "Bytes of committed slots in the SSD tier")
SSD_FOREIGN_CHUNKS = gauge("kvtier_ssd_foreign_chunks", "Committed chunks of another KV identity (other weights, "
                           "config, layout, ...) in the SSD tier: never served, reclaimed first")
SSD_PREPARED_BYTES = counter("kvtier_ssd_prepared_bytes_total", "Bytes of slot files zeroed ahead of use "
                             "(kvtier.prepare_slots)")
SSD_INFLIGHT_WRITE_BYTES = gauge("kvtier_ssd_inflight_write_bytes", "Host bytes held by queued SSD writes")
SSD_READ_SECONDS = histogram("kvtier_ssd_read_seconds", "Latency of one batched SSD-tier read",
                             buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
SSD_WRITE_SECONDS = histogram("kvtier_ssd_write_seconds", "Latency from submit to commit of one chunk",
                              buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))

# LMCache multiprocess-mode L2 adapter (lmcache_mp_adapter.py)
MP_STORE_TASKS = counter("kvtier_mp_store_tasks_total", "Store tasks of LMCache's MP server completed by kvtier's "
                         "L2 adapter", ["result"])
MP_LOOKUP_CHUNKS = counter("kvtier_mp_lookup_chunks_total", "Chunks looked up (and locked when found) by LMCache's "
                           "MP server in kvtier's L2 adapter", ["result"])
MP_LOAD_CHUNKS = counter("kvtier_mp_load_chunks_total", "Chunks LMCache's MP server asked kvtier's L2 adapter to "
                         "load: hit, miss, layout_mismatch (a chunk of another layout than the buffer)", ["result"])
# vLLM's own offloading: kvtier's SSD tier as a secondary tier (vllm_offload/secondary_tier.py)
VLLM_TIER_LOOKUPS = counter("kvtier_vllm_tier_lookups_total", "Chunk lookups of vLLM's tiering manager in kvtier's "
                            "secondary tier", ["result"])
VLLM_TIER_JOBS = counter("kvtier_vllm_tier_jobs_total", "Store and load jobs of vLLM's tiering manager finished by "
                         "kvtier's secondary tier: ok, partial (loads: some chunks failed a check), failed",
                         ["kind", "result"])
VLLM_TIER_LOAD_CHUNKS = counter("kvtier_vllm_tier_load_chunks_total", "Chunks vLLM's tiering manager asked kvtier's "
                                "secondary tier to load: loaded, or failed (evicted since the lookup, or failing a "
                                "check: vLLM recomputes them)", ["result"])
HOST_POOL_EXHAUSTED = counter("kvtier_host_pool_exhausted_total",
                              "Allocations in LMCache's host pool (max_local_cpu_size) that failed even after "
                              "eviction, by what needed the room (store: a chunk LMCache could not store; "
                              "ssd_read: an SSD chunk not staged in host memory)", ["op"])
HOST_POOL_LOST = counter("kvtier_host_pool_lost_chunks_total",
                         "Chunks kvtier's connector could not store even after waiting for queued SSD writes "
                         "(later misses), by operation", ["op"])
# write admission (storage_backends/admission/, `kvtier.ssd_admission`)
SSD_ADMISSION_CHUNKS = counter("kvtier_ssd_admission_chunks_total", "Chunks the connector saved, by the SSD tier's "
                               "admission decision: admitted (written to SSD too) or refused (host tier only)",
                               ["decision"])
SSD_ADMISSION_SKIPPED = counter("kvtier_ssd_admission_skipped_writes_total", "Chunks LMCache handed the SSD tier "
                                "that write admission kept off the SSD")
