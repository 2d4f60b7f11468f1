"""Chunks sealed for the shared store (`kvtier.encryption_key_file`): what the store holds is an envelope, never
the chunk's bytes.

LMCache's remote backends store a host object's bytes and its shape, dtype and format as they are; they have no room
for a nonce and a tag. So a sealed chunk travels as an object of its own: a 1-D uint8 object
(`MemoryFormat.BINARY_BUFFER`: a byte buffer outside the host pool) holding
`KVTSEAL1 | header length | header (JSON: the chunk's shape, dtype, format, size, nonce, tag) | ciphertext`.
The chunk is sealed with the tenant's key (`ssd/sealing.py`) and authenticated together with its store key and the
header (its layout), so an envelope copied under another key, or with another layout, fails to open: a miss.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import torch

from kvtier.storage_backends.base import ChunkMeta, HostTier
from kvtier.storage_backends.ssd.sealing import SEALED, ChunkSealer

__all__ = ["open_envelope", "seal_envelope"]

MAGIC = b"KVTSEAL1"
_FRAME = struct.Struct("<8sI")
_MAX_HEADER = 4096


def _aad(store_key: str, layout: dict[str, Any]) -> bytes:
    return (store_key + "|" + json.dumps(layout, sort_keys=True, separators=(",", ":"))).encode()


def seal_envelope(sealer: ChunkSealer, store_key: str, obj: Any, host: HostTier) -> Any | None:
    """A new host object holding `obj` sealed for the store under `store_key` (None: no host room). The caller owns
    one reference of it."""
    from lmcache.v1.memory_management import MemoryFormat

    n = int(obj.get_size())
    layout = {"shape": [int(x) for x in obj.get_shape()], "dtype": str(obj.get_dtype()),
              "fmt": obj.get_memory_format().name, "nbytes": n}
    meta, ct = sealer.seal(store_key, ChunkMeta(n, tuple(layout["shape"]), layout["dtype"], layout["fmt"]),
                           memoryview(obj.byte_array).cast("B"), aad=_aad(store_key, layout))
    head = json.dumps({**layout, SEALED: meta.extra[SEALED]}, sort_keys=True).encode()
    total = _FRAME.size + len(head) + n
    env = host.allocate(torch.Size([total]), torch.uint8, MemoryFormat.BINARY_BUFFER, busy_loop=False)
    if env is None:
        return None
    view = memoryview(env.byte_array).cast("B")
    _FRAME.pack_into(view, 0, MAGIC, len(head))
    view[_FRAME.size:_FRAME.size + len(head)] = head
    view[_FRAME.size + len(head):total] = ct
    return env


def open_envelope(sealer: ChunkSealer, store_key: str, env: Any, host: HostTier) -> Any | None:
    """The chunk an envelope read from the store holds, as a new host object of its own layout (the caller owns one
    reference); None if it is not an envelope, fails authentication, or finds no host room."""
    _DTYPES = {str(d): d for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8,
                                   torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)}
    from lmcache.v1.memory_management import MemoryFormat

    view = memoryview(env.byte_array).cast("B")
    if len(view) < _FRAME.size:
        return None
    magic, hlen = _FRAME.unpack_from(view, 0)
    if magic != MAGIC or hlen > _MAX_HEADER or _FRAME.size + hlen > len(view):
        return None
    try:
        head = json.loads(bytes(view[_FRAME.size:_FRAME.size + hlen]))
        sealed = head.pop(SEALED)
        shape, dtype, fmt, n = tuple(int(x) for x in head["shape"]), _DTYPES[head["dtype"]], \
            MemoryFormat[head["fmt"]], int(head["nbytes"])
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    start = _FRAME.size + hlen
    if start + n > len(view):
        return None
    obj = host.allocate(torch.Size(shape), dtype, fmt, busy_loop=False)
    if obj is None:
        return None
    dest = memoryview(obj.byte_array).cast("B")
    if len(dest) < n:
        obj.ref_count_down()
        return None
    dest[:n] = view[start:start + n]
    meta = ChunkMeta(n, shape, head["dtype"], head["fmt"], {SEALED: sealed})
    if not sealer.open(store_key, meta, dest, _aad(store_key, head)):
        obj.ref_count_down()
        return None
    return obj
