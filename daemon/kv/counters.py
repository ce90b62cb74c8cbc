"""What the KV tiers count: the moves between tiers (protocol.status.MoveCounts), and the time and bytes of pool
checkpoints and restores."""

from __future__ import annotations

import msgspec

from kvpool.protocol.status import MoveCounts, Moves

# Snapshots this large and up are counted apart too: their time is the copy, not fixed costs.
LARGE_SNAPSHOT = 1 << 20


class MoveTimes(msgspec.Struct):
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


class TierCounters(MoveCounts, kw_only=True):
    checkpoint: MoveTimes = msgspec.field(default_factory=MoveTimes)  # state copy + checksum, into the pool
    restore_pool: MoveTimes = msgspec.field(default_factory=MoveTimes)  # checksum + copy back, from the pool

    def status(self) -> Moves:
        counts = {name: getattr(self, name) for name in MoveCounts.__struct_fields__}
        timings = {
            f"{move}_{part}": value
            for move, times in (("checkpoint", self.checkpoint), ("restore_pool", self.restore_pool))
            for part, value in msgspec.structs.asdict(times).items()
        }
        return Moves(**counts, **timings)
