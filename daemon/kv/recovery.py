"""Rebuilding the sessions and shared prefixes from the pool after a restart (or a crash).

A damaged record or spill file must not stop the start: its session is closed (its owner gets SESSION_CORRUPT, with
what was wrong), never brought back with a history it does not have. A spill file that cannot be read (permissions,
an I/O error: not damage) keeps its session's entry and file for a start that can read it, its owner told
SPILL_UNAVAILABLE meanwhile. A record whose bytes fail only their checksum is found at its restore, which reports
SESSION_CORRUPT the same way. Runs once, before the engine starts.
"""

from __future__ import annotations

import logging
import time

from kvpool.daemon.kv import place
from kvpool.daemon.kv.manager import KvManager
from kvpool.daemon.kv.place import SessionPlace
from kvpool.daemon.kv.pool.layout import LIVE, NO_PREFIX, SESSION, TIER_POOL
from kvpool.daemon.kv.pool.segment import PoolError
from kvpool.daemon.kv.spill_dir import SnapshotCorrupt, SpillError
from kvpool.daemon.refusals import RequestRefused
from kvpool.protocol import ErrorCode

log = logging.getLogger("kvpool.kv")


def damaged_at_start(session: str, why: str) -> RequestRefused:
    return RequestRefused(
        ErrorCode.SESSION_CORRUPT,
        f"Session {session!r}'s saved state was found damaged when the daemon started ({why}); it was closed, open "
        "a new one.",
    )


def unreadable_at_start(session: str, why: str) -> RequestRefused:
    return RequestRefused(
        ErrorCode.SPILL_UNAVAILABLE,
        f"Session {session!r}'s saved state could not be read when the daemon started ({why}); it is kept: mend the "
        "spill directory (its permissions, the disk) and restart the daemon.",
    )


def recover(kv: KvManager) -> int:
    """Rebuild the session table from the pool (after a restart); returns how many sessions came back."""
    now_wall, now = time.time(), time.monotonic()
    live_files: set[str] = set()
    kv.pool.settle()
    entries = kv.pool.entries()
    if not kv.prefixes.enabled and any(
        e.kind == SESSION and e.state == LIVE and e.snapshot is not None and e.snapshot.prefix_entry != NO_PREFIX
        for e in entries
    ):
        raise PoolError(
            f"Pool segment {kv.pool.name} holds sessions whose snapshots build on shared prefixes, but "
            "prefix_slots = 0 turns sharing off; start with prefix_slots >= 1, or with --reset-pool to discard them."
        )
    prefixes = kv.prefixes.recover(entries)
    for e in entries:
        if e.kind != SESSION:
            continue
        if e.state != LIVE:
            kv.sessions.evicted[e.session] = e.token
            continue
        snap = e.snapshot
        tokens: list[int] = []
        damaged = ""
        if snap is not None and snap.tier == TIER_POOL:
            if kv.pool.intact(e.index, snap):
                tokens = kv.pool.tokens(snap)
            else:
                damaged = "its pool record does not fit the pool"
        elif snap is not None:
            try:
                tokens = kv.spill.read_tokens(e.session, snap.version, snap.checksum)
                live_files.add(kv.spill.name(e.session, snap.version))
            except SnapshotCorrupt as exc:
                damaged = str(exc)  # (its file, if any, is removed below with the leftovers)
            except SpillError as exc:  # not damage: its entry and its file stay for a start that can read it
                live_files.add(kv.spill.name(e.session, snap.version))
                log.warning("session %s: %s; it is kept, and comes back at a start that can read it", e.session, exc)
                kv.counts.spill_failures += 1
                kv.sessions.not_restored_at_start(e.session, e.token, unreadable_at_start(e.session, str(exc)))
                continue
        if damaged:
            log.warning("session %s: %s; it is closed, its owner is told SESSION_CORRUPT", e.session, damaged)
            kv.counts.checksum_failures += 1
            kv.pool.release(e.index)
            kv.sessions.not_restored_at_start(e.session, e.token, damaged_at_start(e.session, damaged))
            continue
        n_kv = snap.n_kv if snap else 0
        kept = place.without_lost_media(tokens, n_kv)
        if len(kept) < len(tokens):
            log.warning(
                "session %s: %d tokens after its computed ones held a medium that was not computed before the "
                "stop; its conversation ends before it",
                e.session,
                len(tokens) - len(kept),
            )
            tokens = kept
        age = max(0.0, now_wall - e.last_used)
        s = kv.sessions.create(
            e.session,
            e.token,
            e.task,
            e.index,
            created=now - (now_wall - e.created),
            last_used=now - age,
            tokens=tokens,
            place=SessionPlace(
                n_kv=snap.n_kv if snap else 0,
                snapshot=snap,
                # only a system prompt so far: it may still become a shared prefix
                boundary=len(tokens) if snap is not None and snap.state_bytes == 0 else 0,
            ),
        )
        prefix = prefixes.get(snap.prefix_entry) if snap is not None else None
        if prefix is not None and snap is not None:
            place.attach(s, prefix, snap.prefix_len, hot=False)
            if not place.consistent(s, snap):  # then its restore reports SESSION_CORRUPT
                place.detach(s)
    kv.prefixes.forget_unused_after_recovery()
    stale = kv.spill.keep_only(live_files)
    if stale:
        log.info("removed %d spill files no session names (an interrupted write's, or a damaged session's)", stale)
    return len(kv.sessions.by_id)
