"""Requests that reach past this node's tiers: resuming a session from the remote tier, migrating one away,
prefetching one ahead of its turn. They extend RequestHandlers (engine/requests.py) by wrapping a few of its
handlers; engine thread only. A fetch from Redis runs on a helper thread and comes back as a RemoteArrived
message through the engine's inbox, so the engine never waits for Redis.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from kvpool import protocol as p
from kvpool.daemon.config import Config
from kvpool.daemon.engine.loop import Engine
from kvpool.daemon.engine.preloading import Preloader
from kvpool.daemon.engine.requests import RequestHandlers
from kvpool.daemon.errors import RequestRefused
from kvpool.daemon.kv.sessions import Session
from kvpool.protocol import ErrorCode

if TYPE_CHECKING:
    from kvpool.daemon.kv.remote.tier import Fetched, RemoteTier

log = logging.getLogger("kvpool.engine")

Submit = Callable[[bytes, Any], bool]
MAX_GONE_REMEMBERED = 4096


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


class TierRequests:
    def __init__(self, base: RequestHandlers, preloader: Preloader, remote: RemoteTier | None, submit: Submit):
        self.base, self.preloader, self.remote, self.submit = base, preloader, remote, submit
        self.tiers, self.sessions = base.tiers, base.sessions
        by = base.by_type
        self._resume, self._generate, self._close = by[p.ResumeSession], by[p.Generate], by[p.CloseSession]
        self._list = by[p.ListSessions]
        by[p.ResumeSession] = self.resume
        by[p.Generate] = self.generate
        by[p.Prefetch] = self.prefetch
        by[p.Migrate] = self.migrate
        if remote is not None:
            by[p.CloseSession] = self.close
            by[p.ListSessions] = self.list_sessions
            by[RemoteArrived] = self.arrived
            by[MigrationDone] = self.migrated

    # ------------------------------------------------------------------ resume, prefetch

    def resume(self, client: bytes, r: p.ResumeSession, received_at: float) -> p.Reply | None:
        try:
            reply = self._resume(client, r, received_at)
        except RequestRefused as refused:
            if self.remote is None or refused.code not in (ErrorCode.UNKNOWN_SESSION, ErrorCode.SESSION_EVICTED):
                raise
            self._fetch(client, r, prefetch=r.prefetch, answer_prefetched=False)
            return None
        s = self.sessions.by_id[r.session]
        if self.remote is not None:
            self.remote.check_owned(s)
        if r.prefetch:
            self.preloader.hint(s)
        return reply

    def prefetch(self, client: bytes, r: p.Prefetch, received_at: float) -> p.Reply | None:
        s = self.sessions.by_id.get(r.session)
        if s is None and self.remote is not None and r.session not in self.sessions.evicted:
            self._fetch(client, r, prefetch=True, answer_prefetched=True)
            return None
        s = self.sessions.get(r.session, r.token)
        if self.remote is not None:
            self.remote.check_owned(s)
        return p.Prefetched(id=r.id, session=s.id, tier=self.preloader.hint(s))

    def _fetch(self, client: bytes, r: p.SessionRequest, prefetch: bool, answer_prefetched: bool) -> None:
        assert self.remote is not None
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
                assert self.remote is not None
                self.remote.release_lease(session, result.lease)

        self.remote.fetch(session, token, done)

    def arrived(self, client: bytes, m: RemoteArrived, received_at: float) -> p.Reply:
        assert self.remote is not None
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
        return self.base._opened(m.id, s)

    def _install(self, session_id: str, token: str, fetched: Fetched) -> Session:
        assert self.remote is not None
        record = fetched.record
        self.sessions.check_can_open(record.task)
        limit = self.sessions.context_limit(record.task)
        if record.n_tokens >= limit:
            raise RequestRefused(
                ErrorCode.CONTEXT_OVERFLOW,
                f"Session {session_id} holds {record.n_tokens} tokens; this daemon's sessions of task "
                f"{record.task!r} hold at most {limit - 1}. Resume it on a node with a larger context_size.",
            )
        entry = self.tiers.pool.claim(session_id, token, record.task)
        if entry is None:
            raise RequestRefused(
                ErrorCode.QUOTA_EXCEEDED, "The pool's session table is full; close a session here first."
            )
        tokens = np.frombuffer(fetched.payload, dtype="<i4", offset=record.state_bytes).tolist()
        s = Session(
            id=session_id,
            token=token,
            task=record.task,
            entry=entry,
            context_limit=limit,
            tokens=tokens,
            n_kv=record.n_kv,
        )
        if record.state_bytes == 0:
            s.boundary = len(tokens)  # only a system prompt so far
        self.sessions.add(s)
        try:
            self.tiers.writer.install(
                s, fetched.payload, record.state_bytes, record.n_kv, record.checksum, record.kv_type, record.raw_bytes
            )
        except BaseException:
            self.tiers.drop(s)
            raise
        self.tiers.pool.touch(s.entry)
        self.remote.adopt(s, fetched)
        return s

    # ------------------------------------------------------------------ turns, close, list

    def generate(self, client: bytes, r: p.Generate, received_at: float) -> None:
        s = self.sessions.by_id.get(r.session)
        if s is None and self.remote is not None:
            self.remote.check_gone(r.session, r.token)
        if s is not None and self.remote is not None:
            self.sessions.get(r.session, r.token)  # the owner check first: strangers learn nothing
            self.remote.check_owned(s)
        result = self._generate(client, r, received_at)
        if s is not None:
            self.preloader.turn(s)
        return result

    def close(self, client: bytes, r: p.CloseSession, received_at: float) -> p.Reply:
        assert self.remote is not None
        s = self.sessions.get(r.session, r.token)
        reply = self._close(client, r, received_at)
        self.remote.forget(s.id, delete=True)  # after drop's release: the delete wins (the writer coalesces)
        return reply

    def list_sessions(self, client: bytes, r: p.ListSessions, received_at: float) -> p.Reply:
        assert self.remote is not None
        reply = self._list(client, r, received_at)
        for info in reply.sessions:
            s = self.sessions.by_id.get(info.session)
            if s is not None:
                info.remote = self.remote.where(s)
        return reply

    # ------------------------------------------------------------------ migrate

    def migrate(self, client: bytes, r: p.Migrate, received_at: float) -> None:
        if self.remote is None:
            raise RequestRefused(
                ErrorCode.BAD_REQUEST, "This daemon has no remote tier (set `remote`); a session cannot move."
            )
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
            self.tiers.checkpoint(s)  # (queues its write too)
        request_id, session = r.id, s.id

        def done(ok: bool, why: str) -> None:
            self.submit(client, MigrationDone(id=request_id, session=session, ok=ok, why=why))

        self.remote.migrating.add(s.id)
        self.remote.saved(s, then="release", waiter=done)
        return None

    def migrated(self, client: bytes, m: MigrationDone, received_at: float) -> p.Reply:
        assert self.remote is not None
        self.remote.migrating.discard(m.session)
        s = self.sessions.by_id.get(m.session)
        if not m.ok:
            raise RequestRefused(
                ErrorCode.REMOTE_UNAVAILABLE,
                f"Session {m.session} could not be handed over ({m.why}); it stays here, retry later.",
            )
        tokens = len(s.tokens) if s is not None else 0
        if s is not None:
            self.tiers.drop(s)  # its lease is already given up; drop's release finds nothing to release
        self.remote.counts.migrations += 1
        log.info("session %s migrated away through the remote tier", m.session)
        return p.Migrated(id=m.id, session=m.session, context_tokens=tokens)


def remote_events(tiers_requests: TierRequests) -> Callable[[], None]:
    """Between steps: preload what the predictor expects; apply what the remote writer reported (a session
    another node took is dropped here once idle; a queued checkpoint whose bytes changed is queued again)."""

    def run() -> None:
        tiers_requests.preloader.predict()
        remote = tiers_requests.remote
        if remote is None:
            return
        sessions = tiers_requests.sessions
        for event in remote.events():
            s = sessions.by_id.get(event.session)
            if s is None:
                continue
            if event.kind == "stale" and s.snapshot is not None and event.session not in remote.lost:
                remote.saved(s)
        for session in list(remote.lost):
            s = sessions.by_id.get(session)
            if s is not None and not s.busy:
                log.warning(
                    "session %s is owned by node %s now: dropping this node's stale copy", s.id, remote.lost[session]
                )
                remote.gone[session] = (remote.lost.pop(session), s.token)
                if len(remote.gone) > MAX_GONE_REMEMBERED:  # oldest first
                    del remote.gone[next(iter(remote.gone))]
                tiers_requests.tiers.drop(s)

    return run


def attach(engine: Engine, config: Config, address: str) -> RemoteTier | None:
    """Wire the remote tier (when `remote` is set) and preloading into an engine; the remote tier to close at
    stop (after the engine, before the pool)."""
    tiers = engine.tiers
    remote = None
    if config.remote:
        from kvpool.daemon.kv.remote.tier import RemoteTier, node_name  # redis-py: the `remote` extra

        remote = RemoteTier(
            config,
            engine.model.fingerprint,
            engine.model.kv_layout,
            tiers.pool,
            tiers.spill,
            node_name(config, address),
        )
        tiers.writer.whole_snapshots = True
        tiers.on_commit = remote.saved
    preloader = Preloader(tiers, config.preload, config.preload_horizon_s)

    def dropped(s: Session) -> None:
        preloader.dropped(s)
        if remote is not None:
            remote.forget(s.id, delete=False)

    tiers.on_drop = dropped
    requests = TierRequests(engine.handlers, preloader, remote, engine.submit)
    engine.between_steps.append(remote_events(requests))
    engine.status_parts.append(lambda status: setattr(status, "preload", msgspec.structs.replace(preloader.counts)))
    if remote is not None:
        engine.status_parts.append(lambda status: setattr(status, "remote", remote.status()))
        for s in list(tiers.sessions.by_id.values()):  # recovered: take their leases, push their newest state
            remote.saved(s)
        remote.start()
    return remote
