"""The price of a guessed row, on this CPU: the floor under any speculation that verifies its drafts.

A verified guess needs its row computed (the transformer over one more token) and its logits (the output
projection: Gemma 3's 262k-token vocabulary). This decodes one step of S sequences with 1 + k rows each, once with
logits for every row (as guesses are fed) and once for the last row only (as a prompt chunk is), and prints the
step times and what each extra row cost. A step of guesses can give at most one token per guessed row, so no
speculation that verifies its guesses passes 1 / (a row's time + its logits' time) tokens a second, however long
its guesses and however many are taken (docs/speculative.md, docs/targets.md). The short shapes show how the
logits rows' count is priced: llama.cpp computes one by a vector kernel and several by a matrix kernel in tiles two
rows wide (an AVX2 build) or four (an AVX-512 one), whose rows past the last whole tile may take a pass of their own
over the output weights (the step cost model's logits features, engine/cost_model.py).

    python bench/guess_rows.py [--model PATH] [--threads 2] [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from common import default_model, prefill, timed_decode

from kvpool.daemon.llama.model import Model

CONTEXT = 200  # tokens each sequence holds before the measured steps
# (sequences, guessed rows each): single rows and short guesses within and past a tile (llama.cpp's matrix kernel
# takes logits rows in tiles of two or four, and the rows past the last whole tile in a pass of their own), then
# long ones.
SHAPES = [
    (1, 0), (1, 1), (1, 2), (1, 3), (1, 4), (1, 5), (1, 16), (1, 32), (1, 63),
    (2, 0), (3, 0), (4, 0), (5, 0), (4, 16), (4, 63), (8, 0), (8, 16), (8, 63),
]  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF (default: the embedded Gemma 3 270M)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    model = Model(
        Path(default_model(args.model)), context_size=8 * 1024, hot_slots=8, batch_size=512, threads=args.threads,
        draft_rows=512,
    )  # fmt: skip
    tokens = model.tokenize("The quick brown fox jumps over the lazy dog. " * 30, add_bos=True)[:CONTEXT]
    for seq in range(8):
        prefill(model, seq, tokens)

    def step(seqs: int, k: int, every_row: bool) -> float:
        rows = 1 + k if every_row else 1
        return timed_decode(model, [(seq, tokens[: 1 + k], CONTEXT, rows) for seq in range(seqs)])

    print(f"one step, {args.threads} threads, medians of {args.repeat}")
    print(f"{'sequences':>9} {'rows each':>9} {'logits rows':>11} {'logits every row ms':>20} "
          f"{'last row only ms':>17} {'a row ms':>9} {'its logits ms':>14}")  # fmt: skip
    row_ms, logits_ms = [], []
    for seqs, k in SHAPES:
        every = statistics.median(step(seqs, k, True) for _ in range(args.repeat)) * 1000
        last = statistics.median(step(seqs, k, False) for _ in range(args.repeat)) * 1000
        base = statistics.median(step(seqs, 0, False) for _ in range(args.repeat)) * 1000
        extra = seqs * k
        row = (last - base) / extra if extra else float("nan")
        logits = (every - last) / extra if extra else float("nan")
        if extra >= 64:
            row_ms.append(row)
            logits_ms.append(logits)
        print(f"{seqs:>9} {1 + k:>9} {seqs * (1 + k):>11} {every:>20.1f} {last:>17.1f} {row:>9.2f} {logits:>14.2f}")
    if row_ms:
        row, logits = statistics.median(row_ms), statistics.median(logits_ms)
        print(f"\nsteps of 64 guessed rows and more: a row {row:.2f} ms, its logits {logits:.2f} ms: "
              f"at most {1000 / (row + logits):.0f} guessed tokens a second")  # fmt: skip
    model.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
