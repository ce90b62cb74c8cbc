"""Smart preloading on a replayed trace: 32 sessions wake up, periodically (24 of them, like a voice assistant's
timed check-ins) or at random (8, Poisson), on 4 hot slots, with a pool too small for all of them (the rest
spill to disk). Three daemons replay the same trace:
  off       preload = "off": a session's KV comes back when its turn arrives (pool or disk restore)
  hints     preload = "hints": each periodic session's client calls prefetch() --lead seconds before its turn
            (it knows its own schedule); random ones cannot
  predict   preload = "predict": no hints; the daemon predicts each session's next turn from its own history
  all hot   the floor any preloading could reach: a hot slot for every session (and the cells for all of them,
            --context-size x 8), so no turn ever waits for a restore, a checkpoint to make room, or a preload.
            Its unified KV is 8x larger, which makes each decode step somewhat dearer (attention over more cells
            in Gemma 3's global layers): if anything, this floor is high.
TTFT is the daemon's measurement (arrival to first token), p50/p99 over every turn of the trace; hit rate =
turns that found their session hot or warm because of a preload / all turns. Each turn also reports the part
of its TTFT that went into making its session hot (Timings.restore_ms); "p99 - own restore" is the p99 of the
turns' TTFT without that part, in the same run.

    python bench/preload.py [--model PATH] [--duration 60] [--history 512]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import default_model, private_daemon  # noqa: E402

from kvpool.client import Client, Session  # noqa: E402

SENTENCE = "The robot walked through the quiet house and noted every open window, lamp and sleeping pet. "
N_SESSIONS, N_PERIODIC = 32, 24


def make_trace(duration: float, seed: int, spread: float = 1.0) -> dict[int, list[float]]:
    """Wake-up times (seconds from the start) of every session; ``spread`` stretches every gap."""
    rng = random.Random(seed)
    trace: dict[int, list[float]] = {}
    for i in range(N_SESSIONS):
        times: list[float] = []
        if i < N_PERIODIC:
            period = rng.uniform(8.0, 16.0) * spread
            t = rng.uniform(0.5, period)
            while t < duration:
                times.append(t)
                t += period * (1 + rng.gauss(0, 0.01))  # a timer's small jitter
        else:
            t = rng.expovariate(1 / (12.0 * spread))
            while t < duration:
                times.append(t)
                t += rng.expovariate(1 / (12.0 * spread))
        trace[i] = times
    return trace


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def replay(address: str, trace: dict[int, list[float]], history: int, hints: bool, lead: float) -> dict:
    with Client(address, timeout=600) as client:
        sessions: dict[int, Session] = {}
        for i in range(N_SESSIONS):
            sessions[i] = client.open_session()
            sessions[i].complete(f"Session {i}. " + SENTENCE * max(1, history // 19), max_tokens=1, temperature=0.0)
        before = client.status()
        ttfts: list[float] = []
        restores: list[float] = []
        lock = threading.Lock()
        start = time.monotonic() + 1.0

        def run(i: int) -> None:
            own = Client(address, timeout=600)  # a connection per session, as each task process has its own
            s = own.resume_session(sessions[i].id, sessions[i].token)
            for n, t in enumerate(trace[i]):
                if hints and i < N_PERIODIC:
                    time.sleep(max(0.0, start + t - lead - time.monotonic()))
                    s.prefetch()
                time.sleep(max(0.0, start + t - time.monotonic()))  # the trace's own clock
                result = s.complete(f" Check-in {n}: anything new?", max_tokens=4, temperature=0.0)
                with lock:
                    ttfts.append(result.ttft_ms)
                    restores.append(result.timings.restore_ms)
            own.close()

        threads = [threading.Thread(target=run, args=(i,)) for i in range(N_SESSIONS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        after = client.status()
        snapshots = [x.snapshot_bytes for x in client.sessions() if x.snapshot_bytes]
    pre = after.preload
    assert pre is not None
    return {
        "turns": len(ttfts),
        "p50": statistics.median(ttfts),
        "p99": percentile(ttfts, 0.99),
        "mean": statistics.fmean(ttfts),
        # The same turns without the part their own restore took (a slot, the KV back): what the turns would have
        # cost had every session been hot on arrival, with the engine's other work (the other turns' restores,
        # checkpoints) unchanged. The floor of what preloading could do for this run's turns.
        "p99_unrestored": percentile([t - r for t, r in zip(ttfts, restores, strict=True)], 0.99),
        "restore_p50": statistics.median(restores),
        "restore_p99": percentile(restores, 0.99),
        "hit_rate": pre.hits / len(ttfts),
        "preloads": pre.preloads,
        "wasted": pre.wasted,
        "restores_pool": after.moves.restores_pool - before.moves.restores_pool,
        "restores_disk": after.moves.restores_disk - before.moves.restores_disk,
        "snapshot_mib": statistics.median(snapshots) / 2**20,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF (default: the embedded Gemma 3 270M)")
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of trace")
    ap.add_argument("--history", type=int, default=512, help="tokens of each session's history")
    ap.add_argument("--pool", default="48MiB", help="cache_pool_size: too small for all the sessions")
    ap.add_argument("--lead", type=float, default=1.0, help="hints: seconds ahead of a turn")
    ap.add_argument("--seed", type=int, default=16)
    ap.add_argument("--context-size", type=int, default=4096, help="KV cells of the 4 hot slots")
    ap.add_argument("--modes", nargs="+", default=["off", "hints", "predict", "all hot"], help="which to run")
    ap.add_argument("--spread", type=float, default=1.0, help="stretch every gap between wake-ups (a lighter load)")
    args = ap.parse_args()
    model = default_model(args.model)
    trace = make_trace(args.duration, args.seed, args.spread)
    common = ("--hot-slots", "4", "--context-size", str(args.context_size), "--threads", "2")
    common += ("--cache-pool-size", args.pool)
    all_hot = ("--hot-slots", str(N_SESSIONS), "--context-size", str(8 * args.context_size), "--threads", "2")
    all_hot += ("--cache-pool-size", args.pool)
    setups = {
        "off": (*common, "--preload", "off"),
        "hints": (*common, "--preload", "hints"),
        "predict": (*common, "--preload", "predict"),
        "all hot": (*all_hot, "--preload", "off"),
    }
    rows = {}
    for mode, setup in setups.items():
        if mode not in args.modes:
            continue
        with private_daemon(model, *setup, "--max-sessions", "40") as daemon:
            rows[mode] = replay(daemon.address, trace, args.history, mode == "hints", args.lead)
        print(f"measured {mode}: {rows[mode]}", file=sys.stderr, flush=True)
    turns = sum(len(v) for v in trace.values())
    snapshot_mib = next(iter(rows.values()))["snapshot_mib"]
    print(
        f"\n{N_SESSIONS} sessions ({N_PERIODIC} periodic, {N_SESSIONS - N_PERIODIC} random), {turns} turns in "
        f"{args.duration:.0f} s (gaps x{args.spread:g}), history {args.history} tokens, 4 hot slots, pool "
        f"{args.pool} (snapshots ~{snapshot_mib:.1f} MiB each); Gemma 3 270M, 2 threads; TTFT "
        "daemon-measured"
    )
    print(
        f"{'preloading':<10} | {'p50 ms':>7} | {'p99 ms':>7} | {'mean ms':>7} | {'restore p50/p99':>15} | "
        f"{'p99 - own restore':>17} | {'hit rate':>8} | {'preloads':>8} | {'wasted':>6} | pool/disk restores"
    )
    for mode, r in rows.items():
        print(
            f"{mode:<10} | {r['p50']:>7.1f} | {r['p99']:>7.1f} | {r['mean']:>7.1f} | "
            f"{r['restore_p50']:>6.1f} / {r['restore_p99']:>6.1f} | {r['p99_unrestored']:>17.1f} | "
            f"{r['hit_rate']:>8.2f} | {r['preloads']:>8} | {r['wasted']:>6} | "
            f"{r['restores_pool']} / {r['restores_disk']}"
        )
    off = rows.get("off")
    if off is not None and "predict" in rows:
        print(f"p99 predict / off: {rows['predict']['p99'] / off['p99']:.2f} (target <= 0.5)")
    if off is not None:
        print(f"p99 off without own restores / off: {off['p99_unrestored'] / off['p99']:.2f} (same run: the floor)")
    if off is not None and "all hot" in rows:
        print(f"p99 all hot / off: {rows['all hot']['p99'] / off['p99']:.2f} (no restores at all, a larger KV)")
    out = HERE / "out"
    out.mkdir(exist_ok=True)
    (out / "preload.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
