"""kvtier's settings: the `kvtier.*` keys of LMCache's `extra_config`, parsed into a typed, validated dataclass.

Every key is documented in `KEYS` (the tables of docs/configuration.md). Unknown `kvtier.*` keys, wrong types and
out-of-range values raise `ConfigError` naming the key and the fix: LMCache only logs a plugin constructor's
exception, so `kvtier check-config` (and the vLLM connector) call `parse_kvtier_config` up front to fail loudly.
The same keys, without the prefix, are the `adapter_params` of the LMCache multiprocess-mode L2 adapter
(`parse_adapter_params`, errors name `adapter_params.<key>`).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

PREFIX = "kvtier."
#: `kvtier.<section>` keys holding a mapping of another component's options (parsed there, not SSD-tier keys)
SECTION_KEYS = ("kvtier.shared", "kvtier.ssd_admission")


class ConfigError(ValueError):
    """A kvtier setting is missing, unknown or invalid; the message names the key and the fix."""


@dataclass(frozen=True)
class KVTierConfig:
    ssd_path: str
    ssd_capacity_gb: float
    io_threads: int = 4
    io_engine: str = "auto"
    o_direct: bool = True
    durable_writes: bool = True
    eviction_policy: str = "lru"
    chunk_format: str = "KV_2LTD"
    page_tokens: int = 16
    file_size_gb: float = 16.0
    grow_step_mb: int = 1024
    prepare_slots: bool = False
    io_block_mb: int = 32
    read_piece_mb: int = 8
    max_inflight_write_mb: int = 2048
    backpressure_timeout_s: float = 10.0
    pin_timeout_s: float = 600.0
    model_identity: str = ""
    encryption_key_file: str = ""
    record_host_policy: str = ""

    @property
    def capacity_bytes(self) -> int:
        return int(self.ssd_capacity_gb * (1 << 30))


@dataclass(frozen=True)
class KeySpec:
    name: str
    kind: str  # "str" | "int" | "float" | "bool" | "choice"
    help: str
    required: bool = False
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    exclusive: bool = False  # minimum itself not allowed


KEYS: tuple[KeySpec, ...] = (
    KeySpec("ssd_path", "str", "Directory of the SSD tier's slot files (created 0700 if missing).", required=True),
    KeySpec("ssd_capacity_gb", "float", "Upper bound of the SSD tier's size in GiB; unpinned chunks are evicted "
            "to stay under it. Above the disk's free space the tier grows only into what is free, keeping room for "
            "its journal (`kvtier check-config` warns).", required=True, minimum=0.0, exclusive=True),
    KeySpec("io_threads", "int", "Threads issuing pread/pwrite (or kvikio) requests in parallel.", minimum=1),
    KeySpec("io_engine", "choice", "`auto` (kvikio where GPUDirect Storage is on, reading SSD chunks straight into "
            "GPU memory; POSIX otherwise, also in kvikio's compat mode, where it measured faster; logged), `posix` "
            "or `kvikio` (fails at start if kvikio cannot run).", choices=("auto", "posix", "kvikio")),
    KeySpec("o_direct", "bool", "Bypass the page cache (O_DIRECT). Start fails on file systems without it "
            "(e.g. tmpfs) unless set to false."),
    KeySpec("durable_writes", "bool", "fdatasync slot data before a chunk counts as stored (a crash loses no "
            "committed chunk). Turn off only for throwaway caches."),
    KeySpec("eviction_policy", "str", "Eviction policy of the SSD tier (`lru`, or any production policy "
            "registered in kvtier.storage_backends.eviction)."),
    KeySpec("chunk_format", "str", "Chunk layout that readers of this tier expect: `KV_2LTD` (LMCache's own GPU "
            "connectors) or `page_first` (kvtier's gather/scatter connector); slots of another layout are misses."),
    KeySpec("page_tokens", "int", "Tokens per page of `page_first` chunks (checked against each slot's shape).",
            minimum=1),
    KeySpec("file_size_gb", "float", "Largest size of one slot file; the tier uses as many files as needed.",
            minimum=0.0, exclusive=True),
    KeySpec("grow_step_mb", "int", "Slot files grow (fallocate) by about this much at a time, never the whole "
            "capacity up front.", minimum=1),
    KeySpec("prepare_slots", "bool", "While the tier is idle (no write queued, no read for a moment), grow the "
            "slot files up to the capacity by writing zeros, so that chunk writes overwrite written blocks instead "
            "of filling fallocated (unwritten) extents, which file systems finish more slowly (ext4 here: 1.4-1.5x, "
            "`benchmarks/first_fill_probe.py`). Costs one background write of the whole capacity, once per "
            "directory (the files keep it across restarts); it yields to every read and write. For a disk the "
            "tier has to itself."),
    KeySpec("io_block_mb", "int", "Chunks are read and written as independent requests of this size, spread over "
            "the I/O threads (a 256-token Llama-3-8B chunk, 32 MiB, is one request: with several chunks in flight "
            "that kept the disk busier than 4 MiB pieces of one chunk did).", minimum=1),
    KeySpec("read_piece_mb", "int", "Reads cut each block into requests of at most this size, each checksummed "
            "as it lands (so the CRCs trail the last byte by one piece), in flight at once up to io_threads blocks' "
            "worth (twice that where a chunk is two or more full pieces). With equal "
            "destinations 8 and 32 MiB pieces read alike on this project's VMs (1.00x; earlier A/Bs that differed "
            "compared engines whose host pools lay differently in memory); measure yours with "
            "`benchmarks/ssd_tier.py --ab-read-piece-mib N`. Capped at io_block_mb.", minimum=1),
    KeySpec("max_inflight_write_mb", "int", "Host memory that queued SSD writes may hold (in the LMCache plugin "
            "at most half of max_local_cpu_size, so LMCache never runs out of room for a store); stores beyond it "
            "wait (back-pressure) before being dropped and counted.", minimum=1),
    KeySpec("backpressure_timeout_s", "float", "How long a store waits for queued writes to drain before its "
            "chunk is dropped from the SSD tier (counted in kvtier_ssd_dropped_puts_total).", minimum=0.0),
    KeySpec("pin_timeout_s", "float", "A pin (taken by a lookup) that nobody releases expires after this long, "
            "so leaked pins cannot block eviction forever.", minimum=0.0),
    KeySpec("model_identity", "str", "Declares the identity of the model's weights instead of kvtier's content "
            "fingerprint of the weight files (the default). Every stored chunk is keyed by a fingerprint of the "
            "weights, the model config, the KV dtype, the chunk layout, the parallelism and the chunk size: any "
            "change makes the old chunks misses, never old KV. Builds that declare the same name share KV (the "
            "other parts must still agree): use it for a checkpoint copied or re-saved unchanged, and change it "
            "for a change the fingerprint cannot see (docs/design/identity.md). `kvtier check-config --model` "
            "shows the fingerprint."),
    KeySpec("encryption_key_file", "str", "Encrypts chunks at rest (off when unset): a file holding the operator's "
            "secret (at least 32 random bytes; a regular file owned by this user, mode 600). Each tenant (a request's "
            "cache salt, LoRA adapter and prompt embeddings) gets its own AES-256-GCM key derived from it; chunks are "
            "authenticated with their key, and the slot checksums still guard against damage. Changing or removing "
            "the secret makes the stored chunks another identity's (never decrypted wrongly, reclaimed first). "
            "Costs CPU on every SSD read and write (docs/results); SSD reads then never go straight into GPU memory."),
    KeySpec("record_host_policy", "str", "Diagnosis (off when unset): a directory where the host tier (LMCache's, "
            "with a `KVTIER_<NAME>` cache_policy, under kvtier's connector) records its policy stream, one file per "
            "process (`host-policy-<pid>-<n>.jsonl`: every policy call with its clock times, the session signals, "
            "each lookup's hit or miss); `kvtier replay-stream FILE` replays it offline through the same policy. "
            "Created if missing."),
)
_SPECS = {k.name: k for k in KEYS}


def _coerce(spec: KeySpec, raw: Any, key: str | None = None) -> Any:
    """Validate one value; `key` is the name the user wrote (error messages say it)."""
    key = key or PREFIX + spec.name
    if spec.kind == "str" or spec.kind == "choice":
        if not isinstance(raw, str) or not raw:
            raise ConfigError(f"{key} must be a non-empty string, got {raw!r}")
        if spec.choices and raw not in spec.choices:
            raise ConfigError(f"{key} must be one of {', '.join(spec.choices)}; got {raw!r}")
        return raw
    if spec.kind == "bool":
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.lower() in ("true", "false", "1", "0", "yes", "no"):
            return raw.lower() in ("true", "1", "yes")
        raise ConfigError(f"{key} must be true or false, got {raw!r}")
    conv: Callable[[Any], Any] = int if spec.kind == "int" else float
    if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
        raise ConfigError(f"{key} must be a number, got {type(raw).__name__} {raw!r}")
    try:
        value = conv(raw)
        if spec.kind == "int" and isinstance(raw, float) and raw != int(raw):
            raise ValueError
    except ValueError:
        raise ConfigError(f"{key} must be {'an integer' if spec.kind == 'int' else 'a number'}, got {raw!r}") from None
    if spec.minimum is not None and (value <= spec.minimum if spec.exclusive else value < spec.minimum):
        raise ConfigError(f"{key} must be {'>' if spec.exclusive else '>='} {spec.minimum:g}, got {raw!r}")
    return value


def _build(merged: dict[str, Any], label: Callable[[str], str], where: str, example: str,
           excluded: Mapping[str, str] | None = None) -> KVTierConfig:
    """Validate `merged` ({key name: raw value}); `label(name)` is how the user spells a key."""
    excluded = excluded or {}
    clash = sorted(set(merged) & set(excluded))
    if clash:
        raise ConfigError(f"{label(clash[0])} {excluded[clash[0]]}; remove it")
    known = [k.name for k in KEYS if k.name not in excluded]
    unknown = sorted(set(merged) - set(known))
    if unknown:
        import difflib

        hints = [f" (did you mean {label(m[0])}?)" if (m := difflib.get_close_matches(u, known, 1)) else ""
                 for u in unknown]
        raise ConfigError(
            f"unknown key(s) {', '.join(label(u) + h for u, h in zip(unknown, hints))}; kvtier knows "
            f"{', '.join(label(k) for k in known)} (see docs/configuration.md)"
        )
    missing = [k.name for k in KEYS if k.required and k.name not in merged]
    if missing:
        raise ConfigError(f"missing {', '.join(label(m) for m in missing)} in {where}; e.g. {example}")
    values = {name: _coerce(_SPECS[name], raw, label(name)) for name, raw in merged.items()}
    values["ssd_path"] = os.path.abspath(os.path.expanduser(values["ssd_path"]))
    if "encryption_key_file" in values:
        try:
            import cryptography  # noqa: F401
        except ImportError:
            raise ConfigError(f"{label('encryption_key_file')} needs the cryptography package (pip install "
                              "'kvtier[encryption]')") from None
        values["encryption_key_file"] = os.path.abspath(os.path.expanduser(values["encryption_key_file"]))
        load_secret(values["encryption_key_file"], label("encryption_key_file"))  # unsafe or short: fail now
    if "record_host_policy" in values:
        values["record_host_policy"] = _recording_directory(values["record_host_policy"], label("record_host_policy"))
    from kvtier.storage_backends.eviction import make_policy

    try:
        make_policy(values.get("eviction_policy", "lru"))
    except ValueError as e:
        raise ConfigError(f"{label('eviction_policy')}: {e}") from None
    if "chunk_format" in values:
        _check_chunk_format(values["chunk_format"], label("chunk_format"))
    return KVTierConfig(**values)


def require_mapping(raw: Any, where: str, example: str) -> Mapping[str, Any]:
    """`raw` as the mapping of options a `where` key must hold (`example`: one, as the user would write it)."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where} must be a mapping of options (e.g. {example}), got {raw!r}")
    return raw


def refuse_unknown_keys(raw: Mapping[Any, Any], known: list[str], where: str) -> None:
    """A ConfigError naming each key of `raw` not in `known` as `where.<key>`, with the closest known one."""
    unknown = sorted(str(k) for k in set(raw) - set(known))
    if unknown:
        import difflib

        hints = [f" (did you mean {where}.{m[0]}?)" if (m := difflib.get_close_matches(u, known, 1)) else ""
                 for u in unknown]
        raise ConfigError(f"unknown key(s) {', '.join(f'{where}.{u}{h}' for u, h in zip(unknown, hints))}; "
                          f"known: {', '.join(known)}")


def check_int(value: Any, key: str, least: int) -> None:
    """A ConfigError unless `value` (option `key`) is an integer (not a bool) >= `least`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(f"{key} must be an integer >= {least}, got {value!r}")


def _recording_directory(path: str, key: str) -> str:
    """`path` made absolute; ConfigError if it names something other than a directory or cannot be created."""
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise ConfigError(f"{key}: {path} exists and is not a directory; name a directory (created if missing)")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ConfigError(f"{key}: {path} is not writable by this user")
        return path
    parent = os.path.dirname(path)
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: cannot create {path} ({parent} is not a writable directory)")
    return path


def parse_kvtier_config(extra_config: Mapping[str, Any] | None, overrides: Mapping[str, Any] | None = None
                        ) -> KVTierConfig:
    """Build a KVTierConfig from LMCache's flat `extra_config` (keys `kvtier.<name>`), plus optional overrides.

    Keys that do not start with `kvtier.` belong to LMCache or other plugins and are ignored here.
    """
    merged: dict[str, Any] = {}
    for source in (extra_config or {}), (overrides or {}):
        for k, v in source.items():
            if isinstance(k, str) and k.startswith(PREFIX) and k not in SECTION_KEYS:
                merged[k[len(PREFIX):]] = v
    return _build(merged, lambda name: PREFIX + name, "extra_config",
                  "'kvtier.ssd_path: /var/cache/kvtier' and 'kvtier.ssd_capacity_gb: 100'")


def _check_chunk_format(fmt: str, key: str = PREFIX + "chunk_format") -> None:
    """`page_first` or a name of LMCache's MemoryFormat (checked against the installed LMCache)."""
    if fmt == "page_first":
        return
    try:
        from lmcache.v1.memory_management import MemoryFormat
    except ImportError:  # no LMCache: no LMCache-format chunk can be produced or read here anyway
        return
    names = [f.name for f in MemoryFormat if f.name != "UNDEFINED"]
    if fmt not in names:
        import difflib

        close = difflib.get_close_matches(fmt, names + ["page_first"], 1)
        raise ConfigError(f"{key}: {fmt!r} is neither page_first nor an LMCache MemoryFormat"
                          f"{f' (did you mean {close[0]}?)' if close else ''}; choose one of page_first, "
                          f"{', '.join(names)}")


#: keys of the in-process plugin that mean nothing to the LMCache MP adapter (the chunk layout comes with each
#: object LMCache hands over, and is checked against the destination of every load)
MP_EXCLUDED_KEYS = {
    "chunk_format": "has no meaning in LMCache's multiprocess mode (each object carries its own layout, checked "
                    "against every load's destination)",
    "page_tokens": "has no meaning in LMCache's multiprocess mode (kvtier's page-first kernels are not used there)",
    "model_identity": "has no meaning in LMCache's multiprocess mode (the server keys each model's chunks by the "
                      "fingerprint of the weight files its key names)",
    "record_host_policy": "has no meaning in LMCache's multiprocess mode (the server's L1 is LMCache's own, not a "
                          "kvtier policy)",
}


def parse_adapter_params(params: Mapping[str, Any] | None, where: str = "adapter_params") -> KVTierConfig:
    """Build a KVTierConfig from the `adapter_params` of an LMCache MP `--l2-adapter` spec: kvtier's own keys
    without the `kvtier.` prefix (`{"ssd_path": ..., "ssd_capacity_gb": ...}`). Strict: an unknown key, a wrong
    type or a key without meaning in MP mode raises ConfigError naming `adapter_params.<key>`."""
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        raise ConfigError(f"{where} must be a JSON object, got {type(params).__name__}")
    bad = [k for k in params if not isinstance(k, str)]
    if bad:
        raise ConfigError(f"{where}: keys must be strings, got {bad!r}")
    return _build(dict(params), lambda name: f"{where}.{name}", where,
                  '{"ssd_path": "/var/cache/kvtier", "ssd_capacity_gb": 100}', MP_EXCLUDED_KEYS)


#: the least an operator secret (`kvtier.encryption_key_file`) may hold
_MIN_SECRET = 32


def load_secret(path: str, key: str = "kvtier.encryption_key_file") -> bytes:
    """The operator's secret from `path` (ConfigError naming `key` if the file is unsafe or too short)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise ConfigError(f"{key}: cannot open {path} ({e.strerror}); it must be a regular file (not a link) holding "
                          f"at least {_MIN_SECRET} random bytes, e.g. `head -c 32 /dev/urandom > FILE; chmod 600 FILE`"
                          ) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{key}: {path} is not a regular file")
        if st.st_uid != os.getuid():
            raise ConfigError(f"{key}: {path} is owned by uid {st.st_uid}, not by this user ({os.getuid()})")
        if st.st_mode & 0o077:
            raise ConfigError(f"{key}: {path} is readable or writable by others (mode {stat.S_IMODE(st.st_mode):o}); "
                              f"chmod 600 {path}")
        secret = os.read(fd, 1 << 16)
    finally:
        os.close(fd)
    if len(secret) < _MIN_SECRET:
        raise ConfigError(f"{key}: {path} holds {len(secret)} bytes; the secret needs at least {_MIN_SECRET} random "
                          "bytes (`head -c 32 /dev/urandom > FILE`)")
    return secret
