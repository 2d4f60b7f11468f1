"""`kvtier serve` (vLLM's own `vllm serve`) on CPU as a real HTTP server, with and without kvtier.

Two servers of the demo model (random tiny Llama + the shipped tokenizer and chat template), started once for
the module and at the same time: one plain, one with kvtier's connector and `--scheduler-cls
kvtier.scheduler_hooks.DualQueueScheduler` from the shipped `configs/vllm-kv-transfer-hrrn.json` (the plain JSON plus
the simulator's tuned scheduler keys: HRRN with the starvation lookahead), a small vLLM KV cache and a small host
tier, so a conversation's
history comes back from kvtier's host and SSD tiers at its next turn. Six chats x three turns go to both
over the OpenAI chat API, one request at a time, round robin. The tests check:

- the assistant text (greedy) of every turn is identical on both servers;
- `/metrics` of the kvtier server: kvtier's hits per tier equal vLLM's own `vllm:prompt_tokens_cached_by_source`
  (host, disk and device), both tiers served something, and the worker's `kvtier_ssd_*` series are there;
- the log shows kvtier's start-up lines (versions, SSD tier, worker, scheduler hook with the JSON's tuned keys), and
  not many;
- tenants: a prompt sent with one `cache_salt` gets no cached token from kvtier under another salt or none (as
  on plain vLLM), and its own tenant gets its hits from kvtier again;
- SIGINT stops the server: exit status 0, no process left, the worker closed kvtier (queued SSD writes
  committed), and a new SSD tier over the directory finds exactly the chunks the worker reported.

Restarts and new weights written in place: tests/test_serve_weights.py.
"""

from __future__ import annotations

import json
import os
import random
import re
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")
psutil = pytest.importorskip("psutil")

from kvtier.testing.serve_process import ServeProcess, free_port  # noqa: E402
from kvtier.testing.waiting import wait_until  # noqa: E402

# compat: the HTTP server in every combination that can run a real engine (the CPU builds); the CUDA wheels
# construct the connector and scheduler from the same JSON in test_serve_config.py
pytestmark = [pytest.mark.slow, pytest.mark.compat, pytest.mark.needs("vllm_cpu_engine")]

REPO = Path(__file__).resolve().parent.parent
PAGE, CHUNK = 32, 64
GPU_BLOCKS, MAX_LEN = 34, 1024  # vLLM's cache holds less than one round of the chats
HOST_MB, SSD_MB = 8, 64  # the host tier about two rounds: older turns come back from SSD
CHATS, TURNS, WORDS = 6, 3, 80
START_TIMEOUT_S = 420  # both servers start at once on 2 cores
KVTIER_LINE = re.compile(r"\] (kvtier|SSD tier at)")
PORT_LO = 18040  # free_port shifts it by KVTIER_TEST_PORT_SHIFT (lane_port)
VLLM_ARGS = ["--dtype", "float32", "--max-model-len", str(MAX_LEN), "--block-size", str(PAGE),
             "--num-gpu-blocks-override", str(GPU_BLOCKS), "--enforce-eager", "--seed", "0",
             "--shutdown-timeout", "20", "--enable-prompt-tokens-details"]
#: the tenant probe's prompt: 14 full chunks and a bit (vLLM's cache, 34 blocks of 32, holds one such prompt)
TENANT_PROMPT = [random.Random(47).randrange(3, 1000) for _ in range(900)]
TENANT_HIT = len(TENANT_PROMPT) // CHUNK * CHUNK  # 896: what kvtier can serve of it


def _metrics_once_all_recorded(srv: ServeProcess) -> dict | None:
    """/metrics once vLLM's API server has recorded every chat as finished (`vllm:request_success_total`), else
    None. It records a step's finished requests together with that step's scheduler stats, which carry kvtier's
    connector series: once all CHATS x TURNS are counted, the last step's stats have arrived."""
    m = srv.metrics()
    done = sum(v for (name, _), v in m.items() if name == "vllm:request_success_total")
    return m if done >= CHATS * TURNS else None


def _conversations() -> list[list[str]]:
    """CHATS chats of TURNS user messages, cut from text kvtier ships: the dated entries of docs/results/ in name
    order (the oldest first; entries are never edited after the fact, so the text stays put; ~250 tokens each)."""
    words = " ".join(p.read_text() for p in sorted((REPO / "docs" / "results").glob("20*.md"))).split()
    msg = lambda i: " ".join(words[i * WORDS:(i + 1) * WORDS])  # noqa: E731
    return [[msg(TURNS * c + t) for t in range(TURNS)] for c in range(CHATS)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from kvtier.launch.demo_model import build

    work = tmp_path_factory.mktemp("serve-http")
    model = Path(build(str(work / "model")))
    ssd = work / "ssd"
    yaml = work / "lmcache-kvtier.yaml"
    text = (REPO / "configs" / "lmcache-kvtier.yaml").read_text()
    text = text.replace("chunk_size: 256", f"chunk_size: {CHUNK}").replace(
        "max_local_cpu_size: 5 ", f"max_local_cpu_size: {HOST_MB / 1024} ").replace(
        "/var/cache/kvtier", str(ssd)).replace("kvtier.ssd_capacity_gb: 100",
                                              f"kvtier.ssd_capacity_gb: {SSD_MB / 1024}")
    yaml.write_text(text)
    kv = json.loads((REPO / "configs" / "vllm-kv-transfer-hrrn.json").read_text())
    kv["kv_connector_extra_config"]["config_file"] = str(yaml)
    servers: dict[str, ServeProcess] = {}
    try:
        servers["base"] = ServeProcess("base", work, model, free_port(PORT_LO), VLLM_ARGS)
        servers["kvtier"] = ServeProcess("kvtier", work, model, free_port(PORT_LO), VLLM_ARGS, [
            "--kv-transfer-config", json.dumps(kv), "--scheduler-cls", "kvtier.scheduler_hooks.DualQueueScheduler"])
        deadline = time.monotonic() + START_TIMEOUT_S
        for s in servers.values():
            s.wait_ready(deadline)
        startup_log = servers["kvtier"].log()
        answers: dict[str, dict[tuple[int, int], dict]] = {name: {} for name in servers}

        def talk(name: str) -> None:
            convs = _conversations()
            history: list[list[dict]] = [[] for _ in convs]
            for turn in range(TURNS):
                for c, conv in enumerate(convs):
                    history[c].append({"role": "user", "content": conv[turn]})
                    rep = servers[name].chat(history[c])
                    history[c].append({"role": "assistant", "content": rep["choices"][0]["message"]["content"]})
                    answers[name][(c, turn)] = rep

        threads = [threading.Thread(target=talk, args=(n,)) for n in servers]  # the two servers side by side
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        assert all(len(a) == CHATS * TURNS for a in answers.values()), {n: len(a) for n, a in answers.items()}
        metrics = wait_until(lambda: _metrics_once_all_recorded(servers["kvtier"]), 60,
                             "the API server's /metrics to count every chat as finished", poll_s=0.1)
        yield {"servers": servers, "answers": answers, "startup_log": startup_log, "metrics": metrics, "ssd": ssd}
    finally:
        for s in servers.values():
            s.stop()


def test_same_text_with_and_without_kvtier(served):
    base, kvt = served["answers"]["base"], served["answers"]["kvtier"]
    for key in sorted(base):
        assert kvt[key]["choices"][0]["message"]["content"] == base[key]["choices"][0]["message"]["content"], key
        assert kvt[key]["usage"]["prompt_tokens"] == base[key]["usage"]["prompt_tokens"], key
    assert len({base[k]["choices"][0]["message"]["content"] for k in base}) > 1  # the model says different things


def test_metrics_hits_by_tier_agree_with_vllm(served):
    m = served["metrics"]
    kv = lambda tier: m.get(("kvtier_connector_hit_tokens_total", (("tier", tier),)), 0.0)  # noqa: E731
    vl = lambda src: m.get(("vllm:prompt_tokens_cached_by_source_total", (("source", src),)), 0.0)  # noqa: E731
    hits = {t: kv(t) for t in ("gpu", "host", "ssd")}
    if any(k[0] == "vllm:prompt_tokens_cached_by_source_total" for k in m):
        assert hits == {"gpu": vl("device"), "host": vl("host"), "ssd": vl("disk")}, m
    else:  # vLLM 0.31 has no split by source: a connector's hits are one number there (compat/vllm_hit_sources.py)
        assert (hits["gpu"], hits["host"] + hits["ssd"]) == (m[("vllm:prefix_cache_hits_total", ())],
                                                             m[("vllm:external_prefix_cache_hits_total", ())]), m
    assert hits["host"] > 0 and hits["ssd"] > 0, f"the workload must be served from both kvtier tiers: {hits}"
    assert m[("kvtier_connector_query_tokens_total", ())] > kv("host") + kv("ssd") + kv("gpu")
    # worker-side series (the SSD tier lives in the worker process) reach the API server's /metrics too
    assert m[("kvtier_ssd_puts_total", ())] > 0 and m[("kvtier_ssd_hits_total", ())] * CHUNK >= kv("ssd")
    assert m[("kvtier_connector_save_bytes_total", ())] > 0 and m[("kvtier_connector_load_seconds_count", ())] > 0


def test_kvtier_startup_lines_in_the_log(served):
    log = served["startup_log"]
    from importlib.metadata import version

    lmcache = re.escape(version("lmcache"))  # the installed one (the compatibility matrix has several)
    assert re.search(rf"kvtier connector \(SCHEDULER role\) on vLLM 0\.3\d\.\d, LMCache {lmcache}", log), log[-3000:]
    assert re.search(r"SSD tier at .*ssd/worker0-of-1: \d+ committed chunks found", log)
    assert "kvtier connector worker rank 0: 4 layers" in log and "kvtier: dual-queue scheduling on" in log
    hook = next(line for line in log.splitlines() if "kvtier: dual-queue scheduling on" in line)
    for key in ("ready_order='hrrn'", "starvation_lookahead=True", "mean_window=1024", "starvation_multiple=8",
                "hrrn_service_exponent=1.5"):  # the shipped JSON's scheduler keys reached vLLM's scheduler
        assert key in hook, hook
    # the KV identity and its parts: the weights' content (one safetensors file), config, dtypes, layout, ranks
    assert re.search(r"kvtier: KV identity of rank 0: m[0-9a-f]{20}: weights [0-9a-f]{12} \(1 files, [\d.]+ GiB, "
                     r"sampled content\), config [0-9a-f]{12}, dtype torch.float32, kv_cache_dtype auto, "
                     r"quantization none, KV torch.float32, layout page_first/p32 v1, chunk 64 tokens, TP 1 \(rank 0\)",
                     log), log[-3000:]
    ours = [line for line in log.splitlines() if KVTIER_LINE.search(line)]
    assert len(ours) <= 8, "\n".join(ours)


def _cached(rep: dict) -> int:
    return int((rep["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def test_a_tenants_kv_never_reaches_another_tenant(served):
    """Tenant A's prompt, then the same tokens from tenant B and without a salt, then A again, on both servers: B
    and the unsalted request get no cached token on either server (vLLM keys its cache on the salt, and so must
    kvtier's tiers), A gets its prompt back from kvtier's tiers (vLLM's own cache lost it to B's blocks)."""
    got: dict[str, dict[str, dict]] = {}
    for name in ("base", "kvtier"):
        srv = served["servers"][name]
        got[name] = {"A": srv.complete(TENANT_PROMPT, cache_salt="tenant-A"),
                     "B": srv.complete(TENANT_PROMPT, cache_salt="tenant-B"),
                     "none": srv.complete(TENANT_PROMPT),
                     "A again": srv.complete(TENANT_PROMPT, cache_salt="tenant-A")}
    text = {n: {k: r["choices"][0]["text"] for k, r in g.items()} for n, g in got.items()}
    assert text["kvtier"] == text["base"]
    cached = {n: {k: _cached(r) for k, r in g.items()} for n, g in got.items()}
    assert cached["base"]["B"] == cached["base"]["none"] == 0, cached
    assert cached["kvtier"]["B"] == cached["kvtier"]["none"] == 0, cached
    assert cached["kvtier"]["A again"] >= TENANT_HIT > cached["base"]["A again"], cached


def test_clean_shutdown_keeps_the_ssd_tier(served):
    from kvtier.launch.demo_model import KV_BYTES_PER_TOKEN
    from kvtier.storage_backends.config import parse_kvtier_config
    from kvtier.storage_backends.ssd.tier import SSDTier

    srv = served["servers"]["kvtier"]
    children = psutil.Process(srv.proc.pid).children(recursive=True)
    assert children, "vLLM's engine and worker processes"
    assert os.listdir(srv.rpc_dir), "vLLM's IPC sockets are in the server's own directory, not $TMPDIR"
    assert srv.stop(sweep=False) == 0, srv.log()[-4000:]
    assert not os.path.exists(srv.rpc_dir), "stop() leaves none of vLLM's sockets behind"
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, alive
    log = srv.log()
    closed = re.search(r"kvtier connector worker rank 0 closed: queued SSD writes committed, (\d+) chunks", log)
    assert closed, log[-4000:]
    cfg = parse_kvtier_config({"kvtier.ssd_path": str(served["ssd"]), "kvtier.ssd_capacity_gb": SSD_MB / 1024,
                               "kvtier.chunk_format": "page_first", "kvtier.page_tokens": PAGE})
    tier = SSDTier(cfg, CHUNK * KV_BYTES_PER_TOKEN, subdir="worker0-of-1")
    try:
        assert len(tier) == int(closed.group(1)) > 0
        assert len(tier) >= served["metrics"][("kvtier_ssd_puts_total", ())]
    finally:
        tier.close()

