"""The eviction replay (`kvtier replay`): trace readers and a replay of a request trace through the same eviction
policy objects the tiers run, plus vLLM's own CPU-offload manager as a baseline. Not production code."""
