"""Extent allocation inside the pool's extent area: pure bookkeeping, no shared memory, unit-testable.

Contiguous-first: first fit over a free list kept sorted by offset, coalescing neighbours on free. The free
list is never stored: the pool rebuilds it from the extents its session table references (``from_used``),
so the table is the only persistent state.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, order=True)
class Extent:
    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


class ExtentAllocator:
    def __init__(self, start: int, size: int, align: int = 64):
        if start % align or size % align:
            raise ValueError("the extent area must be aligned")
        self.start, self.size, self.align = start, size, align
        self._free: list[Extent] = [Extent(start, size)] if size else []  # sorted by offset, never adjacent
        # Extents freed so far. Snapshots are never changed in place, so while this count stands still, every
        # extent's bytes are as they were: a reader on another thread (the remote writer) checks it instead of
        # rereading megabytes.
        self.frees = 0

    @classmethod
    def from_used(cls, start: int, size: int, used: list[Extent], align: int = 64) -> ExtentAllocator:
        """Rebuild the free list from the extents in use (at attach); overlapping extents are refused."""
        allocator = cls(start, size, align)
        allocator._free = []
        cursor = start
        for extent in sorted(used):
            if extent.offset < cursor or extent.end > start + size:
                raise ValueError(f"extent {extent} overlaps another or leaves the extent area")
            if extent.offset > cursor:
                allocator._free.append(Extent(cursor, extent.offset - cursor))
            cursor = extent.end
        if cursor < start + size:
            allocator._free.append(Extent(cursor, start + size - cursor))
        return allocator

    def rounded(self, nbytes: int) -> int:
        return max(self.align, -(-nbytes // self.align) * self.align)

    def allocate(self, nbytes: int) -> Extent | None:
        """The lowest free extent that fits ``nbytes`` (rounded up to the alignment), or None."""
        need = self.rounded(nbytes)
        for i, hole in enumerate(self._free):
            if hole.length >= need:
                if hole.length == need:
                    del self._free[i]
                else:
                    self._free[i] = Extent(hole.offset + need, hole.length - need)
                return Extent(hole.offset, need)
        return None

    def free(self, extent: Extent) -> None:
        self.frees += 1  # first: a reader that sees the old count must not miss a free already under way
        i = bisect.bisect_left(self._free, extent)
        before = self._free[i - 1] if i > 0 else None
        after = self._free[i] if i < len(self._free) else None
        if (before and before.end > extent.offset) or (after and extent.end > after.offset):
            raise ValueError(f"double free or overlap: {extent}")
        merged = extent
        if after and merged.end == after.offset:
            merged = Extent(merged.offset, merged.length + after.length)
            del self._free[i]
        if before and before.end == merged.offset:
            merged = Extent(before.offset, before.length + merged.length)
            i -= 1
            del self._free[i]
        self._free.insert(i, merged)

    @property
    def free_bytes(self) -> int:
        return sum(e.length for e in self._free)

    @property
    def largest_free(self) -> int:
        return max((e.length for e in self._free), default=0)

    @property
    def holes(self) -> list[Extent]:
        return list(self._free)
