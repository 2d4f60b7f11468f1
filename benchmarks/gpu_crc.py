"""The GPU checksum of kvikio reads (`kvtier.kernels.crc32`): bit-exact against zlib, then its speed.

On a CUDA device: a `--mib` MiB buffer of random bytes; per-piece CRC-32 with the Triton kernel (pieces of 4, 16
and 64 KiB) checked against zlib on a host copy, then timed (median of `--repeats`, results brought to the host
included) against a pinned host->GPU copy of the same bytes (about what a read into GPU memory moves at best).
Prints GB/s and the speed of a copy-speed read followed by the check relative to the read alone
(`1 / (1 + copy_gbps / crc_gbps)`, target >= 0.95); `benchmarks/kvikio_read.py` measures the real thing on a disk.
`--dry-run`: the torch path on the CPU, a small buffer, the bit-exact check only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import zlib


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mib", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", default=None)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()

    import torch

    from kvtier.kernels.crc32 import piece_crcs

    dev = "cpu" if args.dry_run else "cuda"
    if dev == "cuda" and not torch.cuda.is_available():
        print("gpu_crc: no CUDA device")
        return 2
    nbytes = (64 << 10) + 7 if args.dry_run else args.mib << 20
    host = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    raw = bytes(host.numpy())
    buf = host.to(dev)
    out: dict[str, object] = {"bytes": nbytes, "device": dev}
    for piece in (4096, 16384, 65536):
        got = piece_crcs(buf, piece)
        want = [zlib.crc32(raw[s:s + piece]) for s in range(0, nbytes, piece)]
        ok = got == want
        print(f"[check] piece {piece}: {'bit-exact' if ok else 'MISMATCH'} ({len(want)} pieces)")
        if not ok:
            return 1
        if args.dry_run:
            continue
        times = []
        for _ in range(args.repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            piece_crcs(buf, piece)  # ends with the values on the host
            times.append(time.perf_counter() - t0)
        out[f"crc_gbps_piece_{piece}"] = nbytes / statistics.median(times) / 1e9
    if not args.dry_run:
        pinned = host.pin_memory()
        times = []
        for _ in range(args.repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            buf.copy_(pinned, non_blocking=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        copy = nbytes / statistics.median(times) / 1e9
        out["h2d_copy_gbps"] = copy
        for piece in (4096, 16384, 65536):
            crc = out[f"crc_gbps_piece_{piece}"]
            rel = 1 / (1 + copy / crc)  # read at copy speed, then the check
            out[f"verified_vs_read_piece_{piece}"] = rel
            print(f"[crc] piece {piece}: {crc:7.1f} GB/s; a copy-speed read ({copy:.1f} GB/s) with the check after "
                  f"it runs at {rel:.3f}x (target >= 0.95)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
