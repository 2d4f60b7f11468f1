"""`DualQueueConfig`: the knobs of kvtier's dual-queue scheduling policy, and the `kvtier.scheduler` keys that set them
(`kv_connector_extra_config["kvtier.scheduler"]`, parsed by `DualQueueConfig.from_keys`). Plain Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvtier.scheduler_hooks.hrrn import GiB
from kvtier.scheduler_hooks.load_plan import LOAD_PLAN_KEYS, LoadPlanConfig

__all__ = ["READY_ORDERS", "SCHEDULER_KEYS", "DualQueueConfig"]


READY_ORDERS = ("arrival", "hrrn")
#: keys of `kv_connector_extra_config["kvtier.scheduler"]` (README, "Using kvtier with vLLM")
SCHEDULER_KEYS = ("delay_hit", "delay_hit_own_loads", "delay_hit_threshold_tokens", "starvation_multiple",
                  "starvation_floor_s", "mean_window", "ready_order", "idle_replan_counts_arrivals",
                  "hrrn_service_exponent", "starvation_lookahead") + LOAD_PLAN_KEYS


@dataclass(frozen=True, slots=True)
class DualQueueConfig:
    """Knobs of `DualQueuePolicy` (defaults: the values used in production and by `kvtier simulate`)."""

    delay_hit: bool = True
    #: with `delay_hit`: the idle-GPU re-plan does not recompute an SSD part whose own read is already issued
    delay_hit_own_loads: bool = False
    #: the idle-GPU re-plan charges a recompute with the work expected to arrive while the read is in flight
    #: (`ArrivalLoad`, `LoadPlanner.recompute_now`); False: recompute whenever that is sooner for the request
    idle_replan_counts_arrivals: bool = True
    delay_hit_threshold_tokens: int = 100
    starvation_multiple: float = 4.0
    starvation_floor_s: float = 2.0
    mean_window: int = 256
    hrrn_byte_unit: int = GiB
    #: total GPU KV units (same unit as `gpu_need`); a request needing more can never run, and the starvation bound
    #: does not hold the queue for it (the engine must reject it). None: unknown.
    gpu_capacity: int | None = None
    #: order of the ready queue: `arrival` (FCFS by original arrival) or `hrrn` (by uncached service time)
    ready_order: str = "arrival"
    #: HRRN's aging weight: the ready ratio is (waiting time + 1 ms) / service ** this; 1 is plain HRRN, larger
    #: favours short prefills longer (the starvation bound still caps every wait), 0 is FCFS by arrival
    hrrn_service_exponent: float = 1.0
    #: with `hrrn`: the starvation bound looks ahead - a ready request goes next only if serving it first leaves
    #: every older ready request able to start within the bound (served in arrival order after it, by their
    #: service estimates); otherwise the highest-ratio request that does (the oldest one always does)
    starvation_lookahead: bool = False
    #: the load-or-recompute decision's knobs and cost model (also the service-time estimate of `hrrn`)
    load_plan: LoadPlanConfig = field(default_factory=LoadPlanConfig)

    @classmethod
    def from_keys(cls, keys: dict | None, *, gpu_capacity: int | None = None, kv_bytes_per_token: int | None = None,
                  prefix: str = "kvtier.scheduler") -> DualQueueConfig:
        """Build from the `kvtier.scheduler` dict of `kv_connector_extra_config` (keys: SCHEDULER_KEYS); a wrong key
        or value raises ValueError naming the key and what it accepts."""
        keys = dict(keys or {})
        unknown = sorted(set(keys) - set(SCHEDULER_KEYS))
        if unknown:
            raise ValueError(f"{prefix}: unknown key(s) {', '.join(unknown)}; known: {', '.join(SCHEDULER_KEYS)}")
        out: dict = {}
        for key in ("delay_hit", "delay_hit_own_loads", "idle_replan_counts_arrivals", "starvation_lookahead"):
            if key in keys:
                if not isinstance(keys[key], bool):
                    raise ValueError(f"{prefix}.{key} must be true or false, got {keys[key]!r}")
                out[key] = keys[key]
        for key in ("delay_hit_threshold_tokens", "mean_window"):
            if key in keys:
                v = keys[key]
                if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                    raise ValueError(f"{prefix}.{key} must be an integer >= 1, got {v!r}")
                out[key] = v
        for key, lo in (("starvation_multiple", 0.0), ("starvation_floor_s", None), ("hrrn_service_exponent", None)):
            if key in keys:
                v = keys[key]
                ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and \
                    (v > lo if lo is not None else v >= 0)
                if not ok:
                    raise ValueError(f"{prefix}.{key} must be a number {'> 0' if lo is not None else '>= 0'}, "
                                     f"got {v!r}")
                out[key] = float(v)
        if "ready_order" in keys:
            if keys["ready_order"] not in READY_ORDERS:
                raise ValueError(f"{prefix}.ready_order must be one of {', '.join(READY_ORDERS)}, got "
                                 f"{keys['ready_order']!r}")
            out["ready_order"] = keys["ready_order"]
        plan = LoadPlanConfig.from_keys({k: v for k, v in keys.items() if k in LOAD_PLAN_KEYS},
                                        kv_bytes_per_token=kv_bytes_per_token, prefix=prefix)
        return cls(gpu_capacity=gpu_capacity, load_plan=plan, **out)

    def __post_init__(self) -> None:
        if self.ready_order not in READY_ORDERS:
            raise ValueError(f"ready_order must be one of {', '.join(READY_ORDERS)}, got {self.ready_order!r}")
        if self.delay_hit_threshold_tokens < 1:
            raise ValueError("delay_hit_threshold_tokens must be >= 1")
        if self.starvation_multiple <= 0 or self.starvation_floor_s < 0:
            raise ValueError("starvation_multiple must be > 0 and starvation_floor_s >= 0")
        if self.mean_window < 1:
            raise ValueError("mean_window must be >= 1")
        if not (math.isfinite(self.hrrn_service_exponent) and self.hrrn_service_exponent >= 0):
            raise ValueError("hrrn_service_exponent must be a finite number >= 0")

