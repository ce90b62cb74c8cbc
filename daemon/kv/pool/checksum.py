"""The snapshot checksum shared by the pool and the spill directory.

Snapshots are megabytes and sit on the hibernate/restore path, so the checksum must run near memory speed:
a CRC-32 (zlib, ~4 GB/s here) would take longer than llama.cpp's own copy of the state (~10-16 GB/s). This
is a 64-bit position-weighted sum over 32 KiB blocks, computed by numpy in one memory-bound pass (24-60 GB/s):
any flipped byte changes the plain sum, and blocks that move or swap change the weighted one. It detects damage
(stray writes, bit rot, truncation); it is not a defence against deliberate tampering, which the pool's file
mode handles.
"""

from __future__ import annotations

import numpy as np

WORDS_PER_BLOCK = 4096  # 32 KiB blocks
_MASK = (1 << 64) - 1
_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads the weighted sum over all bits


def checksum(data: bytes | bytearray | memoryview) -> int:
    # Splitting the pass over two threads was measured to gain nothing: it waits on memory, not on the CPU.
    raw = np.frombuffer(data, dtype=np.uint8)
    n_words = len(raw) // 8
    words = raw[: n_words * 8].view(np.uint64)
    n_blocks = n_words // WORDS_PER_BLOCK
    blocks = words[: n_blocks * WORDS_PER_BLOCK].reshape(n_blocks, WORDS_PER_BLOCK)
    sums = blocks.sum(axis=1, dtype=np.uint64)
    weights = np.arange(1, n_blocks + 1, dtype=np.uint64)
    plain, weighted = int(sums.sum(dtype=np.uint64)), int((sums * weights).sum(dtype=np.uint64))
    tail = int(words[n_blocks * WORDS_PER_BLOCK :].sum(dtype=np.uint64))
    plain += tail + sum((i + 1) * int(b) for i, b in enumerate(raw[n_words * 8 :]))
    weighted += (n_blocks + 1) * tail + len(raw)  # the length counts too: truncation is damage
    return (plain ^ ((weighted & _MASK) * _MIX)) & _MASK
