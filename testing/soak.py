"""A fault-injection soak of `vllm serve` (the demo model) with kvtier's connector, scheduler hook, a small host
tier, an SSD tier that evicts all the time and a shared Redis tier, under a real client (`vllm bench serve`), shared
by `benchmarks/soak_serve.py` (20 minutes and more) and `tests/test_soak_serve.py` (a short schedule).

    rep = run_soak(SoakConfig(workdir=Path("soak-work"), minutes=20))   # prints the table, writes JSON and PNG

Faults, on a schedule while the load runs (`SoakConfig.schedule`, repeated until `minutes` are over):
`enospc` (the SSD tier's small tmpfs filled by a filler file, then freed), `redis` (the shared tier's server
killed, restarted empty on the same port), `kill` (SIGKILL of the server's process group at the tail of a client
round, restart on the same SSD directory), `journal` (server stopped, one journal byte flipped, started again) and
`kill+journal` (both at one restart). What is recorded: `testing/soak_report.py`.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
import urllib.error
from dataclasses import asdict, dataclass
from pathlib import Path

from kvtier.launch.demo_model import KV_BYTES_PER_TOKEN, build
from kvtier.launch.lmcache_yaml import write_lmcache_yaml
from kvtier.launch.redis_server import RedisServer
from kvtier.testing import faults
from kvtier.testing.serve_process import ServeProcess, free_port, http_post
from kvtier.testing.soak_report import (
    EPISODES,
    TIERS,
    FaultRecord,
    Sample,
    SoakReport,
    count_episodes,
    lifetime_slopes,
    plot,
    print_report,
    write_json,
)
from kvtier.testing.soak_workload import (
    BenchRound,
    Prompt,
    RoundResult,
    attribute_failures,
    conversations,
    round_prompts,
)

logger = logging.getLogger(__name__)

PAGE, CHUNK = 32, 64
SLOT_BYTES = CHUNK * KV_BYTES_PER_TOKEN  # one chunk's KV (a slot adds a header)


@dataclass
class SoakConfig:
    workdir: Path
    minutes: float = 20.0  #: the schedule repeats until this much time has passed (a cycle is never cut)
    schedule: tuple[str, ...] = ("enospc", "redis", "kill", "journal")
    warmup_requests: int = 24  #: requests completed before the first fault
    rate: float = 3.0  #: requests/s the client sends (Poisson), at most `concurrency` in flight
    round_s: float = 300.0  #: the longest client round (a round spans faults; the client starts in ~30-60 s)
    gap_s: float = 60.0  #: load after each fault clears (hits "after"), and before the next one
    #: more load (in 5 s steps, at most this long) while a tier has no hit yet after a fault: a Redis restarted
    #: empty serves hits only once chunks written after it came back are read again
    comeback_s: float = 60.0
    enospc_s: float = 60.0
    redis_down_s: float = 20.0
    conversations: int = 8  #: per pass (a round interleaves passes: `soak_workload.round_prompts`)
    turns: int = 3
    words_per_block: int = 40
    output_tokens: int = 8
    tail_tokens: int = 160  #: answer length of each round's last `concurrency` requests (a kill finds them running)
    concurrency: int = 8
    host_mb: float = 16.0  #: more than vLLM's own cache (gpu_blocks), or the host tier never serves a hit
    ssd_mb: float = 32.0
    fs_mb: int = 56  #: the tmpfs under the SSD tier (its room beyond ssd_mb is the journal's reserve)
    gpu_blocks: int = 48
    max_model_len: int = 1280  #: prompts <= 1024 tokens (the client's limit) + a tail answer
    sample_s: float = 2.0
    greedy_per_check: int = 3
    rss_warmup_s: float = 60.0  #: per lifetime, samples before this are left out of the slopes
    seed: int = 0
    port_lo: int = 18300
    start_timeout_s: float = 600.0
    mount: bool = True  #: False: never try to mount (the ENOSPC fault is then SKIPPED)
    json_path: Path | None = None
    plot_path: Path | None = None


class Soak:
    def __init__(self, cfg: SoakConfig) -> None:
        self.cfg = cfg
        self.work = Path(cfg.workdir).resolve()
        self.work.mkdir(parents=True, exist_ok=True)
        self.t0 = time.monotonic()
        self.rep = SoakReport(config={k: str(v) for k, v in asdict(cfg).items()})
        self.model = Path(build(str(self.work / "model")))
        self.disk = faults.SmallDisk(self.work / "ssd-fs", cfg.fs_mb)
        self.mount_error: str | None = "mounting disabled (SoakConfig.mount=False)"
        self.ssd_dir = self.work / "ssd-fs" / "kvtier"
        self.redis = RedisServer(free_port(cfg.port_lo + 50), self.work / "redis")
        self.srv: ServeProcess | None = None
        self.ref: ServeProcess | None = None
        self.life = -1
        self.lock = threading.Lock()
        self.stop_sampling = threading.Event()
        self.stopping = threading.Event()  #: the current server is being stopped: its samples would be its shutdown
        self.bench: BenchRound | None = None
        self.round_no = 0
        self.side_requests = 0  #: greedy-check requests sent to the current lifetime since its round began
        self.round_base = 0.0
        self.kills: list[float] = []
        self.results: list[RoundResult] = []
        self.checked: list[Prompt] = []  #: prompts sent by completed rounds (greedy samples come from these)
        self.rng = random.Random(cfg.seed)

    # ------------------------------------------------------------------ set-up
    def now(self) -> float:
        return time.monotonic() - self.t0

    def _yaml(self) -> str:
        extra = {"o_direct": "false"} if self.disk.mounted else {}  # tmpfs has no O_DIRECT
        return write_lmcache_yaml(
            self.work / "lmcache-kvtier-redis.yaml", base="lmcache-kvtier-redis.yaml", ssd_path=self.ssd_dir,
            chunk_size=CHUNK, host_gb=f"{self.cfg.host_mb / 1024:.9f}", ssd_capacity_gb=self.cfg.ssd_mb / 1024,
            redis_port=self.redis.port,
            replace={"on_unavailable: fail": "on_unavailable: degrade", "    # retry_s: 5.0": "    retry_s: 1.0",
                     "    # timeout_s: 2.0": "    timeout_s: 1.0"}, extra=extra)

    def vllm_args(self) -> list[str]:
        return ["--dtype", "float32", "--max-model-len", str(self.cfg.max_model_len), "--block-size", str(PAGE),
                "--num-gpu-blocks-override", str(self.cfg.gpu_blocks), "--enforce-eager", "--seed", "0",
                "--max-num-seqs", str(self.cfg.concurrency), "--shutdown-timeout", "10"]

    def start_server(self) -> ServeProcess:
        self.life += 1
        kv = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.connector",
              "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
              "kv_connector_extra_config": {"config_file": self.yaml}}
        srv = ServeProcess(f"kvtier-life{self.life}", self.work, self.model, self.port, self.vllm_args(), [
            "--kv-transfer-config", json.dumps(kv), "--scheduler-cls", "kvtier.scheduler_hooks.DualQueueScheduler"])
        with self.lock:
            self.srv = srv
            self.stopping.clear()
        return srv

    # ------------------------------------------------------------------ sampling
    def metrics(self) -> dict:
        srv = self.srv
        try:
            return srv.metrics() if srv is not None else {}
        except (OSError, urllib.error.URLError, ValueError):
            return {}

    @staticmethod
    def hits(m: dict) -> dict[str, float]:
        return {t: m.get(("kvtier_connector_hit_tokens_total", (("tier", t),)), 0.0) for t in TIERS}

    def slot_sizes(self) -> tuple[int, int]:
        size = alloc = 0
        for p in self.ssd_dir.rglob("slots-*"):
            try:
                st = p.stat()
            except OSError:
                continue
            size += st.st_size
            alloc += st.st_blocks * 512
        return size, alloc

    def sample_once(self) -> None:
        with self.lock:
            srv, life = self.srv, self.life
        if srv is None or srv.proc.poll() is not None or self.stopping.is_set():
            return
        m = self.metrics()
        if not m:
            return
        rss, fds, procs = faults.group_usage(srv.proc.pid)
        if srv.proc.poll() is not None or not rss:  # it ended (a kill) while being measured: not a sample
            return
        size, alloc = self.slot_sizes()
        s = Sample(round(self.now(), 2), life, rss / 2**20, fds, procs, self.hits(m),
                   m.get(("kvtier_ssd_used_bytes", ()), 0.0), size, alloc)
        self.rep.samples.append(s)
        cap = self.cfg.ssd_mb * 2**20
        if s.ssd_used > cap or s.slot_bytes > cap:
            self.rep.ssd_over_capacity.append(asdict(s))

    def _sampler(self) -> None:
        while not self.stop_sampling.wait(self.cfg.sample_s):
            try:
                self.sample_once()
            except Exception:  # noqa: BLE001 - a sampler error is reported, never ends the soak
                logger.exception("soak sampler")

    # ------------------------------------------------------------------ load
    def last_cycle(self) -> bool:
        """Whether the cycle under way is the last one (`minutes` would be over by its end)."""
        cfg = self.cfg
        cycle = sum({"enospc": cfg.enospc_s, "redis": cfg.redis_down_s}.get(n, 120.0) + cfg.gap_s
                    for n in cfg.schedule)
        return self.now() + cycle >= cfg.minutes * 60

    def plan_s(self, pos: int, last_cycle: bool) -> float:
        """Seconds of load the schedule needs from fault `pos` up to the tail of its next restart (or its end)."""
        cfg, total = self.cfg, 0.0
        sched = list(cfg.schedule[pos:]) + ([] if last_cycle else list(cfg.schedule[:pos]))
        for name in sched:
            total += {"enospc": cfg.enospc_s, "redis": cfg.redis_down_s}.get(name, 0.0) + cfg.gap_s + 5.0
            if name in ("kill", "journal", "kill+journal"):
                break
        return min(cfg.round_s, total + 30.0)  # a round that ends early costs a client start (30-60 s)

    def next_round(self, seconds: float | None = None) -> None:
        """Collect a finished client round and start the next one, `seconds` long at the configured rate."""
        if self.bench is not None:
            self.collect()
        n = max(16, round(self.cfg.rate * (seconds or self.cfg.round_s)))
        per_pass = self.cfg.conversations * self.cfg.turns
        salt = (self.cfg.seed * 1000 + self.round_no) * 1000  # new text in every pass of every round
        passes = [conversations(self.trace, str(self.model / "tokenizer.json"), self.cfg.conversations,
                                self.cfg.turns, self.cfg.words_per_block, salt=salt + i)
                  for i in range(-(-n // per_pass))]
        prompts: list[Prompt] = round_prompts(passes, seed=salt)
        self.round_base = self.successes(self.metrics())
        self.side_requests = 0
        self.bench = BenchRound(f"round{self.round_no:03d}", self.work, self.srv.url, str(self.model), prompts,
                                self.cfg.concurrency, self.cfg.output_tokens, self.cfg.rate, self.cfg.tail_tokens)
        self.round_no += 1

    def collect(self) -> None:
        b, self.bench = self.bench, None
        res = b.result()
        self.results.append(res)
        inflight, outside = attribute_failures(res, self.kills)
        self.rep.failed_inflight += inflight
        self.rep.failed_outside += outside
        self.rep.requests += res.requests
        if not res.note:
            self.checked.extend(p for p, e in zip(b.prompts, res.errors) if not e)
        self.rep.rounds.append({"name": res.name, "requests": res.requests, "failed": res.failed,
                                "failed_inflight_at_kill": inflight, "failed_outside": outside,
                                "start_s": round(res.started - self.t0, 1), "end_s": round(res.ended - self.t0, 1),
                                "exit": res.returncode, "note": res.note,
                                "errors": sorted({e[:160] for e in res.errors if e})[:5]})
        logger.info("soak: %s: %d requests, %d failed (%d in flight at a kill)", res.name, res.requests, res.failed,
                    inflight)

    @staticmethod
    def successes(m: dict) -> float:
        return sum(v for (name, _), v in m.items() if name == "vllm:request_success_total")

    def keep_loaded(self, seconds: float) -> None:
        """Run the load for `seconds`: a finished round is followed by the next one at once."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if self.bench is None or self.bench.done():
                self.next_round()
            time.sleep(0.5)

    def wait_requests(self, n: int, timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.successes(self.metrics()) >= n:
                return
            if self.bench is None or self.bench.done():
                self.next_round()
            time.sleep(0.5)
        raise RuntimeError(f"fewer than {n} requests completed in {timeout:.0f} s")

    def round_tail(self, timeout: float = 900) -> None:
        """Until every request of the current round has reached the server and some are still running: a kill
        then leaves no request of the round unsent (failures are all in flight)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.bench is None or self.bench.done():
                self.next_round(10.0)  # the round ended before the kill was due: a short one to reach a tail
            m = self.metrics()
            inflight = sum(v for (name, _), v in m.items()
                           if name in ("vllm:num_requests_running", "vllm:num_requests_waiting"))
            done = self.successes(m) - self.round_base - self.side_requests
            total = self.bench.requests + 1  # + its ready-check request
            if inflight > 0 and done + inflight >= total and done < total:
                return
            time.sleep(0.05)
        raise RuntimeError("no round tail within the timeout")

    # ------------------------------------------------------------------ greedy check
    def completion(self, srv: ServeProcess, prompt: str) -> list[int]:
        r = http_post(srv.url + "/v1/completions", {
            "model": str(self.model), "prompt": prompt, "max_tokens": self.cfg.output_tokens, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}, timeout=300)
        return list(r["choices"][0]["token_ids"])

    def greedy_check(self, rec: FaultRecord) -> None:
        """A few prompts the server has answered before (their KV is in some tier), greedy, on both servers."""
        pool = list(self.checked)
        if self.bench is not None:  # requests go out in order: all but the last `concurrency` sent are done
            done = self.successes(self.metrics()) - self.round_base - self.side_requests - 1
            pool += self.bench.prompts[:max(0, int(done) - self.cfg.concurrency)]
        pool = [p for p in pool if p.turn > 1] or pool
        for p in self.rng.sample(pool, min(self.cfg.greedy_per_check, len(pool))):
            self.side_requests += 1
            got = self.completion(self.srv, p.text)
            want = self.completion(self.ref, p.text)
            rec.greedy_checked += 1
            self.rep.greedy_checked += 1
            if got != want:
                rec.greedy_mismatches += 1
                self.rep.greedy_mismatches += 1
                self.rep.mismatch_examples.append({"fault": rec.name, "conv": p.conv, "turn": p.turn,
                                                   "kvtier": got, "reference": want})

    # ------------------------------------------------------------------ faults
    def log_mark(self) -> tuple[int, int]:
        return self.life, self.srv.log_path.stat().st_size

    def log_since(self, mark: tuple[int, int]) -> str:
        life, off = mark
        text = ""
        for i in range(life, self.life + 1):
            path = self.work / f"kvtier-life{i}.log"
            data = path.read_bytes() if path.exists() else b""
            text += data[off if i == life else 0:].decode(errors="replace")
        return text

    def restart(self, rec: FaultRecord, kill: bool, flip: bool) -> None:
        """Stop (SIGKILL of the group at a round's tail, or SIGINT between rounds), flip a journal byte if asked,
        start again on the same SSD directory; the next round starts with the server."""
        old = self.srv
        if kill:
            self.round_tail()
            rec.injected = self.now()
            self.stopping.set()
            self.kills.append(time.monotonic())
            faults.kill_group(old.proc.pid)
            old.proc.wait(30)
            old.stop()  # closes its log; the session is gone already
            self.collect()
        else:
            if self.bench is not None:
                self.collect()
            rec.injected = self.now()
            self.stopping.set()
            rec.details["stop_exit"] = old.stop()
        rec.details["leftover_processes"] = len(faults.group_pids(old.proc.pid))
        if flip:
            try:
                rec.details["flip"] = asdict(faults.flip_journal_byte(self.ssd_dir, self.cfg.seed + self.life))
            except FileNotFoundError as e:
                rec.status, rec.reason = "FAILED", str(e)
        t = time.monotonic()
        srv = self.start_server()
        # the client imports vLLM while the server starts, then waits for /health itself
        self.next_round(self.cfg.gap_s + 5.0 + self.plan_s(self.pos + 1, self.last_cycle()))
        srv.wait_ready(time.monotonic() + self.cfg.start_timeout_s)
        rec.server_back_s = time.monotonic() - t
        rec.cleared = self.now()

    def inject(self, name: str, rec: FaultRecord) -> None:
        cfg = self.cfg
        if name == "enospc":
            if not self.disk.mounted:
                rec.status, rec.reason = "SKIPPED", self.mount_error or "not mounted"
                return
            rec.injected = self.now()
            rec.details["filler_bytes"] = self.disk.fill()
            rec.details["free_after_fill"] = self.disk.free_bytes()
            self.keep_loaded(cfg.enospc_s)
            self.disk.free()
            rec.cleared = self.now()
        elif name == "redis":
            rec.injected = self.now()
            self.redis.kill()
            self.keep_loaded(cfg.redis_down_s)
            self.redis.start()
            rec.cleared = self.now()
        elif name in ("kill", "journal", "kill+journal"):
            self.restart(rec, kill="kill" in name, flip="journal" in name)
        else:
            raise ValueError(f"unknown fault {name!r}")

    def run_fault(self, name: str, before: dict[str, float]) -> dict[str, float]:
        """Inject one fault, keep the load on for `gap_s` after it clears; returns the hits of that window (the
        next fault's "before"). `before`: the hits of the window before this one."""
        rec = FaultRecord(name, life_before=self.life, hits_before=dict(before))
        self.rep.faults.append(rec)
        mark = self.log_mark()
        self.inject(name, rec)
        rec.life_after = self.life
        if rec.status != "done":
            logger.warning("soak: fault %s %s: %s", name, rec.status, rec.reason)
            return before
        start = self.hits(self.metrics()) if rec.life_after == rec.life_before else {t: 0.0 for t in TIERS}
        self.keep_loaded(self.cfg.gap_s)
        deadline = time.monotonic() + self.cfg.comeback_s
        while (any(h <= start[t] for t, h in self.hits(self.metrics()).items() if t in start)
               and time.monotonic() < deadline):
            self.keep_loaded(5.0)
        self.greedy_check(rec)
        after = self.hits(self.metrics())
        rec.hits_after = {t: after[t] - start[t] for t in TIERS}
        kinds = count_episodes(self.log_since(mark), name.split("+")[-1])
        if name == "kill+journal":
            kinds.update(count_episodes(self.log_since(mark), "kill"))
        rec.episodes = kinds
        logger.info("soak: fault %s cleared at %.0f s; hits after %s; episodes %s", name, rec.cleared,
                    rec.hits_after, kinds)
        return rec.hits_after

    # ------------------------------------------------------------------ the run
    def run(self) -> SoakReport:
        from kvtier.demo_data import path as data_path

        cfg = self.cfg
        self.trace = data_path("mooncake_conversation_sessions.jsonl")
        sampler = threading.Thread(target=self._sampler, name="soak-sampler", daemon=True)
        try:
            if cfg.mount:
                self.mount_error = self.disk.mount()
                if self.mount_error:
                    logger.warning("soak: the ENOSPC fault will be SKIPPED: %s", self.mount_error)
            self.redis.start()
            self.yaml = self._yaml()
            self.port = free_port(cfg.port_lo)
            self.ref = ServeProcess("reference", self.work, self.model, free_port(cfg.port_lo), self.vllm_args())
            srv = self.start_server()
            self.pos = -1
            self.next_round(self.plan_s(0, self.last_cycle()) + cfg.warmup_requests / cfg.rate + 30.0)
            deadline = time.monotonic() + cfg.start_timeout_s
            srv.wait_ready(deadline)
            sampler.start()
            self.ref.wait_ready(deadline)
            self.wait_requests(cfg.warmup_requests, cfg.start_timeout_s)
            window = self.hits(self.metrics())  # the warm-up's hits: the first fault's "before"
            cycle = 0
            while cycle == 0 or self.now() < cfg.minutes * 60:
                for self.pos, name in enumerate(cfg.schedule):
                    window = self.run_fault(name, window)
                cycle += 1
            if self.bench is not None:
                self.collect()  # the last round runs to its end
        finally:
            self.stop_sampling.set()
            if sampler.is_alive():
                sampler.join(10)
            if self.bench is not None:
                self.bench.stop()
            for s in (self.srv, self.ref):
                if s is not None:
                    s.stop()
            self.redis.stop()
            self.disk.unmount()
        return self.finish()

    def finish(self) -> SoakReport:
        rep = self.rep
        rep.wall_s = self.now()
        rep.slopes = lifetime_slopes(rep.samples, self.cfg.rss_warmup_s)
        logs = "".join(p.read_text(errors="replace") for p in sorted(self.work.glob("kvtier-life*.log")))
        for fault in EPISODES:  # episode messages outside every fault's own log segment
            for kind, (starts, clears) in count_episodes(logs, fault).items():
                seen = [f.episodes.get(kind, [0, 0]) for f in rep.faults]
                extra = starts + clears - sum(a + b for a, b in seen)
                if extra:
                    rep.stray_episodes[kind] = extra
        if self.mount_error and self.cfg.mount:
            rep.notes.append(f"ENOSPC fault SKIPPED: {self.mount_error}")
        print_report(rep)
        if self.cfg.json_path:
            write_json(rep, self.cfg.json_path)
        if self.cfg.plot_path:
            rep.notes.append(plot(rep, self.cfg.plot_path))
            print(rep.notes[-1])
        if self.cfg.json_path:
            write_json(rep, self.cfg.json_path)
        return rep


def run_soak(cfg: SoakConfig) -> SoakReport:
    return Soak(cfg).run()

