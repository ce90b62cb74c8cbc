"""Time to first token of a session's next turn, by where its KV is: hot, pool, disk, or nowhere (re-prefill).

For contexts of about 256, 1024 and 2048 tokens (--contexts picks some) on the default model (2 threads):
  (a) resident   the session is still in its hot slot
  (b) pool       the session was hibernated: its KV comes back from the shared-memory pool
  (c) disk       the session's snapshot lives in the spill directory (a daemon whose pool is too small)
  (d) prefill    a new session is given the whole conversation as text: what a daemon without a pool does
TTFT is the daemon's measurement (arrival to first token), median of --repeat runs. The daemon's own pool
counters, read after every turn, give each checkpoint's (save + checksum) and each restore's (checksum + load)
bandwidth; their medians are printed next to the median of a plain memcpy of the same number of bytes measured
in this process in the same run (the means over all moves are printed too).

    python bench/resume.py [--model PATH] [--repeat 5] [--contexts 1024]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import msgspec
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import default_model, private_daemon  # noqa: E402

from kvpool.client import Client, Session  # noqa: E402

SENTENCE = "The robot walked through the quiet house and noted every open window, lamp and sleeping pet. "
TARGETS = [256, 1024, 2048]
NEXT_TURN = " Now summarise."


def history_text(tokens: int) -> str:
    return SENTENCE * max(1, tokens // 19)  # the sentence is about 19 Gemma tokens


def next_turn_ttft(session: Session) -> float:
    return session.complete(NEXT_TURN, max_tokens=1, temperature=0.0).ttft_ms


def tier_of(client: Client, session: Session) -> str:
    return next(i.tier for i in client.sessions() if i.session == session.id)


def push_out(client: Client, session: Session, others: list[Session], expect: str) -> None:
    """Use the other sessions so that ``session`` loses its slot; check where it went."""
    for other in others:
        other.complete(" ok", max_tokens=1, temperature=0.0)
    tier = tier_of(client, session)
    if tier != expect:
        raise RuntimeError(f"the session went to {tier}, not {expect}")


class MoveSamples:
    """Per-move bandwidth of large snapshots (1 MiB and up, counted apart by the daemon), from the daemon's
    counters read after each turn: a turn that made exactly one large move of a kind gives one sample."""

    KINDS = ("checkpoint", "restore_pool")

    def __init__(self, client: Client):
        self.client = client
        self.samples: dict[str, list[float]] = {k: [] for k in self.KINDS}
        self.last = msgspec.to_builtins(client.status().moves)

    def take(self) -> None:
        now = msgspec.to_builtins(self.client.status().moves)
        for kind in self.KINDS:
            count = now[f"{kind}_large_count"] - self.last[f"{kind}_large_count"]
            if count == 1:
                nbytes = now[f"{kind}_large_bytes"] - self.last[f"{kind}_large_bytes"]
                seconds = now[f"{kind}_large_seconds"] - self.last[f"{kind}_large_seconds"]
                self.samples[kind].append(nbytes / seconds)
        self.last = now


def measure_context(address: str, disk_address: str, target: int, repeat: int, moves: MoveSamples) -> dict[str, float]:
    text = history_text(target)
    row: dict[str, float] = {}
    with Client(address, timeout=600) as client:
        s = client.open_session()
        first = s.complete(text, max_tokens=1, temperature=0.0)
        row["tokens"] = first.usage.context_tokens
        others = [client.open_session() for _ in range(2)]
        for o in others:
            o.complete("Hello there.", max_tokens=1, temperature=0.0)
        s.complete(" ok", max_tokens=1, temperature=0.0)
        row["resident"] = statistics.median(next_turn_ttft(s) for _ in range(repeat))
        pool_ttfts = []
        for _ in range(repeat):
            push_out(client, s, others, "pool")
            moves.take()  # the others' small moves (and any left from before) are not samples
            pool_ttfts.append(next_turn_ttft(s))
            moves.take()  # one restore and one checkpoint of the measured session
        row["pool"] = statistics.median(pool_ttfts)
        prefill = []
        for _ in range(repeat):
            with client.open_session() as fresh:
                prefill.append(fresh.complete(text + NEXT_TURN, max_tokens=1, temperature=0.0).ttft_ms)
        row["prefill"] = statistics.median(prefill)
        for session in [s, *others]:
            session.close()
    with Client(disk_address, timeout=600) as client:
        s = client.open_session()
        s.complete(text, max_tokens=1, temperature=0.0)
        others = [client.open_session() for _ in range(2)]
        disk_ttfts = []
        for _ in range(repeat):
            push_out(client, s, others, "disk")
            disk_ttfts.append(next_turn_ttft(s))
        row["disk"] = statistics.median(disk_ttfts)
        for session in [s, *others]:
            session.close()
    return row


def memcpy_bandwidth(nbytes: int, cold: bool, repeat: int = 9) -> float:
    """numpy copy of ``nbytes``. Hot: the same two buffers every time (they stay in the CPU cache). Cold: a
    different pair each time from a ring larger than any cache, as for a snapshot that was not just touched."""
    ring = 1 if not cold else max(2, (512 << 20) // max(nbytes, 1))
    src = [np.ones(nbytes, dtype=np.uint8) for _ in range(ring)]
    dst = [np.zeros(nbytes, dtype=np.uint8) for _ in range(ring)]
    for a, b in zip(src, dst, strict=True):
        np.copyto(b, a)  # touch every page first, as the pool's pages are
    times = []
    for i in range(repeat):
        started = time.perf_counter()
        np.copyto(dst[i % ring], src[i % ring])
        times.append(time.perf_counter() - started)
    return nbytes / statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF (default: the embedded Gemma 3 270M)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument(
        "--contexts",
        type=lambda text: [int(x) for x in text.split(",")],
        default=TARGETS,
        help="context sizes to measure, e.g. 1024 (default: 256,1024,2048)",
    )
    args = ap.parse_args()
    model = default_model(args.model)
    common = ("--hot-slots", "2", "--context-size", "4096", "--threads", "2")
    rows = []
    # memcpy is measured before and after the daemons' run (the machine is shared: its speed drifts), and the
    # faster of the two is the reference, so the ratio errs against the pool.
    cold_before = memcpy_bandwidth(8 << 20, cold=True)
    with (
        private_daemon(model, *common, "--cache-pool-size", "512MiB") as warm,
        private_daemon(model, *common, "--cache-pool-size", "1MiB", "--spill-max-bytes", "2GiB") as cold,
        Client(warm.address) as client,
    ):
        samples = MoveSamples(client)
        for target in args.contexts:
            row = measure_context(warm.address, cold.address, target, args.repeat, samples)
            rows.append(row)
            print(f"measured {target}: {row}", file=sys.stderr, flush=True)
        moves = msgspec.to_builtins(client.status().moves)
    # Snapshots of 1 MiB or more (the daemon counts them apart): small ones (the 10-token sessions used to push
    # the measured one out) cost fixed microseconds each, which is not bandwidth.
    # Medians of the per-move bandwidths (a move the OS preempted is an outlier, not a bandwidth), and the
    # means over all moves (total bytes / total seconds) for comparison.
    save_bw = statistics.median(samples.samples["checkpoint"])
    restore_bw = statistics.median(samples.samples["restore_pool"])
    mean_save_bw = moves["checkpoint_large_bytes"] / moves["checkpoint_large_seconds"]
    mean_restore_bw = moves["restore_pool_large_bytes"] / moves["restore_pool_large_seconds"]
    mean_round_trip_bw = 2 / (1 / mean_save_bw + 1 / mean_restore_bw)
    mean_bytes = int(
        (moves["checkpoint_large_bytes"] + moves["restore_pool_large_bytes"])
        / max(1, moves["checkpoint_large_count"] + moves["restore_pool_large_count"])
    )
    all_save_bw = moves["checkpoint_bytes"] / moves["checkpoint_seconds"]
    all_restore_bw = moves["restore_pool_bytes"] / moves["restore_pool_seconds"]
    hot_bw = memcpy_bandwidth(mean_bytes, cold=False)
    cold_after = memcpy_bandwidth(mean_bytes, cold=True)
    cold_bw = max(cold_after, cold_before)
    round_trip_bw = 2 / (1 / save_bw + 1 / restore_bw)  # bytes moved out and back in, per second of moving

    print(
        "\nTime to first token of the next turn (ms, daemon-measured, median of "
        f"{args.repeat}; Gemma 3 270M, 2 threads)"
    )
    print(
        f"{'context':>8} | {'(a) hot':>8} | {'(b) pool':>8} | {'(c) disk':>8} | {'(d) prefill':>11} | "
        f"{'prefill/pool':>12}"
    )
    for r in rows:
        print(
            f"{int(r['tokens']):>8} | {r['resident']:>8.1f} | {r['pool']:>8.1f} | {r['disk']:>8.1f} | "
            f"{r['prefill']:>11.1f} | {r['prefill'] / r['pool']:>11.1f}x"
        )
    n_save, n_restore = len(samples.samples["checkpoint"]), len(samples.samples["restore_pool"])
    print(
        f"\nPool bandwidth, snapshots >= 1 MiB (mean {mean_bytes / 2**20:.1f} MiB), median of {n_save} checkpoints "
        f"and {n_restore} restores: checkpoint {save_bw / 1e9:.2f} GB/s, restore {restore_bw / 1e9:.2f} GB/s, "
        f"round trip {round_trip_bw / 1e9:.2f} GB/s"
    )
    print(
        f"  means over all moves: checkpoint {mean_save_bw / 1e9:.2f}, restore {mean_restore_bw / 1e9:.2f}, round "
        f"trip {mean_round_trip_bw / 1e9:.2f} GB/s (small snapshots included: checkpoint {all_save_bw / 1e9:.2f}, "
        f"restore {all_restore_bw / 1e9:.2f} GB/s)"
    )
    print(
        f"memcpy of the same bytes (median of 9): cold {cold_bw / 1e9:.2f} GB/s (before the run "
        f"{cold_before / 1e9:.2f}, after {cold_after / 1e9:.2f}), cache-hot {hot_bw / 1e9:.2f} GB/s"
    )
    print(
        f"round trip / cold memcpy: medians {round_trip_bw / cold_bw:.2f} (target >= 0.5), means "
        f"{mean_round_trip_bw / cold_bw:.2f}; medians / hot memcpy {round_trip_bw / hot_bw:.2f}"
    )
    out = HERE / "out"
    out.mkdir(exist_ok=True)
    (out / "resume.json").write_text(
        json.dumps(
            {
                "rows": rows,
                "moves": moves,
                "memcpy_cold_bytes_per_s": cold_bw,
                "memcpy_hot_bytes_per_s": hot_bw,
                "round_trip_bytes_per_s": round_trip_bw,
                "mean_round_trip_bytes_per_s": mean_round_trip_bw,
                "samples_bytes_per_s": samples.samples,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
