"""Where a server's time goes under one aiperf run: CPU seconds per process and thread, vLLM's own per-request
phase times, and the client's TTFT and inter-token latency, for vLLM alone and for kvtier, one after the other.

    .venv/bin/python benchmarks/serve_threads.py --aiperf /tmp/aiperf-venv/bin/aiperf [--workload no-reuse]
        [--servers base,kvtier] [--kvtier-connector '{"async_saves": false}'] [--py-spy PATH]

Each server (`serve_aiperf.py`'s settings: the demo model on vLLM's CPU build, kvtier's connector and scheduler
hook on `kvtier`) runs alone: started, one aiperf run of the workload (`serve_aiperf.py`'s `reuse` or `no-reuse`
requests at `--concurrency`), stopped. Printed per server: each thread's CPU seconds during the run (from
/proc/<pid>/task/*/stat; Python thread names such as `kvtier-transfer` come from `py-spy dump` when `--py-spy`
names it, else the OS names, which Python threads do not set), the deltas of vLLM's request phase histograms
(queue, prefill, decode: summed over requests, from /metrics), kvtier's timed work (its lookup, save, load, idle
wait and transfer-queue histograms) and the client's mean TTFT, inter-token latency and
request latency, with the run's wall time and requests/s. Not a ratio benchmark: one run per server, to find where a
difference goes; the ratios are `serve_aiperf.py`'s.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import serve_aiperf as S  # the sibling module (benchmarks/ is the script's sys.path[0])

from kvtier.demo_data import path as data_path
from kvtier.launch.demo_model import build
from kvtier.testing.serve_process import ServeProcess, free_port

PHASES = ("request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds")
#: kvtier's `kvtier_connector_<name>_seconds` histograms
KVTIER_SECONDS = ("lookup", "save", "load", "idle_wait", "transfer_queue")
#: a trailing thread number (`kvtier-io_3`, `ThreadPoolExecutor-3_0`): threads of one pool are summed
POOL_SUFFIX = re.compile(r"[_-]\d+(_\d+)?$")


def session_threads(sid: int) -> dict[tuple[int, int], tuple[str, str, float]]:
    """(pid, tid) -> (process name, OS thread name, CPU seconds) of every thread of session `sid`."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getsid(int(pid)) != sid:
                continue
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            for tid in os.listdir(f"/proc/{pid}/task"):
                stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
                name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
                out[(int(pid), int(tid))] = (comm, name, (int(rest[11]) + int(rest[12])) / tick)
        except (OSError, ValueError, IndexError):  # a process or thread that ended meanwhile
            continue
    return out


def python_thread_names(py_spy: str | None, pids: set[int]) -> dict[int, str]:
    """tid -> Python thread name, from `py-spy dump` of each process (empty without py-spy)."""
    names: dict[int, str] = {}
    if not py_spy:
        return names
    for pid in pids:
        p = subprocess.run([py_spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60)
        for m in re.finditer(r'Thread (\d+) \([^)]*\): "([^"]+)"', p.stdout):
            names[int(m.group(1))] = m.group(2)
    return names


def series_total(metrics: dict[tuple[str, tuple], float], series: str) -> float:
    """A /metrics series summed over every label set."""
    return sum(v for (name, _labels), v in metrics.items() if name == series)


def phase_sums(metrics: dict[tuple[str, tuple], float]) -> dict[str, float]:
    return {ph: series_total(metrics, f"vllm:{ph}_sum") for ph in PHASES}


def histogram_sums(metrics: dict[tuple[str, tuple], float]) -> dict[str, tuple[float, float]]:
    """kvtier's histograms of seconds: name -> (sum, count), over all labels."""
    return {name: (series_total(metrics, f"kvtier_connector_{name}_seconds_sum"),
                   series_total(metrics, f"kvtier_connector_{name}_seconds_count")) for name in KVTIER_SECONDS}


def run_one(name: str, args: argparse.Namespace, work: Path, model: Path, hf_home: Path, trace: Path) -> None:
    page, chunk = 32, 64
    extra: list[str] = []
    if name == "kvtier":
        yaml = S.kvtier_yaml(work / "lmcache-kvtier.yaml", chunk, args.host_mb, str(work / "ssd"), args.ssd_mb)
        extra = S.kvtier_server_args(yaml, args.kvtier_connector)
    srv = ServeProcess(name, work, model, free_port(args.port), S.vllm_server_args(args, page), extra)
    try:
        srv.wait_ready(time.monotonic() + 600)
        sid = os.getsid(srv.proc.pid)
        m0, c0 = srv.metrics(), session_threads(sid)
        t0 = time.monotonic()
        recs = S.run_aiperf(args.aiperf, srv, trace, work / f"aiperf-{name}", args, args.seed, hf_home)
        wall = time.monotonic() - t0
        m1, c1 = srv.metrics(), session_threads(sid)
        names = python_thread_names(args.py_spy, {pid for pid, _ in c1})
    finally:
        srv.stop()
    per: collections.Counter[tuple[str, str]] = collections.Counter()
    for key, (comm, os_name, cpu) in c1.items():
        used = cpu - (c0[key][2] if key in c0 else 0.0)
        if used > 0:
            per[(comm, POOL_SUFFIX.sub("", names.get(key[1], os_name)))] += used

    def mean(metric: str) -> float:
        vals = [v for v in (S._metric(r, metric) for r in recs) if v is not None]
        return statistics.fmean(vals) if vals else float("nan")

    print(f"\n{name}: {len(recs)} requests in {wall:.1f} s ({len(recs) / wall:.2f} req/s); client means: TTFT "
          f"{mean('time_to_first_token'):.0f} ms, inter-token latency {mean('inter_token_latency'):.1f} ms, "
          f"request latency {mean('request_latency'):.0f} ms")
    p0, p1 = phase_sums(m0), phase_sums(m1)
    print("  vLLM's request phases, summed over requests: " + ", ".join(
        f"{ph.removeprefix('request_').removesuffix('_time_seconds')} {p1[ph] - p0[ph]:.1f} s" for ph in PHASES))
    if name == "kvtier":
        h0, h1 = histogram_sums(m0), histogram_sums(m1)
        print("  kvtier's timed work, summed (count): " + ", ".join(
            f"{k} {h1[k][0] - h0[k][0]:.2f} s ({h1[k][1] - h0[k][1]:.0f})" for k in KVTIER_SECONDS))
    print(f"  CPU seconds during the run: {sum(per.values()):.1f} s (2 cores x {wall:.0f} s = "
          f"{(os.cpu_count() or 1) * wall:.0f} s available)")
    for (comm, thread), secs in per.most_common():
        if secs >= args.min_seconds:
            print(f"    {secs:8.2f} s  {comm:<16} {thread}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--aiperf", default=shutil.which("aiperf") or "aiperf", help="the aiperf command")
    p.add_argument("--py-spy", default=shutil.which("py-spy"), help="py-spy, to name Python threads (optional)")
    p.add_argument("--servers", default="base,kvtier", help="comma-separated: base, kvtier (run in this order)")
    p.add_argument("--workload", default="no-reuse", choices=("reuse", "no-reuse"))
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--block-tokens", type=int, default=32, help="tokens per 512-token trace block")
    p.add_argument("--max-prompt-tokens", type=int, default=1536)
    p.add_argument("--max-answer-tokens", type=int, default=24)
    p.add_argument("--gpu-blocks", type=int, default=160)
    p.add_argument("--host-mb", type=float, default=32)
    p.add_argument("--ssd-mb", type=float, default=1024)
    p.add_argument("--kvtier-connector", type=json.loads, default=None, metavar="JSON",
                   help="the kvtier server's `kvtier.connector` options")
    p.add_argument("--seed", type=int, default=1000, help="aiperf's --random-seed")
    p.add_argument("--port", type=int, default=18100)
    p.add_argument("--timeout", type=float, default=1800, help="seconds the aiperf run may take")
    p.add_argument("--min-seconds", type=float, default=0.1, help="threads below this many CPU seconds are not listed")
    p.add_argument("--workdir", default=None, help="keep logs and aiperf artifacts here")
    args = p.parse_args(argv)
    if not shutil.which(args.aiperf) and not os.path.exists(args.aiperf):
        print(f"aiperf not found ({args.aiperf}); see benchmarks/serve_aiperf.py for its install line")
        return 2
    work = Path(args.workdir or tempfile.mkdtemp(prefix="kvtier-serve-threads-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    rows, _held = S.scale(S.read_trace(data_path("mooncake_conversation_sessions.jsonl")), args.block_tokens,
                          args.max_prompt_tokens, args.max_answer_tokens)
    trace = work / f"{args.workload}.jsonl"
    S.write_jsonl(trace, rows if args.workload == "reuse" else S.without_reuse(rows))
    model = Path(build(str(work / "model")))
    hf_home = work / "hf"
    S.hf_cache(model, hf_home)
    print(f"serve threads: {len(rows)} requests ({args.workload}), concurrency {args.concurrency}, servers "
          f"{args.servers}")
    for name in [s.strip() for s in args.servers.split(",") if s.strip()]:
        if name not in ("base", "kvtier"):
            raise SystemExit(f"--servers: expected base and/or kvtier, got {name!r}")
        run_one(name, args, work, model, hf_home, trace)
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
