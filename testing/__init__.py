"""The harness shared by tests, demos and benchmarks (not production code): real vLLM engines in a child process,
a real redis-server, LMCache's multiprocess server, the tiny demo model, SSD test helpers, LMCache engine
factories and `waiting.wait_until` (a deadline poll for tests). Nothing in connector, storage_backends or
scheduler_hooks imports it."""
