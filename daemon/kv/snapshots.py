"""Writing snapshots: checkpoints into the pool (whole, or only a session's cells past a shared prefix),
spills to the disk tier, and making room in both (least recently used first; an unused shared prefix goes
before any session's snapshot; with pool compression "when_full", the least recently used snapshots are
compressed before any is spilled; a session is evicted only when both tiers are full). Engine thread only."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import time
from collections.abc import Callable

import numpy as np

from kvpool.daemon.errors import RequestRefused
from kvpool.daemon.kv import policy
from kvpool.daemon.kv.codec.kv_types import KvType
from kvpool.daemon.kv.codec.state_format import StateBytes
from kvpool.daemon.kv.codec.tier_codec import TierCodec
from kvpool.daemon.kv.counters import TierCounters
from kvpool.daemon.kv.pool.allocator import Extent, ExtentAllocator
from kvpool.daemon.kv.pool.checksum import checksum
from kvpool.daemon.kv.pool.layout import (
    HOT_TYPES,
    NO_PREFIX,
    TIER_DISK,
    TIER_POOL,
    TOKEN_BYTES,
    Snapshot,
    payload_bytes,
)
from kvpool.daemon.kv.pool.segment import Pool
from kvpool.daemon.kv.prefix import links as prefix_links
from kvpool.daemon.kv.prefix.cache import PrefixCache
from kvpool.daemon.kv.sessions import Session, SessionTable
from kvpool.daemon.kv.spill import SpillDir
from kvpool.daemon.llama.model import Model
from kvpool.protocol import ErrorCode

log = logging.getLogger("kvpool.tiers")


class SessionCorrupt(RequestRefused):
    def __init__(self, session: Session, why: str):
        super().__init__(
            ErrorCode.SESSION_CORRUPT,
            f"Session {session.id}'s saved state is damaged ({why}); it was closed, open a new one.",
        )


def with_tokens(state: StateBytes, tokens: list[int]) -> bytes:
    """A snapshot's payload: its state, then its tokens as int32 (as the pool and spill files hold it)."""
    return b"".join((state, np.asarray(tokens, dtype="<i4").tobytes()))


class SnapshotWriter:
    def __init__(
        self,
        model: Model,
        pool: Pool,
        spill: SpillDir,
        sessions: SessionTable,
        prefixes: PrefixCache,
        counts: TierCounters,
        evict: Callable[[Session], None],
        codec: TierCodec,
        whole: bool = False,
    ):
        """``whole``: checkpoints hold every cell, shared prefix included, so another node can restore them."""
        self.model, self.pool, self.spill, self.sessions = model, pool, spill, sessions
        self.prefixes, self.counts, self.evict, self.codec = prefixes, counts, evict, codec
        self.whole_snapshots = whole

    def checkpoint(self, s: Session) -> None:
        """Write the resident session's state to a fresh pool extent (or straight to disk) and commit it."""
        assert s.slot is not None
        first = 0 if self.whole_snapshots else prefix_links.suffix_start(s)
        with self.model.cells_from(s.slot, first) as source:
            state_bytes = self.model.state_size(source)
            if self.codec.compress_on_write and self.codec.pool_type is not None:
                self._checkpoint_compressed(s, source, state_bytes, first, self.codec.pool_type)
                return
            extent = self._allocate(payload_bytes(state_bytes, len(s.tokens)), pinned=s)
            if extent is None:
                self._checkpoint_to_disk(s, source, state_bytes, first)
                return
            started = time.perf_counter()
            state = self.pool.address(extent.offset, state_bytes)
            try:
                written = self.model.save_state(source, state)
            except BaseException:
                self.pool.allocator.free(extent)
                raise
            finally:
                del state
        if written != state_bytes:
            self.pool.allocator.free(extent)
            raise RequestRefused(ErrorCode.INTERNAL, f"llama.cpp saved {written} of {state_bytes} state bytes.")
        previous = s.snapshot
        s.snapshot = self.pool.commit_written(
            s.entry, extent, state_bytes, s.tokens, s.n_kv, *prefix_links.snapshot_ref(s, first)
        )
        self._note_saved(s, first, state_bytes)
        if previous is not None and previous.tier == TIER_DISK:
            self.spill.remove(s.id, previous.version)
        self.counts.checkpoints += 1
        self.counts.checkpoint.add(state_bytes, time.perf_counter() - started)

    def _saved_state(self, source: int, state_bytes: int, to: KvType | None) -> tuple[StateBytes, int]:
        """The sequence's state saved into a private buffer (to compress it, or when the pool has no room), at
        ``to`` when given and the codec can read it: the bytes, and the type they are stored at."""
        buffer = (ctypes.c_uint8 * state_bytes)()
        written = self.model.save_state(source, buffer)
        if written != state_bytes:  # never commit a half-empty buffer over a good snapshot
            raise RequestRefused(ErrorCode.INTERNAL, f"llama.cpp saved {written} of {state_bytes} state bytes.")
        stored = self.codec.compress(memoryview(buffer).cast("B"), to) if to is not None else None
        if stored is None or to is None:
            return memoryview(buffer).cast("B"), HOT_TYPES
        return stored, to.ggml_id

    def _compressed_pool_state(self, snap: Snapshot, to: KvType) -> bytearray | None:
        """A pool snapshot's state at ``to`` (None when the codec cannot read it)."""
        view = self.pool.view(snap.offset, snap.state_bytes)
        try:
            return self.codec.compress(view, to)
        finally:
            view.release()

    def _checkpoint_compressed(self, s: Session, source: int, raw_bytes: int, first: int, to: KvType) -> None:
        """A checkpoint compressed as it is written (pool_kv_policy "always")."""
        started = time.perf_counter()
        state, kv_type = self._saved_state(source, raw_bytes, to)
        extent = self._allocate(payload_bytes(len(state), len(s.tokens)), pinned=s)
        prefix_ref = prefix_links.snapshot_ref(s, first)
        if extent is None:
            payload = with_tokens(state, s.tokens)
            self._write_disk(
                s, memoryview(payload), len(state), len(s.tokens), s.n_kv, None, prefix_ref, kv_type, raw_bytes
            )
        else:
            self.pool.view(extent.offset, len(state))[:] = state
            previous = s.snapshot
            s.snapshot = self.pool.commit_written(
                s.entry, extent, len(state), s.tokens, s.n_kv, *prefix_ref, kv_type, raw_bytes
            )
            if previous is not None and previous.tier == TIER_DISK:
                self.spill.remove(s.id, previous.version)
            self.counts.checkpoint.add(raw_bytes, time.perf_counter() - started)
        if kv_type != HOT_TYPES:
            self.counts.compressions += 1
        self._note_saved(s, first, raw_bytes)
        self.counts.checkpoints += 1

    def _compress_in_pool(self, pinned: Session) -> bool:
        """Compress the least recently used pool snapshot still at the hot types into a smaller extent (pool
        pressure, pool_kv_policy "when_full"). False when there is none, or its compressed copy finds no room
        either (the caller spills then)."""
        to = self.codec.pool_type
        victim = next(iter(policy.uncompressed_in_pool(self.sessions.by_id.values(), pinned)), None)
        if to is None or victim is None or victim.snapshot is None:
            return False
        snap = victim.snapshot
        if not self.pool.verify(snap):
            return False  # its restore will report the damage; spilling it keeps the bytes as they are
        stored = self._compressed_pool_state(snap, to)
        if stored is None or len(stored) >= snap.state_bytes:
            return False
        extent = self.pool.allocator.allocate(payload_bytes(len(stored), snap.n_tokens))
        if extent is None:
            return False
        self.pool.view(extent.offset, len(stored))[:] = stored
        victim.snapshot = self._recommit(victim, snap, extent, stored, to)
        self.counts.compressions += 1
        return True

    def _recommit(self, s: Session, snap: Snapshot, extent: Extent, state: bytes, to: KvType) -> Snapshot:
        tokens = self.pool.tokens(snap)
        return self.pool.commit_written(
            s.entry,
            extent,
            len(state),
            tokens,
            snap.n_kv,
            snap.prefix_entry,
            snap.prefix_len,
            to.ggml_id,
            snap.hot_bytes,
        )

    def _note_saved(self, s: Session, first: int, state_bytes: int) -> None:
        """Bytes the new snapshot did not store again because it builds on a prefix (for status)."""
        assert s.slot is not None
        s.saved_bytes = self.model.state_size(s.slot) - state_bytes if first else 0
        prefix_links.settle(s)

    def record_tokens(self, s: Session) -> None:
        """Commit a snapshot of a session's tokens alone (no KV yet: a session opened with a system prompt), so
        that a restart before its first turn does not lose them."""
        payload = payload_bytes(0, len(s.tokens))
        # Free room only (or a prefix nobody uses): keeping these tokens is not worth spilling other sessions.
        extent = self.prefixes.allocate(payload)
        if extent is None:
            log.warning("no free pool room for session %s's system prompt: it is kept in memory only", s.id)
            self.pool.mark_unsaved(s.entry)  # a crash before its first checkpoint evicts it, never empties it
            return
        s.snapshot = self.pool.commit_written(s.entry, extent, 0, s.tokens, 0)

    def install(
        self,
        s: Session,
        payload: memoryview,
        state_bytes: int,
        n_kv: int,
        digest: int,
        kv_type: int = HOT_TYPES,
        raw_bytes: int = 0,
    ) -> None:
        """Commit a checkpoint that came from elsewhere (the remote tier), already checked against ``digest``, as
        the session's snapshot: into the pool (spilling others for room), else to disk. ``kv_type``/``raw_bytes``:
        the type it was compressed to, and its size at the hot types."""
        n_tokens = (len(payload) - state_bytes) // TOKEN_BYTES
        extent = self._allocate(len(payload), pinned=s)
        if extent is None:
            self._write_disk(s, payload, state_bytes, n_tokens, n_kv, digest, (NO_PREFIX, 0), kv_type, raw_bytes)
            return
        view = self.pool.view(extent.offset, len(payload))
        try:
            view[:] = payload
        finally:
            view.release()
        s.snapshot = self.pool.commit(
            s.entry,
            TIER_POOL,
            extent,
            state_bytes,
            n_tokens,
            n_kv,
            digest,
            len(payload),
            NO_PREFIX,
            0,
            kv_type,
            raw_bytes,
        )

    def _checkpoint_to_disk(self, s: Session, source: int, state_bytes: int, first: int) -> None:
        """The pool cannot hold this snapshot at all (larger than every extent it could free): go to disk."""
        state, kv_type = self._saved_state(source, state_bytes, self.codec.spill_type)
        payload = with_tokens(state, s.tokens)
        prefix_ref = prefix_links.snapshot_ref(s, first)
        self._write_disk(
            s, memoryview(payload), len(state), len(s.tokens), s.n_kv, None, prefix_ref, kv_type, state_bytes
        )
        self._note_saved(s, first, state_bytes)
        self.counts.checkpoints += 1

    def _allocate(self, nbytes: int, pinned: Session) -> Extent | None:
        """An extent for ``nbytes``, spilling least recently used snapshots to disk until one fits; None when no
        amount of spilling could make room (the caller then writes the snapshot to disk)."""
        if self.codec.compress_when_full:
            # Compress while the pool still has room for a compressed copy (it is written before the original is
            # freed, so a crash never finds half of either): when less than two snapshots of this size are free.
            while self.pool.allocator.free_bytes < 2 * nbytes and self._compress_in_pool(pinned):
                pass
        extent = self.pool.allocator.allocate(nbytes)
        if extent is None and not self._could_ever_fit(nbytes, pinned):
            return None
        # A prefix nobody uses goes before any session's snapshot.
        while extent is None and (extent := self.prefixes.allocate(nbytes)) is None:
            if self.codec.compress_when_full and self._compress_in_pool(pinned):
                continue
            victim = policy.first_to_go(policy.pool_snapshot_holders(self.sessions.by_id.values(), pinned))
            if victim is None:
                return None
            self._make_pool_room(victim)
        return extent

    def _could_ever_fit(self, nbytes: int, pinned: Session) -> bool:
        """Whether spilling every snapshot that may move would leave a hole of ``nbytes``. What stays: the pinned
        session's own older snapshot (until the new one is committed) and the prefixes in use."""
        a = self.pool.allocator
        stays = [
            snap.extent
            for snap in [pinned.snapshot, *(x.snapshot for x in self.prefixes.by_id.values() if x.in_use)]
            if snap is not None and snap.tier == TIER_POOL
        ]
        return a.rounded(nbytes) <= ExtentAllocator.from_used(a.start, a.size, stays, a.align).largest_free

    def _make_pool_room(self, victim: Session) -> None:
        """Take a snapshot out of the pool: to disk if it can go there; otherwise a resident session loses only
        its checkpoint (its KV is still hot), and an idle one is evicted."""
        try:
            self.spill_out(victim)
            return
        except RequestRefused:
            if victim.slot is None and victim.busy:
                raise  # it waits for a slot: its snapshot is all it has
        if victim.slot is not None:
            self.give_up(victim)
        else:
            self.evict(victim)

    def give_up(self, s: Session) -> None:
        """Drop a resident session's saved state: for room, or because its newest state could not be saved. Its
        KV stays hot; if the daemon dies before its next checkpoint, its owner gets SESSION_EVICTED instead of
        an older context that would answer as if the last turns never happened."""
        previous = s.snapshot
        self.pool.discard(s.entry)
        s.snapshot = None
        prefix_links.settle(s)
        if previous is not None and previous.tier == TIER_DISK:
            # A spill directory that fails (read-only, I/O errors) may be why the checkpoint failed at all: the
            # file stays then, and the next start removes it (no entry names it any more).
            with contextlib.suppress(OSError):
                self.spill.remove(s.id, previous.version)

    def spill_out(self, s: Session) -> None:
        """Move a session's pool snapshot to the spill directory (the pool extent is freed by the commit)."""
        snap = s.snapshot
        assert snap is not None and snap.tier == TIER_POOL
        prefix_ref = (snap.prefix_entry, snap.prefix_len)
        to = self.codec.spill_type
        if to is not None and snap.kv_type != to.ggml_id and snap.n_kv and self.pool.verify(snap):
            stored = self._compressed_pool_state(snap, to)
            if stored is not None:
                payload = with_tokens(stored, self.pool.tokens(snap))
                self._write_disk(
                    s,
                    memoryview(payload),
                    len(stored),
                    snap.n_tokens,
                    snap.n_kv,
                    None,
                    prefix_ref,
                    to.ggml_id,
                    snap.hot_bytes,
                )
                self.counts.spills += 1
                self.counts.compressions += 1
                return
        view = self.pool.view(snap.offset, payload_bytes(snap.state_bytes, snap.n_tokens))
        try:
            self._write_disk(
                s,
                view,
                snap.state_bytes,
                snap.n_tokens,
                snap.n_kv,
                snap.checksum,
                prefix_ref,
                snap.kv_type,
                snap.raw_bytes,
            )
        finally:
            view.release()
        self.counts.spills += 1

    # ------------------------------------------------------------------ cold tier

    def _write_disk(
        self,
        s: Session,
        payload: memoryview,
        state_bytes: int,
        n_tokens: int,
        n_kv: int,
        digest: int | None = None,
        prefix_ref: tuple[int, int] = (NO_PREFIX, 0),
        kv_type: int = HOT_TYPES,
        raw_bytes: int = 0,
    ) -> None:
        self._make_disk_room(len(payload), keep=s)
        digest = checksum(payload) if digest is None else digest
        previous = s.snapshot
        version = (previous.version if previous else 0) + 1
        try:
            self.spill.write(s.id, version, payload, state_bytes, n_tokens, n_kv, digest, kv_type)
        except OSError as exc:
            raise RequestRefused(
                ErrorCode.POOL_FULL,
                f"Writing a snapshot to the spill directory {self.spill.path} failed ({exc.strerror}); free space "
                "there or raise cache_pool_size.",
            ) from None
        s.snapshot = self.pool.commit(
            s.entry, TIER_DISK, None, state_bytes, n_tokens, n_kv, digest, len(payload), *prefix_ref, kv_type, raw_bytes
        )
        if previous is not None and previous.tier == TIER_DISK:
            self.spill.remove(s.id, previous.version)

    def _make_disk_room(self, nbytes: int, keep: Session) -> None:
        if not self.spill.could_fit(nbytes):  # evicting everything would not help
            raise RequestRefused(
                ErrorCode.POOL_FULL,
                f"A {nbytes}-byte snapshot does not fit the pool ({self.pool.size} bytes) nor the spill directory "
                f"(spill_max_bytes={self.spill.max_bytes}); raise one of them or use shorter contexts.",
            )
        while not self.spill.fits(nbytes):
            victim = policy.first_to_go(policy.idle_on_disk(self.sessions.by_id.values(), keep))
            if victim is None:
                raise RequestRefused(
                    ErrorCode.POOL_FULL,
                    f"The pool ({self.pool.size} bytes) and the spill directory ({self.spill.max_bytes} bytes) "
                    "are full of sessions in use; close sessions or raise cache_pool_size or spill_max_bytes.",
                )
            self.evict(victim)
