"""What the remote tier stores for a session, and under which keys.

A checkpoint is two Redis values: the record (a fixed header, then msgpack) and the payload (llama.cpp's
sequence state, then the tokens as int32, exactly as in the pool). Two values, so the payload goes from the
pool to the socket without a copy (store.py); they are made visible together by one script and read together in
one MULTI/EXEC, so a reader never sees a record of one checkpoint with the bytes of another, and the record's length
and checksum of the payload would catch it if it did. Every field that can be damaged is checked on read: a
checkpoint that fails any check costs only its session (SESSION_CORRUPT), never the daemon.

Keys are namespaced by the model's fingerprint and KV layout, so daemons of different models (or of the same
model with another KV format) never read each other's snapshots:
    {prefix}:{fingerprint}:{layout hash}:rec:{session}     the checkpoint's record (header + msgpack)
    {prefix}:{fingerprint}:{layout hash}:snap:{session}    its payload
    {prefix}:{fingerprint}:{layout hash}:stage:{session}:{generation}
                                                           a payload on its way, until its record commits it
    {prefix}:{fingerprint}:{layout hash}:lease:{session}   "{generation} {node}" while a node owns the session
    {prefix}:{fingerprint}:{layout hash}:gen:{session}     the fencing generation counter (INCR)
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass

import msgspec

from kvpool.daemon.kv.codec.kv_types import StoreType
from kvpool.daemon.kv.pool.checksum import checksum
from kvpool.daemon.kv.pool.layout import HOT_TYPES, payload_bytes

MAGIC = b"KVREMOT2"  # 2: the payload's checksum is XXH3
HEADER = struct.Struct("<8sI")  # magic, record length
MAX_RECORD_BYTES = 1 << 16


class RemoteRecord(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    session: str
    token_sha256: str  # the owner's capability token, hashed: a reader of Redis cannot resume the session
    task: str
    n_tokens: int
    n_kv: int
    state_bytes: int
    fingerprint: str  # the model that wrote it
    kv_layout: str  # and its KV format
    checksum: int  # of the payload (kvpool's snapshot checksum)
    # KV compression: the store type (StoreType.id) the state's K/V rows were stored at (HOT_TYPES: the hot
    # types of kv_layout), and the state's size at the hot types. A reader writes a compressed state back at its
    # hot types to load it.
    kv_type: int = HOT_TYPES
    raw_bytes: int = 0
    version: int  # the checkpoint's version on the node that wrote it
    generation: int  # the lease's fencing generation under which it was written
    last_used: float  # wall-clock time of the session's last turn
    written_at: float
    node: str  # who wrote it


class RecordCorrupt(Exception):
    """A remote value that cannot be this session's checkpoint; the message says what is wrong with it."""


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def token_matches(record: RemoteRecord, token: str) -> bool:
    return hmac.compare_digest(record.token_sha256, token_hash(token))


@dataclass(frozen=True)
class Keys:
    """The key names of one model's namespace."""

    namespace: str

    @classmethod
    def of(cls, prefix: str, fingerprint: str, kv_layout: str) -> Keys:
        layout = hashlib.sha256(kv_layout.encode()).hexdigest()[:12]
        return cls(f"{prefix}:{fingerprint}:{layout}")

    def rec(self, session: str) -> str:
        return f"{self.namespace}:rec:{session}"

    def snap(self, session: str) -> str:
        return f"{self.namespace}:snap:{session}"

    def stage(self, session: str, generation: int) -> str:
        # per generation: a node fenced off but not yet aware of it never overwrites the new owner's staged bytes
        return f"{self.namespace}:stage:{session}:{generation}"

    def lease(self, session: str) -> str:
        return f"{self.namespace}:lease:{session}"

    def gen(self, session: str) -> str:
        return f"{self.namespace}:gen:{session}"


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(RemoteRecord)


def encode(record: RemoteRecord) -> bytes:
    """The record's value (the payload is stored as it is, under its own key)."""
    head = _encoder.encode(record)
    return HEADER.pack(MAGIC, len(head)) + head


def decode(
    head: bytes, payload: bytes | memoryview, session: str, fingerprint: str, kv_layout: str
) -> tuple[RemoteRecord, memoryview]:
    """The record and payload of ``session``'s checkpoint, or RecordCorrupt saying why they cannot be used."""
    if len(head) < HEADER.size:
        raise RecordCorrupt("its remote record is truncated")
    magic, record_bytes = HEADER.unpack_from(head)
    if magic != MAGIC and magic.startswith(MAGIC[:-1]):
        raise RecordCorrupt(f"its remote checkpoint was written by another kvpool version (format {magic.decode()!r})")
    if magic != MAGIC:
        raise RecordCorrupt("its remote value is not a kvpool checkpoint")
    if record_bytes > MAX_RECORD_BYTES or HEADER.size + record_bytes > len(head):
        raise RecordCorrupt("its remote record is truncated")
    if HEADER.size + record_bytes < len(head):
        raise RecordCorrupt("its remote record has bytes past its end")
    try:
        record = _decoder.decode(head[HEADER.size : HEADER.size + record_bytes])
    except msgspec.DecodeError as exc:
        raise RecordCorrupt(f"its remote record cannot be read ({exc})") from None
    if record.fingerprint != fingerprint or record.kv_layout != kv_layout:
        raise RecordCorrupt(
            f"its remote checkpoint was written by another model (fingerprint {record.fingerprint}, "
            f"KV layout {record.kv_layout!r})"
        )
    if record.session != session:
        raise RecordCorrupt(f"its remote record names another session ({record.session!r})")
    if record.kv_type != HOT_TYPES and not StoreType.known(record.kv_type):
        raise RecordCorrupt(f"its remote checkpoint is stored at a KV type kvpool does not know ({record.kv_type})")
    payload = memoryview(payload)
    if len(payload) != payload_bytes(record.state_bytes, record.n_tokens) or record.n_kv > record.n_tokens:
        raise RecordCorrupt("its remote checkpoint is truncated (the bytes do not match the record)")
    if checksum(payload) != record.checksum:
        raise RecordCorrupt("its remote checkpoint fails its checksum")
    return record, payload
