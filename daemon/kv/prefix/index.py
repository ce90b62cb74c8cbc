"""Shared prefixes and the index that finds them: pure bookkeeping (no llama.cpp, no pool access).

A prefix is a run of tokens many sessions start with (a task's system prompt), computed once. The index is
keyed by chained hashes of fixed-size token blocks, as vLLM's automatic prefix caching: block i's key hashes
block i's tokens together with block i-1's key, so one dictionary lookup per block finds the longest stored
prefix a session's tokens begin with, whatever text or request they came from. A hash only proposes a match;
the tokens themselves are compared before anything is shared, so a collision costs a miss, never a wrong
answer.

Two reference counts keep a prefix alive: ``users`` are the sessions whose KV or snapshot builds on it (its
pool snapshot must stay while any exist), ``hot_users`` the resident sessions whose cells it shares (its hot
copy must stay while any exist). A prefix with neither is evicted, least recently used first, before any
session snapshot.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvpool.daemon.kv.pool.layout import Snapshot
from kvpool.daemon.kv.positions import Positions


@dataclass(eq=False)
class Prefix:
    id: str
    task: str  # the task whose session computed it (for status)
    tokens: list[int]
    seq: int | None = None  # its llama.cpp sequence while it is in the unified KV
    # The lowest position its hot copy holds cells for: 0 unless a sliding-window model dropped the oldest
    # cells (a prefix longer than the window, or restored from a snapshot); positions below cannot be shared.
    lowest_position: int = 0
    entry: int | None = None  # its pool table entry, once its snapshot is committed there
    snapshot: Snapshot | None = None
    users: int = 0
    hot_users: int = 0
    last_used: float = field(default_factory=time.monotonic)
    hits: int = 0
    damaged: bool = False  # its snapshot failed its checksum: never offered again
    _positions: Positions | None = field(default=None, repr=False)

    @property
    def in_use(self) -> bool:
        return self.users > 0 or self.hot_users > 0

    @property
    def positions(self) -> Positions:
        """Where its cells sit (kv/positions.py): a shared length is a count of cells, llama.cpp shares by position."""
        if self._positions is None:
            self._positions = Positions.of(self.tokens)
        return self._positions


def block_keys(tokens: list[int], block: int) -> list[int]:
    """The chained key of every whole block of ``tokens``."""
    keys: list[int] = []
    key = 0
    for start in range(0, len(tokens) - block + 1, block):
        key = hash((key, *tokens[start : start + block]))
        keys.append(key)
    return keys


def common_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixIndex:
    def __init__(self, block: int):
        self.block = block
        self._by_key: dict[int, Prefix] = {}

    def add(self, prefix: Prefix) -> None:
        for key in block_keys(prefix.tokens, self.block):
            self._by_key[key] = prefix  # a newer prefix with the same leading blocks takes them over

    def remove(self, prefix: Prefix, others: Iterable[Prefix]) -> None:
        for key in block_keys(prefix.tokens, self.block):
            if self._by_key.get(key) is prefix:
                del self._by_key[key]
        for other in others:  # give the blocks the removed prefix had taken over back to their other owners
            if other is not prefix and not other.damaged:
                for key in block_keys(other.tokens, self.block):
                    self._by_key.setdefault(key, other)

    def longest_match(self, tokens: list[int]) -> tuple[Prefix, int] | None:
        """The stored prefix sharing the most leading tokens with ``tokens`` (at least one whole block), and
        how many it shares; None when no block matches."""
        found: Prefix | None = None
        matched_blocks = 0
        key = 0
        block = self.block
        for i, start in enumerate(range(0, len(tokens) - block + 1, block)):
            key = hash((key, *tokens[start : start + block]))
            prefix = self._by_key.get(key)
            if prefix is None:
                break
            found, matched_blocks = prefix, i + 1
        if found is None:
            return None
        length = common_length(tokens, found.tokens)
        if length < matched_blocks * block:  # a hash collision: nothing is shared on a hash alone
            return None
        return found, length

    def __len__(self) -> int:
        return len(self._by_key)


def shareable_length(prefix: Prefix, wanted: int, window: int) -> int:
    """How many of ``wanted`` leading positions a session may take from the prefix's hot copy and still
    continue exactly. A sliding-window model attends from position L to the ``window`` positions before L, so
    those cells must all be in the copy; a model without a window (0) needs every cell, which a hot copy has."""
    if window <= 0 or prefix.lowest_position <= 0:
        return wanted
    return wanted if wanted - window >= prefix.lowest_position else 0
