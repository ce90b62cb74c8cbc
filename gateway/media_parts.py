"""Images and audio in a request's messages (OpenAI's ``image_url`` and ``input_audio`` parts, Anthropic's image
blocks): their bytes, and where they stand in the rendered conversation.

Each medium renders as a marker naming its content (its SHA-256), so the rendering that decides whether a
conversation continues its session (turns.py) tells one picture from another, and the daemon, which gets the new
part of a rendering split at the markers (the text as token ids, each medium as its bytes), reads every medium
once. A ``data:`` URL is always read; a local file only under ``--media-dir``; an http(s) URL only with
``--fetch-media-urls`` (never by default: a gateway fetching what a request names is a way into the network).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from kvpool.client.media import Audio, Image
from kvpool.protocol.file_kinds import AUDIO_KINDS, SIGNATURES, file_kind

from .http_errors import HttpError, refuse

MARK = "\u2063kvpool-medium:{}\u2063"
_MARKS = re.compile("\u2063kvpool-medium:([0-9a-f]{64})\u2063")
FETCH_TIMEOUT_S = 10.0
AUDIO_FORMATS = AUDIO_KINDS  # (input_audio.format names the file's kind)
_NAMES = {"jpg": "jpeg", "x-ms-bmp": "bmp", "x-wav": "wav", "wave": "wav", "mpeg": "mp3", "x-flac": "flac"}


def check_declared(declared: str, data: bytes, where: str, what: str) -> None:
    """A 400 when ``declared`` (a subtype such as png, or a MIME type) names another kind of file than ``data``: a
    declared type (a data: URL's, input_audio.format) is refused rather than passed over (the bytes decide what the
    daemon reads either way; it refuses a WebP, which llama.cpp does not read, itself)."""
    subtype = declared.lower().partition("/")[2] or declared.lower()
    named = _NAMES.get(subtype, subtype)
    found = file_kind(data)
    if named in SIGNATURES and found is not None and found != named:
        raise refuse(
            where, f"{where}: {what} is {declared}, but the bytes are a {found.upper()} file.", "invalid_value"
        )


@dataclass
class RequestMedia:
    """The media one request's messages carry, by content."""

    media_dir: Path | None = None
    fetch_urls: bool = False
    max_bytes: int = 32 << 20
    by_digest: dict[str, Image | Audio] = field(default_factory=dict)
    where: dict[int, str] = field(default_factory=dict)  # id() of a medium -> the request field it came from

    def image(self, part: Any, where: str) -> str:
        """An ``image_url`` part's marker (its bytes kept), or a 400 naming the part."""
        spec = part if isinstance(part, dict) else {}
        url = spec.get("url") if isinstance(spec.get("url"), str) else None
        if url is None:
            raise refuse(
                f"{where}.image_url.url",
                f"{where}.image_url needs a `url` (a data: URL, e.g. data:image/png;base64,...).",
            )
        if spec.get("detail", "auto") not in ("auto", "low", "high"):
            raise refuse(f"{where}.image_url.detail", f"{where}.image_url.detail is auto, low or high.")
        data = self._read_url(url, f"{where}.image_url.url")
        mime = url[5:].partition(";")[0].partition(",")[0] if url.startswith("data:") else ""
        if mime and not mime.lower().startswith(("image/", "application/octet-stream")):
            raise refuse(
                f"{where}.image_url.url",
                f"{where}.image_url.url: the image is declared {mime}; an image part carries an image (image/png, "
                "image/jpeg, ...).",
                "invalid_value",
            )
        if mime:
            check_declared(mime, data, f"{where}.image_url.url", "its declared type")
        return self._add(Image(data), f"{where}.image_url")

    def audio(self, part: Any, where: str) -> str:
        """An ``input_audio`` part's marker (its bytes kept), or a 400 naming the part."""
        spec = part if isinstance(part, dict) else {}
        if spec.get("format") not in AUDIO_FORMATS:
            raise refuse(
                f"{where}.input_audio.format", f"{where}.input_audio.format is one of {', '.join(AUDIO_FORMATS)}."
            )
        data = spec.get("data")
        if not isinstance(data, str):
            raise refuse(f"{where}.input_audio.data", f"{where}.input_audio needs `data`: the file's bytes in base64.")
        audio = self._base64(data, f"{where}.input_audio.data")
        check_declared(spec["format"], audio, f"{where}.input_audio.format", "input_audio.format")
        return self._add(Audio(audio), f"{where}.input_audio")

    def _add(self, medium: Image | Audio, where: str) -> str:
        digest = hashlib.sha256(bytes(medium.source)).hexdigest()
        medium = self.by_digest.setdefault(digest, medium)  # (the same bytes twice: named where they came first)
        self.where.setdefault(id(medium), where)
        return MARK.format(digest)

    def part_names(self, parts: list[list[int] | Image | Audio]) -> dict[int, str]:
        """The request field each medium of a turn's parts came from, by its index there (the daemon's refusals
        name a part by its index: ``parts[3]``)."""
        return {i: self.where[id(x)] for i, x in enumerate(parts) if not isinstance(x, list) and id(x) in self.where}

    def _read_url(self, url: str, where: str) -> bytes:
        if url.startswith("data:"):
            header, _, payload = url.partition(",")
            if not header.endswith(";base64"):
                raise refuse(where, f"{where}: a data: URL of an image is base64 (data:image/png;base64,...).")
            return self._base64(payload, where)
        parsed = urlparse(url)
        if parsed.scheme in ("http", "https"):
            if not self.fetch_urls:
                raise refuse(
                    where,
                    f"{where}: this gateway does not fetch URLs (start it with --fetch-media-urls to allow it); send "
                    "the image as a data: URL.",
                )
            return self._fetch(url, where)
        if parsed.scheme in ("", "file"):
            return self._file(unquote(parsed.path) if parsed.scheme else url, where)
        raise refuse(where, f"{where}: {parsed.scheme}: URLs are not read; send a data: URL.")

    def _file(self, name: str, where: str) -> bytes:
        if self.media_dir is None:
            raise refuse(
                where,
                f"{where}: this gateway reads no local files (start it with --media-dir DIR to allow files there); "
                "send the image as a data: URL.",
            )
        path = (self.media_dir / name).resolve()
        if not path.is_relative_to(self.media_dir.resolve()) or not path.is_file():
            raise refuse(where, f"{where}: no file {name!r} in the gateway's --media-dir.")
        if path.stat().st_size > self.max_bytes:
            raise refuse(where, f"{where}: {name!r} is larger than {self.max_bytes} bytes.")
        return path.read_bytes()

    def _fetch(self, url: str, where: str) -> bytes:
        import httpx  # (the gateway extra)

        try:
            with httpx.stream("GET", url, timeout=FETCH_TIMEOUT_S, follow_redirects=False) as answer:
                if answer.status_code != 200:
                    raise refuse(where, f"{where}: fetching it answered {answer.status_code}.")
                data = bytearray()
                for piece in answer.iter_bytes():
                    data += piece
                    if len(data) > self.max_bytes:
                        raise refuse(where, f"{where}: the file is larger than {self.max_bytes} bytes.")
                return bytes(data)
        except httpx.HTTPError as exc:
            raise refuse(where, f"{where}: could not fetch it ({exc}).") from None

    def _base64(self, text: str, where: str) -> bytes:
        try:
            data = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise refuse(where, f"{where}: not valid base64.") from None
        if not data:
            raise refuse(where, f"{where}: the file is empty.")
        if len(data) > self.max_bytes:
            raise HttpError(413, f"{where}: the file is larger than {self.max_bytes} bytes.", "too_large", param=where)
        return data

    def parts(self, text: str) -> list[str | Image | Audio]:
        """``text`` (a rendering's new part) split at its media's markers: text pieces and media, in order."""
        out: list[str | Image | Audio] = []
        at = 0
        for found in _MARKS.finditer(text):
            if found.start() > at:
                out.append(text[at : found.start()])
            medium = self.by_digest.get(found.group(1))
            if medium is None:  # (a marker a client typed itself: its bytes are not this request's)
                raise HttpError(
                    400,
                    "A message holds a medium marker that names no image or audio of this request.",
                    "invalid_value",
                )
            out.append(medium)
            at = found.end()
        if at < len(text):
            out.append(text[at:])
        return out


def holds_media(text: str) -> bool:
    return _MARKS.search(text) is not None
