"""Making room in the pool for a snapshot: compressing (pool_kv_policy "when_full"), then spilling the least
recently used snapshots that may move (an unused shared prefix goes before any session's), and only when nothing
can go to disk for room, dropping one: a resident session loses just its checkpoint (its KV is still hot), an idle
one is evicted. A spill directory that fails (an I/O error, not a full disk) drops nothing: the snapshot that needed
the room is refused instead. Engine thread only."""

from __future__ import annotations

from kvpool.daemon.kv import place, policy
from kvpool.daemon.kv.compression import PoolCompressor
from kvpool.daemon.kv.disk_writes import DiskWrites, SpillFailed
from kvpool.daemon.kv.pool.allocator import Extent, ExtentAllocator
from kvpool.daemon.kv.pool.layout import TIER_DISK, TIER_POOL
from kvpool.daemon.kv.prefix.cache import PrefixCache
from kvpool.daemon.kv.sessions import Session
from kvpool.daemon.kv.stores import Stores
from kvpool.daemon.refusals import RequestRefused


class PoolRoom:
    def __init__(self, stores: Stores, prefixes: PrefixCache, disk_writes: DiskWrites):
        self.pool, self.spill, self.sessions, self.codec = stores.pool, stores.spill, stores.sessions, stores.codec
        self.prefixes, self.disk_writes, self.evict = prefixes, disk_writes, disk_writes.evict
        self.compressor = PoolCompressor(stores)

    def allocate(self, nbytes: int, pinned: Session) -> Extent | None:
        """An extent for ``nbytes``, spilling least recently used snapshots to disk until one fits; None when no
        amount of spilling could make room (the caller then writes the snapshot to disk)."""
        if self.codec.compress_when_full:
            # Compress while the pool still has room for a compressed copy (it is written before the original is
            # freed, so a crash never finds half of either): when less than two snapshots of this size are free.
            while self.pool.allocator.free_bytes < 2 * nbytes and self.compressor.compress_one(pinned):
                pass
        extent = self.pool.allocator.allocate(nbytes)
        if extent is None and not self._could_ever_fit(nbytes, pinned):
            return None
        # A prefix nobody uses goes before any session's snapshot.
        while extent is None and (extent := self.prefixes.allocate(nbytes)) is None:
            if self.codec.compress_when_full and self.compressor.compress_one(pinned):
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
            self.disk_writes.spill_out(victim)
            return
        except SpillFailed:
            raise  # the directory failed rather than filled: dropping a session would make no room on it
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
        place.lose_snapshot(s)
        if previous is not None and previous.tier == TIER_DISK:
            self.spill.remove(s.id, previous.version)  # (a failing directory leaves it for the next start)
