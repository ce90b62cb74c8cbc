"""A projector GGUF (``mmproj``) read before anything is loaded, in pure Python: what it serves (vision, audio) and
what it costs in memory, for the start plan, ``--check-config`` and the memory plan."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvpool.daemon.llama.gguf_meta import GgufError, read_metadata

F32 = 4
AUDIO_POSITIONS = 1500  # a Whisper-style encoder's positions for a 30 s chunk (what llama.cpp's audio projectors take)


class ProjectorError(Exception):
    """The mmproj setting names no projector GGUF kvpool can use; the message says why and what to do."""


@dataclass(frozen=True, slots=True)
class ProjectorPlan:
    path: Path
    vision: bool
    audio: bool
    projector_type: str
    weights: int  # bytes of the file (its tensors, loaded whole)
    compute: int  # the encoder's working memory for one medium (an estimate from its shape)

    def describe(self) -> str:
        served = " and ".join(kind for kind, on in (("images", self.vision), ("audio", self.audio)) if on)
        return f"projector {self.path.name} ({self.projector_type}): {served} served"


def plan_projector(configured: str) -> ProjectorPlan | None:
    """The projector the ``mmproj`` setting names (None: none), or ProjectorError."""
    if not configured:
        return None
    path = Path(configured).expanduser()
    if not path.is_file():
        raise ProjectorError(
            f"mmproj {configured!r} does not exist; give the projector GGUF's path, or leave it empty."
        )
    try:
        meta = read_metadata(path)
    except (GgufError, OSError) as exc:
        raise ProjectorError(
            f"mmproj {configured!r} is not a GGUF file ({exc}); give the projector GGUF's path."
        ) from None
    vision, audio = bool(meta.get("clip.has_vision_encoder")), bool(meta.get("clip.has_audio_encoder"))
    if not (vision or audio):
        raise ProjectorError(
            f"mmproj {path.name} has no vision or audio encoder (clip.has_vision_encoder / clip.has_audio_encoder): "
            "it is not a projector; llama.cpp's convert scripts write one with --mmproj."
        )
    kinds = [
        meta.get(key, "") for key in ("clip.projector_type", "clip.vision.projector_type", "clip.audio.projector_type")
    ]
    compute = 0
    if vision:
        side = int(meta.get("clip.vision.image_size", 0)) // max(1, int(meta.get("clip.vision.patch_size", 1)))
        compute = max(compute, _encoder_bytes(meta, "vision", side * side))
    if audio:
        compute = max(compute, _encoder_bytes(meta, "audio", AUDIO_POSITIONS))
    return ProjectorPlan(path, vision, audio, "+".join(k for k in kinds if k) or "?", path.stat().st_size, compute)


def _encoder_bytes(meta: dict[str, object], prefix: str, positions: int) -> int:
    """A ViT layer's widest activations over ``positions`` (its residual, attention and feed-forward rows, and the
    attention scores), which the encoder's compute buffer holds."""
    embd = int(meta.get(f"clip.{prefix}.embedding_length", 0) or 0)  # type: ignore[call-overload]
    ff = int(meta.get(f"clip.{prefix}.feed_forward_length", 0) or 0)  # type: ignore[call-overload]
    heads = int(meta.get(f"clip.{prefix}.attention.head_count", 1) or 1)  # type: ignore[call-overload]
    return F32 * positions * (6 * embd + 2 * ff) + F32 * heads * positions * positions
