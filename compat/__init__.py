"""kvtier.compat: the vLLM x LMCache versions kvtier supports, and the adapters that bridge their differences.

- `matrix` (with `matrix.toml`): the tested and known-broken combinations, read by the build scripts, the test
  command and the version guard.
- `guard`: the start-up version check of the connector and the LMCache plugins.
- `vllm_*` / `lmcache_*` modules: one adapter per interface difference, named after the version range it serves.
"""
