"""`kvtier.kernels.crc32`: CRC-32 where the bytes are (the GPU check of kvikio reads), per piece and per segment,
bit-exact against zlib, and what the SSD tier does with it: the slot header's per-segment values; a
byte that went bad in device memory after the read is a miss.

The torch path runs here directly; the Triton kernel runs under Triton's interpreter in a subprocess
(`TRITON_INTERPRET=1` must be set before triton is first imported, and other test modules import it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

from kvtier.kernels.crc32 import piece_crcs, segment_crcs, slicing_tables

SIZES = [0, 1, 3, 4, 5, 1023, 1024, 4096, 4099, 3 * 4096 + 7, 5 * 4096]


def _bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _zlib_pieces(raw: bytes, piece: int) -> list[int]:
    return [zlib.crc32(raw[s:s + piece]) for s in range(0, len(raw), piece)] or [zlib.crc32(b"")]


def test_tables_are_zlibs():
    t = slicing_tables()
    assert int(t[0, 1]) == 0x77073096 and int(t[0, 255]) == 0x2D02EF8D  # zlib's crc_table[0][1], [255]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("piece", [4, 1024, 4096])
def test_torch_pieces_equal_zlib(n, piece):
    b = _bytes(n, n)
    assert piece_crcs(b, piece, impl="torch") == _zlib_pieces(bytes(b.numpy()), piece)


@pytest.mark.parametrize("n", [0, 5, 4096, 3 * 8192 + 4100])
def test_segment_values_equal_the_slot_headers(n):
    from kvtier.storage_backends.ssd.slot_format import checksum, segments

    b = _bytes(n, 7)
    raw = bytes(b.numpy())
    want = [checksum(raw[lo:hi]) for lo, hi in segments(n, 8192)]
    assert segment_crcs(b, 8192, piece=4096, impl="torch") == want
    assert segment_crcs(b, 8192, piece=16384, impl="torch") == want  # pieces made to divide the segment


def test_the_kernels_segment_rule_and_combine_are_the_slot_formats():
    """kernels/crc32.py keeps its own `segments` and `combine` (the kernels import no storage module): the same
    ranges and values as the SSD slot format's."""
    import zlib

    from kvtier.kernels import crc32
    from kvtier.storage_backends.ssd import slot_format

    for n in (0, 1, 4095, 4096, 8192, 3 * 8192 + 4100):
        for seg in (4096, 8192, 1 << 20):
            assert crc32.segments(n, seg) == slot_format.segments(n, seg)
    data = bytes(range(256)) * 97
    parts = [(zlib.crc32(data[lo:hi]), hi - lo) for lo, hi in ((0, 1000), (1000, 1000), (1000, 9000), (9000, 24832))]
    assert crc32.combine(parts) == slot_format.combine_checksums(parts) == zlib.crc32(data)


def test_a_flipped_byte_changes_its_piece_only():
    b = _bytes(4 * 1024, 3)
    before = piece_crcs(b, 1024, impl="torch")
    b[2 * 1024 + 1023] ^= 1  # the last byte of piece 2
    after = piece_crcs(b, 1024, impl="torch")
    assert [x != y for x, y in zip(before, after)] == [False, False, True, False]


def test_refuses_what_it_cannot_cut():
    with pytest.raises(ValueError):
        piece_crcs(_bytes(16, 0), 6)
    with pytest.raises(ValueError):
        piece_crcs(_bytes(16, 0).view(torch.int32), 4)


def _triton_worker() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    for n in SIZES:
        for piece in (4, 1024, 2800, 16384):  # one word; two rows; off the row size; 32 rows
            if piece == 4 and n > 1024:
                piece = 12  # the interpreter runs programs one by one
            b = _bytes(n, n + piece)
            got = piece_crcs(b, piece, impl="triton")
            print(json.dumps({"n": n, "piece": piece, "ok": got == _zlib_pieces(bytes(b.numpy()), piece)}),
                  flush=True)
        for seg, piece in ((4096, 1024), (12288, 4096), (1 << 20, 16384)):  # pieces combined by the kernel
            b = _bytes(n, n + seg)
            got = segment_crcs(b, seg, piece, impl="triton")
            print(json.dumps({"n": n, "seg": seg, "ok": got == _zlib_pieces(bytes(b.numpy()), seg)}), flush=True)


def test_triton_kernel_equals_zlib_under_the_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    here = Path(__file__).resolve()
    code = (f"import importlib.util, sys; spec = importlib.util.spec_from_file_location('crc_cases', {str(here)!r}); "
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); m._triton_worker()")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 7 * len(SIZES)
    assert all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
