"""Keys and layouts of LMCache multiprocess-mode objects in kvtier's SSD tier: an `ObjectKey` as a reversible
string (`key_string` / `parse_key_string`), and the `Layout` a stored chunk and its destination buffer must share."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObj

from kvtier.storage_backends.ssd.tier import ChunkMeta

_KEY_TAG = "mp1"
_DTYPES = {str(d): d for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8,
                               torch.int16, torch.int32, torch.int64, torch.float8_e4m3fn, torch.float8_e5m2)}


def key_string(key: ObjectKey) -> str:
    """The tier's key for an LMCache MP object: `mp1@model@kv_rank@group@chunk_hash@salt` (hex numbers). LMCache
    forbids `@` in model names and salts, so the string splits back unambiguously (`parse_key_string`)."""
    return (f"{_KEY_TAG}@{key.model_name}@{key.kv_rank:x}@{key.object_group_id:x}@{key.chunk_hash.hex()}"
            f"@{key.cache_salt}")


def parse_key_string(s: str) -> ObjectKey | None:
    parts = s.split("@")
    if len(parts) != 6 or parts[0] != _KEY_TAG:
        return None
    _, model, rank, group, chunk, salt = parts
    try:
        return ObjectKey(chunk_hash=bytes.fromhex(chunk), model_name=model, kv_rank=int(rank, 16),
                         object_group_id=int(group, 16), cache_salt=salt)
    except ValueError:
        return None


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
            return Layout(int(meta.nbytes), tuple(tuple(int(x) for x in s) for s in shapes),  # type: ignore[union-attr]
                          tuple(str(d) for d in dtypes), str(meta.fmt))  # type: ignore[union-attr]
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
