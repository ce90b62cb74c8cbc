"""The remote store: the few Redis commands the remote tier uses, through redis-py. Thread-safe (redis-py's
connection pool); every call is bounded by the socket timeout and raises RemoteUnavailable when Redis cannot be
reached or answers too slowly. redis-py reconnects by itself on the next call."""

from __future__ import annotations

from typing import Any

import redis
from redis.exceptions import RedisError

from kvpool.daemon.remote import lease as scripts
from kvpool.daemon.remote.lease import Lease, LeaseHeld
from kvpool.daemon.remote.record import Keys

STAGE_MS = 60_000  # a staged payload whose commit never came (the node died in between) expires by itself


class RemoteUnavailable(Exception):
    """Redis could not be reached, or did not answer within remote_timeout_ms."""


def redacted(url: str) -> str:
    """The URL without its password, for logs and status."""
    scheme, sep, rest = url.partition("://")
    if "@" in rest:
        rest = "***@" + rest.split("@", 1)[1]
    return f"{scheme}{sep}{rest}"


class RemoteStore:
    def __init__(self, url: str, keys: Keys, node: str, timeout_s: float):
        self.keys, self.node, self.url = keys, node, redacted(url)
        self.redis = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            health_check_interval=30,
            max_connections=8,
        )
        self._renew = self.redis.register_script(scripts.RENEW)
        self._release = self.redis.register_script(scripts.RELEASE)
        self._delete = self.redis.register_script(scripts.DELETE)
        self._commit = self.redis.register_script(scripts.COMMIT)

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except RedisError as exc:
            raise RemoteUnavailable(f"{self.url}: {exc}") from None

    def ping(self) -> None:
        self._call(self.redis.ping)

    def acquire(self, session: str, px: int) -> Lease:
        """Take the session's lease (a new fencing generation), or keep this node's own; LeaseHeld if another
        node owns it."""
        keys = self.keys
        for _ in range(3):  # the owner's lease may vanish between SET NX and GET: try again
            current = self._call(self.redis.get, keys.lease(session))
            if current is not None:
                owner = Lease.parse(current)
                if owner.node != self.node:
                    raise LeaseHeld(session, owner)
                if self._call(self._renew, keys=[keys.lease(session)], args=[owner.value, px]):
                    return owner
                continue
            generation = int(self._call(self.redis.incr, keys.gen(session)))
            mine = Lease(generation, self.node)
            if self._call(self.redis.set, keys.lease(session), mine.value, nx=True, px=px):
                return mine
        current = self._call(self.redis.get, keys.lease(session))
        raise LeaseHeld(session, Lease.parse(current or b"0 (unknown)"))

    def renew(self, leases: dict[str, Lease], px: int) -> list[str]:
        """Renew every lease in one round trip; the sessions whose lease is no longer this node's."""
        if not leases:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for session, held in leases.items():
            self._renew(keys=[self.keys.lease(session)], args=[held.value, px], client=pipe)
        results = self._call(pipe.execute)
        return [session for session, ok in zip(leases, results, strict=True) if not ok]

    def owner(self, session: str) -> Lease | None:
        current = self._call(self.redis.get, self.keys.lease(session))
        return Lease.parse(current) if current is not None else None

    def release(self, session: str, held: Lease) -> None:
        self._call(self._release, keys=[self.keys.lease(session)], args=[held.value])

    def stage(self, session: str, held: Lease, payload: memoryview) -> None:
        """Send a checkpoint's payload ahead of its record, under a key of its own: the current checkpoint stays
        readable until commit(). redis-py sends a memoryview as it is, so the bytes go from the pool to the
        socket without a copy (a copy into a new buffer cost more than the checksum and the round trips
        together: page faults on every fresh 4 KiB, bench/roaming.py)."""
        self._call(self.redis.set, self.keys.stage(session, held.generation), payload, px=STAGE_MS)

    def unstage(self, session: str, held: Lease) -> None:
        self._call(self.redis.delete, self.keys.stage(session, held.generation))

    def commit(self, session: str, held: Lease, record: bytes, ttl_ms: int) -> bool:
        """Make the staged payload and its record the session's checkpoint, atomically, if ``held`` is still the
        session's lease; False when fenced off."""
        keys = self.keys
        names = [
            keys.lease(session),
            keys.stage(session, held.generation),
            keys.snap(session),
            keys.rec(session),
            keys.gen(session),
        ]
        done = int(self._call(self._commit, keys=names, args=[held.value, record, ttl_ms]))
        if done < 0:
            raise RemoteUnavailable(f"{self.url}: the staged checkpoint of session {session} is gone (restarted?)")
        return done == 1

    def delete(self, session: str, held: Lease) -> None:
        keys = [self.keys.lease(session), self.keys.rec(session), self.keys.snap(session), self.keys.gen(session)]
        self._call(self._delete, keys=keys, args=[held.value])

    def exists(self, session: str) -> bool:
        return bool(self._call(self.redis.exists, self.keys.rec(session)))

    def get(self, session: str) -> tuple[bytes, bytes] | None:
        """The session's record and payload, read in one transaction (so from the same commit); None if none."""
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.get(self.keys.rec(session))
            pipe.get(self.keys.snap(session))
            record, payload = self._call(pipe.execute)
        if record is None:
            return None
        return record, payload or b""

    def close(self) -> None:
        self.redis.close()
