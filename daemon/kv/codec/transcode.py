"""Transcoding a sequence state's K and V rows to other ggml types (compress for the pool or the disk, and
back to the context's types to load). The block kernels are gguf's numpy ports of ggml's reference
quantizers (maintained with llama.cpp), vectorised over whole layers."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
from gguf import GGMLQuantizationType, quants

from kvpool.daemon.kv.codec.kv_types import KvType, RowCoding, StoreType
from kvpool.daemon.kv.codec.rotation import rotate, unrotate
from kvpool.daemon.kv.codec.state_format import Rows, SequenceState, StateBytes, parse, rewrite


@dataclass(frozen=True, slots=True)
class Target:
    """The codings to write: K rows and V rows (a plain type: as it is, not rotated; None keeps that kind)."""

    k: KvType | RowCoding | None
    v: KvType | RowCoding | None
    # Codings of single K layers over K's, by their order among the state's K layers (cache after cache: a
    # sliding-window model's full-attention layers come first): a precision per layer.
    k_layers: Mapping[int, RowCoding] = field(default_factory=dict)

    @classmethod
    def of(cls, store: StoreType) -> Target:
        return cls(store.k, store.v, dict(store.k_layers))

    def for_layer(self, k_order: int | None, kind: str) -> RowCoding | None:
        """``k_order``: a K layer's order among the state's K layers (None for a V layer)."""
        if kind == "k" and k_order in self.k_layers:
            return self.k_layers[k_order]
        to = self.k if kind == "k" else self.v
        return RowCoding(to) if isinstance(to, KvType) else to


def decode_rows(rows: np.ndarray, kv_type: KvType) -> np.ndarray:
    """uint8 [n, row_bytes] -> float32 [n, n_cols]."""
    if kv_type.name == "f32":
        return rows.view(np.float32)
    if kv_type.name == "f16":
        return rows.view(np.float16).astype(np.float32)
    return quants.dequantize(rows, GGMLQuantizationType(kv_type.ggml_id)).astype(np.float32, copy=False)


def encode_rows(values: np.ndarray, kv_type: KvType) -> np.ndarray:
    """float32 [n, n_cols] -> uint8 [n, row_bytes] in ``kv_type``'s block format."""
    if kv_type.name == "f32":
        return np.ascontiguousarray(values, dtype=np.float32).view(np.uint8)
    if kv_type.name == "f16":
        return values.astype(np.float16).view(np.uint8)
    return quants.quantize(values, GGMLQuantizationType(kv_type.ggml_id))


def convertible(layer: Rows, to: KvType) -> bool:
    return layer.n_cols % to.block == 0


def transcode(state: StateBytes | SequenceState, target: Target) -> bytearray:
    """The state with every K/V row block at the target types (layers whose width is not a whole number of the
    target's blocks, and transposed V, stay as they are). Raises StateFormatError for bytes it cannot read."""
    parsed = state if isinstance(state, SequenceState) else parse(state)
    replace: dict[int, tuple[RowCoding, bytes]] = {}
    k_order = 0
    for index, layer in enumerate(parsed.layers):
        to = target.for_layer(k_order if layer.kind == "k" else None, layer.kind)
        k_order += layer.kind == "k"
        if to is None or to == layer.coding or not convertible(layer, to.kv_type):
            continue
        rows = np.frombuffer(parsed.data, np.uint8, layer.n_rows * layer.row_bytes, layer.data_offset)
        values = decode_rows(rows.reshape(layer.n_rows, layer.row_bytes), layer.kv_type)
        if layer.rotated:
            values = unrotate(values)
        if to.rotated:
            values = rotate(values)
        replace[index] = (to, encode_rows(values, to.kv_type).tobytes())
    if not replace:
        return bytearray(parsed.data)
    return rewrite(parsed, replace)
