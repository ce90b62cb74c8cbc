"""An in-process stand-in for the Model surface the KV tiers, the scheduler and the engine use, so their logic can be
tested without a daemon process or llama.cpp: a unified KV of ``context_size`` cells shared by sequence ids, with
llama.cpp's rules that matter to the tiers (a restore needs free cells, seq_cp shares cells, a saved state names
the positions it holds), and a decode that fills those cells (1, nothing changed, when they do not fit) or fails
as it is told to. It models bookkeeping, not numbers: the tests of what llama.cpp computes stay on real daemons
(tests/test_tiers.py, tests/test_prefix.py, tests/test_gemma.py)."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np

from kvpool.daemon.config import sequence_count
from kvpool.daemon.kv.codec.kv_types import F16
from kvpool.daemon.llama.deterministic_mode import NOT_DETERMINISTIC
from kvpool.daemon.llama.kv_settings import KvSettings
from kvpool.daemon.llama.model import Sampled, SamplingParams

MAGIC = 0x4B565046  # "KVPF": a state this fake wrote
BYTES_PER_CELL = 64  # what each saved cell costs, like a (small) model's K and V rows
SAMPLED = 42  # the token every fake sampler picks
N_VOCAB = 256


class FakeBatch:
    """One step's tokens, per sequence, as the runner adds them."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.rows: list[tuple[int, int, int]] = []  # (sequence, first position, token count)
        self.n = 0

    def clear(self) -> None:
        self.rows, self.n = [], 0

    def add(self, seq_id: int, tokens: list[int], first_pos: int, outputs: int) -> int:
        self.rows.append((seq_id, first_pos, len(tokens)))
        self.n += len(tokens)
        return self.n - 1


class FakeModel:
    fingerprint = "f" * 32
    kv_layout = "fake"
    kv = KvSettings(F16, F16, flash_attn=True, rotate_k=False, rotate_v=False)
    n_swa = 0
    mrope = False  # (one position per cell: tests/test_mrope.py runs the real M-RoPE model)
    n_vocab = N_VOCAB
    deterministic = False  # (the real model's deterministic KV is tested on the real model)
    determinism = NOT_DETERMINISTIC
    threads = 1  # (one thread: the engine's thread count has nothing to adapt)
    draft_rows = 16
    attention_tile_rows = 0  # (no attention kernel to tile: every step is one decode; tests/test_decode_groups.py)

    def __init__(self, *, context_size: int = 256, hot_slots: int = 2, prefix_slots: int = 0, batch_size: int = 64):
        self.context_size = context_size
        self.hot_slots = hot_slots
        self.prefix_seqs = list(range(hot_slots, hot_slots + prefix_slots))
        self.scratch_seq = hot_slots + prefix_slots if prefix_slots else -1
        self.n_seq = sequence_count(hot_slots, prefix_slots)
        self.batch = FakeBatch(batch_size)
        self.cells: list[tuple[int, set[int]] | None] = [None] * context_size  # (position, sequence ids) or free
        self.loads = 0
        self.decodes = 0
        # What the next decodes do instead of decoding: an rc to return (nothing changes), or an exception to raise.
        self.failures: list[int | BaseException] = []
        self.byte_tokens_read: list[int] = []  # the decodes done when the byte table was read, a read each

    # ------------------------------------------------------------------ decoding

    @property
    def step_tokens(self) -> int:
        return self.batch.capacity

    def decode_with(self, threads: int) -> None:
        """The real model's thread count for the next decodes: the fake computes the same whatever it is."""

    def fail_next_decodes(self, *outcomes: int | BaseException) -> None:
        """The next decodes return these codes (1: no room in the KV; -1 or 2: llama.cpp failed) or raise these."""
        self.failures.extend(outcomes)

    def decode(self, parts: Sequence[int] = ()) -> int:
        """The filled batch into the KV: 0; 1 (nothing changed) when its tokens do not fit the free cells."""
        assert len(parts) <= 1, "a step in parts needs a tile, which the fake has not"
        self.decodes += 1
        if self.failures:
            outcome = self.failures.pop(0)
            if isinstance(outcome, BaseException):
                raise outcome
            return outcome
        if self.context_size - self.used_cells() < self.batch.n:
            return 1
        for seq, first, count in self.batch.rows:
            assert self.fill(seq, first, count)
        return 0

    def new_sampler(self, params: SamplingParams, history: list[int], replay: list[int] | None = None) -> FakeSampler:
        return FakeSampler()

    def valid_token(self, token: int) -> bool:
        return 0 <= token < self.n_vocab

    def is_end_of_generation(self, token: int) -> bool:
        return False

    def token_bytes(self, token: int) -> bytes:
        return b"x"

    @property
    def byte_tokens(self) -> None:
        """No byte table (a grammar's forced text is then never asked for); the decodes before each read are kept,
        so a test can tell when the engine read it."""
        self.byte_tokens_read.append(self.decodes)
        return None

    # ------------------------------------------------------------------ the unified KV

    def positions(self, seq: int) -> list[int]:
        return sorted(pos for cell in self.cells if cell is not None and seq in cell[1] for pos in [cell[0]])

    def used_cells(self) -> int:
        return sum(cell is not None for cell in self.cells)

    def fill(self, seq: int, first: int, count: int) -> bool:
        """What a decode of ``count`` tokens at ``first`` leaves in the KV; False (nothing changed) without room."""
        free = [i for i, cell in enumerate(self.cells) if cell is None]
        if len(free) < count:
            return False
        for i, pos in zip(free, range(first, first + count), strict=False):
            self.cells[i] = (pos, {seq})
        return True

    def forget_sequence(self, seq: int) -> None:
        for i, cell in enumerate(self.cells):
            if cell is not None and seq in cell[1]:
                cell[1].discard(seq)
                if not cell[1]:
                    self.cells[i] = None

    def forget_from(self, seq: int, first: int) -> None:
        for i, cell in enumerate(self.cells):
            if cell is not None and seq in cell[1] and cell[0] >= first:
                cell[1].discard(seq)
                if not cell[1]:
                    self.cells[i] = None

    def share_cells(self, src: int, dst: int, first: int, end: int) -> None:
        for cell in self.cells:
            if cell is not None and src in cell[1] and cell[0] >= first and (end < 0 or cell[0] < end):
                cell[1].add(dst)

    def lowest_position(self, seq: int) -> int:
        held = self.positions(seq)
        return held[0] if held else -1

    def highest_position(self, seq: int) -> int:
        held = self.positions(seq)
        return held[-1] if held else -1

    # ------------------------------------------------------------------ sequence state

    def state_size(self, seq: int) -> int:
        return 8 + (4 + BYTES_PER_CELL) * len(self.positions(seq))

    def save_state(self, seq: int, dest: ctypes.Array[ctypes.c_uint8]) -> int:
        held = np.array(self.positions(seq), dtype="<i4")
        size = self.state_size(seq)
        if len(dest) < size:
            return 0
        out = np.frombuffer(dest, dtype=np.uint8, count=size)
        out[:8] = np.frombuffer(np.array([MAGIC, len(held)], dtype="<u4").tobytes(), dtype=np.uint8)
        out[8 : 8 + 4 * len(held)] = np.frombuffer(held.tobytes(), dtype=np.uint8)
        out[8 + 4 * len(held) :] = (np.repeat(held, BYTES_PER_CELL) % 251).astype(np.uint8)  # the "K and V rows"
        return size

    def load_state(self, seq: int, src: ctypes.Array[ctypes.c_uint8], first: int = 0, cells: int | None = None) -> bool:
        data = np.frombuffer(src, dtype=np.uint8)
        magic, count = np.frombuffer(data[:8].tobytes(), dtype="<u4")
        if magic != MAGIC or len(data) != 8 + (4 + BYTES_PER_CELL) * int(count):
            return False
        held = np.frombuffer(data[8 : 8 + 4 * int(count)].tobytes(), dtype="<i4")
        rows = data[8 + 4 * int(count) :]
        if not np.array_equal(rows, (np.repeat(held, BYTES_PER_CELL) % 251).astype(np.uint8)):
            return False  # llama.cpp would load garbage; the fake refuses it so a test can tell
        self.forget_sequence(seq)
        free = [i for i, cell in enumerate(self.cells) if cell is None]
        if len(free) < len(held):
            return False
        for i, pos in zip(free, held.tolist(), strict=False):
            self.cells[i] = (pos, {seq})
        self.loads += 1
        return True

    @contextmanager
    def cells_from(self, seq: int, first: int) -> Iterator[int]:
        if not first:
            yield seq
            return
        self.share_cells(seq, self.scratch_seq, first, -1)
        try:
            yield self.scratch_seq
        finally:
            self.forget_sequence(self.scratch_seq)


class FakeSampler:
    def sample(self, row: int) -> Sampled:
        return Sampled(SAMPLED)

    constrained = False

    def admitted(self, guess: list[int]) -> int:
        return len(guess)

    def free(self) -> None:
        pass
