"""Where a session's cells sit in llama.cpp's positions, derived from its tokens alone.

With most models a session's token i is at position i. A model that takes M-RoPE positions (Qwen2-VL and its
kind) puts an image's cells on a grid: every cell of it at the image's first position in time, and the text after
it ``n_pos`` positions on (the grid's longer side), not ``n_tokens`` — so past an image the two part. The
placeholders that stand for such an image's cells in the tokens (media/media_cache.py) say so themselves: they lie
in a band of their own below the ordinary placeholders, the first marked as a start and carrying ``n_pos``. A
session's positions then travel with its tokens through every tier (pool, disk, Redis, a restart) and come out the
same for every session that holds the same tokens (a shared prefix), with nothing stored beside them.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

GRID_SPAN = 1 << 30  # the band: tokens in [-2**31, -2**30 - 1]
_BAND_TOP = -(1 << 30) - 1
_START = 1 << 29  # the first cell's mark
_POS_BITS = 12
MAX_N_POS = (1 << _POS_BITS) - 1  # the most positions a grid medium may span (its longer side)
_HASH_BITS = 29 - _POS_BITS


def grid_placeholders(key: str, n_tokens: int, n_pos: int) -> list[int]:
    """The placeholders of a medium whose ``n_tokens`` cells span ``n_pos`` positions: the first carries the
    start mark and ``n_pos``, every one a hash of the medium's content and its place in it (so that sessions
    holding the same medium at the same place match token for token, and sessions holding another do not)."""
    if not 0 < n_pos <= MAX_N_POS:
        raise ValueError(f"a medium spanning {n_pos} positions (at most {MAX_N_POS})")
    base = xxhash.xxh3_64_intdigest(key.encode())
    first = _START | (n_pos << _HASH_BITS) | (base % (1 << _HASH_BITS))
    rest = [(base + j) % _START for j in range(1, n_tokens)]
    return [_BAND_TOP - v for v in (first, *rest)]


def in_band(token: int) -> bool:
    return token <= _BAND_TOP


@dataclass(frozen=True, slots=True)
class Run:
    """A grid medium's cells among a session's tokens: ``n_tokens`` from ``start`` on, spanning ``n_pos``."""

    start: int
    n_tokens: int
    n_pos: int

    @property
    def end(self) -> int:
        return self.start + self.n_tokens


def runs_of(tokens: Sequence[int]) -> list[Run]:
    """The grid media among ``tokens``, in order."""
    runs: list[Run] = []
    start, n_pos = -1, 0
    for i, token in enumerate(tokens):
        if not in_band(token):
            if start >= 0:
                runs.append(Run(start, i - start, n_pos))
                start = -1
            continue
        v = _BAND_TOP - token
        if v & _START:
            if start >= 0:
                runs.append(Run(start, i - start, n_pos))
            start, n_pos = i, (v >> _HASH_BITS) & MAX_N_POS
        elif start < 0:  # a band token with no start before it: not written by grid_placeholders
            raise ValueError(f"token {i} ({token}) continues a grid medium that does not start")
    if start >= 0:
        runs.append(Run(start, len(tokens) - start, n_pos))
    return runs


class Positions:
    """The position of each of a session's cells, from its grid media (none: position = index)."""

    def __init__(self, runs: list[Run]):
        self.runs = runs
        self._starts = [r.start for r in runs]
        # positions fewer than cells before each run's end, summed over the runs up to it
        self._shift_after: list[int] = []
        shift = 0
        for r in runs:
            shift += r.n_tokens - r.n_pos
            self._shift_after.append(shift)

    @classmethod
    def of(cls, tokens: Sequence[int]) -> Positions:
        if not tokens or min(tokens) > _BAND_TOP:  # (no grid medium: the common case, at C speed)
            return cls([])
        return cls(runs_of(tokens))

    def floor(self, i: int) -> int:
        """``i``, or the start of the grid medium ``i`` falls inside: the longest cut at most ``i`` that keeps
        whole cells."""
        k = bisect_right(self._starts, i) - 1
        return self.runs[k].start if k >= 0 and self.runs[k].start < i < self.runs[k].end else i

    def at(self, i: int) -> int:
        """The position of cell ``i``; for ``i`` past the last cell, the position the next token takes. Every cell
        of a grid medium is at its first cell's position, and llama.cpp removes cells by position, so cutting a
        sequence at ``at(i)`` keeps exactly cells [0, i) only where ``i`` is not inside a grid medium."""
        if not self.runs:
            return i
        k = bisect_right(self._starts, i) - 1  # the last run starting at or before i
        if k < 0:
            return i
        r = self.runs[k]
        before = self._shift_after[k - 1] if k else 0
        if i < r.end:
            return r.start - before
        return i - self._shift_after[k]
