"""The remote store: the few Redis commands the remote tier uses, through redis-py. Thread-safe (redis-py's
connection pool); every call is bounded by the socket timeout and raises RemoteUnavailable when Redis cannot be
reached or answers too slowly. redis-py reconnects by itself on the next call."""

from __future__ import annotations

from typing import Any

import redis
from redis.exceptions import RedisError, WatchError

from kvpool.daemon.kv.remote import lease as scripts
from kvpool.daemon.kv.remote.lease import Lease, LeaseHeld
from kvpool.daemon.kv.remote.record import Keys


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

    def write(self, session: str, held: Lease, blob: bytes, ttl_ms: int) -> bool:
        """Store the checkpoint if ``held`` is still the session's lease; False when fenced off.

        WATCH/MULTI rather than a script: Redis copies a script's arguments into Lua and back, which made a
        checkpoint's write 3-5x slower than a plain SET of its bytes (bench/roaming.py)."""
        return bool(self._call(self._write_watched, session, held, blob, ttl_ms))

    def _write_watched(self, session: str, held: Lease, blob: bytes, ttl_ms: int) -> bool:
        lease_key = self.keys.lease(session)
        with self.redis.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(lease_key)  # EXEC fails if the lease changes after this check
                if pipe.get(lease_key) != held.value.encode():
                    return False
                pipe.multi()
                pipe.set(self.keys.snap(session), blob, px=ttl_ms or None)
                if ttl_ms:
                    pipe.pexpire(self.keys.gen(session), ttl_ms)  # the counter lives as long as the checkpoint
                pipe.execute()
            except WatchError:
                return False
        return True

    def delete(self, session: str, held: Lease) -> None:
        keys = [self.keys.lease(session), self.keys.snap(session), self.keys.gen(session)]
        self._call(self._delete, keys=keys, args=[held.value])

    def exists(self, session: str) -> bool:
        return bool(self._call(self.redis.exists, self.keys.snap(session)))

    def get(self, session: str) -> bytes | None:
        return self._call(self.redis.get, self.keys.snap(session))

    def close(self) -> None:
        self.redis.close()
