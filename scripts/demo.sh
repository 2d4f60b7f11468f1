#!/usr/bin/env bash
# kvtier's main job (README): builds or reuses the environment, then runs the demo (`kvtier demo --help`).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
main=$("$ROOT/scripts/env.sh" main)
export LMCACHE_TRACK_USAGE=false
cd "$ROOT"
exec "$main/bin/kvtier" demo "$@"
