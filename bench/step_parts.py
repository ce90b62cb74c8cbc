"""A long prompt beside long conversations decoding: the step_parts setting side by side (llama/decode_groups.py).

Eight sessions, each with a prompt of about 1,200 tokens, decode their answers; once every one has its first
token, a ninth session sends a prompt as long and asks for one token. Its chunks go into the steps beside the eight
sessions' decode rows, and llama.cpp's flash attention, from 64 rows on, takes such a batch in tiles of 64 rows:
the tile holding the eight decode rows computes them against all nine sessions' cells. ``off`` decodes each such
step at once, ``always`` the chunk apart from the rows (one more pass over the weights), ``auto`` (the default)
whichever the cost model predicts faster. Each setting is its own private kvpoold (the default model, 2 threads, 9
hot slots, the shipped defaults otherwise), in rotating order each round. Printed, medians over the rounds: the
ninth prompt's time to its first token, the eight answers' summed decode rate (each one's tokens after its first
over its last token's time less its first's), the whole job's time, and the steps the daemon decoded in parts (its
step log).

    python bench/step_parts.py [--rounds 3] [--tokens 96] [--settings off auto always] [--model PATH]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
from common import default_model, private_daemon

from kvpool.client import Client
from kvpool.daemon.engine.step_log import StepRecord

SESSIONS = 8
TIMEOUT_S = 600.0


def prompt(name: str) -> str:
    """About 1,200 tokens, its own from the first words (no prefix shared with another session's)."""
    items = " ".join(f"item {name}-{k} weighs {(k * 37) % 97} grams and sits on shelf {k % 13};" for k in range(60))
    return f"Session {name}. Here is an inventory. {items} Summarise the inventory in a few sentences."


@dataclass
class Round:
    ninth_first_token_s: float
    decode_rate: float  # the eight answers' summed tokens/s after their first token
    job_s: float
    steps_in_parts: int


def one_round(address: str, step_log: Path, round_: int, tokens: int) -> Round:
    started = time.monotonic()
    decoding = threading.Condition()
    times: list[list[float]] = [[] for _ in range(SESSIONS)]

    def answer(i: int) -> None:
        with Client(address, timeout=TIMEOUT_S) as client, client.open_session() as session:
            for chunk in session.generate(prompt(f"{round_}.{i}"), max_tokens=tokens, temperature=0.0):
                if chunk.tokens:
                    times[i] += [time.monotonic()] * len(chunk.tokens)
                    with decoding:
                        decoding.notify()

    threads = [threading.Thread(target=answer, args=(i,)) for i in range(SESSIONS)]
    for t in threads:
        t.start()
    with decoding:  # every answer has its first token
        assert decoding.wait_for(lambda: all(times), TIMEOUT_S), "the eight answers did not start"
    sent = time.monotonic()
    with Client(address, timeout=TIMEOUT_S) as client, client.open_session() as session:
        next(iter(session.generate(prompt(f"{round_}.ninth"), max_tokens=1, temperature=0.0)))
        ninth = time.monotonic() - sent
    for t in threads:
        t.join(TIMEOUT_S)
    rate = sum((len(t) - 1) / (t[-1] - t[0]) for t in times if len(t) > 1 and t[-1] > t[0])
    lines = step_log.read_bytes().splitlines() if step_log.exists() else []
    steps = [msgspec.json.decode(line, type=StepRecord) for line in lines if line.strip()]
    return Round(ninth, rate, max(t[-1] for t in times) - started, sum(1 for s in steps if s.decodes > 1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF (default: the embedded Gemma 3 270M)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--settings", nargs="+", default=["off", "auto", "always"], choices=["off", "auto", "always"])
    args = ap.parse_args()
    model = default_model(args.model)
    results: dict[str, list[Round]] = {s: [] for s in args.settings}
    logs = Path(tempfile.mkdtemp(prefix="kvpool-step-parts-"))
    for round_ in range(args.rounds):
        order = args.settings[round_ % len(args.settings) :] + args.settings[: round_ % len(args.settings)]
        for setting in order:
            log = logs / f"{setting}-{round_}.jsonl"
            flags = ("--threads", "2", "--hot-slots", "9", "--context-size", "16384", "--step-parts", setting,
                     "--step-log", str(log))  # fmt: skip
            with private_daemon(model, *flags) as daemon:
                results[setting].append(one_round(daemon.address, log, round_, args.tokens))
            r = results[setting][-1]
            print(
                f"round {round_ + 1} {setting}: ninth prompt {r.ninth_first_token_s * 1e3:.0f} ms, "
                f"{r.decode_rate:.1f} tok/s, job {r.job_s:.1f} s, {r.steps_in_parts} steps in parts",
                flush=True,
            )
    print(f"\nmedians over {args.rounds} rounds ({SESSIONS} sessions of about 1,200 tokens decoding {args.tokens} "
          "tokens each; a ninth prompt as long, sent once all are decoding)")  # fmt: skip
    print(f"{'step_parts':>10} {'ninth first token ms':>21} {'eight decoding tok/s':>21} {'job s':>7} {'in parts':>9}")
    for setting, rounds in results.items():
        print(
            f"{setting:>10} {statistics.median(r.ninth_first_token_s for r in rounds) * 1e3:>21.0f} "
            f"{statistics.median(r.decode_rate for r in rounds):>21.1f} "
            f"{statistics.median(r.job_s for r in rounds):>7.1f} "
            f"{statistics.median(r.steps_in_parts for r in rounds):>9.0f}"
        )
    shutil.rmtree(logs, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
