"""Images and audio in a turn: the parts a prompt may hold besides text, and the frame area through which a local
client hands their bytes to the daemon without sending them over the socket.

A turn is a list of parts: ``str``, ``Image`` and ``Audio``. A frame (a numpy array) or a file's bytes is written
once into the connection's frame area, shared memory the daemon created for it (protocol.FrameArea), and the
request names its place there; its region is free again once the daemon answered the request (it has read the
bytes by then). Over tcp://, or when the daemon gives no area, the bytes travel in the message.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpool import protocol as p

from .errors import BadRequest

AREA_BYTES = 16 << 20  # the frame area a client asks for (a few camera frames in flight)


@dataclass(frozen=True)
class Image:
    """An image: an RGB or RGBA frame (a uint8 numpy array, height x width x 3 or 4), or a file's bytes (JPEG, PNG,
    BMP, GIF)."""

    source: Any


@dataclass(frozen=True)
class Audio:
    """Audio: mono PCM (a float32 numpy array at the projector's sample rate, kvpool status says it), or a file's
    bytes (WAV, MP3, FLAC)."""

    source: Any


Part = str | list[int] | Image | Audio  # (token ids: a piece already tokenized, e.g. a rendered chat template's)


def is_parts(prompt: object) -> bool:
    """Whether ``prompt`` is a list of parts (not token ids): it holds an Image or an Audio."""
    return isinstance(prompt, list | tuple) and any(isinstance(x, Image | Audio) for x in prompt)


def medium_bytes(part: Image | Audio) -> tuple[dict[str, Any], bytes | memoryview]:
    """The Medium's fields but its bytes, and its bytes."""
    source = part.source
    kind = "image" if isinstance(part, Image) else "audio"
    if isinstance(source, bytes | bytearray | memoryview):
        if not len(source):
            raise BadRequest(f"An {type(part).__name__} of no bytes: give the file's bytes or a numpy array.")
        return {"kind": kind, "format": "encoded"}, memoryview(source)
    if not isinstance(source, np.ndarray):
        raise BadRequest(f"An {type(part).__name__}'s source is a numpy array or a file's bytes, not {type(source)}.")
    if kind == "image":
        if source.dtype != np.uint8 or source.ndim != 3 or source.shape[2] not in (3, 4):
            raise BadRequest(
                f"An Image frame is a uint8 array of height x width x 3 (RGB) or 4 (RGBA), not {source.dtype} "
                f"{source.shape}."
            )
        height, width, channels = source.shape
        if not height or not width:
            raise BadRequest(
                f"An Image frame of {width}x{height} pixels has nothing to see; send a frame of at least 1x1."
            )
        fields = {"kind": kind, "format": "rgb" if channels == 3 else "rgba", "width": width, "height": height}
        return fields, memoryview(np.ascontiguousarray(source)).cast("B")
    if source.dtype != np.float32 or source.ndim != 1:
        raise BadRequest(f"Audio PCM is a one-dimensional float32 array (mono), not {source.dtype} {source.shape}.")
    if not source.size:
        raise BadRequest("Audio PCM of no samples has nothing to hear; send at least one sample.")
    return {"kind": kind, "format": "pcm_f32"}, memoryview(np.ascontiguousarray(source)).cast("B")


class FrameArea:
    """The connection's frame area, mapped; regions are taken per request and given back when it is answered."""

    def __init__(self, name: str, size: int, connection: int = 0):
        """``connection``: the connection it was given on (the daemon frees it when that one goes)."""
        import posix_ipc  # (a daemon dependency too: it maps its pool the same way)

        shm = posix_ipc.SharedMemory(name)
        try:
            self.mapping = mmap.mmap(shm.fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            shm.close_fd()
        self.name, self.size, self.connection = name, size, connection
        self._held: dict[int, list[tuple[int, int]]] = {}  # request id -> its (offset, length) regions
        self._placed: dict[int, list[tuple[int, int]]] = {}  # a request being built (its Placing's id) -> regions

    def placing(self) -> Placing:
        """Regions for one request, from its first medium until it is sent (``hold``) or given up (``abandon``)."""
        return Placing(self)

    def _put(self, placing: Placing, data: bytes | memoryview) -> int | None:
        n = len(data)
        taken = sorted(r for regions in (*self._held.values(), *self._placed.values()) for r in regions)
        at = 0
        for offset, length in taken:
            if offset - at >= n:
                break
            at = max(at, offset + length)
        if at + n > self.size:
            return None
        self.mapping[at : at + n] = data
        self._placed.setdefault(id(placing), []).append((at, n))
        return at

    def hold(self, placing: Placing, request_id: int) -> None:
        """The request was sent: its regions are its until it is answered."""
        regions = self._placed.pop(id(placing), None)
        if regions:
            self._held[request_id] = regions

    def abandon(self, placing: Placing) -> None:
        """The request was not sent: its regions are free."""
        self._placed.pop(id(placing), None)

    def answered(self, request_id: int) -> None:
        """The daemon answered ``request_id``: it read its media, their regions are free."""
        self._held.pop(request_id, None)

    @property
    def busy(self) -> bool:
        return bool(self._held or self._placed)

    def close(self) -> None:
        self._held.clear()
        self._placed.clear()
        self.mapping.close()


@dataclass(eq=False)
class Placing:
    """The regions one request's media take while it is built."""

    area: FrameArea

    def put(self, data: bytes | memoryview) -> int | None:
        """Write ``data`` into a free region; its offset, or None when no region is free (wait for answers)."""
        return self.area._put(self, data)


def wire_parts(parts: list[Part], placing: Placing | None, max_inline: int) -> list[str | list[int] | p.Medium] | None:
    """The parts as the protocol carries them: each medium's bytes in the frame area ``placing`` takes regions of
    (None: in the message, up to ``max_inline`` bytes in all). None when a medium found no free region in the area
    (answers must come first; the caller abandons the placing)."""
    area = placing.area if placing is not None else None
    out: list[str | list[int] | p.Medium] = []
    inline = 0
    for i, part in enumerate(parts):
        if isinstance(part, str | list):
            out.append(part)
            continue
        if not isinstance(part, Image | Audio):
            raise BadRequest(f"parts[{i}] is a str, token ids, an Image or an Audio, not {type(part).__name__}.")
        fields, data = medium_bytes(part)
        if placing is not None and area is not None and len(data) <= area.size:
            offset = placing.put(data)
            if offset is None:
                return None
            out.append(p.Medium(**fields, area=area.name, offset=offset, length=len(data)))
            continue
        inline += len(data)
        if inline > max_inline:
            raise BadRequest(
                f"The prompt's media are {inline} bytes, more than a message to the daemon may carry ({max_inline}); "
                "send smaller frames (or connect over ipc://, where frames go through shared memory)."
            )
        out.append(p.Medium(**fields, data=bytes(data)))
    return out
