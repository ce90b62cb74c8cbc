"""Voice latency under a vision load: does the voice assistant stay snappy while vision pushes long prompts?

A voice client sends a short turn every 1-2 s (one multi-turn session, task "voice": 300 ms first-token
budget) while a vision client streams ~1,100-token scene descriptions back to back (task "vision",
best effort), for --seconds each, against the default model with configs/default.toml, in three setups:
  (a) budgets   the default scheduler: deadlines first, chunked prompts, preemption
  (b) fcfs      the same daemon with budgets off: first come first served, whole-batch prompt chunks
  (c) serial    one request at a time (one hot slot, first come first served)
  deterministic (a) with deterministic decoding (docs/determinism.md): its cost, side by side with (a)
  no-guesses, guesses   (a) with draft_tokens 0 and 16 (docs/speculative.md)
Reports voice time to first token (client-measured, send to first chunk) p50/p99, the deadline-miss rate
(late or refused), and vision throughput (prompt + generated tokens per second). Writes a plot of the TTFT
distributions to bench/out/latency.png and the raw numbers to bench/out/latency.json.

    python bench/latency.py [--model PATH] [--seconds 60] [--setups budgets fcfs serial deterministic]
                            [--before PYTHON]

--before also runs each setup with kvpoold from another install's Python ("<setup> before", beside it, each of
the two first in turn), for a change's effect on the same machine in the same hour.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import default_model, private_daemon  # noqa: E402

from kvpool.client import Client, KvpoolError  # noqa: E402

CONFIG = HERE.parent / "configs" / "default.toml"
VOICE_BUDGET_MS = 300.0
SCENE = (
    "A delivery robot crosses a busy market square at noon. Stalls sell oranges, bread, flowers and "
    "fish; a child chases a red balloon; two dogs bark at a pigeon; an old man plays the accordion. "
)
SETUPS = {
    "budgets": ("--scheduling", "budgets"),
    "fcfs": ("--scheduling", "fcfs"),
    "serial": ("--scheduling", "fcfs", "--hot-slots", "1"),
    "deterministic": ("--scheduling", "budgets", "--deterministic"),  # (a) with deterministic decoding
    # (a) with draftless speculation off and at its most (docs/speculative.md): the voice budget holds either way
    "no-guesses": ("--scheduling", "budgets", "--draft-tokens", "0"),
    "guesses": ("--scheduling", "budgets", "--draft-tokens", "16"),
}


def role_voice(address: str, seconds: float) -> None:
    rng = random.Random(7)
    results = []
    with Client(address, timeout=120) as client:
        session = client.open_session("voice")
        end = time.monotonic() + seconds
        turn = 0
        while time.monotonic() < end:
            turn += 1
            if turn % 12 == 0:  # keep the conversation within the voice task's context limit
                session.close()
                session = client.open_session("voice")
            sent = time.monotonic()
            first = None
            try:
                stream = session.generate(
                    f"User: question number {turn}, what should I do now?\nAssistant:", max_tokens=16, temperature=0.0
                )
                for _chunk in stream:
                    if first is None:
                        first = time.monotonic()
                results.append({"ttft_ms": (first - sent) * 1000.0, "refused": None})
            except KvpoolError as exc:
                results.append({"ttft_ms": None, "refused": exc.code, "detail": exc.detail, "turn": turn})
            time.sleep(max(0.0, sent + rng.uniform(1.0, 2.0) - time.monotonic()))  # the next turn's pace
    print(json.dumps(results), flush=True)


def role_vision(address: str, seconds: float) -> None:
    tokens = 0
    done = 0
    started = time.monotonic()
    end = started + seconds
    with Client(address, timeout=600) as client:
        while time.monotonic() < end:
            with client.open_session("vision") as session:
                result = session.complete(SCENE * 28 + "\nCaption:", max_tokens=32, temperature=0.0)
            tokens += result.usage.prompt_tokens + result.usage.completion_tokens
            done += 1
    print(json.dumps({"tokens": tokens, "requests": done, "seconds": time.monotonic() - started}), flush=True)


def run_setup(model: str, args: tuple[str, ...], seconds: float, python: str = sys.executable) -> dict[str, object]:
    with private_daemon(model, "--config", str(CONFIG), "--threads", "2", *args, python=python) as daemon:
        me = [sys.executable, str(Path(__file__))]
        vision = subprocess.Popen(
            [*me, "--role", "vision", daemon.address, str(seconds)], stdout=subprocess.PIPE, text=True
        )
        time.sleep(2.0)  # let the vision load get going before the first voice turn (pacing, not syncing)
        voice = subprocess.Popen(
            [*me, "--role", "voice", daemon.address, str(seconds)], stdout=subprocess.PIPE, text=True
        )
        voice_out, _ = voice.communicate(timeout=seconds * 4 + 600)
        vision_out, _ = vision.communicate(timeout=seconds * 4 + 600)
        with Client(daemon.address) as client:
            status = msgspec.to_builtins(client.status())
    turns = json.loads(voice_out.strip().splitlines()[-1])
    ttfts = [t["ttft_ms"] for t in turns if t["ttft_ms"] is not None]
    refused = sum(1 for t in turns if t["refused"])
    late = sum(1 for v in ttfts if v > VOICE_BUDGET_MS)
    vision_result = json.loads(vision_out.strip().splitlines()[-1])
    return {
        "voice_ttft_ms": ttfts,
        "voice_turns": len(turns),
        "voice_refused": refused,
        "voice_refusals": [t for t in turns if t["refused"]],
        "voice_late": late,
        "vision_tokens_per_s": vision_result["tokens"] / vision_result["seconds"],
        "vision_requests": vision_result["requests"],
        "daemon_tasks": status["tasks"],
        "cost_model": status["scheduler"]["cost_model"],
    }


def plot(results: dict[str, dict[str, object]], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print("(no plot: pip install 'kvpool[bench]')", file=sys.stderr)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, r in results.items():
        values = np.sort(np.asarray(r["voice_ttft_ms"]))
        if len(values):
            ax.plot(values, np.arange(1, len(values) + 1) / len(values), label=name, drawstyle="steps-post")
    ax.axvline(VOICE_BUDGET_MS, color="grey", linestyle="--", label="voice budget (300 ms)")
    ax.set_xscale("log")
    ax.set_xlabel("voice time to first token (ms, log scale)")
    ax.set_ylabel("fraction of voice turns")
    ax.set_title("Voice TTFT while vision streams ~1,100-token prompts (Gemma 3 270M, 2 threads)")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("args", nargs="*", help=argparse.SUPPRESS)
    ap.add_argument("--model", help="GGUF (default: the embedded Gemma 3 270M)")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--setups", nargs="+", default=["budgets", "fcfs", "serial", "deterministic"], choices=list(SETUPS))
    ap.add_argument("--before", metavar="PYTHON", help="also run each setup with this Python's install of kvpool")
    args = ap.parse_args()
    if args.role:
        {"voice": role_voice, "vision": role_vision}[args.role](args.args[0], float(args.args[1]))
        return 0
    model = default_model(args.model)
    results = {}
    for i, name in enumerate(args.setups):
        installs = [(name, sys.executable)] + ([(f"{name} before", args.before)] if args.before else [])
        for label, python in installs[:: -1 if i % 2 else 1]:  # (each goes first in turn: drift favours neither)
            results[label] = run_setup(model, SETUPS[name], args.seconds, python)
            print(f"measured {label}", file=sys.stderr, flush=True)
    out = HERE / "out"
    out.mkdir(exist_ok=True)
    (out / "latency.json").write_text(json.dumps(results, indent=2))
    plot(results, out / "latency.png")

    print(f"\nVoice under vision load, {args.seconds:.0f} s per setup (voice budget {VOICE_BUDGET_MS:.0f} ms)")
    print(
        f"{'setup':>16} | {'turns':>5} | {'TTFT p50':>8} | {'TTFT p99':>8} | {'missed':>6} | {'refused':>7} | "
        f"{'vision tok/s':>12} | {'vision reqs':>11}"
    )
    for name, r in results.items():
        ttft = np.asarray(r["voice_ttft_ms"])
        p50, p99 = np.percentile(ttft, [50, 99]) if len(ttft) else (float("nan"), float("nan"))
        missed = (r["voice_late"] + r["voice_refused"]) / max(1, r["voice_turns"])
        print(
            f"{name:>16} | {r['voice_turns']:>5} | {p50:>8.0f} | {p99:>8.0f} | {missed:>6.1%} | "
            f"{r['voice_refused']:>7} | {r['vision_tokens_per_s']:>12.1f} | {r['vision_requests']:>11}"
        )
    if {"budgets", "deterministic"} <= results.keys():
        a, d = results["budgets"], results["deterministic"]
        print(
            f"\ndeterministic vs budgets: voice p50 {np.percentile(d['voice_ttft_ms'], 50):.0f} vs "
            f"{np.percentile(a['voice_ttft_ms'], 50):.0f} ms, p99 {np.percentile(d['voice_ttft_ms'], 99):.0f} vs "
            f"{np.percentile(a['voice_ttft_ms'], 99):.0f} ms; vision throughput "
            f"{d['vision_tokens_per_s'] / a['vision_tokens_per_s']:.0%} of budgets"
        )
    if {"budgets", "fcfs"} <= results.keys():
        a, b = results["budgets"], results["fcfs"]
        ratio = np.percentile(b["voice_ttft_ms"], 99) / np.percentile(a["voice_ttft_ms"], 99)
        print(
            f"\nbudgets vs fcfs: voice p99 {ratio:.1f}x lower; vision throughput "
            f"{a['vision_tokens_per_s'] / b['vision_tokens_per_s']:.0%} of fcfs"
        )
    print(f"plot: {out / 'latency.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
