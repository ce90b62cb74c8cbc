"""What each KV tier stores: the hot KV's types, or a smaller type for the pool and the spill directory.

A snapshot is compressed when it is written to a tier that stores a smaller type, and written back at the hot
types when it is restored. Compressing is lossy (docs/kv-compression.md has the measured cost), so the pool
compresses under pressure by default ("when_full": the least recently used snapshots, before any is spilled
or evicted); "always" compresses every snapshot as it is written.
"""

from __future__ import annotations

import logging

from kvpool.daemon.kv.codec.kv_types import PROFILE, StoreType
from kvpool.daemon.kv.codec.state_format import StateBytes, StateFormatError, parse
from kvpool.daemon.kv.codec.transcode import Target, transcode
from kvpool.daemon.kv.pool.layout import HOT_TYPES
from kvpool.daemon.llama.kv_settings import KvSettings

log = logging.getLogger("kvpool.kv")


class TierCodec:
    def __init__(
        self,
        hot: KvSettings,
        pool_type: str,
        pool_policy: str,
        spill_type: str,
        cell_ext: bool = False,
        profile: StoreType | None = None,
    ):
        """``profile``: what a tier whose type is "profile" stores (the model's precision profile's store type,
        codec/precision_profile.py)."""
        self.hot = hot
        self.cell_ext = cell_ext  # the model's cell records carry M-RoPE positions (state_format.parse)
        self.profile = profile
        self.pool_type = self._store_type(pool_type)
        self.pool_policy = pool_policy
        self.spill_type = self._store_type(spill_type)
        self._refused = False

    def _store_type(self, name: str) -> StoreType | None:
        """None: the tier stores the hot types (nothing to gain from types no smaller than they are)."""
        if name == "same":
            return None
        if name == PROFILE:
            if self.profile is None:
                raise ValueError("a tier stores by the precision profile, and none was given")
            return self.profile
        t = StoreType.named(name)
        hot_bytes = self.hot.type_k.bytes_per_element() + self.hot.type_v.bytes_per_element()
        if t.bytes_per_element() < hot_bytes:
            return t
        log.warning(
            "a tier set to store %s keeps the hot types (%s/%s) instead: %s is no smaller than they are",
            name,
            self.hot.type_k.name,
            self.hot.type_v.name,
            name,
        )
        return None

    @property
    def compress_on_write(self) -> bool:
        return self.pool_type is not None and self.pool_policy == "always"

    @property
    def compress_when_full(self) -> bool:
        return self.pool_type is not None and self.pool_policy == "when_full"

    def name(self, kv_type: int) -> str:
        """A record's stored type in words: "f16", "q8_0", or "f16/q8_0" for K and V of different types (an h:
        rotated rows)."""
        if kv_type != HOT_TYPES:
            return StoreType.of_id(kv_type).name
        k, v = self.hot.type_k.name, self.hot.type_v.name
        return k if k == v else f"{k}/{v}"

    def compress(self, state: StateBytes, to: StoreType) -> bytearray | None:
        """The state with its K and V rows at ``to``; None when it cannot be read (kept as it is then)."""
        try:
            parsed = parse(state, self.cell_ext)
            self._check_layout(parsed.transposed_v)
            return transcode(parsed, Target.of(to))
        except StateFormatError as exc:
            if not self._refused:  # once: every snapshot of this model will say the same
                log.warning("snapshots stay at the hot KV types: kvpool cannot read this state (%s)", exc)
                self._refused = True
            return None

    def to_hot(self, state: StateBytes) -> bytearray:
        """A compressed state back at the hot types, for llama.cpp to load. Raises StateFormatError."""
        parsed = parse(state, self.cell_ext)
        self._check_layout(parsed.transposed_v)
        return transcode(parsed, Target(self.hot.type_k, self.hot.type_v))

    def _check_layout(self, transposed_v: bool) -> None:
        if transposed_v == self.hot.flash_attn:
            raise StateFormatError(
                f"its V is {'transposed' if transposed_v else 'not transposed'}, which does not match flash "
                f"attention {'on' if self.hot.flash_attn else 'off'}"
            )
