#!/usr/bin/env bash
# kvtier GPU check: finishes in under 5 minutes on one H200.
#
#   1. kvtier page kernel: bit-exact on the device (vs the torch path and per-page copies; bf16/fp8/fp32),
#      then GB/s both directions for Llama-3-8B/70B-like shapes and 16/32-token pages:
#      (a) kvtier kernel, (b) one copy_ per page per layer, (d) one big pinned copy; a launch-config sweep;
#      the slowdown of a concurrent bf16 matmul while (a) runs.
#   2. (c) cudaMemcpyBatchAsync of the same copies, in its own process (cuda-python or libcudart via ctypes;
#      skipped cleanly when unavailable).
#   3. summary: medians, ratios a/d, a/b, a/c, targets.
#   4. SLOT for the SSD tier's kvikio SSD->GPU read check (below).
#   4b. the SSD stream's device path without vLLM (benchmarks/gpu_ssd_load.py): chunks read by kvikio into GPU
#       staging, verified there, scattered into paged KV by the kernel; vs via pinned host; every block bit-exact.
#   4c. GPU checksum (kvtier.kernels.crc32, the check of kvikio reads): bit-exact vs zlib, GB/s vs a host->GPU copy.
#   5. transfer overlap (#14): a forward-like bf16 matmul step loop alone, with a concurrent page-first load
#      (per-page copy_) on a copy stream, and with the Triton scatter kernel on a copy stream: step slowdown,
#      load GB/s, overlap factor, pages bit-exact after the overlapped loads (benchmarks/transfer_overlap.py).
#   6. where vLLM imports: vLLM's OffloadingConnector + TieringOffloadingSpec with kvtier's secondary tier and CPU
#      policy, engine level (benchmarks/vllm_offload_engine.py: identical tokens, a restart served by kvtier's
#      tier); vLLM refuses that connector on its CPU platform, so this is the only place it runs.
#
# Needs python with CUDA torch + triton only (no vLLM, no LMCache). kvtier is imported from this checkout
# through a temporary directory holding a symlink named `kvtier` (the repo root is never put on sys.path).
#
#   bash benchmarks/gpu_check.sh                 # results in $OUT (device machine) or ./out/gpu_check
#   PYTHON=python3.12 MIB=256 bash benchmarks/gpu_check.sh
#   bash benchmarks/gpu_check.sh --dry-run       # no GPU: runs the CPU-checkable parts (tiny shapes, torch path)
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUTDIR="${OUT:-$ROOT/out/gpu_check}"
PY="${PYTHON:-python3}"
MIB="${MIB:-512}"
mkdir -p "$OUTDIR"

SHIM="$(mktemp -d)"
ln -s "$ROOT" "$SHIM/kvtier"
export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
trap 'rm -rf "$SHIM"' EXIT

START=$SECONDS
log() { echo "[gpu_check +$((SECONDS - START))s] $*"; }

if [ "${1:-}" = "--dry-run" ]; then
  log "dry run (CPU): kernel benchmark smoke, transfer overlap dry run"
  "$PY" "$ROOT/benchmarks/gather_kernel.py" --smoke --methods check,a,b,d --json "$OUTDIR/kernel-dry.json" \
    > "$OUTDIR/kernel-dry.log" 2>&1 || { log "gather_kernel.py --smoke failed:"; tail -n 20 "$OUTDIR/kernel-dry.log"; exit 1; }
  "$PY" "$ROOT/benchmarks/transfer_overlap.py" --dry-run --json "$OUTDIR/overlap-dry.json" || exit 1
  "$PY" "$ROOT/benchmarks/gpu_crc.py" --dry-run || exit 1
  "$PY" "$ROOT/benchmarks/gpu_ssd_load.py" --dry-run --repeats 1 || exit 1
  log "dry run done; results in $OUTDIR"
  exit 0
fi

nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max --format=csv 2>/dev/null || true
if ! "$PY" -c "import torch, triton, kvtier.kernels as k; assert torch.cuda.is_available(); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'kvtier.kernels OK')"; then
  log "torch/triton/kvtier.kernels not importable or no CUDA device: stopping"
  exit 1
fi

BENCH="$ROOT/benchmarks/gather_kernel.py"

log "1/3 kernel check, sweep, (a) (b) (d), matmul interference"
timeout 200 "$PY" "$BENCH" --methods check,sweep,a,b,d,matmul --mib "$MIB" --json "$OUTDIR/kernel.json" \
  > "$OUTDIR/kernel.log" 2>&1
rc=$?
grep -E '^\[(check|sweep|row|matmul|c)\]' "$OUTDIR/kernel.log" | grep -v '^\[row\]' || true
[ $rc -eq 0 ] || { log "step 1 exited with $rc; last lines:"; tail -n 30 "$OUTDIR/kernel.log"; }

log "2/3 (c) cudaMemcpyBatchAsync, isolated process"
timeout 60 "$PY" "$BENCH" --methods c --mib "$MIB" --json "$OUTDIR/batch.json" > "$OUTDIR/batch.log" 2>&1
rc=$?
grep -E '^\[c\]' "$OUTDIR/batch.log" || true
[ $rc -eq 0 ] || { log "(c) exited with $rc (skipped in the summary); last lines:"; tail -n 10 "$OUTDIR/batch.log"; }

log "3/3 summary"
"$PY" "$BENCH" --summarize "$OUTDIR/kernel.json" "$OUTDIR/batch.json" | tee "$OUTDIR/summary.txt"

# ======================================================================================================
# SSD tier: kvikio SSD -> GPU reads of chunks written by the SSD tier, against SSD -> pinned host (-> GPU).
# Needs kvikio and msgspec on the device; carry wheels in .whl (see the device tool's README) if they are missing.
if ls "$ROOT"/.whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/kvtier-site "$ROOT"/.whl/*.whl \
    && export PYTHONPATH="/tmp/kvtier-site:${PYTHONPATH:-}"
fi
log "4/4 kvikio SSD->GPU"
timeout 90 "$PY" "$ROOT/benchmarks/kvikio_read.py" --json "$OUTDIR/ssd.json" 2>&1 | tee "$OUTDIR/ssd.log"
# ======================================================================================================

log "SSD stream's device path: kvikio -> GPU staging -> scatter kernel -> paged KV, vs via pinned host; bit-exact"
timeout 120 "$PY" "$ROOT/benchmarks/gpu_ssd_load.py" --json "$OUTDIR/load.json" 2>&1 | tee "$OUTDIR/load.log"

log "GPU checksum of kvikio reads (Triton CRC-32 per segment): bit-exact vs zlib, GB/s vs a host->GPU copy"
timeout 120 "$PY" "$ROOT/benchmarks/gpu_crc.py" --json "$OUTDIR/crc.json" 2>&1 | tee "$OUTDIR/crc.log"

log "5/5 transfer overlap (forward-like steps with a concurrent load on a copy stream)"
timeout 120 "$PY" "$ROOT/benchmarks/transfer_overlap.py" --json "$OUTDIR/overlap.json" 2>&1 | tee "$OUTDIR/overlap.log"

log "6/6 vLLM's own offloading path with kvtier's secondary tier and CPU policy (engine level; needs vLLM)"
if "$PY" -c "import vllm" >/dev/null 2>&1; then
  timeout 600 "$PY" "$ROOT/benchmarks/vllm_offload_engine.py" --workdir "$OUTDIR/offload-engine" 2>&1 \
    | grep -E '^\[(ok|FAIL)\]|^cached by source|^not runnable' | tee "$OUTDIR/offload-engine.log"
else
  log "skipped: vLLM does not import here (the engine-level run of issue 27 needs a GPU machine with vLLM)"
fi

log "done; results in $OUTDIR"
