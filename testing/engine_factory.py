"""The tests' tiny model for in-process LMCache engines (`kvtier.launch.lmcache_engine`) and seeded KV for it."""

from __future__ import annotations

import torch

from kvtier.launch.lmcache_engine import ModelShape

#: the tests' tiny model: 2 layers, 2 KV heads of 16, bfloat16 (16-token chunks of it are 4 KiB)
TINY = ModelShape("kvtier-test/tiny", num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)


def random_kv(shape: ModelShape, tokens: int, seed: int = 0) -> torch.Tensor:
    """A seeded random KV tensor `[2, layers, tokens, hidden]` of `shape` (what the dense CPU connector takes)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, shape.num_layers, tokens, shape.hidden, generator=g).to(shape.dtype)
