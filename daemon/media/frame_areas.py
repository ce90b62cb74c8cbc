"""Frame areas: shared memory through which a local task hands the daemon its camera frames and audio, so that a
frame crosses no socket. The daemon creates one POSIX segment per connection that asks (FrameArea), mode 0600 or
0660 in the client group, like its socket; the task maps it, writes a frame once and names its place (offset,
length) in a Medium. A connection reads only its own area: another's name is refused. An area goes when its
connection does, and every area when the daemon stops. Engine thread only.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
from dataclasses import dataclass

import posix_ipc

from kvpool.daemon.refusals import RequestRefused
from kvpool.protocol import ErrorCode

PREFIX = "/kvpool-frames-"


@dataclass
class Area:
    name: str
    size: int
    mapping: mmap.mmap


class FrameAreas:
    def __init__(self, max_bytes: int, max_areas: int, gid: int | None):
        """``max_bytes``: the largest area a connection may have; ``max_areas``: how many at once (a daemon's
        connections are bounded by its sessions and clients); ``gid``: the client group (None: owner only)."""
        self.max_bytes, self.max_areas, self.gid = max_bytes, max_areas, gid
        self._tag = secrets.token_hex(4)  # a daemon's areas never meet another's, nor an earlier start's
        self._count = 0
        self._by_client: dict[bytes, Area] = {}

    def area_for(self, client: bytes, size: int) -> Area:
        """The connection's area (created now, or the one it has when that is as large)."""
        area = self._by_client.get(client)
        if area is not None and area.size >= size:
            return area
        if size > self.max_bytes:
            raise RequestRefused(
                ErrorCode.BAD_REQUEST,
                f"A frame area of {size} bytes is larger than this daemon gives (max_media_bytes={self.max_bytes}); "
                "ask for a smaller one.",
            )
        if area is not None:
            self.release(client)
        if len(self._by_client) >= self.max_areas:
            raise RequestRefused(
                ErrorCode.OVERLOADED,
                f"The daemon has given {self.max_areas} frame areas already; send media as `data`, or retry once "
                "other tasks have disconnected.",
            )
        self._count += 1
        name = f"{PREFIX}{os.getpid()}-{self._tag}-{self._count}"
        mode = 0o660 if self.gid is not None else 0o600
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=mode, size=size)
        try:
            if self.gid is not None:
                os.fchown(shm.fd, -1, self.gid)
            mapping = mmap.mmap(shm.fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        except BaseException:
            shm.unlink()
            raise
        finally:
            shm.close_fd()
        area = Area(name, size, mapping)
        self._by_client[client] = area
        return area

    def read(self, client: bytes, name: str, offset: int, length: int) -> memoryview:
        """``length`` bytes at ``offset`` of the connection's own area (a view: copy what must outlive the
        request's handling)."""
        area = self._by_client.get(client)
        if area is None or area.name != name:
            raise RequestRefused(
                ErrorCode.BAD_REQUEST,
                f"Frame area {name!r} is not this connection's (a connection reads its own area only, and an area "
                "goes when its connection does); ask for one with FrameArea.",
            )
        if length <= 0 or offset + length > area.size:
            raise RequestRefused(
                ErrorCode.BAD_REQUEST,
                f"{length} bytes at offset {offset} do not lie inside frame area {name} ({area.size} bytes).",
            )
        return memoryview(area.mapping)[offset : offset + length]

    def release(self, client: bytes) -> None:
        """The connection is gone: its area too."""
        area = self._by_client.pop(client, None)
        if area is None:
            return
        with contextlib.suppress(BufferError):  # a view still exported (a request being handled): it goes with it
            area.mapping.close()
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory(area.name)

    def clients(self) -> list[bytes]:
        return list(self._by_client)

    def __len__(self) -> int:
        return len(self._by_client)

    def close(self) -> None:
        for client in list(self._by_client):
            self.release(client)
