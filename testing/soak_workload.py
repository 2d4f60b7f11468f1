"""The soak's load (`testing/soak.py`): multi-turn conversations of the shipped Mooncake sessions as cumulative text
prompts, sent by a real client, `vllm bench serve`, at a fixed concurrency, in successive client rounds.

A conversation's turn k is the text of its turns 1..k (turn 1: one passage per 512-token trace block, so the trace's
shared system-prompt block is shared text; later turns: a new user message), so turn k+1 finds turn k's KV in some
tier. A round sends passes of `conversations` sessions (each pass salted: new text, the same shapes), interleaved
so that the distance back to a conversation's previous turn varies (host, SSD and shared-tier hits). Prompts go
out as ShareGPT-format records (the only text dataset of `vllm bench serve` that needs nothing beyond vLLM: its
`custom` one needs pandas), greedy, `ignore_eos`, each as long as its record's answer.
"""

from __future__ import annotations

import json
import logging
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

#: words the demo tokenizer (trained on kvtier's README and sources) knows well: about one token each
WORDS = ("the", "tier", "chunk", "cache", "host", "disk", "slot", "file", "read", "write", "turn", "request", "token",
         "engine", "server", "memory", "journal", "index", "policy", "queue", "load", "save", "store", "key", "page",
         "layer", "block", "prefix", "model", "kvtier", "vLLM", "LMCache", "config", "shared", "local", "time", "step",
         "first", "last", "size", "data", "test", "path", "user", "answer", "history", "evict", "commit", "start")
#: `vllm bench serve`'s ShareGPT loader drops prompts longer than this (tokens), silently
MAX_PROMPT_TOKENS = 1024
#: the step (pass) in which turn k of a pass goes out, after its turn 1 (`round_prompts`)
LAGS = (0, 1, 8)


@dataclass
class Prompt:
    conv: int
    turn: int
    text: str
    tokens: int


def _passage(key: str, words: int) -> str:
    rng = random.Random(key)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def conversations(trace: str, tokenizer_json: str, count: int, turns: int, words_per_block: int, salt: int,
                  max_tokens: int = MAX_PROMPT_TOKENS - 64) -> list[list[Prompt]]:
    """`count` conversations of `turns` cumulative prompts (the first sessions of `trace` with that many turns and
    whose last prompt fits `max_tokens`), text salted by `salt` except the shared system-prompt block."""
    from tokenizers import Tokenizer

    from kvtier.replay.traces import read_mooncake

    tok = Tokenizer.from_file(tokenizer_json)
    by_session: dict[int, list] = {}
    for r in read_mooncake(trace):
        by_session.setdefault(r.session, []).append(r)
    out: list[list[Prompt]] = []
    for session in sorted(by_session, key=lambda s: by_session[s][0].index):
        chain = sorted(by_session[session], key=lambda r: r.turn)[:turns]
        if [r.turn for r in chain] != list(range(1, turns + 1)):
            continue
        parts: list[str] = []
        convo: list[Prompt] = []
        for k, r in enumerate(chain):
            if k == 0:  # block 0 is the trace's common system prompt: the same text in every round
                parts.append("\n".join(_passage(f"block-{h}" if h == 0 else f"{salt}-block-{h}", words_per_block)
                                       for h in r.hash_ids[:4]))
            else:
                new = max(16, (r.input_length - chain[k - 1].input_length) * words_per_block // 512)
                parts.append(_passage(f"{salt}-msg-{session}-{k}", min(new, 2 * words_per_block)))
            text = "\n\n".join(parts)
            convo.append(Prompt(len(out), k + 1, text, len(tok.encode(text).ids)))
        if convo[-1].tokens > max_tokens:
            continue
        out.append(convo)
        if len(out) == count:
            break
    if len(out) < count:
        raise ValueError(f"only {len(out)} sessions of {trace} have {turns} turns within {max_tokens} tokens")
    return out


def round_prompts(passes: list[list[list[Prompt]]], seed: int) -> list[Prompt]:
    """Several passes of conversations interleaved: turn k of pass p goes out in step p + LAGS[k] (turn 2 one step
    after turn 1, turn 3 seven steps after turn 2, ...), each step's conversations in a seeded order. The way back
    to a conversation's previous turn then spans one pass's new chunks (its history mostly still in the host tier)
    or several (only on the SSD tier, or only in the shared tier)."""
    rng = random.Random(seed)
    turns = len(passes[0][0])
    lag = [LAGS[k] if k < len(LAGS) else LAGS[-1] + 8 * (k - len(LAGS) + 1) for k in range(turns)]
    out: list[Prompt] = []
    for step in range(len(passes) + lag[-1]):
        wave = [c[k] for k in range(turns) if 0 <= step - lag[k] < len(passes) for c in passes[step - lag[k]]]
        rng.shuffle(wave)
        out.extend(wave)
    return out


def write_sharegpt(path: Path, prompts: list[Prompt], answer_tokens: list[int]) -> None:
    """ShareGPT records; `vllm bench serve` asks for as many tokens as each record's answer has (one per word)."""
    path.write_text(json.dumps([{"id": f"c{p.conv}-t{p.turn}", "conversations": [
        {"from": "human", "value": p.text}, {"from": "gpt", "value": " ".join(["the"] * n)}]}
        for p, n in zip(prompts, answer_tokens)]))


@dataclass
class RoundResult:
    """One `vllm bench serve` run: per request, its start (CLOCK_MONOTONIC, as time.monotonic()), latency and
    error ("" when it succeeded)."""

    name: str
    requests: int
    started: float
    ended: float
    returncode: int
    starts: list[float] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    note: str = ""

    @property
    def failed(self) -> int:
        return sum(1 for e in self.errors if e) + max(0, self.requests - len(self.errors))


def attribute_failures(res: RoundResult, kills: list[float]) -> tuple[int, int]:
    """(failed requests in flight at a kill during the round, failed requests outside those). A request is in flight
    at a kill if it was sent before it; a round without per-request records counts every request as failed."""
    kill = max((k for k in kills if res.started <= k <= res.ended), default=None)
    inflight = outside = 0
    for start, err in zip(res.starts, res.errors):
        if err and kill is not None and start <= kill:
            inflight += 1
        elif err:
            outside += 1
    return inflight, outside + max(0, res.requests - len(res.errors))


class BenchRound:
    """`vllm bench serve` against `url` on a ShareGPT file, in the background; `result()` waits for it."""

    def __init__(self, name: str, workdir: Path, url: str, model: str, prompts: list[Prompt], concurrency: int,
                 output_tokens: int, rate: float, tail_tokens: int, ready_timeout_s: float = 600) -> None:
        """The last `concurrency` requests answer `tail_tokens` tokens (the others `output_tokens`): the round ends
        with that many requests in flight for a while (a kill then finds them there, and nothing left unsent)."""
        self.name, self.requests, self.prompts = name, len(prompts), prompts
        self.dataset = workdir / f"{name}.json"
        tail = max(0, len(prompts) - concurrency)
        write_sharegpt(self.dataset, prompts, [output_tokens if i < tail else tail_tokens for i in range(len(prompts))])
        self.out = workdir / f"{name}-result.json"
        self.log_path = workdir / f"{name}.log"
        vllm = Path(sys.executable).parent / "vllm"  # kvtier's CPU environment: vLLM's CLI (`kvtier.cli.serve`)
        cmd = [str(vllm) if vllm.exists() else "vllm", "bench", "serve", "--backend", "openai", "--base-url", url,
               "--model", model, "--tokenizer", model, "--dataset-name", "sharegpt", "--dataset-path",
               str(self.dataset), "--disable-shuffle", "--num-prompts", str(self.requests), "--ignore-eos",
               "--temperature", "0", "--max-concurrency", str(concurrency),
               "--request-rate", str(rate),
               "--ready-check-timeout-sec", str(int(ready_timeout_s)), "--save-result", "--save-detailed",
               "--result-dir", str(workdir), "--result-filename", self.out.name, "--disable-tqdm", "--seed", "0"]
        self.started = time.monotonic()
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)

    def done(self) -> bool:
        return self.proc.poll() is not None

    def result(self, timeout: float = 900) -> RoundResult:
        try:
            rc = self.proc.wait(timeout)
        finally:
            self.stop()
        res = RoundResult(self.name, self.requests, self.started, time.monotonic(), rc)
        if not self.out.exists():
            res.note = f"no result file (exit {rc}); log ends: {self.log_path.read_text(errors='replace')[-1500:]}"
            return res
        d = json.loads(self.out.read_text())
        res.starts = [float(x) for x in d.get("start_times", [])]
        res.latencies = [float(x) for x in d.get("latencies", [])]
        res.errors = [str(x or "") for x in d.get("errors", [])]
        res.texts = [str(x or "") for x in d.get("generated_texts", [])]
        return res

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        if not self._log.closed:
            self._log.close()
