"""The snapshot path, behind one facade: writing checkpoints (a resident session's state into a fresh pool
extent, whole or only its cells past a shared prefix, compressed as it is written with pool_kv_policy "always";
straight to disk when the pool cannot hold it), a session's tokens alone (a system prompt before its first turn),
a checkpoint that came from the remote tier, and giving a snapshot up. Room is made behind it: room.py
(compressing, compression.py; spilling, disk_writes.py; evicting through the KV manager). Engine thread only."""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Callable

from kvpool.daemon.kv import place
from kvpool.daemon.kv.codec.kv_types import StoreType
from kvpool.daemon.kv.codec.state_format import StateBytes
from kvpool.daemon.kv.disk_writes import DiskWrites
from kvpool.daemon.kv.pool.layout import (
    HOT_TYPES,
    NO_PREFIX,
    TIER_DISK,
    TIER_POOL,
    TOKEN_BYTES,
    payload_bytes,
    with_tokens,
)
from kvpool.daemon.kv.prefix.cache import PrefixCache
from kvpool.daemon.kv.room import PoolRoom
from kvpool.daemon.kv.sessions import Session
from kvpool.daemon.kv.stores import Stores
from kvpool.daemon.llama.model import Model
from kvpool.daemon.refusals import RequestRefused
from kvpool.protocol import ErrorCode

log = logging.getLogger("kvpool.kv")


class Checkpoints:
    def __init__(
        self, model: Model, stores: Stores, prefixes: PrefixCache, evict: Callable[[Session], None], whole: bool
    ):
        """``evict(s)``: drop an idle session for room; ``whole``: checkpoints hold every cell, shared prefix
        included, so another node can restore them."""
        self.model, self.pool, self.spill, self.prefixes = model, stores.pool, stores.spill, prefixes
        self.counts, self.codec = stores.counts, stores.codec
        self.disk_writes = DiskWrites(stores, evict)
        self.room = PoolRoom(stores, prefixes, self.disk_writes)
        self.whole_snapshots = whole

    def checkpoint(self, s: Session) -> None:
        """Write the resident session's state to a fresh pool extent (or straight to disk) and commit it."""
        assert s.slot is not None
        first = 0 if self.whole_snapshots else place.suffix_start(s)
        with self.model.cells_from(s.slot, s.position(first)) as source:  # (first: a cell; llama.cpp: positions)
            state_bytes = self.model.state_size(source)
            if self.codec.compress_on_write and self.codec.pool_type is not None:
                self._checkpoint_compressed(s, source, state_bytes, first, self.codec.pool_type)
                return
            extent = self.room.allocate(payload_bytes(state_bytes, len(s.tokens)), pinned=s)
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
        place.commit(
            s, self.pool.commit_written(s.entry, extent, state_bytes, s.tokens, s.n_kv, *place.snapshot_ref(s, first))
        )
        self._note_saved(s, first, state_bytes)
        if previous is not None and previous.tier == TIER_DISK:
            self.spill.remove(s.id, previous.version)
        self.counts.checkpoints += 1
        self.counts.checkpoint.add(state_bytes, time.perf_counter() - started)

    def _saved_state(self, source: int, state_bytes: int, to: StoreType | None) -> tuple[StateBytes, int]:
        """The sequence's state saved into a private buffer (to compress it, or when the pool has no room), at
        ``to`` when given and the codec can read it: the bytes, and the type they are stored at."""
        buffer = (ctypes.c_uint8 * state_bytes)()
        written = self.model.save_state(source, buffer)
        if written != state_bytes:  # never commit a half-empty buffer over a good snapshot
            raise RequestRefused(ErrorCode.INTERNAL, f"llama.cpp saved {written} of {state_bytes} state bytes.")
        stored = self.codec.compress(memoryview(buffer).cast("B"), to) if to is not None else None
        if stored is None or to is None:
            return memoryview(buffer).cast("B"), HOT_TYPES
        return stored, to.id

    def _checkpoint_compressed(self, s: Session, source: int, raw_bytes: int, first: int, to: StoreType) -> None:
        """A checkpoint compressed as it is written (pool_kv_policy "always")."""
        started = time.perf_counter()
        state, kv_type = self._saved_state(source, raw_bytes, to)
        extent = self.room.allocate(payload_bytes(len(state), len(s.tokens)), pinned=s)
        prefix_ref = place.snapshot_ref(s, first)
        if extent is None:
            payload = with_tokens(state, s.tokens)
            self.disk_writes.write_disk(
                s, memoryview(payload), len(state), len(s.tokens), s.n_kv, None, prefix_ref, kv_type, raw_bytes
            )
        else:
            self.pool.view(extent.offset, len(state))[:] = state
            previous = s.snapshot
            place.commit(
                s,
                self.pool.commit_written(
                    s.entry, extent, len(state), s.tokens, s.n_kv, *prefix_ref, kv_type, raw_bytes
                ),
            )
            if previous is not None and previous.tier == TIER_DISK:
                self.spill.remove(s.id, previous.version)
            self.counts.checkpoint.add(raw_bytes, time.perf_counter() - started)
        if kv_type != HOT_TYPES:
            self.counts.compressions += 1
        self._note_saved(s, first, raw_bytes)
        self.counts.checkpoints += 1

    def _note_saved(self, s: Session, first: int, state_bytes: int) -> None:
        """Bytes the new snapshot did not store again because it builds on a prefix (for status)."""
        assert s.slot is not None
        place.note_saved(s, self.model.state_size(s.slot) - state_bytes if first else 0)

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
        place.commit(s, self.pool.commit_written(s.entry, extent, 0, s.tokens, 0))

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
        extent = self.room.allocate(len(payload), pinned=s)
        if extent is None:
            self.disk_writes.write_disk(
                s, payload, state_bytes, n_tokens, n_kv, digest, (NO_PREFIX, 0), kv_type, raw_bytes
            )
            return
        view = self.pool.view(extent.offset, len(payload))
        try:
            view[:] = payload
        finally:
            view.release()
        committed = self.pool.commit(
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
        place.commit(s, committed)

    def give_up(self, s: Session) -> None:
        """Drop a resident session's saved state (see PoolRoom.give_up)."""
        self.room.give_up(s)

    def _checkpoint_to_disk(self, s: Session, source: int, state_bytes: int, first: int) -> None:
        """The pool cannot hold this snapshot at all (larger than every extent it could free): go to disk."""
        state, kv_type = self._saved_state(source, state_bytes, self.codec.spill_type)
        payload = with_tokens(state, s.tokens)
        prefix_ref = place.snapshot_ref(s, first)
        self.disk_writes.write_disk(
            s, memoryview(payload), len(state), len(s.tokens), s.n_kv, None, prefix_ref, kv_type, state_bytes
        )
        self._note_saved(s, first, state_bytes)
        self.counts.checkpoints += 1
