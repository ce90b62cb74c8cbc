"""The unified KV's sequences: emptying and sharing them, where their positions are, and their state saved to a
buffer (a pool extent) and loaded back. Deterministic decoding keeps cells in position order: a sequence's cells
go to a graveyard sequence instead of being freed, and the count of appended cells says when to compact."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager

import llama_cpp as lc


class Sequences:
    def __init__(self, ctx: ctypes.c_void_p, cell_room: int, scratch_seq: int, graveyard: int):
        """``cell_room``: cells the smallest of the model's caches holds; ``scratch_seq``: the sequence a suffix is
        cut out through (-1: none); ``graveyard``: where freed cells go in deterministic decoding (-1: freed)."""
        self.ctx = ctx
        self.memory = lc.llama_get_memory(ctx)
        self.cell_room, self.scratch_seq, self.graveyard = cell_room, scratch_seq, graveyard
        # Cells appended since the KV was last laid out (deterministic decoding): the cells before this count are
        # taken (live or in the graveyard), those after it free.
        self.appended = 0

    def cells_free(self) -> int:
        """Deterministic decoding: cells left after the last appended one (a compaction makes more)."""
        return self.cell_room - self.appended

    def clear(self) -> None:
        """Empty the whole KV (every sequence, the graveyard too): the first step of a compaction."""
        lc.llama_memory_clear(self.memory, False)
        self.appended = 0

    def forget_sequence(self, seq_id: int) -> None:
        """Empty a sequence (the slot becomes empty). Its cells are freed, or, in deterministic decoding, handed
        to the graveyard: a freed cell would take the next token of any sequence out of position order."""
        if self.graveyard >= 0 and seq_id != self.graveyard:
            lc.llama_memory_seq_cp(self.memory, seq_id, self.graveyard, -1, -1)
        lc.llama_memory_seq_rm(self.memory, seq_id, -1, -1)

    def forget_from(self, seq_id: int, first: int) -> None:
        """Empty a sequence's cells at positions >= ``first`` (a guess's rows that were not taken); freed, or
        handed to the graveyard as forget_sequence does."""
        if self.graveyard >= 0:
            lc.llama_memory_seq_cp(self.memory, seq_id, self.graveyard, first, -1)
        lc.llama_memory_seq_rm(self.memory, seq_id, first, -1)

    def free(self, seq_id: int) -> None:
        """Free a sequence's cells whatever the mode: deterministic decoding's pad row (see Model.decode), and the
        scratch sequence, whose cells its source keeps."""
        lc.llama_memory_seq_rm(self.memory, seq_id, -1, -1)

    def share_cells(self, src: int, dst: int, first: int, end: int) -> None:
        """Give ``dst`` the cells of ``src`` for positions [first, end) (end -1: all): the cells are shared in the
        unified KV (one more sequence id on each), not copied."""
        lc.llama_memory_seq_cp(self.memory, src, dst, first, end)

    def lowest_position(self, seq_id: int) -> int:
        """The lowest position whose cells the sequence holds (-1 when empty). Above 0 after a sliding-window
        model has moved past its window, or after a restore: positions below it cannot be shared."""
        return lc.llama_memory_seq_pos_min(self.memory, seq_id)

    def highest_position(self, seq_id: int) -> int:
        """The highest position the sequence holds cells for (-1 when empty)."""
        return lc.llama_memory_seq_pos_max(self.memory, seq_id)

    def state_size(self, seq_id: int) -> int:
        """Bytes llama_state_seq_get_data needs for the sequence's KV cells."""
        return lc.llama_state_seq_get_size(self.ctx, seq_id)

    def save_state(self, seq_id: int, dest: ctypes.Array[ctypes.c_uint8]) -> int:
        """Copy the sequence's KV state into ``dest`` (e.g. a view of the shared-memory pool); bytes written."""
        return lc.llama_state_seq_get_data(self.ctx, dest, len(dest), seq_id)

    @contextmanager
    def cells_from(self, seq_id: int, first: int) -> Iterator[int]:
        """A sequence holding just ``seq_id``'s cells at positions >= ``first`` (a suffix past a shared prefix),
        to size and save: the scratch sequence, sharing those cells while the block runs (``first`` 0: the
        sequence itself)."""
        if not first:
            yield seq_id
            return
        self.share_cells(seq_id, self.scratch_seq, first, -1)
        try:
            yield self.scratch_seq
        finally:
            self.free(self.scratch_seq)  # its cells stay with seq_id: nothing for the graveyard

    def load_state(
        self, seq_id: int, src: ctypes.Array[ctypes.c_uint8], first: int = 0, cells: int | None = None
    ) -> bool:
        """Restore a saved state into an empty sequence; False when llama.cpp rejects it (no room, mismatch).
        ``first``: the state's first position (a suffix past a shared prefix starts there): the full-attention
        cache gets a cell for every position from it on (llama.cpp reports positions of the sliding-window cache,
        which may start later); ``cells``: how many it holds when that is not one per position (an M-RoPE
        model's image, kv/positions.py)."""
        self.forget_sequence(seq_id)
        if lc.llama_state_seq_set_data(self.ctx, src, len(src), seq_id) == 0:
            self.forget_sequence(seq_id)
            return False
        if cells is None:
            high = self.highest_position(seq_id)
            cells = high - first + 1 if high >= first else 0
        self.appended += cells
        return True

    def copy_state(self, seq_id: int, first: int = 0) -> ctypes.Array[ctypes.c_uint8]:
        """The sequence's state from position ``first`` on, in a buffer of its own (a compaction's copy)."""
        with self.cells_from(seq_id, first) as seq:
            buf = (ctypes.c_uint8 * self.state_size(seq))()
            written = self.save_state(seq, buf)
        return (ctypes.c_uint8 * written).from_buffer(buf) if written != len(buf) else buf

    # ------------------------------------------------------------------ identity
