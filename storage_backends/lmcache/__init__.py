"""kvtier inside LMCache: the in-process storage plugin (`backend.KVTierBackend`), the multiprocess-mode L2 adapter
(`mp_adapter.KVTierL2Adapter`), kvtier's eviction policies as LMCache host-tier cache policies (`host_policy`), the
host pool, and the GPU connectors that store chunks page-first (`gpu_connector`, `dense_cpu_connector`). What kvtier
reaches into of LMCache's internals (the storage manager, remote backends, the host tier) is in `engine_access`.
Every module here imports LMCache; the modules under `kvtier.storage_backends.ssd` and `eviction` do not."""
