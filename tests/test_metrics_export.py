"""kvtier's series across processes (`kvtier.telemetry.series`, `kvtier.connector.metrics_export`), both vLLM versions.

An "engine" subprocess updates kvtier series at random (counters with labels, gauges, histograms, values on
bucket bounds), exporting after each "step" as the connector does, and finally dumps what its own
prometheus_client objects expose. The mirror in this process, fed those payloads, must expose exactly the same
samples. Also: a process's own payloads are ignored by its mirror; a process whose values live in
multiprocess files exports nothing; connector stats carry payloads through vLLM's aggregate/rebuild without
losing or sharing them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.compat

ENGINE = r"""
import json, random, sys
from prometheus_client import REGISTRY
from kvtier.connector import metrics as M
from kvtier.connector.metrics_export import exporter
from kvtier.storage_backends import metrics as S

rng = random.Random(int(sys.argv[1]))
payloads = []
for step in range(60):
    for _ in range(rng.randrange(0, 6)):
        op = rng.randrange(6)
        if op == 0:
            M.HIT_TOKENS.labels(rng.choice(["gpu", "host", "ssd", "miss"])).inc(rng.randrange(1, 500))
        elif op == 1:
            M.LOAD_SECONDS.observe(rng.choice([0.0005, 0.01, 0.3, 7.0, 99.0, rng.random()]))  # bounds included
        elif op == 2:
            S.SSD_USED_BYTES.set(rng.randrange(0, 10**9))
        elif op == 3:
            S.SSD_DROPPED.labels(rng.choice(["backpressure", "full"])).inc()
        elif op == 4:
            S.SSD_READ_SECONDS.observe(rng.random() * 3)
        else:
            S.HOST_POOL_EXHAUSTED.labels("store").inc(2)
    p = exporter().take()
    if p is not None:
        payloads.append(p)
own = {}
for fam in REGISTRY.collect():
    if fam.name.startswith("kvtier_"):
        for s in fam.samples:
            if not s.name.endswith("_created"):
                own[s.name + json.dumps(s.labels, sort_keys=True)] = s.value
print(json.dumps({"payloads": payloads, "own": own}))
"""


def _engine(seed: int, env: dict | None = None) -> dict:
    base = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}  # LMCache sets it in-process
    out = subprocess.run([sys.executable, "-c", ENGINE, str(seed)], capture_output=True, text=True, timeout=120,
                         env=dict(base, **(env or {})))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _exposed(mirror) -> dict:
    return {s.name + json.dumps(s.labels, sort_keys=True): s.value for fam in mirror.collect() for s in fam.samples}


def test_mirror_shows_what_two_engine_processes_expose():
    from kvtier.connector import metrics  # noqa: F401  (declares the connector's series here too)
    from kvtier.connector.metrics_export import Mirror
    from kvtier.storage_backends import metrics as storage_metrics  # noqa: F401
    from kvtier.telemetry import series as metrics_core

    a, b = _engine(1), _engine(2)
    assert a["payloads"] and b["payloads"]
    mirror = Mirror([s.prom for s in metrics_core.all_series()])
    local = _exposed(mirror)  # this process's own values (whatever other tests did)
    for p in a["payloads"]:
        mirror.apply(json.loads(json.dumps(p)))  # as it crosses processes (msgpack/JSON-safe)
    got = _exposed(mirror)
    for key, value in a["own"].items():
        assert got.get(key) == pytest.approx(local.get(key, 0.0) + value, rel=1e-9, abs=1e-9), key
    for p in b["payloads"]:
        mirror.apply(p)
    got = _exposed(mirror)
    for key in set(a["own"]) | set(b["own"]):
        want = local.get(key, 0.0) + a["own"].get(key, 0.0) + b["own"].get(key, 0.0)
        assert got.get(key) == pytest.approx(want, rel=1e-9, abs=1e-9), key  # gauges: sum of each one's latest


def test_own_payloads_ignored_and_files_mode_exports_nothing(tmp_path):
    from kvtier.connector import metrics as M
    from kvtier.connector.metrics_export import Mirror, exporter

    exporter().take()
    M.QUERY_TOKENS.inc(7)
    p = exporter().take()
    assert p is not None and p["src"] == exporter().source
    mirror = Mirror([M.QUERY_TOKENS.prom])
    before = _exposed(mirror)
    mirror.apply(p)
    assert _exposed(mirror) == before
    # values in PROMETHEUS_MULTIPROC_DIR files (set before prometheus_client is imported): nothing to export
    files = _engine(3, {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)})
    assert files["payloads"] == [] and os.listdir(tmp_path)


def test_connector_stats_carry_payloads_through_vllm_aggregation():
    from kvtier.connector.kvtier_connector import KVTierConnector
    from kvtier.connector.metrics import KVTierConnectorStats

    worker = KVTierConnectorStats()
    worker.add(loads=1, loaded_tokens=64)
    worker.add_export({"src": "w", "meta": {}, "samples": [["f", "f_total", {}, 1.0]]})
    sched = KVTierConnectorStats().add_export({"src": "s", "meta": {}, "samples": [["g", "g_total", {}, 2.0]]})
    assert not sched.is_empty()
    merged = worker.aggregate(sched)  # what vLLM's scheduler does each step
    data = merged.to_dict()
    assert [p["src"] for p in data["prom"]] == ["w", "s"] and data["loaded_tokens"] == 64
    assert merged.reduce()["kvtier_loaded_tokens"] == 64
    rebuilt = KVTierConnector.build_kv_connector_stats(data)  # the API server's logging path
    rebuilt.aggregate(KVTierConnectorStats().add_export({"src": "x", "meta": {}, "samples": []}))
    assert len(data["prom"]) == 2 and len(rebuilt.data["prom"]) == 3  # the message itself is left as it was
