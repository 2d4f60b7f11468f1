"""A real vLLM engine (`vllm.LLM`, CPU build) in its own process, driven over a pipe: for tests and benchmarks.

    model = tiny_llama(tmp / "model")                      # the tests' random 2-layer Llama (no download)
    with EngineProcess(tmp, "kvtier", model, llm={"kv_transfer_config": ktc, "max_model_len": 1024}) as eng:
        eng.ready()
        res = eng.generate([[1, 2, 3]], max_tokens=16)      # {"outputs": [{"tokens", "cached", ...}], "seconds"}
        stats = eng.stats()                                 # connector snapshot, kvtier metrics, vLLM hit sources
    batches = run_conversations(eng, conversations, schedule, max_tokens=16)   # multi-turn chats, greedy

The child is this module (`python -m kvtier.testing.vllm_engine ARGS.json`): it installs the caller's `timing`
(`kvtier.testing.transfer_timing`), builds one `LLM` with the settings every test shares (float32, eager, block size
32, vLLM's prefix cache off, seed 0, token ids in and out) plus the caller's `llm` keywords, prints `KVTIER-READY`,
then answers one JSON command a line (`generate`, `stats`, `quit`) with one `KVTIER-RESULT` line. Everything else it
prints goes to `workdir/NAME.log`; a hang ends the child with its stacks in that log (`watchdog_s`). `close()`
always ends the process (quit, then kill).
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier.testing.transfer_timing import HeldTransfers

from kvtier.launch.vllm_process import end_process_group, guard_llvmlite_for_vllm_kernel_scan

#: the tests' tiny random Llama (2 layers, 2 KV heads of 32): 512 bytes of fp32 KV per token and layer pair
TEST_LLAMA = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 1024, "max_position_embeddings": 4096,
              "initializer_range": 0.2}
#: `LLM(...)` settings of every engine here; the caller's `llm` keywords are added (and win)
LLM_DEFAULTS = {"skip_tokenizer_init": True, "load_format": "auto", "dtype": "float32", "enforce_eager": True,
                "block_size": 32, "enable_prefix_caching": False, "seed": 0}
#: environment of an engine on a CPU machine: vLLM's CPU build, 1 GiB of KV space, the engine core in-process
ENGINE_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "LMCACHE_TRACK_USAGE": "false",
              "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TRITON_INTERPRET": "0"}
_READY, _RESULT = "KVTIER-READY", "KVTIER-RESULT "


def tiny_llama(path: str | Path, **config: Any) -> str:
    """Write a random Llama (`TEST_LLAMA` with `config` overrides, seed 0) to `path` unless it is there; built in
    a subprocess, so the caller's torch RNG and imports stay untouched. Returns the path."""
    path = str(path)
    if not os.path.exists(os.path.join(path, "config.json")):
        cfg = dict(TEST_LLAMA, **config)
        subprocess.run([sys.executable, "-m", "kvtier.testing.vllm_engine", "--build-model", path, json.dumps(cfg)],
                       check=True, capture_output=True, timeout=300, env=dict(os.environ, **ENGINE_ENV))
    return path


class EngineFailed(AssertionError):
    """The engine process did not answer (it exited, hung or printed something else); carries its log's end."""


class EngineProcess:
    """One vLLM engine process; `llm` holds extra `LLM(...)` keywords (kv_transfer_config, scheduler_cls, ...),
    `env` extra environment variables (over `ENGINE_ENV`), `timing` holds or slows the connector worker's
    transfers (installed in the child before it builds the engine: `kvtier.testing.transfer_timing`)."""

    def __init__(self, workdir: str | Path, name: str, model: str | Path, *, llm: dict | None = None,
                 env: dict[str, str] | None = None, watchdog_s: float | None = 600,
                 timing: HeldTransfers | None = None) -> None:
        workdir = Path(workdir)
        self.name = name
        self.log_path = workdir / f"{name}.log"
        args = {"model": str(model), "llm": {k: v for k, v in (llm or {}).items() if v is not None},
                "watchdog_s": watchdog_s, "timing": timing.as_dict() if timing is not None else None}
        args_path = workdir / f"{name}.args.json"
        args_path.write_text(json.dumps(args))
        self._log = open(self.log_path, "w")
        # LMCache's in-process engine sets PROMETHEUS_MULTIPROC_DIR in os.environ of whatever process built one
        # (a test run's pytest): inherited, it would put the workers' metric values in files that this engine's
        # samples do not read. An engine gets it only when `env` asks for it.
        base = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
        self.proc = subprocess.Popen([sys.executable, "-m", "kvtier.testing.vllm_engine", str(args_path)],
                                     cwd=workdir, env={**base, **ENGINE_ENV, **(env or {})},
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, bufsize=1, start_new_session=True)
        self._lines: queue.Queue = queue.Queue()
        self._pump_thread = threading.Thread(target=self._pump, name=f"engine-{name}-stdout", daemon=True)
        self._pump_thread.start()

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            if line.startswith((_READY, _RESULT)):
                self._lines.put(line.rstrip("\n"))
            else:
                self._log.write(line)
                self._log.flush()
        self._lines.put(None)

    def log_text(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def _line(self, prefix: str, timeout: float) -> str:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            line = None
        if line is None or not line.startswith(prefix):
            if line is None:
                self._pump_thread.join(5)  # the rest of the output into the log
            raise EngineFailed(f"engine {self.name} gave no {prefix.strip()!r} (rc {self.proc.poll()}, got "
                               f"{line!r}):\n{self.log_text()[-6000:]}")
        return line[len(prefix):]

    def ready(self, timeout: float = 400) -> EngineProcess:
        """Wait until the engine is built (raises EngineFailed with its log's end if it stops first)."""
        self._line(_READY, timeout)
        return self

    def wait_exit(self, timeout: float = 300) -> int:
        """For an engine expected to stop at start: its exit status (killed after `timeout`)."""
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._kill()
            log = self.log_text()[-6000:]
            raise EngineFailed(f"engine {self.name} did not stop within {timeout} s:\n{log}") from None
        self._pump_thread.join(30)
        return rc

    def _call(self, cmd: dict, timeout: float) -> dict:
        try:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        except OSError as e:
            raise EngineFailed(f"engine {self.name} is gone ({e}):\n{self.log_text()[-6000:]}") from None
        return json.loads(self._line(_RESULT, timeout))

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int = 16, *, logprobs: bool = False,
                 flush: bool = False, timeout: float = 300, salts: Sequence[str | None] | None = None) -> dict:
        """Greedy generation (ignore_eos) of one batch of token-id prompts (`salts`: each prompt's cache_salt, None
        for none). Returns {"outputs": [{"tokens", "cached" (vLLM's num_cached_tokens), "logprobs" (the chosen
        tokens', with `logprobs`)}], "seconds" (the `generate` call)}; with `flush` also "drained_seconds": until
        the connector's queued saves and SSD writes landed."""
        return self._call({"op": "generate", "prompts": [list(p) for p in prompts], "max_tokens": max_tokens,
                           "logprobs": logprobs, "flush": flush,
                           "salts": list(salts) if salts is not None else [None] * len(prompts)}, timeout)

    def stats(self, timeout: float = 120) -> dict:
        """The connector's scheduler-side snapshot (when there is a connector), kvtier's metric samples, vLLM's
        prompt tokens cached by source, and its preemptions (when any)."""
        return self._call({"op": "stats"}, timeout)

    def close(self, timeout: float = 60) -> None:
        try:
            if self.proc.poll() is None:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout)
        except (OSError, subprocess.TimeoutExpired, ValueError):
            pass
        finally:
            self._kill()
            self._pump_thread.join(10)
            self._log.close()

    def _kill(self) -> None:
        if self.proc.poll() is None:
            end_process_group(self.proc)


def run_conversations(engine: EngineProcess, conversations: list[list[list[int]]], schedule: list[list[int]],
                      max_tokens: int = 16, *, logprobs: bool = False, pause_s: float = 0.0) -> list[list[dict]]:
    """Multi-turn chats: each batch of `schedule` names conversations whose next turn (history + the turn's new
    tokens) runs together in one `generate`; the answer joins the history. Returns per batch one record a request:
    conv, turn, prompt_len, tokens, cached (and logprobs). `pause_s` waits after each batch."""
    history: list[list[int]] = [[] for _ in conversations]
    turn_of = [0] * len(conversations)
    batches = []
    for batch in schedule:
        prompts = [history[i] + conversations[i][turn_of[i]] for i in batch]
        res = engine.generate(prompts, max_tokens, logprobs=logprobs)
        rec = []
        for i, p, o in zip(batch, prompts, res["outputs"], strict=True):
            history[i] = p + o["tokens"]
            rec.append(dict(o, conv=i, turn=turn_of[i], prompt_len=len(p)))
            turn_of[i] += 1
        batches.append(rec)
        time.sleep(pause_s)
    return batches


# ------------------------------------------------------------------------------------------------ the child
def _serve(args_path: str) -> None:
    args = json.loads(Path(args_path).read_text())
    if args.get("watchdog_s"):
        import faulthandler

        faulthandler.dump_traceback_later(args["watchdog_s"], exit=True)  # a hang shows its stacks
    guard_llvmlite_for_vllm_kernel_scan()
    from kvtier.testing.transfer_timing import install_dict

    install_dict(args.get("timing"))  # before the engine builds its connector worker (in this process)
    from vllm import LLM, SamplingParams

    from kvtier.connector.kvtier_connector import KVTierConnector

    llm = LLM(model=args["model"], **dict(LLM_DEFAULTS, **args["llm"]))
    conn = llm.llm_engine.engine_core.engine_core.scheduler.connector if hasattr(
        llm.llm_engine.engine_core, "engine_core") else None
    print(_READY, flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        if cmd["op"] == "generate":
            sp = SamplingParams(temperature=0.0, max_tokens=cmd["max_tokens"], ignore_eos=True,
                                logprobs=0 if cmd["logprobs"] else None)
            t0 = time.perf_counter()
            res = llm.generate([{"prompt_token_ids": p, **({"cache_salt": s} if s else {})}
                                for p, s in zip(cmd["prompts"], cmd["salts"])], sp, use_tqdm=False)
            out: dict[str, Any] = {"seconds": time.perf_counter() - t0, "outputs": []}
            for r in res:
                o = r.outputs[0]
                rec = {"tokens": list(o.token_ids), "cached": int(r.num_cached_tokens or 0)}
                if cmd["logprobs"]:
                    rec["logprobs"] = [float(d[t].logprob) for t, d in zip(o.token_ids, o.logprobs)]
                out["outputs"].append(rec)
            if cmd["flush"] and isinstance(conn, KVTierConnector):  # queued saves and SSD writes land first
                conn.scheduler_side.flush(120)
                out["drained_seconds"] = time.perf_counter() - t0
        else:  # stats
            out = conn.scheduler_side.snapshot() if isinstance(conn, KVTierConnector) else {}
            from kvtier.connector.metrics import kvtier_samples

            out["metrics"] = kvtier_samples()
            src = {}
            for x in llm.get_metrics():
                if x.name == "vllm:prompt_tokens_cached_by_source":
                    src[x.labels.get("source", "?")] = x.value
                if x.name == "vllm:num_preemptions":
                    out["preemptions"] = out.get("preemptions", 0) + x.value
            out["cached_by_source"] = src
        print(_RESULT + json.dumps(out), flush=True)
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":  # vLLM's engine core may run in a spawned process: nothing above runs on import
    if sys.argv[1] == "--build-model":
        from kvtier.launch.demo_model import build

        build(sys.argv[2], config=json.loads(sys.argv[3]), tokenizer=False)
    else:
        _serve(sys.argv[1])
