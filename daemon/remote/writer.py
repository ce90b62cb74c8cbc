"""The remote writer: one background thread that copies committed checkpoints to Redis and keeps this node's
leases alive. The engine thread only hands it a small job (where the checkpoint's bytes are and its record);
the thread reads the bytes itself, so a turn never waits for Redis nor for a copy.

- Jobs are coalesced per session (only the newest checkpoint of a session is worth writing) and bounded by
  remote_queue_bytes of pending payload: beyond it the oldest job is dropped, counted and logged.
- The thread sends a checkpoint straight from the pool (or the spill file) to a staging key, then checks it
  against the record's checksum before committing it with its record: a mismatch means the engine has reused
  those bytes since (a newer checkpoint, a spill), and the engine is asked to hand over the session's current
  checkpoint instead ("stale").
- Redis down or slow: a failed job goes back to the queue (still coalesced and bounded), the failure is counted,
  the change of state is logged once, and the thread retries with a growing pause until Redis answers again.
- Leases are renewed every third of remote_lease_ms in one pipelined round trip; a lease found taken by another
  node, or a write fenced off, is reported to the engine ("lost").
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from kvpool.daemon.kv.pool.checksum import checksum
from kvpool.daemon.kv.pool.pool import Pool
from kvpool.daemon.kv.spill_dir import SnapshotCorrupt, SpillDir, SpillError
from kvpool.daemon.remote import record as rec
from kvpool.daemon.remote.lease import Lease, LeaseHeld
from kvpool.daemon.remote.store import RemoteStore, RemoteUnavailable
from kvpool.protocol.status import RemoteCounts

log = logging.getLogger("kvpool.remote")

MAX_BACKOFF_S = 2.0


@dataclass
class Source:
    """Where a committed checkpoint's payload is: a pool extent, or a spill file (session, version).
    ``pool_frees``: the pool's count of freed extents when the job was made (see _intact)."""

    length: int
    pool_offset: int | None = None
    spill_version: int = 0
    pool_frees: int = -1


@dataclass
class Job:
    session: str
    record: rec.RemoteRecord | None = None  # a checkpoint to write (None: only the lease to take or give up)
    source: Source | None = None
    then: str = "keep"  # after the write: "keep" the lease, "release" it, or "delete" the session's remote keys
    waiters: list[Callable[[bool, str], None]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return self.source.length if self.source is not None else 0


@dataclass(frozen=True)
class Event:
    """What the writer tells the engine: "written" (n_tokens, n_kv), "lost" (the owner), "stale", "dropped",
    "vanished" (its lease was gone, and may be its copy with it)."""

    kind: str
    session: str
    detail: object = None


class RemoteWriter:
    def __init__(
        self,
        store: RemoteStore,
        pool: Pool,
        spill: SpillDir,
        *,
        lease_ms: int,
        ttl_ms: int,
        max_pending_bytes: int,
        counts: RemoteCounts,
        timeout_s: float,
    ):
        self.store, self.pool, self.spill = store, pool, spill
        self.lease_ms, self.ttl_ms, self.max_pending_bytes = lease_ms, ttl_ms, max_pending_bytes
        self.counts, self.timeout_s = counts, timeout_s
        self.events: queue.Queue[Event] = queue.Queue()
        self._jobs: OrderedDict[str, Job] = OrderedDict()
        self._leases: dict[str, Lease] = {}
        self._cond = threading.Condition()
        self._stopping = False
        self._busy = False
        self.up = True
        self._thread = threading.Thread(target=self._run, name="remote-writer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # ------------------------------------------------------------------ engine side

    @property
    def pending_bytes(self) -> int:
        with self._cond:
            return sum(j.nbytes for j in self._jobs.values())

    @property
    def pending(self) -> int:
        with self._cond:
            return len(self._jobs)

    @property
    def leases_held(self) -> int:
        with self._cond:
            return len(self._leases)

    def put(self, job: Job) -> None:
        """Queue a job; it replaces the session's older one (whose waiters and `then` it inherits)."""
        with self._cond:
            old = self._jobs.pop(job.session, None)
            if old is not None:
                job.waiters = old.waiters + job.waiters
                if job.then == "keep":
                    job.then = old.then
                if job.record is None and job.then == "release" and old.record is not None:
                    job.record, job.source = old.record, old.source  # a release still writes the newest first
            self._jobs[job.session] = job
            self._bound()
            self._cond.notify()

    def adopt(self, session: str, lease: Lease) -> None:
        """This node took the session's lease elsewhere (a resume from the remote tier): keep it alive."""
        with self._cond:
            self._leases[session] = lease

    def lease_of(self, session: str) -> Lease | None:
        with self._cond:
            return self._leases.get(session)

    def _bound(self) -> None:
        total = sum(j.nbytes for j in self._jobs.values())
        while total > self.max_pending_bytes:
            victim = next((j for j in self._jobs.values() if j.record is not None), None)
            if victim is None:
                return
            total -= victim.nbytes
            victim.record, victim.source = None, None
            if victim.then == "keep" and not victim.waiters:
                del self._jobs[victim.session]
            self.counts.dropped += 1
            self.events.put(Event("dropped", victim.session))
            log.warning(
                "remote write of session %s dropped: more than remote_queue_bytes=%d pending (Redis slow or down)",
                victim.session,
                self.max_pending_bytes,
            )

    def close(self, flush_s: float) -> None:
        """Stop after writing what is pending, for at most ``flush_s`` seconds."""
        deadline = time.monotonic() + flush_s
        with self._cond:
            while (self._jobs or self._busy) and self.up and time.monotonic() < deadline:
                self._cond.wait(0.05)
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            # a call in flight ends within the socket timeout; the pool is unmapped only after this thread stopped
            self._thread.join(max(0.1, deadline - time.monotonic()) + 2 * self.timeout_s)

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        # Lowest CPU priority for this thread (Linux schedules threads apart): on a device whose cores all run
        # llama.cpp's decode threads, a write must take the idle time, not the next turn's (the decode threads
        # wait for each other at every graph node, so one preempted thread stalls the whole step).
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        backoff = 0.0
        next_renewal = 0.0
        while True:
            with self._cond:
                if backoff or not self._jobs:
                    wait = backoff or max(0.0, next_renewal - time.monotonic())
                    if wait > 0 and not self._stopping:
                        self._cond.wait(wait)
                if self._stopping:
                    return
                job = self._jobs.popitem(last=False)[1] if self._jobs else None
                self._busy = job is not None
            try:
                if backoff or time.monotonic() >= next_renewal:
                    self._renew()
                    next_renewal = time.monotonic() + self.lease_ms / 3000.0
                if job is not None:
                    self._do(job)
                self._went_up()
                backoff = 0.0
            except RemoteUnavailable as exc:
                if job is not None:
                    self.counts.write_failures += 1
                    self._requeue(job)
                self._tell_waiters(f"the remote tier did not answer: {exc}")
                self._went_down(exc)
                backoff = min(MAX_BACKOFF_S, max(0.05, backoff * 2))
            except Exception:  # a bug costs this job, never the thread
                log.exception("remote write of session %s failed", job.session if job else "-")
                if job is not None:
                    self._notify(job, False, "internal error")
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _tell_waiters(self, why: str) -> None:
        """Redis does not answer: whoever waits for a queued job (a migrate) is told now, not once Redis is back,
        and its session stays here (its hand-over becomes a plain write; a close's delete stays a delete)."""
        told: list[Callable[[bool, str], None]] = []
        with self._cond:
            for job in self._jobs.values():
                if job.waiters:
                    told += job.waiters
                    job.waiters = []
                    if job.then == "release":
                        job.then = "keep"
        for waiter in told:
            waiter(False, why)

    def _requeue(self, job: Job) -> None:
        with self._cond:
            newer = self._jobs.pop(job.session, None)
            if newer is not None:  # a newer checkpoint came meanwhile: it goes instead, keeping the old waiters
                newer.waiters = job.waiters + newer.waiters
                job = newer
            self._jobs[job.session] = job
            self._jobs.move_to_end(job.session, last=False)

    def _went_down(self, exc: RemoteUnavailable) -> None:
        if self.up:
            self.up = False
            self.counts.disconnects += 1
            log.warning("remote tier unreachable (%s): local tiers go on serving, writes wait and retry", exc)

    def _went_up(self) -> None:
        if not self.up:
            self.up = True
            log.info("remote tier %s reachable again: pending writes resume", self.store.url)

    def _renew(self) -> None:
        with self._cond:
            leases = dict(self._leases)
        for session in self.store.renew(leases, self.lease_ms):
            if self.store.owner(session) is None:
                # Nobody holds it (it expired while Redis was unreachable, or Redis restarted empty): take it again.
                try:
                    held = self.store.acquire(session, self.lease_ms)
                except LeaseHeld:
                    self._lost(session)
                    continue
                with self._cond:
                    if session in self._leases:
                        self._leases[session] = held
                # Its copy may have gone with the lease (a Redis restarted empty): the engine writes it again.
                self.events.put(Event("vanished", session))
                continue
            self._lost(session)

    def _lost(self, session: str) -> None:
        with self._cond:
            self._leases.pop(session, None)
        owner = self.store.owner(session)
        self.counts.leases_lost += 1
        why = f"node {owner.node}" if owner is not None else "nobody (its lease expired)"
        log.warning("lost the lease of session %s to %s", session, why)
        self.events.put(Event("lost", session, owner))

    def _lease(self, session: str) -> Lease:
        with self._cond:
            held = self._leases.get(session)
        if held is None:
            held = self.store.acquire(session, self.lease_ms)
            with self._cond:
                self._leases[session] = held
        return held

    def _do(self, job: Job) -> None:
        if job.record is None and job.then != "keep" and self.lease_of(job.session) is None:
            self._notify(job, True, "")  # never written from here: no lease to give up
            return
        try:
            held = self._lease(job.session)
        except LeaseHeld as exc:
            self.counts.fenced += 1
            self.events.put(Event("lost", job.session, exc.owner))
            self._notify(job, False, str(exc))
            return
        if job.record is not None and job.source is not None and not self._write(job, held):
            return
        if job.then in ("release", "delete"):
            with self._cond:
                self._leases.pop(job.session, None)
            if job.then == "delete":
                self.store.delete(job.session, held)
            else:
                self.store.release(job.session, held)
        self._notify(job, True, "")

    def _write(self, job: Job, held: Lease) -> bool:
        assert job.record is not None and job.source is not None
        started = time.perf_counter()
        record = msgspec.structs.replace(
            job.record, generation=held.generation, written_at=time.time(), node=self.store.node
        )
        try:
            payload = self._payload(job.session, job.source, record.checksum)
        except SpillError as exc:  # (not "stale": the engine would hand over the same file, read again in vain)
            log.warning("remote write of session %s skipped: %s", job.session, exc)
            self._notify(job, False, "its checkpoint cannot be read from the spill directory")
            return False
        try:
            if payload is not None:
                self.store.stage(job.session, held, payload)
            intact = payload is not None and self._intact(job.source, payload, record.checksum)
        finally:
            if payload is not None:
                payload.release()
        if not intact:
            if payload is not None:  # dropped before anyone is told, so that whoever hears "stale" finds it gone
                with contextlib.suppress(RemoteUnavailable):  # else it expires by itself (STAGE_MS)
                    self.store.unstage(job.session, held)
            self.counts.stale += 1
            self.events.put(Event("stale", job.session))
            self._notify(job, False, "its checkpoint changed while it was queued; retry")
            return False
        head = rec.encode(record)
        if not self.store.commit(job.session, held, head, self.ttl_ms):
            with contextlib.suppress(RemoteUnavailable):
                self.store.unstage(job.session, held)
            self.counts.fenced += 1
            with self._cond:
                self._leases.pop(job.session, None)
            owner = self.store.owner(job.session)
            self.events.put(Event("lost", job.session, owner))
            self._notify(job, False, f"fenced off: node {owner.node if owner else '?'} owns it now")
            return False
        self.counts.writes += 1
        self.counts.write_bytes += len(head) + job.source.length
        self.counts.write_seconds += time.perf_counter() - started
        self.events.put(Event("written", job.session, (record.n_tokens, record.n_kv)))
        return True

    def _intact(self, source: Source, payload: memoryview, digest: int) -> bool:
        """Whether the bytes just sent are the checkpoint's. Pool bytes went as they were during the send, and
        the engine may have reused the extent since the job was queued or during the send (a newer checkpoint,
        a spill); checked after the send, before the commit makes them visible. While no extent was freed since
        the job was made, none was reused (snapshots are never changed in place): no need to reread them. A spill
        file's bytes are a private copy, checked when read."""
        if source.pool_offset is None or source.pool_frees == self.pool.allocator.frees:
            return True
        return checksum(payload) == digest

    def _payload(self, session: str, source: Source, digest: int) -> memoryview | None:
        """The checkpoint's bytes: a view of the pool extent (no copy), or the spill file's contents (None when
        the file is gone or not this checkpoint's any more: the job then ends as stale; SpillError when the
        directory cannot be read)."""
        if source.pool_offset is not None:
            return self.pool.view(source.pool_offset, source.length)
        try:
            return memoryview(self.spill.read(session, source.spill_version, digest))
        except SnapshotCorrupt:
            return None

    @staticmethod
    def _notify(job: Job, ok: bool, why: str) -> None:
        for waiter in job.waiters:
            waiter(ok, why)
