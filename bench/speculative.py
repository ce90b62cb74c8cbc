"""Draftless speculation, side by side in one run: kvpoold without speculation (no guesses, no grammar
jump-forward) and as it ships (guesses and jump-forward), against llama-server (built by
scripts/build-llama-server.sh from the same llama.cpp) without drafts and with its n-gram drafts, on the default
model with 2 threads and 8 slots, greedy. ``--jump-compare`` adds kvpoold with guesses and each other
jump_forward setting ("append", "off"), and with forced text appended but no guesses.

Workloads, each a Gemma chat turn:
  chat   free text (a few paragraphs about the bicycle's history)
  json   a JSON-schema answer: a list of the devices its prompt describes, as an array of records
  copy   an answer that copies from its prompt: a Python function with one variable renamed
Streams: 1, 4 and 8 at once, each stream its own session (its prompt starts with its number). A cell is the
decode rate, client-side: the sum over the streams of each one's tokens after its first / (its last token's time -
its first token's), the median over --rounds (the servers' order rotates every round; every llama-server starts
afresh for each cell, since ngram-mod keeps what it drafts from across requests). At 4 and 8 streams a second table
gives the same runs end to end: all the answers' tokens over the time from the requests to the last token, their
prompts included; a third, to each answer's end: the same tokens over the mean time from the requests to an
answer's last token (each task waits for its own answer). kvpoold starts an answer as soon as its prompt is
computed, so its first answers decode beside the later prompts, which their own rates count; llama-server, given
the prompts at once, computes every one before the first answer starts, so its rates count none of them. kvpoold's
answers with guesses are compared with its answers without, token for token, and its guess counters are read.

    python bench/speculative.py [--rounds 3] [--tokens 128] [--draft-tokens 16] [--draft-step-rows 16]
                                [--llama-server PATH]
                                [--workloads chat json copy] [--streams 1 4 8] [--jump-compare] [--no-anchors]
                                [--before PYTHON] [--predicted]

--predicted adds "kvpool predicted": kvpoold with guesses, each request carrying as its prediction the answer it
will give (each prompt's answer without guesses, asked for one at a time first): its ceiling with guesses, every
guess right. --before adds "kvpool guesses before": kvpoold with guesses run by another install's Python (a
worktree at an older commit), for a change's effect side by side. Raw numbers go to bench/out/speculative.json, a
plot to bench/out/speculative.png.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from anchors import llama_server, llama_server_binary  # noqa: E402
from common import default_model, private_daemon  # noqa: E402

from kvpool.client import Client  # noqa: E402

THREADS = 2
SLOTS = 8
TIMEOUT_S = 900.0
GREEDY = {"temperature": 0.0}
DAEMON_FLAGS = ("--threads", str(THREADS), "--hot-slots", str(SLOTS), "--context-size", str(SLOTS * 2048))
WITHOUT_GUESSES = ("--draft-tokens", "0", "--jump-forward", "off")  # kvpoold without speculation


# llama-server without drafts, and with each n-gram draft setting of its own (no draft model: draftless, as kvpool)
ANCHORS: dict[str, tuple[str, ...]] = {
    "llama-server": (),
    "llama-server ngram 3/8": (
        "--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "8",
    ),
    "llama-server ngram-mod": ("--spec-type", "ngram-mod"),
}  # fmt: skip


def turn(text: str) -> str:
    return f"<start_of_turn>user\n{text}<end_of_turn>\n<start_of_turn>model\n"


DEVICES = [
    ("kitchen lamp", "kitchen", "light", 9),
    ("hall lamp", "hall", "light", 7),
    ("living room tv", "living room", "screen", 95),
    ("bedroom fan", "bedroom", "fan", 40),
    ("bathroom heater", "bathroom", "heater", 1500),
    ("office monitor", "office", "screen", 30),
    ("garage door", "garage", "motor", 350),
    ("garden pump", "garden", "pump", 600),
    ("nursery light", "nursery", "light", 5),
    ("kitchen kettle", "kitchen", "appliance", 2200),
]
DEVICE_LINES = "\n".join(f"- {n} (room: {r}, kind: {k}, {w} W)" for n, r, k, w in DEVICES)
SCHEMA = {
    "type": "array",
    "minItems": len(DEVICES),
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "room": {"type": "string"},
            "kind": {"type": "string"},
            "watts": {"type": "integer"},
        },
        "required": ["name", "room", "kind", "watts"],
    },
}
CODE = '''def summarize(items, threshold):
    """Count, sum and average the items above a threshold."""
    total = 0
    count = 0
    largest = None
    for item in items:
        if item.value < threshold:
            continue
        total += item.value
        count += 1
        if largest is None or item.value > largest.value:
            largest = item
    average = total / count if count else 0.0
    return {"count": count, "total": total, "average": average, "largest": largest}
'''
WORKLOADS: dict[str, tuple[str, dict[str, object]]] = {
    "chat": (turn("Tell me about the history of the bicycle, in a few paragraphs."), {}),
    "json": (
        turn(f"These are the devices in the house:\n{DEVICE_LINES}\nList every device as JSON records."),
        {"json_schema": SCHEMA},
    ),
    "copy": (
        turn(f"Here is a Python function:\n```python\n{CODE}```\nRename the variable `item` to `entry` everywhere "
             "and give the whole function back, code only."),
        {},
    ),
}  # fmt: skip


def prompt_of(workload: str, stream: int) -> tuple[str, dict[str, object]]:
    text, extra = WORKLOADS[workload]
    return f"Request {stream}.\n" + text, extra


PROMPT_TOKENS: dict[str, list[int]] = {}  # a prompt's token ids (BOS and the turn markers as special tokens)


def tokenize_prompts(address: str, workloads: list[str], streams: int) -> None:
    """The same token ids go to every server: kvpoold tokenizes a text prompt's ``<start_of_turn>`` as text, and
    llama-server as the special token; ids leave no room for either reading. Every prompt, before any server runs."""
    with Client(address, timeout=TIMEOUT_S) as client:
        for w in workloads:
            for i in range(streams):
                prompt = prompt_of(w, i)[0]
                PROMPT_TOKENS[prompt] = client.tokenize(prompt, add_bos=True, special=True)


class Server:
    name: str

    def answer(self, prompt: str, extra: dict[str, object], tokens: int) -> tuple[list[float], list[int]]:
        """One answer, streamed: each token's arrival time, and the tokens (when the server gives them)."""
        raise NotImplementedError

    def counters(self) -> dict[str, int]:
        return {}

    def fresh(self) -> contextlib.AbstractContextManager[object]:
        """The server as it is for one cell: nothing one cell's answers left behind may serve the next."""
        return contextlib.nullcontext()


class Kvpool(Server):
    def __init__(self, name: str, address: str) -> None:
        self.name, self.address = name, address

    def answer(self, prompt: str, extra: dict[str, object], tokens: int) -> tuple[list[float], list[int]]:
        times: list[float] = []
        out: list[int] = []
        ids = PROMPT_TOKENS[prompt]
        with Client(self.address, timeout=TIMEOUT_S) as client, client.open_session() as session:
            for chunk in session.generate(ids, max_tokens=tokens, **GREEDY, **extra):
                now = time.monotonic()
                times += [now] * len(chunk.tokens)
                out += chunk.tokens
        return times, out

    def counters(self) -> dict[str, int]:
        with Client(self.address, timeout=TIMEOUT_S) as client:
            c = client.status().counters
        return {
            "drafted": c.drafted_tokens,
            "accepted": c.accepted_tokens,
            "jumped": c.jumped_tokens,
            "generated": c.generated_tokens,
        }


class Predicted(Kvpool):
    """kvpoold with guesses, each request carrying the answer it will give as its prediction (``expected``: each
    prompt's greedy answer without guesses): every token is guessed right, as no guess from the session's own
    tokens can be, but for near-ties a batch of another shape takes otherwise. What this daemon gives with guesses
    at best: its ceiling, with all its own costs in it (sampling, the grammar, the prompts beside the answers)."""

    def __init__(self, name: str, address: str, expected: dict[str, list[int]]) -> None:
        super().__init__(name, address)
        self.expected = expected

    def answer(self, prompt: str, extra: dict[str, object], tokens: int) -> tuple[list[float], list[int]]:
        return super().answer(prompt, {**extra, "prediction_tokens": self.expected[prompt][:tokens]}, tokens)


class LlamaServer(Server):
    """A llama-server started afresh for every cell: its ngram-mod drafts come from a table of n-grams shared by all
    its sequences and kept from one request to the next, so a server kept across cells would draft this round's
    answers from the last round's (the same prompts, greedy: the same answers). Measured so, ngram-mod's one-stream
    copying rose from 108 to 222 tok/s between two rounds. kvpool's guesses come from the session's own tokens."""

    def __init__(self, name: str, binary: str, model: str, flags: tuple[str, ...]) -> None:
        self.name, self.binary, self.model, self.flags = name, binary, model, flags
        self.url = ""

    @contextlib.contextmanager
    def fresh(self) -> Iterator[object]:
        with llama_server(self.binary, self.model, SLOTS, 2048, *self.flags) as self.url:
            yield self

    def answer(self, prompt: str, extra: dict[str, object], tokens: int) -> tuple[list[float], list[int]]:
        body = {
            "prompt": PROMPT_TOKENS[prompt],
            "n_predict": tokens,
            "stream": True,
            "cache_prompt": False,
            "return_tokens": True,
            **GREEDY,
            **extra,
        }
        times: list[float] = []
        out: list[int] = []
        with httpx.stream("POST", f"{self.url}/completion", json=body, timeout=TIMEOUT_S) as reply:
            for line in reply.iter_lines():
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[6:])
                got = event.get("tokens") or []
                n = len(got) or (1 if event.get("content") else 0)
                times += [time.monotonic()] * n
                out += got
        return times, out


@dataclass(frozen=True)
class StreamsRun:
    rate: float  # the sum of each answer's decode rate: its tokens after the first over its first to its last
    # All answers' tokens over the time from the requests to the last token: their prompts included, whenever each
    # server computes them (kvpoold starts an answer as soon as its prompt is computed, so its first answers decode
    # beside the later prompts, which their own rates count; llama-server, given them at once, computes every prompt
    # before the first answer starts).
    end_to_end: float
    # All answers' tokens over the mean time from the requests to an answer's last token: what the job's end hides
    # when answers end at different times (each task waits for its own answer, not for the last one).
    answer_ends: float
    answers: list[list[int]]


MEASURES = ("rate", "end_to_end", "answer_ends")  # what bench/out/speculative.json holds of each cell's rounds


def run_streams(server: Server, workload: str, n: int, tokens: int) -> StreamsRun:
    """``n`` answers at once: their decode rates (so that prompts computed before an answer's first token do not
    count), their rate end to end, and their tokens."""
    results: list[tuple[list[float], list[int]]] = [([], [])] * n
    barrier = threading.Barrier(n + 1)

    def one(i: int) -> None:
        prompt, extra = prompt_of(workload, i)
        barrier.wait(TIMEOUT_S)
        results[i] = server.answer(prompt, extra, tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    barrier.wait(TIMEOUT_S)
    asked = time.monotonic()
    for thread in threads:
        thread.join(TIMEOUT_S)
    rates = [(len(t) - 1) / (t[-1] - t[0]) for t, _ in results if len(t) > 1 and t[-1] > t[0]]
    answers = [out for _, out in results]
    if len(rates) < n:
        return StreamsRun(float("nan"), float("nan"), float("nan"), answers)
    tokens_out = sum(len(t) for t, _ in results)
    ends = [t[-1] - asked for t, _ in results]
    return StreamsRun(sum(rates), tokens_out / max(ends), tokens_out / statistics.mean(ends), answers)


def greedy_answers(server: Server, workloads: list[str], streams: int, tokens: int) -> dict[str, list[int]]:
    """Each prompt's answer from ``server``, one at a time."""
    return {prompt_of(w, i)[0]: server.answer(*prompt_of(w, i), tokens)[1] for w in workloads for i in range(streams)}


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def report(rates: dict[str, dict[str, list[float]]], workloads: list[str], streams: list[int], note: str) -> None:
    names = list(rates)
    print(f"\n{note}")
    header = f"{'workload':<8} {'streams':>7} " + " ".join(f"{n:>22}" for n in names)
    print(header)
    for w in workloads:
        for n in streams:
            key = f"{w}/{n}"
            print(f"{w:<8} {n:>7} " + " ".join(f"{med(rates[name][key]):>22.1f}" for name in names))
    base, fast = "kvpool", "kvpool guesses"
    others = [name for name in names if name.startswith("llama-server") or name == f"{fast} before"]
    if base in rates and fast in rates:
        print("\nratios (medians)")
        cols = [f"{fast} / {base}"] + [f"{fast} / {a}" for a in others]
        print(f"{'workload':<8} {'streams':>7} " + " ".join(f"{c:>36}" for c in cols))
        for w in workloads:
            for n in streams:
                key = f"{w}/{n}"
                f = med(rates[fast][key])
                values = [f / med(rates[base][key])] + [f / med(rates[a][key]) for a in others]
                print(f"{w:<8} {n:>7} " + " ".join(f"{v:>35.2f}x" for v in values))


def plot(rates: dict[str, dict[str, list[float]]], workloads: list[str], streams: list[int], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print("(no plot: pip install 'kvpool[bench]')", file=sys.stderr)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 4.5), squeeze=False)
    names = list(rates)
    width = 0.8 / len(names)
    for ax, w in zip(axes[0], workloads, strict=True):
        for k, name in enumerate(names):
            ax.bar(np.arange(len(streams)) + k * width, [med(rates[name][f"{w}/{n}"]) for n in streams], width,
                   label=name)  # fmt: skip
        ax.set_xticks(np.arange(len(streams)) + width * (len(names) - 1) / 2, [f"{n} streams" for n in streams])
        ax.set_title(f"{w}: decode tokens/s (2 cores)")
        ax.grid(True, axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF (default: the embedded Gemma 3 270M)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--draft-tokens", type=int, default=16)
    ap.add_argument("--draft-step-rows", type=int, default=16, help="guessed rows a step may hold (kvpool guesses)")
    ap.add_argument("--llama-server", help="a llama-server binary (default: one scripts/build-llama-server.sh built)")
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--streams", nargs="+", type=int, default=[1, 4, 8])
    ap.add_argument("--no-anchor-drafts", action="store_true", help="llama-server without drafts only")
    ap.add_argument("--no-anchors", action="store_true", help="no llama-server at all")
    ap.add_argument(
        "--jump-compare", action="store_true", help="also kvpool with guesses but without grammar jump-forward"
    )
    ap.add_argument("--before", metavar="PYTHON", help="also kvpool with guesses from this Python's install")
    ap.add_argument(
        "--predicted", action="store_true", help="also kvpool with guesses given each answer as its prediction"
    )
    args = ap.parse_args()
    model = default_model(args.model)
    binary = llama_server_binary(args.llama_server)
    anchors = {"llama-server": ()} if args.no_anchor_drafts else ANCHORS
    with contextlib.ExitStack() as stack:
        servers: list[Server] = []
        guessing = ("--draft-tokens", str(args.draft_tokens), "--draft-step-rows", str(args.draft_step_rows))
        kvpools = [("kvpool", WITHOUT_GUESSES), ("kvpool guesses", guessing)]
        pythons: dict[str, str] = {}  # a daemon run by another install; the rest by this one
        if args.before:
            kvpools.append(("kvpool guesses before", guessing))
            pythons["kvpool guesses before"] = args.before
        if args.jump_compare:
            kvpools += [
                ("kvpool forced appended", (*guessing, "--jump-forward", "append")),
                ("kvpool no jump-forward", (*guessing, "--jump-forward", "off")),
                ("kvpool appends alone", ("--draft-tokens", "0", "--jump-forward", "append")),
            ]
        for name, flags in kvpools:
            python = pythons.get(name, sys.executable)
            daemon = stack.enter_context(private_daemon(model, *DAEMON_FLAGS, *flags, python=python))
            servers.append(Kvpool(name, daemon.address))
        if binary and not args.no_anchors:
            servers += [LlamaServer(name, binary, model, flags) for name, flags in anchors.items()]
        elif not args.no_anchors:
            print("(no llama-server: build one with scripts/build-llama-server.sh, or pass --llama-server)")
        tokenize_prompts(daemon.address, args.workloads, max(args.streams))
        if args.predicted:
            expected = greedy_answers(servers[0], args.workloads, max(args.streams), args.tokens)
            guessing_daemon = stack.enter_context(private_daemon(model, *DAEMON_FLAGS, *guessing))
            servers.insert(2, Predicted("kvpool predicted", guessing_daemon.address, expected))
        # measure ("rate", "end_to_end", "answer_ends": StreamsRun's) -> server -> cell -> one value a round
        measured: dict[str, dict[str, dict[str, list[float]]]] = {m: {s.name: {} for s in servers} for m in MEASURES}
        answers: dict[str, dict[str, list[list[int]]]] = {s.name: {} for s in servers}
        guesses: dict[str, dict[str, int]] = {}
        for round_ in range(args.rounds):
            for w in args.workloads:
                for n in args.streams:
                    key = f"{w}/{n}"
                    order = servers[round_ % len(servers) :] + servers[: round_ % len(servers)]
                    for server in order:
                        with server.fresh():
                            before = server.counters()
                            run = run_streams(server, w, n, args.tokens)
                            after = server.counters()
                        for m in MEASURES:
                            measured[m][server.name].setdefault(key, []).append(getattr(run, m))
                        answers[server.name][key] = run.answers
                        if after:
                            total = guesses.setdefault(f"{server.name} {w}", {})
                            for k, v in after.items():
                                total[k] = total.get(k, 0) + v - before.get(k, 0)
                    print(f"round {round_ + 1}: {key}", file=sys.stderr, flush=True)
    same = sum(
        a == b
        for key in answers["kvpool"]
        for a, b in zip(answers["kvpool"][key], answers["kvpool guesses"][key], strict=True)
    )
    total = sum(len(v) for v in answers["kvpool"].values())
    # The same prompt ids and model: one stream's greedy answers agree, but for near-ties.
    agree = [
        a == b for key in answers["kvpool"] if key.endswith("/1") and key in answers.get("llama-server", {})
        for a, b in zip(answers["kvpool"][key], answers["llama-server"][key], strict=True)
    ]  # fmt: skip
    out = HERE / "out"
    out.mkdir(exist_ok=True)
    (out / "speculative.json").write_text(json.dumps({**measured, "guesses": guesses}, indent=2))
    setting = f"{args.rounds} rounds, {args.tokens} tokens, 2 threads"
    report(measured["rate"], args.workloads, args.streams, f"decode tokens/s, client-side, medians ({setting})")
    report(
        measured["end_to_end"],
        args.workloads,
        [n for n in args.streams if n > 1],
        f"the same runs end to end (all answers' tokens over the time from the requests to the last token, prompts "
        f"included): tokens/s, medians ({setting})",
    )
    report(
        measured["answer_ends"],
        args.workloads,
        [n for n in args.streams if n > 1],
        f"the same runs to each answer's end (all answers' tokens over the mean time from the requests to an "
        f"answer's last token, prompts included): tokens/s, medians ({setting})",
    )
    print(f"\nkvpool's answers with guesses the same as without, token for token: {same} of {total} (last round)")
    for key, plain in answers["kvpool"].items():
        for i, (a, b) in enumerate(zip(plain, answers["kvpool guesses"][key], strict=True)):
            if a != b:
                at = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
                print(f"  {key} stream {i}: the same for {at} tokens, then another ({len(a)} and {len(b)} tokens)")
    if agree:
        print(f"one stream, kvpool's answers and llama-server's the same token for token: {sum(agree)} of {len(agree)}")
        for key in (k for k in answers["kvpool"] if k.endswith("/1") and k in answers["llama-server"]):
            a, b = answers["kvpool"][key][0], answers["llama-server"][key][0]
            at = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            if a != b:
                print(f"  {key}: the same for {at} tokens, then another")
    print("\nguesses (all rounds)")
    for name, g in guesses.items():
        if g.get("drafted"):
            share = g["accepted"] / g["drafted"]
            jumped = g.get("jumped", 0)
            print(f"  {name:<22} {g['accepted']} of {g['drafted']} guessed tokens taken ({share:.0%}), "
                  f"{jumped} forced tokens without a step of their own, {g['generated']} generated")  # fmt: skip
    plot(measured["rate"], args.workloads, args.streams, out / "speculative.png")
    print(f"(plot: {out / 'speculative.png'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
