"""The KV identity (`ModelFingerprint`) of a vLLM engine, from its `VllmConfig`: the weights named by the model
(content fingerprint, or `kvtier.model_identity`), vLLM's effective model config (after `--hf-overrides`), the dtype
and quantization the engine computes with, the KV cache dtype, and what the caller knows of the layout and ranks."""

from __future__ import annotations

from typing import Any, Protocol

from kvtier.identity.model import ModelFingerprint, config_digest, weights_identity

__all__ = ["engine_fingerprint", "vllm_fingerprint"]


class _HFConfig(Protocol):
    def to_dict(self) -> dict[str, Any]: ...


class _ModelConfig(Protocol):
    model: str
    revision: str | None
    hf_config: _HFConfig
    dtype: Any
    quantization: str | None


class _CacheConfig(Protocol):
    cache_dtype: str


class _ParallelConfig(Protocol):
    tensor_parallel_size: int


class _VllmConfig(Protocol):
    model_config: _ModelConfig
    cache_config: _CacheConfig
    parallel_config: _ParallelConfig


def vllm_fingerprint(vllm_config: _VllmConfig, *, declared: str, kv_dtype: Any, layout: str, chunk_tokens: int,
                     tp_rank: int) -> ModelFingerprint:
    """The fingerprint of KV an engine of `vllm_config` computes (`tp_rank` -1: chunks hold every rank's share)."""
    mc = vllm_config.model_config
    weights = weights_identity(str(mc.model), declared, mc.revision)
    compute = {"dtype": str(mc.dtype), "quantization": str(mc.quantization or "none"),
               "kv_cache_dtype": str(vllm_config.cache_config.cache_dtype)}
    return ModelFingerprint(weights, config_digest(mc.hf_config.to_dict()), str(kv_dtype), layout,
                            int(chunk_tokens), int(vllm_config.parallel_config.tensor_parallel_size), int(tp_rank),
                            compute)


def engine_fingerprint(vllm_config: _VllmConfig, cfg: Any, kv_dtype: Any, rank: int) -> ModelFingerprint:
    """The kvtier connector's worker rank: page-first chunks of `cfg.page_tokens` tokens per page and
    `cfg.chunk_size` tokens per chunk (the page kernels read any of vLLM's KV tensor layouts into that format)."""
    return vllm_fingerprint(vllm_config, declared=cfg.kvtier.model_identity, kv_dtype=kv_dtype,
                            layout=f"page_first/p{cfg.page_tokens}", chunk_tokens=cfg.chunk_size, tp_rank=rank)
