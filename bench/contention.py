"""Decode beside the device's other work: kvpoold and llama-server alone and beside CPU-busy neighbour processes, side
by side in one run (the default model, 2 threads, configs/default.toml for kvpoold; llama-server with 4 slots).

Neighbours are separate processes that compute on their own, as a robot's other tasks do:
  python   a pure-Python loop (speech recognition's glue, a planner)
  numpy    image preprocessing: a 640x480 frame resized to 224x224 and normalised, over and over (one thread)
Scenarios: alone, beside 1 python, beside 2 python, beside 1 numpy, beside 1 python at nice 10 (a task whose
systemd unit says Nice=10: the integrator's lever, docs/operations.md).

For each server and scenario, in every round (the servers' order rotates; neighbours start afresh each round):
  first      the first greedy answer of 64 tokens the server decodes beside the neighbours: tokens/s of its
             decode (client-side, first token to last), the time kvpoold takes to change its thread count included
  1 stream   the next such answer
  4 streams  four answers at once: their tokens / the wall time from send to the last one's end
  voice      --voice-turns short turns in one voice session (task "voice", 300 ms first-token budget, a pause of
             0.2-0.5 s between turns): send to first token, p50/p99, and turns refused
Each cell is the median over --rounds (voice: all turns pooled). The ratios: beside / alone of the same server, and
kvpool / llama-server. kvpoold's status (its thread count and step slowdown) is read at each scenario's end.

    python bench/contention.py [--rounds 3] [--voice-turns 12] [--llama-server PATH] [--kvpool NAME=FLAGS ...]
                               [--scenarios alone "1 python" ...] [--before PYTHON]

--kvpool adds a kvpoold variant (FLAGS: its extra command-line flags, e.g. "fixed=--no-adapt-threads", and
environment variables, e.g. "spin=--no-adapt-threads GOMP_SPINCOUNT=1000");
without it, kvpoold runs as shipped and with its thread count fixed. --before adds "kvpool before": kvpoold as
shipped, run by another install's Python (a worktree at an older commit), for a change's effect side by side.
Raw numbers go to bench/out/contention.json,
a plot to bench/out/contention.png.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shlex
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import msgspec
import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from anchors import llama_server, llama_server_binary  # noqa: E402
from common import default_model, private_daemon  # noqa: E402
from latency import VOICE_BUDGET_MS  # noqa: E402

from kvpool.client import Client, KvpoolError  # noqa: E402

CONFIG = ROOT / "configs" / "default.toml"
THREADS = 2
TOKENS = 64
STREAMS = 4
TIMEOUT_S = 600.0
SCENARIOS = {
    "alone": [],
    "1 python": ["python"],
    "2 python": ["python", "python"],
    "1 numpy": ["numpy"],
    "1 python nice 10": ["python@10"],  # the integrator's lever: the task's unit says Nice=10
}
DEFAULT_VARIANTS = {"kvpool": (), "kvpool fixed threads": ("--no-adapt-threads",)}
ENV_VAR = re.compile(r"^[A-Z][A-Z0-9_]*=")  # a variant's FLAGS may set the daemon's environment
STORY = "Once upon a time, in a small village by the sea, there lived"
GREEDY = {"temperature": 0.0}


def neighbour_python() -> None:
    while True:
        pass


def neighbour_numpy() -> None:
    rng = np.random.default_rng(0)
    frame = rng.integers(0, 256, (480, 640, 3), dtype=np.uint8)
    rows, cols = np.linspace(0, 479, 224).astype(int), np.linspace(0, 639, 224).astype(int)
    mean, std = np.array([0.485, 0.456, 0.406], np.float32), np.array([0.229, 0.224, 0.225], np.float32)
    while True:
        small = frame[rows][:, cols].astype(np.float32) / 255.0
        _ = ((small - mean) / std).transpose(2, 0, 1).copy()
        frame = np.roll(frame, 1, axis=1)


@contextlib.contextmanager
def neighbours(kinds: list[str]) -> Iterator[None]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    procs = []
    for spec in kinds:  # "kind" or "kind@nice"
        kind, _, nice = spec.partition("@")
        niced = ["nice", "-n", nice] if nice else []
        command = [*niced, sys.executable, str(Path(__file__)), "--role", kind]
        procs.append(subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL))
    try:
        time.sleep(0.5 if procs else 0.0)  # let them reach their loops (pacing, not syncing)
        yield
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait(30)


class Server:
    """What the bench asks of each server."""

    name: str
    refusal: dict[str, object] | None = None  # why the last refused turn was refused: its error's detail

    def decode_rate(self) -> float: ...
    def streams(self, n: int) -> float: ...
    def voice_turn(self, turn: int) -> float | None: ...  # ms to first token; None if refused
    def voice_reset(self) -> None: ...
    def status(self) -> dict[str, object]:
        return {}


class Kvpool(Server):
    def __init__(self, name: str, address: str) -> None:
        self.name, self.address = name, address
        self.client = Client(address, timeout=TIMEOUT_S)
        self.voice = self.client.open_session("voice")

    def decode_rate(self) -> float:
        with self.client.open_session() as session:
            return rate_of(chunk_times(session.generate(STORY, max_tokens=TOKENS, **GREEDY)))

    def streams(self, n: int) -> float:
        def one(i: int) -> int:
            with Client(self.address, timeout=TIMEOUT_S) as client, client.open_session() as session:
                return session.complete(f"{STORY} {i}", max_tokens=TOKENS, **GREEDY).usage.completion_tokens

        return all_at_once(one, n)

    def voice_turn(self, turn: int) -> float | None:
        sent, first, self.refusal = time.monotonic(), None, None
        try:
            for _chunk in self.voice.generate(f"User: question {turn}, what now?\nAssistant:", max_tokens=8, **GREEDY):
                first = first or time.monotonic()
        except KvpoolError as error:
            status = msgspec.to_builtins(self.client.status())
            recent = {k: status["scheduler"]["cost_model"][f"{k}_steps"]["recent"] for k in ("small", "large")}
            self.refusal = {"turn": turn, "code": str(error.code), **error.detail, "recent": recent, **status["cpu"]}
            return None
        return (first - sent) * 1e3 if first else None

    def voice_reset(self) -> None:
        self.voice.close()
        self.voice = self.client.open_session("voice")

    def status(self) -> dict[str, object]:
        status = msgspec.to_builtins(self.client.status())
        return dict(status.get("cpu") or {})


class LlamaServer(Server):
    def __init__(self, url: str) -> None:
        self.name, self.url = "llama-server", url
        self.history = ""

    def _stream(self, prompt: str, n: int) -> Iterator[dict]:
        body = {"prompt": prompt, "n_predict": n, "stream": True, "cache_prompt": True, **GREEDY}
        with httpx.stream("POST", f"{self.url}/completion", json=body, timeout=TIMEOUT_S) as answer:
            for line in answer.iter_lines():
                if line.startswith("data: "):
                    yield json.loads(line[6:])

    def decode_rate(self) -> float:
        return rate_of(time.monotonic() for event in self._stream(STORY, TOKENS) if event.get("content"))

    def streams(self, n: int) -> float:
        def one(i: int) -> int:
            body = {"prompt": f"{STORY} {i}", "n_predict": TOKENS, **GREEDY}
            return httpx.post(f"{self.url}/completion", json=body, timeout=TIMEOUT_S).json()["tokens_predicted"]

        return all_at_once(one, n)

    def voice_turn(self, turn: int) -> float | None:
        self.history += f"User: question {turn}, what now?\nAssistant:"
        sent, first, answer = time.monotonic(), None, ""
        for event in self._stream(self.history, 8):
            if event.get("content"):
                first = first or time.monotonic()
                answer += event["content"]
        self.history += answer + "\n"
        return (first - sent) * 1e3 if first else None

    def voice_reset(self) -> None:
        self.history = ""


def chunk_times(stream: Iterator[object]) -> Iterator[float]:
    for chunk in stream:
        for _ in chunk.tokens:
            yield time.monotonic()


def rate_of(times: Iterator[float]) -> float:
    stamps = list(times)
    return (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else float("nan")


def all_at_once(one: Callable[[int], int], n: int) -> float:
    results: list[int] = [0] * n
    barrier = threading.Barrier(n + 1)

    def run(i: int) -> None:
        barrier.wait(TIMEOUT_S)
        results[i] = one(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    barrier.wait(TIMEOUT_S)
    started = time.monotonic()
    for thread in threads:
        thread.join(TIMEOUT_S)
    return sum(results) / (time.monotonic() - started)


@dataclass
class Cell:
    first: list[float] = field(default_factory=list)  # the first answer after the neighbours started
    rate1: list[float] = field(default_factory=list)
    rate4: list[float] = field(default_factory=list)
    voice_ms: list[float] = field(default_factory=list)
    refused: int = 0
    refusals: list[dict[str, object]] = field(default_factory=list)  # each refused turn's estimate and its parts
    turns: int = 0
    status: list[dict[str, object]] = field(default_factory=list)


def measure(server: Server, cell: Cell, voice_turns: int, rng: random.Random) -> None:
    cell.first.append(server.decode_rate())  # a thread count that follows the cores changes during this one
    cell.rate1.append(server.decode_rate())
    cell.rate4.append(server.streams(STREAMS))
    server.voice_reset()
    for turn in range(voice_turns):
        ms = server.voice_turn(turn)
        cell.turns += 1
        if ms is None:
            cell.refused += 1
            cell.refusals.append(server.refusal or {"turn": turn})
        else:
            cell.voice_ms.append(ms)
        time.sleep(rng.uniform(0.2, 0.5))  # the next turn's pace
    cell.status.append(server.status())


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def plot(results: dict[str, dict[str, Cell]], scenarios: list[str], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print("(no plot: pip install 'kvpool[bench]')", file=sys.stderr)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    servers = list(results)
    width = 0.8 / len(servers)
    for ax, key, title in ((axes[0], "rate1", "1 stream"), (axes[1], "rate4", "4 streams")):
        for k, name in enumerate(servers):
            values = [med(getattr(results[name][s], key)) for s in scenarios]
            ax.bar(np.arange(len(scenarios)) + k * width, values, width, label=name)
        ax.set_xticks(np.arange(len(scenarios)) + width * (len(servers) - 1) / 2, scenarios)
        ax.set_ylabel("tokens/s")
        ax.set_title(f"decode, {title}, beside busy neighbours (2 cores)")
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("--model", help="GGUF (default: the embedded Gemma 3 270M)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--voice-turns", type=int, default=12)
    ap.add_argument("--llama-server", help="a llama-server binary (default: one scripts/build-llama-server.sh built)")
    ap.add_argument("--kvpool", action="append", default=[], metavar="NAME=FLAGS", help="a kvpoold variant")
    ap.add_argument("--before", metavar="PYTHON", help="also kvpoold as shipped from this Python's install")
    ap.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    args = ap.parse_args()
    if args.role:
        {"python": neighbour_python, "numpy": neighbour_numpy}[args.role]()
        return 0
    model = default_model(args.model)
    variants = dict(DEFAULT_VARIANTS)
    if args.kvpool:
        variants = {name: tuple(shlex.split(flags)) for name, _, flags in (v.partition("=") for v in args.kvpool)}
    pythons: dict[str, str] = {}  # a variant run by another install; the rest by this one
    if args.before:
        variants["kvpool before"], pythons["kvpool before"] = (), args.before
    binary = llama_server_binary(args.llama_server)
    rng = random.Random(7)
    with contextlib.ExitStack() as stack:
        servers: list[Server] = []
        for name, flags in variants.items():
            env = dict(f.split("=", 1) for f in flags if ENV_VAR.match(f))  # e.g. GOMP_SPINCOUNT=1000
            options = [f for f in flags if not ENV_VAR.match(f)]
            python = pythons.get(name, sys.executable)
            daemon = stack.enter_context(
                private_daemon(
                    model, "--config", str(CONFIG), "--threads", str(THREADS), *options, python=python, env=env
                )
            )
            server = Kvpool(name, daemon.address)
            stack.callback(server.client.close)
            servers.append(server)
        if binary:
            servers.append(LlamaServer(stack.enter_context(llama_server(binary, model, STREAMS, 2048))))
        else:
            print("(no llama-server: build one with scripts/build-llama-server.sh, or pass --llama-server)")
        results = {s.name: {scenario: Cell() for scenario in args.scenarios} for s in servers}
        for round_ in range(args.rounds):
            for scenario in args.scenarios:
                with neighbours(SCENARIOS[scenario]):
                    order = servers[round_ % len(servers) :] + servers[: round_ % len(servers)]
                    for server in order:
                        measure(server, results[server.name][scenario], args.voice_turns, rng)
                print(f"round {round_ + 1}: measured {scenario}", file=sys.stderr, flush=True)
    out = HERE / "out"
    out.mkdir(exist_ok=True)
    raw = {name: {s: msgspec.to_builtins(c) for s, c in cells.items()} for name, cells in results.items()}
    (out / "contention.json").write_text(json.dumps(raw, indent=2, default=vars))
    report(results, args.scenarios, args.rounds)
    plot(results, args.scenarios, out / "contention.png")
    print(f"plot: {out / 'contention.png'}")
    return 0


def report(results: dict[str, dict[str, Cell]], scenarios: list[str], rounds: int) -> None:
    print(f"\nBeside busy neighbours, 2 cores, {THREADS} threads; medians of {rounds} rounds (voice: all turns)")
    print(
        f"{'server':>20} | {'scenario':>16} | {'first':>5} | {'x alone':>7} | {'1 stream':>8} | {'x alone':>7} | "
        f"{'4 streams':>9} | {'x alone':>7} | {'voice p50':>9} | {'p99':>5} | {'refused':>7} | threads"
    )
    for name, cells in results.items():
        alone = cells.get("alone")
        for scenario in scenarios:
            c = cells[scenario]
            r0, r1, r4 = med(c.first), med(c.rate1), med(c.rate4)
            x0 = r0 / med(alone.rate1) if alone else float("nan")
            x1 = r1 / med(alone.rate1) if alone else float("nan")
            x4 = r4 / med(alone.rate4) if alone else float("nan")
            threads = ",".join(str(s.get("threads", "")) for s in c.status) or "-"
            print(
                f"{name:>20} | {scenario:>16} | {r0:>5.1f} | {x0:>7.2f} | {r1:>8.1f} | {x1:>7.2f} | {r4:>9.1f} | "
                f"{x4:>7.2f} | {pct(c.voice_ms, 50):>9.0f} | {pct(c.voice_ms, 99):>5.0f} | "
                f"{c.refused:>3}/{c.turns:<3} | {threads}"
            )
    if "llama-server" in results:
        theirs = results["llama-server"]
        print("\nkvpool / llama-server, same scenario:")
        for name, cells in results.items():
            if name == "llama-server":
                continue
            line = ", ".join(
                f"{s}: 1 stream {med(cells[s].rate1) / med(theirs[s].rate1):.2f}x, "
                f"4 streams {med(cells[s].rate4) / med(theirs[s].rate4):.2f}x"
                for s in scenarios
            )
            print(f"  {name}: {line}")
    print(f"(voice budget {VOICE_BUDGET_MS:.0f} ms)")


if __name__ == "__main__":
    sys.exit(main())
