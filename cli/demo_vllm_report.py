"""What `kvtier demo-vllm` prints and plots: the per-request and per-turn tables, the summary, the generated-tokens
check, the LMCache MP column, the spread over `--repeat` runs, and the TTFT plot."""

from __future__ import annotations

import argparse
import math
import os
import statistics
from dataclasses import dataclass

from kvtier.cli.conversations import Turn
from kvtier.cli.demo_vllm_engine import RunResult
from kvtier.telemetry.lost_hits import REASONS

LMCACHE_CPU_NOTE = (
    "LMCache's in-process connector (LMCacheConnectorV1) is not compared here: it does not run on vLLM's CPU build "
    "(its worker logs \"No supported cpu connector found\" and vLLM silently continues with zero hits), so that "
    "column is absent on CPU.")


def quantile(xs: list[float], q: float) -> float:
    """The `q` quantile (0-1) of `xs`, interpolated between closest ranks; NaN when empty."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def ratio(a: float, b: float) -> str:
    if not b or math.isnan(a) or math.isnan(b):
        return "n/a"
    return f"{a / b:.2f}x"


def _faster(base: float, other: float) -> str:
    """`other` against `base` (both times) in words: "2.10x faster" or "1.85x slower"."""
    if not base or not other or math.isnan(base) or math.isnan(other):
        return "n/a"
    return f"{base / other:.2f}x faster" if other <= base else f"{other / base:.2f}x slower"


@dataclass(frozen=True)
class FollowUps:
    """One run's follow-up turns (turn >= 2), vLLM alone against vLLM + kvtier."""

    speedup_mean: float  #: mean TTFT without kvtier / mean TTFT with it (> 1: kvtier faster)
    speedup_median: float
    slowest_base_s: float  #: the slowest follow-up turn's TTFT without kvtier
    slowest_kvtier_s: float
    slowest_kvtier_turn: tuple[int, int]  #: (conversation, turn) of kvtier's slowest follow-up
    #: kvtier's share of the achievable gain in mean / median / p99 follow-up TTFT (NaN: no ideal run)
    share_mean: float = float("nan")
    share_p50: float = float("nan")
    share_p99: float = float("nan")

    @classmethod
    def of(cls, base: RunResult, kvt: RunResult, ideal: RunResult | None = None) -> FollowUps:
        b, k = base.ttft(2), kvt.ttft(2)
        worst = max((r for r in kvt.requests if r["turn"] >= 2), key=lambda r: r["ttft"])
        shares = [float("nan")] * 3
        if ideal is not None:
            i = ideal.ttft(2)
            shares = [share_of_gain(f(b), f(k), f(i)) for f in (statistics.mean, _p50, _p99)]
        return cls(statistics.mean(b) / statistics.mean(k), quantile(b, 0.5) / quantile(k, 0.5), max(b), max(k),
                   (worst["conv"], worst["turn"]), *shares)


def _p50(xs: list[float]) -> float:
    return quantile(xs, 0.5)


def _p99(xs: list[float]) -> float:
    return quantile(xs, 0.99)


def share_of_gain(alone: float, kvtier: float, ideal: float) -> float:
    """kvtier's share of the achievable gain: (alone - kvtier) / (alone - ideal), 1 = at the limit, 0 = no gain,
    negative = slower than vLLM alone; NaN when the limit gains nothing over vLLM alone."""
    if any(math.isnan(x) for x in (alone, kvtier, ideal)) or alone - ideal <= 0:
        return float("nan")
    return (alone - kvtier) / (alone - ideal)


def print_spread(runs: list[FollowUps]) -> None:
    """The repeated comparison: min / median / max over runs."""
    def mmm(xs: list[float], fmt: str) -> str:
        return " / ".join(fmt.format(x) for x in (min(xs), statistics.median(xs), max(xs)))

    n = len(runs)
    print(f"\nrepeated {n} times (fresh engines and SSD tier each run): follow-up turns (turn >= 2), "
          "min / median / max over runs")
    print(f"  mean TTFT speed-up (vLLM alone / kvtier): {mmm([r.speedup_mean for r in runs], '{:.2f}x')}")
    print(f"  median TTFT speed-up:                     {mmm([r.speedup_median for r in runs], '{:.2f}x')}")
    print(f"  slowest follow-up, vLLM alone:            "
          f"{mmm([1000 * r.slowest_base_s for r in runs], '{:.0f}')} ms")
    print(f"  slowest follow-up, vLLM + kvtier:         "
          f"{mmm([1000 * r.slowest_kvtier_s for r in runs], '{:.0f}')} ms")
    for i, r in enumerate(runs, 1):
        print(f"  run {i:>2}: mean {_faster(1.0, 1.0 / r.speedup_mean)}, median "
              f"{_faster(1.0, 1.0 / r.speedup_median)}; slowest follow-up {1000 * r.slowest_base_s:.0f} ms alone, "
              f"{1000 * r.slowest_kvtier_s:.0f} ms with kvtier (conversation {r.slowest_kvtier_turn[0]} turn "
              f"{r.slowest_kvtier_turn[1]})")
    if not any(math.isnan(r.share_mean) for r in runs):
        for name, xs in (("mean", [r.share_mean for r in runs]), ("p50", [r.share_p50 for r in runs]),
                         ("p99", [r.share_p99 for r in runs])):
            print(f"  share of the achievable gain, {name + ' TTFT:':<10}    {mmm(xs, '{:.2f}')}")
    slower = sum(1 for r in runs if r.speedup_mean < 1)
    worse_tail = sum(1 for r in runs if r.slowest_kvtier_s > r.slowest_base_s)
    print(f"  kvtier slower on average in {slower} of {n} runs; its slowest follow-up slower than vLLM alone's "
          f"slowest in {worse_tail} of {n} runs")


def report_lmcache_mp(base: RunResult, kvt: RunResult, mp: RunResult, turns: list[Turn]) -> int:
    """The third column: vLLM + LMCache MP (`fs` L2), against the same turns of the two other runs."""
    key = lambda r: (r["conv"], r["turn"])  # noqa: E731
    b_by, m_by = {key(r): r for r in base.requests}, {key(r): r for r in mp.requests}
    print("\nvLLM + LMCache MP (LMCache's `fs` L2 adapter), the same conversations: TTFT per turn (ms; mean / "
          "median) and cached prompt tokens (vLLM's prefix cache + LMCache)")
    head = (f"{'turn':>4} {'no connector':>16} {'kvtier':>16} {'LMCache MP (fs)':>16} {'MP cached':>10} "
            f"{'kvtier speed-up':>16}")
    print(head)
    print("-" * len(head))
    for n in range(1, max(t.turn for t in turns) + 1):
        bt, kt, mt = base.ttft(n, n), kvt.ttft(n, n), mp.ttft(n, n)
        cached = sum(r.get("cached", 0) for r in mp.requests if r["turn"] == n)
        print(f"{n:>4} {1000 * statistics.mean(bt):>8.1f} / {1000 * statistics.median(bt):>5.1f} "
              f"{1000 * statistics.mean(kt):>8.1f} / {1000 * statistics.median(kt):>5.1f} "
              f"{1000 * statistics.mean(mt):>8.1f} / {1000 * statistics.median(mt):>5.1f} {cached:>10} "
              f"{ratio(statistics.mean(mt), statistics.mean(kt)):>16}")
    c = mp.raw.get("lmcache_mp", {})
    ext = sum(v for k, v in c.items() if k.startswith("vllm_external"))
    l1, l2 = int(c.get("lmcache_mp_lookup_hit_l1_keys_total", 0)), int(c.get("lmcache_mp_lookup_hit_l2_keys_total", 0))
    print(f"LMCache MP hits (the replay, warm-up excluded): vLLM prefix cache {int(c.get('vllm_device', 0))} tokens, "
          f"from LMCache {int(ext)} tokens; the server's lookups found {l1} chunks in L1 and loaded {l2} from the "
          f"`fs` L2, which stored {int(c.get('lmcache_mp_l2_store_completed_objects_chunks_total', 0))}")
    later_k, later_m = kvt.ttft(2), mp.ttft(2)
    if later_k and later_m:
        print(f"TTFT of follow-up turns: kvtier {_faster(statistics.mean(later_m), statistics.mean(later_k))} "
              f"than LMCache MP (fs) on average ({_faster(quantile(later_m, 0.5), quantile(later_k, 0.5))} at the "
              "median)")
    diff = [k for k in b_by if b_by[k]["tokens"] != m_by[k]["tokens"]]
    if diff:
        print(f"LMCache MP generated tokens: DIFFERENT from the run without a connector in {len(diff)} of "
              f"{len(turns)} requests (first: conversation {diff[0][0]} turn {diff[0][1]})")
        return 1
    print(f"LMCache MP generated tokens: identical to the run without a connector ({len(turns)} requests)")
    return 0


def report_ideal(base: RunResult, kvt: RunResult, ideal: RunResult, turns: list[Turn]) -> int:
    """The limit's column: follow-up TTFT of vLLM alone, kvtier and the ideal engine, kvtier's share of the
    achievable gain, each side's hit tokens, and kvtier's lost hits by reason (its connector's ledger). Returns 1
    if the ideal run generated other tokens than vLLM alone."""
    b, k, i = base.ttft(2), kvt.ttft(2), ideal.ttft(2)
    print("\nthe limit: vLLM alone with room for every conversation (column 'ideal'), the same requests; follow-up "
          "turns (turn >= 2), TTFT in ms")
    head = f"{'':<18}{'vLLM alone':>11}{'kvtier':>9}{'ideal':>9}   share of the achievable gain"
    print(head)
    print("-" * len(head))
    for name, f in (("TTFT mean", statistics.mean), ("TTFT p50", _p50), ("TTFT p99", _p99)):
        print(f"{name:<18}{1000 * f(b):>11.1f}{1000 * f(k):>9.1f}{1000 * f(i):>9.1f}   "
              f"{share_of_gain(f(b), f(k), f(i)):.2f}")
    hits = [sum(r["gpu_hit"] + r["host_hit"] + r["ssd_hit"] for r in x.requests if r["turn"] >= 2)
            for x in (base, kvt, ideal)]
    print(f"{'hit tokens':<18}{hits[0]:>11}{hits[1]:>9}{hits[2]:>9}   (vLLM's prefix cache + kvtier's tiers)")
    b_by = {(r["conv"], r["turn"]): r["tokens"] for r in base.requests}
    diff = [(r["conv"], r["turn"]) for r in ideal.requests if r["tokens"] != b_by[(r["conv"], r["turn"])]]
    if diff:
        print(f"ideal run generated tokens: DIFFERENT from vLLM alone's in {len(diff)} of {len(turns)} requests")
        return 1
    print(f"ideal run generated tokens: identical to vLLM alone's ({len(turns)} requests)")
    return 0


def report_lost_hits(kvt: RunResult, ideal: RunResult | None) -> None:
    """kvtier's follow-up turns against the limit, from its connector's lost-hit ledger: what the limit reuses,
    what kvtier did, the difference by reason; with an ideal run, the ledger's limit against that run's hits."""
    follow = [r for r in kvt.requests if r["turn"] >= 2]
    acc = [r["lost"] for r in follow if r.get("lost")]
    if not follow or len(acc) != len(follow):
        print("kvtier's lost hits: not accounted (the connector's ledger did not report every follow-up turn)")
        return
    tot = {key: sum(a[key] for a in acc) for key in acc[0]}
    lost = sum(tot[key] for key in REASONS)
    hit = sum(r["gpu_hit"] + r["host_hit"] + r["ssd_hit"] for r in follow)
    ideal_hits = (sum(r["gpu_hit"] for r in ideal.requests if r["turn"] >= 2) if ideal is not None else None)
    print(f"kvtier's lost hits (its connector's ledger, follow-up turns): the limit reuses {tot['ideal']} tokens "
          f"(the ideal run: {'not run' if ideal_hits is None else ideal_hits}), kvtier {tot['hit']}; lost {lost}: "
          + ", ".join(f"{key.replace('_', ' ')} {tot[key]}" for key in REASONS)
          + f"; past the limit {tot['beyond_ideal']}")
    ok = lost - tot["beyond_ideal"] == tot["ideal"] - tot["hit"] and tot["hit"] == hit
    print(f"  lost - past the limit = {lost - tot['beyond_ideal']}, the limit's hits - kvtier's = "
          f"{tot['ideal'] - tot['hit']} ({'equal' if ok else 'DIFFERENT'})"
          + ("" if ideal_hits is None else f"; against the ideal run's hits: {ideal_hits - hit}"))


def report(base: RunResult, kvt: RunResult, turns: list[Turn], args: argparse.Namespace, full: bool = True) -> int:
    """Prints the comparison (with `full`, the per-request and per-turn tables and the cross-checks too);
    returns 1 if the generated tokens differ."""
    key = lambda r: (r["conv"], r["turn"])  # noqa: E731
    b_by = {key(r): r for r in base.requests}
    k_by = {key(r): r for r in kvt.requests}
    if full:
        _print_tables(base, kvt, turns, b_by, k_by)
    return _print_summary(base, kvt, turns, b_by, k_by, full)


def _print_tables(base: RunResult, kvt: RunResult, turns: list[Turn], b_by: dict, k_by: dict) -> None:
    print("\nper request (arrival order; hits in tokens: GPU = vLLM's own prefix cache, host / SSD = kvtier)")
    head = (f"{'conv':>4} {'turn':>4} {'prompt':>6} | {'TTFT ms':>8} {'GPU hit':>7} | {'TTFT ms':>8} {'GPU hit':>7} "
            f"{'host hit':>8} {'SSD hit':>7} | {'speed-up':>8}")
    print(f"{'':16} | {'vLLM, no connector':^16} | {'vLLM + kvtier':^34} |")
    print(head)
    print("-" * len(head))
    for t in turns:
        b, k = b_by[(t.conv, t.turn)], k_by[(t.conv, t.turn)]
        print(f"{t.conv:>4} {t.turn:>4} {b['prompt_len']:>6} | {1000 * b['ttft']:>8.1f} {b['gpu_hit']:>7} | "
              f"{1000 * k['ttft']:>8.1f} {k['gpu_hit']:>7} {k['host_hit']:>8} {k['ssd_hit']:>7} | "
              f"{b['ttft'] / k['ttft']:>7.2f}x")

    max_turn = max(t.turn for t in turns)
    print("\nTTFT per turn (ms; mean / median over conversations)")
    head = f"{'turn':>4} {'no connector':>16} {'kvtier':>16} {'speed-up (mean)':>16} {'kvtier hits host+SSD':>21}"
    print(head)
    print("-" * len(head))
    for n in range(1, max_turn + 1):
        bt, kt = base.ttft(n, n), kvt.ttft(n, n)
        hits = sum(r["host_hit"] + r["ssd_hit"] for r in kvt.requests if r["turn"] == n)
        print(f"{n:>4} {1000 * statistics.mean(bt):>8.1f} / {1000 * statistics.median(bt):>5.1f} "
              f"{1000 * statistics.mean(kt):>8.1f} / {1000 * statistics.median(kt):>5.1f} "
              f"{ratio(statistics.mean(bt), statistics.mean(kt)):>16} {hits:>21}")


def _print_summary(base: RunResult, kvt: RunResult, turns: list[Turn], b_by: dict, k_by: dict, full: bool) -> int:
    key = lambda r: (r["conv"], r["turn"])  # noqa: E731
    rows = []
    for r in (base, kvt):
        later = r.ttft(2)
        hit = r.hits("gpu_hit") + r.hits("host_hit") + r.hits("ssd_hit")
        prompt = sum(x["prompt_len"] for x in r.requests)
        rows.append({
            "name": r.name, "prompt": prompt, "gpu": r.hits("gpu_hit"), "host": r.hits("host_hit"),
            "ssd": r.hits("ssd_hit"), "hit": hit, "computed": prompt - hit,
            "mean2": statistics.mean(later) if later else float("nan"), "p50_2": quantile(later, 0.5),
            "p90_2": quantile(later, 0.9), "mean1": statistics.mean(r.ttft(1, 1)), "wall": r.wall_s,
            "start": r.start_s})
    print("\nsummary (TTFT of turns >= 2 in ms; wall = the replay, engine start excluded)")
    head = (f"{'run':<20}{'prompt tok':>11}{'GPU hits':>9}{'host hits':>10}{'SSD hits':>9}{'prefilled':>10}"
            f"{'TTFT t1':>8}{'mean':>8}{'p50':>8}{'p90':>8}{'wall s':>8}")
    print(head)
    print("-" * len(head))
    for x in rows:
        print(f"{x['name']:<20}{x['prompt']:>11}{x['gpu']:>9}{x['host']:>10}{x['ssd']:>9}{x['computed']:>10}"
              f"{1000 * x['mean1']:>8.1f}{1000 * x['mean2']:>8.1f}{1000 * x['p50_2']:>8.1f}{1000 * x['p90_2']:>8.1f}"
              f"{x['wall']:>8.1f}")
    a, b = rows
    print(f"{'kvtier vs none':<20}{'':>11}{'':>9}{'':>10}{'':>9}{ratio(b['computed'], a['computed']):>10}"
          f"{'':>8}{ratio(a['mean2'], b['mean2']):>8}{ratio(a['p50_2'], b['p50_2']):>8}"
          f"{ratio(a['p90_2'], b['p90_2']):>8}{ratio(a['wall'], b['wall']):>8}")
    print("(ratio row: prefilled tokens kvtier / none; TTFT and wall time none / kvtier, i.e. kvtier's speed-up)")
    print(f"\nkvtier: TTFT of follow-up turns {_faster(a['mean2'], b['mean2'])} on average "
          f"({_faster(a['p50_2'], b['p50_2'])} at the median); cached prompt tokens {b['hit']} vs {a['hit']} "
          f"({ratio(b['hit'], a['hit'])}), {b['host']} from the host tier and {b['ssd']} from the SSD tier; "
          f"prefilled tokens {b['computed']} vs {a['computed']}; replay wall time {_faster(a['wall'], b['wall'])}.")
    ok = _print_token_check(base, kvt, turns, b_by, k_by)
    if not full:
        return 0 if ok else 1

    # cross-checks
    src = kvt.raw.get("cached_by_source", {})
    vh, vd = int(src.get("host", 0)), int(src.get("disk", 0))
    print(f"vLLM's own counter vllm:prompt_tokens_cached_by_source (kvtier run, warm-up included): host {vh}, "
          f"disk {vd}")
    st = kvt.raw.get("storage", {}).get("ssd", {})
    cnt = kvt.raw.get("counters", {})
    m = kvt.raw.get("metrics", {})
    print(f"kvtier: scheduler {kvt.raw.get('scheduler')}, {cnt.get('prefetches', 0)} SSD prefetches "
          f"({cnt.get('none_answers', 0)} 'not yet' answers while they ran), SSD tier {st.get('hits', 0)} chunk "
          f"hits, {st.get('corrupt', 0)} corrupt, load errors "
          f"{int(m.get('kvtier_connector_load_error_blocks_total', 0))} blocks; {cnt.get('idle_steps', 0)} engine "
          f"steps with nothing to compute ({cnt.get('steps_during_async_loads', 0)} steps while "
          f"{cnt.get('async_loads', 0)} asynchronous loads were in flight)")
    for r in (base, kvt):
        by = {key(x): x for x in r.requests}
        lost = []
        for x in r.requests:
            prev = by.get((x["conv"], x["turn"] - 1))
            if prev is not None and x["gpu_hit"] + x["host_hit"] + x["ssd_hit"] < (prev["prompt_len"] + len(
                    prev["tokens"])) // 2:
                lost.append(f"{x['conv']}/{x['turn']}")
        print(f"{r.name}: {len(lost)} of {sum(1 for x in r.requests if x['turn'] >= 2)} follow-up turns recomputed "
              f"more than half of their history" + (f" (conversation/turn {', '.join(lost[:12])}"
                                                    f"{', ...' if len(lost) > 12 else ''})" if lost else ""))
    print(f"engine start: {base.start_s:.0f} s (no connector), {kvt.start_s:.0f} s (kvtier)")
    print(LMCACHE_CPU_NOTE)
    return 0 if ok else 1


def _print_token_check(base: RunResult, kvt: RunResult, turns: list[Turn], b_by: dict, k_by: dict) -> bool:
    """Whether both runs generated the same tokens for every request (printed either way)."""
    diff = [(t.conv, t.turn) for t in turns if b_by[(t.conv, t.turn)]["tokens"] != k_by[(t.conv, t.turn)]["tokens"]]
    if diff:
        print(f"generated tokens: DIFFERENT in {len(diff)} of {len(turns)} requests (first: conversation "
              f"{diff[0][0]} turn {diff[0][1]})")
        return False
    n_tok = sum(len(r["tokens"]) for r in base.requests)
    print(f"generated tokens: identical in both runs ({len(turns)} requests, {n_tok} tokens, greedy)")
    return True


def plot(base: RunResult, kvt: RunResult, path: str, mp: RunResult | None = None,
         ideal: RunResult | None = None) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot written ({path})")
        return
    fig, ax = plt.subplots(figsize=(7, 4.2))
    runs = [(base, "tab:gray", -0.08), (kvt, "tab:blue", 0.08)] + ([(mp, "tab:orange", 0.0)] if mp else []) + (
        [(ideal, "tab:green", 0.16)] if ideal else [])
    for r, color, dx in runs:
        max_turn = max(x["turn"] for x in r.requests)
        xs = [x["turn"] + dx for x in r.requests]
        ys = [1000 * x["ttft"] for x in r.requests]
        ax.scatter(xs, ys, s=14, alpha=0.45, color=color)
        turns = list(range(1, max_turn + 1))
        means = [1000 * statistics.mean(r.ttft(n, n)) for n in turns]
        ax.plot(turns, means, marker="o", color=color, label=f"{r.name} (mean)")
    ax.set_xlabel("turn of the conversation")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("Mooncake conversations on vLLM (CPU, tiny Llama): TTFT per turn")
    ax.set_xticks(range(1, max(x["turn"] for x in base.requests) + 1))
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot: {os.path.abspath(path)}")
