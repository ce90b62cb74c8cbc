"""What a medium file's first bytes say it is: one table for the daemon (which checks a file before llama.cpp's
decoders see it, since their fallback for unknown bytes starts ffprobe) and the gateway (which refuses a declared
type that names another kind than the bytes)."""

from __future__ import annotations

SIGNATURES = {
    "png": (b"\x89PNG\r\n\x1a\n",),
    "jpeg": (b"\xff\xd8\xff",),
    "gif": (b"GIF87a", b"GIF89a"),
    "bmp": (b"BM",),
    "webp": (),  # RIFF, as WAV: told apart in file_kind
    "wav": (),
    "mp3": (b"ID3", b"\xff\xfb", b"\xff\xf3", b"\xff\xf2"),
    "flac": (b"fLaC",),
}
IMAGE_KINDS = ("png", "jpeg", "gif", "bmp")  # what llama.cpp decodes (no WebP)
AUDIO_KINDS = ("wav", "mp3", "flac")


def file_kind(data: bytes) -> str | None:
    """png, jpeg, gif, bmp, webp, wav, mp3 or flac, from the first bytes; None for anything else."""
    if data.startswith(b"RIFF"):
        return {b"WAVE": "wav", b"WEBP": "webp"}.get(data[8:12])
    return next((name for name, marks in SIGNATURES.items() if marks and data.startswith(marks)), None)
