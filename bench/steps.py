"""Where the steps' time goes: a summary of kvpoold's step log (the ``step_log`` setting, engine/step_log.py).

Without ``--log`` it runs one: a private daemon (bench/speculative.py's settings, with guesses unless
``--without``) writes its step log while ``--streams`` answers of a bench/speculative.py workload run at once for
``--rounds`` rounds, then the log is summarised. Three tables:

- steps: those that carry a prompt chunk (decoded in one call, or in parts: the chunk apart from the decode rows,
  llama/decode_groups.py), and the decode steps by how many sequences decode in them: their count,
  time, median time, rows (each decode token and each guessed token is a row with its logits), tokens given, and
  the measured time over the cost model's prediction;
- what a row costs: within the decode steps of each width, a least-squares line of the step's time on its rows
  (where the rows vary), and so the least share of its guessed rows a guess must have taken to pay for the job
  (a row's cost over a row's cost plus the step's fixed part shared by its sequences; docs/speculative.md);
- guesses by kind (the match length; 0: the grammar's forced text; negative: a substitution; "p" before it: a
  match in the request's prediction): how many, their rows, the tokens taken, per row, and how often the first
  token was.

    python bench/steps.py [--log PATH] [--workload json] [--streams 8] [--rounds 2] [--tokens 128] [--without]
                          [--flag=--draft-step-rows --flag=32 ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import msgspec
import numpy as np
import speculative as sp
from common import default_model, private_daemon

from kvpool.daemon.engine.step_log import StepRecord

PROMPT = -1  # the group of steps that carry a prompt chunk
IN_PARTS = -2  # ... and those of them decoded in parts (llama/decode_groups.py: the chunk apart from the rows)
FIT_STEPS = 10  # decode steps of one width a row's cost is fitted from, at least


def record_log(
    path: Path, workload: str, streams: int, rounds: int, tokens: int, without: bool, flags: list[str]
) -> None:
    path.unlink(missing_ok=True)
    guesses = sp.WITHOUT_GUESSES if without else ()
    with private_daemon(default_model(None), *sp.DAEMON_FLAGS, *guesses, *flags, "--step-log", str(path)) as daemon:
        sp.tokenize_prompts(daemon.address, [workload], streams)
        server = sp.Kvpool("kvpool", daemon.address)
        for round_ in range(rounds):
            run = sp.run_streams(server, workload, streams, tokens)
            print(f"round {round_ + 1}: {run.rate:.1f} tok/s summed, {run.end_to_end:.1f} end to end", flush=True)


def rows(step: StepRecord) -> int:
    return sum(item.fed + item.guessed for item in step.items if item.pending == 1)


def prompt_tokens(step: StepRecord) -> int:
    return sum(item.fed for item in step.items if item.pending > 1)


def summarise(steps: list[StepRecord]) -> None:
    groups: dict[int, list[StepRecord]] = defaultdict(list)  # sequences decoding -> its steps (PROMPT: a prompt's)
    for step in steps:
        prompt = any(item.pending > 1 for item in step.items)
        decoding = sum(1 for item in step.items if item.pending == 1)
        groups[(IN_PARTS if step.decodes > 1 else PROMPT) if prompt else decoding].append(step)
    header = ("steps", "count", "seconds", "median ms", "prompt", "rows", "tokens", "measured/pred")
    widths = (6, 8, 10, 7, 6, 7, 14)
    print(f"{header[0]:<12} " + " ".join(f"{h:>{w}}" for h, w in zip(header[1:], widths, strict=True)))
    for decoding in sorted(groups):
        group = groups[decoding]
        name = {PROMPT: "prompt", IN_PARTS: "prompt,parts"}.get(decoding, f"{decoding} decoding")
        given = sum(item.sampled for step in group for item in step.items)
        ratio = statistics.median(step.ms / step.predicted_ms for step in group)
        print(
            f"{name:<12} {len(group):>6} {sum(s.ms for s in group) / 1e3:>8.2f} "
            f"{statistics.median(s.ms for s in group):>10.1f} {sum(map(prompt_tokens, group)) / len(group):>7.0f} "
            f"{sum(map(rows, group)) / len(group):>6.1f} {given / len(group):>7.1f} {ratio:>14.2f}"
        )
    print(f"\n{'decoding':<9} {'steps':>6} {'fixed ms':>9} {'ms a row':>9} {'pays from':>10}")
    for sequences, group in groups.items():
        if sequences in (PROMPT, IN_PARTS) or len(group) < FIT_STEPS or len({rows(s) for s in group}) < 3:
            continue
        per_row, fixed = np.polyfit([rows(s) for s in group], [s.ms for s in group], 1)
        if per_row <= 0 or fixed <= 0:  # too few or too noisy steps to tell a row from the step
            print(f"{sequences:<9} {len(group):>6} {'(noise)':>9}")
            continue
        pays = per_row / (per_row + fixed / sequences)
        print(f"{sequences:<9} {len(group):>6} {fixed:>9.1f} {per_row:>9.2f} {pays:>10.2f}")
    # (kind, from the prediction) -> (guessed, taken) per guess
    kinds: dict[tuple[int, bool], list[tuple[int, int]]] = defaultdict(list)
    for step in steps:
        for item in step.items:
            if item.guessed and item.guess_kind is not None:
                kinds[item.guess_kind, item.predicted].append((item.guessed, item.sampled - 1))
    print(f"\n{'kind':>5} {'guesses':>8} {'rows':>6} {'taken':>6} {'per row':>8} {'first taken':>12}")
    for kind, predicted in sorted(kinds):
        g = kinds[kind, predicted]
        fed, taken = sum(d for d, _ in g), sum(a for _, a in g)
        first = sum(1 for _, a in g if a > 0) / len(g)
        name = f"p{kind}" if predicted else str(kind)
        print(f"{name:>5} {len(g):>8} {fed:>6} {taken:>6} {taken / fed:>8.2f} {first:>12.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--log", help="a step log to summarise (default: record one, as above)")
    ap.add_argument("--workload", default="json", choices=list(sp.WORKLOADS))
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--without", action="store_true", help="the daemon without guesses and jump-forward")
    ap.add_argument(
        "--flag", action="append", default=[], help="a kvpoold flag more (repeat: --flag=--draft-step-rows --flag=32)"
    )
    args = ap.parse_args()
    path = Path(args.log) if args.log else sp.HERE / "out" / "steps.jsonl"
    if not args.log:
        path.parent.mkdir(exist_ok=True)
        record_log(path, args.workload, args.streams, args.rounds, args.tokens, args.without, args.flag)
    decoder = msgspec.json.Decoder(StepRecord)
    steps = [decoder.decode(line) for line in path.read_bytes().splitlines() if line.strip()]
    if not steps:
        print(f"{path}: no steps", file=sys.stderr)
        return 1
    print(f"{path}: {len(steps)} steps")
    summarise(steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
