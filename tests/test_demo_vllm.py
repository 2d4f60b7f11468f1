"""`kvtier demo-vllm` (the main job) end to end with its smallest settings: real vLLM on CPU, three times.

Runs the installed `kvtier` command from a scratch directory (never with the repository root on sys.path) and
checks what the demo prints: it exits 0, kvtier serves part of the follow-up turns' history (host or SSD tier),
both runs generate identical tokens, the LMCache note is there and the plot is written; the third column (vLLM +
LMCache's multiprocess server with its `fs` L2 adapter) generates the same tokens and reuses history too.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("matplotlib")

pytestmark = pytest.mark.slow


def test_demo_vllm_smallest(tmp_path):
    kvtier = Path(sys.executable).with_name("kvtier")
    assert kvtier.exists(), f"the kvtier command is not installed next to {sys.executable}"
    plot = tmp_path / "demo.png"
    env = dict(os.environ, LMCACHE_TRACK_USAGE="false")
    p = subprocess.run([str(kvtier), "demo-vllm", "--conversations", "2", "--turns", "2", "--plot", str(plot),
                        "--timeout", "200", "--mp-port", "15571", "--mp-http-port", "18571"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=700)
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
    assert plot.exists() and plot.stat().st_size > 0
    # the progress bars went to stderr
    assert "vLLM + kvtier" in p.stderr


def test_an_engine_run_leaves_no_process_behind(tmp_path):
    """What the demos and the tests' engine runner do with an engine process (`end_process_group`) also ends what
    it started: vLLM's engine core runs in a process of its own, and killing only the child left it running (seen
    after a start timeout)."""
    import time

    from kvtier.tools.vllm_engine import end_process_group

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
