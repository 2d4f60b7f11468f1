"""Small workload slices shipped with kvtier for the demo and the tests (see NOTICE for their license)."""

from __future__ import annotations

from importlib import resources


def path(name: str = "mooncake_conversation_slice.jsonl") -> str:
    return str(resources.files(__name__) / name)
