"""`kvtier check-config FILE`: load an LMCache config the way LMCache does and fail loudly on any kvtier problem.

FILE is an LMCache YAML (the in-process storage plugin), the JSON of an `lmcache server --l2-adapter` spec (the
multiprocess-mode L2 adapter, `configs/lmcache-mp-l2-kvtier.json`), or a vLLM `--kv-transfer-config` JSON naming
kvtier's connector (`configs/vllm-kv-transfer.json`: its `kv_connector_extra_config`, the LMCache YAML it names,
`kvtier.connector` and `kvtier.scheduler` keys, checked as the connector checks them at start).

LMCache only logs a storage plugin's constructor error and runs without it, so a typo silently disables the SSD
tier. This command parses the file with LMCache's own loader, validates every `kvtier.*` key (or every
`adapter_params` key), checks that the plugin entries point at kvtier, runs the version guard
(`kvtier.compat.guard`), and opens the SSD directory (creating it 0700; for the L2 adapter also an O_DIRECT
probe) to prove it is usable. It warns (and still passes) when the capacity is more than the SSD path's file system
has free: the tier then stays within what is free, keeping room for its journal.

With `--model MODEL` (a path or a Hugging Face id in the local cache) it also shows the parts of the KV identity
known before an engine starts (`kvtier.identity`): the weights' fingerprint (or the identity the file declares,
`kvtier.model_identity`) and the model config's; the engine's start-up log names the whole fingerprint.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from kvtier.connector import plugin
from kvtier.storage_backends.config import ConfigError, KVTierConfig, parse_kvtier_config
from kvtier.storage_backends.ssd.posix_io import free_bytes

GIB = 1 << 30


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="LMCache YAML file, or the JSON of an `lmcache server --l2-adapter` spec")
    p.add_argument("--model", help="also show the KV identity of this model (a path, or a Hugging Face id in the "
                   "local cache): the fingerprint of its weights and config that every stored chunk carries")
    p.add_argument("--revision", help="the model's revision (with a Hugging Face id)")


def declared_identity(path: str) -> str:
    """The `model_identity` a configuration file declares ("" for none, and for an L2-adapter spec: the MP server
    fingerprints each model it serves)."""

    if path.endswith(".json"):
        spec = _json_object(path, "a JSON configuration")
        extra = spec.get("kv_connector_extra_config") or {}
        if spec.get("kv_connector") == "OffloadingConnector":
            from kvtier.storage_backends.vllm_offload import TIER_CLASS

            tiers = [t for t in extra.get("secondary_tiers", []) if isinstance(t, dict) and t.get("type") == TIER_CLASS]
            return str(tiers[0].get("model_identity", "")) if tiers else ""
        if spec.get("kv_connector") == CONNECTOR_NAME:
            from kvtier.connector.config import load_connector_config

            return load_connector_config(extra, 16, prepare_dir=False).kvtier.model_identity
        return ""
    from kvtier.storage_backends.lmcache.backend import load_lmcache_config

    return parse_kvtier_config(load_lmcache_config(path).extra_config).model_identity


def identity_report(model: str, declared: str = "", revision: str | None = None) -> str:
    """The parts of `model`'s KV identity known before an engine starts, one per line."""
    from kvtier.identity.model import config_digest, read_config, weights_identity

    weights = weights_identity(model, declared, revision)
    config = read_config(model, revision)
    how = {"files": "the weight files' content", "hub": "the Hugging Face cache's blob hashes",
           "declared": f"declared: kvtier.model_identity = {declared!r}",
           "name": "its name only: the weights cannot be read here"}.get(weights.source, weights.source)
    return "\n".join([
        f"KV identity of {model} (every stored chunk carries it; any change of a part = misses, never old KV):",
        f"  weights: {weights.describe()} from {how}",
        f"  config:  {config_digest(config)[:12] if config else 'none found (config.json)'}",
        "  and, named in the engine's start-up log with the whole fingerprint: dtype, quantization, KV cache dtype, "
        "chunk layout and format version, chunk size, tensor-parallel size and rank"])


def _needs_lmcache(path: str, component: str) -> None:
    """ConfigError naming `kvtier[lmcache]` where the file is for an LMCache-only component and LMCache is missing."""
    from kvtier.compat.extras import MissingExtra, require_lmcache

    try:
        require_lmcache(component)
    except MissingExtra as e:
        raise ConfigError(f"{path}: {e}") from None


def check(path: str) -> str:
    """Validate `path`; returns a one-line summary or raises ConfigError."""
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: no such file")
    with open(path) as f:
        head = f.read(4096).lstrip()
    from kvtier.compat import guard

    if path.endswith(".json") or head.startswith("{"):
        if '"OffloadingConnector"' in head:
            return check_vllm_offloading_json(path)  # vLLM's own offloading: no LMCache needed
        if '"kv_connector"' in head:
            _needs_lmcache(path, guard.COMPONENT_CONNECTOR)
            return check_vllm_json(path)
        _needs_lmcache(path, guard.COMPONENT_MP_ADAPTER)
        return check_l2_adapter(path)
    _needs_lmcache(path, guard.COMPONENT_PLUGIN)
    from kvtier.storage_backends.lmcache.backend import load_lmcache_config

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
    host_policy = _host_cache_policy(path, cfg.cache_policy)
    recording = ""
    if kv.record_host_policy:
        if not host_policy.startswith("KVTIER_"):
            raise ConfigError(f"{path}: kvtier.record_host_policy records a kvtier policy in the host tier, but its "
                              f"cache_policy is {host_policy}; set cache_policy: KVTIER_<NAME> (e.g. KVTIER_LRU)")
        recording = f", host policy stream recorded into {kv.record_host_policy}"
    from kvtier.compat import guard

    try:
        versions = guard.check(guard.COMPONENT_PLUGIN)
    except guard.UnsupportedVersion as e:
        raise ConfigError(str(e)) from None
    from kvtier.storage_backends.ssd.directory import prepare_directory

    prepare_directory(kv.ssd_path)
    from kvtier.storage_backends.shared.config import SHARED_KEY, SharedTierOptions, remote_configured

    shared = ""
    raw = (cfg.extra_config or {}).get(SHARED_KEY)
    if remote_configured(cfg):
        opts = SharedTierOptions.parse(raw)
        shared = (f", shared store {cfg.remote_url or cfg.remote_storage_plugins} (writes: {opts.writes}, "
                  f"on_unavailable: {opts.on_unavailable}; not contacted here)")
    elif raw is not None:
        raise ConfigError(f"{path}: {SHARED_KEY} is set but no shared store is named; add 'remote_url: "
                          f"redis://HOST:PORT' (or remote_storage_plugins), or remove {SHARED_KEY}")
    from kvtier.storage_backends.admission.config import SSD_ADMISSION_KEY, AdmissionOptions

    admission = AdmissionOptions.parse((cfg.extra_config or {}).get(SSD_ADMISSION_KEY))
    return (f"OK: {path}: plugin {names[0]!r} -> KVTierBackend, SSD tier at {kv.ssd_path} "
            f"({kv.ssd_capacity_gb:g} GiB, {kv.io_threads} I/O threads, io_engine={kv.io_engine}, "
            f"eviction={kv.eviction_policy}), SSD admission {admission.policy}, "
            f"host tier {cfg.max_local_cpu_size:g} GiB (cache_policy {host_policy}), "
            f"chunk_size {cfg.chunk_size}"
            f"{shared}{recording}, LMCache {versions.installed.lmcache} ({versions.verdict.value}){capacity_note(kv)}")


def _host_cache_policy(path: str, name: str | None) -> str:
    """The host tier's `cache_policy` as LMCache will look it up (upper case), with kvtier's KVTIER_<NAME> policies
    registered as kvtier's vLLM plugin entry point registers them; ConfigError if LMCache would refuse it at start."""
    from lmcache.v1.storage_backend.cache_policy import POLICY_MAPPING

    from kvtier.storage_backends.lmcache.host_policy import register_host_policies

    register_host_policies()
    key = str(name or "LRU").upper()
    if key not in POLICY_MAPPING:
        raise ConfigError(f"{path}: cache_policy {name!r} is not a policy LMCache knows (the engine would fail at "
                          f"start); choose one of {', '.join(sorted(POLICY_MAPPING))}")
    return key


def capacity_note(kv: KVTierConfig, key: str = "kvtier.ssd_capacity_gb") -> str:
    """A warning (starting "; warning:") when the capacity is more than the SSD path's file system has free, counting
    the slot files and journals kvtier already keeps there as the tier's; "" otherwise."""
    where = os.path.abspath(kv.ssd_path)
    while not os.path.isdir(where) and os.path.dirname(where) != where:
        where = os.path.dirname(where)  # not created yet (a vLLM JSON is checked without creating it)
    try:
        free = free_bytes(where)
    except OSError:
        return ""
    own = 0
    if os.path.isdir(kv.ssd_path):
        for root, _dirs, files in os.walk(kv.ssd_path):  # never follows links
            for name in files:
                if (name.startswith("slots-") and name.endswith(".dat")) or name.startswith("journal-"):
                    with contextlib.suppress(OSError):
                        own += os.lstat(os.path.join(root, name)).st_blocks * 512
    room = free + own
    if kv.capacity_bytes <= room:
        return ""
    kept = f" (counting the {_size(own)} kvtier's files already hold there)" if own else ""
    return (f"; warning: {key}={kv.ssd_capacity_gb:g} GiB is more than the {_size(room)} free on the file system "
            f"of {kv.ssd_path}{kept}: the SSD tier will stay within what is free, keeping room for its journal, and "
            "evict within it")


def _size(nbytes: int) -> str:
    return f"{nbytes / GIB:.1f} GiB" if nbytes >= GIB // 10 else f"{nbytes / (1 << 20):.1f} MiB"


ADAPTER_MODULE = "kvtier.storage_backends.lmcache_mp_adapter"
ADAPTER_CLASS = "KVTierL2Adapter"


def _json_object(path: str, what: str) -> dict:
    """The JSON object in `path`; ConfigError if it is not valid JSON or not an object (`what` names it)."""
    import json

    try:
        with open(path) as f:
            spec = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(spec, dict):
        raise ConfigError(f"{path}: {what} is a JSON object, got {type(spec).__name__}")
    return spec


def check_l2_adapter(path: str) -> str:
    """Validate an `--l2-adapter` JSON spec for kvtier's L2 adapter, parsed by LMCache's own argument parser."""
    import json

    spec = _json_object(path, "an --l2-adapter spec")
    kind = spec.get("type")
    kvtier_keys = {"module_path", "class_name", "adapter_params"} & spec.keys()
    if kind != "plugin" and (kvtier_keys or "kvtier" in str(kind).lower()):
        # meant as kvtier's adapter (LMCache's parser would only say it knows no such type, or fail elsewhere)
        raise ConfigError(f"{path}: \"type\" must be \"plugin\" for kvtier's adapter, with \"module_path\": "
                          f"{ADAPTER_MODULE!r}, \"class_name\": {ADAPTER_CLASS!r} and its settings under "
                          f"\"adapter_params\" (as configs/lmcache-mp-l2-kvtier.json); got {kind!r}")
    from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config

    try:
        parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[json.dumps(spec)]))
    except (ValueError, KeyError, ImportError) as e:
        raise ConfigError(f"{path}: LMCache rejects this --l2-adapter spec: {e}") from None
    if kind != "plugin":  # one of LMCache's own adapters, stacked after kvtier's (e.g. `resp`: Redis)
        return (f"OK: {path}: LMCache's own L2 adapter {spec.get('type')!r}, accepted by LMCache's parser; kvtier "
                f"does not run it: list it after kvtier's adapter (a second --l2-adapter)")
    if spec.get("module_path") != ADAPTER_MODULE:
        raise ConfigError(f"{path}: \"module_path\" must be {ADAPTER_MODULE!r}, got {spec.get('module_path')!r}")
    if spec.get("class_name") != ADAPTER_CLASS:
        raise ConfigError(f"{path}: \"class_name\" must be {ADAPTER_CLASS!r}, got {spec.get('class_name')!r}")
    from kvtier.storage_backends.config import KEYS, parse_adapter_params

    misplaced = sorted({k.name for k in KEYS} & spec.keys())
    if misplaced:
        raise ConfigError(f"{path}: {', '.join(misplaced)} belong under \"adapter_params\" (kvtier's settings), not "
                          "beside \"type\"")
    kv = parse_adapter_params(spec.get("adapter_params"))
    from kvtier.storage_backends.lmcache.mp_adapter import SUBDIR
    from kvtier.storage_backends.lmcache.mp_config import check_o_direct, prepare_directories

    directory = os.path.join(kv.ssd_path, SUBDIR)
    prepare_directories(kv.ssd_path, directory)
    note = capacity_note(kv, "adapter_params.ssd_capacity_gb")
    untold = check_o_direct(directory) if kv.o_direct else None
    if untold is not None:
        note += f"; warning: {untold}"
    if spec.get("eviction") is not None:
        note += ("; note: the \"eviction\" block makes LMCache delete chunks too (by its own policy, at its "
                "watermark), beside kvtier's own eviction")
    return (f"OK: {path}: LMCache L2 adapter {ADAPTER_CLASS}, SSD tier at {directory} ({kv.ssd_capacity_gb:g} GiB, "
            f"{kv.io_threads} I/O threads, io_engine={kv.io_engine}, o_direct={kv.o_direct}, "
            f"durable_writes={kv.durable_writes}, eviction={kv.eviction_policy}){note}")


CONNECTOR_NAME = plugin.NAME
CONNECTOR_MODULE = plugin.MODULE


def check_vllm_json(path: str, block_size: int = 16) -> str:
    """Validate a vLLM `--kv-transfer-config` JSON for kvtier's connector, as the connector does when vLLM builds
    it (`block_size`: vLLM's default page size; the engine's real one is checked again at start)."""
    spec = _json_object(path, "a --kv-transfer-config")
    if spec.get("kv_connector") != CONNECTOR_NAME:
        raise ConfigError(f"{path}: \"kv_connector\" must be {CONNECTOR_NAME!r}, got {spec.get('kv_connector')!r}")
    if spec.get("kv_connector_module_path", CONNECTOR_MODULE) != CONNECTOR_MODULE:
        raise ConfigError(f"{path}: \"kv_connector_module_path\" must be {CONNECTOR_MODULE!r}, got "
                          f"{spec.get('kv_connector_module_path')!r}")
    if spec.get("kv_role") != "kv_both":
        raise ConfigError(f"{path}: \"kv_role\" must be \"kv_both\" (kvtier both saves and loads), got "
                          f"{spec.get('kv_role')!r}")
    from kvtier.connector.config import load_connector_config

    cfg = load_connector_config(spec.get("kv_connector_extra_config"), block_size)
    from kvtier.compat import guard

    try:
        versions = guard.check(guard.COMPONENT_CONNECTOR)
    except guard.UnsupportedVersion as e:
        raise ConfigError(str(e)) from None
    policy = spec.get("kv_load_failure_policy")
    note = capacity_note(cfg.kvtier) + ("" if policy == "recompute" else (
        f"; note: kv_load_failure_policy is {policy or 'unset (vLLM default: fail)'}: a KV block that fails to load "
        "(a corrupt or vanished SSD chunk) then fails its request instead of being recomputed; set \"recompute\""))
    return (f"OK: {path}: vLLM connector {CONNECTOR_NAME}, LMCache config {cfg.config_file}, SSD tier at "
            f"{cfg.kvtier.ssd_path} ({cfg.kvtier.ssd_capacity_gb:g} GiB), chunk_size {cfg.chunk_size}, "
            f"vLLM {versions.installed.vllm}, LMCache {versions.installed.lmcache} ({versions.verdict.value}){note}")


def check_vllm_offloading_json(path: str) -> str:
    """Validate a vLLM `--kv-transfer-config` JSON for vLLM's own offloading (`OffloadingConnector` with
    `TieringOffloadingSpec`) naming kvtier's secondary tier and/or CPU cache policy: kvtier's keys as the tier parses
    them at start, the SSD directory created and checked (O_DIRECT probed), vLLM's own tiers resolved by vLLM."""
    from kvtier.storage_backends.config import parse_adapter_params
    from kvtier.storage_backends.vllm_offload import POLICY_MODULE, TIER_CLASS, TIER_MODULE, tier_directory

    spec = _json_object(path, "a --kv-transfer-config")
    if spec.get("kv_role") != "kv_both":
        raise ConfigError(f"{path}: \"kv_role\" must be \"kv_both\" (offloading both saves and loads), got "
                          f"{spec.get('kv_role')!r}")
    extra = spec.get("kv_connector_extra_config")
    if not isinstance(extra, dict):
        raise ConfigError(f"{path}: \"kv_connector_extra_config\" must be a JSON object")
    if extra.get("spec_name") != "TieringOffloadingSpec":
        raise ConfigError(f"{path}: kv_connector_extra_config.spec_name must be \"TieringOffloadingSpec\" for "
                          f"secondary tiers, got {extra.get('spec_name')!r}")
    cpu = extra.get("cpu_bytes_to_use")
    if isinstance(cpu, bool) or not isinstance(cpu, int | float) or cpu <= 0:
        raise ConfigError(f"{path}: kv_connector_extra_config.cpu_bytes_to_use must be a positive number of bytes "
                          f"(the CPU tier's size), got {cpu!r}")
    if int(extra.get("store_threshold", 0)) >= 2:
        raise ConfigError(f"{path}: kv_connector_extra_config.store_threshold >= 2 is refused by "
                          "TieringOffloadingSpec")
    from kvtier.compat import guard

    try:
        versions = guard.check(guard.COMPONENT_VLLM_TIER)
    except guard.UnsupportedVersion as e:
        raise ConfigError(str(e)) from None
    parts = []
    if extra.get("cache_policy_module_path") == POLICY_MODULE:
        from kvtier.storage_backends.vllm_offload.cache_policy import CLASSES

        name = extra.get("eviction_policy")
        if name not in CLASSES:
            raise ConfigError(f"{path}: kv_connector_extra_config.eviction_policy must name one of kvtier's CPU "
                              f"cache policies ({', '.join(sorted(CLASSES))}), got {name!r}")
        parts.append(f"CPU tier {cpu / GIB:g} GiB with kvtier's {CLASSES[name]} policy")
    else:
        parts.append(f"CPU tier {cpu / GIB:g} GiB with vLLM's {extra.get('eviction_policy', 'lru')!r} policy")
    tiers = extra.get("secondary_tiers", [])
    if not isinstance(tiers, list) or not all(isinstance(t, dict) for t in tiers):
        raise ConfigError(f"{path}: kv_connector_extra_config.secondary_tiers must be a list of JSON objects")
    note = ""
    for i, tier in enumerate(tiers):
        where = f"secondary_tiers[{i}]"
        if tier.get("module_path") != TIER_MODULE:
            if tier.get("type") == TIER_CLASS:
                raise ConfigError(f"{path}: {where}.module_path must be {TIER_MODULE!r} for kvtier's tier, got "
                                  f"{tier.get('module_path')!r}")
            from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

            try:
                SecondaryTierFactory.get_tier_class(tier)
            except (ValueError, ImportError, AttributeError, AssertionError) as e:
                raise ConfigError(f"{path}: {where}: vLLM rejects this tier: {e}") from None
            parts.append(f"vLLM's {tier.get('type')!r} tier")
            continue
        if tier.get("type") != TIER_CLASS:
            raise ConfigError(f"{path}: {where}.type must be {TIER_CLASS!r}, got {tier.get('type')!r}")
        params = {k: v for k, v in tier.items() if k not in ("type", "module_path", "backpressure", "locality")}
        kv = parse_adapter_params(params, where=f"secondary_tiers[type={TIER_CLASS}]")
        directory = tier_directory(kv.ssd_path)
        from kvtier.storage_backends.ssd.directory import prepare_directory
        from kvtier.storage_backends.ssd.posix_io import probe_o_direct

        prepare_directory(kv.ssd_path)
        prepare_directory(directory)
        untold = None
        if kv.o_direct:
            try:
                untold = probe_o_direct(directory)
            except OSError as e:
                raise ConfigError(f"{path}: {where}.o_direct: the file system of {directory} refuses O_DIRECT "
                                  f"({e.strerror}); put ssd_path on a real disk, or set \"o_direct\": false") from None
        note += capacity_note(kv, f"{where}.ssd_capacity_gb") + (f"; warning: {untold}" if untold else "")
        parts.append(f"kvtier's SSD tier at {directory} ({kv.ssd_capacity_gb:g} GiB, eviction={kv.eviction_policy}, "
                     f"durable_writes={kv.durable_writes})")
    if not any(p.startswith("kvtier") or "kvtier's" in p for p in parts):
        raise ConfigError(f"{path}: neither a secondary tier nor the CPU cache policy is kvtier's")
    policy = spec.get("kv_load_failure_policy")
    if policy != "recompute":
        note += (f"; note: kv_load_failure_policy is {policy or 'unset (vLLM default: fail)'}: set \"recompute\" so "
                 "that a chunk failing its checks is recomputed")
    return (f"OK: {path}: vLLM OffloadingConnector (TieringOffloadingSpec): {'; '.join(parts)}; vLLM "
            f"{versions.installed.vllm} ({versions.verdict.value}){note}")


def run(args: argparse.Namespace) -> int:
    try:
        print(check(args.file))
        if args.model:
            print(identity_report(args.model, declared_identity(args.file), args.revision))
        return 0
    except ConfigError as e:
        print(f"kvtier check-config: ERROR: {e}", file=sys.stderr)
        return 1
