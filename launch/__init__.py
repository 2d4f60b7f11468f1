"""Starting what the demos run: the demo model, LMCache YAMLs from the shipped configs, an `lmcache server`, a
`redis-server`, an in-process LMCacheEngine, and the end of a vLLM engine's process group.

Shipped with the `kvtier demo*` commands (`kvtier.cli`), and used by the test harness (`kvtier.testing`) and the
benchmarks too. It imports only production packages; no production package imports it. Every process started here
is stopped by its owner's `stop()` / `with` block (or `end_process_group`), whatever happens in between.
"""
