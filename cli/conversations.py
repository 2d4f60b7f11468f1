"""The conversations the vLLM demos replay (`kvtier demo-vllm`, `kvtier demo-shared`): whole conversations of a
Mooncake-format trace, sessions recovered from the prefix chains, scaled to the tiny demo model.

A turn-1 prompt is its trace blocks (one 512-token hash id -> `block_tokens` token ids, so a block shared in the
trace, such as the system prompt, is shared here too); a follow-up turn is the previous prompt + the answer the
model generated + a new user message (the trace's new input, scaled).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import random
from dataclasses import dataclass

from kvtier.launch.demo_model import VOCAB

logger = logging.getLogger(__name__)


@dataclass
class Turn:
    conv: int  #: position of the conversation in the replay (0..)
    session: int  #: session id in the trace
    turn: int  #: 1-based
    index: int  #: trace line (arrival order)
    new_tokens: list[int]  #: turn 1: the whole prompt; later turns: the new user message
    max_tokens: int
    trace_input: int  #: the trace's prompt length (512-token blocks world)


def _block_tokens(hash_id: int, n: int) -> list[int]:
    """Token ids standing for one 512-token trace block: equal ids give equal blocks (prefix reuse preserved)."""
    rng = random.Random(hashlib.sha256(f"block-{hash_id}".encode()).digest())
    return [rng.randrange(1, VOCAB) for _ in range(n)]


def _message_tokens(session: int, turn: int, new_ids: tuple[int, ...], n: int) -> list[int]:
    rng = random.Random(hashlib.sha256(f"msg-{session}-{turn}-{new_ids}".encode()).digest())
    return [rng.randrange(1, VOCAB) for _ in range(n)]


def build_workload(trace: str, conversations: int, turns: int, block_tokens: int, max_prompt: int,
                   answer_tokens: int) -> tuple[list[Turn], int]:
    """The replayed turns in trace arrival order, and the longest prompt + answer (tokens)."""
    from kvtier.replay.traces import read_mooncake

    scale = block_tokens / 512
    reqs = read_mooncake(trace)
    by_session: dict[int, list] = {}
    for r in reqs:
        by_session.setdefault(r.session, []).append(r)
    out: list[Turn] = []
    longest = 0
    chosen = 0
    for session in sorted(by_session, key=lambda s: by_session[s][0].index):
        chain = sorted(by_session[session], key=lambda r: r.turn)[:turns]
        if len(chain) < turns or [r.turn for r in chain] != list(range(1, turns + 1)):
            continue
        answers = [max(4, min(answer_tokens, round(r.output_length * scale))) for r in chain]
        plan: list[Turn] = []
        length = 0
        for k, r in enumerate(chain):
            if k == 0:
                n = max(block_tokens, round(r.input_length * scale))
                toks = [t for h in r.hash_ids for t in _block_tokens(h, block_tokens)][:n]
            else:
                prev = chain[k - 1]
                new_input = r.input_length - prev.input_length - prev.output_length
                n = max(8, round(new_input * scale))
                shared = 0
                while shared < min(len(prev.hash_ids), len(r.hash_ids)) and \
                        prev.hash_ids[shared] == r.hash_ids[shared]:
                    shared += 1
                toks = _message_tokens(session, r.turn, r.hash_ids[shared:], n)
            length += len(toks)
            plan.append(Turn(chosen, session, r.turn, r.index, toks, answers[k], r.input_length))
            if k + 1 < len(chain):
                length += answers[k]
        if length > max_prompt:
            continue
        longest = max(longest, length + answers[-1])
        out.extend(plan)
        chosen += 1
        if chosen == conversations:
            break
    if chosen < conversations:
        logger.warning("only %d conversations of %s have %d turns and fit --max-prompt-tokens %d",
                       chosen, trace, turns, max_prompt)
    out.sort(key=lambda t: t.index)
    return out, longest


def workload_of(args: argparse.Namespace) -> tuple[list[Turn], int] | str:
    """`build_workload` from a demo's options (`add_engine_arguments`), or the one line that says why there is no
    workload: the trace cannot be read (the file and line named, no traceback), or no conversation fits."""
    from kvtier.replay.traces import input_error

    try:
        turns, longest = build_workload(args.trace, args.conversations, args.turns, args.block_tokens,
                                        args.max_prompt_tokens, args.answer_tokens)
    except (OSError, ValueError) as e:
        return f"--trace: {input_error(e)}"
    if not turns:
        return "no conversation of the trace fits the options; raise --max-prompt-tokens or lower --turns"
    return turns, longest
