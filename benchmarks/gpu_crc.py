"""The GPU checksum of kvikio reads (`kvtier.kernels.crc32`): bit-exact against zlib, then its speed.

On a CUDA device: a `--mib` MiB buffer of random bytes. Checked against zlib on a host copy: every piece's CRC-32
(`piece_crcs`, pieces of 4 to 256 KiB, also with a last piece ending off a 4-byte boundary) and every segment's
(`segment_crcs`, the values a slot header records; 1 MiB and whole-buffer segments). Then timed, for each piece
size (median of `--repeats`, the values brought to the host included): the check as a read runs it, the segment
CRCs of the buffer as one segment (`--mib` MiB, as the SSD tier's default segment holds a whole chunk) and in 1 MiB
segments; against a pinned host->GPU copy of the same bytes (about what a read into GPU memory moves at best).
Prints GB/s and the speed of a copy-speed read followed by the check relative to the read alone
(`1 / (1 + copy_gbps / check_gbps)`); `benchmarks/kvikio_read.py` measures the real thing on a disk.
`--dry-run`: the torch path on the CPU, a small buffer, the bit-exact checks only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import zlib

PIECES = (4096, 16384, 65536, 262144)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mib", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", default=None)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()

    import torch

    from kvtier.kernels.crc32 import piece_crcs, segment_crcs

    dev = "cpu" if args.dry_run else "cuda"
    if dev == "cuda" and not torch.cuda.is_available():
        print("gpu_crc: no CUDA device")
        return 2
    nbytes = (64 << 10) + 7 if args.dry_run else args.mib << 20
    host = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    raw = bytes(host.numpy())
    buf = host.to(dev)
    odd = nbytes - 4093  # a buffer whose last piece ends off a 4-byte boundary: the bytewise launch

    def zlib_parts(n: int, size: int) -> list[int]:
        return [zlib.crc32(raw[s:min(s + size, n)]) for s in range(0, n, size)]

    out: dict[str, object] = {"bytes": nbytes, "device": dev}
    for piece in PIECES:
        ok = (piece_crcs(buf, piece) == zlib_parts(nbytes, piece)
              and piece_crcs(buf[:odd], piece) == zlib_parts(odd, piece)
              and segment_crcs(buf, 1 << 20, piece) == zlib_parts(nbytes, 1 << 20)
              and segment_crcs(buf[:odd], 1 << 20, piece) == zlib_parts(odd, 1 << 20)
              and segment_crcs(buf, nbytes // 4096 * 4096, piece) == zlib_parts(nbytes, nbytes // 4096 * 4096))
        print(f"[check] piece {piece}: {'bit-exact' if ok else 'MISMATCH'} (pieces, 1 MiB segments, one segment; "
              "also with an odd tail)")
        if not ok:
            return 1
    if args.dry_run:
        return 0

    def gbps(fn) -> float:
        times = []
        for _ in range(args.repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()  # ends with the values on the host
            times.append(time.perf_counter() - t0)
        return nbytes / statistics.median(times) / 1e9

    pinned = host.pin_memory()

    def copy() -> None:
        buf.copy_(pinned, non_blocking=True)
        torch.cuda.synchronize()

    h2d = out["h2d_copy_gbps"] = gbps(copy)
    for piece in PIECES:
        whole = out[f"whole_gbps_piece_{piece}"] = gbps(lambda: segment_crcs(buf, nbytes, piece))
        mib = out[f"mib_segments_gbps_piece_{piece}"] = gbps(lambda: segment_crcs(buf, 1 << 20, piece))
        rel = out[f"verified_vs_read_piece_{piece}"] = 1 / (1 + h2d / whole)
        print(f"[crc] piece {piece:6d}: one {args.mib} MiB segment {whole:6.1f} GB/s, 1 MiB segments {mib:6.1f} GB/s; "
              f"a copy-speed read ({h2d:.1f} GB/s) with the check after it runs at {rel:.3f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
