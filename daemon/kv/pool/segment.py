"""The pool's shared-memory segment: created (every page reserved, then formatted) or attached (its header checked
against this daemon's model, KV layout and sizes), locked so that two daemons never share one, mapped, and
unlinked on --reset-pool. The segment outlives the daemon, so a restarted daemon attaches to it and recovers every
session; what it holds is laid out by layout.py and read and written through Pool (pool.py).
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
from dataclasses import dataclass

import numpy as np
import posix_ipc

from kvpool.daemon.kv.pool.layout import ALIGN, ENTRY, HEADER, HEADER_BYTES, LAYOUT_VERSION, LIVE, MAGIC, SESSION

log = logging.getLogger("kvpool.kv")


class PoolError(Exception):
    """The segment cannot be created or attached; the message says what to do."""


def _lock(shm: posix_ipc.SharedMemory) -> None:
    try:
        fcntl.flock(shm.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        shm.close_fd()
        raise PoolError(
            f"Pool segment {shm.name} is in use by another running kvpoold; give each daemon its own --pool-name."
        ) from None


def _live_sessions(shm: posix_ipc.SharedMemory) -> int:
    """How many live sessions a segment's table holds, for the log of a --reset-pool; 0 when it cannot be read as a
    pool (too small, not formatted, another layout)."""
    if shm.size < HEADER_BYTES:
        return 0
    with mmap.mmap(shm.fd, shm.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as mapping:
        h = np.frombuffer(mapping, dtype=HEADER, count=1)[0]
        if h["magic"] != MAGIC or h["layout"] != LAYOUT_VERSION:
            return 0
        entries, offset = int(h["entries"]), int(h["table_offset"])
        if offset + entries * ENTRY.itemsize > shm.size:
            return 0
        table = np.frombuffer(mapping, dtype=ENTRY, count=entries, offset=offset)
        held = int(np.count_nonzero((table["state"] == LIVE) & (table["kind"] == SESSION)))
        del h, table
    return held


def _map(fd: int, size: int) -> mmap.mmap:
    # MAP_POPULATE maps every page now, once: otherwise the first snapshot written to each extent pays a page
    # fault per 4 KiB, which costs as much as copying the snapshot.
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))


@dataclass
class Segment:
    """A mapped, locked segment: the daemon holds its flock until close()."""

    shm: posix_ipc.SharedMemory
    mapping: mmap.mmap
    created: bool

    @property
    def name(self) -> str:
        return str(self.shm.name)

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
    ) -> Segment:
        """Attach to the segment ``name`` if it exists and matches, else create it (O_EXCL, fallocate)."""
        if reset:
            try:
                existing = posix_ipc.SharedMemory(name)
            except posix_ipc.ExistentialError:
                pass
            else:
                _lock(existing)  # never discard a pool another daemon is using
                held = _live_sessions(existing)
                existing.close_fd()
                cls.unlink(name)
                log.warning(
                    "--reset-pool: discarded pool segment %s with the %d sessions it held (their spill files go too)",
                    name,
                    held,
                )
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
    def _attach(cls, name: str, want_size: int, want_entries: int, fingerprint: str, kv_layout: str) -> Segment:
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
        del h
        if problem:
            mapping.close()
            shm.close_fd()
            raise PoolError(
                f"Pool segment {name} {problem}; start with --reset-pool to discard it, or pass another --pool-name."
            )
        return cls(shm, mapping, created=False)

    @staticmethod
    def unlink(name: str) -> bool:
        try:
            posix_ipc.unlink_shared_memory(name)
            return True
        except posix_ipc.ExistentialError:
            return False

    def close(self) -> None:
        """Unmap and unlock (the segment stays for the next daemon). Views into the mapping must be gone."""
        self.mapping.close()
        self.shm.close_fd()
