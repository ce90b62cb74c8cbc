"""The warm tier: session snapshots in one fixed-size shared-memory segment (segment.py).

Layout (layout.py): a header page, a session table of fixed-size entries (entry_table.py: states, and two snapshot
records each, switched by one store), and an extent area managed by ExtentAllocator. Only the table is persistent
state: the free list is rebuilt from it at attach. Pool writes a snapshot's tokens after its state, checksums the
payload, commits it through the table, and verifies it before it is read back.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import numpy as np

from kvpool.daemon.kv.pool.allocator import Extent, ExtentAllocator
from kvpool.daemon.kv.pool.checksum import checksum
from kvpool.daemon.kv.pool.entry_table import EntryTable
from kvpool.daemon.kv.pool.layout import (
    ALIGN,
    ENTRY,
    HEADER,
    HOT_TYPES,
    LIVE,
    NO_PREFIX,
    PREFIX,
    TIER_POOL,
    UNSAVED,
    Snapshot,
    payload_bytes,
)
from kvpool.daemon.kv.pool.segment import PoolError, Segment
from kvpool.protocol.status import PoolStatus

log = logging.getLogger("kvpool.pool")


class Pool:
    def __init__(self, segment: Segment):
        self.name = segment.name
        self.created = segment.created
        self._segment = segment
        self._map = segment.mapping
        self.header = np.frombuffer(self._map, dtype=HEADER, count=1)
        h = self.header[0]
        self.size = int(h["pool_size"])
        self.table = np.frombuffer(self._map, dtype=ENTRY, count=int(h["entries"]), offset=int(h["table_offset"]))
        self.entry_table = EntryTable(self.table, self._free_extent)
        # The table's operations, called on the pool by the tiers and recovery (entry_table.py says what each does).
        table = self.entry_table
        self.entries, self.committed, self.claim, self.touch = table.entries, table.committed, table.claim, table.touch
        self.release, self.mark_evicted, self.discard = table.release, table.mark_evicted, table.discard
        self.mark_unsaved, self.settle, self.commit = table.mark_unsaved, table.settle, table.commit
        start, size = int(h["area_offset"]), int(h["area_size"])
        used, self.unowned = self._owned_extents(start, size)
        self.allocator = ExtentAllocator.from_used(start, size, used, ALIGN)

    @classmethod
    def open(cls, name: str, size: int, entries: int, fingerprint: str, kv_layout: str, **options: Any) -> Pool:
        """Attach to the segment ``name`` if it exists and matches, else create it (``options``: Segment.open's
        mode, reset, gid); PoolError says what to do when neither can be. The daemon holds an flock on the segment
        while it runs, so two daemons never share one."""
        segment = Segment.open(name, size, entries, fingerprint, kv_layout, **options)
        try:
            pool = cls(segment)
        except ValueError as exc:
            segment.shm.close_fd()
            raise PoolError(
                f"Pool segment {name} has a corrupt session table ({exc}); start with --reset-pool."
            ) from None
        if not segment.created:
            pool.header[0]["generation"] += 1
        return pool

    @staticmethod
    def unlink(name: str) -> bool:
        return Segment.unlink(name)

    def close(self) -> None:
        """Unmap and unlock (the segment stays for the next daemon)."""
        self.entry_table.close()  # (the table's operations bound above hold the entry table, not the memory)
        del self.header, self.table
        self._segment.close()

    def _owned_extents(self, start: int, size: int) -> tuple[list[Extent], set[int]]:
        """The extents the committed records hold, and the entries whose record is damaged: its extent leaves the
        area or overlaps one already taken. One damaged record must not cost every other session: its extent is
        not owned (never freed), and its session's restore reports SESSION_CORRUPT (the checksum cannot match
        bytes it does not own, or will not once they are reused)."""
        records = sorted(
            (s.extent, e.index, s) for e in self.entries() if (s := e.snapshot) is not None and s.tier == TIER_POOL
        )
        kept: list[tuple[Extent, int, Snapshot]] = []
        unowned: set[int] = set()
        for record in records:
            extent, index, snap = record
            if extent.offset < start or extent.end > start + size:
                unowned.add(index)
            elif kept and extent.offset < kept[-1][0].end:
                # Two records claim the same bytes: at most one can be right, the one whose checksum matches.
                if self.verify(snap) and not self.verify(kept[-1][2]):
                    unowned.add(kept.pop()[1])
                    kept.append(record)
                else:
                    unowned.add(index)
            else:
                kept.append(record)
        for index in unowned:
            log.warning("pool entry %d has a damaged snapshot record: its session is corrupt", index)
        return [extent for extent, _, _ in kept], unowned

    def _free_extent(self, index: int, snap: Snapshot) -> None:
        if index in self.unowned:  # a damaged record found at attach: its bytes were never its own
            self.unowned.discard(index)
        else:
            self.allocator.free(snap.extent)

    # ------------------------------------------------------------------ snapshots in the extent area

    def view(self, offset: int, length: int) -> memoryview:
        return memoryview(self._map)[offset : offset + length]

    def address(self, offset: int, length: int) -> ctypes.Array[ctypes.c_uint8]:
        """A ctypes array over pool bytes, for llama.cpp to read or write in place (delete it after use)."""
        return (ctypes.c_uint8 * length).from_buffer(self._map, offset)

    def commit_written(
        self,
        index: int,
        extent: Extent,
        state_bytes: int,
        tokens: list[int],
        n_kv: int,
        prefix_entry: int = NO_PREFIX,
        prefix_len: int = 0,
        kv_type: int = HOT_TYPES,
        raw_bytes: int = 0,
    ) -> Snapshot:
        """Finish a pool snapshot whose state bytes are already in ``extent``: append its tokens, checksum the
        whole payload, commit."""
        payload = payload_bytes(state_bytes, len(tokens))
        self.write_tokens(extent.offset + state_bytes, tokens)
        digest = checksum(self.view(extent.offset, payload))
        return self.commit(
            index,
            TIER_POOL,
            extent,
            state_bytes,
            len(tokens),
            n_kv,
            digest,
            payload,
            prefix_entry,
            prefix_len,
            kv_type,
            raw_bytes,
        )

    def verify(self, snap: Snapshot) -> bool:
        return checksum(self.view(snap.offset, payload_bytes(snap.state_bytes, snap.n_tokens))) == snap.checksum

    def intact(self, index: int, snap: Snapshot) -> bool:
        """The entry's record can be read: inside its extent and the area, and not found damaged at attach."""
        return self.in_bounds(snap) and index not in self.unowned

    def in_bounds(self, snap: Snapshot) -> bool:
        """The record describes bytes inside its own extent, inside the extent area."""
        a = self.allocator
        return (
            a.start <= snap.offset
            and snap.offset + snap.length <= a.start + a.size
            and payload_bytes(snap.state_bytes, snap.n_tokens) <= snap.length
        )

    def tokens(self, snap: Snapshot) -> list[int]:
        start = snap.offset + snap.state_bytes
        return np.frombuffer(self._map, dtype="<i4", count=snap.n_tokens, offset=start).tolist()

    def write_tokens(self, offset: int, tokens: list[int]) -> None:
        np.frombuffer(self._map, dtype="<i4", count=len(tokens), offset=offset)[:] = tokens

    # ------------------------------------------------------------------ figures

    def usage(self) -> PoolStatus:
        a = self.allocator
        return PoolStatus(
            name=self.name,
            size_bytes=self.size,
            area_bytes=a.size,
            used_bytes=a.size - a.free_bytes,
            free_bytes=a.free_bytes,
            largest_free_extent_bytes=a.largest_free,
            entries=len(self.table),
            entries_used=int(np.count_nonzero(np.isin(self.table["state"], (LIVE, UNSAVED)))),
            prefix_entries=int(np.count_nonzero((self.table["state"] == LIVE) & (self.table["kind"] == PREFIX))),
        )
