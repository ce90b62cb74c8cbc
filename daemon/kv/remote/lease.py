"""One writer at a time: a lease in Redis names the node that owns a session.

A node takes a session's lease with SET NX PX; its value is "{generation} {node}", where the generation comes
from an INCR counter of that session (the fencing token). The owner renews it while it holds the session; a
dead owner stops renewing, the lease expires, and another node may take it. Every remote write is conditional
on the lease still holding the writer's exact value, generation included (WATCH on the lease, then MULTI/EXEC;
store.py), so a node that lost its lease (a
long partition, a pause) can never overwrite the newer owner's checkpoint: its write is fenced off and it
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

# KEYS[1] = lease, KEYS[2] = the checkpoint, KEYS[3] = the generation counter; ARGV[1] = the lease value.
# A closed session: its checkpoint and lease go, if the caller still owns it.
DELETE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[2], KEYS[3])
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
