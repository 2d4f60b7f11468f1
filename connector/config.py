"""The connector's configuration: the version check, `kv_connector_extra_config` parsing and validation.

    {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.connector", "kv_role": "kv_both",
     "kv_load_failure_policy": "recompute",
     "kv_connector_extra_config": {"config_file": "configs/lmcache-kvtier.yaml",
                                   "kvtier.ssd_path": "/mnt/nvme/kvtier",          # inline keys override the file
                                   "kvtier.connector": {"prefetch_concurrency": 2}}}

Everything is checked when the connector is built (both roles), so a bad setting stops the engine at start with
a message naming the key and the fix (`ConfigError`), instead of LMCache logging it and running without the SSD
tier. The connector always stores page-first chunks (kvtier's gather/scatter kernels), so the SSD tier is told
`kvtier.chunk_format: page_first` and the page size.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtier.compat import guard
from kvtier.compat.guard import UnsupportedVersion  # noqa: F401 (re-exported: the connector's start error)
from kvtier.storage_backends.admission.config import SSD_ADMISSION_KEY, AdmissionOptions
from kvtier.storage_backends.config import PREFIX, ConfigError, KVTierConfig, parse_kvtier_config

logger = logging.getLogger(__name__)

#: keys of `kv_connector_extra_config` that belong to other kvtier components (not SSD-tier keys)
CONNECTOR_KEY = "kvtier.connector"
SCHEDULER_KEY = "kvtier.scheduler"
FOREIGN_KEYS = (SCHEDULER_KEY, CONNECTOR_KEY, "kvtier.shared", "kvtier.ssd_admission")
KV_LAYOUTS = ("auto", "split_token_dim", "split_last_dim", "split_head_dim", "kv_first", "block_first",
              "block_first_hnd")


def check_versions() -> tuple[str, str]:
    """(vllm, lmcache) versions, after kvtier's version guard (`kvtier.compat.guard`): raises
    `UnsupportedVersion` for a known-broken combination (or an untested one in strict mode), warns for an
    untested one naming the nearest tested combination."""
    result = guard.check(guard.COMPONENT_CONNECTOR)
    return str(result.installed.vllm), str(result.installed.lmcache)


@dataclass(frozen=True)
class ConnectorOptions:
    """`kv_connector_extra_config["kvtier.connector"]`: the connector's own knobs."""

    #: SSD -> host prefetches in flight at once (per engine); more are queued in disk-HRRN order
    prefetch_concurrency: int = 2
    #: attention backend layout of vLLM's KV tensors; `auto` detects it from the backend
    kv_layout: str = "auto"
    #: seconds the scheduler side waits for a storage lookup before counting it a miss
    rpc_timeout_s: float = 10.0
    #: give up on a prefetch (recompute instead) after this long
    prefetch_timeout_s: float = 120.0
    #: saves (GPU -> host tier) run off the engine step on the worker's transfer thread; false: inside the step
    async_saves: bool = True
    #: KV bytes (MiB) that may load inside one engine step, before its forward pass (one request's load fits whole
    #: or not at all); the other loads run off the step (the request waits in WAITING_FOR_REMOTE_KVS while the
    #: others keep running, at least one step longer). The stall a load adds to the step grows with its bytes, not
    #: its tokens: 128 MiB is 1024 tokens of Llama-3-8B (the budget measured with benchmarks/host_loads.py), about
    #: 5 ms at 25 GB/s host->GPU. 0: every load off the step (`kvtier.connector.load_placement`)
    sync_load_budget_mb: float = 128.0
    #: the same budget in tokens; when set it replaces `sync_load_budget_mb` (0: every load off the step)
    sync_load_budget_tokens: int | None = None
    #: an engine step with nothing to compute while kvtier work is in flight (asynchronous loads, prefetches,
    #: saves that hold blocks) waits up to this long on the worker for one of them to end, with the GIL released,
    #: instead of returning at once: the engine does not spin past a transfer thread that needs the GIL. Bounds
    #: the delay such a step adds to a request arriving meanwhile. 0: no wait (the step returns at once)
    idle_wait_ms: float = 20.0
    #: chunks of the worker's staging area for SSD reads at load time: the part of a request's SSD-resident prefix
    #: that its prefetch could not bring into the host tier (no free room) streams through it, this many chunks
    #: at a time, so a request's SSD hits are never capped by the host tier's free room. 0: no stream (SSD hits
    #: then reach a request only through the host tier)
    ssd_stream_chunks: int = 4

    @classmethod
    def parse(cls, raw: Any) -> ConnectorOptions:
        if raw is None:
            return cls()
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{CONNECTOR_KEY} must be an object, got {raw!r}")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(f"unknown key(s) {', '.join(CONNECTOR_KEY + '.' + u for u in unknown)}; known: "
                              f"{', '.join(sorted(known))}")
        out = cls(**raw)
        if not isinstance(out.prefetch_concurrency, int) or out.prefetch_concurrency < 1:
            raise ConfigError(f"{CONNECTOR_KEY}.prefetch_concurrency must be an integer >= 1, got "
                              f"{out.prefetch_concurrency!r}")
        if out.kv_layout not in KV_LAYOUTS:
            raise ConfigError(f"{CONNECTOR_KEY}.kv_layout must be one of {', '.join(KV_LAYOUTS)}, got "
                              f"{out.kv_layout!r}")
        for name in ("rpc_timeout_s", "prefetch_timeout_s", "idle_wait_ms"):
            v = getattr(out, name)
            number = isinstance(v, (int, float)) and not isinstance(v, bool)
            may_be_zero = name == "idle_wait_ms"
            if not number or v < 0 or (v == 0 and not may_be_zero):
                raise ConfigError(f"{CONNECTOR_KEY}.{name} must be a number {'>=' if may_be_zero else '>'}"
                                  f" 0, got {v!r}")
        if not isinstance(out.async_saves, bool):
            raise ConfigError(f"{CONNECTOR_KEY}.async_saves must be true or false, got {out.async_saves!r}")
        for name in ("sync_load_budget_tokens", "ssd_stream_chunks"):
            v = getattr(out, name)
            if v is None and name == "sync_load_budget_tokens":
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ConfigError(f"{CONNECTOR_KEY}.{name} must be an integer >= 0, got {v!r}" + (
                    " (0: every load off the engine step; a huge value: every load inside it)"
                    if name == "sync_load_budget_tokens" else ""))
        mb = out.sync_load_budget_mb
        if not isinstance(mb, (int, float)) or isinstance(mb, bool) or not mb >= 0:
            raise ConfigError(f"{CONNECTOR_KEY}.sync_load_budget_mb must be a number >= 0 (MiB of KV per engine "
                              f"step; 0: every load off the step), got {mb!r}")
        return out


@dataclass
class ConnectorConfig:
    """Everything the connector needs, validated."""

    config_file: str
    lmcache: Any  # LMCacheEngineConfig (with the inline overrides applied)
    kvtier: KVTierConfig
    options: ConnectorOptions
    chunk_size: int
    page_tokens: int
    extra: dict[str, Any] = field(default_factory=dict)
    #: the shared tier's options when the LMCache config names a remote store (`remote_url` /
    #: `remote_storage_plugins`), else None
    shared: Any = None
    #: which chunks the SSD tier writes (`kvtier.ssd_admission`; default: all)
    ssd_admission: AdmissionOptions = field(default_factory=AdmissionOptions)


def _resolve_file(path: str) -> str:
    p = os.path.expanduser(path)
    if os.path.isfile(p):
        return os.path.abspath(p)
    # `configs/...` also resolves against the installed package (the shipped files)
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    alt = os.path.join(pkg_root, path)
    if not os.path.isabs(path) and os.path.isfile(alt):
        return alt
    raise ConfigError(f"kv_connector_extra_config.config_file: {path} does not exist (cwd {os.getcwd()}); give the "
                      "path of an LMCache YAML with the kvtier plugin, e.g. configs/lmcache-kvtier.yaml")


def load_connector_config(extra: Mapping[str, Any] | None, block_size: int, *, prepare_dir: bool = True
                          ) -> ConnectorConfig:
    """Parse and validate `kv_connector_extra_config`; raises ConfigError with a message naming the fix."""
    extra = dict(extra or {})
    known_top = {"config_file", *FOREIGN_KEYS}
    bad = sorted(k for k in extra if k not in known_top and not k.startswith(PREFIX))
    if bad:
        raise ConfigError(f"kv_connector_extra_config: unknown key(s) {', '.join(bad)}; kvtier reads config_file, "
                          f"kvtier.<ssd key> overrides, {CONNECTOR_KEY} and kvtier.scheduler")
    if "config_file" not in extra:
        raise ConfigError("kv_connector_extra_config.config_file is missing: name the LMCache YAML with the kvtier "
                          "plugin, e.g. {\"config_file\": \"configs/lmcache-kvtier.yaml\"}")
    path = _resolve_file(str(extra["config_file"]))
    from kvtier.storage_backends.lmcache.backend import load_lmcache_config

    try:
        lmc = load_lmcache_config(path)
    except Exception as e:  # LMCache's own validation
        raise ConfigError(f"{path}: LMCache rejects this file: {e}") from None
    ec = dict(lmc.extra_config or {})
    plugins = [p for p in (lmc.storage_plugins or [])
               if ec.get(f"storage_plugin.{p}.class_name") == "KVTierBackend"]
    if not plugins:
        raise ConfigError(f"{path}: no storage plugin uses kvtier; add 'storage_plugins: [\"kvtier\"]' and, under "
                          "extra_config, 'storage_plugin.kvtier.module_path: kvtier.storage_backends' and "
                          "'storage_plugin.kvtier.class_name: KVTierBackend'")
    for name in plugins:
        module = ec.get(f"storage_plugin.{name}.module_path", "")
        if not str(module).startswith("kvtier.storage_backends"):
            raise ConfigError(f"{path}: storage_plugin.{name}.module_path must be kvtier.storage_backends, got "
                              f"{module!r}")
    if not lmc.local_cpu:
        raise ConfigError(f"{path}: local_cpu must be true: LMCache's host tier is kvtier's host-memory tier")
    if getattr(lmc, "use_layerwise", False):
        raise ConfigError(f"{path}: use_layerwise must be false with the kvtier connector")
    if getattr(lmc, "enable_async_loading", False):
        logger.info("kvtier: enable_async_loading is ignored (the connector prefetches SSD data itself)")
        lmc.enable_async_loading = False

    inline = {k: v for k, v in extra.items() if k.startswith(PREFIX) and k not in FOREIGN_KEYS}
    merged = {**ec, **inline}
    fmt = merged.get(PREFIX + "chunk_format", "page_first")
    if fmt != "page_first":
        raise ConfigError(f"kvtier.chunk_format is {fmt!r}, but the kvtier connector stores page-first chunks; "
                          "set kvtier.chunk_format: page_first (or remove the key)")
    merged[PREFIX + "chunk_format"] = "page_first"
    merged.setdefault(PREFIX + "page_tokens", block_size)
    kv = parse_kvtier_config(merged)
    chunk = int(lmc.chunk_size)
    if chunk % kv.page_tokens:
        raise ConfigError(f"LMCache chunk_size {chunk} is not a multiple of kvtier.page_tokens {kv.page_tokens}; "
                          f"use a chunk_size that is a multiple of {kv.page_tokens}")
    if prepare_dir:
        from kvtier.storage_backends.ssd.directory import prepare_directory

        prepare_directory(kv.ssd_path)
    # The merged keys are what LMCache hands the plugin's constructor.
    lmc.extra_config = merged
    if getattr(lmc, "pre_caching_hash_algorithm", "builtin") == "builtin" and "PYTHONHASHSEED" not in os.environ:
        logger.warning("kvtier: pre_caching_hash_algorithm is builtin and PYTHONHASHSEED is unset: chunk keys change "
                       "with every process, so a restarted engine finds none of the SSD tier's chunks; use "
                       "sha256_cbor")
    options = ConnectorOptions.parse(extra.get(CONNECTOR_KEY))
    check_scheduler_keys(extra.get(SCHEDULER_KEY))
    return ConnectorConfig(path, lmc, kv, options, chunk, kv.page_tokens, extra, _shared_options(path, lmc, ec, extra),
                           AdmissionOptions.parse(extra.get(SSD_ADMISSION_KEY, ec.get(SSD_ADMISSION_KEY))))


def check_scheduler_keys(raw: Any) -> None:
    """Validate `kvtier.scheduler` here too, not only where the scheduler hook reads it: the connector's hints
    use the same load plan, and an engine started without `--scheduler-cls` would otherwise ignore a typo."""
    if raw is None:
        return
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{SCHEDULER_KEY} must be an object, got {raw!r}")
    from kvtier.scheduler_hooks.dual_queue_config import DualQueueConfig

    try:
        DualQueueConfig.from_keys(dict(raw), prefix=SCHEDULER_KEY)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _shared_options(path: str, lmc: Any, ec: Mapping[str, Any], extra: Mapping[str, Any]) -> Any:
    """`kvtier.shared` (inline keys win over the YAML's) when the LMCache config names a remote store."""
    from kvtier.storage_backends.shared.config import SHARED_KEY, SharedTierOptions, remote_configured

    raw = extra.get(SHARED_KEY, ec.get(SHARED_KEY))
    if not remote_configured(lmc):
        if raw is not None:
            raise ConfigError(f"{path}: {SHARED_KEY} is set but the LMCache config names no shared store; add "
                              "'remote_url: redis://HOST:PORT' (or remote_storage_plugins), or remove "
                              f"{SHARED_KEY}")
        return None
    return SharedTierOptions.parse(raw)
