"""A reader and writer for llama.cpp's per-sequence state (``llama_state_seq_get_data``), as written by the
llama.cpp that llama-cpp-python 0.3.36 vendors (src/llama-context.cpp, src/llama-kv-cache.cpp):

    u32 magic 0xAF143CD8, i32 seq_id
    then one block per KV cache (two for sliding-window models: the full-attention cache, then the SWA one):
      u32 n_stream; per stream: u32 cell_count, and when it is not 0:
        cell_count x (i32 pos, u32 n_seq_id = 1, [i32 x, i32 y, i32 token: M-RoPE models], i32 seq_id)
        u32 v_trans, u32 n_layer
        n_layer x K: i32 ggml type, u64 row bytes, cell_count rows
        n_layer x V: i32 ggml type, u64 row bytes, cell_count rows            (v_trans = 0: flash attention)
                     i32 ggml type, u32 element bytes, u32 n_embd_v, n_embd_v x cell_count elements (v_trans = 1)

The state records each layer's type and row size, so a layer's rows can be rewritten at another type and the
result is still this format: llama.cpp rejects it (its types differ from the context's) until it is written
back at the context's types. Anything this reader does not recognise is refused with StateFormatError, never
guessed: cell records of another shape than the model's, unknown types, sizes that do not add up. A change of
llama.cpp's format fails tests/test_kv_codec.py, which round-trips real states byte for byte.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np

from kvpool.daemon.kv.codec.kv_types import BY_ID, ROTATED_FLAG, KvType, RowCoding

FORMAT_VERSION = 1  # the layout above; bump when a new llama.cpp needs another reader
MAGIC = 0xAF143CD8
_U32, _I32, _U64 = struct.Struct("<I"), struct.Struct("<i"), struct.Struct("<Q")
_MAX_STREAMS, _MAX_LAYERS = 256, 4096
StateBytes = bytes | bytearray | memoryview


class StateFormatError(Exception):
    """Bytes that are not a sequence state this reader knows."""


@dataclass(frozen=True, slots=True)
class Rows:
    """One layer's K (or non-transposed V) data: ``n_rows`` cells of ``row_bytes`` each, at ``offset``."""

    kind: str  # "k" or "v"
    kv_type: KvType
    n_rows: int
    row_bytes: int
    offset: int  # where the type field starts; the rows follow its 12-byte header
    rotated: bool = False  # stored by kvpool after its rotation (codec/rotation.py): llama.cpp cannot load it so
    positions: np.ndarray | None = field(default=None, compare=False)  # each row's cell position, in row order

    @property
    def coding(self) -> RowCoding:
        return RowCoding(self.kv_type, self.rotated)

    @property
    def n_cols(self) -> int:
        return self.row_bytes // self.kv_type.block_bytes * self.kv_type.block

    @property
    def data_offset(self) -> int:
        return self.offset + 12

    @property
    def end(self) -> int:
        return self.data_offset + self.n_rows * self.row_bytes


@dataclass(frozen=True, slots=True)
class SequenceState:
    """A parsed state: its layers' row blocks, in order; every other byte is carried over as it is."""

    data: memoryview
    seq_id: int
    layers: tuple[Rows, ...]
    transposed_v: bool  # flash attention off: V is stored column-wise and is never rewritten
    cells: int  # cells over all caches

    def types(self, kind: str) -> set[str]:
        """The codings its layers of ``kind`` are stored at, by name ("q4_0h": rotated)."""
        return {r.coding.name for r in self.layers if r.kind == kind}


class _Reader:
    def __init__(self, data: memoryview):
        self.data, self.pos = data, 0

    def take(self, s: struct.Struct) -> int:
        if self.pos + s.size > len(self.data):
            raise StateFormatError(f"the state ends early, at byte {self.pos} of {len(self.data)}")
        (value,) = s.unpack_from(self.data, self.pos)
        self.pos += s.size
        return value

    def skip(self, n: int) -> int:
        start = self.pos
        if n < 0 or start + n > len(self.data):
            raise StateFormatError(f"a block of {n} bytes at byte {start} runs past the end ({len(self.data)})")
        self.pos += n
        return start


def parse(state: StateBytes, cell_ext: bool = False) -> SequenceState:
    """``cell_ext``: the model's cells carry extra position data (llama_kv_cell_ext: an M-RoPE model's x, y and
    token), 12 bytes between a cell's sequence count and its sequence id."""
    record = 6 if cell_ext else 3  # i32 fields per cell
    data = memoryview(state).cast("B")
    r = _Reader(data)
    if r.take(_U32) != MAGIC:
        raise StateFormatError("it does not start with llama.cpp's sequence-state magic")
    seq_id = r.take(_I32)
    layers: list[Rows] = []
    transposed = False
    cells = 0
    if r.pos == len(data):
        raise StateFormatError("it holds no KV cache block")
    while r.pos < len(data):
        n_stream = r.take(_U32)
        if not 1 <= n_stream <= _MAX_STREAMS:
            raise StateFormatError(f"a cache block claims {n_stream} streams")
        for _ in range(n_stream):
            n_cells = r.take(_U32)
            if n_cells == 0:
                continue
            cells += n_cells
            meta = np.frombuffer(data, dtype="<i4", count=record * n_cells, offset=r.skip(4 * record * n_cells))
            meta = meta.reshape(n_cells, record)
            if not (np.all(meta[:, 1] == 1) and np.all(meta[:, -1] == seq_id)):
                raise StateFormatError("its cell records are not (position, one sequence id) pairs")
            v_trans = r.take(_U32)
            n_layer = r.take(_U32)
            if v_trans > 1 or not 1 <= n_layer <= _MAX_LAYERS:
                raise StateFormatError(f"a cache block has v_trans={v_trans} and {n_layer} layers")
            transposed |= bool(v_trans)
            positions = meta[:, 0]
            for _layer in range(n_layer):
                layers.append(_rows(r, "k", n_cells, positions))
            for _layer in range(n_layer):
                if v_trans:
                    _skip_transposed(r, n_cells)
                else:
                    layers.append(_rows(r, "v", n_cells, positions))
    return SequenceState(data, seq_id, tuple(layers), transposed, cells)


def _kv_type(type_id: int) -> KvType:
    try:
        return BY_ID[type_id]
    except KeyError:
        raise StateFormatError(f"a layer has ggml type {type_id}, which kvpool cannot read") from None


def _rows(r: _Reader, kind: str, n_cells: int, positions: np.ndarray) -> Rows:
    offset = r.pos
    type_field = r.take(_I32)
    rotated = type_field & ROTATED_FLAG != 0
    kv_type = _kv_type(type_field & ~ROTATED_FLAG)
    row_bytes = r.take(_U64)
    if row_bytes == 0 or row_bytes % kv_type.block_bytes:
        raise StateFormatError(f"a {kind.upper()} row of {row_bytes} bytes is not whole {kv_type.name} blocks")
    r.skip(n_cells * row_bytes)
    return Rows(kind, kv_type, n_cells, row_bytes, offset, rotated, positions)


def _skip_transposed(r: _Reader, n_cells: int) -> None:
    kv_type = _kv_type(r.take(_I32))
    element_bytes = r.take(_U32)
    n_embd = r.take(_U32)
    if kv_type.quantized or element_bytes != kv_type.block_bytes:
        raise StateFormatError(f"a transposed V layer of type {kv_type.name} has {element_bytes}-byte elements")
    r.skip(n_embd * n_cells * element_bytes)


def rewrite(state: SequenceState, replace: dict[int, tuple[RowCoding, bytes]]) -> bytearray:
    """The state with the layers at the given indexes (into ``state.layers``) replaced by rows of another coding
    (the new rows' bytes, ``n_rows`` x the type's row size); every other byte as it was."""
    out = bytearray()
    at = 0
    for index, layer in enumerate(state.layers):
        if index not in replace:
            continue
        coding, rows = replace[index]
        row_bytes = coding.kv_type.row_bytes(layer.n_cols)
        if len(rows) != layer.n_rows * row_bytes:
            raise ValueError(f"layer {index}: {len(rows)} bytes for {layer.n_rows} rows of {row_bytes}")
        out += state.data[at : layer.offset]
        out += _I32.pack(coding.type_field) + _U64.pack(row_bytes)
        out += rows
        at = layer.end
    out += state.data[at:]
    return out
