"""`kvtier demo-shared`: several vLLM replicas behind a round-robin router, with and without a shared tier.

The shipped Mooncake conversations (the same workload as `kvtier demo-vllm`: `conversations.build_workload`) are
replayed in trace arrival order, one request at a time, request i going to replica i % `--replicas` (a
round-robin router: a conversation's next turn usually lands on another replica than its previous one). Each
configuration runs its own replica processes (vLLM's CPU build, the tiny random Llama of `launch/demo_model.py`):

- `none`: vLLM alone (its own prefix cache, a small KV budget as in `demo-vllm`);
- `local`: kvtier's connector and scheduler hook, host + SSD tiers per replica, nothing shared;
- `shared-all`: the same plus one real Redis server shared by the replicas (`kvtier.shared.writes: all`);
- `shared-continuing`: the same with `writes: continuing` (only chunks of requests that continue an earlier turn
  are written to Redis: selective write-through);
- `mp-shared` (not in the default set): LMCache's multiprocess mode through vLLM's `LMCacheMPConnector`
  (LMCache's own copy, which runs on CPU), one `lmcache server` per replica (`--l2-prefetch-policy retain`) with
  kvtier's L2 adapter first and LMCache's `resp` adapter (the shipped `configs/lmcache-mp-l2-redis.json`) second,
  over the same Redis. vLLM reports its reuse as one number per request (`cached`); what came from Redis is
  Redis's own GET count.

Reported: TTFT per turn, cached tokens per tier (vLLM's prefix cache / host / SSD / remote), what reached Redis
(kvtier's written chunks and bytes, Redis's own SET calls and key count, measured after each request), and whether
every configuration generated the same tokens as `none` (greedy). Figures come from one run on a shared CPU: read
the ratios, not the absolute times.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.cli.conversations import Turn, workload_of
from kvtier.cli.demo_vllm_engine import engine_env
from kvtier.cli.demo_vllm_report import ratio
from kvtier.cli.engine_args import add_engine_arguments
from kvtier.launch.demo_model import KV_BYTES_PER_TOKEN, VOCAB
from kvtier.launch.lmcache_yaml import write_lmcache_yaml
from kvtier.launch.redis_server import READ_COMMANDS
from kvtier.launch.vllm_process import end_process_group

CONFIGS = ("none", "local", "shared-all", "shared-continuing", "mp-shared")
DEFAULT_CONFIGS = ("none", "local", "shared-all", "shared-continuing")
RESULT = "KVTIER-RESULT "
READY = "KVTIER-READY"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p, block_tokens=64, host_mb=None, ssd_mb=128, conversations=8, max_prompt_tokens=2048,
                         answer_tokens=16, per_replica=True)
    p.add_argument("--replicas", type=int, default=2, help="vLLM replicas behind the round-robin router")
    p.add_argument("--routing", choices=("round-robin", "alternate"), default="round-robin",
                   help="round-robin: request i (arrival order) to replica i %% replicas; alternate: turn t of "
                        "conversation c to replica (c + t) %% replicas (every follow-up on another replica)")
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help="comma-separated configurations to run, the first is the token reference "
                        f"({', '.join(CONFIGS)})")
    p.add_argument("--min-history-chunks", type=int, default=2,
                   help="`writes: continuing`: cached chunks at arrival that make a request a continuation")
    p.add_argument("--redis-port", type=int, default=19310, help="port of the demo's redis-server (127.0.0.1)")
    p.add_argument("--mp-port", type=int, default=19320,
                   help="`mp-shared`: replica i's `lmcache server` listens on this + i, its HTTP API on this + 10 + i")
    p.add_argument("--timeout", type=float, default=600,
                   help="seconds the replicas of one configuration may take to start, and then to replay")


# --------------------------------------------------------------------------------------------- replica side
def replica_main(args_path: str) -> None:
    """Body of one replica process: takes one request per stdin line, answers one `KVTIER-RESULT` line each."""
    import faulthandler

    from kvtier.launch.demo_model import build as build_model

    args = json.loads(Path(args_path).read_text())
    faulthandler.dump_traceback_later(args["watchdog_s"], exit=True)
    build_model(args["model"])
    if args.get("lmcache_mp"):  # vLLM's in-process mode with LMCache's MP connector (see the guard's docstring)
        from kvtier.launch.vllm_process import guard_llvmlite_for_vllm_kernel_scan

        guard_llvmlite_for_vllm_kernel_scan()
    from vllm import LLM, SamplingParams

    kw: dict[str, Any] = {}
    if args.get("kv_transfer_config"):
        kw["kv_transfer_config"] = args["kv_transfer_config"]
        if args.get("lmcache_mp"):
            kw["distributed_executor_backend"] = "uni"  # one process: vLLM's CPU build needs it in-process
        else:
            kw["scheduler_cls"] = "kvtier.scheduler_hooks.DualQueueScheduler"
    llm = LLM(model=args["model"], skip_tokenizer_init=True, load_format="auto", dtype="float32", enforce_eager=True,
              block_size=args["page_tokens"], max_model_len=args["max_model_len"], enable_prefix_caching=True,
              num_gpu_blocks_override=args["gpu_blocks"], max_num_seqs=4, disable_log_stats=False, seed=0, **kw)
    engine = llm.llm_engine
    core = getattr(engine.engine_core, "engine_core", None)  # None when the engine core runs in its own process
    conn = core.scheduler.connector if core is not None else None
    side = getattr(conn, "scheduler_side", None) if conn is not None else None
    admitted: dict[str, dict[str, int]] = {}
    if side is not None:
        original = conn.update_state_after_alloc

        def update_state_after_alloc(request: Any, blocks: Any, num_external_tokens: int) -> None:
            st = side.reqs.get(request.request_id)
            src = st.sources if st is not None and num_external_tokens > 0 else {}
            disk, remote = int(src.get("disk", 0)), int(src.get("remote", 0))
            admitted.setdefault(request.request_id, {
                "gpu_hit": int(st.gpu_tokens) if st is not None else 0,
                "host_hit": int(num_external_tokens) - disk - remote, "ssd_hit": disk, "remote_hit": remote})
            return original(request, blocks, num_external_tokens)

        conn.update_state_after_alloc = update_state_after_alloc  # instance attribute: the scheduler calls this

    def shared_stats() -> dict[str, Any]:
        if side is None:
            return {}
        return side.snapshot()["storage"].get("shared") or {}  # flushes the workers' queued writes first

    rng = random.Random(1000 + args["replica"])  # warm-up outside the measurement, distinct per replica
    warm = [rng.randrange(1, VOCAB) for _ in range(3 * args["chunk_tokens"] + 5)]
    wsp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for p in (warm, warm + warm[:40]):
        llm.generate([{"prompt_token_ids": p}], wsp, use_tqdm=False)
    print(READY + " " + json.dumps({"shared": shared_stats()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("quit"):
            break
        sp = SamplingParams(temperature=0.0, max_tokens=cmd["max_tokens"], ignore_eos=True)
        t0 = time.perf_counter()
        rid = engine.add_request(cmd["rid"], {"prompt_token_ids": cmd["prompt"]}, sp)
        rec: dict[str, Any] = {}
        while "tokens" not in rec:
            for o in engine.step():
                toks = list(o.outputs[0].token_ids) if o.outputs else []
                if "ttft" not in rec and toks:
                    rec["ttft"] = time.perf_counter() - t0
                    rec["cached"] = int(o.num_cached_tokens or 0)
                if o.finished:
                    rec["tokens"] = toks
        hits = admitted.pop(rid if isinstance(rid, str) else cmd["rid"], None)
        if hits is None:  # no kvtier connector: vLLM's prefix cache (+ LMCache MP's reuse, unsplit) only
            hits = {"gpu_hit": rec.get("cached", 0), "host_hit": 0, "ssd_hit": 0, "remote_hit": 0}
        rec.update(hits)
        rec["shared"] = shared_stats()
        print(RESULT + json.dumps(rec), flush=True)
    engine.engine_core.shutdown()


# --------------------------------------------------------------------------------------------- driver side
class Replica:
    """One replica process; always ended by `close()`."""

    def __init__(self, workdir: Path, name: str, args: dict[str, Any], env_extra: dict[str, str] | None = None) -> None:
        self.name = name
        path = workdir / f"{name}.args.json"
        path.write_text(json.dumps(args))
        self.log_path = workdir / f"{name}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - the replica process writes it while it lives
        code = ("if __name__ == '__main__':\n    from kvtier.cli.demo_shared import replica_main\n"
                f"    replica_main({str(path)!r})")
        self.proc = subprocess.Popen([sys.executable, "-c", code], cwd=workdir,
                                     env={**engine_env(), **(env_extra or {})}, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True, bufsize=1,
                                     start_new_session=True)
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("KVTIER-"):
                self._lines.put(line.rstrip("\n"))
            else:  # vLLM logs to stdout: keep it in the replica's log
                self._log.write(line)
        self._lines.put(None)

    def _line(self, prefix: str, deadline: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=max(1.0, deadline - time.monotonic()))
        except queue.Empty:
            line = None
        if line is None or not line.startswith(prefix):
            self._log.flush()
            raise RuntimeError(f"replica {self.name} gave no {prefix.strip()} (status {self.proc.poll()}, log "
                               f"{self.log_path}):\n{self.log_path.read_text(errors='replace')[-4000:]}")
        return json.loads(line[len(prefix):] or "{}")

    def ready(self, deadline: float) -> dict[str, Any]:
        return self._line(READY + " ", deadline)

    def run(self, rid: str, prompt: list[int], max_tokens: int, deadline: float) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps({"rid": rid, "prompt": prompt, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        return self._line(RESULT, deadline)

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(60)
        except Exception:  # noqa: BLE001 - killed below
            pass
        finally:
            end_process_group(self.proc)  # the replica and whatever it started (vLLM's engine core, if any)
            self._log.close()


@dataclass
class ConfigRun:
    name: str
    requests: list[dict[str, Any]] = field(default_factory=list)
    wall_s: float = 0.0

    def total(self, key: str, min_turn: int = 1) -> int:
        return sum(int(r[key]) for r in self.requests if r["turn"] >= min_turn)

    def ttft(self, turn: int | None = None, min_turn: int = 1) -> list[float]:
        return [r["ttft"] for r in self.requests if (turn is None and r["turn"] >= min_turn) or r["turn"] == turn]


def _lmcache_yaml(path: Path, cfg: str, chunk: int, host_mb: float, ssd_dir: Path, ssd_mb: float,
                  redis_port: int | None, min_history: int) -> None:
    """The shipped YAML of `cfg` (`configs/lmcache-kvtier.yaml`, or `lmcache-kvtier-redis.yaml` for `shared-*`)
    with the demo's sizes, paths, Redis port and write rule, page-first chunks."""
    kw: dict[str, Any] = {}
    if cfg.startswith("shared-"):
        kw = {"base": "lmcache-kvtier-redis.yaml", "redis_port": redis_port,
              "replace": {"writes: all": f"writes: {cfg.removeprefix('shared-')}",
                          "    # timeout_s:": f"    min_history_chunks: {min_history}\n    # timeout_s:"}}
    write_lmcache_yaml(path, ssd_path=ssd_dir, chunk_size=chunk, host_gb=f"{host_mb / 1024:.9f}",
                       ssd_capacity_gb=f"{ssd_mb / 1024:.9f}", extra={"chunk_format": "page_first"}, **kw)


def _kv_configs(cfg: str, workdir: Path, opts: argparse.Namespace, host_mb: float, redis: Any,
                stack: contextlib.ExitStack) -> list[dict[str, Any] | None]:
    """The kv-transfer-config of each replica (starting the `lmcache server`s of `mp-shared`)."""
    if cfg == "none":
        return [None] * opts.replicas
    out: list[dict[str, Any] | None] = []
    servers: list[Any] = []
    for i in range(opts.replicas):
        ssd = workdir / f"ssd-{cfg}-{i}"
        shutil.rmtree(ssd, ignore_errors=True)
        if cfg == "mp-shared":
            from kvtier.configs import path as config_path
            from kvtier.launch.lmcache_server import MPServer, kvtier_adapter_spec

            resp = dict(json.loads(Path(config_path("lmcache-mp-l2-redis.json")).read_text()), port=redis.port,
                        num_workers=2)
            # `retain`: chunks read from Redis stay in this replica's L1 (LMCache's default drops them once vLLM
            # has them, and no L2 adapter copies them into another, so the next turn would read Redis again)
            srv = MPServer(opts.mp_port + i, opts.mp_port + 10 + i,
                           [kvtier_adapter_spec(ssd, opts.ssd_mb / 1024), resp], str(workdir / f"{cfg}-{i}-server.log"),
                           l1_gb=host_mb / 1024, chunk_size=opts.chunk_tokens, eviction_watermark=0.5,
                           eviction_ratio=0.5, extra_args=["--l2-prefetch-policy", "retain"],
                           start_timeout=opts.timeout)
            srv.launch()  # the replicas' servers start side by side
            stack.callback(srv.stop)
            servers.append(srv)
            out.append({"kv_connector": "LMCacheMPConnector",
                        "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector",
                        "kv_role": "kv_both", "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1",
                                                                            "lmcache.mp.port": srv.port}})
            continue
        y = workdir / f"lmcache-{cfg}-{i}.yaml"
        _lmcache_yaml(y, cfg, opts.chunk_tokens, host_mb, ssd, opts.ssd_mb, redis.port if redis is not None else None,
                      opts.min_history_chunks)
        out.append({"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.connector",
                    "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                    "engine_id": f"kvtier-shared-demo-{cfg}-{i}-{os.getpid()}",
                    "kv_connector_extra_config": {"config_file": str(y)}})
    for srv in servers:
        srv.wait_ready()
    return out


def _run_config(cfg: str, workdir: Path, base: dict[str, Any], turns: list[Turn], opts: argparse.Namespace,
                host_mb: float, redis: Any) -> ConfigRun:
    deadline = time.monotonic() + opts.timeout
    if redis is not None:
        redis.client().flushall()
        redis.reset_stats()
    out = ConfigRun(cfg)
    mp = cfg == "mp-shared"
    with contextlib.ExitStack() as stack:
        kv = _kv_configs(cfg, workdir, opts, host_mb, redis, stack)
        reps = []
        for i in range(opts.replicas):
            reps.append(Replica(workdir, f"{cfg}-{i}", dict(base, replica=i, watchdog_s=int(opts.timeout),
                                                             kv_transfer_config=kv[i], lmcache_mp=mp)))
            stack.callback(reps[-1].close)
        last = [r.ready(deadline).get("shared") or {} for r in reps]
        deadline = time.monotonic() + opts.timeout  # the replay's own limit, engine start excluded
        if redis is not None:  # the warm-up's writes are not part of the replay
            time.sleep(1.0 if mp else 0.0)  # LMCache MP's L2 stores are asynchronous
            redis.client().flushall()
            redis.reset_stats()
        hist: dict[int, list[int]] = {}
        t_run = time.perf_counter()
        for i, t in enumerate(turns):
            k = i % opts.replicas if opts.routing == "round-robin" else (t.conv + t.turn) % opts.replicas
            prompt = hist.get(t.conv, []) + t.new_tokens
            before = redis.commandstats() if redis is not None else {}
            rec = reps[k].run(f"conv{t.conv}-turn{t.turn}", prompt, t.max_tokens, deadline)
            hist[t.conv] = prompt + rec["tokens"]
            sh, prev = rec.pop("shared"), last[k]
            last[k] = sh or prev
            rec.update(conv=t.conv, turn=t.turn, replica=k, prompt_len=len(prompt),
                       shared_writes=int(sh.get("writes", 0)) - int(prev.get("writes", 0)),
                       shared_write_bytes=int(sh.get("write_bytes", 0)) - int(prev.get("write_bytes", 0)),
                       shared_dropped=int(sh.get("dropped_writes", 0)) - int(prev.get("dropped_writes", 0)))
            if redis is not None:
                if mp:
                    time.sleep(0.5)  # LMCache MP's L2 stores finish after the request
                after = redis.commandstats()
                rec["redis_sets"] = after.get("set", 0) - before.get("set", 0)
                rec["redis_gets"] = sum(after.get(c, 0) - before.get(c, 0) for c in READ_COMMANDS)
                rec["redis_keys"] = redis.dbsize()
            out.requests.append(rec)
            print(f"  {cfg:>17} {i + 1:>3}/{len(turns)} conv {t.conv} turn {t.turn} -> replica {k}: TTFT "
                  f"{1000 * rec['ttft']:7.1f} ms, cached gpu/host/ssd/remote {rec['gpu_hit']}/{rec['host_hit']}/"
                  f"{rec['ssd_hit']}/{rec['remote_hit']}" + (f", Redis GETs {rec['redis_gets']} SETs "
                                                           f"{rec['redis_sets']}" if redis is not None else ""),
                  file=sys.stderr, flush=True)
        out.wall_s = time.perf_counter() - t_run
    return out


def _mean_ms(xs: list[float]) -> str:
    return f"{1000 * statistics.mean(xs):8.1f}" if xs else f"{'-':>8}"


def report(runs: list[ConfigRun], turns: list[Turn], chunk: int) -> int:
    """Print the comparison; returns 1 when a configuration's tokens differ from the reference's."""
    max_turn = max(t.turn for t in turns)
    print("\nTTFT per turn (ms, mean over conversations; one request at a time over the replicas)")
    print(f"{'turn':>4} " + " ".join(f"{r.name:>17}" for r in runs))
    for n in range(1, max_turn + 1):
        print(f"{n:>4} " + " ".join(f"{_mean_ms(r.ttft(n)):>17}" for r in runs))
    print(f"{'>=2':>4} " + " ".join(f"{_mean_ms(r.ttft(min_turn=2)):>17}" for r in runs))
    ref = runs[0]
    print(f"\ncached prompt tokens by tier, shared-store traffic (KV: {KV_BYTES_PER_TOKEN} B per token, "
          f"{chunk}-token chunks)")
    head = (f"{'config':<18}{'prompt':>8}{'gpu':>7}{'host':>7}{'ssd':>7}{'remote':>7}{'prefilled':>10}"
            f"{'TTFT>=2':>9}{'vs ' + ref.name:>10}{'chunks->store':>14}{'MiB->store':>11}{'SETs':>6}{'GETs':>6}"
            f"{'keys':>6}")
    print(head)
    print("-" * len(head))
    ref2 = statistics.mean(ref.ttft(min_turn=2)) if ref.ttft(min_turn=2) else 0.0
    for r in runs:
        prompt = r.total("prompt_len")
        hit = sum(r.total(k) for k in ("gpu_hit", "host_hit", "ssd_hit", "remote_hit"))
        t2 = statistics.mean(r.ttft(min_turn=2)) if r.ttft(min_turn=2) else 0.0
        shared = r.name.startswith("shared-")
        store = shared or r.name.startswith("mp-")
        keys = r.requests[-1].get("redis_keys", 0) if store and r.requests else 0
        mib = f"{r.total('shared_write_bytes') / 2**20:.1f}" if shared else "-"
        print(f"{r.name:<18}{prompt:>8}{r.total('gpu_hit'):>7}{r.total('host_hit'):>7}{r.total('ssd_hit'):>7}"
              f"{r.total('remote_hit'):>7}{prompt - hit:>10}{1000 * t2:>9.1f}{ratio(ref2, t2):>10}"
              f"{r.total('shared_writes') if shared else '-':>14}"
              f"{mib:>11}"
              f"{r.total('redis_sets') if store else '-':>6}{r.total('redis_gets') if store else '-':>6}"
              f"{keys if store else '-':>6}")
    print(f"(TTFT>=2: mean TTFT of follow-up turns in ms; 'vs {ref.name}': {ref.name}'s / this one's, i.e. the "
          "speed-up; chunks/MiB->store: what kvtier wrote to Redis; SETs/GETs/keys: Redis's own counters)")
    if "mp-shared" in {r.name for r in runs}:
        m = next(r for r in runs if r.name == "mp-shared")
        from_redis = [x for x in m.requests if x.get("redis_gets", 0) > 0]
        print(f"mp-shared: 'gpu' is vLLM's whole reuse (its prefix cache + LMCache MP, unsplit); {len(from_redis)} "
              f"requests read from Redis (GETs > 0), with {sum(x['gpu_hit'] for x in from_redis)} cached tokens")
    by = {r.name: r for r in runs}
    if "shared-all" in by and "shared-continuing" in by:
        a, c = by["shared-all"], by["shared-continuing"]
        ab, cb = a.total("shared_write_bytes"), c.total("shared_write_bytes")
        print(f"writes: continuing sent {cb / 2**20:.1f} MiB to the store vs {ab / 2**20:.1f} MiB with all "
              f"({ratio(cb, ab)}), and got {c.total('remote_hit')} remote hit tokens vs {a.total('remote_hit')} "
              f"({ratio(c.total('remote_hit'), a.total('remote_hit'))}); follow-up TTFT "
              f"{1000 * statistics.mean(c.ttft(min_turn=2)):.1f} vs "
              f"{1000 * statistics.mean(a.ttft(min_turn=2)):.1f} ms")
    rc = 0
    for r in runs[1:]:
        diff = [(x["conv"], x["turn"]) for x, y in zip(r.requests, ref.requests) if x["tokens"] != y["tokens"]]
        if diff:
            rc = 1
            print(f"{r.name}: generated tokens DIFFERENT from {ref.name} in {len(diff)} of {len(turns)} requests "
                  f"(first: conversation {diff[0][0]} turn {diff[0][1]})")
        else:
            print(f"{r.name}: generated tokens identical to {ref.name} ({len(turns)} requests, greedy)")
    return rc


def run(args: argparse.Namespace) -> int:
    t_all = time.perf_counter()
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in CONFIGS]
    if bad or not configs:
        print(f"--configs: unknown {', '.join(bad) or '(none given)'}; choose from {', '.join(CONFIGS)}")
        return 2
    if args.replicas < 1 or args.chunk_tokens % args.page_tokens:
        print("--replicas must be >= 1 and --chunk-tokens a multiple of --page-tokens")
        return 2
    workload = workload_of(args)
    if isinstance(workload, str):
        print(workload)
        return 2
    turns, longest = workload
    page = args.page_tokens
    max_model_len = -(-longest // page) * page
    history_tokens = sum(len(t.new_tokens) + t.max_tokens for t in turns)
    # vLLM's KV budget: one longest request (+1 block), as on a busy server: histories do not stay on the GPU
    gpu_blocks = max_model_len // page + 1
    host_mb = args.host_mb if args.host_mb is not None else round(
        max(history_tokens * KV_BYTES_PER_TOKEN / 2**20 / 2, 3 * longest * KV_BYTES_PER_TOKEN / 2**20), 2)
    own = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-demo-shared-") if own else args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    base = {"model": str(workdir / "model"), "page_tokens": page, "chunk_tokens": args.chunk_tokens,
            "max_model_len": max_model_len, "gpu_blocks": gpu_blocks}
    n_conv = len({t.conv for t in turns})
    print(f"kvtier shared-tier demo: {n_conv} conversations x {args.turns} turns ({len(turns)} requests) of "
          f"{args.trace}, routed {args.routing} over {args.replicas} vLLM CPU replicas, one request at a time")
    print(f"  per replica: vLLM KV budget {gpu_blocks} x {page} tokens; kvtier host tier {host_mb:g} MiB, SSD "
          f"tier {args.ssd_mb:g} MiB; {args.chunk_tokens}-token chunks; shared: one redis-server on "
          f"127.0.0.1:{args.redis_port}; configurations: {', '.join(configs)}")
    sys.stdout.flush()
    from kvtier.launch.demo_model import build as build_model

    build_model(base["model"])
    redis = None
    runs: list[ConfigRun] = []
    try:
        if any(c.startswith(("shared-", "mp-")) for c in configs):
            from kvtier.launch.redis_server import RedisServer

            redis = RedisServer(args.redis_port, workdir / "redis").start()
        for cfg in configs:
            runs.append(_run_config(cfg, workdir, base, turns, args, host_mb,
                                    redis if cfg.startswith(("shared-", "mp-")) else None))
    except RuntimeError as e:
        print(f"\nERROR: {e}")
        print(f"(work directory kept: {workdir})")
        return 1
    finally:
        if redis is not None:
            redis.stop()
    rc = report(runs, turns, args.chunk_tokens)
    if args.json:
        Path(args.json).write_text(json.dumps({"chunk_tokens": args.chunk_tokens, "replicas": args.replicas,
                                               "min_history_chunks": args.min_history_chunks,
                                               "runs": {r.name: {"requests": r.requests, "wall_s": r.wall_s}
                                                        for r in runs}}, indent=1))
    if own and rc == 0:
        shutil.rmtree(workdir, ignore_errors=True)
    elif own:
        print(f"(work directory kept: {workdir})")
    print(f"\ndemo wall time {time.perf_counter() - t_all:.0f} s")
    return rc
