"""The rotation a stored layer's rows may take before they are quantized: a fixed random sign per column, then a
Walsh-Hadamard transform over blocks of each row (QuaRot's randomized Hadamard). It is orthogonal, so it keeps a
row's length and its dot products (what attention reads) and is undone exactly, up to rounding; what it changes is
how a row's values spread: an outlier column shares its size with the whole block, so a 32-value quantization block
no longer spends its scale on one value. The transform is the codec's own (the state records only that a layer was
rotated, codec/state_format.py), so it must stay the same for every snapshot kvpool can still read: the signs come
from a fixed seed and the block from the row width alone.
"""

from __future__ import annotations

from functools import cache

import numpy as np

MAX_BLOCK = 256  # (a head of most models; larger blocks cost more and spread little more)
_SEED = 0x6B76706F  # "kvpo": never change it, stored snapshots were rotated with it


def block_size(n_cols: int) -> int:
    """The largest power of two dividing ``n_cols``, at most MAX_BLOCK."""
    return min(n_cols & -n_cols, MAX_BLOCK)


@cache
def _signs(n_cols: int) -> np.ndarray:
    bits = np.random.RandomState(_SEED).randint(0, 2, size=n_cols)  # (RandomState's stream is frozen by numpy)
    return np.where(bits == 1, np.float32(1), np.float32(-1))


@cache
def _sylvester(size: int) -> np.ndarray:
    """The orthonormal Walsh-Hadamard matrix of ``size`` (a power of two), in Sylvester's order."""
    h = np.ones((1, 1), dtype=np.float32)
    while len(h) < size:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(size)).astype(np.float32)


def _hadamard(values: np.ndarray, block: int) -> np.ndarray:
    """The orthonormal Walsh-Hadamard transform of every ``block`` values of each row (its own inverse). H of 2^k is
    H of 2^(k/2) twice over (a Kronecker product), so each block is two small matrix products: a tenth of the
    time of the butterflies or of one product by the whole matrix."""
    n_rows, n_cols = values.shape
    k = block.bit_length() - 1
    first, second = 1 << (k // 2), 1 << (k - k // 2)
    blocks = np.ascontiguousarray(values, dtype=np.float32).reshape(-1, first, second)
    return (_sylvester(first) @ blocks @ _sylvester(second)).reshape(n_rows, n_cols)


def rotate(values: np.ndarray) -> np.ndarray:
    """float32 [n, n_cols] -> the same rows rotated."""
    n_cols = values.shape[1]
    return _hadamard(values * _signs(n_cols), block_size(n_cols))


def unrotate(values: np.ndarray) -> np.ndarray:
    """The inverse of ``rotate``."""
    n_cols = values.shape[1]
    return _hadamard(values, block_size(n_cols)) * _signs(n_cols)
