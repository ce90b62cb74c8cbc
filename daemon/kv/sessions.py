"""Sessions: who owns what, and where each one's KV lives. Pure bookkeeping (no llama.cpp, no pool access)."""

from __future__ import annotations

import hmac
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvpool.daemon.config import Config
from kvpool.daemon.kv.place import SessionPlace
from kvpool.daemon.kv.place import positions as positions_of
from kvpool.daemon.kv.pool.layout import TIER_POOL, Snapshot
from kvpool.daemon.kv.positions import Positions
from kvpool.daemon.refusals import RequestRefused
from kvpool.protocol import ErrorCode

if TYPE_CHECKING:
    from kvpool.daemon.kv.prefix.index import Prefix
    from kvpool.daemon.media.media_cache import MediaPiece


MAX_EVICTED_REMEMBERED = 4096


@dataclass(eq=False)
class Session:
    id: str
    token: str
    task: str
    entry: int  # index of the session's entry in the pool's session table
    context_limit: int  # most tokens this session's context may hold
    created: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)
    # The whole conversation. While resident, the KV holds tokens[:n_kv]; the rest (the last sampled token,
    # a new prompt) is fed by the next steps.
    tokens: list[int] = field(default_factory=list)
    # Where its KV is: moved by the KV manager only (kv/place.py), read here.
    place: SessionPlace = field(default_factory=SessionPlace)
    # Media whose cells it holds but has not computed yet, by the position their cells begin at (kv/place.py
    # keeps them): a step feeds a medium's cells from its embeddings, in one batch of their own.
    media: dict[int, MediaPiece] = field(default_factory=dict)
    # A generation runs on it (set by the engine's scheduler): the tiers never hibernate, spill or evict it then.
    busy: bool = False
    # Time spent making it hot (a slot, hibernating an idle session if none was free, and its KV restored), in
    # all: a turn reports the part between its arrival and its first token (Timings.restore_ms).
    restore_seconds: float = 0.0

    @property
    def slot(self) -> int | None:
        return self.place.slot

    @property
    def n_kv(self) -> int:
        return self.place.n_kv

    @property
    def cell_positions(self) -> Positions:
        """Where its cells sit in llama.cpp's positions, from its tokens (kv/positions.py)."""
        return positions_of(self)

    def position(self, i: int) -> int:
        """The llama.cpp position of its cell ``i``; past its cells, the next token's."""
        return positions_of(self).at(i)

    @property
    def snapshot(self) -> Snapshot | None:
        return self.place.snapshot

    @property
    def prefix(self) -> Prefix | None:
        return self.place.prefix

    @property
    def prefix_len(self) -> int:
        return self.place.prefix_len

    @property
    def shares_hot(self) -> bool:
        return self.place.shares_hot

    @property
    def boundary(self) -> int:
        """The end of its system prompt: its prompt is fed in chunks that stop there, shared or not, so that
        sharing does not change the steps' shapes."""
        return self.place.boundary

    @property
    def saved_bytes(self) -> int:
        return self.place.saved_bytes

    @property
    def feedable_tokens(self) -> int:
        """Pending tokens the next step may feed: all of them, or up to the end of the system prompt, or up to the
        next medium's cells; a medium's own cells from where its computed ones end (fed whole: ``feeds_medium``)."""
        n_kv = self.n_kv
        pending = len(self.tokens) - n_kv
        if self.media:
            start, entry = self.medium_ahead()
            if start <= n_kv:
                return start + entry.n_tokens - n_kv
            pending = min(pending, start - n_kv)
        if n_kv < self.boundary < len(self.tokens):
            return min(pending, self.boundary - n_kv)
        return pending

    def medium_ahead(self) -> tuple[int, MediaPiece]:
        """The first uncomputed medium: where its cells begin, and what it is (``media`` is not empty)."""
        start = min(self.media)
        return start, self.media[start]

    @property
    def feeds_medium(self) -> bool:
        """Its next cells are a medium's: a step feeds them whole, from the medium's embeddings."""
        return bool(self.media) and min(self.media) <= self.n_kv

    @property
    def pending_tokens(self) -> int:
        return len(self.tokens) - self.n_kv

    @property
    def tier(self) -> str:
        if self.slot is not None:
            return "hot"
        if self.snapshot is None:
            return "new"  # opened, nothing computed yet
        return "pool" if self.snapshot.tier == TIER_POOL else "disk"

    @property
    def checkpoint_fresh(self) -> bool:
        """The committed snapshot holds exactly the session's current state."""
        s = self.snapshot
        return s is not None and s.n_tokens == len(self.tokens) and s.n_kv == self.n_kv

    @property
    def snapshot_bytes(self) -> int:
        return self.snapshot.length if self.snapshot is not None else 0


class SessionCorrupt(RequestRefused):
    """A session's saved state cannot be restored: the session is closed, its owner told why."""

    def __init__(self, session: Session, why: str):
        super().__init__(
            ErrorCode.SESSION_CORRUPT,
            f"Session {session.id}'s saved state is damaged ({why}); it was closed, open a new one.",
        )


class SessionTable:
    def __init__(self, config: Config, context_size: int):
        self._config = config
        self._context_size = context_size
        self.by_id: dict[str, Session] = {}
        # Open sessions per task, kept by add/remove: the engine asks every step (step_time_cap).
        self._per_task: Counter[str] = Counter()
        # Sessions dropped when both tiers were full, id -> token: their owners (only) get SESSION_EVICTED.
        self.evicted: dict[str, str] = {}
        # Sessions whose saved state could not be read at start, id -> (token, the refusal their owners get):
        # SESSION_CORRUPT when it is damaged (never a history of placeholders), SPILL_UNAVAILABLE when its file
        # could not be read then (kept for a start that can).
        self.not_restored: dict[str, tuple[str, RequestRefused]] = {}

    def check_can_open(self, task: str) -> None:
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

    def context_limit(self, task: str) -> int:
        profile = self._config.tasks.get(task)
        limit = profile.max_context_tokens if profile is not None else 0
        return min(self._context_size, limit or self._context_size)

    def create(self, session_id: str, token: str, task: str, entry: int, **state: Any) -> Session:
        """A new session in the table, holding pool entry ``entry`` (already claimed); ``state``: what it starts
        with (tokens, place, created, last_used)."""
        session = Session(
            id=session_id, token=token, task=task, entry=entry, context_limit=self.context_limit(task), **state
        )
        self.add(session)
        return session

    def add(self, session: Session) -> None:
        self.by_id[session.id] = session
        self._per_task[session.task] += 1
        self.evicted.pop(session.id, None)
        self.not_restored.pop(session.id, None)

    def get(self, session_id: str, token: str) -> Session:
        """The session, if ``token`` is its capability token; the error says nothing about other sessions."""
        session = self.by_id.get(session_id)
        if session is None and session_id in self.evicted:
            if not hmac.compare_digest(self.evicted[session_id].encode(), token.encode()):
                raise RequestRefused(
                    ErrorCode.NOT_OWNER, f"Session {session_id!r} belongs to another client; use your own session."
                )
            raise RequestRefused(
                ErrorCode.SESSION_EVICTED,
                f"Session {session_id!r} was evicted because the pool and the spill directory were full; "
                "open a new session (or give the daemon a larger cache_pool_size or spill_max_bytes).",
            )
        if session is None and session_id in self.not_restored:
            owner, refusal = self.not_restored[session_id]
            if not hmac.compare_digest(owner.encode(), token.encode()):
                raise RequestRefused(
                    ErrorCode.NOT_OWNER, f"Session {session_id!r} belongs to another client; use your own session."
                )
            raise refusal
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

    def remove(self, session: Session, evicted: bool = False) -> None:
        del self.by_id[session.id]
        self._per_task[session.task] -= 1
        if evicted:
            self.evicted[session.id] = session.token
            if len(self.evicted) > MAX_EVICTED_REMEMBERED:  # oldest first (dicts keep insertion order)
                del self.evicted[next(iter(self.evicted))]

    def not_restored_at_start(self, session_id: str, token: str, refusal: RequestRefused) -> None:
        self.not_restored[session_id] = (token, refusal)
        if len(self.not_restored) > MAX_EVICTED_REMEMBERED:
            del self.not_restored[next(iter(self.not_restored))]

    def count(self, task: str) -> int:
        return self._per_task[task]

    def idle_longer_than(self, seconds: float, now: float) -> list[Session]:
        return [s for s in self.by_id.values() if not s.busy and now - s.last_used > seconds]
