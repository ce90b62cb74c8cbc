"""The request handlers' side of the cross-node tier (a CrossNode, interface.py): resuming a session from the
remote tier, migrating one away, prefetching one ahead of its turn, and what the background writer reports.
Engine thread only. A fetch from Redis runs on a helper thread and comes back as a RemoteArrived message through
the engine's inbox, so the engine never waits for Redis.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from kvpool import protocol as p
from kvpool.daemon.engine.replies import session_opened
from kvpool.daemon.kv.manager import KvManager
from kvpool.daemon.kv.sessions import Session
from kvpool.daemon.preload.preloader import Preloader
from kvpool.daemon.refusals import RequestRefused
from kvpool.daemon.remote.interface import Handler
from kvpool.protocol import ErrorCode
from kvpool.protocol.status import RemoteStatus

if TYPE_CHECKING:  # the tier needs redis-py (the `remote` extra): only a daemon with `remote` set imports it
    from kvpool.daemon.remote.tier import Fetched, RemoteTier

log = logging.getLogger("kvpool.engine")

Submit = Callable[[bytes, Any], bool]


class RemoteArrived(msgspec.Struct, tag="remote_arrived"):
    """Internal (never on the wire): a fetch from the remote tier ended, with a Fetched or a RequestRefused."""

    id: int
    session: str
    token: str
    prefetch: bool  # move it up the tiers too
    answer_prefetched: bool  # the request was a Prefetch (else a ResumeSession)
    result: Any


class MigrationDone(msgspec.Struct, tag="migration_done"):
    """Internal: the writer wrote a migrating session's newest checkpoint and gave up its lease (or failed)."""

    id: int
    session: str
    ok: bool
    why: str


class RemoteRequests:
    def __init__(self, remote: RemoteTier, kv: KvManager, preloader: Preloader, submit: Submit):
        """``submit``: the engine's inbox, where fetches and migrations that ended come back as messages."""
        self.remote, self.kv, self.preloader, self.submit = remote, kv, preloader, submit
        self.sessions = kv.sessions
        self.internal: dict[type, Handler] = {RemoteArrived: self.arrived, MigrationDone: self.migrated}

    # ------------------------------------------------------------------ sessions in

    def fetch(self, client: bytes, r: p.SessionRequest, prefetch: bool, answer_prefetched: bool) -> bool:
        request_id, session, token = r.id, r.session, r.token

        def done(result: Fetched | RequestRefused) -> None:
            arrived = RemoteArrived(
                id=request_id,
                session=session,
                token=token,
                prefetch=prefetch,
                answer_prefetched=answer_prefetched,
                result=result,
            )
            if not self.submit(client, arrived) and not isinstance(result, RequestRefused):  # the engine is stopping
                self.remote.release_lease(session, result.lease)

        self.remote.fetch(session, token, done)
        return True

    def arrived(self, client: bytes, m: RemoteArrived, received_at: float) -> p.Reply:
        result = m.result
        if isinstance(result, RequestRefused):
            raise result
        existing = self.sessions.by_id.get(m.session)
        if existing is not None:  # two resumes of one session raced here: the first installed it
            s = self.sessions.get(m.session, m.token)
        else:
            try:
                s = self._install(m.session, m.token, result)
            except RequestRefused:
                self.remote.release_lease(m.session, result.lease)
                raise
            log.info("session %s resumed from the remote tier (written by %s)", s.id, result.record.node)
        if m.prefetch:
            self.preloader.fetched(s)
        if m.answer_prefetched:
            return p.Prefetched(id=m.id, session=s.id, tier=s.tier)
        return session_opened(m.id, s)

    def _install(self, session_id: str, token: str, fetched: Fetched) -> Session:
        record = fetched.record
        limit = self.sessions.context_limit(record.task)
        if record.n_tokens >= limit:
            raise RequestRefused(
                ErrorCode.CONTEXT_OVERFLOW,
                f"Session {session_id} holds {record.n_tokens} tokens; this daemon's sessions of task "
                f"{record.task!r} hold at most {limit - 1}. Resume it on a node with a larger context_size.",
            )
        tokens = np.frombuffer(fetched.payload, dtype="<i4", offset=record.state_bytes).tolist()
        s = self.kv.open(
            session_id,
            token,
            record.task,
            tokens=tokens,
            n_kv=record.n_kv,
            boundary=len(tokens) if record.state_bytes == 0 else 0,  # only a system prompt so far
        )
        try:
            self.kv.install(
                s, fetched.payload, record.state_bytes, record.n_kv, record.checksum, record.kv_type, record.raw_bytes
            )
        except BaseException:
            self.kv.drop(s)
            raise
        self.kv.touch(s)
        self.remote.adopt(s, fetched)
        return s

    # ------------------------------------------------------------------ ownership

    def check_owned(self, s: Session) -> None:
        self.remote.check_owned(s)

    def check_gone(self, session: str, token: str) -> None:
        self.remote.check_gone(session, token)

    def where(self, s: Session) -> str:
        return self.remote.where(s)

    def closed(self, s: Session) -> None:
        self.remote.forget(s.id, delete=True)  # after drop's release: the delete wins (the writer coalesces)

    # ------------------------------------------------------------------ migrate

    def migrate(self, client: bytes, r: p.Migrate, received_at: float) -> None:
        s = self.sessions.get(r.session, r.token)
        self.remote.check_owned(s)
        if s.busy:
            raise RequestRefused(
                ErrorCode.SESSION_BUSY, f"Session {s.id} is generating; wait for its final message, then migrate."
            )
        if s.snapshot is None and s.slot is None:
            raise RequestRefused(
                ErrorCode.BAD_REQUEST, f"Session {s.id} holds nothing to hand over yet; send its first turn here."
            )
        if s.slot is not None and not s.checkpoint_fresh:
            self.kv.checkpoint(s)  # (queues its write too)
        request_id, session = r.id, s.id

        def done(ok: bool, why: str) -> None:
            self.submit(client, MigrationDone(id=request_id, session=session, ok=ok, why=why))

        self.remote.migrate(s, done)
        return None

    def migrated(self, client: bytes, m: MigrationDone, received_at: float) -> p.Reply:
        self.remote.migration_ended(m.session)
        s = self.sessions.by_id.get(m.session)
        if not m.ok:
            raise RequestRefused(
                ErrorCode.REMOTE_UNAVAILABLE,
                f"Session {m.session} could not be handed over ({m.why}); it stays here, retry later.",
            )
        tokens = len(s.tokens) if s is not None else 0
        if s is not None:
            self.kv.drop(s)  # its lease is already given up; drop's release finds nothing to release
        self.remote.counts.migrations += 1
        log.info("session %s migrated away through the remote tier", m.session)
        return p.Migrated(id=m.id, session=m.session, context_tokens=tokens)

    # ------------------------------------------------------------------ between steps, status

    def between_steps(self) -> None:
        for s in self.remote.reports(self.sessions.by_id):
            self.kv.drop(s)

    def status(self) -> RemoteStatus | None:
        return self.remote.status()
