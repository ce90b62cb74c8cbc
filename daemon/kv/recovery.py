"""Rebuilding the sessions and shared prefixes from the pool after a restart (or a crash).

A damaged record or spill file must not stop the start: its session comes back with placeholder tokens and its
restore reports SESSION_CORRUPT (the checksum cannot match). Runs once, before the engine starts.
"""

from __future__ import annotations

import logging
import time

from kvpool.daemon.kv.pool.layout import LIVE, NO_PREFIX, SESSION, TIER_POOL
from kvpool.daemon.kv.pool.segment import PoolError
from kvpool.daemon.kv.prefix import links as prefix_links
from kvpool.daemon.kv.spill import SnapshotCorrupt
from kvpool.daemon.kv.tiers import Tiers

log = logging.getLogger("kvpool.tiers")


def recover(tiers: Tiers) -> int:
    """Rebuild the session table from the pool (after a restart); returns how many sessions came back."""
    now_wall, now = time.time(), time.monotonic()
    live_files: set[str] = set()
    tiers.pool.settle()
    entries = tiers.pool.entries()
    if not tiers.prefixes.enabled and any(
        e.kind == SESSION and e.state == LIVE and e.snapshot is not None and e.snapshot.prefix_entry != NO_PREFIX
        for e in entries
    ):
        raise PoolError(
            f"Pool segment {tiers.pool.name} holds sessions whose snapshots build on shared prefixes, but "
            "prefix_slots = 0 turns sharing off; start with prefix_slots >= 1, or with --reset-pool to discard them."
        )
    prefixes = tiers.prefixes.recover(entries)
    for e in entries:
        if e.kind != SESSION:
            continue
        if e.state != LIVE:
            tiers.sessions.evicted[e.session] = e.token
            continue
        snap = e.snapshot
        tokens: list[int] = []
        placeholder = [0] * min(snap.n_tokens if snap else 0, tiers.model.context_size)
        if snap is not None and snap.tier == TIER_POOL:
            tokens = tiers.pool.tokens(snap) if tiers.pool.intact(e.index, snap) else placeholder
        elif snap is not None:
            live_files.add(tiers.spill.name(e.session, snap.version))
            try:
                tokens = tiers.spill.read_tokens(e.session, snap.version)
            except SnapshotCorrupt:
                tokens = placeholder
        age = max(0.0, now_wall - e.last_used)
        s = tiers.sessions.create(
            e.session,
            e.token,
            e.task,
            e.index,
            created=now - (now_wall - e.created),
            last_used=now - age,
            tokens=tokens,
            n_kv=snap.n_kv if snap else 0,
            snapshot=snap,
            # only a system prompt so far: it may still become a shared prefix
            boundary=len(tokens) if snap is not None and snap.state_bytes == 0 else 0,
        )
        prefix = prefixes.get(snap.prefix_entry) if snap is not None else None
        if prefix is not None and snap is not None:
            prefix_links.attach(s, prefix, snap.prefix_len, hot=False)
            if not prefix_links.consistent(s, snap):  # then its restore reports SESSION_CORRUPT
                prefix_links.detach(s)
    tiers.prefixes.forget_unused_after_recovery()
    stale = tiers.spill.keep_only(live_files)
    if stale:
        log.info("removed %d spill files left by an interrupted write", stale)
    return len(tiers.sessions.by_id)
