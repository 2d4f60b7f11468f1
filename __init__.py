"""kvtier: a host-memory + SSD tier for LLM KV caches, shared by vLLM and LMCache."""

__version__ = "0.1.0"
