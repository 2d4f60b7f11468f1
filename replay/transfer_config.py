"""What a vLLM `--kv-transfer-config` JSON (or an LMCache YAML) sets, for the offline tools: `kvtier simulate
--kv-transfer-config FILE` and `kvtier replay --kv-transfer-config FILE` run exactly the scheduler and eviction keys
of a shipped configuration (`configs/vllm-kv-transfer*.json`).

`load_transfer_config(path)` validates the file as the kvtier connector does when vLLM builds it
(`kvtier.connector.config.load_connector_config`, without touching the SSD directory): `config_file` resolves as the
connector resolves it (as written, i.e. against the working directory, else against the installed package, so
`configs/...` names a shipped file; not against the JSON's folder), and a wrong key is the connector's error naming
it (`kvtier.scheduler` keys: `DualQueueConfig.from_keys`, the production scheduler hook's parser; `kvtier.*` keys:
`storage_backends/config.py`). An LMCache YAML given directly is read as a JSON naming it and nothing else would be
(the scheduler knobs are then production's defaults).

The scheduler name (`scheduler_name`) is the simulator's name of the dual-queue policy the knobs describe: each
modifier is one switch of `DualQueueConfig` (`+hrrn`: `ready_order: hrrn`; `+delay-hit`: `delay_hit`, on by default
in production but off in the bare name `dual-queue`; `+own-loads`: `delay_hit_own_loads` with `delay_hit`;
`+always-load`: `load_or_recompute: false`; `+eager-replan`: `idle_replan_counts_arrivals: false`), every other knob
travels in the config. Not 1:1 in two places: `delay_hit_own_loads` without `delay_hit` has no effect and no name
(the name leaves it out), and the baselines (`fcfs`, `fcfs+prefetch`, `recompute`) are not kvtier's scheduler: no
file names them (whether vLLM runs kvtier's scheduler at all is its `--scheduler-cls`, not this file).

The host tier's policy is the YAML's `cache_policy`: `KVTIER_<NAME>` is kvtier's policy `<name>`; LMCache's own
`LRU` (its default), `FIFO` and `LFU` are kvtier's `lru`, `fifo` and `lfu`, which order entries alike; LMCache's
`MRU` has no kvtier equal and is an error.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from kvtier.connector.plugin import MODULE as CONNECTOR_MODULE
from kvtier.connector.plugin import NAME as CONNECTOR_NAME
from kvtier.scheduler_hooks.dual_queue_policy import (
    DUAL_QUEUE_MODIFIERS,
    DualQueueConfig,
    DualQueuePolicy,
    make_scheduling_policy,
)
from kvtier.storage_backends.config import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["IDENTITY_KEYS", "LMCACHE_POLICIES", "TransferConfig", "host_policy_name", "load_transfer_config",
           "scheduler_name", "unmodelled"]

#: keys that only name kvtier's connector and plugin (checked on load): nothing for an offline tool to model
IDENTITY_KEYS = ("kv_connector", "kv_connector_module_path", "kv_role", "config_file", "local_cpu", "storage_plugins",
                 "storage_plugin.*")
#: LMCache's own host-tier policies (`cache_policy`) and kvtier's policy that orders entries alike
LMCACHE_POLICIES = {"LRU": "lru", "FIFO": "fifo", "LFU": "lfu"}
#: the page size the connector's checks assume (vLLM's default block size, as `kvtier check-config`)
_BLOCK_SIZE = 16
_GIB = 1 << 30

#: each dual-queue modifier of the scheduler name, as the config switch that means it
_MODIFIERS: dict[str, Callable[[DualQueueConfig], bool]] = {
    "hrrn": lambda c: c.ready_order == "hrrn",
    "delay-hit": lambda c: c.delay_hit,
    "own-loads": lambda c: c.delay_hit and c.delay_hit_own_loads,
    "always-load": lambda c: not c.load_plan.load_or_recompute,
    "eager-replan": lambda c: not c.idle_replan_counts_arrivals,
}


@dataclass(frozen=True, slots=True)
class TransferConfig:
    """The settings of one `--kv-transfer-config` file that the offline tools run."""

    path: str  #: the file given (a vLLM --kv-transfer-config JSON, or an LMCache YAML)
    lmcache_file: str  #: the LMCache YAML (the JSON's `config_file`, resolved as the connector does)
    scheduler: DualQueueConfig  #: `kvtier.scheduler`, parsed by the production hook's parser
    scheduler_name: str  #: the simulator's scheduler name for it (`scheduler_name`)
    scheduler_keys: tuple[tuple[str, Any], ...]  #: the `kvtier.scheduler` keys the file sets, with their values
    host_policy: str  #: kvtier's name of the host tier's eviction policy
    cache_policy: str | None  #: the YAML's `cache_policy` as written; None: LMCache's default (LRU)
    ssd_policy: str  #: `kvtier.eviction_policy` (default lru)
    host_bytes: int  #: `max_local_cpu_size` GiB, in bytes
    keys: tuple[str, ...]  #: every key the file and its YAML set (nested kvtier.* sections as `section.key`)


def load_transfer_config(path: str) -> TransferConfig:
    """Read and validate `path`; raises ConfigError naming the key and the fix."""
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: no such file")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    given: list[str] = []  # the JSON's own keys (none for a YAML given directly)
    if path.endswith(".json") or text.lstrip().startswith("{"):
        spec = _json_object(path, text)
        if spec.get("kv_connector") != CONNECTOR_NAME:
            raise ConfigError(f"{path}: \"kv_connector\" must be {CONNECTOR_NAME!r} (the tools model kvtier's "
                              f"connector), got {spec.get('kv_connector')!r}")
        if spec.get("kv_connector_module_path", CONNECTOR_MODULE) != CONNECTOR_MODULE:
            raise ConfigError(f"{path}: \"kv_connector_module_path\" must be {CONNECTOR_MODULE!r}, got "
                              f"{spec.get('kv_connector_module_path')!r}")
        extra = spec.get("kv_connector_extra_config") or {}
        if not isinstance(extra, Mapping):
            raise ConfigError(f"{path}: \"kv_connector_extra_config\" must be an object, got {extra!r}")
        given = [*(k for k in spec if k != "kv_connector_extra_config"), *_flatten(extra)]
    else:
        extra = {"config_file": path}
    from kvtier.connector.config import SCHEDULER_KEY, load_connector_config

    cc = load_connector_config(extra, _BLOCK_SIZE, prepare_dir=False)
    raw_sched = extra.get(SCHEDULER_KEY) or {}
    sched = DualQueueConfig.from_keys(dict(raw_sched), prefix=SCHEDULER_KEY)
    if sched.delay_hit_own_loads and not sched.delay_hit:
        logger.warning("%s: %s.delay_hit_own_loads has no effect without delay_hit (production ignores it too)",
                       path, SCHEDULER_KEY)
    yaml_keys = _yaml_mapping(cc.config_file)
    written = yaml_keys.get("cache_policy")
    return TransferConfig(
        path=path,
        lmcache_file=cc.config_file,
        scheduler=sched,
        scheduler_name=scheduler_name(sched),
        scheduler_keys=tuple(raw_sched.items()),
        host_policy=host_policy_name(str(cc.lmcache.cache_policy)),
        cache_policy=None if written is None else str(written),
        ssd_policy=cc.kvtier.eviction_policy,
        host_bytes=int(float(cc.lmcache.max_local_cpu_size) * _GIB),
        keys=tuple(dict.fromkeys([*given, *(k for k in yaml_keys if k != "extra_config"),
                                  *_flatten(yaml_keys.get("extra_config") or {})])),
    )


def scheduler_name(cfg: DualQueueConfig) -> str:
    """The dual-queue scheduler name whose policy, built with `cfg`, runs exactly `cfg` (see the module doc)."""
    missing = [m for m in DUAL_QUEUE_MODIFIERS if m not in _MODIFIERS]
    if missing:
        raise RuntimeError(f"dual-queue modifier(s) {', '.join(missing)} have no config switch here; add them to "
                           "kvtier.replay.transfer_config._MODIFIERS")
    name = "+".join(["dual-queue", *(m for m in DUAL_QUEUE_MODIFIERS if _MODIFIERS[m](cfg))])
    built = make_scheduling_policy(name, cfg)
    expected = replace(cfg, delay_hit_own_loads=cfg.delay_hit and cfg.delay_hit_own_loads)
    if not isinstance(built, DualQueuePolicy) or built.config != expected:
        raise RuntimeError(f"scheduler {name!r} does not run the configured knobs; kvtier.replay.transfer_config's "
                           "name mapping is out of date with make_scheduling_policy")
    return name


def host_policy_name(cache_policy: str) -> str:
    """kvtier's policy for LMCache's `cache_policy` value (LMCache reads it case-insensitively)."""
    from kvtier.storage_backends.eviction import production_policy_names
    from kvtier.storage_backends.lmcache.host_policy import lmcache_name

    upper = cache_policy.upper()
    ours = {lmcache_name(n): n for n in production_policy_names()}
    if upper in ours:
        return ours[upper]
    if upper in LMCACHE_POLICIES:
        return LMCACHE_POLICIES[upper]
    raise ConfigError(f"cache_policy: {cache_policy!r} has no kvtier equal the tools can run; use LMCache's "
                      f"{', '.join(LMCACHE_POLICIES)} or one of kvtier's {', '.join(sorted(ours))}")


def unmodelled(cfg: TransferConfig, modelled: Iterable[str]) -> tuple[str, ...]:
    """The keys `cfg`'s files set that neither only name kvtier (`IDENTITY_KEYS`) nor match a `modelled` pattern
    (fnmatch): the keys a tool ignores, to be reported."""
    patterns = (*IDENTITY_KEYS, *modelled)
    return tuple(k for k in cfg.keys if not any(fnmatch.fnmatchcase(k, p) for p in patterns))


def _json_object(path: str, text: str) -> dict[str, Any]:
    try:
        spec = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(spec, dict):
        raise ConfigError(f"{path}: a --kv-transfer-config is a JSON object, got {type(spec).__name__}")
    return spec


def _yaml_mapping(path: str) -> dict[str, Any]:
    """The top-level keys of the LMCache YAML as written (LMCache has loaded and checked it already)."""
    import yaml

    with open(path, encoding="utf-8") as f:
        doc = yaml.safe_load(f) or {}
    return dict(doc) if isinstance(doc, Mapping) else {}


def _flatten(section: Mapping[str, Any]) -> list[str]:
    """Keys of an `extra_config`; a `kvtier.*` key holding an object (kvtier.scheduler, ...) as `key.subkey`."""
    out: list[str] = []
    for key, value in section.items():
        if str(key).startswith("kvtier.") and isinstance(value, Mapping):
            out += [f"{key}.{sub}" for sub in value]
        else:
            out.append(str(key))
    return out
