"""kvtier inside vLLM's own offloading path (`OffloadingConnector` + `TieringOffloadingSpec`,
`vllm/v1/kv_offload/tiering/`): kvtier's SSD tier as an out-of-tree secondary tier (`secondary_tier`), loaded by
vLLM from the `module_path` a `secondary_tiers` entry names. Every module here imports vLLM; the SSD tier under
`kvtier.storage_backends.ssd` does not, nor does this file (the names `kvtier check-config` needs)."""

import os

#: what a `secondary_tiers` entry names for kvtier's tier, and `cache_policy_module_path` for its policies
TIER_CLASS = "KVTierSecondaryTier"
TIER_MODULE = "kvtier.storage_backends.vllm_offload.secondary_tier"
POLICY_MODULE = "kvtier.storage_backends.vllm_offload.cache_policy"
#: the tiers' directory under ssd_path (apart from the connector's worker<r>-of-<w> and LMCache's directories); each
#: layout (model, dtype, chunk size, parallelism) has a directory of its own below it
SUBDIR = "vllm-offload"


def tier_directory(ssd_path: str) -> str:
    return os.path.join(ssd_path, SUBDIR)
