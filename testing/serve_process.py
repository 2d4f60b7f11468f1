"""A `kvtier serve` (= `vllm serve`) subprocess of the demo model on CPU, for tests and benchmarks.

    srv = ServeProcess("kvtier", workdir, model_dir, port, extra=["--kv-transfer-config", ...])
    srv.wait_ready(deadline)           # /health answers, or the log's end in the error
    srv.metrics()                      # /metrics parsed: {(sample name, labels): value}
    srv.stop()                         # SIGINT as a user would, SIGKILL to the whole session on timeout

The server runs in its own session (process group), its output goes to `workdir/NAME.log`, and `stop()` leaves
no process behind, and no file: vLLM's ZMQ IPC sockets go to a directory of the server's own
(`VLLM_RPC_BASE_PATH`), which `stop()` removes (vLLM leaves them in `$TMPDIR` even after a clean shutdown).
Settings for a 2-core machine: one unbound OpenMP thread, 1 GiB of vLLM CPU KV space.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

#: environment of a CPU server: offline, one compute thread, a small KV space, no LMCache telemetry
SERVER_ENV = {"LMCACHE_TRACK_USAGE": "false", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
              "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}

_TAKEN: set[int] = set()  # handed out in this process: a server binds its port only at the end of its start-up


def lane_port(port: int) -> int:
    """`port` moved by `KVTIER_TEST_PORT_SHIFT` (default 0): `scripts/test.sh` runs the compatibility suites beside
    the main one with a shift, so the fixed ports of two test processes never meet."""
    return port + int(os.environ.get("KVTIER_TEST_PORT_SHIFT", "0"))


def free_port(lo: int = 18040, n: int = 60) -> int:
    """A port of 127.0.0.1 in [lane_port(lo), lane_port(lo) + n) that is free now and not handed out before by
    this process."""
    lo = lane_port(lo)
    for port in range(lo, lo + n):
        if port in _TAKEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _TAKEN.add(port)
        return port
    raise RuntimeError(f"no free port in {lo}..{lo + n - 1}")


def http_get(url: str, timeout: float = 10) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def http_post(url: str, body: dict[str, Any], timeout: float = 120) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


class ServeProcess:
    def __init__(self, name: str, workdir: Path, model: Path | str, port: int, vllm_args: list[str],
                 extra: list[str] = (), env: dict[str, str] | None = None) -> None:
        self.name, self.port, self.model = name, port, str(model)
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = Path(workdir) / f"{name}.log"
        # short (socket paths have 108 bytes) and the server's own: stop() removes it with what vLLM left there
        self.rpc_dir = tempfile.mkdtemp(prefix="kvtier-rpc-")
        full_env = {**os.environ, **SERVER_ENV, "VLLM_RPC_BASE_PATH": self.rpc_dir, **(env or {})}
        full_env.pop("PROMETHEUS_MULTIPROC_DIR", None)  # vLLM's default metrics set-up
        cmd = [sys.executable, "-m", "kvtier.cli", "serve", self.model, "--host", "127.0.0.1", "--port", str(port),
               *vllm_args, *extra]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=workdir, env=full_env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)

    def wait_ready(self, deadline: float) -> None:
        """Until /health answers (monotonic `deadline`); raises with the log's end if the server died or is late."""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                http_get(self.url + "/health", timeout=2)
                return
            except OSError:
                time.sleep(1)
        raise RuntimeError(f"{self.name} is not up in time:\n{self.log()[-4000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def chat(self, messages: list[dict[str, str]], max_tokens: int = 16) -> dict[str, Any]:
        return http_post(self.url + "/v1/chat/completions", {"model": self.model, "messages": messages,
                                                            "max_tokens": max_tokens, "temperature": 0.0})

    def complete(self, prompt: list[int] | str, max_tokens: int = 16, **body: Any) -> dict[str, Any]:
        """A greedy completion (OpenAI completions API); `body` adds fields such as `cache_salt`."""
        return http_post(self.url + "/v1/completions", {"model": self.model, "prompt": prompt,
                                                       "max_tokens": max_tokens, "temperature": 0.0, **body})

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """/metrics as {(sample name, ((label, value), ...)): value}, labels other than engine/model dropped."""
        from prometheus_client.parser import text_string_to_metric_families

        out = {}
        for fam in text_string_to_metric_families(http_get(self.url + "/metrics")):
            for s in fam.samples:
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("engine", "model_name")))
                out[(s.name, labels)] = s.value
        return out

    def stop(self, timeout: float = 90, sweep: bool = True) -> int | None:
        """SIGINT (Ctrl-C); SIGKILL to the whole session if it has not exited after `timeout` s, and (`sweep`)
        to whatever of its session outlived it. Idempotent; returns the server's exit status."""
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGINT)
                self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
            if sweep:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)  # anything of its session still there
            if not self._log.closed:
                self._log.close()
            shutil.rmtree(self.rpc_dir, ignore_errors=True)
        return self.proc.returncode
