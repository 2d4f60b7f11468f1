"""Metrics of the scheduling core (`prometheus_client`, process-wide): the load-or-recompute decisions.

- `kvtier_load_plan_decisions_total{tier, action}`: one per plan and tier holding part of the prefix (`tier`:
  host, ssd; `action`: load, prefetch, recompute); re-plans at an idle GPU count as `ssd`/`recompute` again.
- `kvtier_load_plan_recomputed_tokens_total{tier}`: cached tokens the plans chose to recompute.
- `kvtier_load_plan_ssd_read_bytes_per_second` / `kvtier_load_plan_prefill_scale`: the calibrated estimates.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

DECISIONS = Counter("kvtier_load_plan_decisions_total",
                    "Load-or-recompute decisions per tier holding part of a request's prefix", ["tier", "action"])
RECOMPUTED_TOKENS = Counter("kvtier_load_plan_recomputed_tokens_total",
                            "Cached prefix tokens a load plan chose to recompute", ["tier"])
SSD_READ_BPS = Gauge("kvtier_load_plan_ssd_read_bytes_per_second", "The load plan's (calibrated) SSD read bandwidth")
PREFILL_SCALE = Gauge("kvtier_load_plan_prefill_scale", "Observed / modelled prefill time (calibration)")

# bound once: a labelled child per combination, so a plan costs two dictionary lookups, not label parsing
DECISION = {(t, a): DECISIONS.labels(t, a) for t in ("host", "ssd") for a in ("load", "prefetch", "recompute")}
RECOMPUTED = {t: RECOMPUTED_TOKENS.labels(t) for t in ("host", "ssd")}
