"""Before and after a change, side by side: the same workloads against kvpoold from two installs, in one run.

Each install is a Python interpreter with kvpool installed (e.g. the .venv of a worktree at the old commit, and
this checkout's). Rounds alternate the order (before, after; then after, before) so that a machine's drift
falls on both. Per round and install, on the default model with configs/default.toml and 2 threads:
  throughput  1 and 4 clients at once, each 64 greedy tokens from its own prompt: tokens/s, client-side
  latency     a voice client's 16-token turns, one every 0.6 s, while a vision client sends ~1,100-token
              prompts back to back (best effort): voice time to first token, p50 and p99 (--seconds)
  restore     a ~1,000-token session pushed out of the only hot slot into the pool by another session, then
              its next turn: the daemon's restore_ms (making it hot again) and the turn's time to first token
Prints medians per install and their ratio (after / before); the raw numbers go to bench/out/before_after.json.
A ratio within the rounds' spread is noise: the table prints each side's min-max too.

    git worktree add /tmp/before <commit> && (cd /tmp/before && make setup)
    python bench/before_after.py --before /tmp/before/.venv/bin/python [--after .venv/bin/python] [--rounds 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import default_model, private_daemon  # noqa: E402

from kvpool.client import Client, KvpoolError  # noqa: E402

CONFIG = HERE.parent / "configs" / "default.toml"
SCENE = "A kitchen with a table, two chairs, a window facing the garden and a cat asleep on the floor. "
SENTENCE = "The robot walked through the quiet house and noted every open window, lamp and sleeping pet. "


def throughput(address: str, clients: int) -> float:
    """Tokens per second of ``clients`` sessions generating 64 greedy tokens each, all at once."""
    barrier = threading.Barrier(clients + 1)
    counts: list[int] = []

    def one(i: int) -> None:
        with Client(address, timeout=300) as client, client.open_session() as session:
            barrier.wait(timeout=120)
            done = session.complete(f"Story {i}: once upon a time", max_tokens=64, temperature=0.0)
            counts.append(done.usage.completion_tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    barrier.wait(timeout=120)
    started = time.perf_counter()
    for t in threads:
        t.join(timeout=600)
    return sum(counts) / (time.perf_counter() - started)


def voice_under_vision(address: str, seconds: float) -> tuple[list[float], int]:
    """Voice times to first token (ms) while a vision client keeps the daemon busy, and how many voice turns
    were refused (their budget could not be met)."""
    stop = threading.Event()

    def vision() -> None:
        with Client(address, timeout=600) as client:
            while not stop.is_set():
                with client.open_session("vision") as session:
                    session.complete(SCENE * 28 + "\nCaption:", max_tokens=32, temperature=0.0)

    loader = threading.Thread(target=vision)
    loader.start()
    ttfts: list[float] = []
    refused = 0
    try:
        time.sleep(1.0)  # let the vision load get going (pacing, not synchronisation)
        with Client(address, timeout=120) as client:
            session = client.open_session("voice")
            end, turn = time.monotonic() + seconds, 0
            while time.monotonic() < end:
                turn += 1
                if turn % 12 == 0:  # within the voice task's context limit
                    session.close()
                    session = client.open_session("voice")
                sent = time.monotonic()
                first = None
                try:
                    for _ in session.generate(f"User: question {turn}, what now?\nAssistant:", max_tokens=16,
                                              temperature=0.0):  # fmt: skip
                        first = first or time.monotonic()
                    ttfts.append(((first or time.monotonic()) - sent) * 1000.0)
                except KvpoolError:
                    refused += 1
                time.sleep(max(0.0, sent + 0.6 - time.monotonic()))
    finally:
        stop.set()
        loader.join(timeout=600)
    return ttfts, refused


def restore(address: str, repeat: int) -> tuple[list[float], list[float]]:
    """(restore_ms, ttft_ms) of a ~1,000-token session's turns after another session took the only slot."""
    restores, ttfts = [], []
    with Client(address, timeout=300) as client:
        long, other = client.open_session(), client.open_session()
        long.complete(SENTENCE * 52, max_tokens=1, temperature=0.0)
        for _ in range(repeat):
            other.complete(" ok", max_tokens=1, temperature=0.0)  # takes the slot: the long one goes to the pool
            done = long.complete(" Now summarise.", max_tokens=1, temperature=0.0)
            restores.append(done.timings.restore_ms)
            ttfts.append(done.ttft_ms)
        long.close()
        other.close()
    return restores, ttfts


def measure(python: str, model: str, seconds: float) -> dict[str, object]:
    row: dict[str, object] = {}
    common = ("--config", str(CONFIG), "--threads", "2")
    with private_daemon(model, *common, python=python) as d:
        row["tokens_per_s_1"] = throughput(d.address, 1)
        row["tokens_per_s_4"] = throughput(d.address, 4)
        ttfts, refused = voice_under_vision(d.address, seconds)
        row["voice_refused"] = refused
        row["voice_ttft_p50"] = float(statistics.median(ttfts))
        row["voice_ttft_p99"] = float(sorted(ttfts)[min(len(ttfts) - 1, int(len(ttfts) * 0.99))])
    with private_daemon(model, *common, "--hot-slots", "1", python=python) as d:
        restores, turn_ttfts = restore(d.address, 5)
        row["restore_ms"] = statistics.median(restores)
        row["restored_turn_ttft_ms"] = statistics.median(turn_ttfts)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="the Python of the install before the change")
    ap.add_argument("--after", default=sys.executable, help="the Python of the install after it (default: this one)")
    ap.add_argument("--model", help="GGUF (default: the embedded Gemma 3 270M)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=20.0, help="of the voice-under-vision load, per round")
    args = ap.parse_args()
    model = default_model(args.model)
    runs: dict[str, list[dict[str, object]]] = {"before": [], "after": []}
    for r in range(args.rounds):
        order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
        for side in order:
            row = measure(args.before if side == "before" else args.after, model, args.seconds)
            runs[side].append(row)
            print(f"round {r + 1} {side}: {row}", file=sys.stderr, flush=True)
    print(f"\nbefore/after, {args.rounds} rounds alternating, medians [min-max]")
    print(f"{'metric':<24} | {'before':>22} | {'after':>22} | after/before")
    for key in runs["before"][0]:
        b = [float(x[key]) for x in runs["before"]]  # type: ignore[arg-type]
        a = [float(x[key]) for x in runs["after"]]  # type: ignore[arg-type]
        mb, ma = statistics.median(b), statistics.median(a)
        cell_b = f"{mb:8.1f} [{min(b):.1f}-{max(b):.1f}]"
        cell_a = f"{ma:8.1f} [{min(a):.1f}-{max(a):.1f}]"
        print(f"{key:<24} | {cell_b:>22} | {cell_a:>22} | {ma / mb if mb else float('nan'):.2f}")
    out = HERE / "out"
    out.mkdir(exist_ok=True)
    (out / "before_after.json").write_text(json.dumps(runs, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
