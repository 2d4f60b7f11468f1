"""Load or recompute: per request, whether each tier's cached prefix is loaded, prefetched while the request waits,
or recomputed, so that a tier-aware engine is never slower than no cache.

Loading 13k tokens of Llama-3-8B KV from a 1.5 GB/s SSD takes ~1.1 s; recomputing them on an H100 ~0.5 s. An SSD
read is worth it only where something hides it (the request would wait for the GPU anyway) or where the GPU time
it saves is worth more than the wait it costs. Strata's loading-bound batch formation is the anchor: a batch must
not become I/O bound, i.e. no request may carry more exposed load time than the compute it saves.

A prompt's prefix, walked from its first token, is `[0, gpu)` in vLLM's GPU prefix cache, `[gpu, host_end)` in
the host tier, `[host_end, hit_end)` on host or SSD (`ssd_bytes` to read for its SSD-only chunks); the rest is
computed. KV is used as a prefix, so the plan is a *cut*: the request uses its cached prefix up to the cut and
computes everything after it. The three candidate cuts and what each costs (`LoadCostModel`):

    cut = gpu_tokens   recompute host and SSD parts      ready now; GPU: prefill(n - gpu, gpu)
    cut = host_end     load the host part at admission   ready now; GPU: load(host) + prefill(n - host_end, host_end)
    cut = hit_end      prefetch the SSD part into host memory while the request waits, then load host + SSD parts:
                       ready after ssd_wait + ssd_bytes / (ssd_read_bytes_per_s * ssd_read_share);
                       GPU: load(host + SSD) + prefill(n - hit_end, hit_end)

Time to first token from now, with `gpu_wait` the time the request would wait for the GPU anyway:

    ttft(cut) = max(gpu_wait, ready(cut)) + gpu_seconds(cut)

The plan minimises `ttft(cut) + recompute_gpu_weight * gpu_seconds(cut)`: weight 0 is "never slower than no cache"
for the request itself; a positive weight also charges the GPU time a recompute takes from the requests queued
behind it (the engine's other customers). Ties go to the larger cut (fewer GPU seconds). The default weight is
large: a request then prefetches its SSD part, and `recompute_now` recomputes it instead when the GPU is about to
idle while its read has not landed (`DualQueuePolicy.replan_idle`): never slower than no cache at an idle GPU,
and no GPU time taken from queued requests otherwise. Under load `recompute_now` also charges the work expected to
arrive during the read (the GPU's busy share times the read's time), which would otherwise use the GPU's idle
window: recompute iff `fallback_gpu_s + load * read_s < read_s + gpu_s`. That combination queued best on the first
15 minutes of the Mooncake conversation trace (`benchmarks/scheduler_sim.py --tune`); weight 0 recomputed ~10% of
the SSD hits at arrival and queued ~5% longer.

The cost model's numbers (SSD and host bandwidth, prefill cost per token for this model and device) are
configurable (`LoadPlanConfig`, from the `kvtier.scheduler` keys) and calibrated online where measured:
`LoadPlanner.observe_ssd_read(nbytes, seconds)` (each prefetch) and `observe_prefill(new, cached, seconds)` (each
prefill) move exponentially weighted estimates. Decisions are counted in `kvtier_load_plan_*` metrics
(`kvtier.scheduler_hooks.metrics`). Plain Python: no vLLM import.
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from kvtier.scheduler_hooks import metrics as M

logger = logging.getLogger(__name__)

__all__ = [
    "PlanSource",
    "LOAD_PLAN_KEYS",
    "LoadAction",
    "LoadCostModel",
    "LoadPlan",
    "LoadPlanConfig",
    "LoadPlanner",
    "PlanContext",
]


class LoadAction(str, enum.Enum):
    """What happens to one tier's part of a request's cached prefix."""

    NONE = "none"  #: the tier holds nothing of this prefix
    LOAD = "load"  #: loaded when the request is admitted (host -> GPU)
    PREFETCH = "prefetch"  #: read from SSD into host memory while the request waits, then loaded
    RECOMPUTE = "recompute"  #: not used: its tokens are computed again


@dataclass(frozen=True, slots=True)
class LoadCostModel:
    """Seconds of the transfers and prefills a plan compares. Defaults: Llama-3-8B on one H100 with a 1.5 GB/s SSD
    (the `llama3-8b-h100` profile of `kvtier simulate`)."""

    kv_bytes_per_token: int = 131_072
    ssd_read_bytes_per_s: float = 1.5e9
    host_load_bytes_per_s: float = 25e9
    prefill_s_per_token: float = 3.247e-5  #: 2 * params / (peak FLOP/s * MFU)
    prefill_s_per_token_pair: float = 1.06e-9  #: attention: 4 * layers * heads * head_dim / (peak FLOP/s * MFU)
    prefill_overhead_s: float = 0.003

    def __post_init__(self) -> None:
        for name in ("kv_bytes_per_token", "ssd_read_bytes_per_s", "host_load_bytes_per_s", "prefill_s_per_token"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
                raise ValueError(f"LoadCostModel.{name} must be a finite number > 0, got {v!r}")
        for name in ("prefill_s_per_token_pair", "prefill_overhead_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v >= 0 and math.isfinite(v)):
                raise ValueError(f"LoadCostModel.{name} must be a finite number >= 0, got {v!r}")

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        n = max(int(new_tokens), 0)
        if n == 0:
            return 0.0
        return self.prefill_overhead_s + n * self.prefill_s_per_token + \
            self.prefill_s_per_token_pair * n * (max(cached_tokens, 0) + n / 2)

    def host_load_s(self, nbytes: float) -> float:
        return max(nbytes, 0) / self.host_load_bytes_per_s

    def ssd_read_s(self, nbytes: float, share: float = 1.0) -> float:
        return max(nbytes, 0) / (self.ssd_read_bytes_per_s * min(max(share, 1e-3), 1.0))


@dataclass(frozen=True, slots=True)
class PlanContext:
    """What the caller knows about the engine right now (estimates are fine; all in seconds)."""

    #: how long the request would wait for the GPU anyway (queued work ahead of it + the running remainder)
    gpu_wait_s: float = 0.0
    #: the same as a function of the request's own GPU seconds, where the ready order depends on them (HRRN: a
    #: short job overtakes long ones); None: `gpu_wait_s` for every candidate
    gpu_wait_fn: Callable[[float], float] | None = None
    #: how long until the SSD could start this request's read (reads queued or in flight ahead of it)
    ssd_wait_s: float = 0.0
    #: fraction of the SSD's read bandwidth the read will get (1.0 idle; less while write-back shares the device)
    ssd_read_share: float = 1.0


#: the default context: nothing known about the engine (no GPU wait, no SSD backlog)
IDLE_ENGINE = PlanContext()


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """The decision for one request: an action per tier, the prefix it will use, and the estimates behind it."""

    host: LoadAction
    ssd: LoadAction
    #: prefix tokens the request uses from vLLM's cache and the tiers (it computes the rest)
    use_tokens: int
    #: estimated time to first token of the chosen plan, and of recomputing everything past the GPU cache
    ttft_s: float = 0.0
    recompute_ttft_s: float = 0.0
    #: estimated GPU seconds of the chosen plan
    gpu_s: float = 0.0
    #: seconds until the prefetched part is in host memory (0 if nothing is prefetched)
    ready_s: float = 0.0
    #: what the request uses, its host action and its GPU seconds if its SSD part is recomputed after all
    #: (`LoadPlanner.replan_idle`); equal to the plan's own values when nothing is prefetched
    fallback_use_tokens: int = 0
    fallback_host: LoadAction = LoadAction.NONE
    fallback_gpu_s: float = 0.0
    reason: str = ""

    @property
    def waits_for_ssd(self) -> bool:
        return self.ssd is LoadAction.PREFETCH

    @property
    def recomputes_cached(self) -> bool:
        return LoadAction.RECOMPUTE in (self.host, self.ssd)


#: the `kvtier.scheduler` keys that configure the load plan (documented in README, "Using kvtier with vLLM")
LOAD_PLAN_KEYS = ("load_or_recompute", "ssd_read_gbps", "host_load_gbps", "prefill_us_per_token",
                  "prefill_ns_per_token_pair", "prefill_overhead_ms", "kv_bytes_per_token", "recompute_gpu_weight",
                  "calibrate", "calibration_weight")


@dataclass(frozen=True, slots=True)
class LoadPlanConfig:
    """Knobs of the load plan (`kvtier.scheduler` keys of the same names)."""

    #: False: always load whatever is cached (the plan then only reports)
    load_or_recompute: bool = True
    cost: LoadCostModel = field(default_factory=LoadCostModel)
    #: GPU seconds of a plan are charged this much on top of its TTFT. 0: the request's own TTFT only (recompute
    #: whenever that is sooner); the default, large, makes the plan recompute only where the GPU would otherwise
    #: idle (`recompute_now`), which queued best in the simulator (a recompute delays everyone queued behind it)
    recompute_gpu_weight: float = 1000.0
    #: move the SSD bandwidth and prefill speed toward what is observed
    calibrate: bool = True
    #: weight of one observation in the exponentially weighted estimates
    calibration_weight: float = 0.1

    def __post_init__(self) -> None:
        if not (self.recompute_gpu_weight >= 0 and math.isfinite(self.recompute_gpu_weight)):
            raise ValueError("recompute_gpu_weight must be a finite number >= 0")
        if not 0 < self.calibration_weight <= 1:
            raise ValueError("calibration_weight must be in (0, 1]")

    @classmethod
    def from_keys(cls, keys: Mapping[str, Any], *, kv_bytes_per_token: int | None = None,
                  prefix: str = "kvtier.scheduler") -> LoadPlanConfig:
        """Build from the `kvtier.scheduler` dict (only LOAD_PLAN_KEYS are read); errors name the key and the fix.

        `kv_bytes_per_token` is the model's KV size (the vLLM hook derives it from the KV cache spec); an explicit
        `kv_bytes_per_token` key wins."""
        base = LoadCostModel()
        cost: dict[str, Any] = {}

        def number(key: str, lo_exclusive: bool = True) -> float | None:
            if key not in keys:
                return None
            v = keys[key]
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and \
                (v > 0 if lo_exclusive else v >= 0)
            if not ok:
                raise ValueError(f"{prefix}.{key} must be a number {'>' if lo_exclusive else '>='} 0, got {v!r}")
            return float(v)

        for key, attr, scale in (("ssd_read_gbps", "ssd_read_bytes_per_s", 1e9),
                                 ("host_load_gbps", "host_load_bytes_per_s", 1e9),
                                 ("prefill_us_per_token", "prefill_s_per_token", 1e-6)):
            v = number(key)
            if v is not None:
                cost[attr] = v * scale
        for key, attr, scale in (("prefill_ns_per_token_pair", "prefill_s_per_token_pair", 1e-9),
                                 ("prefill_overhead_ms", "prefill_overhead_s", 1e-3)):
            v = number(key, lo_exclusive=False)
            if v is not None:
                cost[attr] = v * scale
        kvb = keys.get("kv_bytes_per_token", kv_bytes_per_token)
        if kvb is not None:
            if not isinstance(kvb, int) or isinstance(kvb, bool) or kvb <= 0:
                raise ValueError(f"{prefix}.kv_bytes_per_token must be an integer > 0, got {kvb!r}")
            cost["kv_bytes_per_token"] = kvb
        out: dict[str, Any] = {"cost": replace(base, **cost)}
        for key in ("load_or_recompute", "calibrate"):
            if key in keys:
                if not isinstance(keys[key], bool):
                    raise ValueError(f"{prefix}.{key} must be true or false, got {keys[key]!r}")
                out[key] = keys[key]
        w = number("recompute_gpu_weight", lo_exclusive=False)
        if w is not None:
            out["recompute_gpu_weight"] = w
        cw = number("calibration_weight")
        if cw is not None:
            if cw > 1:
                raise ValueError(f"{prefix}.calibration_weight must be in (0, 1], got {cw!r}")
            out["calibration_weight"] = cw
        return cls(**out)


class PlanSource(Protocol):
    """What hands a request's load plan to `derive_tier_hint`: a `LoadPlanner`, or a plan already made."""

    def plan(self, *, prompt_tokens: int, gpu_tokens: int, host_end: int, hit_end: int, ssd_tokens: int,
             ssd_bytes: int, context: PlanContext = ..., ssd_committed: bool = False) -> LoadPlan: ...


class LoadPlanner:
    """Makes `LoadPlan`s with a (calibrated) `LoadCostModel`. One per engine; cheap to call (a few float ops)."""

    def __init__(self, config: LoadPlanConfig | None = None) -> None:
        self.config = config or LoadPlanConfig()
        self.cost = self.config.cost
        self._prefill_scale = 1.0
        self.stats = {"plans": 0, "plan_prefetch": 0, "plan_recompute_ssd": 0, "plan_recompute_host": 0,
                      "replan_recompute_ssd": 0, "ssd_observations": 0, "prefill_observations": 0}

    # --- calibration ---------------------------------------------------------------------------------------------
    def observe_ssd_read(self, nbytes: int, seconds: float) -> None:
        """A read of `nbytes` from the SSD tier took `seconds` (e.g. one prefetch)."""
        if not self.config.calibrate or nbytes <= 0 or not seconds > 0:
            return
        w = self.config.calibration_weight
        bw = (1 - w) * self.cost.ssd_read_bytes_per_s + w * (nbytes / seconds)
        self.cost = replace(self.cost, ssd_read_bytes_per_s=bw)
        self.stats["ssd_observations"] += 1
        M.SSD_READ_BPS.set(bw)

    def observe_prefill(self, new_tokens: int, cached_tokens: int, seconds: float) -> None:
        """A prefill of `new_tokens` after `cached_tokens` took `seconds`: scales every prefill term."""
        if not self.config.calibrate or new_tokens <= 0 or not seconds > 0:
            return
        base = self.config.cost.prefill_s(new_tokens, cached_tokens)
        w = self.config.calibration_weight
        self._prefill_scale = (1 - w) * self._prefill_scale + w * (seconds / base)
        c = self.config.cost
        self.cost = replace(self.cost, prefill_s_per_token=c.prefill_s_per_token * self._prefill_scale,
                            prefill_s_per_token_pair=c.prefill_s_per_token_pair * self._prefill_scale,
                            prefill_overhead_s=c.prefill_overhead_s * self._prefill_scale)
        self.stats["prefill_observations"] += 1
        M.PREFILL_SCALE.set(self._prefill_scale)

    # --- the decision --------------------------------------------------------------------------------------------
    def service_s(self, prompt_tokens: int, use_tokens: int, loaded_tokens: int = 0) -> float:
        """Estimated GPU seconds of a request that uses `use_tokens` cached tokens, `loaded_tokens` of them loaded
        over PCIe (the rest in vLLM's GPU cache)."""
        c = self.cost
        return c.host_load_s(loaded_tokens * c.kv_bytes_per_token) + c.prefill_s(prompt_tokens - use_tokens,
                                                                                 use_tokens)

    def plan(self, *, prompt_tokens: int, gpu_tokens: int, host_end: int, hit_end: int, ssd_tokens: int,
             ssd_bytes: int, context: PlanContext = IDLE_ENGINE, ssd_committed: bool = False) -> LoadPlan:
        """The plan for one request. Token counts as in `kvtier.connector.messages.LookupResult`; `gpu_tokens` is
        vLLM's own hit. `ssd_committed`: its SSD read is already issued or done, so the plan keeps it
        (`context.ssd_wait_s` is then the read's remaining time)."""
        c = self.cost
        n = max(int(prompt_tokens), 0)
        gpu = min(max(int(gpu_tokens), 0), n)
        host_end = min(max(int(host_end), gpu), n)
        hit_end = min(max(int(hit_end), host_end), n)
        ssd_tokens = max(int(ssd_tokens), 0) if hit_end > host_end else 0
        wait = max(context.gpu_wait_s, 0.0)
        weight = self.config.recompute_gpu_weight

        # candidate cuts: (use, host action, ssd action, ready_s, gpu_s)
        cands: list[tuple[int, LoadAction, LoadAction, float, float]] = []
        host_none = host_end <= gpu and hit_end - ssd_tokens <= host_end
        ssd_none = ssd_tokens == 0 and ssd_bytes <= 0
        no_host = LoadAction.NONE if host_none else LoadAction.RECOMPUTE
        no_ssd = LoadAction.NONE if ssd_none else LoadAction.RECOMPUTE
        cands.append((gpu, no_host, no_ssd, 0.0, self.service_s(n, gpu)))
        if host_end > gpu:
            cands.append((host_end, LoadAction.LOAD, no_ssd, 0.0, self.service_s(n, host_end, host_end - gpu)))
        if hit_end > host_end:
            ready = max(context.ssd_wait_s, 0.0)
            if not ssd_committed:
                ready += c.ssd_read_s(ssd_bytes, context.ssd_read_share)
            cands.append((hit_end, LoadAction.LOAD if hit_end - ssd_tokens > gpu else LoadAction.NONE,
                          LoadAction.PREFETCH, ready, self.service_s(n, hit_end, hit_end - gpu)))
        fn = context.gpu_wait_fn
        waits = [max(fn(k[4]), 0.0) if fn is not None else wait for k in cands]
        if not self.config.load_or_recompute or ssd_committed:
            i = len(cands) - 1
        else:  # ties: the larger cut (fewer GPU seconds)
            i = min(reversed(range(len(cands))),
                    key=lambda j: max(waits[j], cands[j][3]) + cands[j][4] + weight * cands[j][4])
        use, host_a, ssd_a, ready, gpu_s = cands[i]
        fb = cands[-2] if len(cands) > 1 and ssd_a is LoadAction.PREFETCH else None
        plan = LoadPlan(host=host_a, ssd=ssd_a, use_tokens=use, ttft_s=max(waits[i], ready) + gpu_s,
                        recompute_ttft_s=waits[0] + cands[0][4], gpu_s=gpu_s, ready_s=ready,
                        fallback_use_tokens=fb[0] if fb else use, fallback_host=fb[1] if fb else host_a,
                        fallback_gpu_s=fb[4] if fb else gpu_s,
                        reason=_reason(use, gpu, host_end, hit_end, ready, waits[i]))
        self.stats["plans"] += 1
        if ssd_a is LoadAction.PREFETCH:
            self.stats["plan_prefetch"] += 1
        elif ssd_a is LoadAction.RECOMPUTE:
            self.stats["plan_recompute_ssd"] += 1
        if host_a is LoadAction.RECOMPUTE:
            self.stats["plan_recompute_host"] += 1
        if ssd_a is not LoadAction.NONE:
            M.DECISION["ssd", ssd_a.value].inc()
            if ssd_a is LoadAction.RECOMPUTE:
                M.RECOMPUTED["ssd"].inc(hit_end - host_end)
        if host_a is not LoadAction.NONE:
            M.DECISION["host", host_a.value].inc()
            if host_a is LoadAction.RECOMPUTE:
                M.RECOMPUTED["host"].inc(max(host_end - gpu, 0))
        return plan


    def recompute_now(self, plan: LoadPlan, read_s: float, arriving_load: float = 0.0) -> LoadPlan | None:
        """For a request whose SSD read has not landed while the GPU would otherwise idle: the plan that recomputes
        its SSD part instead, if that leaves less work on the GPU when the read would have landed; else None.

        `read_s`: seconds until its read lands, at best. Waiting leaves the GPU idle for `read_s`, then runs the
        request (`plan.gpu_s`); recomputing runs `plan.fallback_gpu_s` now, and work that arrives meanwhile
        (`arriving_load` GPU seconds per second, `ArrivalLoad`) queues behind it instead of using the idle time.
        Recompute iff `fallback_gpu_s + arriving_load * read_s < read_s + gpu_s`. With `arriving_load=0` (no
        other work expected) that is "an earlier first token than reading it": never slower than no cache at an
        idle GPU; under load it also keeps the GPU time the arrivals would have used."""
        if plan.ssd is not LoadAction.PREFETCH or not self.config.load_or_recompute:
            return None
        if self.idle_gain_s(plan, read_s, arriving_load) <= 0:
            return None
        self.stats["replan_recompute_ssd"] += 1
        M.DECISION["ssd", "recompute"].inc()
        M.RECOMPUTED["ssd"].inc(max(plan.use_tokens - plan.fallback_use_tokens, 0))
        return replace(plan, ssd=LoadAction.RECOMPUTE, host=plan.fallback_host, use_tokens=plan.fallback_use_tokens,
                       ttft_s=plan.fallback_gpu_s, gpu_s=plan.fallback_gpu_s, ready_s=0.0,
                       reason="the GPU is idle: recomputing the SSD part beats waiting for its read")

    @staticmethod
    def idle_gain_s(plan: LoadPlan, read_s: float, arriving_load: float = 0.0) -> float:
        """GPU work (seconds) that recomputing `plan`'s SSD part at an idle GPU saves against waiting `read_s` for
        its read, net of the work arriving meanwhile (`recompute_now`); > 0: recompute."""
        rho = min(max(arriving_load, 0.0), 1.0)
        return (1.0 - rho) * max(read_s, 0.0) + plan.gpu_s - plan.fallback_gpu_s


def _reason(use: int, gpu: int, host_end: int, hit_end: int, ready: float, wait: float) -> str:
    if use == hit_end and hit_end > host_end:
        return "SSD read hidden by the GPU wait" if ready <= wait else "waiting for the SSD read beats recomputing"
    if hit_end > host_end:
        return "recomputing the SSD part beats waiting for its read"
    if use == host_end and host_end > gpu:
        return "host load beats recomputing"
    if host_end > gpu:
        return "recomputing the host part beats loading it"
    return "nothing cached beyond the GPU"
