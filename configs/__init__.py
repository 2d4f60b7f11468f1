"""Ready-to-use configurations shipped with kvtier (LMCache YAML, vLLM kv-transfer JSON)."""

from __future__ import annotations

from importlib import resources


def path(name: str) -> str:
    """Filesystem path of a shipped config file, e.g. path("lmcache-kvtier.yaml")."""
    return str(resources.files(__name__) / name)
