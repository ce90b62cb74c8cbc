"""The snapshot checksum shared by the pool, the spill directory and the remote tier: XXH3 (64-bit), by the
`xxhash` package (the reference C implementation).

Snapshots are megabytes and sit on the hibernate/restore path, so the checksum must run near memory speed: a
CRC-32 (zlib, ~4 GB/s here) or BLAKE2 (~0.4 GB/s) would take longer than llama.cpp's own copy of the state
(~10-16 GB/s); XXH3 runs at ~17 GB/s here, as fast as the position-weighted block sum it replaced, and unlike
that sum it sees bytes that trade places anywhere (two 8-byte words swapped inside one 32 KiB block passed the
sum). It detects damage (stray writes, bit rot, truncation, reordering); it is not a defence against deliberate
tampering, which the pool's file mode handles.
"""

from __future__ import annotations

import xxhash


def checksum(data: bytes | bytearray | memoryview) -> int:
    """The 64-bit XXH3 of ``data`` (the length counts too: truncation is damage)."""
    return xxhash.xxh3_64_intdigest(data)
