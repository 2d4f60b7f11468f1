"""Trains the demo model's tokenizer: a byte-level BPE of 1,024 tokens over text kvtier ships (its README and
Python sources), with a chat template, so HTTP clients can talk to the tiny demo Llama offline.

    python -m kvtier.testing.demo_tokenizer            # rewrites kvtier/demo_data/tiny-tokenizer/

The result is committed (`demo_data/tiny-tokenizer/`): the demo, the tests and the benchmarks use those files
and never train at run time. Ids 0-5 are the special tokens, so the model config's defaults (bos 1, eos 2) match.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

VOCAB_SIZE = 1024
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>"]
#: one turn per role token, the answer closed by eos; `add_generation_prompt` opens the assistant's turn
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}"
    "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
PACKAGE = Path(__file__).resolve().parent.parent
OUT = PACKAGE / "demo_data" / "tiny-tokenizer"


def corpus(root: Path = PACKAGE) -> list[str]:
    """The training text: README.md and every Python source of the package, in a fixed order."""
    files = [root / "README.md"] + sorted(p for p in root.rglob("*.py") if ".venv" not in p.parts
                                           and "__pycache__" not in p.parts)
    return [p.read_text(encoding="utf-8", errors="replace") for p in files if p.is_file()]


def train(texts: list[str], vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE (`tokenizers.Tokenizer`) trained on `texts`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save(tok, out: str) -> None:
    """`tokenizer.json` plus a `tokenizer_config.json` that any transformers release (4.x and 5.x) reads: the
    fast-tokenizer class, the special tokens and the chat template inline."""
    os.makedirs(out, exist_ok=True)
    tok.save(os.path.join(out, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>", "eos_token": "<|eos|>",
              "pad_token": "<|pad|>", "model_max_length": 8192, "clean_up_tokenization_spaces": False,
              "chat_template": CHAT_TEMPLATE}
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)
        f.write("\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(OUT), help="directory to write (default: the shipped one)")
    args = p.parse_args(argv)
    tok = train(corpus())
    save(tok, args.out)
    print(f"tokenizer with {tok.get_vocab_size()} tokens written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
