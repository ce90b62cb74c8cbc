"""A prompt in parts (text and media, protocol.Medium) as a session's tokens: each text part tokenized as the
projector's own tokenizer would (each piece on its own), each medium as the text the projector puts around it and
its placeholder cells (media/media_cache.py), the medium found by its content or prepared now. Every medium comes back
pinned for the caller (``release`` lets go of them when the prompt is not taken)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvpool import protocol as p
from kvpool.daemon.llama.model.mtmd import MediaError
from kvpool.daemon.media.media_cache import MediaCache, MediaEntry, MediaPiece
from kvpool.daemon.refusals import RequestRefused
from kvpool.protocol import ErrorCode

MAX_MEDIA_PER_PROMPT = 64
NO_PROJECTOR = (
    "This daemon has no projector (mmproj), so it reads text only; start it with --mmproj FILE (a projector GGUF "
    "for its model) to send images or audio, or send text."
)


@dataclass
class MediaPrompt:
    tokens: list[int] = field(default_factory=list)
    media: list[tuple[int, MediaPiece]] = field(default_factory=list)  # where each piece's cells begin, pinned

    def release(self) -> None:
        for _, piece in self.media:
            piece.pins -= 1
        self.media.clear()


Tokenize = Callable[[str, bool], list[int]]  # (text, add_bos) -> tokens
AreaBytes = Callable[[str, int, int], bytes]  # (area, offset, length) -> the bytes, or RequestRefused


def media_prompt(
    parts: list[str | list[int] | p.Medium],
    cache: MediaCache | None,
    tokenize: Tokenize,
    checked: Callable[[list[int]], list[int]],
    area_bytes: AreaBytes,
    starts_session: bool,
    max_bytes: int,
) -> MediaPrompt:
    """The tokens ``parts`` stand for; ``starts_session``: they are the session's first (BOS first, unless the
    first part is token ids: those are taken as given). ``checked``: token ids, or BAD_REQUEST for ids outside the
    vocabulary."""
    media = [part for part in parts if isinstance(part, p.Medium)]
    if media and cache is None:
        raise RequestRefused(ErrorCode.MEDIA_UNSUPPORTED, NO_PROJECTOR)
    if len(media) > MAX_MEDIA_PER_PROMPT:
        raise RequestRefused(
            ErrorCode.BAD_REQUEST, f"A prompt holds at most {MAX_MEDIA_PER_PROMPT} media; this one has {len(media)}."
        )
    prompt = MediaPrompt()
    try:
        for i, part in enumerate(parts):
            first = starts_session and i == 0
            if isinstance(part, str):
                prompt.tokens += tokenize(part, first)
                continue
            if isinstance(part, list):
                prompt.tokens += checked(part)
                continue
            assert cache is not None
            if first:
                prompt.tokens += tokenize("", True)  # the BOS a session starts with, before the medium
            entry = _entry(part, i, cache, area_bytes, max_bytes)
            tokens, starts = entry.prompt(len(prompt.tokens))
            for _, piece in starts:
                piece.pins += 1
            prompt.media += starts
            prompt.tokens += tokens
    except BaseException:
        prompt.release()
        raise
    return prompt


def _entry(part: p.Medium, i: int, cache: MediaCache, area_bytes: AreaBytes, max_bytes: int) -> MediaEntry:
    encoder = cache.encoder
    served = encoder.vision if part.kind == "image" else encoder.audio
    if not served:
        other = "images" if part.kind == "audio" else "audio"
        raise RequestRefused(
            ErrorCode.MEDIA_UNSUPPORTED,
            f"parts[{i}] is {'an image' if part.kind == 'image' else 'audio'}, but the projector "
            f"{encoder.path.name} reads {other} only; send {other}, or start the daemon with a projector that "
            f"reads {part.kind}.",
        )
    if part.data is not None and part.area is not None:
        raise RequestRefused(ErrorCode.BAD_REQUEST, f"parts[{i}] names both `data` and an `area`: send one of them.")
    if part.data is not None:
        data: bytes | memoryview = part.data
    elif part.area is not None:
        # Read (copied) once: the task may write its area again at any time; what is hashed is what is read.
        data = area_bytes(part.area, part.offset, part.length)
    else:
        raise RequestRefused(ErrorCode.BAD_REQUEST, f"parts[{i}] has no bytes: send `data`, or an `area` with a place.")
    if len(data) > max_bytes:
        raise RequestRefused(
            ErrorCode.BAD_REQUEST,
            f"parts[{i}] is {len(data)} bytes; this daemon takes media of at most max_media_bytes={max_bytes}.",
        )
    try:
        return cache.get(part.kind, part.format, data, part.width, part.height)
    except MediaError as exc:
        raise RequestRefused(ErrorCode.BAD_REQUEST, f"parts[{i}]: {exc}.") from None
