"""The KV cache types kvpool knows: llama.cpp's cache types (ggml block formats) by the names its
``--cache-type-k`` flag uses, with their ggml ids and sizes. Pure data: the model and the memory plan size the
hot KV from them, and the codec (through gguf's numpy kernels, written by the llama.cpp project) reads and
writes their blocks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KvType:
    name: str
    ggml_id: int  # enum ggml_type
    block: int  # elements per block
    block_bytes: int  # bytes per block

    @property
    def quantized(self) -> bool:
        return self.block > 1

    def row_bytes(self, elements: int) -> int:
        """ggml_row_size: bytes of ``elements`` values (a multiple of the block)."""
        return elements // self.block * self.block_bytes

    def bytes_per_element(self) -> float:
        return self.block_bytes / self.block


# The cache types llama.cpp accepts for K and V whose blocks gguf's numpy kernels can both read and write
# (iq4_nl is left out: gguf cannot quantize it).
KV_TYPES = {
    t.name: t
    for t in (
        KvType("f32", 0, 1, 4),
        KvType("f16", 1, 1, 2),
        KvType("bf16", 30, 1, 2),
        KvType("q8_0", 8, 32, 34),
        KvType("q5_1", 7, 32, 24),
        KvType("q5_0", 6, 32, 22),
        KvType("q4_1", 3, 32, 20),
        KvType("q4_0", 2, 32, 18),
    )
}
BY_ID = {t.ggml_id: t for t in KV_TYPES.values()}
F16 = KV_TYPES["f16"]
# What a warm or cold tier may store snapshots as: "same" (the hot types, bytes untouched) or a smaller type.
STORE_TYPES = ("same", "q8_0", "q4_0")


def kv_type(name: str) -> KvType:
    return KV_TYPES[name]
