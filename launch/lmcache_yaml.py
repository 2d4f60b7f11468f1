"""The shipped LMCache YAMLs (`configs/lmcache-kvtier*.yaml`) with their paths and sizes replaced, for the demos,
tests and benchmarks: every demo and test that runs LMCache with kvtier starts from the file users are told to use,
so a change to that file is tested, and only the lines a small machine needs differ.

    path = write_lmcache_yaml(tmp / "lmcache.yaml", ssd_path=tmp / "ssd", chunk_size=32, host_gb=0.01,
                              ssd_capacity_gb=0.05, extra={"eviction_policy": "answer-length"})
"""

from __future__ import annotations

from pathlib import Path

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
#: the shipped files' placeholder values, replaced below
_SHIPPED = {"ssd_path": "/var/cache/kvtier", "chunk_size": "chunk_size: 256", "host_gb": "max_local_cpu_size: 5 ",
            "ssd_capacity_gb": "kvtier.ssd_capacity_gb: 100", "redis_port": "redis://127.0.0.1:6379"}


def lmcache_yaml_text(*, ssd_path: str | Path, base: str = "lmcache-kvtier.yaml", chunk_size: int | None = None,
                      host_gb: float | str | None = None, ssd_capacity_gb: float | None = None,
                      redis_port: int | None = None, replace: dict[str, str] | None = None,
                      extra: dict | None = None, lines: str = "") -> str:
    """`configs/<base>` with the SSD path (and, where given, the chunk size, host pool GiB, SSD capacity GiB and
    Redis port) replaced, then each `replace` item (old text -> new text); `extra` appends `kvtier.<key>: <value>`
    lines to `extra_config`, `lines` raw text at the end. A placeholder missing from the shipped file is an error
    (the file changed: adapt this helper), never a test silently run with the shipped value."""
    text = (CONFIGS / base).read_text()
    new: dict[str, str | None] = {
           "ssd_path": str(ssd_path),
           "chunk_size": None if chunk_size is None else f"chunk_size: {chunk_size}",
           "host_gb": None if host_gb is None else f"max_local_cpu_size: {host_gb} ",
           "ssd_capacity_gb": None if ssd_capacity_gb is None else f"kvtier.ssd_capacity_gb: {ssd_capacity_gb}",
           "redis_port": None if redis_port is None else f"redis://127.0.0.1:{redis_port}"}
    for name, value in new.items():
        if value is None:
            continue
        if _SHIPPED[name] not in text:
            raise ValueError(f"configs/{base} has no {_SHIPPED[name]!r} to replace ({name})")
        text = text.replace(_SHIPPED[name], value)
    for old, value in (replace or {}).items():
        if old not in text:
            raise ValueError(f"configs/{base} has no {old!r} to replace")
        text = text.replace(old, value)
    for key, value in (extra or {}).items():
        text += f"  kvtier.{key}: {value}\n"
    return text + lines


def write_lmcache_yaml(path: str | Path, **kw) -> str:
    """Write `lmcache_yaml_text(**kw)` to `path`; returns the path as a string."""
    Path(path).write_text(lmcache_yaml_text(**kw))
    return str(path)
