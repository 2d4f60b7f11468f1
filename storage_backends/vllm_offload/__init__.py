"""kvtier inside vLLM's own offloading path (`OffloadingConnector` + `TieringOffloadingSpec`,
`vllm/v1/kv_offload/tiering/`): kvtier's SSD tier as an out-of-tree secondary tier (`secondary_tier`), loaded by
vLLM from the `module_path` a `secondary_tiers` entry names. Every module here imports vLLM; the SSD tier under
`kvtier.storage_backends.ssd` does not."""
