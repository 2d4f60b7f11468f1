"""A real `lmcache server` (LMCache's multiprocess mode) as a managed subprocess, for the demos, tests and
benchmarks.

`MPServer(...)` starts `lmcache server` with the given L2 adapters, waits until its HTTP admin API answers, and
stops it (SIGTERM, then SIGKILL after a timeout) when the `with` block ends, whatever happens inside. It also reads
what the server exposes: `/status` (which includes each L2 adapter's `report_status()`) and the Prometheus text
of `/metrics`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def kvtier_adapter_spec(ssd_path: str, capacity_gb: float, **params: Any) -> dict[str, Any]:
    """kvtier's `--l2-adapter` spec (the shipped configs/lmcache-mp-l2-kvtier.json with its path and size set)."""
    from kvtier.configs import path as config_path

    spec = json.loads(Path(config_path("lmcache-mp-l2-kvtier.json")).read_text())
    spec["adapter_params"].update({"ssd_path": str(ssd_path), "ssd_capacity_gb": capacity_gb, **params})
    return spec


def lmcache_executable() -> str:
    """`lmcache` next to this interpreter (the environment's console script), else the one on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "lmcache")
    return here if os.path.exists(here) else (shutil.which("lmcache") or "lmcache")


@dataclass
class MPServer:
    """One `lmcache server` on 127.0.0.1 (`port` for its RPC, `http_port` for its admin API), logging to
    `log_path`; `adapters` are its `--l2-adapter` specs in order."""

    port: int
    http_port: int
    adapters: list[dict[str, Any]]
    log_path: str
    l1_gb: float = 0.05
    chunk_size: int = 256
    eviction_watermark: float | None = None
    eviction_ratio: float | None = None
    extra_args: list[str] = field(default_factory=list)
    start_timeout: float = 120.0
    proc: subprocess.Popen | None = None
    returncode: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def rpc_url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [lmcache_executable(), "server", "--host", "127.0.0.1", "--port", str(self.port),
               "--http-host", "127.0.0.1", "--http-port", str(self.http_port), "--l1-size-gb", f"{self.l1_gb:.6f}",
               "--eviction-policy", "LRU", "--supported-transfer-mode", "engine_driven",
               "--chunk-size", str(self.chunk_size)]
        if self.eviction_watermark is not None:
            cmd += ["--eviction-trigger-watermark", str(self.eviction_watermark)]
        if self.eviction_ratio is not None:
            cmd += ["--eviction-ratio", str(self.eviction_ratio)]
        for a in self.adapters:
            cmd += ["--l2-adapter", json.dumps(a)]
        return cmd + self.extra_args

    def start(self) -> MPServer:
        return self.launch().wait_ready()

    def launch(self) -> MPServer:
        """Start the process without waiting for it (`wait_ready` waits): servers can start side by side."""
        env = dict(os.environ, LMCACHE_TRACK_USAGE="false", LMCACHE_DISABLE_BANNER="1")
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - the server writes it while it lives, closed by stop()
        self.proc = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        self._launched = time.monotonic()
        return self

    def wait_ready(self) -> MPServer:
        """Until the HTTP admin API answers (`start_timeout` from `launch`); stops the server if it does not."""
        deadline = self._launched + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc is None:
                raise RuntimeError("lmcache server: wait_ready() before launch()")
            if self.proc.poll() is not None:
                self.returncode = self.proc.returncode
                self.proc = None
                self._log.close()
                raise RuntimeError(f"lmcache server exited with status {self.returncode} at start; its log "
                                   f"({self.log_path}) ends:\n{self.log_tail()}")
            try:
                self.status()
                return self
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"lmcache server did not answer within {self.start_timeout:.0f} s; log:\n"
                           f"{self.log_tail()}")

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM (LMCache closes its adapters), then SIGKILL the process group if it hangs."""
        if self.proc is None:
            return self.returncode
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.returncode = self.proc.returncode
        self.proc = None
        self._log.close()
        return self.returncode

    def __enter__(self) -> MPServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ------------------------------------------------------------------ what the server exposes
    def _get(self, path: str, timeout: float = 10.0) -> bytes:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            return r.read()

    def status(self) -> dict[str, Any]:
        return json.loads(self._get("/status"))

    def l2_status(self, index: int = 0) -> dict[str, Any]:
        return self.status()["storage_manager"]["l2_adapters"][index]

    def l1_status(self) -> dict[str, Any]:
        return self.status()["storage_manager"]["l1_manager"]

    def metrics(self) -> dict[str, float]:
        """Prometheus text of /metrics, summed over label sets: {metric name: value}."""
        out: dict[str, float] = {}
        for line in self._get("/metrics").decode().splitlines():
            if not line or line.startswith("#"):
                continue
            name_labels, _, value = line.rpartition(" ")
            name = name_labels.split("{", 1)[0]
            try:
                out[name] = out.get(name, 0.0) + float(value)
            except ValueError:
                continue
        return out

    def clear_l1(self) -> None:
        req = urllib.request.Request(self.url + "/cache/clear", data=json.dumps({"tier": "l1"}).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=30) as r:
            r.read()

    def wait_l2_idle(self, committed: int | None = None, timeout: float = 60.0, index: int = 0) -> dict[str, Any]:
        """Until the store controller has no task in flight (and the adapter committed `committed` chunks)."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.status()["storage_manager"]
            l2 = st["l2_adapters"][index]
            idle = st["store_controller"]["in_flight_task_count"] == 0 and st["store_controller"][
                "pending_keys_count"] == 0
            if idle and (committed is None or l2.get("stats", {}).get("committed", 0) >= committed):
                return l2
            if time.monotonic() > deadline:
                raise TimeoutError(f"L2 stores still in flight after {timeout:.0f} s: {l2}")
            time.sleep(0.1)

    def log_tail(self, n: int = 6000) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")[-n:]
        except OSError:
            return ""
