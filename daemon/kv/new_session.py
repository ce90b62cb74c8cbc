"""Creating a session: the one place that checks the session quotas and takes a pool entry, so that every way a
session comes to this daemon (opened, fetched from the remote tier) is refused with the same sentences. What it
brings (a system prompt's tokens, a fetched checkpoint) is then recorded by the caller."""

from __future__ import annotations

from kvpool.daemon.kv.place import SessionPlace
from kvpool.daemon.kv.pool.pool import Pool
from kvpool.daemon.kv.sessions import Session, SessionTable
from kvpool.daemon.refusals import RequestRefused
from kvpool.protocol import ErrorCode

TABLE_FULL = "The pool's session table is full; close a session or raise max_sessions (and restart with --reset-pool)."


def create_session(
    pool: Pool,
    sessions: SessionTable,
    session_id: str,
    token: str,
    task: str,
    tokens: list[int],
    boundary: int,
    n_kv: int = 0,
) -> Session:
    """A new session of ``task``, in the table and in the pool's; UNKNOWN_TASK or QUOTA_EXCEEDED when it may not
    be. It starts with ``tokens``, the first ``boundary`` of them a system prompt (that may become a shared prefix),
    and ``n_kv`` of them in the checkpoint it brings (none yet in a slot)."""
    sessions.check_can_open(task)
    entry = pool.claim(session_id, token, task)
    if entry is None:
        raise RequestRefused(ErrorCode.QUOTA_EXCEEDED, TABLE_FULL)
    place = SessionPlace(n_kv=n_kv, boundary=boundary)
    return sessions.create(session_id, token, task, entry, tokens=tokens, place=place)
