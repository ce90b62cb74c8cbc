"""The pool segment's format: the header, the session table's entries and their two snapshot records,
and the Python values a committed record decodes to. A daemon refuses a segment of another LAYOUT_VERSION."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvpool.daemon.kv.pool.allocator import Extent

MAGIC = b"KVPOOL\x00\x01"
# 2: prefix entries and records naming them; 3: records name their stored KV type; 4: XXH3; 5: a record's kv_type
# may name two codings and rotated rows (codec/kv_types.py StoreType), which a daemon of layout 4 cannot name; 6: it
# may say that K layers have codings of their own (a precision profile's), which a daemon of layout 5 cannot name
LAYOUT_VERSION = 6
HEADER_BYTES = 4096
ALIGN = 64

# Entry states. EVICTED keeps the id so its owner learns SESSION_EVICTED. UNSAVED is a live session whose saved
# state was given up for room (its KV is still hot): if the daemon dies before its next checkpoint, it comes back
# evicted, never as an older or empty context.
FREE, LIVE, EVICTED, UNSAVED = 0, 1, 2, 3
SESSION, PREFIX = 0, 1  # entry kinds: a session, or a prefix shared by sessions (its snapshot is whole)
NO_PREFIX = -1
TOKEN_BYTES = 4  # a snapshot's payload is llama.cpp's sequence state, then its tokens as little-endian int32
TIER_POOL, TIER_DISK = 1, 2
HOT_TYPES = -1  # a record's kv_type when its state is at the hot KV's types (else its StoreType.id)

HEADER = np.dtype(
    {
        "names": [
            "magic",
            "layout",
            "entries",
            "pool_size",
            "table_offset",
            "area_offset",
            "area_size",
            "generation",
            "fingerprint",
            "kv_layout",
        ],
        "formats": ["S8", "<u4", "<u4", "<u8", "<u8", "<u8", "<u8", "<u8", "S32", "S64"],
        "offsets": [0, 8, 12, 16, 24, 32, 40, 48, 64, 96],
        "itemsize": 256,
    }
)
RECORD = np.dtype(
    {
        # prefix_entry/prefix_len: the snapshot holds only the cells past the first prefix_len positions; the
        # rest are the prefix snapshot in table entry prefix_entry (NO_PREFIX: the snapshot is whole).
        # kv_type: the store type its K/V rows were compressed to (HOT_TYPES: none); raw_bytes: its state's size
        # at the hot types (state_bytes when not compressed).
        "names": [
            "version",
            "tier",
            "offset",
            "length",
            "state_bytes",
            "n_tokens",
            "n_kv",
            "checksum",
            "prefix_len",
            "prefix_entry",
            "kv_type",
            "raw_bytes",
        ],
        "formats": ["<u8", "<u4", "<u8", "<u8", "<u8", "<u4", "<u4", "<u8", "<u4", "<i4", "<i4", "<u8"],
        "offsets": [0, 8, 16, 24, 32, 40, 44, 48, 56, 60, 64, 72],
        "itemsize": 80,
    }
)
ENTRY = np.dtype(
    {
        "names": ["state", "kind", "session", "token", "task", "created", "last_used", "records"],
        "formats": ["<u4", "<u4", "S16", "S32", "S64", "<f8", "<f8", (RECORD, (2,))],
        "offsets": [0, 4, 8, 24, 56, 120, 128, 192],
        "itemsize": 352,
    }
)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A committed snapshot record: where the bytes are and what they hold."""

    version: int
    tier: int
    offset: int
    length: int
    state_bytes: int
    n_tokens: int
    n_kv: int
    checksum: int
    prefix_len: int = 0
    prefix_entry: int = NO_PREFIX
    kv_type: int = HOT_TYPES
    raw_bytes: int = 0

    @property
    def compressed(self) -> bool:
        return self.kv_type != HOT_TYPES

    @property
    def hot_bytes(self) -> int:
        """Its state's size at the hot KV types (what it would take uncompressed)."""
        return self.raw_bytes or self.state_bytes

    @property
    def extent(self) -> Extent:
        return Extent(self.offset, self.length)


@dataclass(frozen=True, slots=True)
class EntryInfo:
    index: int
    state: int
    kind: int
    session: str
    token: str
    task: str
    created: float
    last_used: float
    snapshot: Snapshot | None


def payload_bytes(state_bytes: int, n_tokens: int) -> int:
    """Bytes of a snapshot's payload: the sequence state, then the tokens."""
    return state_bytes + TOKEN_BYTES * n_tokens


def with_tokens(state: bytes | bytearray | memoryview, tokens: list[int]) -> bytes:
    """A snapshot's payload: its state, then its tokens as int32 (as the pool and spill files hold it)."""
    return b"".join((state, np.asarray(tokens, dtype="<i4").tobytes()))
