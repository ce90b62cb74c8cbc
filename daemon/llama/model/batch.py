"""The batch one decode takes: a reusable llama_batch."""

from __future__ import annotations

import ctypes

import llama_cpp as lc
import numpy as np


class Batch:
    """A reusable llama_batch with numpy views on its arrays, so filling it costs no per-token ctypes calls."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._batch = lc.llama_batch_init(capacity, 0, 1)
        b = self._batch
        self.token = np.ctypeslib.as_array(b.token, shape=(capacity,))
        self.pos = np.ctypeslib.as_array(b.pos, shape=(capacity,))
        self.logits = np.ctypeslib.as_array(b.logits, shape=(capacity,))
        n_seq_id = np.ctypeslib.as_array(b.n_seq_id, shape=(capacity,))
        n_seq_id[:] = 1
        # seq_id is an array of per-token pointers, each to one int32 (n_seq_max = 1 per token).
        self._seq_rows = [b.seq_id[i] for i in range(capacity)]
        self.n = 0

    def clear(self) -> None:
        self.n = 0

    def add(self, seq_id: int, tokens: list[int], first_pos: int, outputs: int) -> int:
        """Append ``tokens`` of one sequence, the last ``outputs`` of them with logits (a bool: the last one or
        none); returns the batch row of the last token (for sampling)."""
        start, count = self.n, len(tokens)
        end = start + count
        self.token[start:end] = tokens
        self.pos[start:end] = np.arange(first_pos, first_pos + count, dtype=np.int32)
        self.logits[start:end] = 0
        if outputs:
            self.logits[end - int(outputs) : end] = 1
        rows = self._seq_rows
        for i in range(start, end):
            rows[i][0] = seq_id
        self.n = end
        return end - 1

    def outputs(self) -> int:
        """Rows whose logits the decode returns."""
        return int(self.logits[: self.n].sum())

    def as_llama_batch(self) -> lc.llama_batch:
        self._batch.n_tokens = self.n
        return self._batch

    def rows(self, start: int, end: int) -> lc.llama_batch:
        """Rows [start, end) as a llama_batch of their own: views into this one's arrays (keep this batch alive
        and unchanged while it is decoded)."""
        b, part = self._batch, lc.llama_batch()
        part.n_tokens = end - start
        part.token = _offset(b.token, start)
        part.pos = _offset(b.pos, start)
        part.n_seq_id = _offset(b.n_seq_id, start)
        part.seq_id = _offset(b.seq_id, start)
        part.logits = _offset(b.logits, start)
        return part

    def sequences(self, start: int, end: int) -> dict[int, int]:
        """Each sequence fed in rows [start, end), with the lowest position it is fed at."""
        lowest: dict[int, int] = {}
        for i in range(start, end):
            seq, pos = int(self._seq_rows[i][0]), int(self.pos[i])
            lowest[seq] = min(pos, lowest.get(seq, pos))
        return lowest

    def free(self) -> None:
        lc.llama_batch_free(self._batch)


def _offset(pointer: ctypes._Pointer, items: int) -> ctypes._Pointer:  # type: ignore[type-arg]
    """``pointer`` moved on by ``items`` of what it points to."""
    return ctypes.cast(ctypes.addressof(pointer.contents) + items * ctypes.sizeof(pointer._type_), type(pointer))
