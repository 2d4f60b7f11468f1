"""`kvtier check-config FILE`: load an LMCache YAML the way LMCache does and fail loudly on any kvtier problem.

LMCache only logs a storage plugin's constructor error and runs without it, so a typo silently disables the SSD
tier. This command parses the file with LMCache's own loader, validates every `kvtier.*` key, checks that the
plugin entries point at kvtier, runs the version guard (`kvtier.compat.guard`), and opens the SSD directory (creating it 0700) to prove it is usable.
"""

from __future__ import annotations

import argparse
import os
import sys

from kvtier.storage_backends.config import ConfigError, parse_kvtier_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="LMCache YAML file")


def check(path: str) -> str:
    """Validate `path`; returns a one-line summary or raises ConfigError."""
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: no such file")
    from kvtier.storage_backends.lmcache_backend import load_lmcache_config

    try:
        cfg = load_lmcache_config(path)
    except Exception as e:  # LMCache's own validation
        raise ConfigError(f"{path}: LMCache rejects this file: {e}") from None
    plugins = list(cfg.storage_plugins or [])
    names = [p for p in plugins if (cfg.extra_config or {}).get(f"storage_plugin.{p}.class_name") == "KVTierBackend"]
    if not names:
        raise ConfigError(
            f"{path}: no storage plugin uses kvtier; add 'storage_plugins: [\"kvtier\"]' and, under extra_config, "
            "'storage_plugin.kvtier.module_path: kvtier.storage_backends' and "
            "'storage_plugin.kvtier.class_name: KVTierBackend'"
        )
    for name in names:
        module = cfg.extra_config.get(f"storage_plugin.{name}.module_path", "")
        if not module.startswith("kvtier.storage_backends"):
            raise ConfigError(f"storage_plugin.{name}.module_path must be kvtier.storage_backends, got {module!r}")
    kv = parse_kvtier_config(cfg.extra_config)
    from kvtier.compat import guard

    try:
        versions = guard.check(guard.COMPONENT_PLUGIN)
    except guard.UnsupportedVersion as e:
        raise ConfigError(str(e)) from None
    from kvtier.storage_backends.ssd_tier import _prepare_directory

    _prepare_directory(kv.ssd_path)
    return (f"OK: {path}: plugin {names[0]!r} -> KVTierBackend, SSD tier at {kv.ssd_path} "
            f"({kv.ssd_capacity_gb:g} GiB, {kv.io_threads} I/O threads, io_engine={kv.io_engine}, "
            f"eviction={kv.eviction_policy}), host tier {cfg.max_local_cpu_size:g} GiB, chunk_size {cfg.chunk_size}, "
            f"LMCache {versions.installed.lmcache} ({versions.verdict.value})")


def run(args: argparse.Namespace) -> int:
    try:
        print(check(args.file))
        return 0
    except ConfigError as e:
        print(f"kvtier check-config: ERROR: {e}", file=sys.stderr)
        return 1
