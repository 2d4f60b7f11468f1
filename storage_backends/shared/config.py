"""`kvtier.shared`: the options of the tier shared by several engines (a Redis, Valkey or Mooncake store that
LMCache's remote backend speaks), parsed strictly: an unknown key, a wrong type or value raises `ConfigError`
naming `kvtier.shared.<key>`.

The store itself is LMCache's remote backend, configured the LMCache way in the same YAML (`remote_url:
redis://...`, or `remote_storage_plugins: [redis]` with `remote_storage_plugin.redis.redis_url`); these options
say how kvtier uses it:

    extra_config:
      kvtier.shared:
        writes: all              # all | continuing | none
        on_unavailable: fail     # fail | degrade

Shared keys name the engine's KV identity (`kvtier.identity`: a fingerprint of the weights' content, config,
dtype, layout, chunk size and parallelism), not the model's path: replicas of the same build share chunks wherever
their files lie, and no replica reads another build's. `kvtier.model_identity` (an SSD-tier key) declares builds
compatible; the former `kvtier.shared.model_id` is refused with a message saying so.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from kvtier.storage_backends.config import ConfigError, check_int, refuse_unknown_keys, require_mapping

SHARED_KEY = "kvtier.shared"
WRITE_POLICIES = ("all", "continuing", "none")


@dataclass(frozen=True)
class SharedTierOptions:
    #: which chunks go to the shared store: `all` (write-through of every chunk an engine computes), `continuing`
    #: (only chunks of requests that already continue an earlier turn: at least `min_history_chunks` of their
    #: prompt were cached somewhere when they arrived), `none` (read only)
    writes: str = "all"
    #: the store does not answer at start: `fail` stops the engine (ConfigError naming the URL), `degrade` starts
    #: with the local tiers only (logged) and uses the store once it answers
    on_unavailable: str = "fail"
    #: limit of one store operation (lookup, read, write batch), seconds; then the store counts as down
    timeout_s: float = 2.0
    #: while the store is down, one probe every this many seconds
    retry_s: float = 5.0
    #: host memory that chunks waiting for their shared write may hold; beyond it new writes are dropped
    #: (counted in kvtier_shared_dropped_writes_total), never waited for
    max_queued_write_mb: int = 256
    #: `writes: continuing`: chunks of a request count as a continuation when this many of its prompt chunks
    #: were cached (GPU, host, SSD or shared) at its arrival
    min_history_chunks: int = 2

    @classmethod
    def parse(cls, raw: Any, where: str = SHARED_KEY) -> SharedTierOptions:
        if raw is None:
            return cls()
        raw = require_mapping(raw, where, "{writes: all}")
        known = [f.name for f in fields(cls)]
        if "model_id" in raw:
            raise ConfigError(f"{where}.model_id is gone: shared keys now carry a fingerprint of the weights' content "
                              "(replicas of the same build share chunks wherever their model files lie); to declare "
                              "two builds' KV compatible, set kvtier.model_identity on both instead "
                              "(docs/design/identity.md)")
        refuse_unknown_keys(raw, known, where)
        out = cls(**raw)
        if out.writes not in WRITE_POLICIES:
            raise ConfigError(f"{where}.writes must be one of {', '.join(WRITE_POLICIES)}, got {out.writes!r}")
        if out.on_unavailable not in ("fail", "degrade"):
            raise ConfigError(f"{where}.on_unavailable must be fail or degrade, got {out.on_unavailable!r}")
        for name in ("timeout_s", "retry_s"):
            v = getattr(out, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise ConfigError(f"{where}.{name} must be a number > 0, got {v!r}")
        check_int(out.max_queued_write_mb, f"{where}.max_queued_write_mb", 1)
        check_int(out.min_history_chunks, f"{where}.min_history_chunks", 0)
        return out


def remote_configured(lmcache_config: Any) -> bool:
    """Whether an LMCache config names a remote store (`remote_url` or `remote_storage_plugins`)."""
    return bool(getattr(lmcache_config, "remote_url", None) or getattr(lmcache_config, "remote_storage_plugins", None))
