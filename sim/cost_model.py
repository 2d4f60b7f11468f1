"""The cost model of `kvtier simulate`: how long GPU work and KV transfers take, and how much each tier holds.

Everything is derived from a few hardware and model numbers (kept in `HardwareSpec` / `ModelSpec` so a reader can
check the arithmetic), then frozen into a `CostProfile` that the simulator queries.

GPU compute (one GPU, prefills served one at a time; see `kvtier.sim.engine` for the queueing model):
- prefill of `n` new tokens after `c` cached ones:
      overhead + n * linear_s_per_token + attn_s_per_pair * n * (c + n / 2)
  linear_s_per_token = 2 * params / (peak_flops * mfu)          (the matmuls of every weight, per token)
  attn_s_per_pair    = 4 * layers * heads * head_dim / (peak_flops * mfu)   (QK^T and AV, causal pairs)
- decode: continuous batching at a typical batch size `decode_batch`. A request's share of GPU time per output token
  is weights / (hbm_bw * decode_batch) + its own KV / hbm_bw (every step reads the weights once for the batch and
  the request's KV for itself); it holds its GPU KV for output_tokens * tpot_s of wall time, tpot_s being one
  decode step of that batch at the trace's mean context.
- chunked prefill: a prefill runs in chunks of `prefill_chunk_tokens` (vLLM's token budget per step); the engine
  can admit the next request when a running prefill reaches its last chunk (the simulator's computing window).
Transfers: host -> GPU over PCIe at `pcie_bytes_per_s`; SSD -> host at `ssd_read_bytes_per_s` and write-back at
`ssd_write_bytes_per_s`, on one device that reads and writes share (`kvtier.sim.ssd`).
Capacities: GPU KV = gpu_mem * gpu_mem_util - weights - activation reserve; host and SSD tiers as given.

Profiles:
- `llama3-8b-h100` (default): Llama-3-8B (GQA: 8 KV heads x 128 dims x 32 layers x 2 (K,V) x 2 bytes
  = 128 KiB of KV per token) on one 80 GB H100-class GPU, 200 GB host tier, one SSD reading and writing
  1.5 GB/s, PCIe 4 x16 (Bidaw's storage setup), chunked prefill of 8,192 tokens per step.
- `opt-13b-a800`: Bidaw's OPT-13B (MHA, 800 KiB/token) on an 80 GB A800. Its GPU holds ~50k tokens of KV, so
  the Mooncake trace's longest prompts do not fit (the simulator counts them as rejected).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

logger = logging.getLogger(__name__)

__all__ = ["PROFILES", "CostProfile", "HardwareSpec", "ModelSpec", "build_profile", "get_profile"]

GB = 10**9


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    params: float  #: parameter count
    layers: int
    heads: int  #: query heads
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes


@dataclass(frozen=True, slots=True)
class HardwareSpec:
    name: str
    peak_flops: float  #: dense BF16 FLOP/s
    mfu: float  #: fraction of peak reached by prefill
    hbm_bytes_per_s: float  #: effective HBM bandwidth for decode
    gpu_mem_bytes: float
    gpu_mem_util: float = 0.90  #: vLLM's gpu_memory_utilization
    activation_reserve_bytes: float = 4 * GB
    host_tier_bytes: float = 200 * GB
    ssd_tier_bytes: float = 8000 * GB
    pcie_bytes_per_s: float = 25 * GB  #: PCIe 4.0 x16, pinned memcpy
    ssd_read_bytes_per_s: float = 1.5 * GB
    ssd_write_bytes_per_s: float = 1.5 * GB


@dataclass(frozen=True, slots=True)
class CostProfile:
    """Frozen numbers the simulator uses. Times in seconds, sizes in bytes or tokens."""

    name: str
    kv_bytes_per_token: int
    linear_s_per_token: float
    attn_s_per_pair: float
    prefill_overhead_s: float
    decode_weights_s: float  #: one decode step's weight read (shared by the batch)
    decode_kv_s_per_token: float  #: reading one token of KV during a decode step
    decode_batch: int
    tpot_s: float
    gpu_kv_tokens: int
    host_bytes: int
    ssd_bytes: int
    pcie_bytes_per_s: float
    ssd_read_bytes_per_s: float
    ssd_write_bytes_per_s: float
    prefill_chunk_tokens: int

    def prefill_time(self, new_tokens: int, cached_tokens: int = 0) -> float:
        n = max(int(new_tokens), 0)
        if n == 0:
            return 0.0
        return (self.prefill_overhead_s + n * self.linear_s_per_token
                + self.attn_s_per_pair * n * (cached_tokens + n / 2))

    def host_to_gpu_time(self, nbytes: float) -> float:
        return nbytes / self.pcie_bytes_per_s

    def ssd_read_time(self, nbytes: float) -> float:
        return nbytes / self.ssd_read_bytes_per_s

    def last_chunk_time(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """Seconds of a prefill's last chunk (`prefill_chunk_tokens` per chunk): the engine admits the next request
        when this chunk starts."""
        n = max(int(new_tokens), 0)
        if n == 0:
            return 0.0
        k = n - self.prefill_chunk_tokens * ((n - 1) // self.prefill_chunk_tokens)
        return min(self.prefill_time(n, cached_tokens), self.prefill_time(k, cached_tokens + n - k))

    def load_cost_model(self):
        """The same numbers as the load plan's cost model (`kvtier.scheduler_hooks.load_plan.LoadCostModel`)."""
        from kvtier.scheduler_hooks.load_plan import LoadCostModel

        return LoadCostModel(kv_bytes_per_token=self.kv_bytes_per_token,
                             ssd_read_bytes_per_s=self.ssd_read_bytes_per_s,
                             host_load_bytes_per_s=self.pcie_bytes_per_s,
                             prefill_s_per_token=self.linear_s_per_token,
                             prefill_s_per_token_pair=self.attn_s_per_pair,
                             prefill_overhead_s=self.prefill_overhead_s)

    def decode_gpu_time(self, output_tokens: int, context_tokens: int) -> float:
        """The request's share of GPU time over its whole decode (continuous batching at `decode_batch`)."""
        out = max(int(output_tokens), 0)
        mean_ctx = context_tokens + out / 2
        return out * (self.decode_weights_s / self.decode_batch + mean_ctx * self.decode_kv_s_per_token)

    def decode_wall_time(self, output_tokens: int) -> float:
        """How long the request holds its GPU KV after its first token."""
        return max(int(output_tokens), 0) * self.tpot_s

    def to_dict(self) -> dict:
        return asdict(self)


def build_profile(
    name: str,
    model: ModelSpec,
    hw: HardwareSpec,
    *,
    decode_batch: int = 32,
    mean_context_tokens: int = 13_000,
    prefill_overhead_s: float = 0.003,
    prefill_chunk_tokens: int = 8192,
) -> CostProfile:
    flops = hw.peak_flops * hw.mfu
    kv = model.kv_bytes_per_token
    decode_weights_s = model.weight_bytes / hw.hbm_bytes_per_s
    decode_kv_s = kv / hw.hbm_bytes_per_s
    gpu_kv = hw.gpu_mem_bytes * hw.gpu_mem_util - model.weight_bytes - hw.activation_reserve_bytes
    if gpu_kv <= 0:
        raise ValueError(f"{model.name} does not fit on {hw.name}")
    return CostProfile(
        name=name,
        kv_bytes_per_token=kv,
        linear_s_per_token=2 * model.params / flops,
        attn_s_per_pair=4 * model.layers * model.heads * model.head_dim / flops,
        prefill_overhead_s=prefill_overhead_s,
        decode_weights_s=decode_weights_s,
        decode_kv_s_per_token=decode_kv_s,
        decode_batch=decode_batch,
        tpot_s=decode_weights_s + decode_batch * mean_context_tokens * decode_kv_s,
        gpu_kv_tokens=int(gpu_kv // kv),
        host_bytes=int(hw.host_tier_bytes),
        ssd_bytes=int(hw.ssd_tier_bytes),
        pcie_bytes_per_s=hw.pcie_bytes_per_s,
        ssd_read_bytes_per_s=hw.ssd_read_bytes_per_s,
        ssd_write_bytes_per_s=hw.ssd_write_bytes_per_s,
        prefill_chunk_tokens=prefill_chunk_tokens,
    )


LLAMA3_8B = ModelSpec("Llama-3-8B", params=8.03e9, layers=32, heads=32, kv_heads=8, head_dim=128)
OPT_13B = ModelSpec("OPT-13B", params=12.85e9, layers=40, heads=40, kv_heads=40, head_dim=128)
H100_80G = HardwareSpec("H100-SXM-80GB", peak_flops=989e12, mfu=0.5, hbm_bytes_per_s=3.35e12 * 0.7,
                        gpu_mem_bytes=80 * GB)
A800_80G = HardwareSpec("A800-80GB", peak_flops=312e12, mfu=0.5, hbm_bytes_per_s=2.04e12 * 0.7, gpu_mem_bytes=80 * GB)

PROFILES: dict[str, CostProfile] = {
    "llama3-8b-h100": build_profile("llama3-8b-h100", LLAMA3_8B, H100_80G),
    "opt-13b-a800": build_profile("opt-13b-a800", OPT_13B, A800_80G, mean_context_tokens=2_048),
}
DEFAULT_PROFILE = "llama3-8b-h100"


def get_profile(name: str = DEFAULT_PROFILE) -> CostProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown cost profile {name!r}; choose one of {sorted(PROFILES)}") from None
