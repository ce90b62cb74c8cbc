"""The pool's session table: one fixed-size entry per session (or shared prefix), its state (free, live, evicted,
unsaved), and its two snapshot records.

Crash consistency: a new snapshot is written to a fresh extent and checksummed first; then its record (the one not
in use) is filled in, and its version (one aligned 8-byte store) is set above the other record's: that store is
the commit. The old extent is freed after. A daemon killed at any instant therefore leaves, for every session, its
last committed snapshot intact; settle() finishes at attach what a crash interrupted.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from kvpool.daemon.kv.pool.allocator import Extent
from kvpool.daemon.kv.pool.layout import (
    EVICTED,
    FREE,
    HOT_TYPES,
    LIVE,
    NO_PREFIX,
    SESSION,
    TIER_POOL,
    UNSAVED,
    EntryInfo,
    Snapshot,
)


class EntryTable:
    def __init__(self, table: np.ndarray, free_extent: Callable[[int, Snapshot], None]):
        """``table``: the entries, in the segment; ``free_extent``: gives a pool snapshot's extent back (entry
        index, snapshot)."""
        self.table = table
        self._free_extent = free_extent

    def close(self) -> None:
        """Let go of the segment's memory, so that it can be unmapped."""
        del self.table

    def entries(self) -> list[EntryInfo]:
        return [self.entry(i) for i in np.nonzero(self.table["state"] != FREE)[0]]

    def entry(self, index: int) -> EntryInfo:
        e = self.table[index]
        return EntryInfo(
            int(index),
            int(e["state"]),
            int(e["kind"]),
            e["session"].decode(),
            e["token"].decode(),
            e["task"].decode(),
            float(e["created"]),
            float(e["last_used"]),
            self.committed(index),
        )

    def committed(self, index: int) -> Snapshot | None:
        records = self.table[index]["records"]
        k = int(np.argmax(records["version"]))
        r = records[k]
        if r["version"] == 0:
            return None
        return Snapshot(
            int(r["version"]),
            int(r["tier"]),
            int(r["offset"]),
            int(r["length"]),
            int(r["state_bytes"]),
            int(r["n_tokens"]),
            int(r["n_kv"]),
            int(r["checksum"]),
            int(r["prefix_len"]),
            int(r["prefix_entry"]),
            int(r["kv_type"]),
            int(r["raw_bytes"]),
        )

    def claim(self, session: str, token: str, task: str, kind: int = SESSION) -> int | None:
        """Write a new live entry; None when the table is full (an evicted tombstone is reused then)."""
        states = self.table["state"]
        free = np.nonzero(states == FREE)[0]
        if len(free) == 0:
            evicted = np.nonzero(states == EVICTED)[0]
            if len(evicted) == 0:
                return None
            free = evicted[np.argsort(self.table["last_used"][evicted])]
        index = int(free[0])
        if states[index] == EVICTED:  # a crash inside mark_evicted can leave a tombstone that still holds an extent
            self._free_committed(index)
        e = self.table[index]
        e["state"] = FREE
        now = time.time()
        e["kind"] = kind
        e["session"], e["token"], e["task"] = session.encode(), token.encode(), task.encode()
        e["created"] = e["last_used"] = now
        e["records"]["version"] = 0
        e["state"] = LIVE  # last: the entry exists only once it is complete
        return index

    def touch(self, index: int) -> None:
        self.table[index]["last_used"] = time.time()

    def release(self, index: int) -> None:
        """Forget an entry (session closed or expired); its pool extent is freed."""
        self._free_committed(index)
        self.table[index]["state"] = FREE

    def mark_evicted(self, index: int) -> None:
        """Keep only the session's id, so its owner gets SESSION_EVICTED instead of UNKNOWN_SESSION."""
        self.table[index]["state"] = EVICTED  # first: a crash from here on leaves a tombstone, never a record
        self._drop_records(index)

    def discard(self, index: int) -> None:
        """Drop a resident session's checkpoint to make room (its KV is still hot): the entry is UNSAVED until
        the next commit. The older record is cleared first: a crash in between leaves the newer one (with which
        recovery treats the entry as live), never a stale older snapshot."""
        self.table[index]["state"] = UNSAVED  # first
        records = self.table[index]["records"]
        newer = int(np.argmax(records["version"]))
        self._free_committed(index)
        records["version"][1 - newer] = 0
        records["version"][newer] = 0

    def mark_unsaved(self, index: int) -> None:
        """The session holds state its committed snapshot lacks and could not be saved (no room)."""
        self.table[index]["state"] = UNSAVED

    def settle(self) -> None:
        """At attach, before recovery, finish what a crash interrupted:
        - an UNSAVED entry with a committed snapshot is live: a crash hit between a commit and its state store,
          or inside discard, which runs before the session's final message (so the turn was not acknowledged);
          one without is a tombstone (SESSION_EVICTED);
        - a tombstone that still holds a record (a crash inside mark_evicted) gives its extent back."""
        for index in map(int, np.nonzero(self.table["state"] == UNSAVED)[0]):
            self.table[index]["state"] = LIVE if self.committed(index) is not None else EVICTED
        for index in map(int, np.nonzero(self.table["state"] == EVICTED)[0]):
            self._drop_records(index)

    def commit(
        self,
        index: int,
        tier: int,
        extent: Extent | None,
        state_bytes: int,
        n_tokens: int,
        n_kv: int,
        digest: int,
        payload_bytes: int,
        prefix_entry: int = NO_PREFIX,
        prefix_len: int = 0,
        kv_type: int = HOT_TYPES,
        raw_bytes: int = 0,
    ) -> Snapshot:
        """Switch the entry to a new snapshot already written and checksummed; free the previous extent.
        ``kv_type``/``raw_bytes``: what it was compressed to, and its state's size uncompressed (0: as stored)."""
        previous = self.committed(index)
        records = self.table[index]["records"]
        k = 0 if previous is None else 1 - int(np.argmax(records["version"]))
        r = records[k]
        r["tier"] = tier
        r["offset"] = extent.offset if extent else 0
        r["length"] = extent.length if extent else payload_bytes
        r["state_bytes"], r["n_tokens"], r["n_kv"], r["checksum"] = state_bytes, n_tokens, n_kv, digest
        r["prefix_entry"], r["prefix_len"] = prefix_entry, prefix_len
        r["kv_type"], r["raw_bytes"] = kv_type, raw_bytes or state_bytes
        version = 1 if previous is None else previous.version + 1
        records["version"][k] = version  # the commit: one aligned 8-byte store
        if self.table[index]["state"] == UNSAVED:
            self.table[index]["state"] = LIVE  # saved again (a crash just before this is settled at attach)
        if previous is not None and previous.tier == TIER_POOL:
            self._free_extent(index, previous)
        snap = self.committed(index)
        assert snap is not None and snap.version == version
        return snap

    def _drop_records(self, index: int) -> None:
        """Free the committed snapshot's extent and clear both records."""
        self._free_committed(index)
        self.table[index]["records"]["version"] = 0

    def _free_committed(self, index: int) -> None:
        snap = self.committed(index)
        if snap is not None and snap.tier == TIER_POOL:
            self._free_extent(index, snap)
