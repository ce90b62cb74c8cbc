"""Who gives way when a tier needs room: the least recently used first, by one rule for every move.

Pure selection, no side effects: the tiers ask, then hibernate, spill, evict or drop what these return.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, TypeVar

from kvpool.daemon.kv.pool.layout import TIER_DISK, TIER_POOL
from kvpool.daemon.kv.prefix.index import Prefix
from kvpool.daemon.kv.sessions import Session


class Used(Protocol):
    @property
    def last_used(self) -> float: ...


T = TypeVar("T", bound=Used)


def least_recently_used(candidates: Iterable[T]) -> list[T]:
    """The candidates, least recently used first."""
    return sorted(candidates, key=lambda x: x.last_used)


def first_to_go(candidates: Iterable[T]) -> T | None:
    """The least recently used candidate, or None when there is none."""
    return min(candidates, key=lambda x: x.last_used, default=None)


def idle_resident(resident: Iterable[Session], exclude: Iterable[Session] = ()) -> list[Session]:
    """Hot sessions that may hibernate (not generating, not excluded), in the order they should."""
    skip = set(map(id, exclude))
    return least_recently_used(r for r in resident if not r.busy and id(r) not in skip)


def pool_snapshot_holders(sessions: Iterable[Session], pinned: Session) -> list[Session]:
    """Sessions whose snapshot may leave the pool to make room (all but the one being written)."""
    return [v for v in sessions if v is not pinned and v.snapshot is not None and v.snapshot.tier == TIER_POOL]


def uncompressed_in_pool(sessions: Iterable[Session], pinned: Session) -> list[Session]:
    """Pool snapshots that compressing would shrink (at the hot types, with KV), least recently used first."""
    return least_recently_used(
        v
        for v in pool_snapshot_holders(sessions, pinned)
        if v.snapshot is not None and not v.snapshot.compressed and v.snapshot.n_kv
    )


def idle_on_disk(sessions: Iterable[Session], keep: Session) -> list[Session]:
    """Sessions that may be evicted to make room on disk: cold, idle, not the one being written."""
    return [
        v
        for v in sessions
        if v is not keep and v.slot is None and not v.busy and v.snapshot is not None and v.snapshot.tier == TIER_DISK
    ]


def hot_prefixes_nobody_shares(prefixes: Iterable[Prefix], keep: set[int]) -> list[Prefix]:
    """Shared prefixes that may leave the unified KV: no resident session uses their cells, their pool snapshot
    keeps them (or nobody needs them at all), and none in ``keep`` (ids of prefixes a restore builds on)."""
    return least_recently_used(
        x
        for x in prefixes
        if x.seq is not None and x.hot_users == 0 and (x.snapshot is not None or x.users == 0) and id(x) not in keep
    )


def prefix_eviction_order(prefixes: Iterable[Prefix]) -> list[Prefix]:
    """Prefixes no session uses, in the order they are forgotten: damaged ones first, then least recently used."""
    return sorted((x for x in prefixes if not x.in_use), key=lambda x: (not x.damaged, x.last_used))
