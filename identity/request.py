"""A request's KV identity beyond its token ids, as vLLM keys its own prefix cache.

vLLM hashes a block of tokens together with the request's "extra keys" (`generate_block_hash_extra_keys` in
`vllm/v1/core/kv_cache_utils.py`): the cache salt (isolation between tenants: one tenant cannot learn another's
prompts from its time to first token), the LoRA adapter (name and path), the multimodal items the block holds (the
item's hash and where it sits) and prompt embeddings. Two requests with the same tokens and different extra keys
never share KV there, and must not share it in kvtier's tiers either.

`RequestIdentity.of(request)` gives kvtier's form of the same identity:
- `tag`: a digest of the salt, the LoRA adapter (name, path, and a fingerprint of its files where the path is a local
  directory: an adapter rewritten in place is another adapter) and the prompt embeddings; empty for a request with
  none of them, so plain requests keep plain keys. It is bound into every chunk key of the request (a tag of
  LMCache's key in the connector, a prefix of the chain in the scheduler side's bookkeeping).
- `key_tokens(tokens)`: the tokens chunk keys are hashed over: the prompt with each multimodal item's placeholder
  tokens replaced by negative ids derived from the item's hash and the position inside the item. Placeholder ids
  are the same for every image, so without this two requests with different images at the same place would share
  KV. The chained chunk hashes then differ from the first chunk holding an item on, exactly as vLLM's block
  hashes do, and chunks before it are still shared.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["IdentitySource", "RequestIdentity", "tenant_of_key"]

#: how the identity tag appears in the string of a connector's LMCache key (`CacheEngineKey` tag `kvtier_id`)
KEY_TAG_MARK = "@kvtier_id%"

#: ids that replace placeholder tokens are -(1 + x) for x below this (never a vocabulary id, which is >= 0, and
#: within int64 for LMCache's token tensors)
_MM_SPACE = 1 << 62


class _Placeholder(Protocol):
    offset: int
    length: int


class _MMFeature(Protocol):
    identifier: str
    mm_position: _Placeholder


class _LoRA(Protocol):
    lora_name: str
    lora_path: str


class IdentitySource(Protocol):
    """What kvtier reads of vLLM's `Request` (vllm/v1/request.py, 0.30-0.34) to tell requests apart."""

    cache_salt: str | None
    lora_request: _LoRA | None
    mm_features: Sequence[_MMFeature]
    prompt_embeds: Any  # torch.Tensor | None


@dataclass(frozen=True)
class RequestIdentity:
    """`tag`: "" or a 32-hex-digit digest (see the module docstring); `mm`: (item hash, offset, length) of each
    multimodal item, by offset."""

    tag: str = ""
    mm: tuple[tuple[str, int, int], ...] = ()

    @staticmethod
    def of(request: IdentitySource) -> RequestIdentity:
        parts: list[Any] = []
        salt = request.cache_salt
        if salt:
            parts.append(["salt", str(salt)])
        lora = request.lora_request
        if lora is not None:
            path = str(lora.lora_path or "")
            parts.append(["lora", str(lora.lora_name), path, adapter_fingerprint(path)])
        embeds = request.prompt_embeds
        if embeds is not None:
            parts.append(["embeds", _tensor_digest(embeds)])
        mm = tuple(sorted((str(f.identifier), int(f.mm_position.offset), int(f.mm_position.length))
                          for f in request.mm_features or ()))
        return RequestIdentity(digest(parts) if parts else "", mm)

    def __bool__(self) -> bool:
        return bool(self.tag or self.mm)

    def key_tokens(self, tokens: Sequence[int]) -> list[int]:
        """The tokens chunk keys are hashed over (a copy only where a multimodal item lies in `tokens`)."""
        out = tokens if isinstance(tokens, list) else list(tokens)
        copied = False
        n = len(out)
        for ident, offset, length in self.mm:
            if offset >= n:
                break
            if not copied:
                out, copied = list(out), True
            base = _item_base(ident)
            for j in range(min(length, n - offset)):
                out[offset + j] = -1 - (base + j) % _MM_SPACE
        return out


def tenant_of_key(key: str) -> str:
    """The tenant a tier key belongs to ("" for none): the identity tag of a kvtier connector's LMCache key, the
    cache salt of an LMCache MP key (`mp2@...@<salt>`). Keys of other paths carry no tenant (vLLM's offloading
    tier folds the salt into its block hashes)."""
    at = key.find(KEY_TAG_MARK)
    if at >= 0:
        return key[at + len(KEY_TAG_MARK):].split("@", 1)[0]
    body = key.split("/", 1)[-1]
    if body.startswith("mp2@"):
        return body.rsplit("@", 1)[1]
    return ""


def digest(parts: Any) -> str:
    """A 128-bit digest of a JSON-encodable value (canonical encoding)."""
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


@functools.lru_cache(maxsize=4096)
def _item_base(identifier: str) -> int:
    return int.from_bytes(hashlib.blake2b(identifier.encode("utf-8", "surrogatepass"), digest_size=8).digest(),
                          "little") % _MM_SPACE


@functools.lru_cache(maxsize=256)
def adapter_fingerprint(path: str) -> str:
    """The content fingerprint of a LoRA adapter directory (its files, sampled as model weights are), "" where the
    path is not a local directory (a hub name: the name and path then stand for it). Computed once per path and
    process."""
    if not path or not os.path.isdir(path):
        return ""
    from kvtier.identity.model import files_fingerprint

    return files_fingerprint(path).digest


def _tensor_digest(t: Any) -> str:
    import torch

    data = t.detach().to("cpu").contiguous()
    raw = data.view(torch.uint8) if data.dtype != torch.bool else data.to(torch.uint8)
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest() + f":{data.dtype}:{tuple(data.shape)}"
