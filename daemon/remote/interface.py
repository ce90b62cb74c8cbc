"""What the engine and its request handlers ask of the cross-node tier, and the answer of a daemon without one.

The engine is given a CrossNode at construction: RemoteRequests (handlers.py) when `remote` is set, NoRemote
otherwise. Every call the handlers make is one of these, so a local-only daemon runs the same code paths with a
tier that holds nothing, fetches nothing and refuses only a migration.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from kvpool import protocol as p
from kvpool.daemon.kv.sessions import Session
from kvpool.daemon.refusals import RequestRefused
from kvpool.protocol import ErrorCode
from kvpool.protocol.status import RemoteStatus

Handler = Callable[[bytes, Any, float], p.Reply | None]


class CrossNode(Protocol):
    # Handlers of the tier's own internal messages (a fetch or a migration that ended), by message type.
    internal: dict[type, Handler]

    def fetch(self, client: bytes, r: p.SessionRequest, prefetch: bool, answer_prefetched: bool) -> bool:
        """Start taking a session this daemon does not hold from the remote tier (the reply comes when it
        arrives); False when there is no tier to take it from."""
        ...

    def check_owned(self, s: Session) -> None:
        """CONFLICT when another node owns ``s`` now, or it is on its way to one."""
        ...

    def check_gone(self, session: str, token: str) -> None:
        """CONFLICT naming the node that took a session this daemon dropped for it."""
        ...

    def where(self, s: Session) -> str:
        """The remote copy of ``s``: "current", "behind", "lost", or "" without a remote tier."""
        ...

    def closed(self, s: Session) -> None:
        """``s`` was closed: its remote copy goes too."""
        ...

    def migrate(self, client: bytes, r: p.Migrate, received_at: float) -> p.Reply | None: ...

    def between_steps(self) -> None:
        """Apply what the background writer reported."""
        ...

    def status(self) -> RemoteStatus | None: ...


class NoRemote:
    """The cross-node tier of a daemon without `remote`: nothing is elsewhere."""

    def __init__(self) -> None:
        self.internal: dict[type, Handler] = {}

    def fetch(self, client: bytes, r: p.SessionRequest, prefetch: bool, answer_prefetched: bool) -> bool:
        return False

    def check_owned(self, s: Session) -> None:
        pass

    def check_gone(self, session: str, token: str) -> None:
        pass

    def where(self, s: Session) -> str:
        return ""

    def closed(self, s: Session) -> None:
        pass

    def migrate(self, client: bytes, r: p.Migrate, received_at: float) -> p.Reply | None:
        raise RequestRefused(
            ErrorCode.BAD_REQUEST, "This daemon has no remote tier (set `remote`); a session cannot move."
        )

    def between_steps(self) -> None:
        pass

    def status(self) -> RemoteStatus | None:
        return None
