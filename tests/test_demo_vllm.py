"""`kvtier demo-vllm` (the main job) end to end with its smallest settings: real vLLM on CPU, four times.

Runs the installed `kvtier` command from a scratch directory (never with the repository root on sys.path) and
checks what the demo prints: it exits 0, kvtier serves part of the follow-up turns' history (host or SSD tier),
both runs generate identical tokens, the LMCache note is there and the plot is written; the third column (vLLM +
LMCache's multiprocess server with its `fs` L2 adapter) generates the same tokens and reuses history too; the
ideal column (vLLM alone with room for everything) is printed, its reuse equals the limit kvtier's connector
accounts against, and the lost hits by reason add up to the difference.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.testing.serve_process import lane_port

pytest.importorskip("vllm")
pytest.importorskip("matplotlib")

pytestmark = pytest.mark.slow


def test_demo_vllm_smallest(tmp_path):
    kvtier = Path(sys.executable).with_name("kvtier")
    assert kvtier.exists(), f"the kvtier command is not installed next to {sys.executable}"
    plot = tmp_path / "demo.png"
    env = dict(os.environ, LMCACHE_TRACK_USAGE="false")
    p = subprocess.run([str(kvtier), "demo-vllm", "--conversations", "2", "--turns", "2", "--plot", str(plot),
                        "--timeout", "200", "--mp-port", str(lane_port(15571)),
                        "--mp-http-port", str(lane_port(18571))], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=700)
    out = p.stdout
    assert p.returncode == 0, f"rc {p.returncode}\n{out[-6000:]}\n{p.stderr[-3000:]}"
    # per-turn table: kvtier serves history from turn 2 on
    turn2 = re.search(r"^\s+2\s+[\d.]+ /\s+[\d.]+\s+[\d.]+ /\s+[\d.]+\s+\S+\s+(\d+)\s*$", out, re.M)
    assert turn2 and int(turn2.group(1)) > 0, out
    summary = re.search(r"^vLLM \+ kvtier\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s", out, re.M)
    assert summary and int(summary.group(3)) + int(summary.group(4)) > 0, out
    assert "generated tokens: identical in both runs" in out, out
    assert "No supported cpu connector found" in out
    assert "kvtier vs none" in out
    assert "LMCache MP generated tokens: identical to the run without a connector (4 requests)" in out, out
    mp_turn2 = re.search(r"^\s+2(?:\s+[\d.]+ /\s+[\d.]+){3}\s+(\d+)\s+\S+\s*$", out, re.M)
    assert mp_turn2 and int(mp_turn2.group(1)) > 0, out
    # the limit (issue 52): the ideal run, kvtier's share of the gain, and the ledger's account of the shortfall
    assert re.search(r"^TTFT mean\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+(-?[\d.]+|nan)$", out, re.M), out
    assert "ideal run generated tokens: identical to vLLM alone's (4 requests)" in out, out
    ledger = re.search(r"the limit reuses (\d+) tokens \(the ideal run: (\d+)\), kvtier (\d+)", out)
    assert ledger, out
    # the connector's limit is the ideal engine's real reuse, and its reasons add up to the shortfall
    assert ledger.group(1) == ledger.group(2), ledger.group(0)
    assert re.search(r"lost - past the limit = (\d+), the limit's hits - kvtier's = \1 \(equal\)", out), out
    assert plot.exists() and plot.stat().st_size > 0
    # the progress bars went to stderr
    assert "vLLM + kvtier" in p.stderr


def test_an_engine_run_leaves_no_process_behind(tmp_path):
    """What the demos and the tests' engine runner do with an engine process (`end_process_group`) also ends what
    it started: vLLM's engine core runs in a process of its own, and killing only the child left it running (seen
    after a start timeout)."""
    import time

    from kvtier.launch.vllm_process import end_process_group

    pid_file = tmp_path / "grandchild.pid"
    code = ("import subprocess, sys, time\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
            f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
            "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    deadline = time.monotonic() + 60
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    grandchild = int(pid_file.read_text())
    end_process_group(proc)
    assert proc.returncode is not None
    for _ in range(100):  # the grandchild is reparented and reaped once killed
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{grandchild}/stat") as f:
            if f.read().split(")")[-1].split()[0] == "Z":  # a zombie: dead, not yet reaped
                break
        time.sleep(0.05)
    else:
        os.kill(grandchild, 9)
        raise AssertionError("the engine's own child outlived it")


def _run_result(name: str, ttfts: dict[tuple[int, int], float]):
    from kvtier.cli.demo_vllm_engine import RunResult

    reqs = [{"conv": c, "turn": t, "ttft": v, "prompt_len": 100, "gpu_hit": 0, "host_hit": 0, "ssd_hit": 0,
             "tokens": [1, 2]} for (c, t), v in ttfts.items()]
    return RunResult(name, reqs, wall_s=10.0)


def test_demo_says_slower_when_kvtier_is_slower(capsys):
    """The summary line names the direction: a run where kvtier's follow-ups are slower says "slower", never
    "0.54x faster"; `--repeat` prints the spread over runs and counts the runs that were slower."""
    from kvtier.cli.conversations import Turn
    from kvtier.cli.demo_vllm_report import FollowUps, print_spread, report

    turns = [Turn(c, c, t, 0, [], 2, 0) for c in range(2) for t in (1, 2, 3)]
    base = _run_result("vLLM, no connector", {(c, t): 0.2 for c in range(2) for t in (1, 2, 3)})
    fast = _run_result("vLLM + kvtier", {(c, t): (0.2 if t == 1 else 0.05) for c in range(2) for t in (1, 2, 3)})
    slow = _run_result("vLLM + kvtier", {(c, t): (0.2 if t == 1 else 0.05) for c in range(2) for t in (1, 2, 3)})
    slow.requests[4]["ttft"] = 3.0  # conversation 1 turn 2 stalls
    assert report(base, slow, turns, None, full=False) == 0
    out = capsys.readouterr().out
    assert "TTFT of follow-up turns 3.94x slower on average" in out, out
    assert "generated tokens: identical in both runs" in out
    report(base, fast, turns, None, full=False)
    assert "TTFT of follow-up turns 4.00x faster on average" in capsys.readouterr().out
    runs = [FollowUps.of(base, fast), FollowUps.of(base, slow), FollowUps.of(base, fast)]
    assert runs[1].slowest_kvtier_turn == (1, 2) and runs[1].slowest_kvtier_s == 3.0
    print_spread(runs)
    out = capsys.readouterr().out
    assert "mean TTFT speed-up (vLLM alone / kvtier): 0.25x / 4.00x / 4.00x" in out, out
    assert "slowest follow-up, vLLM + kvtier:         50 / 50 / 3000 ms" in out, out
    assert "kvtier slower on average in 1 of 3 runs; its slowest follow-up slower than vLLM alone's slowest in 1 " \
           "of 3 runs" in out, out


def test_eviction_policy_reaches_both_tiers_of_the_demos_yaml(tmp_path, capsys):
    """`--eviction-policy NAME` sets the host tier's cache_policy (KVTIER_<NAME>) and the SSD tier's
    kvtier.eviction_policy in the YAML the demo's engine loads, as check-config reads them; without it the shipped
    YAML's LRU stays; an unknown name stops the demo before anything starts."""
    from kvtier.cli import main
    from kvtier.cli.check_config import check
    from kvtier.cli.demo_vllm import _lmcache_yaml

    for policy, host, ssd in ((None, "LRU", "lru"), ("adaptive", "KVTIER_ADAPTIVE", "adaptive"),
                              ("answer-length", "KVTIER_ANSWER_LENGTH", "answer-length")):
        path = tmp_path / f"{policy}.yaml"
        _lmcache_yaml(path, 64, 8, str(tmp_path / "ssd"), 64, policy)
        said = check(str(path))
        assert f"(cache_policy {host})" in said and f"eviction={ssd})" in said, said
    assert main(["demo-vllm", "--eviction-policy", "nope"]) == 2
    out = capsys.readouterr().out
    assert out.startswith("--eviction-policy 'nope': choose one of ") and "adaptive" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["None.yaml", "adaptive.yaml", "answer-length.yaml", "ssd"]


def test_ideal_column_share_and_lost_hits(capsys):
    """The limit's column: the share of the achievable gain per statistic and over `--repeat` runs, each side's
    hit tokens, and the ledger's breakdown checked against kvtier's recorded hits (a mismatch says DIFFERENT)."""
    from kvtier.cli.conversations import Turn
    from kvtier.cli.demo_vllm_report import FollowUps, print_spread, report_ideal, report_lost_hits

    turns = [Turn(c, c, t, 0, [], 2, 0) for c in range(2) for t in (1, 2)]
    base = _run_result("vLLM, no connector", {(c, t): 0.5 for c in range(2) for t in (1, 2)})
    kvt = _run_result("vLLM + kvtier", {(c, t): (0.5 if t == 1 else 0.14) for c in range(2) for t in (1, 2)})
    ideal = _run_result("vLLM, room for all", {(c, t): (0.5 if t == 1 else 0.1) for c in range(2) for t in (1, 2)})
    for r in ideal.requests:
        r["gpu_hit"] = 96 if r["turn"] == 2 else 0
    for r in kvt.requests:
        if r["turn"] == 2:
            r["host_hit"] = 64
            r["lost"] = {"ideal": 96, "hit": 64, "recomputed": 0, "save_in_flight": 0, "not_saved": 0,
                         "evicted": 0, "not_found": 32, "beyond_ideal": 0}
    assert report_ideal(base, kvt, ideal, turns) == 0
    out = capsys.readouterr().out
    assert re.search(r"^TTFT mean\s+500\.0\s+140\.0\s+100\.0\s+0\.90$", out, re.M), out
    assert re.search(r"^hit tokens\s+0\s+128\s+192\b", out, re.M), out
    report_lost_hits(kvt, ideal)
    out = capsys.readouterr().out
    assert "the limit reuses 192 tokens (the ideal run: 192), kvtier 128; lost 64" in out, out
    assert "not found 64" in out and "(equal); against the ideal run's hits: 64" in out, out
    kvt.requests[1]["lost"] = dict(kvt.requests[1]["lost"], hit=32, not_found=64)  # disagrees with host_hit
    report_lost_hits(kvt, None)
    assert "DIFFERENT" in capsys.readouterr().out
    run = FollowUps.of(base, kvt, ideal)
    assert run.share_mean == pytest.approx(0.9) and run.share_p50 == pytest.approx(0.9)
    print_spread([run, FollowUps.of(base, kvt, ideal)])
    assert re.search(r"share of the achievable gain, mean TTFT:\s+0\.90 / 0\.90 / 0\.90", capsys.readouterr().out)
    ideal.requests[3]["tokens"] = [9]
    assert report_ideal(base, kvt, ideal, turns) == 1  # the ideal run must generate vLLM alone's tokens
