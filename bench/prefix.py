"""Prefix sharing: 16 sessions that start with one ~500-token system prompt, shared vs not.

Two daemons on the default model (4 hot slots, 2 threads), one with prefix sharing (the default) and one with
`prefix_slots = 0`, run the same script: open 16 sessions with the system prompt, one short greedy turn each.
Reported per daemon:
  - time to first token of a new session (the daemon's measurement): the first session of the shared daemon
    computes the prompt ("cold"); the 15 after it share it; every session of the unshared daemon is cold
  - KV cells in use at the end (the unified KV) and pool bytes: session snapshots and prefix snapshots
  - the prefix part: the pool bytes the system prompt takes (shared: its one snapshot; unshared: the full
    snapshots minus the shared daemon's suffix-only ones, i.e. 16 copies of it)
and whether both daemons produced the same tokens. Plot: bench/out/prefix.png.

    python bench/prefix.py [--model PATH] [--sessions 16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import msgspec

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import default_model, private_daemon  # noqa: E402

from kvpool.client import Client  # noqa: E402

SYSTEM = (
    "You are the voice assistant of a family car. You help the driver with navigation, music, climate and "
    "phone calls. Answer in one or two short sentences, never distract the driver, and ask before you change "
    "a setting the driver did not mention. Safety comes first: if a request could distract the driver, "
    "suggest doing it when the car is parked. "
) * 7  # about 500 Gemma tokens
QUESTIONS = ["Play some jazz.", "Is it warm outside?", "Call home.", "How far to the station?"]


def run(model: str, sessions: int, sharing: bool, hot_slots: int = 4) -> dict[str, Any]:
    args = ("--hot-slots", str(hot_slots), "--context-size", "8192", "--threads", "2", "--cache-pool-size", "512MiB")
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-cfg-") as folder:
        config = Path(folder) / "kvpoold.toml"
        config.write_text("" if sharing else "prefix_slots = 0\n")
        return measure(model, (*args, "--config", str(config)), sessions)


def measure(model: str, args: tuple[str, ...], sessions: int) -> dict[str, Any]:
    with private_daemon(model, *args) as daemon, Client(daemon.address, timeout=300) as c:
        opened = [c.open_session(system_prompt=SYSTEM) for _ in range(sessions)]
        ttft, tokens = [], []
        for i, s in enumerate(opened):
            answer = s.complete(f"\nDriver: {QUESTIONS[i % len(QUESTIONS)]}\nAssistant:", max_tokens=8, temperature=0)
            ttft.append(answer.ttft_ms)
            tokens.append(answer.tokens)
        status = msgspec.to_builtins(c.status())
        infos = c.sessions()
    prefixes = status["prefixes"]
    return {
        "ttft_ms": ttft,
        "tokens": tokens,
        "system_tokens": min(i.context_tokens for i in infos) - 16,  # roughly: the turn added ~16 tokens
        "kv_cells": status["kv"]["cells_used"],
        "session_bytes": sum(i.snapshot_bytes for i in infos),
        "prefix_bytes": prefixes["pool_bytes"],
        "pool_used": status["pool"]["used_bytes"],
        "hits": prefixes["hits"],
        "tiers": status["sessions_by_tier"],
    }


def mib(n: float) -> str:
    return f"{n / 2**20:8.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="GGUF path (default: the embedded Gemma 3 270M)")
    parser.add_argument("--sessions", type=int, default=16)
    args = parser.parse_args()
    model = default_model(args.model)
    shared = run(model, args.sessions, sharing=True)
    unshared = run(model, args.sessions, sharing=False)
    # A control for exactness: the same unshared sessions with 1 hot slot, so their cells sit elsewhere in the KV.
    control = run(model, args.sessions, sharing=False, hot_slots=1)

    cold = statistics.median(unshared["ttft_ms"])
    warm = statistics.median(shared["ttft_ms"][1:])
    print(f"{args.sessions} sessions, system prompt of ~{shared['system_tokens']} tokens, one 8-token greedy turn each")
    print(" daemon   | TTFT new session (median ms) | KV cells | pool: sessions MiB | prefixes MiB | total MiB")
    for name, r, first in (("shared", shared, warm), ("unshared", unshared, cold)):
        total = r["session_bytes"] + r["prefix_bytes"]
        print(
            f" {name:<8} | {first:28.1f} | {r['kv_cells']:8d} | {mib(r['session_bytes']):>18} |"
            f" {mib(r['prefix_bytes']):>12} | {mib(total):>9}"
        )
    print(f"shared daemon: first session (computes the prompt) {shared['ttft_ms'][0]:.1f} ms, hits {shared['hits']}")
    # The prefix part: what the system prompt costs in the pool. Unshared, every snapshot holds it; shared, the
    # sessions' snapshots hold only their own cells and the prompt is stored once.
    unshared_prefix = unshared["session_bytes"] - shared["session_bytes"]
    shared_prefix = shared["prefix_bytes"]
    print(f"TTFT of a new session: {cold / warm:.1f}x lower when shared (target >= 10x)")
    print(
        f"pool bytes for the prefix part: shared {mib(shared_prefix).strip()} MiB vs unshared "
        f"{mib(unshared_prefix).strip()} MiB = 1/{unshared_prefix / max(shared_prefix, 1):.1f} (target <= 1/8)"
    )
    cells_saved = unshared["kv_cells"] - shared["kv_cells"]
    print(f"hot KV: {shared['kv_cells']} cells shared vs {unshared['kv_cells']} unshared ({cells_saved} fewer)")
    same = [a == b for a, b in zip(shared["tokens"], unshared["tokens"], strict=True)]
    print(f"sessions with the same tokens, shared vs unshared: {sum(same)} of {len(same)}")
    for i, (a, b) in enumerate(zip(shared["tokens"], unshared["tokens"], strict=True)):
        if a != b:
            print(f"  session {i}: shared {a} vs unshared {b} (unshared with 1 hot slot: {control['tokens'][i]})")
    alike = sum(a == b for a, b in zip(unshared["tokens"], control["tokens"], strict=True))
    print(
        f"control, no sharing anywhere: 4 hot slots vs 1 hot slot give the same tokens for {alike} of {len(same)} "
        "sessions (llama.cpp's attention depends on where cells sit in the KV; near-ties can flip)"
    )
    plot(shared, unshared)


def plot(shared: dict[str, Any], unshared: dict[str, Any]) -> None:
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = HERE / "out"
    out.mkdir(exist_ok=True)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    n = range(1, len(shared["ttft_ms"]) + 1)
    left.plot(n, unshared["ttft_ms"], "o-", label="unshared")
    left.plot(n, shared["ttft_ms"], "o-", label="shared")
    left.set_yscale("log")
    left.set_xlabel("session (opened in order)")
    left.set_ylabel("time to first token (ms, log)")
    left.legend()
    names = ["unshared", "shared"]
    sessions = [unshared["session_bytes"] / 2**20, shared["session_bytes"] / 2**20]
    prefixes = [unshared["prefix_bytes"] / 2**20, shared["prefix_bytes"] / 2**20]
    right.bar(names, sessions, label="session snapshots")
    right.bar(names, prefixes, bottom=sessions, label="prefix snapshots")
    right.set_ylabel("pool MiB")
    right.legend()
    fig.suptitle("16 sessions with one ~500-token system prompt (Gemma 3 270M, 2 threads)")
    fig.tight_layout()
    fig.savefig(out / "prefix.png", dpi=100)


if __name__ == "__main__":
    main()
