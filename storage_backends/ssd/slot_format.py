"""On-disk formats of the SSD tier: the 4 KiB slot header and the commit journal's records.

A slot is `[header: 4 KiB][data: nbytes, padded to 4 KiB]`. The header names the full key, the sizes, dtype,
shape and memory format of the chunk, the generation number of the write and one CRC32 per `seg`-byte segment of
the data. The journal is an append-only file of framed records; a COMMIT record is the chunk's commit marker
and is written only after the slot's data and header are durable. Encoding is msgpack (msgspec), never pickle.

Nothing read from disk is trusted: a header or record whose fields are out of range (a negative slot, a zero
segment size, a CRC count that does not match the size...) fails to decode exactly like one with a bad checksum.
msgspec checks the ranges on decode; `encode_record` and `encode_header` refuse what would not decode again.
`decode_records` resynchronises after a damaged record instead of stopping there, so one flipped byte costs at most
the record it hits.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field
from typing import Annotated

import msgspec
from isal.isal_zlib import crc32 as _isal_crc32
from isal.isal_zlib import crc32_combine as _isal_crc32_combine

HEADER_SIZE = 4096
SLOT_MAGIC = b"KVTSLOT1"
_HDR_FRAME = struct.Struct("<8sII")  # magic, payload length, payload crc32
_REC_FRAME = struct.Struct("<II")  # payload length, payload crc32
FORMAT_VERSION = 1
#: Largest journal record payload accepted (a COMMIT record carries what a 4 KiB slot header carries).
MAX_RECORD_BYTES = HEADER_SIZE
#: Largest segment size a header or record may name (io_block_mb is at most a few hundred MiB in practice).
MAX_SEGMENT_BYTES = 1 << 34
_SEG_ALIGN = 4096
#: Generations are counted up from 1 and stay far below msgpack's int64 limit.
MAX_GENERATION = 1 << 62
#: A generation read from disk at or above this is not trusted (its record is skipped as damaged): the counter
#: resumes from the largest trusted generation, so one crafted or damaged record can never bring it near
#: MAX_GENERATION (2^61 more writes would be needed: centuries at a million writes per second).
TRUSTED_GENERATION = MAX_GENERATION >> 1


# Field ranges, checked by msgspec in C while decoding (a record or header out of range does not decode).
Slot = Annotated[int, msgspec.Meta(ge=0)]
Gen = Annotated[int, msgspec.Meta(ge=1, lt=MAX_GENERATION)]
Size = Annotated[int, msgspec.Meta(ge=0)]
Dim = Annotated[int, msgspec.Meta(ge=0)]
Name = Annotated[str, msgspec.Meta(min_length=1)]
Seg = Annotated[int, msgspec.Meta(gt=0, le=MAX_SEGMENT_BYTES, multiple_of=_SEG_ALIGN)]


class SlotHeader(msgspec.Struct, array_like=True, frozen=True):
    version: int
    key: Name
    gen: Gen
    nbytes: Size
    shape: tuple[Dim, ...]
    dtype: Name
    fmt: Name
    seg: Seg
    crcs: tuple[int, ...]
    extra: dict[str, object] = {}

    def __post_init__(self) -> None:
        if self.version != FORMAT_VERSION:
            raise ValueError(f"slot format version {self.version}, expected {FORMAT_VERSION}")
        if len(self.crcs) != segment_count(self.nbytes, self.seg):
            raise ValueError(f"{len(self.crcs)} checksums for {self.nbytes} bytes in {self.seg}-byte segments")


class CommitRecord(msgspec.Struct, tag="C", array_like=True, frozen=True):
    slot: Slot
    gen: Gen
    key: Name
    nbytes: Size
    shape: tuple[Dim, ...]
    dtype: Name
    fmt: Name
    seg: Seg
    extra: dict[str, object] = {}


class FreeRecord(msgspec.Struct, tag="F", array_like=True, frozen=True):
    slot: Slot
    gen: Gen


JournalRecord = CommitRecord | FreeRecord

_enc = msgspec.msgpack.Encoder()
_hdr_dec = msgspec.msgpack.Decoder(SlotHeader)
_rec_dec = msgspec.msgpack.Decoder(JournalRecord)


class CorruptSlot(Exception):
    """A slot failed validation (bad magic, checksum, truncated, wrong key...). `reason` is the metric label."""

    def __init__(self, message: str, reason: str = "header") -> None:
        super().__init__(message)
        self.reason = reason


def checksum(data) -> int:
    """CRC-32 of a data segment: the same polynomial and value as `zlib.crc32` (slots written by either verify
    with either), computed by ISA-L, about 7x faster than zlib on cold memory. On a 2-core machine zlib's CRC
    alone took 0.42 CPU-s per GB read or written, enough to hold the tier below the disk's speed."""
    return _isal_crc32(data)


def combine_checksums(parts: list[tuple[int, int]]) -> int:
    """The CRC-32 of consecutive byte ranges from each range's (CRC-32, length): what `checksum` of their
    concatenation returns, without reading the bytes again (so the ranges can be checked as they arrive)."""
    crc, _ = parts[0]
    for part, n in parts[1:]:
        crc = _isal_crc32_combine(crc, part, n)
    return crc


def segment_count(nbytes: int, seg: int) -> int:
    return max(1, -(-nbytes // seg))


def segments(nbytes: int, seg: int) -> list[tuple[int, int]]:
    """The `[lo, hi)` byte ranges of a chunk's data segments (one empty segment for an empty chunk)."""
    return [(lo, min(lo + seg, nbytes)) for lo in range(0, nbytes, seg)] or [(0, 0)]


def pieces(lo: int, hi: int, size: int) -> list[tuple[int, int]]:
    """`[lo, hi)` cut into ranges of at most `size` bytes (one empty range for an empty one)."""
    return [(a, min(a + size, hi)) for a in range(lo, hi, size)] or [(lo, hi)]


def encode_header(h: SlotHeader, out: memoryview) -> None:
    """Write `h` into the first HEADER_SIZE bytes of `out` (zero-padded). ValueError if it does not fit."""
    payload = _enc.encode(h)
    try:
        _hdr_dec.decode(payload)
    except (msgspec.ValidationError, ValueError) as e:
        raise ValueError(f"slot header out of range: {e}") from None
    if _HDR_FRAME.size + len(payload) > HEADER_SIZE:
        raise ValueError(f"slot header too large ({len(payload)} bytes): key or shape too long")
    out[:HEADER_SIZE] = b"\0" * HEADER_SIZE
    _HDR_FRAME.pack_into(out, 0, SLOT_MAGIC, len(payload), zlib.crc32(payload))
    out[_HDR_FRAME.size:_HDR_FRAME.size + len(payload)] = payload


def header_fits(key: str, shape: tuple[int, ...], dtype: str, fmt: str, nbytes: int, seg: int,
                extra: dict[str, object]) -> bool:
    """Whether a header for such a chunk fits the 4 KiB header block (checked before a chunk is queued)."""
    worst = SlotHeader(FORMAT_VERSION, key, MAX_GENERATION - 1, nbytes, shape, dtype, fmt, seg,
                       (0xFFFFFFFF,) * segment_count(nbytes, seg), extra)
    return _HDR_FRAME.size + len(_enc.encode(worst)) <= HEADER_SIZE


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
    except (msgspec.DecodeError, ValueError) as e:
        raise CorruptSlot(f"slot header undecodable or out of range: {e}") from None


def encode_record(rec: JournalRecord) -> bytes:
    """Frame a record; ValueError if it would not decode again (a field out of range)."""
    payload = _enc.encode(rec)
    try:
        _rec_dec.decode(payload)
    except msgspec.ValidationError as e:
        raise ValueError(f"journal record out of range: {e}") from None
    return _REC_FRAME.pack(len(payload), zlib.crc32(payload)) + payload


@dataclass
class DecodedJournal:
    """What `decode_records` found: the valid records in file order, the byte ranges it skipped as damaged
    (valid records follow each), and where the valid data ends (a torn or damaged tail starts there)."""

    records: list[JournalRecord] = field(default_factory=list)
    damaged: list[tuple[int, int]] = field(default_factory=list)
    valid_end: int = 0


def _record_at(data: bytes, pos: int) -> tuple[JournalRecord, int] | None:
    """The valid record framed at `pos` and the offset after it, or None."""
    n = len(data)
    if pos + _REC_FRAME.size > n:
        return None
    length, crc = _REC_FRAME.unpack_from(data, pos)
    end = pos + _REC_FRAME.size + length
    if length == 0 or length > MAX_RECORD_BYTES or end > n:
        return None
    payload = data[pos + _REC_FRAME.size:end]
    if zlib.crc32(payload) != crc:
        return None
    try:
        return _rec_dec.decode(payload), end
    except (msgspec.DecodeError, ValueError):
        return None


def decode_records(data: bytes) -> DecodedJournal:
    """Decode framed records. After a damaged record, scan forward to the next valid frame and go on from
    there (the damaged bytes are reported); damage with no valid record after it is the tail."""
    out = DecodedJournal()
    pos, n = 0, len(data)
    records, unpack, crc32, decode, frame = out.records, _REC_FRAME.unpack_from, zlib.crc32, _rec_dec.decode, \
        _REC_FRAME.size
    while pos < n:
        if pos + frame <= n:  # the common case, inline: a valid record at pos
            length, crc = unpack(data, pos)
            end = pos + frame + length
            if 0 < length <= MAX_RECORD_BYTES and end <= n:
                payload = data[pos + frame:end]
                if crc32(payload) == crc:
                    try:
                        records.append(decode(payload))
                        pos = out.valid_end = end
                        continue
                    except (msgspec.DecodeError, ValueError):
                        pass
        nxt = next((p for p in range(pos + 1, n - _REC_FRAME.size + 1) if _record_at(data, p) is not None), None)
        if nxt is None:
            break
        out.damaged.append((pos, nxt))
        pos = nxt
    return out
