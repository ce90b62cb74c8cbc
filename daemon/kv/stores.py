"""What every part of the snapshot path works on: the pool, the spill directory, the session table (whose
snapshots may move to make room), the tiers' codec and their counters. One record, so that each part takes it
and only the collaborators of its own."""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.daemon.kv.codec.tier_codec import TierCodec
from kvpool.daemon.kv.counters import TierCounters
from kvpool.daemon.kv.pool.pool import Pool
from kvpool.daemon.kv.sessions import SessionTable
from kvpool.daemon.kv.spill_dir import SpillDir


@dataclass(frozen=True, slots=True)
class Stores:
    pool: Pool
    spill: SpillDir
    sessions: SessionTable
    codec: TierCodec
    counts: TierCounters
