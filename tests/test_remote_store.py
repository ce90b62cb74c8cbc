"""The remote store's write protocol against a real redis-server: a payload is staged, then committed with its
record only while the writer holds the lease; until then the session's current checkpoint stays readable."""

from __future__ import annotations

import mmap
from collections.abc import Iterator

import pytest

from kvpool.daemon.remote.lease import LeaseHeld
from kvpool.daemon.remote.record import Keys
from kvpool.daemon.remote.store import RemoteStore, RemoteUnavailable

from .redis_server import RedisServer

Stores = tuple[RemoteStore, RemoteStore]


@pytest.fixture
def stores(redis_server: RedisServer) -> Iterator[Stores]:
    a = RemoteStore(redis_server.url, Keys("test:f:l"), "node-a", 2.0)
    b = RemoteStore(redis_server.url, Keys("test:f:l"), "node-b", 2.0)
    yield a, b
    a.close()
    b.close()


def shared_bytes(data: bytes) -> tuple[mmap.mmap, memoryview]:
    """A payload in a shared mapping, as the pool holds it: what the writer sends is a view of it, not a copy."""
    area = mmap.mmap(-1, len(data))
    area[:] = data
    return area, memoryview(area)


def test_a_staged_payload_is_invisible_until_committed(stores: Stores, redis_server: RedisServer) -> None:
    a, _ = stores
    held = a.acquire("s", 10_000)
    area, view = shared_bytes(b"first" * 10_000)
    a.stage("s", held, view)
    assert a.get("s") is None and not a.exists("s")
    assert a.commit("s", held, b"record-1", 0)
    assert a.get("s") == (b"record-1", b"first" * 10_000)
    raw = redis_server.client()
    assert raw.pttl(a.keys.snap("s")) == -1 and not raw.exists(a.keys.stage("s", held.generation))

    area[:5] = b"SECON"  # a newer payload is staged, then found stale and dropped: the first stays readable
    a.stage("s", held, view)
    a.unstage("s", held)
    assert a.get("s") == (b"record-1", b"first" * 10_000)
    view.release()
    area.close()


def test_a_commit_needs_the_lease_and_its_staged_payload(stores: Stores, redis_server: RedisServer) -> None:
    a, b = stores
    held = a.acquire("s", 10_000)
    a.stage("s", held, memoryview(b"x" * 100))
    assert a.commit("s", held, b"record-a", 5_000)
    raw = redis_server.client()
    assert 0 < raw.pttl(a.keys.snap("s")) <= 5_000 and 0 < raw.pttl(a.keys.rec("s")) <= 5_000

    a.stage("s", held, memoryview(b"y" * 100))
    raw.delete(a.keys.lease("s"))  # a's lease expires during a long pause; b takes the session
    b_held = b.acquire("s", 10_000)
    with pytest.raises(LeaseHeld):
        a.acquire("s", 10_000)
    b.stage("s", b_held, memoryview(b"z" * 100))
    assert not a.commit("s", held, b"record-a2", 0)  # fenced off: the write of a node that lost its lease
    assert b.get("s") == (b"record-a", b"x" * 100)  # its staged bytes never replaced b's, nor became visible
    assert b.commit("s", b_held, b"record-b", 0)
    assert b.get("s") == (b"record-b", b"z" * 100)

    b.stage("s", b_held, memoryview(b"w" * 100))
    raw.delete(b.keys.stage("s", b_held.generation))  # Redis restarted empty between stage and commit
    with pytest.raises(RemoteUnavailable, match="staged checkpoint"):
        b.commit("s", b_held, b"record-b2", 0)
    assert b.get("s") == (b"record-b", b"z" * 100)

    b.delete("s", b_held)
    assert b.get("s") is None and not raw.keys("test:f:l:*:s")
