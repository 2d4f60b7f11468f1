"""Configuration and start-up of the multiprocess-mode L2 adapter: `adapter_params` parsed strictly
(`KVTierL2AdapterConfig`), settings named as the user wrote them (`adapter_params.<key>`), kvtier's log lines made
visible under `lmcache server`, the adapter's directory claimed (created, checked, locked) at start, and the slot size
its chunks were stored at recorded there (`LAYOUT_FILE`)."""

from __future__ import annotations

import json
import logging
import os

from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase

from kvtier.storage_backends.config import (
    ConfigError,
    KVTierConfig,
    parse_adapter_params,
)
from kvtier.storage_backends.ssd.directory import (
    DirectoryInUse,
    lock_directory,
    prepare_directory,
    read_small_file,
    write_small_file,
)

logger = logging.getLogger(__name__)

#: the file under the adapter's directory that records its chunks' slot size (LMCache hands an adapter none)
LAYOUT_FILE = "layout.json"


class KVTierL2AdapterConfig(L2AdapterConfigBase):
    """`adapter_params` of the plugin spec, parsed strictly into kvtier's `KVTierConfig`."""

    def __init__(self, kvtier: KVTierConfig) -> None:
        self.kvtier = kvtier

    @classmethod
    def from_dict(cls, d: dict) -> KVTierL2AdapterConfig:
        return cls(parse_adapter_params(d))

    @classmethod
    def help(cls) -> str:
        from kvtier.storage_backends.config import KEYS, MP_EXCLUDED_KEYS

        lines = ["kvtier L2 adapter: adapter_params are kvtier's keys without the 'kvtier.' prefix:"]
        lines += [f"- {k.name} ({k.kind}{', required' if k.required else ''}): {k.help}" for k in KEYS
                  if k.name not in MP_EXCLUDED_KEYS]
        return "\n".join(lines)


def adapter_key_names(message: str) -> str:
    """The tier names its settings `kvtier.<key>`; in MP mode the user wrote them as `adapter_params.<key>`."""
    from kvtier.storage_backends.config import KEYS

    for k in KEYS:
        message = message.replace(f"kvtier.{k.name}", f"adapter_params.{k.name}")
    return message


def show_logs() -> None:
    """`lmcache server` configures only LMCache's own loggers: without a handler, kvtier's INFO lines (the tier's
    size, what a restart found) would be lost. Give the `kvtier` logger one, unless the process has its own."""
    root, ours = logging.getLogger(), logging.getLogger("kvtier")
    if root.handlers or ours.handlers:
        return
    h = logging.StreamHandler()
    h.setFormatter(logging.Formatter("[%(asctime)s] kvtier %(levelname)s: %(message)s (%(name)s)"))
    ours.addHandler(h)
    if ours.level == logging.NOTSET:
        ours.setLevel(logging.INFO)


def prepare_directories(ssd_path: str, directory: str) -> None:
    """Create and check `ssd_path` and the adapter's directory under it; errors name `adapter_params.<key>`."""
    try:
        prepare_directory(ssd_path)
        prepare_directory(directory)
    except ConfigError as e:
        raise ConfigError(adapter_key_names(str(e))) from None


def check_o_direct(directory: str) -> str | None:
    """ConfigError (naming `adapter_params.o_direct`) if the directory's file system refuses O_DIRECT. A full disk
    is no refusal: the probe then reads a file already there, and when there is none it cannot tell; that is logged
    and returned (None when O_DIRECT works)."""
    from kvtier.storage_backends.ssd.posix_io import probe_o_direct

    try:
        untold = probe_o_direct(directory)
    except OSError as e:
        raise ConfigError(f"adapter_params.o_direct: the file system of {directory} refuses O_DIRECT "
                          f"({e.strerror}); put ssd_path on a real disk, or set \"o_direct\": false") from None
    if untold is None:
        return None
    warning = (f"adapter_params.o_direct: cannot check that the file system of {directory} takes O_DIRECT: "
               f"{untold}; starting with O_DIRECT as configured")
    logger.warning("%s", warning)
    return warning


def claim_directory(ssd_path: str, directory: str, o_direct: bool) -> int:
    """Create, check and lock the adapter's directory now, so a bad or unsafe path or a second server on the same
    path fails at start (the tier itself opens later, with the first chunk size). `kvtier check-config` runs the same
    checks without the lock."""
    prepare_directories(ssd_path, directory)
    try:
        fd = lock_directory(directory, "adapter.lock")
    except (ConfigError, DirectoryInUse) as e:
        raise ConfigError(adapter_key_names(str(e))) from None
    if o_direct:
        try:
            check_o_direct(directory)
        except ConfigError:
            os.close(fd)
            raise
    return fd


def saved_chunk_bytes(directory: str) -> int | None:
    """The chunk size a previous run opened the tier with (None: a first start); a ConfigError if unreadable."""
    path = os.path.join(directory, LAYOUT_FILE)
    try:
        data = read_small_file(path)
        if data is None:
            return None
        n = int(json.loads(data)["chunk_bytes"])
        if n <= 0:
            raise ValueError(n)
        return n
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"adapter_params.ssd_path: {path} is unreadable ({e}); it records the slot size of "
                          f"the chunks under {directory}: restore it, or empty that directory") from None


def record_chunk_bytes(directory: str, chunk_bytes: int) -> None:
    """Record the chunk size the tier opens with (once: a recorded size is kept)."""
    path = os.path.join(directory, LAYOUT_FILE)
    if read_small_file(path) is None:
        write_small_file(path, json.dumps({"chunk_bytes": chunk_bytes}).encode())
