"""Frame areas: shared memory through which a local task hands the daemon its camera frames and audio, so that a
frame crosses no socket. The daemon creates one POSIX segment per connection that asks (FrameArea), mode 0600, or
0660 in the client group (set with fchmod, whatever the daemon's umask), like its socket; the task maps it, writes
a frame once and names its place (offset, length) in a Medium. A connection reads only its own area: another's
name is refused. The daemon reads with pread on the segment's descriptor, not through a mapping, so a task that
shrinks its segment gets a refusal, never the daemon a SIGBUS. An area goes when its connection is gone, when the
most areas are given and another connection asks (the least recently used goes), and every area when the daemon
stops; a start removes the areas a killed daemon left. Engine thread only.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

import posix_ipc

from kvpool.daemon.refusals import RequestRefused
from kvpool.protocol import ErrorCode

PREFIX = "/kvpool-frames-"
SHM_DIR = Path("/dev/shm")


@dataclass
class Area:
    name: str
    size: int
    fd: int
    used: float = field(default_factory=time.monotonic)


class FrameAreas:
    def __init__(self, max_bytes: int, max_areas: int, gid: int | None):
        """``max_bytes``: the largest area a connection may have; ``max_areas``: how many at once (a daemon's
        connections are bounded by its sessions and clients); ``gid``: the client group (None: owner only)."""
        self.max_bytes, self.max_areas, self.gid = max_bytes, max_areas, gid
        self._tag = secrets.token_hex(4)  # a daemon's areas never meet another's, nor an earlier start's
        self._count = 0
        self._by_client: dict[bytes, Area] = {}
        self._reclaimed: dict[str, None] = {}  # names of areas taken back for another connection (the newest)
        self.left_behind = remove_left_behind()

    def area_for(self, client: bytes, size: int) -> Area:
        """The connection's area (created now, or the one it has when that is as large)."""
        area = self._by_client.get(client)
        if area is not None and area.size >= size and os.fstat(area.fd).st_size >= area.size:
            area.used = time.monotonic()
            return area
        if size > self.max_bytes:
            raise RequestRefused(
                ErrorCode.BAD_REQUEST,
                f"A frame area of {size} bytes is larger than this daemon gives (max_media_bytes={self.max_bytes}); "
                "ask for a smaller one.",
            )
        if area is not None:
            self.release(client)
        if len(self._by_client) >= self.max_areas:  # the one least recently used goes (its task asks again)
            oldest = min(self._by_client, key=lambda c: self._by_client[c].used)
            self._reclaimed[self._by_client[oldest].name] = None
            if len(self._reclaimed) > self.max_areas:
                del self._reclaimed[next(iter(self._reclaimed))]
            self.release(oldest)
        self._count += 1
        name = f"{PREFIX}{os.getpid()}-{self._tag}-{self._count}"
        mode = 0o660 if self.gid is not None else 0o600
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=mode, size=size)
        try:
            os.fchmod(shm.fd, mode)  # (shm_open applied the umask: systemd's UMask=0077 would leave it 0600)
            if self.gid is not None:
                os.fchown(shm.fd, -1, self.gid)
        except BaseException:
            shm.close_fd()
            shm.unlink()
            raise
        area = Area(name, size, shm.fd)
        self._by_client[client] = area
        return area

    def read(self, client: bytes, name: str, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset`` of the connection's own area."""
        area = self._by_client.get(client)
        if area is None and name in self._reclaimed:
            raise RequestRefused(
                ErrorCode.BAD_REQUEST,
                f"Frame area {name!r} was taken back for another connection before this request was read (more than "
                f"{self.max_areas} connections asked for one, and this one's was the least recently used); nothing "
                "was applied: send it again through a new area (the client libraries resend a generate once).",
                {"frame_area": name},
            )
        if area is None or area.name != name:
            raise RequestRefused(
                ErrorCode.BAD_REQUEST,
                f"Frame area {name!r} is not this connection's (a connection reads its own area only, and an area "
                "goes when its connection does); ask for one with FrameArea, or send the medium as `data`.",
                {"frame_area": name},
            )
        area.used = time.monotonic()
        if length <= 0:
            raise RequestRefused(ErrorCode.BAD_REQUEST, "A medium of no bytes has nothing to see or hear; send one.")
        if offset + length > area.size:
            raise RequestRefused(
                ErrorCode.BAD_REQUEST,
                f"{length} bytes at offset {offset} do not lie inside frame area {name} ({area.size} bytes).",
            )
        data = os.pread(area.fd, length, offset)
        if len(data) != length:
            self.release(client)  # (damaged: the connection's next FrameArea gets a new one)
            raise RequestRefused(
                ErrorCode.BAD_REQUEST,
                f"Frame area {name} holds fewer than {offset + length} bytes now (was it truncated?); ask for a new "
                "one.",
                {"frame_area": name},
            )
        return data

    def release(self, client: bytes) -> None:
        """The connection is gone: its area too."""
        area = self._by_client.pop(client, None)
        if area is None:
            return
        os.close(area.fd)
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory(area.name)

    def clients(self) -> list[bytes]:
        return list(self._by_client)

    def __len__(self) -> int:
        return len(self._by_client)

    def close(self) -> None:
        for client in list(self._by_client):
            self.release(client)


def remove_left_behind() -> int:
    """Remove the frame areas of daemons that are no longer running (killed before they could): their names carry
    their process id. How many went."""
    removed = 0
    with contextlib.suppress(OSError):
        for entry in SHM_DIR.glob(PREFIX.lstrip("/") + "*"):
            pid = entry.name.removeprefix(PREFIX.lstrip("/")).split("-", 1)[0]
            if pid.isdigit() and not _running(int(pid)):
                with contextlib.suppress(OSError):
                    entry.unlink()
                    removed += 1
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: running
        return True
    return True
