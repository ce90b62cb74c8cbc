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
# Types a tier may store rows at that llama.cpp takes for weights but not for its cache: a stored state is always
# written back at the hot types before llama.cpp loads it.
STORE_ONLY_TYPES = {
    t.name: t for t in (KvType("mxfp4", 39, 32, 17), KvType("tq2_0", 35, 256, 66), KvType("tq1_0", 34, 256, 54))
}
BY_ID = {t.ggml_id: t for t in (*KV_TYPES.values(), *STORE_ONLY_TYPES.values())}
F16 = KV_TYPES["f16"]
ROTATED_FLAG = 0x100  # in a stored layer's type field: its rows were rotated before quantizing (codec/rotation.py)


@dataclass(frozen=True, slots=True)
class RowCoding:
    """How a layer's rows are stored: a ggml block type, after kvpool's Hadamard rotation or as they are."""

    kv_type: KvType
    rotated: bool = False

    @property
    def name(self) -> str:
        return self.kv_type.name + ("h" if self.rotated else "")

    @property
    def type_field(self) -> int:
        """What a state's layer header says: the ggml type, with ROTATED_FLAG for rotated rows."""
        return self.kv_type.ggml_id | (ROTATED_FLAG if self.rotated else 0)

    @classmethod
    def of_field(cls, field: int) -> RowCoding:
        return cls(BY_ID[field & ~ROTATED_FLAG], bool(field & ROTATED_FLAG))


_PAIR = 1 << 20  # a store type id from here on names K's and V's codings (below: one ggml type for both)
_BY_LAYER = 1 << 21  # with _PAIR: some K layers have codings of their own (a precision profile's)


@dataclass(frozen=True, slots=True)
class StoreType:
    """What a warm or cold tier stores a snapshot's K and V rows at: K's and V's codings, and K layers that take
    a coding of their own (a precision profile's, codec/precision_profile.py), by their order among the state's K
    layers. A record names only that there are such layers: every stored layer's own type field says its coding,
    so a restore needs nothing else."""

    k: RowCoding
    v: RowCoding
    k_layers: tuple[tuple[int, RowCoding], ...] = ()
    by_layer: bool = False  # set for a profile's type (k_layers then holds its layers; read from an id, none)

    @property
    def name(self) -> str:
        both = self.k.name if self.k == self.v else f"{self.k.name}/{self.v.name}"
        return f"{both} by layer" if self.by_layer else both

    @property
    def id(self) -> int:
        """A snapshot record's kv_type: the ggml type for one plain type (as records have always said), else both
        codings, and whether K layers have codings of their own."""
        if self.k == self.v and not self.k.rotated and not self.by_layer:
            return self.k.kv_type.ggml_id
        return _PAIR | (_BY_LAYER if self.by_layer else 0) | self.k.type_field << 10 | self.v.type_field

    @classmethod
    def of_id(cls, type_id: int) -> StoreType:
        """Raises KeyError for an id no store type has."""
        if type_id < _PAIR:
            plain = RowCoding(BY_ID[type_id])
            return cls(plain, plain)
        if type_id >= _BY_LAYER << 1 or not type_id & _PAIR:
            raise KeyError(type_id)
        k, v = RowCoding.of_field(type_id >> 10 & 0x3FF), RowCoding.of_field(type_id & 0x3FF)
        return cls(k, v, by_layer=bool(type_id & _BY_LAYER))

    @classmethod
    def known(cls, type_id: int) -> bool:
        try:
            cls.of_id(type_id)
        except KeyError:
            return False
        return True

    @classmethod
    def named(cls, name: str) -> StoreType:
        """ "q4_0", "q4_0h" (rotated), "q4_0h/q8_0" (K, then V). Raises ValueError naming what it takes."""
        halves = name.split("/")
        if len(halves) > 2 or not all(h.removesuffix("h") in QUANTIZED_STORE for h in halves):
            raise ValueError(
                f"{name!r} is no store type: one of {', '.join(QUANTIZED_STORE)}, an h after it for rotated rows, "
                "and K/V for two"
            )
        codings = [coding_named(h) for h in halves]
        return cls(codings[0], codings[-1])

    def with_k_layers(self, k_layers: dict[int, RowCoding]) -> StoreType:
        """This type with the K layers named (their order among the state's K layers) at codings of their own."""
        return StoreType(self.k, self.v, tuple(sorted(k_layers.items())), by_layer=True)

    def bytes_per_element(self) -> float:
        """Of K and V together, per element of each (K layers of their own not counted)."""
        return self.k.kv_type.bytes_per_element() + self.v.kv_type.bytes_per_element()


def coding_named(name: str) -> RowCoding:
    """ "q5_1", "q4_0h" (rotated rows), or "f16" (a layer kept as the default hot KV holds it). Raises ValueError
    naming what it takes."""
    plain = name.removesuffix("h")
    if name != "f16" and plain not in QUANTIZED_STORE:
        raise ValueError(
            f"{name!r} is no row coding: f16, or one of {', '.join(QUANTIZED_STORE)}, an h after it for rotated rows"
        )
    types = KV_TYPES | STORE_ONLY_TYPES
    return RowCoding(types[name]) if name == "f16" else RowCoding(types[plain], name.endswith("h"))


# (gguf quantizes them; f16 and bf16 are no smaller)
QUANTIZED_STORE = ("q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "mxfp4", "tq2_0", "tq1_0")
# What a warm or cold tier may store snapshots as: "same" (the hot types, bytes untouched) or a smaller store type
# (StoreType.named); the settings offer the ones on bench/kv_quality.py's frontier (docs/kv-compression.md): K
# holds the precision, V takes 4 bits rotated at the noise floor.
STORE_TYPES = ("same", "q8_0", "q8_0/q4_0h", "q5_1/q4_0h", "q4_0h", "q4_0")
# ... or the model's precision profile: K and V at the profile's codings, its sensitive K layers at their own
# (codec/precision_profile.py; kv_profile names the file).
PROFILE = "profile"


def kv_type(name: str) -> KvType:
    return KV_TYPES[name]
