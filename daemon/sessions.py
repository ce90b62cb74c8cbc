"""Sessions and the hot slots they live in: who owns what, pure bookkeeping (no llama.cpp)."""

from __future__ import annotations

import hmac
import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvpool.client.protocol import ErrorCode

from .config import Config
from .errors import RequestRefused

if TYPE_CHECKING:
    from .generation import Generation


@dataclass(eq=False)
class Session:
    id: str
    token: str
    task: str
    slot: int  # the llama.cpp sequence id holding this session's KV
    context_limit: int  # most tokens this session's context may hold
    created: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)
    # The whole conversation. The KV holds tokens[:n_kv]; the rest (the last sampled token, a new prompt)
    # is fed by the next steps.
    tokens: list[int] = field(default_factory=list)
    n_kv: int = 0
    generation: Generation | None = None

    @property
    def pending_tokens(self) -> int:
        return len(self.tokens) - self.n_kv


class SessionTable:
    def __init__(self, config: Config, hot_slots: int, context_size: int):
        self._config = config
        self._context_size = context_size
        self._free_slots = list(range(hot_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self.by_id: dict[str, Session] = {}

    def open(self, task: str) -> Session:
        profile = self._config.tasks.get(task)
        if profile is None:
            known = ", ".join(sorted(self._config.tasks))
            raise RequestRefused(
                ErrorCode.UNKNOWN_TASK, f"Task {task!r} has no profile in the config; known tasks: {known}."
            )
        if len(self.by_id) >= self._config.max_sessions:
            raise RequestRefused(
                ErrorCode.QUOTA_EXCEEDED,
                f"The daemon already holds max_sessions={self._config.max_sessions} sessions; "
                "close one or raise max_sessions.",
            )
        if profile.max_sessions and self.count(task) >= profile.max_sessions:
            raise RequestRefused(
                ErrorCode.QUOTA_EXCEEDED,
                f"Task {task!r} already holds its max_sessions={profile.max_sessions} sessions; close one first.",
            )
        if not self._free_slots:
            raise RequestRefused(
                ErrorCode.POOL_FULL,
                f"All {len(self.by_id)} hot slots hold open sessions and this build keeps every session in a "
                "slot; close a session or raise hot_slots.",
            )
        limit = min(self._context_size, profile.max_context_tokens or self._context_size)
        session = Session(
            id=secrets.token_hex(8),
            token=secrets.token_hex(16),
            task=task,
            slot=self._free_slots.pop(),
            context_limit=limit,
        )
        self.by_id[session.id] = session
        return session

    def get(self, session_id: str, token: str) -> Session:
        """The session, if ``token`` is its capability token; the error says nothing about other sessions."""
        session = self.by_id.get(session_id)
        if session is None:
            raise RequestRefused(
                ErrorCode.UNKNOWN_SESSION,
                f"No session {session_id!r}: it was closed, expired, or never opened here; open a new one.",
            )
        if not hmac.compare_digest(session.token.encode(), token.encode()):
            raise RequestRefused(
                ErrorCode.NOT_OWNER, f"Session {session_id!r} belongs to another client; use your own session."
            )
        return session

    def close(self, session: Session) -> None:
        del self.by_id[session.id]
        self._free_slots.append(session.slot)

    def count(self, task: str) -> int:
        return sum(1 for s in self.by_id.values() if s.task == task)

    def idle_longer_than(self, seconds: float, now: float) -> list[Session]:
        return [s for s in self.by_id.values() if s.generation is None and now - s.last_used > seconds]

    @property
    def slots_used(self) -> int:
        return len(self.by_id)
