#!/usr/bin/env bash
# kvtier's main job (README): builds or reuses the environment, then runs the vLLM demo (`kvtier demo-vllm --help`):
# multi-turn Mooncake conversations through real vLLM (CPU build, tiny model), without and with kvtier.
# The LMCache-level demo is `kvtier demo`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
main=$("$ROOT/scripts/env.sh" main)
export LMCACHE_TRACK_USAGE=false
export PYTHONPATH="$ROOT/.kvtier-import${PYTHONPATH:+:$PYTHONPATH}"  # this clone's sources (scripts/env.sh)
cd "$ROOT"
exec "$main/bin/kvtier" demo-vllm "$@"
