"""The harness of tests and benchmarks (not production code): real vLLM engines in a child process, `vllm serve`,
LMCache's MP client, SSD test helpers, the tests' tiny LMCache model, the soak run and `waiting.wait_until` (a
deadline poll for tests). What the shipped demos start (the demo model, lmcache server, redis-server, LMCache YAMLs
and engines) lives in `kvtier.launch`. No production package imports it."""
