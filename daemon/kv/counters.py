"""What the KV tiers count: moves between tiers, and the time and bytes of pool checkpoints and restores."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpool.protocol.status import Moves

# Snapshots this large and up are counted apart too: their time is the copy, not fixed costs.
LARGE_SNAPSHOT = 1 << 20


@dataclass
class MoveTimes:
    """The time and bytes of one kind of move (all of them, and those of LARGE_SNAPSHOT bytes and up)."""

    seconds: float = 0.0
    bytes: int = 0
    large_seconds: float = 0.0
    large_bytes: int = 0
    large_count: int = 0

    def add(self, nbytes: int, seconds: float) -> None:
        self.seconds += seconds
        self.bytes += nbytes
        if nbytes >= LARGE_SNAPSHOT:
            self.large_seconds += seconds
            self.large_bytes += nbytes
            self.large_count += 1


@dataclass
class TierCounters:
    hibernations: int = 0
    restores_pool: int = 0
    restores_disk: int = 0
    checkpoints: int = 0
    spills: int = 0
    evictions: int = 0
    checksum_failures: int = 0
    restores_without_room: int = 0  # llama.cpp had no cells for a restore: idle sessions made room
    checkpoint: MoveTimes = field(default_factory=MoveTimes)  # state copy + checksum, into the pool
    restore_pool: MoveTimes = field(default_factory=MoveTimes)  # checksum + copy back, from the pool

    def status(self) -> Moves:
        c, r = self.checkpoint, self.restore_pool
        return Moves(
            hibernations=self.hibernations,
            restores_pool=self.restores_pool,
            restores_disk=self.restores_disk,
            checkpoints=self.checkpoints,
            spills=self.spills,
            evictions=self.evictions,
            checksum_failures=self.checksum_failures,
            restores_without_room=self.restores_without_room,
            checkpoint_seconds=c.seconds,
            checkpoint_bytes=c.bytes,
            restore_pool_seconds=r.seconds,
            restore_pool_bytes=r.bytes,
            checkpoint_large_seconds=c.large_seconds,
            checkpoint_large_bytes=c.large_bytes,
            checkpoint_large_count=c.large_count,
            restore_pool_large_seconds=r.large_seconds,
            restore_pool_large_bytes=r.large_bytes,
            restore_pool_large_count=r.large_count,
        )


@dataclass
class PrefixCounters:
    hits: int = 0  # sessions that started from a shared prefix
    tokens_saved: int = 0  # prompt tokens those sessions did not compute
    made: int = 0
    hot_evictions: int = 0
    dropped: int = 0
    restores: int = 0
