"""Which shared prefix a session builds on, kept right through every tier move: pure bookkeeping.

A session builds on a prefix while its hot cells for the first ``prefix_len`` positions are the prefix's own
(``shares_hot``), or while its committed snapshot holds only its cells past them. The prefix's ``users`` counts
such sessions (its pool snapshot must stay), ``hot_users`` those of the first kind (its hot copy must stay).
"""

from __future__ import annotations

from kvpool.daemon.kv.pool.layout import NO_PREFIX, Snapshot
from kvpool.daemon.kv.prefix.index import Prefix
from kvpool.daemon.kv.sessions import Session


def attach(s: Session, prefix: Prefix, length: int, hot: bool) -> None:
    assert s.prefix is None
    prefix.users += 1
    prefix.hot_users += int(hot)
    s.prefix, s.prefix_len, s.shares_hot = prefix, length, hot


def move_to(s: Session, prefix: Prefix, length: int) -> None:
    """The session (resident) just made ``prefix`` from its own cells: it builds on it from now on, unless its
    committed snapshot builds on the prefix it took its first cells from (then it stays with that one)."""
    if s.prefix is not None:
        snap = s.snapshot
        if snap is not None and snap.prefix_entry != NO_PREFIX:
            return
        detach(s)
    attach(s, prefix, length, hot=True)


def consistent(s: Session, snap: Snapshot) -> bool:
    """The prefix the session is linked to is the one its snapshot names, and holds the session's tokens (a
    table entry index is reused once a prefix is gone: a stale reference must not pass)."""
    p = s.prefix
    return (
        p is not None
        and p.entry == snap.prefix_entry
        and snap.prefix_len <= len(p.tokens)
        and p.tokens[: snap.prefix_len] == s.tokens[: snap.prefix_len]
    )


def leave_hot(s: Session) -> None:
    """The session left its slot: it shares no cells now, and builds on the prefix only through a
    suffix-only snapshot."""
    if s.prefix is not None and s.shares_hot:
        s.prefix.hot_users -= 1
        s.shares_hot = False
    settle(s)


def rejoin_hot(s: Session) -> None:
    """Its suffix was restored and the prefix's cells shared back into its slot."""
    assert s.prefix is not None and not s.shares_hot
    s.prefix.hot_users += 1
    s.shares_hot = True


def settle(s: Session) -> None:
    """Let go of the prefix once neither the hot cells nor the committed snapshot build on it."""
    if s.prefix is None or s.shares_hot:
        return
    snap = s.snapshot
    if snap is None or snap.prefix_entry == NO_PREFIX:
        s.prefix.users -= 1
        s.prefix, s.prefix_len = None, 0


def detach(s: Session) -> None:
    """The session is gone."""
    if s.prefix is not None:
        s.prefix.hot_users -= int(s.shares_hot)
        s.prefix.users -= 1
        s.prefix, s.prefix_len, s.shares_hot = None, 0, False


def suffix_start(s: Session) -> int:
    """Where the session's own cells begin, when its snapshot can leave out a shared prefix (0: whole).
    Only a prefix with a pool snapshot can be left out, so that the snapshot can always be restored."""
    p = s.prefix
    if p is None or not s.shares_hot or p.entry is None or s.n_kv <= s.prefix_len:
        return 0
    return s.prefix_len


def snapshot_ref(s: Session, first: int) -> tuple[int, int]:
    """(prefix entry, prefix length) for the record of a snapshot whose cells start at ``first``."""
    if not first:
        return NO_PREFIX, 0
    assert s.prefix is not None and s.prefix.entry is not None
    return s.prefix.entry, first
