"""Media by content: each medium a request brings is prepared once (tokenized by the projector) and encoded once
while its embeddings stay here, so the same camera frame or the same picture in two sessions costs one encode.

An entry is pinned while a session holds its cells uncomputed (kv/place.py counts them): its prepared chunk, or
its embeddings once encoded, stay until they are fed. Unpinned entries keep their embeddings in a least recently
used cache of ``max_bytes``; a prepared chunk is freed once encoded (the embeddings are what a later feed needs).
Engine thread only.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import xxhash

from kvpool.daemon.llama.model.mtmd import MediaEncoder, Prepared
from kvpool.protocol.status import MediaStatus

PLACEHOLDER_SPAN = 1 << 30
# What an encode is expected to take before one was measured (the start's warm-up encode measures it).
PRIOR_ENCODE_S = 0.05
LEARN = 0.3  # weight of the newest encode in the running estimate


def digest_of(kind: str, fmt: str, width: int, height: int, data: bytes | memoryview) -> str:
    """A medium's identity: its bytes and what they are (XXH3-128)."""
    h = xxhash.xxh3_128(f"{kind}:{fmt}:{width}x{height}:".encode())
    h.update(data)
    return h.hexdigest()


def placeholders(digest: str, n_tokens: int) -> list[int]:
    """The token ids a medium's cells stand as in a session's tokens: negative (no vocabulary id is), one per cell,
    derived from its content, so that sessions holding the same medium at the same place match token for token
    (prefix sharing, a conversation continued) and sessions holding another do not."""
    base = int(digest[:8], 16) % PLACEHOLDER_SPAN
    return [-1 - (base + j) % PLACEHOLDER_SPAN for j in range(n_tokens)]


@dataclass(eq=False)
class MediaEntry:
    digest: str
    kind: str
    before: list[int]  # the text tokens the projector puts around the medium
    after: list[int]
    n_tokens: int
    non_causal: bool
    prepared: Prepared | None  # until encoded
    embeddings: np.ndarray | None = None
    pins: int = 0  # sessions holding its cells uncomputed
    last_used: float = field(default_factory=time.monotonic)
    expected_seconds: float = PRIOR_ENCODE_S  # what feeding it costs before its rows: its encode (0 once encoded)

    @property
    def tokens(self) -> list[int]:
        """What the medium adds to a prompt: its text around its placeholder cells."""
        return [*self.before, *placeholders(self.digest, self.n_tokens), *self.after]

    @property
    def bytes(self) -> int:
        return self.embeddings.nbytes if self.embeddings is not None else 0


class MediaCache:
    def __init__(self, encoder: MediaEncoder, max_bytes: int):
        self.encoder = encoder
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, MediaEntry] = OrderedDict()  # least recently used first
        self._encode_s: dict[str, float] = {}  # kind -> expected encode seconds
        self.prepared = self.hits = self.encodes = 0
        self.encode_seconds = 0.0

    def get(self, kind: str, fmt: str, data: bytes | memoryview, width: int, height: int) -> MediaEntry:
        """The entry for this medium: found by its content, else prepared now (MediaError when it cannot be)."""
        digest = digest_of(kind, fmt, width, height, data)
        self.trim()  # (what sessions let go of since: a cache of 0 bytes keeps nothing for the next request)
        entry = self._entries.get(digest)
        if entry is not None:
            self.hits += 1
            self._entries.move_to_end(digest)
            entry.last_used = time.monotonic()
            return entry
        prepared = self.encoder.prepare(
            kind, fmt, data if isinstance(data, bytes) else bytes(data), width, height, digest
        )
        entry = MediaEntry(
            digest, kind, prepared.before, prepared.after, prepared.n_tokens, prepared.non_causal, prepared
        )
        entry.expected_seconds = self._encode_s.get(kind, PRIOR_ENCODE_S)
        self._entries[digest] = entry  # (the caller pins it: a trim drops an unpinned entry never encoded)
        self.prepared += 1
        return entry

    def encode(self, entry: MediaEntry) -> float:
        """Encode ``entry`` if it is not yet; the seconds it took (0 when it was)."""
        if entry.embeddings is not None:
            return 0.0
        assert entry.prepared is not None
        started = time.perf_counter()
        entry.embeddings = self.encoder.encode(entry.prepared)
        seconds = time.perf_counter() - started
        entry.prepared.free()
        entry.prepared = None
        entry.expected_seconds = 0.0
        self.encodes += 1
        self.encode_seconds += seconds
        known = self._encode_s.get(entry.kind)
        self._encode_s[entry.kind] = seconds if known is None else (1 - LEARN) * known + LEARN * seconds
        self.trim()
        return seconds

    def expected_seconds(self, entry: MediaEntry) -> float:
        """What feeding ``entry`` costs before its rows are decoded: its encode, unless it is encoded."""
        return entry.expected_seconds

    def warm_up(self) -> None:
        """Encode a blank image and a second of silence (what the projector reads), timed, so that scheduling and
        admission expect the right cost from the first request on; nothing of it is kept."""
        samples = []
        if self.encoder.vision:
            samples.append(("image", "rgb", bytes([128]) * (64 * 64 * 3), 64, 64))
        if self.encoder.audio:
            samples.append(("audio", "pcm_f32", bytes(4 * max(1, self.encoder.sample_rate)), 0, 0))
        for kind, fmt, data, width, height in samples:
            entry = self.get(kind, fmt, data, width, height)
            entry.pins += 1
            try:
                self.encode(entry)
            finally:
                entry.pins -= 1
                if entry.digest in self._entries:
                    self._drop(entry.digest)
        self.prepared = self.encodes = 0
        self.encode_seconds = 0.0

    def trim(self) -> None:
        """Drop the least recently used unpinned entries beyond ``max_bytes`` (and any unpinned entry never
        encoded: a prepared chunk is kept only for a session that will feed it)."""
        total = sum(e.bytes for e in self._entries.values())
        for digest, entry in list(self._entries.items()):
            if entry.pins:
                continue
            if entry.embeddings is None or total > self.max_bytes:
                total -= entry.bytes
                self._drop(digest)

    def _drop(self, digest: str) -> None:
        entry = self._entries.pop(digest)
        if entry.prepared is not None:
            entry.prepared.free()
            entry.prepared = None

    def close(self) -> None:
        for digest in list(self._entries):
            self._drop(digest)

    def status(self) -> MediaStatus:
        encoder = self.encoder
        return MediaStatus(
            projector=encoder.path.name,
            vision=encoder.vision,
            audio=encoder.audio,
            audio_sample_rate=encoder.sample_rate,
            prepared=self.prepared,
            encodes=self.encodes,
            cache_hits=self.hits,
            encode_ms_total=round(self.encode_seconds * 1000.0, 1),
            expected_encode_ms={kind: round(s * 1000.0, 2) for kind, s in self._encode_s.items()},
            cached=len(self._entries),
            cached_bytes=sum(e.bytes for e in self._entries.values()),
            cache_max_bytes=self.max_bytes,
        )
