"""The cross-node tier as the engine sees it: checkpoints handed to the background writer, sessions fetched by
helper threads, and what both report back. Methods without a leading underscore run on the engine thread,
except the fetch itself (``_fetch``), which runs on a helper thread and touches only Redis.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import socket
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import msgspec

from kvpool.daemon.config import Config
from kvpool.daemon.kv.pool.layout import NO_PREFIX, TIER_POOL, payload_bytes
from kvpool.daemon.kv.pool.pool import Pool
from kvpool.daemon.kv.sessions import Session
from kvpool.daemon.kv.spill_dir import SpillDir
from kvpool.daemon.refusals import RequestRefused
from kvpool.daemon.remote import record as rec
from kvpool.daemon.remote.lease import Lease, LeaseHeld
from kvpool.daemon.remote.store import RemoteStore, RemoteUnavailable
from kvpool.daemon.remote.writer import Event, Job, RemoteWriter, Source
from kvpool.protocol import ErrorCode
from kvpool.protocol.status import RemoteCounts, RemoteStatus

log = logging.getLogger("kvpool.remote")

FLUSH_AT_STOP_S = 5.0
MAX_GONE_REMEMBERED = 4096


def checkpoint_job(s: Session, pool: Pool, fingerprint: str, kv_layout: str) -> Job:
    """The write job of ``s``'s committed checkpoint: its record and where its bytes are. Runs on the engine
    thread. A snapshot that builds on a shared prefix holds only its own cells, not a checkpoint another node could
    use (with the remote tier on, new checkpoints are whole; only one recovered from an older pool is not): its
    job carries no record, only the lease."""
    job = Job(s.id)
    snap = s.snapshot
    if snap is None or snap.prefix_entry != NO_PREFIX:
        return job
    job.record = rec.RemoteRecord(
        session=s.id,
        token_sha256=rec.token_hash(s.token),
        task=s.task,
        n_tokens=snap.n_tokens,
        n_kv=snap.n_kv,
        state_bytes=snap.state_bytes,
        fingerprint=fingerprint,
        kv_layout=kv_layout,
        checksum=snap.checksum,
        kv_type=snap.kv_type,
        raw_bytes=snap.raw_bytes,
        version=snap.version,
        generation=0,
        last_used=0.0,
        written_at=0.0,
        node="",
    )
    length = payload_bytes(snap.state_bytes, snap.n_tokens)
    if snap.tier == TIER_POOL:
        # The baseline of the writer's check that the extent was not reused: taken here, on the engine thread,
        # while the extent is the session's committed snapshot (else no baseline: a full check).
        frees = pool.allocator.frees if pool.committed(s.entry) == snap else -1
        job.source = Source(length, pool_offset=snap.offset, pool_frees=frees)
    else:
        job.source = Source(length, spill_version=snap.version)
    return job


@dataclass
class Fetched:
    """A session's checkpoint taken from the remote tier, with the lease this node now holds for it."""

    record: rec.RemoteRecord
    payload: memoryview
    lease: Lease


def node_name(config: Config, address: str) -> str:
    """This daemon's name in leases: remote_node, else host name and address (what a client connects to)."""
    return config.remote_node or f"{socket.gethostname()} {address}"


class RemoteTier:
    def __init__(self, config: Config, fingerprint: str, kv_layout: str, pool: Pool, spill: SpillDir, node: str):
        self.fingerprint, self.kv_layout = fingerprint, kv_layout
        self.lease_ms = config.remote_lease_ms
        keys = rec.Keys.of(config.remote_prefix, fingerprint, kv_layout)
        self.store = RemoteStore(config.remote, keys, node, config.remote_timeout_ms / 1e3)
        self.counts = RemoteCounts()
        self.writer = RemoteWriter(
            self.store,
            pool,
            spill,
            lease_ms=config.remote_lease_ms,
            ttl_ms=int(config.remote_ttl * 1000),
            max_pending_bytes=config.remote_queue_bytes,
            counts=self.counts,
            timeout_s=config.remote_timeout_ms / 1e3,
        )
        self._fetchers = ThreadPoolExecutor(2, thread_name_prefix="remote-fetch")
        self.synced: dict[str, tuple[int, int]] = {}  # session -> (n_tokens, n_kv) of its newest remote copy
        self.lost: dict[str, str] = {}  # session -> the node that owns it now (this node's copy is stale)
        self.migrating: set[str] = set()
        # Sessions dropped here because another node took them: session -> (that node, the owner's token).
        self.gone: dict[str, tuple[str, str]] = {}

    def start(self, recovered: Iterable[Session]) -> None:
        """Take the leases of the sessions recovered from the pool and queue their newest state, then connect."""
        for s in recovered:
            self.saved(s)
        try:
            self.store.ping()
        except RemoteUnavailable as exc:
            log.warning("remote tier %s unreachable at start (%s): retrying in the background", self.store.url, exc)
            self.writer.up = False
        self.writer.start()

    # ------------------------------------------------------------------ checkpoints out

    def saved(self, s: Session, then: str = "keep", waiter: Callable[[bool, str], None] | None = None) -> None:
        """A checkpoint of ``s`` was committed: queue it for Redis (the writer reads its bytes later)."""
        job = checkpoint_job(s, self.writer.pool, self.fingerprint, self.kv_layout)
        job.then, job.waiters = then, [waiter] if waiter else []
        self.writer.put(job)

    def forget(self, session: str, delete: bool) -> None:
        """The session leaves this node: give up its lease once its newest checkpoint is written (``delete``:
        it was closed, so its remote copy goes too)."""
        self.synced.pop(session, None)
        self.migrating.discard(session)
        self.writer.put(Job(session, then="delete" if delete else "release"))

    def migrate(self, s: Session, done: Callable[[bool, str], None]) -> None:
        """Hand ``s`` over: its newest checkpoint written, then its lease given up; ``done`` (on the writer's
        thread) says whether that worked. Until migration_ended, turns of ``s`` here are refused."""
        self.migrating.add(s.id)
        self.saved(s, then="release", waiter=done)

    def migration_ended(self, session: str) -> None:
        self.migrating.discard(session)

    def adopt(self, s: Session, fetched: Fetched) -> None:
        self.lost.pop(s.id, None)
        self.gone.pop(s.id, None)
        self.writer.adopt(s.id, fetched.lease)
        self.synced[s.id] = (fetched.record.n_tokens, fetched.record.n_kv)

    # ------------------------------------------------------------------ sessions in

    def fetch(self, session: str, token: str, done: Callable[[Fetched | RequestRefused], None]) -> None:
        """Take ``session`` from the remote tier on a helper thread; ``done`` gets the result there."""

        def run() -> None:
            try:
                result: Fetched | RequestRefused = self._fetch(session, token)
            except RequestRefused as refused:
                result = refused
            except Exception as exc:  # a bug costs this resume, never the daemon
                log.exception("fetching session %s from the remote tier failed", session)
                result = RequestRefused(ErrorCode.INTERNAL, f"Fetching the session from the remote tier failed: {exc}")
            done(result)

        self._fetchers.submit(run)

    def _fetch(self, session: str, token: str) -> Fetched:
        store = self.store
        try:
            if not store.exists(session):  # no lease is taken (nor a counter made) for what is not there
                raise RequestRefused(
                    ErrorCode.UNKNOWN_SESSION,
                    f"No session {session!r} here nor in the remote tier: it was closed, expired (remote_ttl), "
                    "was never saved, or belongs to another model; open a new one.",
                )
            lease = store.acquire(session, self.lease_ms)
        except LeaseHeld as exc:
            self.counts.conflicts += 1
            raise RequestRefused(ErrorCode.CONFLICT, str(exc), {"owner": exc.owner.node}) from None
        except RemoteUnavailable as exc:
            self.counts.fetch_failures += 1
            raise self.unavailable(exc) from None
        try:
            stored = store.get(session)
            if stored is None:
                store.release(session, lease)
                raise RequestRefused(
                    ErrorCode.UNKNOWN_SESSION, f"Session {session!r} expired from the remote tier; open a new one."
                )
            try:
                record, payload = rec.decode(*stored, session, self.fingerprint, self.kv_layout)
            except rec.RecordCorrupt as exc:
                self.counts.corrupt += 1
                log.warning("session %s: %s; its remote copy is removed", session, exc)
                store.delete(session, lease)
                raise RequestRefused(
                    ErrorCode.SESSION_CORRUPT,
                    f"Session {session}'s saved state is damaged ({exc}); it was closed, open a new one.",
                ) from None
            if not rec.token_matches(record, token):
                store.release(session, lease)
                raise RequestRefused(
                    ErrorCode.NOT_OWNER, f"Session {session!r} belongs to another client; use your own session."
                )
        except RemoteUnavailable as exc:
            self.counts.fetch_failures += 1
            raise self.unavailable(exc) from None
        self.counts.fetches += 1
        self.counts.fetch_bytes += len(stored[0]) + len(stored[1])
        return Fetched(record, payload, lease)

    def unavailable(self, exc: Exception) -> RequestRefused:
        return RequestRefused(
            ErrorCode.REMOTE_UNAVAILABLE,
            f"The remote tier did not answer ({exc}); sessions held here still work. Retry once Redis is back.",
        )

    def release_lease(self, session: str, lease: Lease) -> None:
        """A fetched session that could not be installed here: let other nodes have it."""

        def run() -> None:
            with contextlib.suppress(RemoteUnavailable):  # else it expires by itself
                self.store.release(session, lease)

        with contextlib.suppress(RuntimeError):  # the daemon is stopping: the lease expires by itself
            self._fetchers.submit(run)

    # ------------------------------------------------------------------ what the writer reports

    def reports(self, sessions: Mapping[str, Session]) -> list[Session]:
        """Between steps, what the writer reported: a queued checkpoint whose bytes changed is queued again; the
        idle sessions another node took are returned, for the caller to drop (a turn for one then gets CONFLICT
        naming that node)."""
        for event in self._events():
            s = sessions.get(event.session)
            rewrite = event.kind in ("stale", "vanished")
            if s is not None and rewrite and s.snapshot is not None and s.id not in self.lost:
                self.saved(s)
        taken = []
        for session in list(self.lost):
            s = sessions.get(session)
            if s is not None and not s.busy:
                owner = self.lost[session]
                log.warning("session %s is owned by node %s now: dropping this node's stale copy", s.id, owner)
                self.gone[session] = (self.lost.pop(session), s.token)
                if len(self.gone) > MAX_GONE_REMEMBERED:  # oldest first
                    del self.gone[next(iter(self.gone))]
                taken.append(s)
        return taken

    def _events(self) -> list[Event]:
        out: list[Event] = []
        while not self.writer.events.empty():
            event = self.writer.events.get_nowait()
            if event.kind == "written":
                self.synced[event.session] = event.detail  # type: ignore[assignment]
            elif event.kind == "lost":
                owner = event.detail
                self.lost[event.session] = owner.node if isinstance(owner, Lease) else "another node"
                self.synced.pop(event.session, None)
            elif event.kind == "vanished":
                self.synced.pop(event.session, None)  # behind until its copy is written again
            out.append(event)
        return out

    def check_owned(self, s: Session) -> None:
        """CONFLICT when another node took this session: this node's copy must not fork it."""
        owner = self.lost.get(s.id)
        if owner is not None:
            raise RequestRefused(
                ErrorCode.CONFLICT,
                f"Session {s.id} is owned by node {owner} now; continue it there (this node's copy is stale).",
                {"owner": owner},
            )
        if s.id in self.migrating:
            raise RequestRefused(
                ErrorCode.CONFLICT, f"Session {s.id} is being migrated to another node; resume it there."
            )

    def check_gone(self, session: str, token: str) -> None:
        """A turn for a session dropped here because another node owns it: CONFLICT naming that node."""
        gone = self.gone.get(session)
        if gone is not None and hmac.compare_digest(gone[1].encode(), token.encode()):
            raise RequestRefused(
                ErrorCode.CONFLICT,
                f"Session {session} is owned by node {gone[0]} now; continue it there, or resume it here once that "
                "node has let it go.",
                {"owner": gone[0]},
            )

    def where(self, s: Session) -> str:
        """Where the session's newest copy lives, remotely: current, behind (a write pending), lost."""
        if s.id in self.lost:
            return "lost"
        synced = self.synced.get(s.id)
        if synced is not None and s.checkpoint_fresh and synced == (len(s.tokens), s.n_kv):
            return "current"
        return "behind"

    def status(self) -> RemoteStatus:
        c = self.counts
        return RemoteStatus(
            **msgspec.structs.asdict(c),
            url=self.store.url,
            node=self.store.node,
            connected=self.writer.up,
            pending=self.writer.pending,
            pending_bytes=self.writer.pending_bytes,
            leases_held=self.writer.leases_held,
        )

    def close(self) -> None:
        self.writer.close(FLUSH_AT_STOP_S)
        self._fetchers.shutdown(wait=True, cancel_futures=True)
        self.store.close()
