"""The cold tier: snapshots evicted from the pool, one file each in a size-capped spill directory.

A file is written atomically (temporary name, fsync, rename, fsync of the directory) and carries its own
header and checksum, verified on every read. The header also names the model and the hot KV layout the state
was saved under (the pool's fingerprint and kv_layout): a file of another layout is refused, never loaded.
File names hold the session id and the snapshot version, so
the pool's session table says which file is current; files it does not reference are leftovers of a crash
and are removed at start.
"""

from __future__ import annotations

import logging
import os
import struct
from pathlib import Path

import numpy as np

from kvpool.daemon.kv.pool.checksum import checksum
from kvpool.daemon.kv.pool.layout import HOT_TYPES, TOKEN_BYTES, payload_bytes

MAGIC = b"KVSPILL3"  # 3: the checksum is XXH3
# magic, version, state_bytes, n_tokens, n_kv, checksum, kv_type (HOT_TYPES or the StoreType.id it was compressed
# to), model fingerprint, KV layout
HEADER = struct.Struct("<8sQQIIQi32s64s")
SUFFIX = ".snap"
log = logging.getLogger("kvpool.kv")


class SpillError(Exception):
    """The spill directory cannot be used (at start), or a file in it cannot be read now (an I/O error, not a
    damaged file: the snapshot may read again once the directory is mended); the message says what failed."""


class SnapshotCorrupt(Exception):
    """A snapshot's bytes do not match its checksum (or its file is missing or truncated)."""


class SpillDir:
    def __init__(self, path: Path, max_bytes: int, fingerprint: str = "", kv_layout: str = ""):
        self.path = path
        self.max_bytes = max_bytes
        self.fingerprint, self.kv_layout = fingerprint, kv_layout
        try:
            path.mkdir(parents=True, exist_ok=True, mode=0o700)
            probe = path / ".write-test"
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as exc:
            raise SpillError(
                f"Spill directory {path} is not writable ({exc.strerror}); fix its permissions or set spill_dir."
            ) from None
        self._sizes: dict[str, int] = {p.name: p.stat().st_size for p in path.glob(f"*{SUFFIX}")}
        for tmp in path.glob("*.tmp"):  # a write interrupted by a crash
            tmp.unlink(missing_ok=True)

    @staticmethod
    def name(session: str, version: int) -> str:
        return f"{session}.{version}{SUFFIX}"

    @property
    def used_bytes(self) -> int:
        return sum(self._sizes.values())

    def fits(self, payload_bytes: int) -> bool:
        return self.used_bytes + HEADER.size + payload_bytes <= self.max_bytes

    def could_fit(self, payload_bytes: int) -> bool:
        """Whether the snapshot would fit an empty spill directory."""
        return HEADER.size + payload_bytes <= self.max_bytes

    def write(
        self,
        session: str,
        version: int,
        payload: memoryview,
        state_bytes: int,
        n_tokens: int,
        n_kv: int,
        digest: int,
        kv_type: int = HOT_TYPES,
    ) -> None:
        name = self.name(session, version)
        tmp = self.path / f"{name}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            header = (MAGIC, version, state_bytes, n_tokens, n_kv, digest, kv_type)
            os.write(fd, HEADER.pack(*header, self.fingerprint.encode(), self.kv_layout.encode()))
            view = payload
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
            os.close(fd)
            fd = -1
            os.rename(tmp, self.path / name)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            tmp.unlink(missing_ok=True)  # a failed write (disk full, I/O error) leaves nothing behind
            raise
        dir_fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # the rename itself must survive a power cut
        finally:
            os.close(dir_fd)
        self._sizes[name] = HEADER.size + len(payload)

    def read(self, session: str, version: int, digest: int) -> bytes:
        """The payload (state bytes then int32 tokens), checked against the header's checksum, which must be
        ``digest``, the one the session's record holds: a file of another session or snapshot put in its place
        checks against its own header, and would otherwise be loaded as this session's KV."""
        name = self.name(session, version)
        try:
            data = (self.path / name).read_bytes()
        except FileNotFoundError:
            raise SnapshotCorrupt(f"spill file {name} is missing") from None
        except OSError as exc:
            raise SpillError(f"spill file {self.path / name} cannot be read: {exc.strerror}") from None
        if len(data) < HEADER.size:
            raise SnapshotCorrupt(f"spill file {name} is truncated")
        magic, file_version, state_bytes, n_tokens, _n_kv, stored, _kv_type, fingerprint, layout = HEADER.unpack_from(
            data
        )
        payload = data[HEADER.size :]
        if magic != MAGIC or file_version != version:
            raise SnapshotCorrupt(f"spill file {name} has a damaged header")
        if len(payload) != payload_bytes(state_bytes, n_tokens):
            raise SnapshotCorrupt(f"spill file {name} is truncated")
        self._check_identity(name, fingerprint, layout)
        if stored != digest:
            raise SnapshotCorrupt(f"spill file {name} holds another snapshot than the one its session's record names")
        if checksum(payload) != digest:
            raise SnapshotCorrupt(f"spill file {name} fails its checksum")
        return payload

    def read_tokens(self, session: str, version: int, digest: int) -> list[int]:
        """Only the token history of a spilled snapshot (at start, to rebuild the session table cheaply), from a
        file whose header holds ``digest`` (see read)."""
        name = self.name(session, version)
        try:
            with (self.path / name).open("rb") as f:
                fields = HEADER.unpack(f.read(HEADER.size))
                state_bytes, n_tokens = fields[2], fields[3]
                f.seek(HEADER.size + state_bytes)
                data = f.read(TOKEN_BYTES * n_tokens)
        except FileNotFoundError:
            raise SnapshotCorrupt(f"spill file {name} is missing") from None
        except struct.error:
            raise SnapshotCorrupt(f"spill file {name} is truncated") from None
        except OSError as exc:
            raise SpillError(f"spill file {self.path / name} cannot be read: {exc.strerror}") from None
        if fields[0] != MAGIC or fields[1] != version:
            raise SnapshotCorrupt(f"spill file {name} has a damaged header")
        if fields[5] != digest:
            raise SnapshotCorrupt(f"spill file {name} holds another snapshot than the one its session's record names")
        if len(data) != TOKEN_BYTES * n_tokens:
            raise SnapshotCorrupt(f"spill file {name} is truncated")
        return np.frombuffer(data, dtype="<i4").tolist()

    def _check_identity(self, name: str, fingerprint: bytes, layout: bytes) -> None:
        theirs_model = fingerprint.rstrip(b"\0").decode(errors="replace")  # (a damaged header's bytes too)
        theirs_layout = layout.rstrip(b"\0").decode(errors="replace")
        if self.fingerprint and theirs_model != self.fingerprint:
            raise SnapshotCorrupt(f"spill file {name} holds a state of another model ({theirs_model})")
        if self.kv_layout and theirs_layout != self.kv_layout:
            raise SnapshotCorrupt(
                f"spill file {name} was saved with KV layout {theirs_layout!r} and this daemon runs {self.kv_layout!r}"
            )

    def remove(self, session: str, version: int) -> None:
        """Remove a file no record names any more; a directory that fails leaves it for the next start to remove
        (what called this has committed already: its session must not pay for the directory)."""
        name = self.name(session, version)
        try:
            (self.path / name).unlink(missing_ok=True)
        except OSError as exc:
            log.warning("spill file %s could not be removed (%s); the next start removes it", name, exc.strerror)
        self._sizes.pop(name, None)

    def keep_only(self, live: set[str]) -> int:
        """Delete files no session references (left by a crash between write and commit); return how many."""
        stale = [name for name in self._sizes if name not in live]
        for name in stale:
            (self.path / name).unlink(missing_ok=True)
            del self._sizes[name]
        return len(stale)
