"""Media by content: each medium a request brings is prepared once (tokenized by the projector) and encoded once
while its embeddings stay here, so the same camera frame or the same picture in two sessions costs one encode.

A medium is one piece or several (a tiled image, audio over 30 s: the projector splits them), with the text the
projector puts around and between them. A piece is pinned while a session holds its cells uncomputed (kv/place.py
counts them): its prepared chunk, or its embeddings once encoded, stay until they are fed. Media no session pins
keep their embeddings in a least recently used cache of ``max_bytes``; a prepared chunk is freed once encoded (the
embeddings are what a later feed needs). With ``beside``, a piece is encoded on a thread of its own as soon as a
request brings it (``start``), one at a time, while the engine's steps go on (``poll`` takes in what is done);
else the step that feeds it encodes it first, on the engine thread. The rest runs on the engine thread only.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import xxhash

from kvpool.daemon.kv.positions import grid_placeholders
from kvpool.daemon.llama.model.mtmd import MediaEncoder, MediumPositions, Piece
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


def placeholders(key: str, n_tokens: int) -> list[int]:
    """The token ids a piece's cells stand as in a session's tokens: negative (no vocabulary id is), one per cell,
    derived from its medium's content and its place in it, so that sessions holding the same medium at the same
    place match token for token (prefix sharing, a conversation continued) and sessions holding another do not."""
    base = xxhash.xxh3_64_intdigest(key.encode()) % PLACEHOLDER_SPAN
    return [-1 - (base + j) % PLACEHOLDER_SPAN for j in range(n_tokens)]


@dataclass(eq=False)
class MediaPiece:
    """One piece of a medium, as a session feeds it: its cells from its embeddings, in a decode of their own."""

    key: str  # its medium's digest and its place in it
    kind: str
    n_tokens: int
    non_causal: bool
    prepared: Piece | None  # until encoded
    embeddings: np.ndarray | None = None
    pins: int = 0  # sessions holding its cells uncomputed
    expected_seconds: float = PRIOR_ENCODE_S  # what feeding it costs before its rows: its encode (0 once encoded)
    encoding: Future[tuple[np.ndarray, float]] | None = None  # its encode beside the steps, while it runs
    error: str = ""  # why it could not be encoded
    positions: MediumPositions | None = None  # an M-RoPE model's (mtmd.py); None: cell i at its first position + i

    @property
    def bytes(self) -> int:
        return self.embeddings.nbytes if self.embeddings is not None else 0

    @property
    def ready(self) -> bool:
        """A step may feed it now: encoded, or to be encoded by that step (not waiting for an encode beside)."""
        return self.encoding is None


@dataclass(eq=False)
class MediaEntry:
    """A medium: the text the projector puts around (and between) its pieces, and its pieces, in order."""

    digest: str
    kind: str
    segments: list[list[int] | MediaPiece]
    last_used: float = field(default_factory=time.monotonic)

    @property
    def pieces(self) -> list[MediaPiece]:
        return [s for s in self.segments if isinstance(s, MediaPiece)]

    def prompt(self, at: int) -> tuple[list[int], list[tuple[int, MediaPiece]]]:
        """What the medium adds to a prompt whose tokens so far are ``at``: its tokens (text and placeholder
        cells), and where each piece's cells begin."""
        tokens: list[int] = []
        starts: list[tuple[int, MediaPiece]] = []
        for segment in self.segments:
            if isinstance(segment, MediaPiece):
                starts.append((at + len(tokens), segment))
                grid = segment.positions
                if grid is not None and grid.grid:  # (its cells share one position: kv/positions.py)
                    tokens += grid_placeholders(segment.key, segment.n_tokens, grid.n_pos)
                else:
                    tokens += placeholders(segment.key, segment.n_tokens)
            else:
                tokens += segment
        return tokens, starts

    @property
    def pinned(self) -> bool:
        return any(piece.pins for piece in self.pieces)

    @property
    def encoded(self) -> bool:
        return all(piece.embeddings is not None for piece in self.pieces)

    @property
    def bytes(self) -> int:
        return sum(piece.bytes for piece in self.pieces)

    def free(self) -> None:
        for piece in self.pieces:
            if piece.prepared is not None:
                piece.prepared.free()
                piece.prepared = None


class MediaCache:
    def __init__(self, encoder: MediaEncoder, max_bytes: int, beside: bool = False):
        self.encoder = encoder
        self.max_bytes = max_bytes
        self._beside = ThreadPoolExecutor(1, thread_name_prefix="kvpool-encode") if beside else None
        self._started: list[MediaPiece] = []  # encodes beside the steps, in the order they go
        self._entries: OrderedDict[str, MediaEntry] = OrderedDict()  # least recently used first
        self._encode_s: dict[str, float] = {}  # kind -> expected encode seconds (of one piece)
        self.prepared = self.hits = self.encodes = 0
        self.encode_seconds = 0.0

    def get(self, kind: str, fmt: str, data: bytes | memoryview, width: int, height: int) -> MediaEntry:
        """The entry for this medium: found by its content, else prepared now (MediaError when it cannot be). The
        caller pins its pieces (a trim drops a medium never encoded that no session pins)."""
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
        expected = self._encode_s.get(kind, PRIOR_ENCODE_S)
        segments: list[list[int] | MediaPiece] = []
        for i, segment in enumerate(prepared.segments):
            if isinstance(segment, Piece):
                piece = MediaPiece(f"{digest}:{i}", kind, segment.n_tokens, segment.non_causal, segment)
                piece.positions = segment.positions
                piece.expected_seconds = expected
                segments.append(piece)
            else:
                segments.append(segment)
        entry = MediaEntry(digest, kind, segments)
        self._entries[digest] = entry
        self.prepared += 1
        return entry

    def encode(self, piece: MediaPiece) -> float:
        """Encode ``piece`` if it is not yet, here (the engine thread); the seconds it took (0 when it was)."""
        if piece.embeddings is not None:
            return 0.0
        assert piece.prepared is not None and piece.encoding is None
        started = time.perf_counter()
        embeddings = self.encoder.encode(piece.prepared)
        seconds = time.perf_counter() - started
        self._encoded(piece, embeddings, seconds)
        return seconds

    def _encoded(self, piece: MediaPiece, embeddings: np.ndarray, seconds: float) -> None:
        piece.embeddings = embeddings
        assert piece.prepared is not None
        piece.prepared.free()
        piece.prepared = None
        piece.expected_seconds = 0.0
        self.encodes += 1
        self.encode_seconds += seconds
        known = self._encode_s.get(piece.kind)
        self._encode_s[piece.kind] = seconds if known is None else (1 - LEARN) * known + LEARN * seconds
        self.trim()

    # ------------------------------------------------------------------ beside the steps

    @property
    def beside(self) -> bool:
        return self._beside is not None

    def start(self, piece: MediaPiece) -> None:
        """Begin encoding ``piece`` beside the steps (with ``beside``; else it is encoded by the step that feeds it)."""
        if self._beside is None or piece.embeddings is not None or piece.encoding is not None or piece.error:
            return
        assert piece.prepared is not None
        piece.encoding = self._beside.submit(self._timed, piece.prepared)
        self._started.append(piece)

    def _timed(self, prepared: Piece) -> tuple[np.ndarray, float]:
        """(On the encoding thread.) The embeddings, and what the encode itself took."""
        started = time.perf_counter()
        return self.encoder.encode(prepared), time.perf_counter() - started

    @property
    def busy(self) -> bool:
        """An encode runs beside the steps now (they take one thread fewer meanwhile)."""
        return bool(self._started)

    def poll(self) -> None:
        """Take in the encodes that ended: their embeddings, or why they failed (the step that feeds the piece ends
        its generation with it)."""
        while self._started and self._started[0].encoding.done():  # type: ignore[union-attr]
            piece = self._started.pop(0)  # (one worker: they end in the order they began)
            assert piece.encoding is not None
            future, piece.encoding = piece.encoding, None
            try:
                self._encoded(piece, *future.result())
            except Exception as exc:  # (MediaError, or llama.cpp's): the piece cannot be fed
                piece.error = str(exc)

    def expected_seconds(self, piece: MediaPiece) -> float:
        """What feeding ``piece`` costs before its rows are decoded: its encode, unless it is encoded."""
        return piece.expected_seconds

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
            for piece in entry.pieces:
                piece.pins += 1
            try:
                for piece in entry.pieces:
                    self.encode(piece)
            finally:
                for piece in entry.pieces:
                    piece.pins -= 1
                if entry.digest in self._entries:
                    self._drop(entry.digest)
        self.prepared = self.encodes = 0
        self.encode_seconds = 0.0

    def trim(self) -> None:
        """Drop the least recently used media no session pins beyond ``max_bytes`` (and any such medium not
        encoded whole: a prepared chunk is kept only for a session that will feed it)."""
        total = sum(e.bytes for e in self._entries.values())
        for digest, entry in list(self._entries.items()):
            if entry.pinned or any(piece.encoding is not None for piece in entry.pieces):
                continue
            if not entry.encoded or total > self.max_bytes:
                total -= entry.bytes
                self._drop(digest)

    def _drop(self, digest: str) -> None:
        self._entries.pop(digest).free()

    def close(self) -> None:
        if self._beside is not None:
            self._beside.shutdown(wait=True, cancel_futures=True)  # (before the projector is freed)
            self._started.clear()
        for digest in list(self._entries):
            self._drop(digest)

    def status(self) -> MediaStatus:
        self.trim()  # (what sessions let go of since the last request: the figures never pass cache_max_bytes)
        encoder = self.encoder
        return MediaStatus(
            projector=encoder.path.name,
            vision=encoder.vision,
            audio=encoder.audio,
            audio_sample_rate=encoder.sample_rate,
            encode="beside" if self.beside else "inline",
            prepared=self.prepared,
            encodes=self.encodes,
            cache_hits=self.hits,
            encode_ms_total=round(self.encode_seconds * 1000.0, 1),
            expected_encode_ms={kind: round(s * 1000.0, 2) for kind, s in self._encode_s.items()},
            cached=len(self._entries),
            cached_bytes=sum(e.bytes for e in self._entries.values()),
            cache_max_bytes=self.max_bytes,
        )
