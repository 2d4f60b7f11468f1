"""The engine process of `kvtier demo-vllm` and the driver side that runs it.

`run_engine` starts one engine subprocess (`engine_main`: vLLM's CPU build with the tiny demo model, prompts as
token ids), follows its progress on a pipe (tqdm bar), ends its whole process group and returns its `RunResult`.
`engine_main` replays the turns with at most `concurrency` in flight (a turn only after its conversation's previous
turn), drives the engine's step loop to measure TTFT per request, and counts per request where its cached prompt
tokens came from (vLLM's prefix cache, kvtier's host or SSD tier).
"""

from __future__ import annotations

import json
import os
import random
import select
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.launch.demo_model import VOCAB
from kvtier.launch.demo_model import build as build_model
from kvtier.launch.vllm_process import end_process_group

PROGRESS_FD_ENV = "KVTIER_DEMO_PROGRESS_FD"


# --------------------------------------------------------------------------------------------- engine side
def engine_main(args_path: str) -> None:
    """Body of one engine subprocess (started by `run_engine`): reads its arguments from the JSON at `args_path`,
    writes its results to the JSON at `args["out"]`, and its progress to the pipe named by $KVTIER_DEMO_PROGRESS_FD."""
    import faulthandler

    args = json.loads(Path(args_path).read_text())
    faulthandler.dump_traceback_later(args["watchdog_s"], exit=True)  # a hang shows its stacks
    fd = int(os.environ.get(PROGRESS_FD_ENV, "-1"))
    progress = os.fdopen(fd, "w", buffering=1) if fd >= 0 else open(os.devnull, "w")  # noqa: SIM115

    def say(*parts: Any) -> None:
        progress.write(" ".join(str(p) for p in parts) + "\n")

    t0 = time.perf_counter()
    if not os.path.exists(os.path.join(args["model"], "config.json")):
        say("phase building the tiny model")
    build_model(args["model"])
    say("phase starting vLLM")
    from vllm import LLM, SamplingParams

    kw: dict[str, Any] = {}
    if args.get("kv_transfer_config"):
        kw["kv_transfer_config"] = args["kv_transfer_config"]
    if args.get("scheduler_cls"):
        kw["scheduler_cls"] = args["scheduler_cls"]
    if args.get("lmcache_mp_url"):
        kw["distributed_executor_backend"] = "uni"  # LMCache's MP connector: engine core in its own process
    llm = LLM(model=args["model"], skip_tokenizer_init=True, load_format="auto", dtype="float32", enforce_eager=True,
              block_size=args["page_tokens"], max_model_len=args["max_model_len"], enable_prefix_caching=True,
              num_gpu_blocks_override=args["gpu_blocks"], max_num_seqs=max(4, args["concurrency"]),
              disable_log_stats=False, seed=0, **kw)
    engine = llm.llm_engine
    core = getattr(engine.engine_core, "engine_core", None)  # None when the engine core runs in its own process
    conn = core.scheduler.connector if core is not None else None
    admitted: dict[str, tuple[int, int, int]] = {}  # request id -> (vLLM prefix-cache, host, SSD) tokens
    if conn is not None and getattr(conn, "scheduler_side", None) is not None:
        ss = conn.scheduler_side
        original = conn.update_state_after_alloc

        def update_state_after_alloc(request: Any, blocks: Any, num_external_tokens: int) -> None:
            st = ss.reqs.get(request.request_id)
            gpu = int(st.gpu_tokens) if st is not None else 0
            disk = int(st.sources.get("disk", 0)) if st is not None and num_external_tokens > 0 else 0
            admitted.setdefault(request.request_id, (gpu, int(num_external_tokens) - disk, disk))
            return original(request, blocks, num_external_tokens)

        conn.update_state_after_alloc = update_state_after_alloc  # instance attribute: the scheduler calls this
    start_s = time.perf_counter() - t0

    # warm-up outside the measurement (first forward passes, first loads and saves)
    rng = random.Random(7)
    warm = [rng.randrange(1, VOCAB) for _ in range(4 * args["chunk_tokens"] + 5)]
    wsp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for p in (warm, warm + warm[:40]):
        llm.generate([{"prompt_token_ids": p}], wsp, use_tqdm=False)
    admitted.clear()
    mp_before = _mp_counters(args.get("lmcache_mp_url"), llm)
    say("ready", f"{start_s:.1f}")

    turns = args["turns"]
    hist: dict[int, list[int]] = {}
    done_turns: dict[int, int] = {}
    pending = list(range(len(turns)))
    inflight: dict[str, int] = {}
    recs: list[dict[str, Any]] = [{} for _ in turns]
    t_run = time.perf_counter()
    while pending or inflight:
        for i in list(pending):
            if len(inflight) >= args["concurrency"]:
                break
            t = turns[i]
            if t["turn"] != done_turns.get(t["conv"], 0) + 1:
                continue  # the previous turn of this conversation has not finished
            prompt = hist.get(t["conv"], []) + t["new_tokens"]
            rid = f"conv{t['conv']}-turn{t['turn']}"
            sp = SamplingParams(temperature=0.0, max_tokens=t["max_tokens"], ignore_eos=True)
            recs[i] = {"conv": t["conv"], "turn": t["turn"], "prompt_len": len(prompt), "rid": rid,
                       "arrival": time.perf_counter()}
            recs[i]["internal_id"] = engine.add_request(rid, {"prompt_token_ids": prompt}, sp)
            recs[i]["_prompt"] = prompt
            inflight[rid] = i
            pending.remove(i)
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            i = inflight.get(o.request_id)
            if i is None:
                continue
            rec = recs[i]
            toks = list(o.outputs[0].token_ids) if o.outputs else []
            if "ttft" not in rec and toks:
                rec["ttft"] = now - rec["arrival"]
                rec["cached"] = int(o.num_cached_tokens or 0)
            if o.finished:
                rec["tokens"] = toks
                rec["latency"] = now - rec["arrival"]
                t = turns[i]
                hist[t["conv"]] = rec.pop("_prompt") + toks
                done_turns[t["conv"]] = t["turn"]
                del inflight[o.request_id]
                say("done", i)
    wall = time.perf_counter() - t_run
    for rec in recs:
        rec["arrival"] -= t_run
        gpu, host, ssd = admitted.get(rec["internal_id"], (rec.get("cached", 0), 0, 0))
        rec.update(gpu_hit=gpu, host_hit=host, ssd_hit=ssd)
    out: dict[str, Any] = {"requests": recs, "wall_s": wall, "start_s": start_s}
    if conn is not None and getattr(conn, "scheduler_side", None) is not None:
        from kvtier.connector.metrics import kvtier_samples

        snap = conn.scheduler_side.snapshot()
        out.update(counters=snap["counters"], storage=snap["storage"], policy=snap["policy"])
        accounts = snap["lost_hits"]["requests"]  # the lost-hit ledger's account of each request
        for rec in recs:
            rec["lost"] = accounts.get(rec["internal_id"])
        out["metrics"] = kvtier_samples()
    src: dict[str, float] = {}
    for x in llm.get_metrics():
        if x.name == "vllm:prompt_tokens_cached_by_source":
            src[x.labels.get("source", "?")] = x.value
    out["cached_by_source"] = src
    out["scheduler"] = type(core.scheduler).__name__ if core is not None else "vLLM's (engine core process)"
    if args.get("lmcache_mp_url"):
        after = _mp_counters(args["lmcache_mp_url"], llm)
        out["lmcache_mp"] = {k: after[k] - mp_before.get(k, 0.0) for k in after}
    Path(args["out"]).write_text(json.dumps(out))
    say("phase shutting down")
    engine.engine_core.shutdown()


def _mp_counters(url: str | None, llm: Any) -> dict[str, float]:
    """For the LMCache MP run: vLLM's cached tokens by source and the server's L1/L2 lookup hits, cumulative."""
    if not url:
        return {}
    out: dict[str, float] = {}
    for x in llm.get_metrics():
        if x.name == "vllm:prompt_tokens_cached_by_source":
            key = "vllm_" + x.labels.get("source", "?")
            out[key] = out.get(key, 0.0) + float(x.value)
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            for name in ("lmcache_mp_lookup_hit_l1_keys_total", "lmcache_mp_lookup_hit_l2_keys_total",
                         "lmcache_mp_l2_store_completed_objects_chunks_total"):
                if line.startswith(name):
                    out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


# --------------------------------------------------------------------------------------------- driver side
@dataclass
class RunResult:
    """One engine run: a record per request (TTFT, hits per tier, generated tokens), the replay's wall time, the
    engine's start time, and everything the engine process wrote (`raw`)."""

    name: str
    requests: list[dict[str, Any]] = field(default_factory=list)
    wall_s: float = 0.0
    start_s: float = 0.0
    raw: dict[str, Any] = field(default_factory=dict)

    def hits(self, key: str, min_turn: int = 1) -> int:
        return sum(r[key] for r in self.requests if r["turn"] >= min_turn)

    def ttft(self, min_turn: int = 1, max_turn: int | None = None) -> list[float]:
        return [r["ttft"] for r in self.requests
                if r["turn"] >= min_turn and (max_turn is None or r["turn"] <= max_turn)]


def engine_env() -> dict[str, str]:
    """The environment of an engine process (also `demo-shared`'s replicas): vLLM's CPU build, one compute thread."""
    env = dict(os.environ)
    env.update({"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "LMCACHE_TRACK_USAGE": "false",
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TRITON_INTERPRET": "0", "TQDM_DISABLE": "1",
                # One unbound compute thread: two OpenMP threads pinned to the two cores stall at every barrier
                # (~80 ms steps) as soon as anything else runs; the tiny model gains nothing from the second one.
                "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"})
    env.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    return env


def run_engine(name: str, label: str, workdir: Path, args: dict[str, Any], n_turns: int, timeout: float,
               env_extra: dict[str, str] | None = None) -> RunResult:
    """One engine process on `args` (`engine_main`'s arguments) with a progress bar named `label`; its arguments,
    log and results are `workdir/<name>.*`. Raises RuntimeError when it fails or takes longer than `timeout` s."""
    from tqdm import tqdm

    args = dict(args, out=str(workdir / f"{name}.out.json"), watchdog_s=max(60, int(timeout) - 10))
    args_path = workdir / f"{name}.args.json"
    args_path.write_text(json.dumps(args))
    log_path = workdir / f"{name}.log"
    r_fd, w_fd = os.pipe()
    env = engine_env()
    env.update(env_extra or {})
    env[PROGRESS_FD_ENV] = str(w_fd)
    code = ("if __name__ == '__main__':\n    from kvtier.cli.demo_vllm_engine import engine_main\n"
            f"    engine_main({str(args_path)!r})")
    bar = tqdm(total=n_turns, desc=f"{label:>22}", unit="turn", leave=True, dynamic_ncols=True)
    bar.set_postfix_str("starting")
    deadline = time.monotonic() + timeout
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=workdir, env=env, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, pass_fds=(w_fd,),
                                start_new_session=True)
    os.close(w_fd)
    buf = b""
    try:
        with os.fdopen(r_fd, "rb", buffering=0) as rd:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    end_process_group(proc)
                    raise RuntimeError(f"{label}: the engine run took longer than {timeout:.0f} s (log: {log_path})")
                ready, _, _ = select.select([rd], [], [], min(1.0, left))
                if not ready:
                    continue
                chunk = rd.read(4096)
                if not chunk:
                    break
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    kind, _, rest = line.decode().partition(" ")
                    if kind == "phase":
                        bar.set_postfix_str(rest)
                    elif kind == "ready":
                        bar.set_postfix_str(f"engine up in {float(rest):.0f} s")
                        bar.reset(total=n_turns)
                    elif kind == "done":
                        bar.update(1)
        rc = proc.wait(timeout=max(5.0, deadline - time.monotonic()))
    finally:
        end_process_group(proc)  # also after a normal exit: nothing of the engine may outlive its run
        bar.close()
    out_path = workdir / f"{name}.out.json"
    if rc != 0 or not out_path.exists():
        tail = log_path.read_text(errors="replace")[-4000:]
        raise RuntimeError(f"{label}: the engine exited with status {rc} (log: {log_path}); its end:\n{tail}")
    raw = json.loads(out_path.read_text())
    return RunResult(label, raw["requests"], raw["wall_s"], raw["start_s"], raw)

