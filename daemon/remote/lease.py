"""One writer at a time: a lease in Redis names the node that owns a session.

A node takes a session's lease with SET NX PX; its value is "{generation} {node}", where the generation comes from
an INCR counter of that session (the fencing token). The owner renews it while it holds the session; a dead owner
stops renewing, the lease expires, and another node may take it. Every remote write is conditional on the lease
still holding the writer's exact value, generation included (the COMMIT script below), so a node that lost its
lease (a long partition, a pause) can never overwrite the newer owner's checkpoint: its write is fenced off and it
learns that the session went elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

# KEYS[1] = lease; ARGV[1] = the value the caller holds, ARGV[2] = milliseconds. 1: renewed; 0: not ours.
RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

# KEYS[1] = lease; ARGV[1] = the value the caller holds. Deletes the lease only if it is still the caller's.
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

# KEYS[1] = lease, KEYS[2] = staged payload, KEYS[3] = payload, KEYS[4] = record, KEYS[5] = generation counter;
# ARGV[1] = the lease value, ARGV[2] = the record, ARGV[3] = TTL in milliseconds (0: none).
# Commits a staged payload with its record if the caller still owns the session. 1: done; 0: fenced off;
# -1: the staged payload is gone (Redis restarted empty). Only the record passes through Lua: the payload is
# renamed, never copied (a script that took the payload as an argument was 3-5x slower than a plain SET).
COMMIT = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
if redis.call('EXISTS', KEYS[2]) == 0 then
  return -1
end
redis.call('RENAME', KEYS[2], KEYS[3])
local ttl = tonumber(ARGV[3])
if ttl > 0 then
  redis.call('SET', KEYS[4], ARGV[2], 'PX', ttl)
  redis.call('PEXPIRE', KEYS[3], ttl)
  redis.call('PEXPIRE', KEYS[5], ttl)
else
  redis.call('SET', KEYS[4], ARGV[2])
  redis.call('PERSIST', KEYS[3])
end
return 1
"""

# KEYS[1] = lease, KEYS[2..] = the session's other keys; ARGV[1] = the lease value.
# A closed session: its checkpoint and lease go, if the caller still owns it.
DELETE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', unpack(KEYS, 2))
  return redis.call('DEL', KEYS[1])
end
return 0
"""


@dataclass(frozen=True, slots=True)
class Lease:
    generation: int
    node: str

    @property
    def value(self) -> str:
        return f"{self.generation} {self.node}"

    @classmethod
    def parse(cls, value: bytes | str) -> Lease:
        text = value.decode(errors="replace") if isinstance(value, bytes) else value
        generation, _, node = text.partition(" ")
        return cls(int(generation) if generation.isdigit() else 0, node)


class LeaseHeld(Exception):
    """Another node owns the session."""

    def __init__(self, session: str, owner: Lease):
        super().__init__(
            f"Session {session} is owned by node {owner.node} (lease generation {owner.generation}); continue it "
            "there, migrate it from there (`kvpool migrate`), or retry once that node is gone and its lease expired."
        )
        self.owner = owner
