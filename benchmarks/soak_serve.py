"""A fault-injection soak of `vllm serve` with kvtier (issue 28): 20 minutes or more of multi-turn load with faults.

    sudo .venv/bin/python benchmarks/soak_serve.py [--minutes 20] [--workdir DIR] [--json soak.json --plot soak.png]

The demo model under `kvtier serve` with kvtier's connector (a generated LMCache YAML from
`configs/lmcache-kvtier-redis.yaml`: a small host tier, an SSD tier that evicts all the time on its own small tmpfs,
a real `redis-server` as the shared tier with `writes: all` and `on_unavailable: degrade`) and `--scheduler-cls
kvtier.scheduler_hooks.DualQueueScheduler`, plus a plain vLLM server of the same model as the greedy reference.
The load: `vllm bench serve` (from the same environment) at concurrency 8, cumulative multi-turn prompts built from
the shipped Mooncake sessions, in successive client rounds. Faults on a repeating schedule (`--schedule`):

- `enospc`: the SSD tier's file system filled to ENOSPC for `--enospc-s` seconds, then freed (mounting a tmpfs
  needs root: without it the fault is reported SKIPPED with the reason);
- `redis`: the shared tier's Redis killed, restarted empty on the same port after `--redis-down-s`;
- `kill`: SIGKILL of the server's process group at the tail of a client round, restart on the same SSD directory;
- `journal`: the server stopped, one byte of its SSD journal flipped at a seeded offset, started again.

Reported (printed table, `--json`, `--plot`): requests failed outside those in flight at a kill (target 0), greedy
mismatches against the reference (target 0), RSS and fds of the server's process group over time with a
least-squares slope per server lifetime, the SSD tier's used bytes and slot files against its capacity at every
sample, hits per tier before and after each fault, and each fault's episode messages in the server log (kvtier logs
a recurring condition once when it starts and once when it clears). The code is `kvtier.testing.soak`;
`tests/test_soak_serve.py` runs it on a 2-3 minute schedule. Exit status 1 if a target is missed.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from kvtier.testing.soak import SoakConfig, run_soak


def main(argv: list[str] | None = None) -> int:
    d = SoakConfig(workdir=Path("."))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=20.0, help="run fault cycles until this much time has passed")
    p.add_argument("--schedule", default=",".join(d.schedule),
                   help="one cycle of faults: enospc, redis, kill, journal, kill+journal")
    p.add_argument("--gap-s", type=float, default=d.gap_s, help="load after each fault before the next one")
    p.add_argument("--enospc-s", type=float, default=d.enospc_s)
    p.add_argument("--redis-down-s", type=float, default=d.redis_down_s)
    p.add_argument("--rate", type=float, default=d.rate, help="requests/s of the client (at most 8 in flight)")
    p.add_argument("--round-s", type=float, default=d.round_s, help="the longest client round")
    p.add_argument("--conversations", type=int, default=d.conversations, help="conversations per pass")
    p.add_argument("--host-mb", type=float, default=d.host_mb)
    p.add_argument("--ssd-mb", type=float, default=d.ssd_mb)
    p.add_argument("--sample-s", type=float, default=d.sample_s)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--port", type=int, default=d.port_lo, help="first port to try")
    p.add_argument("--no-mount", action="store_true", help="do not mount a tmpfs (the ENOSPC fault is SKIPPED)")
    p.add_argument("--workdir", default=None, help="keep logs, client results and the SSD tier here")
    p.add_argument("--json", default="soak-serve.json")
    p.add_argument("--plot", default="soak-serve.png")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # servers and mounts go in run_soak's finally
    own = args.workdir is None
    work = Path(tempfile.mkdtemp(prefix="kvtier-soak-") if own else args.workdir)
    cfg = SoakConfig(workdir=work, minutes=args.minutes, schedule=tuple(s for s in args.schedule.split(",") if s),
                     gap_s=args.gap_s, enospc_s=args.enospc_s, redis_down_s=args.redis_down_s, rate=args.rate,
                     round_s=args.round_s, conversations=args.conversations, host_mb=args.host_mb,
                     ssd_mb=args.ssd_mb, sample_s=args.sample_s, seed=args.seed, port_lo=args.port,
                     mount=not args.no_mount, json_path=Path(args.json).resolve() if args.json else None,
                     plot_path=Path(args.plot).resolve() if args.plot else None)
    rep = run_soak(cfg)
    if own:
        shutil.rmtree(work, ignore_errors=True)
    missed = rep.failed_outside or rep.greedy_mismatches or rep.ssd_over_capacity
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
