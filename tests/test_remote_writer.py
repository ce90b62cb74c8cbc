"""The remote writer against a real pool segment and a real redis-server: it sends a checkpoint straight from
the pool and commits it only if those bytes were still the checkpoint's once sent."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.daemon.kv.place import SessionPlace
from kvpool.daemon.kv.pool.pool import Pool
from kvpool.daemon.kv.sessions import Session
from kvpool.daemon.kv.spill_dir import SpillDir
from kvpool.daemon.remote import record as rec
from kvpool.daemon.remote import tier
from kvpool.daemon.remote.record import Keys
from kvpool.daemon.remote.store import RemoteStore
from kvpool.daemon.remote.writer import Event, Job, RemoteWriter
from kvpool.protocol.status import RemoteCounts

from .redis_server import RedisServer
from .test_pool import write_snapshot

FINGERPRINT, LAYOUT = "a" * 32, "type_k=1"
TOKENS = list(range(100))


@pytest.fixture
def parts(redis_server: RedisServer, tmp_path: Path) -> Iterator[tuple[Pool, RemoteStore, RemoteWriter]]:
    name = f"/kvpool-test-{secrets.token_hex(6)}"
    pool = Pool.open(name, 1 << 20, 8, FINGERPRINT, LAYOUT)
    store = RemoteStore(redis_server.url, Keys("test:w"), "node-a", 2.0)
    writer = RemoteWriter(
        store,
        pool,
        SpillDir(tmp_path / "spill", 1 << 20, FINGERPRINT, LAYOUT),
        lease_ms=10_000,
        ttl_ms=0,
        max_pending_bytes=1 << 30,
        counts=RemoteCounts(),
        timeout_s=2.0,
    )
    writer.start()
    try:
        yield pool, store, writer
    finally:
        writer.close(5.0)
        store.close()
        pool.close()
        Pool.unlink(name)


def checkpoint_job(pool: Pool, session: str, fill: int) -> Job:
    """Commit a checkpoint of ``session`` into the pool and make its write job, as the engine does."""
    index = pool.claim(session, "t" * 32, "voice")
    assert index is not None
    write_snapshot(pool, index, bytes([fill]) * 40_000, TOKENS)
    s = Session(
        session, "t" * 32, "voice", index, context_limit=1024, place=SessionPlace(snapshot=pool.committed(index))
    )
    return tier.checkpoint_job(s, pool, FINGERPRINT, LAYOUT)


def outcome(writer: RemoteWriter) -> Event:
    return writer.events.get(timeout=10)


def test_a_checkpoint_goes_from_the_pool_to_redis(parts: tuple[Pool, RemoteStore, RemoteWriter]) -> None:
    pool, store, writer = parts
    writer.put(checkpoint_job(pool, "s" * 16, 7))
    assert outcome(writer).kind == "written"
    stored = store.get("s" * 16)
    assert stored is not None
    record, payload = rec.decode(*stored, "s" * 16, FINGERPRINT, LAYOUT)
    assert bytes(payload[:40_000]) == bytes([7]) * 40_000 and record.n_tokens == len(TOKENS)


def test_a_checkpoint_whose_extent_was_reused_is_never_committed(
    parts: tuple[Pool, RemoteStore, RemoteWriter], redis_server: RedisServer
) -> None:
    pool, store, writer = parts
    job = checkpoint_job(pool, "r" * 16, 1)
    # While the job waits (Redis slow), the engine gives the extent to another session's checkpoint.
    index = next(e.index for e in pool.entries() if e.session == "r" * 16)
    pool.release(index)
    other = checkpoint_job(pool, "o" * 16, 2)
    assert other.source is not None and job.source is not None
    assert other.source.pool_offset == job.source.pool_offset  # first fit: the same bytes
    writer.put(job)
    assert outcome(writer) == Event("stale", "r" * 16)
    raw = redis_server.client()
    assert store.get("r" * 16) is None  # no record, no payload, and its staged bytes were dropped
    assert not [k for kind in ("rec", "snap", "stage") for k in raw.keys(f"test:w:{kind}:{'r' * 16}*")]
    assert writer.counts.stale == 1

    # Freed but not reused: the bytes are still the checkpoint's (checked in full), so it is written.
    kept = checkpoint_job(pool, "k" * 16, 3)
    pool.allocator.free(pool.allocator.allocate(64))  # an unrelated free moves the count on
    writer.put(kept)
    assert outcome(writer).kind == "written" and store.get("k" * 16) is not None
