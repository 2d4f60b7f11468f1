"""The tiny demo model: a random 4-layer Llama (built with transformers, no download) plus the shipped byte-level
BPE tokenizer and chat template, so `vllm serve DIR` works offline and HTTP clients can talk to it.

    kvtier demo-model /tmp/kvtier-tiny            # then: vllm serve /tmp/kvtier-tiny --dtype float32 ...

Weights are random with a large init scale (decisive argmax: greedy outputs of two servers can be compared) and
seeded, so every build of the directory holds the same model.
"""

from __future__ import annotations

import argparse
import os
import shutil
from importlib import resources

VOCAB = 1024
#: the tiny model (4-layer Llama, fp32); its KV is 2 x layers x kv heads x head dim x 4 bytes per token
MODEL = {"hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 2, "vocab_size": VOCAB, "max_position_embeddings": 8192, "initializer_range": 0.2,
         "bos_token_id": 1, "eos_token_id": 2}  # the tokenizer's <|bos|> and <|eos|> (also LlamaConfig's defaults)
KV_BYTES_PER_TOKEN = 2 * MODEL["num_hidden_layers"] * MODEL["num_key_value_heads"] * (
    MODEL["hidden_size"] // MODEL["num_attention_heads"]) * 4
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def tokenizer_dir() -> str:
    """The shipped tokenizer (`kvtier/demo_data/tiny-tokenizer`, made by `kvtier.testing.demo_tokenizer`)."""
    return str(resources.files("kvtier.demo_data") / "tiny-tokenizer")


def install_tokenizer(path: str) -> None:
    """Copy the shipped tokenizer files into a model directory."""
    for name in TOKENIZER_FILES:
        shutil.copyfile(os.path.join(tokenizer_dir(), name), os.path.join(path, name))


def build(path: str, seed: int = 0, config: dict | None = None, tokenizer: bool = True) -> str:
    """Write the demo model (config, weights, generation config, tokenizer) to `path` unless it is there.
    `config` replaces `MODEL` (the tests' smaller Llamas: `kvtier.testing.vllm_engine`), `tokenizer=False` leaves
    the tokenizer out (engines fed token ids)."""
    if not os.path.exists(os.path.join(path, "config.json")):
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(seed)
        LlamaForCausalLM(LlamaConfig(**(MODEL if config is None else config))).save_pretrained(path)
    if tokenizer and not all(os.path.exists(os.path.join(path, n)) for n in TOKENIZER_FILES):
        install_tokenizer(path)
    return path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="directory to write the model to (kept if it already holds one)")


def run(args: argparse.Namespace) -> int:
    build(args.dir)
    print(f"demo model in {os.path.abspath(args.dir)}: {MODEL['num_hidden_layers']}-layer Llama, vocab {VOCAB}, "
          f"byte-level BPE tokenizer with a chat template (serve it with --dtype float32)")
    return 0
