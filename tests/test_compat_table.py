"""The compatibility table's evidence: every `tested` row of compat/matrix.toml has a passing run stored in
compat/results.json (commit, date, installed versions, counts), the README claims exactly those rows, and a matrix
run stamps what it stores (`compat/table.py`). About the repository's files, so it runs once, in the main suite."""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import shutil
import subprocess

from kvtier.compat import matrix

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_table():
    spec = importlib.util.spec_from_file_location("kvtier_compat_table", os.path.join(REPO, "compat", "table.py"))
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    return table


def test_every_tested_row_has_a_stored_passing_run():
    """A row is `tested` only with its run stored in compat/results.json: the commit and date it ran at, the
    versions it found installed, and counts with no failure; the README quotes exactly those rows."""
    table = load_table()
    results = json.load(open(os.path.join(REPO, "compat", "results.json")))
    for c in matrix.load():
        if not c.tested:
            continue
        r = results.get(c.id)
        assert table.stored_run(r) is None, f"{c.label} is marked tested but {table.stored_run(r)}"
        inst = r["installed"]
        assert matrix.find(inst["build"], inst["vllm"], inst["lmcache"]) == c, (c.label, inst)
    readme = open(os.path.join(REPO, "README.md")).read()
    claim = readme[readme.index("kvtier supports the vLLM and LMCache versions"):].split("\n\n")[0]
    tested = {*matrix.tested_vllm_versions("cpu"), *matrix.tested_vllm_versions("cuda"),
              *matrix.tested_lmcache_versions()}
    for v in tested:
        assert v in claim, f"the README's support sentence leaves out tested {v}: {claim!r}"
    for c in matrix.load():
        for v in {c.vllm, c.lmcache} - tested - {""}:
            assert v not in claim, f"the README claims {v}, which no tested row has: {claim!r}"


def test_a_run_stores_its_commit_date_versions_and_counts(tmp_path, monkeypatch):
    table = load_table()
    results, doc = tmp_path / "results.json", tmp_path / "compatibility.md"
    shutil.copy(os.path.join(REPO, "compat", "results.json"), results)
    shutil.copy(os.path.join(REPO, "docs", "compatibility.md"), doc)
    monkeypatch.setattr(table, "RESULTS", str(results))
    monkeypatch.setattr(table, "DOC", str(doc))
    row = next(c for c in matrix.load() if c.lmcache == "" and c.tested)
    tests = [{"nodeid": "tests/test_vllm_offload_tier.py::a", "outcome": "passed", "compat": True,
              "needs": ["vllm_tiering"]},
             {"nodeid": "tests/test_compat.py::test_layout_x", "outcome": "skipped", "compat": True, "needs": [],
              "reason": "why"},
             {"nodeid": "tests/test_ssd_tier.py::b", "outcome": "failed", "compat": True, "needs": []},
             {"nodeid": "tests/test_other.py::c", "outcome": "failed", "compat": False, "needs": []}]
    report = tmp_path / "r.json"
    report.write_text(json.dumps({"installed": {"build": row.build, "vllm": row.vllm, "lmcache": None,
                                                "torch": "2.14.0", "python": "3.11.7"}, "tests": tests}))
    assert table.main([str(report)]) == 0
    stored = json.load(open(results))[row.id]
    head = subprocess.run(["git", "-C", REPO, "rev-parse", "--short=12", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    assert stored["commit"].split("+")[0] == head
    assert stored["date"] == datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    assert stored["installed"]["vllm"] == row.vllm and stored["installed"]["torch"] == "2.14.0"
    assert stored["totals"] == {"passed": 1, "failed": 1, "skipped": 1}  # the non-compat test is not counted
    assert stored["checks"]["offload"]["passed"] == 1 and stored["checks"]["ssd"]["failed"] == 1
    assert "1 failing" in table.stored_run(stored)
    line = next(x for x in doc.read_text().splitlines() if x.startswith(f"| {row.label} |"))
    assert "1 FAILING" in line and stored["commit"] in line
    assert table.stored_run(dict(stored, totals={"passed": 3, "failed": 0, "skipped": 0})) is None
