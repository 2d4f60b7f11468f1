"""Where a host-tier load runs: inside the engine step (before its forward pass) or off it (the transfer thread).

Inside, the load's copy delays the step's forward pass, and with it every request of the step; off it, the copy
runs on the transfer thread beside the forward pass and the loading request waits in WAITING_FOR_REMOTE_KVS until
it has landed, at least one step longer. The stall a load adds to a step grows with its bytes, so the budget of
loads inside one step is KV bytes (`kvtier.connector.sync_load_budget_mb`, 128 MiB: 1024 tokens of Llama-3-8B,
about 5 ms of host -> GPU copy), converted to this model's tokens with its KV bytes per token
(`kvtier.scheduler_hooks.kv_cache_size`); `sync_load_budget_tokens` sets it in tokens instead. A load fits whole or
not at all; every load that reads the SSD tier runs off the step (the scheduler side decides that).

`LoadPlacement` keeps one step's account: `inside(tokens)` answers and counts, `new_step()` starts the next one.
Plain Python: no vLLM or LMCache import.
"""

from __future__ import annotations

__all__ = ["UNKNOWN_KV_SYNC_TOKENS", "LoadPlacement", "sync_budget_tokens"]

#: the budget in tokens when the model's KV bytes per token are unknown (128 MiB of a Llama-3-8B-sized model)
UNKNOWN_KV_SYNC_TOKENS = 1024


def sync_budget_tokens(budget_mb: float, budget_tokens: int | None, kv_bytes_per_token: int | None) -> int:
    """The tokens that may load inside one engine step: `budget_tokens` when set, else `budget_mb` MiB of this
    model's KV (`kv_bytes_per_token`; unknown: `UNKNOWN_KV_SYNC_TOKENS`)."""
    if budget_tokens is not None:
        return budget_tokens
    if not kv_bytes_per_token:
        return UNKNOWN_KV_SYNC_TOKENS
    return int(budget_mb * 2**20 // kv_bytes_per_token)


class LoadPlacement:
    """One scheduler's budget of tokens loaded inside each engine step."""

    def __init__(self, budget_tokens: int) -> None:
        self.budget_tokens = budget_tokens
        self._placed = 0  # tokens placed inside the step being scheduled

    def inside(self, tokens: int) -> bool:
        """Whether a load of `tokens` runs inside the step being scheduled (and counts it there if so)."""
        if tokens > self.budget_tokens - self._placed:
            return False
        self._placed += tokens
        return True

    def new_step(self) -> None:
        """The step's metadata was built: the next step's loads start from an empty budget."""
        self._placed = 0
