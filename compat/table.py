"""The compatibility table: folds a matrix run's per-test reports into compat/results.json and the table of
docs/compatibility.md.

    python3 compat/table.py out/compat/*.json          # what scripts/test.sh runs after the matrix

Each report is what tests/conftest.py writes with `KVTIER_COMPAT_REPORT` (installed versions, and per test its
outcome, markers and skip reason). Only tests marked `compat` count (the main environment runs the whole suite,
its other tests are not compatibility checks). Results of combinations this run did not cover stay as they were
in compat/results.json, so a default run refreshes its rows and keeps the full run's others. The part of
docs/compatibility.md between the compat-table markers is regenerated from results.json and compat/matrix.toml,
never typed.
Standard library only (runs with the system Python, outside every environment).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "compat", "results.json")
DOC = os.path.join(ROOT, "docs", "compatibility.md")
BEGIN, END = "<!-- compat-table:begin -->", "<!-- compat-table:end -->"

#: check -> what it proves, in table order; tests are assigned by `needs` marker first, then by test id prefix
CHECKS: list[tuple[str, str]] = [
    ("connector", "the connector from the shipped JSON in vLLM's real `Scheduler` (both roles): tier hints, "
                  "`None` while an SSD prefetch runs, KV saved and loaded bit for bit from the host and SSD "
                  "tiers, metadata through a pickle round trip, hit sources"),
    ("layouts", "layout detection and a bit-exact page round trip on the KV tensors vLLM allocates for each "
                "attention backend, in every layout the backend declares"),
    ("hook", "the scheduler hook on vLLM's `Scheduler`/`AsyncScheduler` (base chosen by async scheduling), "
             "delay-hit deferral and each shipped vLLM JSON's ready order through the real scheduler"),
    ("plugin", "the LMCache storage plugin in a real `LMCacheEngine`: bit-exact round trip, restart recovery "
               "from a new process, corrupt chunks recomputed"),
    ("ssd", "the SSD tier and its eviction wiring under this torch/LMCache"),
    ("mp", "the MP-mode L2 adapter through `lmcache bench l2 --no-skip-verify` (where LMCache has MP mode)"),
    ("engine", "a real multi-turn vLLM engine run: identical tokens with and without kvtier, hits by tier"),
    ("offload", "vLLM's own offloading path: kvtier's secondary tier under vLLM's tiering manager (bit-exact loads "
                "after a restart, capacity, corruption, full disk, salts and weights), kvtier's CPU cache policy "
                "through vLLM's factory, check-config of the offloading JSON"),
    ("extras", "kvtier without LMCache: every module outside the LMCache integration imports, check-config passes "
               "the offloading JSON, LMCache-only entry points stop in one line naming `kvtier[lmcache]`, the vLLM "
               "plugin entry points load"),
    ("guard", "the version guard, configuration validation, packaging (no shadowed top-level modules)"),
]
NEEDS_CHECK = {"lmcache_mp": "mp", "vllm_cpu_engine": "engine", "vllm_tiering": "offload"}
PREFIX_CHECK = [
    ("tests/test_without_lmcache.py", "extras"),
    ("tests/test_compat.py::test_connector_", "connector"),
    ("tests/test_connector_scheduler.py::test_dual_queue_hook", "hook"),
    ("tests/test_connector_scheduler.py", "connector"),
    ("tests/test_compat.py::test_layout_", "layouts"),
    ("tests/test_compat.py::test_scheduler_hook", "hook"),
    ("tests/test_lmcache_plugin.py", "plugin"),
    ("tests/test_compat.py::test_plugin", "plugin"),
    ("tests/test_ssd_tier.py", "ssd"),
    ("tests/test_policy_wiring.py", "ssd"),
    ("tests/test_version_guard.py", "guard"),
    ("tests/test_connector_config.py", "guard"),
    ("tests/test_compat.py::test_kvtier_installs", "guard"),
]


def _matrix():
    spec = importlib.util.spec_from_file_location("kvtier_compat_matrix", os.path.join(ROOT, "compat", "matrix.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def check_of(test: dict) -> str:
    for need in test.get("needs", []):
        if need in NEEDS_CHECK:
            return NEEDS_CHECK[need]
    for prefix, check in PREFIX_CHECK:
        if test["nodeid"].startswith(prefix):
            return check
    return "other"


def summarize(report: dict) -> dict:
    """One combination's results: per check, counts and the skip reasons."""
    checks: dict[str, dict] = {}
    for t in report["tests"]:
        if not t.get("compat"):
            continue
        c = checks.setdefault(check_of(t), {"passed": 0, "failed": 0, "skipped": 0, "reasons": []})
        key = "failed" if t["outcome"] in ("failed", "error") else t["outcome"]
        c[key] += 1
        if key == "skipped" and t.get("reason") and t["reason"] not in c["reasons"]:
            c["reasons"].append(t["reason"])
    for c in checks.values():
        c["reasons"] = sorted(c["reasons"])
    totals = {k: sum(c[k] for c in checks.values()) for k in ("passed", "failed", "skipped")}
    return {"installed": report["installed"], "totals": totals, "checks": dict(sorted(checks.items()))}


def run_stamp() -> dict:
    """What a stored row was run at: the commit (`+changes` when tracked files differed from it, besides the files
    this script writes) and the UTC date."""
    import datetime
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, check=True).stdout

    try:
        commit = git("rev-parse", "--short=12", "HEAD").strip()
        ours = {os.path.relpath(RESULTS, ROOT), os.path.relpath(DOC, ROOT)}
        changed = [line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines()
                   if line[3:] not in ours]
        if changed:
            commit += "+changes"
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return {"commit": commit, "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")}


def stored_run(result: dict | None) -> str | None:
    """Why `result` (a row of results.json) is not a stored passing run, or None if it is one."""
    if result is None:
        return "no stored run"
    if not result.get("commit") or not result.get("date") or "totals" not in result:
        return "the stored run names no commit or date"
    t = result["totals"]
    if t["failed"]:
        return f"its stored run ({result['commit']}, {result['date']}) has {t['failed']} failing test(s)"
    if not t["passed"]:
        return f"its stored run ({result['commit']}, {result['date']}) passed no test"
    return None


def _cell(c: dict | None) -> str:
    if c is None:
        return ""
    if c["failed"]:
        return f"FAIL {c['failed']}/{c['passed'] + c['failed']}"
    if c["passed"]:
        return f"ok {c['passed']}" + (f" ({c['skipped']} skipped)" if c["skipped"] else "")
    return "skipped"


def render(results: dict, combos) -> str:
    labels = [name for name, _ in CHECKS] + (["other"] if any(
        "other" in r["checks"] for r in results.values()) else [])
    head = ["combination", "status", "runs", "stored run"] + labels
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes: list[str] = []
    for c in combos:
        r = results.get(c.id)
        runs = {"main": "every run (whole suite)", "default": "every run", "full": "`--matrix full`"}[c.run]
        if c.status == "broken":
            lines.append(f"| {c.label} | broken: {c.reason} | not run | | " + " | ".join("" for _ in labels) + " |")
            continue
        if r is None:
            status = "tested, but NO STORED RUN" if c.tested else c.status
            lines.append(f"| {c.label} | {status} | {runs} | none | " + " | ".join("not run yet" if i == 0 else ""
                                                                            for i, _ in enumerate(labels)) + " |")
            continue
        cells = [_cell(r["checks"].get(name)) for name in labels]
        failed = sum(x["failed"] for x in r["checks"].values())
        status = f"{c.status}, passing" if not failed else f"{c.status}, {failed} FAILING"
        if c.tested and not failed and stored_run(r):
            status = f"tested, but {stored_run(r)}"
        run = f"`{r['commit']}` {r['date']}" if r.get("commit") else "none recorded"
        lines.append(f"| {c.label} | {status} | {runs} | {run} | " + " | ".join(cells) + " |")
        for name in labels:
            for why in r["checks"].get(name, {}).get("reasons", []):
                note = f"{name}: {why}"
                if note not in notes:
                    notes.append(note)
    legend = [f"- **{name}**: {what}" for name, what in CHECKS]
    out = ["Generated by `compat/table.py` from the stored runs in `compat/results.json` (`scripts/test.sh`), do not "
           "edit. \"stored run\": the commit and date of the run behind the row. Cells count the passing `compat` "
           "tests of each check.", "", *lines, "", *legend]
    if notes:
        out += ["", "Skipped checks: " + "; ".join(sorted(notes)) + "."]
    return "\n".join(out)


def update_doc(text: str, table: str) -> str:
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{os.path.relpath(DOC, ROOT)} has no {BEGIN} ... {END} section")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table}\n{END}{tail}"


def main(argv: list[str]) -> int:
    m = _matrix()
    combos = m.load(os.path.join(ROOT, "compat", "matrix.toml"))
    results = {}
    if os.path.exists(RESULTS):
        with open(RESULTS) as f:
            results = json.load(f)
    stamp = run_stamp()
    for path in argv:
        with open(path) as f:
            report = json.load(f)
        inst = report["installed"]
        row = m.find(inst["build"], inst["vllm"] or "", inst["lmcache"] or "", combos)
        if row is None:
            print(f"compat_table: {path}: {inst} is not a matrix combination; ignored", file=sys.stderr)
            continue
        results[row.id] = {**stamp, **summarize(report)}
    results = {c.id: results[c.id] for c in combos if c.id in results}  # rows that left the matrix go
    with open(RESULTS, "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)
        f.write("\n")
    table = render(results, combos)
    with open(DOC) as f:
        text = f.read()
    new = update_doc(text, table)
    if new != text:
        with open(DOC, "w") as f:
            f.write(new)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
