"""How fast guesses from a session's own tokens could make bench/speculative.py's answers, at best, on this CPU.

Every step samples one token that no guess gave (the token after the last one taken), so an answer needs at least
one step for each of its tokens that the guesser's guess, made from the context just before it, does not start
with: a record's new value, a word the prompt does not have. This answers each prompt of bench/speculative.py
greedily without guesses, replays the guesser (engine/drafts.py, no grammar: a schema's forced text would make
fewer tokens unguessable, so the figure is a floor under the steps, and the speed a ceiling below the true one)
over each answer, and counts those tokens U. Every other token a guessed row at best, the fastest the answer can
be decoded is

    tokens / (U x a one-row step + (tokens - U) x a guessed row)

with the step and row times bench/guess_rows.py measures on this CPU (one sequence; pass them as --step-ms and
--row-ms: a guessed row's time is its computation and its logits). A target above that ceiling lies past what any
guessing from these tokens can give; below it, the gap is guesses priced under uncertainty (rows refused, and
right guesses not fed because their figures did not pay).

    python bench/guess_ceiling.py --step-ms 16.5 --row-ms 4.4 [--prompts 8] [--tokens 128]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import speculative as sp
from common import default_model, private_daemon

from kvpool.client import Client
from kvpool.daemon.config import Config
from kvpool.daemon.engine.drafts import Drafter

MOST = 64  # tokens per guess (its length does not matter to its first token)


def unguessed(prompt: list[int], answer: list[int], ends_turn: set[int]) -> int:
    """The answer's tokens that the guess from the context just before each does not start with."""
    tokens = list(prompt)
    drafter = Drafter(tokens, Config().draft_ngram, MOST, lambda t: t in ends_turn)
    count = 0
    for token in answer:
        guess = drafter.guess()
        count += not guess or guess[0] != token
        tokens.append(token)
    return count


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF (default: the embedded Gemma 3 270M)")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per workload (bench/speculative.py's streams)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--step-ms", type=float, required=True, help="a one-row decode step (bench/guess_rows.py)")
    ap.add_argument("--row-ms", type=float, required=True, help="a guessed row with its logits (bench/guess_rows.py)")
    ap.add_argument("--workloads", nargs="+", default=list(sp.WORKLOADS), choices=list(sp.WORKLOADS))
    args = ap.parse_args()
    model = default_model(args.model)
    flags = ("--threads", str(sp.THREADS), "--draft-tokens", "0", "--jump-forward", "off")
    print(f"{'workload':<8} {'unguessed tokens per answer':>28} {'ceiling tok/s':>14}")
    with private_daemon(model, *flags) as daemon:
        sp.tokenize_prompts(daemon.address, args.workloads, args.prompts)
        with Client(daemon.address, timeout=sp.TIMEOUT_S) as client:
            ends_turn = set(client.tokenize("<end_of_turn><eos>", special=True))  # (Gemma 3's ends of a turn)
        for w in args.workloads:
            counts, rates = [], []
            for i in range(args.prompts):
                prompt, extra = sp.prompt_of(w, i)
                _, answer = sp.Kvpool("kvpool", daemon.address).answer(prompt, extra, args.tokens)
                u = unguessed(sp.PROMPT_TOKENS[prompt], answer, ends_turn)
                counts.append(u)
                rates.append(len(answer) / ((u * args.step_ms + (len(answer) - u) * args.row_ms) / 1000))
            print(f"{w:<8} {statistics.mean(counts):>28.1f} {statistics.median(rates):>14.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
