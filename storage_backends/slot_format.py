"""On-disk formats of the SSD tier: the 4 KiB slot header and the commit journal's records.

A slot is `[header: 4 KiB][data: nbytes, padded to 4 KiB]`. The header names the full key, the sizes, dtype,
shape and memory format of the chunk, the generation number of the write and one CRC32 per `seg`-byte segment of
the data. The journal is an append-only file of framed records; a COMMIT record is the chunk's commit marker
and is written only after the slot's data and header are durable. Encoding is msgpack (msgspec), never pickle.
"""

from __future__ import annotations

import struct
import zlib

import msgspec
from isal.isal_zlib import crc32 as _isal_crc32

HEADER_SIZE = 4096
SLOT_MAGIC = b"KVTSLOT1"
_HDR_FRAME = struct.Struct("<8sII")  # magic, payload length, payload crc32
_REC_FRAME = struct.Struct("<II")  # payload length, payload crc32
FORMAT_VERSION = 1


class SlotHeader(msgspec.Struct, array_like=True, frozen=True):
    version: int
    key: str
    gen: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    fmt: str
    seg: int
    crcs: tuple[int, ...]
    extra: dict[str, object] = {}


class CommitRecord(msgspec.Struct, tag="C", array_like=True, frozen=True):
    slot: int
    gen: int
    key: str
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    fmt: str
    seg: int
    extra: dict[str, object] = {}


class FreeRecord(msgspec.Struct, tag="F", array_like=True, frozen=True):
    slot: int
    gen: int


JournalRecord = CommitRecord | FreeRecord

_hdr_enc = msgspec.msgpack.Encoder()
_hdr_dec = msgspec.msgpack.Decoder(SlotHeader)
_rec_dec = msgspec.msgpack.Decoder(JournalRecord)


class CorruptSlot(Exception):
    """A slot or record failed validation (bad magic, checksum, truncated, wrong key...)."""


def checksum(data) -> int:
    """CRC-32 of a data segment: the same polynomial and value as `zlib.crc32` (slots written by either verify
    with either), computed by ISA-L, about 7x faster than zlib on cold memory. On a 2-core machine zlib's CRC
    alone took 0.42 CPU-s per GB read or written, enough to hold the tier below the disk's speed."""
    return _isal_crc32(data)


def encode_header(h: SlotHeader, out: memoryview) -> None:
    """Write `h` into the first HEADER_SIZE bytes of `out` (zero-padded)."""
    payload = _hdr_enc.encode(h)
    if _HDR_FRAME.size + len(payload) > HEADER_SIZE:
        raise ValueError(f"slot header too large ({len(payload)} bytes): key or shape too long")
    out[:HEADER_SIZE] = b"\0" * HEADER_SIZE
    _HDR_FRAME.pack_into(out, 0, SLOT_MAGIC, len(payload), zlib.crc32(payload))
    out[_HDR_FRAME.size:_HDR_FRAME.size + len(payload)] = payload


def decode_header(buf: memoryview) -> SlotHeader:
    magic, n, crc = _HDR_FRAME.unpack_from(buf, 0)
    if magic != SLOT_MAGIC:
        raise CorruptSlot("no slot header (never written, or torn)")
    if n > HEADER_SIZE - _HDR_FRAME.size:
        raise CorruptSlot("slot header length out of range")
    payload = bytes(buf[_HDR_FRAME.size:_HDR_FRAME.size + n])
    if zlib.crc32(payload) != crc:
        raise CorruptSlot("slot header checksum mismatch")
    try:
        return _hdr_dec.decode(payload)
    except msgspec.DecodeError as e:
        raise CorruptSlot(f"slot header undecodable: {e}") from None


def encode_record(rec: JournalRecord) -> bytes:
    payload = _hdr_enc.encode(rec)
    return _REC_FRAME.pack(len(payload), zlib.crc32(payload)) + payload


def decode_records(data: bytes) -> tuple[list[JournalRecord], int]:
    """Decode framed records; returns them and the length of the valid prefix (a torn tail is cut there)."""
    out: list[JournalRecord] = []
    pos, n = 0, len(data)
    while pos + _REC_FRAME.size <= n:
        length, crc = _REC_FRAME.unpack_from(data, pos)
        end = pos + _REC_FRAME.size + length
        if end > n:
            break
        payload = data[pos + _REC_FRAME.size:end]
        if zlib.crc32(payload) != crc:
            break
        try:
            out.append(_rec_dec.decode(payload))
        except msgspec.DecodeError:
            break
        pos = end
    return out, pos
