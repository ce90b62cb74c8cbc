"""Which of a step's items llama.cpp decodes together: pure logic, no llama.cpp.

All hot sequences share one KV (``kv_unified``), so a query row's attention mask spans every sequence's cells and
hides the others'. From ``ATTENTION_TILE_ROWS`` query rows on, llama.cpp's CPU flash attention takes a tiled path
(ggml-cpu's ops.cpp, ``GGML_FA_TILE_Q``): 64 consecutive rows of the batch against 64 cells at a time, skipping a
block of cells only when no row of the tile attends to any of them. A tile holding the decode rows of eight
sessions beside a prompt chunk attends to all of their cells, so such a step computes up to eight times the
attention it needs. Measured with Gemma 3 270M on 2 cores (2026-12-06, an Intel Xeon; eight sessions of 1,000
tokens each, `docs/decisions.md`): eight decode rows and a 128-token prompt chunk took 728 ms in one decode and
414 ms in two; below 64 rows llama.cpp computes each row against its own cells, and one decode is as fast as two.

So a step of several sequences with ``tile`` rows or more may be decoded in parts: the wide items (prompt chunks of
a tile or more) together, each tile of theirs holding one sequence but at its edges; the narrow ones (decode rows
with their guesses, short chunks) in a part of fewer than ``tile`` rows (a short chunk that does not fit there goes
with the wide ones; with no wide ones, more such parts). Each extra part costs one more pass over the weights: the
step cost model weighs that against the attention a tile of several sequences wastes, and the step runs in parts
only when they are predicted faster (CostModel.plan).
"""

from __future__ import annotations

from collections.abc import Sequence

ATTENTION_TILE_ROWS = 64  # ggml-cpu's GGML_FA_TILE_Q in the llama.cpp that llama-cpp-python 0.3.36 vendors


def decode_groups(rows: Sequence[int], tile: int) -> list[list[int]]:
    """The items' indices per decode, in the order they run: the wide items first, then the narrow ones. ``rows``:
    each item's rows (tokens fed, guesses included); ``tile``: the rows from which the tiled path is taken (0: the
    kernel never tiles, one decode)."""
    everything = list(range(len(rows)))
    if tile <= 0 or len(rows) < 2 or sum(rows) < tile:
        return [everything]
    wide = [i for i in everything if rows[i] >= tile]
    narrow = sorted((i for i in everything if rows[i] < tile), key=lambda i: (rows[i], i))
    parts: list[list[int]] = []
    part: list[int] = []
    held = 0
    for i in narrow:
        if held + rows[i] >= tile:
            if wide:  # a chunk that does not fit beside the rows goes with the wide ones: one sequence more there
                wide.append(i)
                continue
            parts.append(part)
            part, held = [], 0
        part.append(i)
        held += rows[i]
    if part:
        parts.append(part)
    return [wide, *parts] if wide else parts
