"""The hot KV's settings, resolved and checked before the model loads: the K and V cache types, flash
attention, and what llama.cpp derives from them without recording it in a saved state.

Two things change what a snapshot's bytes mean without showing in llama.cpp's per-layer types: flash attention
off stores V transposed, and a quantized K or V of a head size that is a multiple of 64 is stored rotated by a
Hadamard matrix unless LLAMA_ATTN_ROT_DISABLE is set (src/llama-kv-cache.cpp). ``layout`` names them all; the
pool and the spill files carry it, and a daemon started with other settings refuses their snapshots instead of
loading bytes it would read differently.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from kvpool.daemon.kv.codec.kv_types import KvType, kv_type


class KvSettingsError(Exception):
    """A KV setting llama.cpp would refuse for this model; the message says which and what to use."""


@dataclass(frozen=True, slots=True)
class KvSettings:
    type_k: KvType
    type_v: KvType
    flash_attn: bool
    rotate_k: bool
    rotate_v: bool
    swa_full: bool = False

    @property
    def layout(self) -> str:
        """The identity of the hot KV's byte format (at most 64 characters: it lives in the pool header)."""
        return (
            f"k={self.type_k.name},v={self.type_v.name},fa={int(self.flash_attn)},"
            f"rot={int(self.rotate_k)}{int(self.rotate_v)},swa_full={int(self.swa_full)}"
        )

    def describe(self) -> str:
        rotated = [kind for kind, on in (("K", self.rotate_k), ("V", self.rotate_v)) if on]
        return (
            f"hot KV: K {self.type_k.name}, V {self.type_v.name}, flash attention {'on' if self.flash_attn else 'off'}"
            + (f", {' and '.join(rotated)} Hadamard-rotated" if rotated else "")
        )


def resolve_kv_settings(
    cache_type_k: str,
    cache_type_v: str,
    flash_attn: str,
    head_k: int,
    head_v: int,
    environ: Mapping[str, str] | None = None,
) -> tuple[KvSettings, str]:
    """The settings and a sentence on how flash attention was chosen. ``head_k``/``head_v``: the model's
    attention head sizes (GGUF ``attention.key_length``/``value_length``)."""
    type_k, type_v = kv_type(cache_type_k), kv_type(cache_type_v)
    if flash_attn == "off" and type_v.quantized:
        raise KvSettingsError(
            f"cache_type_v = {type_v.name} needs flash attention (llama.cpp keeps a quantized V only in flash "
            'attention\'s layout); set flash_attn = "on" or "auto", or cache_type_v = "f16".'
        )
    # auto is on: kvpool runs llama.cpp's CPU backend, which has flash attention for every type, and it is what
    # llama.cpp's own auto resolves to there. Resolving it here (not in llama.cpp) keeps the layout knowable.
    fa = flash_attn != "off"
    if flash_attn == "auto":
        why = "flash attention on (auto" + (f": required by cache_type_v = {type_v.name})" if type_v.quantized else ")")
    else:
        why = f"flash attention {flash_attn} (configured)"
    for name, t, head in (("cache_type_k", type_k, head_k), ("cache_type_v", type_v, head_v)):
        if t.quantized and head % t.block:
            raise KvSettingsError(
                f"{name} = {t.name} does not fit this model: its attention heads have {head} values, not a "
                f"multiple of {t.name}'s {t.block}-value blocks; use f16 (or a type whose block divides {head})."
            )
    env = os.environ if environ is None else environ
    rotation_off = _atoi(env.get("LLAMA_ATTN_ROT_DISABLE", "")) != 0
    settings = KvSettings(
        type_k,
        type_v,
        fa,
        rotate_k=not rotation_off and type_k.quantized and head_k % 64 == 0,
        rotate_v=not rotation_off and type_v.quantized and head_v % 64 == 0,
    )
    return settings, why


def _atoi(text: str) -> int:
    """C's atoi, as llama.cpp reads LLAMA_ATTN_ROT_DISABLE: leading digits, else 0."""
    text = text.strip()
    sign = -1 if text.startswith("-") else 1
    digits = ""
    for ch in text.lstrip("+-"):
        if not ch.isdigit():
            break
        digits += ch
    return sign * int(digits) if digits else 0
