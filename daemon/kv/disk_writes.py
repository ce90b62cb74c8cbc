"""The cold tier's writes: a pool snapshot moved to the spill directory (compressed to spill_kv_type on the way when
that is set), any snapshot written there, and room made there by evicting the least recently used idle spilled
session. Engine thread only."""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable

from kvpool.daemon.kv import place, policy
from kvpool.daemon.kv.compression import compressed_pool_state
from kvpool.daemon.kv.pool.checksum import checksum
from kvpool.daemon.kv.pool.layout import HOT_TYPES, NO_PREFIX, TIER_DISK, TIER_POOL, payload_bytes, with_tokens
from kvpool.daemon.kv.sessions import Session
from kvpool.daemon.kv.stores import Stores
from kvpool.daemon.refusals import RequestRefused
from kvpool.protocol import ErrorCode

log = logging.getLogger("kvpool.kv")
NO_ROOM = (errno.ENOSPC, errno.EDQUOT)  # the directory's disk is full: a write fails for room, like a full pool


class SpillFailed(RequestRefused):
    """A write to the spill directory failed for another reason than room (not a directory, permissions, an I/O
    error, a file size limit): no session is dropped to make room the directory could not take anyway."""


class DiskWrites:
    def __init__(self, stores: Stores, evict: Callable[[Session], None]):
        """``evict(s)``: drop an idle session for room (its owner gets SESSION_EVICTED)."""
        self.pool, self.spill, self.sessions = stores.pool, stores.spill, stores.sessions
        self.codec, self.counts, self.evict = stores.codec, stores.counts, evict

    def spill_out(self, s: Session) -> None:
        """Move a session's pool snapshot to the spill directory (the pool extent is freed by the commit)."""
        snap = s.snapshot
        assert snap is not None and snap.tier == TIER_POOL
        prefix_ref = (snap.prefix_entry, snap.prefix_len)
        to = self.codec.spill_type
        if to is not None and snap.kv_type != to.id and snap.n_kv and self.pool.verify(snap):
            stored = compressed_pool_state(self.pool, self.codec, snap, to)
            if stored is not None and len(stored) < snap.state_bytes:  # (else it is spilled as it is)
                payload = with_tokens(stored, self.pool.tokens(snap))
                self.write_disk(
                    s,
                    memoryview(payload),
                    len(stored),
                    snap.n_tokens,
                    snap.n_kv,
                    None,
                    prefix_ref,
                    to.id,
                    snap.hot_bytes,
                )
                self.counts.spills += 1
                self.counts.compressions += 1
                return
        view = self.pool.view(snap.offset, payload_bytes(snap.state_bytes, snap.n_tokens))
        try:
            self.write_disk(
                s,
                view,
                snap.state_bytes,
                snap.n_tokens,
                snap.n_kv,
                snap.checksum,
                prefix_ref,
                snap.kv_type,
                snap.raw_bytes,
            )
        finally:
            view.release()
        self.counts.spills += 1

    def write_disk(
        self,
        s: Session,
        payload: memoryview,
        state_bytes: int,
        n_tokens: int,
        n_kv: int,
        digest: int | None = None,
        prefix_ref: tuple[int, int] = (NO_PREFIX, 0),
        kv_type: int = HOT_TYPES,
        raw_bytes: int = 0,
    ) -> None:
        """Write ``s``'s snapshot to the spill directory (evicting others for room) and commit it; ``digest``: its
        checksum when already known."""
        self._make_disk_room(len(payload), keep=s)
        digest = checksum(payload) if digest is None else digest
        previous = s.snapshot
        version = (previous.version if previous else 0) + 1
        try:
            self.spill.write(s.id, version, payload, state_bytes, n_tokens, n_kv, digest, kv_type)
        except OSError as exc:
            if exc.errno in NO_ROOM:
                raise RequestRefused(
                    ErrorCode.POOL_FULL,
                    f"The disk of the spill directory {self.spill.path} is full ({exc.strerror}); free space there "
                    "or raise cache_pool_size.",
                ) from None
            self.counts.spill_failures += 1
            log.warning("writing session %s's snapshot to %s failed: %s", s.id, self.spill.path, exc)
            raise SpillFailed(
                ErrorCode.SPILL_UNAVAILABLE,
                f"Writing a snapshot to the spill directory {self.spill.path} failed ({exc.strerror}); no session "
                "was dropped for it: mend the directory (its path, permissions, the disk) or set spill_dir.",
            ) from None
        committed = self.pool.commit(
            s.entry, TIER_DISK, None, state_bytes, n_tokens, n_kv, digest, len(payload), *prefix_ref, kv_type, raw_bytes
        )
        place.commit(s, committed)
        if previous is not None and previous.tier == TIER_DISK:
            self.spill.remove(s.id, previous.version)

    def _make_disk_room(self, nbytes: int, keep: Session) -> None:
        if not self.spill.could_fit(nbytes):  # evicting everything would not help
            raise RequestRefused(
                ErrorCode.POOL_FULL,
                f"A {nbytes}-byte snapshot does not fit the pool ({self.pool.size} bytes) nor the spill directory "
                f"(spill_max_bytes={self.spill.max_bytes}); raise one of them or use shorter contexts.",
            )
        while not self.spill.fits(nbytes):
            victim = policy.first_to_go(policy.idle_on_disk(self.sessions.by_id.values(), keep))
            if victim is None:
                raise RequestRefused(
                    ErrorCode.POOL_FULL,
                    f"The pool ({self.pool.size} bytes) and the spill directory ({self.spill.max_bytes} bytes) "
                    "are full of sessions in use; close sessions or raise cache_pool_size or spill_max_bytes.",
                )
            self.evict(victim)
