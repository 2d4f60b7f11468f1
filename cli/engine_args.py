"""The command-line options the three demos share: the trace and how it is scaled, the tier sizes, and for the vLLM
demos the replayed conversations, vLLM's page and the chunk, and where a run keeps its files.

Each demo adds its own options after these (`kvtier demo --help`, `kvtier demo-vllm --help`,
`kvtier demo-shared --help`); the defaults differ per demo and are its arguments here.
"""

from __future__ import annotations

import argparse


def add_engine_arguments(p: argparse.ArgumentParser, *, block_tokens: int, host_mb: float | None, ssd_mb: float,
                         conversations: int | None = None, max_prompt_tokens: int = 0, answer_tokens: int = 0,
                         per_replica: bool = False) -> None:
    """Add the shared options to `p`.

    `conversations` None: the LMCache-level demo (a trace slice through an LMCache engine, no vLLM): the trace,
    `--block-tokens` and the two tier sizes only. Otherwise a vLLM demo: also the conversations to replay
    (`--conversations`, `--turns`, `--max-prompt-tokens`, `--answer-tokens`), `--page-tokens`, `--chunk-tokens`,
    `--workdir` and `--json`. `host_mb` None: the demo sizes the host tier from the replay. `per_replica`: the
    tier sizes are per vLLM replica (`demo-shared`).
    """
    from kvtier.demo_data import path as data_path

    vllm = conversations is not None
    p.add_argument("--trace", default=data_path("mooncake_conversation_sessions.jsonl"),
                   help="Mooncake-format JSONL (default: 60 whole conversations shipped with kvtier)")
    if vllm:
        p.add_argument("--conversations", type=int, default=conversations, help="conversations to replay")
        p.add_argument("--turns", type=int, default=4,
                       help="turns per conversation (conversations with fewer are skipped)")
    p.add_argument("--block-tokens", type=int, default=block_tokens, help="token ids per 512-token trace block")
    if vllm:
        p.add_argument("--max-prompt-tokens", type=int, default=max_prompt_tokens,
                       help="skip conversations whose last replayed prompt would be longer")
        p.add_argument("--answer-tokens", type=int, default=answer_tokens,
                       help="upper bound of a scaled answer (greedy, no EOS)")
        p.add_argument("--page-tokens", type=int, default=32, help="vLLM block size (tokens)")
        p.add_argument("--chunk-tokens", type=int, default=64, help="LMCache/kvtier chunk size (multiple of the page)")
    each = " per replica" if per_replica else ""
    if host_mb is None:
        host_help = (f"kvtier host tier (LMCache local CPU) size{each}; default: half of the replay's history (at "
                     "least three of the longest requests), so part of it comes back from the SSD tier")
    else:
        host_help = f"host tier (LMCache local CPU) size{each}"
    p.add_argument("--host-mb", type=float, default=host_mb, help=host_help)
    p.add_argument("--ssd-mb", type=float, default=ssd_mb, help=f"kvtier SSD tier size{each}")
    if vllm:
        p.add_argument("--workdir", default=None, help="keep the model, configs and engine logs here (default: a "
                                                       "temporary directory, removed at the end)")
        p.add_argument("--json", default=None, help="also write all per-request results to this JSON file")
