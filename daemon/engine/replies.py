"""Replies built from a session's state, for every handler that answers with them."""

from __future__ import annotations

from kvpool import protocol as p
from kvpool.daemon.kv.sessions import Session


def session_opened(request_id: int, s: Session) -> p.SessionOpened:
    return p.SessionOpened(
        id=request_id,
        session=s.id,
        token=s.token,
        task=s.task,
        context_size=s.context_limit,
        context_tokens=len(s.tokens),
    )
