"""Compressing pool snapshots to the pool's KV type (pool_kv_policy "when_full"): the least recently used snapshot
still at the hot types is rewritten, smaller, into an extent of its own before the original is freed, so a crash
never finds half of either. Engine thread only."""

from __future__ import annotations

from kvpool.daemon.kv import place, policy
from kvpool.daemon.kv.codec.kv_types import StoreType
from kvpool.daemon.kv.codec.tier_codec import TierCodec
from kvpool.daemon.kv.pool.allocator import Extent
from kvpool.daemon.kv.pool.layout import Snapshot, payload_bytes
from kvpool.daemon.kv.pool.pool import Pool
from kvpool.daemon.kv.sessions import Session
from kvpool.daemon.kv.stores import Stores


def compressed_pool_state(pool: Pool, codec: TierCodec, snap: Snapshot, to: StoreType) -> bytearray | None:
    """A pool snapshot's state at ``to`` (None when the codec cannot read it)."""
    view = pool.view(snap.offset, snap.state_bytes)
    try:
        return codec.compress(view, to)
    finally:
        view.release()


class PoolCompressor:
    def __init__(self, stores: Stores):
        self.pool, self.sessions, self.codec, self.counts = stores.pool, stores.sessions, stores.codec, stores.counts

    def compress_one(self, pinned: Session) -> bool:
        """Compress the least recently used pool snapshot still at the hot types into a smaller extent (pool
        pressure). False when there is none, or its compressed copy finds no room either (the caller spills
        then)."""
        to = self.codec.pool_type
        victim = next(iter(policy.uncompressed_in_pool(self.sessions.by_id.values(), pinned)), None)
        if to is None or victim is None or victim.snapshot is None:
            return False
        snap = victim.snapshot
        if not self.pool.verify(snap):
            return False  # its restore will report the damage; spilling it keeps the bytes as they are
        stored = compressed_pool_state(self.pool, self.codec, snap, to)
        if stored is None or len(stored) >= snap.state_bytes:
            return False
        extent = self.pool.allocator.allocate(payload_bytes(len(stored), snap.n_tokens))
        if extent is None:
            return False
        self.pool.view(extent.offset, len(stored))[:] = stored
        place.commit(victim, self._recommit(victim, snap, extent, stored, to))
        self.counts.compressions += 1
        return True

    def _recommit(self, s: Session, snap: Snapshot, extent: Extent, state: bytes, to: StoreType) -> Snapshot:
        tokens = self.pool.tokens(snap)
        return self.pool.commit_written(
            s.entry,
            extent,
            len(state),
            tokens,
            snap.n_kv,
            snap.prefix_entry,
            snap.prefix_len,
            to.id,
            snap.hot_bytes,
        )
