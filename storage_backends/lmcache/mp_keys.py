"""Keys and layouts of LMCache multiprocess-mode objects in kvtier's SSD tier: an `ObjectKey` with the fingerprint
of its model's weights as a reversible string (`key_string` / `parse_key_string`), the fingerprints themselves
(`ModelWeights`), the `Layout` a stored chunk and its destination buffer must share, and the pages of LMCache's key
listing (`key_page`).

LMCache's MP keys carry the model's name (vLLM's model path or id), the KV rank, the object group, the chunk hash
and the request's cache salt, but nothing of the weights: a model updated in place keeps its name. The adapter adds
a fingerprint of the weights' content and config (`kvtier.identity.model`), computed once per model name on the
server (which runs beside vLLM and reads the same model files): chunks of the old weights are never found.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
from lmcache.v1.distributed.api import EncodedObjectKey, KeyEntry, KeyListPage, MemoryLayoutDesc, ObjectKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObj

from kvtier.identity.model import config_digest, read_config, weights_identity
from kvtier.identity.request import digest
from kvtier.storage_backends.base import ChunkMeta

logger = logging.getLogger(__name__)

_KEY_TAG = "mp2"
#: LMCache's MP connector appends a layout namespace to the model name under decode context parallelism
_DCP_MARK = "##"
_DTYPES = {str(d): d for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8,
                               torch.int16, torch.int32, torch.int64, torch.float8_e4m3fn, torch.float8_e5m2)}


def key_string(key: ObjectKey, weights: str) -> str:
    """The tier's key for an LMCache MP object of a model whose weights have fingerprint `weights`:
    `mp2@weights@model@kv_rank@group@chunk_hash@salt` (hex numbers). LMCache forbids `@` in model names and salts,
    so the string splits back unambiguously (`parse_key_string`)."""
    return (f"{_KEY_TAG}@{weights}@{key.model_name}@{key.kv_rank:x}@{key.object_group_id:x}@{key.chunk_hash.hex()}"
            f"@{key.cache_salt}")


def parse_key_string(s: str) -> ObjectKey | None:
    parsed = parse_key_weights(s)
    return parsed[0] if parsed is not None else None


def parse_key_weights(s: str) -> tuple[ObjectKey, str] | None:
    """The object key and the weights' fingerprint of a tier key (None: not such a key, e.g. written by kvtier
    before keys carried the fingerprint)."""
    parts = s.split("@")
    if len(parts) != 7 or parts[0] != _KEY_TAG or not parts[1]:
        return None
    _, weights, model, rank, group, chunk, salt = parts
    try:
        return ObjectKey(chunk_hash=bytes.fromhex(chunk), model_name=model, kv_rank=int(rank, 16),
                         object_group_id=int(group, 16), cache_salt=salt), weights
    except ValueError:
        return None


class ModelWeights:
    """Model name -> the fingerprint of its weights' content and config (16 hex digits), computed on first use
    (a few MB read) and kept; `on_new(model, fingerprint)` runs once per model after it is computed (the adapter
    reclaims that model's chunks of other fingerprints first)."""

    def __init__(self, on_new: Callable[[str, str], None] | None = None) -> None:
        self._known: dict[str, str] = {}
        self._lock = threading.Lock()
        self._on_new = on_new

    def __call__(self, model_name: str) -> str:
        fp = self._known.get(model_name)
        if fp is not None:
            return fp
        with self._lock:
            fp = self._known.get(model_name)
            if fp is not None:
                return fp
            base = model_name.split(_DCP_MARK, 1)[0]
            weights = weights_identity(base)
            fp = digest([weights.source, weights.digest, config_digest(read_config(base))])[:16]
            logger.info("kvtier L2 adapter: model %s has KV fingerprint %s (weights %s)", model_name, fp,
                        weights.describe())
            self._known[model_name] = fp
        if self._on_new is not None:
            self._on_new(model_name, fp)
        return fp


@dataclass(frozen=True)
class Layout:
    """What must agree between a stored chunk and a buffer it is read into."""

    nbytes: int
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    fmt: str

    @staticmethod
    def of_object(obj: MemoryObj) -> Layout:
        meta = obj.metadata
        shapes = meta.shapes or [meta.shape]
        dtypes = meta.dtypes or [meta.dtype]
        return Layout(int(obj.get_size()), tuple(tuple(int(x) for x in s) for s in shapes),
                      tuple(str(d) for d in dtypes), obj.get_memory_format().name)

    @staticmethod
    def of_meta(meta: ChunkMeta) -> Layout | None:
        try:
            shapes = meta.extra.get("shapes", [meta.shape])
            dtypes = meta.extra.get("dtypes", [meta.dtype])
            return Layout(int(meta.nbytes), tuple(tuple(int(x) for x in s) for s in shapes),
                          tuple(str(d) for d in dtypes), str(meta.fmt))
        except (TypeError, ValueError, AttributeError):
            return None

    def chunk_meta(self) -> ChunkMeta:
        return ChunkMeta(self.nbytes, self.shapes[0] if self.shapes else (), self.dtypes[0] if self.dtypes else "",
                         self.fmt, {"shapes": [list(s) for s in self.shapes], "dtypes": list(self.dtypes)})

    def consistent(self) -> bool:
        """Shapes and dtypes are known and add up to nbytes (what a slot written by this adapter always has)."""
        if self.fmt not in MemoryFormat.__members__ or len(self.shapes) != len(self.dtypes) or not self.shapes:
            return False
        total = 0
        for shape, dtype in zip(self.shapes, self.dtypes):
            d = _DTYPES.get(dtype)
            if d is None:
                return False
            n = d.itemsize
            for x in shape:
                n *= x
            total += n
        return total == self.nbytes


def desc_bytes(desc: MemoryLayoutDesc) -> int:
    return sum(torch.Size(s).numel() * d.itemsize for s, d in zip(desc.shapes, desc.dtypes))


def meta_ok(meta: ChunkMeta) -> bool:
    """The tier's layout predicate: a slot whose recorded layout is not self-consistent is unusable."""
    lay = Layout.of_meta(meta)
    return lay is not None and lay.consistent()


def key_page(items: list[tuple[str, int]], model_name: str | None, page_size: int, cursor: str | None
             ) -> KeyListPage:
    """One page of LMCache's key listing (`list_l2_keys`): of the stored chunks `items` ((key string, bytes),
    sorted by key string), those after `cursor` and of `model_name` (None: every model), at most `page_size`; the
    page's cursor is its last key string when more follow."""
    entries: list[KeyEntry] = []
    last = None
    for s, size in items:
        if cursor is not None and s <= cursor:
            continue
        k = parse_key_string(s)
        if k is None or (model_name is not None and k.model_name != model_name):
            continue
        if len(entries) == page_size:
            return KeyListPage(tuple(entries), last)
        entries.append(KeyEntry(EncodedObjectKey(k.chunk_hash.hex(), k.model_name, k.kv_rank,
                                                 k.object_group_id, k.cache_salt), size))
        last = s
    return KeyListPage(tuple(entries), None)
