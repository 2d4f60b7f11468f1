"""kvtier's Prometheus series (`series`): declared once, exported by the process and carried to vLLM's API server."""
