"""The warm tier: one POSIX shared-memory segment of fixed size holding session snapshots.

Layout: a header page (magic, layout version, model fingerprint, KV layout, sizes, generation), a session
table of fixed-size entries, and an extent area managed by ExtentAllocator. Only the table is persistent
state: the free list is rebuilt from it at attach.

Crash consistency: every entry has two snapshot records. A new snapshot is written to a fresh extent and
checksummed, its record (the one not in use) is filled in, and then its version (one aligned 8-byte store)
is set above the other record's: that store is the commit. The old extent is freed after. A daemon killed
at any instant therefore leaves, for every session, its last committed snapshot intact.

The segment outlives the daemon, so a restarted daemon attaches to it and recovers every session.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import mmap
import os
import time

import numpy as np
import posix_ipc

from kvpool.daemon.kv.pool.allocator import Extent, ExtentAllocator
from kvpool.daemon.kv.pool.checksum import checksum
from kvpool.daemon.kv.pool.layout import (
    ALIGN,
    ENTRY,
    EVICTED,
    FREE,
    HEADER,
    HEADER_BYTES,
    HOT_TYPES,
    LAYOUT_VERSION,
    LIVE,
    MAGIC,
    NO_PREFIX,
    PREFIX,
    SESSION,
    TIER_POOL,
    UNSAVED,
    EntryInfo,
    Snapshot,
    payload_bytes,
)
from kvpool.protocol.status import PoolStatus

log = logging.getLogger("kvpool.pool")


def _lock(shm: posix_ipc.SharedMemory) -> None:
    try:
        fcntl.flock(shm.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        shm.close_fd()
        raise PoolError(
            f"Pool segment {shm.name} is in use by another running kvpoold; give each daemon its own --pool-name."
        ) from None


def _map(fd: int, size: int) -> mmap.mmap:
    # MAP_POPULATE maps every page now, once: otherwise the first snapshot written to each extent pays a page
    # fault per 4 KiB, which costs as much as copying the snapshot.
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))


class PoolError(Exception):
    """The segment cannot be created or attached; the message says what to do."""


class Pool:
    def __init__(self, shm: posix_ipc.SharedMemory, mapping: mmap.mmap, created: bool):
        self.name = shm.name
        self.created = created
        self._shm = shm
        self._map = mapping
        self.header = np.frombuffer(mapping, dtype=HEADER, count=1)
        h = self.header[0]
        self.size = int(h["pool_size"])
        self.table = np.frombuffer(mapping, dtype=ENTRY, count=int(h["entries"]), offset=int(h["table_offset"]))
        start, size = int(h["area_offset"]), int(h["area_size"])
        used, self.unowned = self._owned_extents(start, size)
        self.allocator = ExtentAllocator.from_used(start, size, used, ALIGN)

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

    # ------------------------------------------------------------------ create / attach

    @classmethod
    def open(
        cls,
        name: str,
        size: int,
        entries: int,
        fingerprint: str,
        kv_layout: str,
        *,
        mode: int = 0o600,
        reset: bool = False,
        gid: int | None = None,
    ) -> Pool:
        """Attach to the segment ``name`` if it exists and matches, else create it (O_EXCL, fallocate).
        The daemon holds an flock on the segment while it runs, so two daemons never share one."""
        if reset:
            try:
                existing = posix_ipc.SharedMemory(name)
            except posix_ipc.ExistentialError:
                pass
            else:
                _lock(existing)  # never discard a pool another daemon is using
                existing.close_fd()
                cls.unlink(name)
        try:
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=mode, size=0)
        except posix_ipc.ExistentialError:
            return cls._attach(name, size, entries, fingerprint, kv_layout)
        _lock(shm)
        if gid is not None:
            os.fchown(shm.fd, -1, gid)
            os.fchmod(shm.fd, mode)  # the creation mode went through the umask
        try:
            # posix_fallocate reserves every page now: a full /dev/shm fails here, not later with SIGBUS.
            os.posix_fallocate(shm.fd, 0, size)
            mapping = _map(shm.fd, size)
        except OSError as exc:
            shm.close_fd()
            shm.unlink()
            raise PoolError(
                f"Cannot reserve a {size}-byte pool in /dev/shm ({exc.strerror}); free space there "
                "or lower cache_pool_size."
            ) from None
        cls._format(mapping, size, entries, fingerprint, kv_layout)
        return cls(shm, mapping, created=True)

    @staticmethod
    def _format(mapping: mmap.mmap, size: int, entries: int, fingerprint: str, kv_layout: str) -> None:
        table_offset = HEADER_BYTES
        area_offset = -(-(table_offset + entries * ENTRY.itemsize) // 4096) * 4096
        area_size = (size - area_offset) // ALIGN * ALIGN
        if area_size < 1 << 16:
            raise PoolError(f"cache_pool_size {size} is too small for {entries} session entries; raise it.")
        header = np.frombuffer(mapping, dtype=HEADER, count=1)
        header[0] = (
            b"",
            LAYOUT_VERSION,
            entries,
            size,
            table_offset,
            area_offset,
            area_size,
            0,
            fingerprint.encode(),
            kv_layout.encode(),
        )
        # The magic goes last: a segment with a valid magic is always fully formatted.
        header[0]["magic"] = MAGIC
        del header

    @classmethod
    def _attach(cls, name: str, want_size: int, want_entries: int, fingerprint: str, kv_layout: str) -> Pool:
        try:
            shm = posix_ipc.SharedMemory(name)
        except posix_ipc.PermissionsError:
            raise PoolError(f"Pool segment {name} belongs to another user; pass a different --pool-name.") from None
        _lock(shm)
        size = shm.size
        if size < HEADER_BYTES:
            shm.close_fd()
            raise PoolError(f"Pool segment {name} is too small to be a kvpool pool; remove it with --reset-pool.")
        mapping = _map(shm.fd, size)
        h = np.frombuffer(mapping, dtype=HEADER, count=1)[0]
        problem = None
        if h["magic"] != MAGIC:
            problem = "is not a kvpool pool (or was never fully formatted)"
        elif h["layout"] != LAYOUT_VERSION:
            problem = f"has layout version {h['layout']}, this daemon writes {LAYOUT_VERSION}"
        elif h["fingerprint"].decode() != fingerprint:
            theirs = h["fingerprint"].decode()
            problem = f"holds sessions of another model (fingerprint {theirs}, this model {fingerprint})"
        elif h["kv_layout"].decode() != kv_layout:
            problem = f"was written with KV layout {h['kv_layout'].decode()!r}, this daemon uses {kv_layout!r}"
        elif int(h["pool_size"]) != size:
            problem = f"says it is {int(h['pool_size'])} bytes but is {size}"
        elif size != want_size:
            problem = f"is {size} bytes but cache_pool_size is {want_size}"
        elif int(h["entries"]) != want_entries:
            problem = f"has {int(h['entries'])} table entries but max_sessions + max_prefixes is {want_entries}"
        if problem:
            del h
            mapping.close()
            shm.close_fd()
            raise PoolError(
                f"Pool segment {name} {problem}; start with --reset-pool to discard it, or pass another --pool-name."
            )
        del h
        try:
            pool = cls(shm, mapping, created=False)
        except ValueError as exc:
            shm.close_fd()
            raise PoolError(
                f"Pool segment {name} has a corrupt session table ({exc}); start with --reset-pool."
            ) from None
        pool.header[0]["generation"] += 1
        return pool

    @staticmethod
    def unlink(name: str) -> bool:
        try:
            posix_ipc.unlink_shared_memory(name)
            return True
        except posix_ipc.ExistentialError:
            return False

    def close(self) -> None:
        """Unmap and unlock (the segment stays for the next daemon)."""
        del self.header, self.table
        self._map.close()
        self._shm.close_fd()

    # ------------------------------------------------------------------ table

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

    def _drop_records(self, index: int) -> None:
        """Free the committed snapshot's extent and clear both records."""
        self._free_committed(index)
        self.table[index]["records"]["version"] = 0

    def _free_committed(self, index: int) -> None:
        snap = self.committed(index)
        if snap is not None and snap.tier == TIER_POOL:
            self._free_extent(index, snap)

    def _free_extent(self, index: int, snap: Snapshot) -> None:
        if index in self.unowned:  # a damaged record found at attach: its bytes were never its own
            self.unowned.discard(index)
        else:
            self.allocator.free(snap.extent)

    # ------------------------------------------------------------------ snapshots

    def view(self, offset: int, length: int) -> memoryview:
        return memoryview(self._map)[offset : offset + length]

    def address(self, offset: int, length: int) -> ctypes.Array[ctypes.c_uint8]:
        """A ctypes array over pool bytes, for llama.cpp to read or write in place (delete it after use)."""
        return (ctypes.c_uint8 * length).from_buffer(self._map, offset)

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
