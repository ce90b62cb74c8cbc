"""The KV manager: the one owner of a session's place across the three tiers (hot slots, the shared-memory pool,
the spill directory). It alone moves sessions (through kv/place.py); everything else reads a session's place.

A session's life, as this class sees it (each step is a method here; the sections below follow it):
- open: ``open`` puts it in the table and the pool's (new_session.py: the quotas); ``record_tokens`` commits a
  system prompt.
- turn: ``append`` adds its prompt to the conversation; ``make_resident`` gives it a slot with its KV restored
  (``share_first_prompt`` lets a first prompt start from a shared prefix); each step's computed tokens are
  ``fed`` and each sampled one is ``append``ed; ``make_prefix`` turns a system prompt's cells into a shared
  prefix; ``checkpoint`` commits the turn into the pool (the mirror copies it to other nodes).
- hibernate: ``hibernate`` frees its slot and cells (checkpointing first unless the snapshot is fresh): when a
  slot is needed, when cells are (``free_cells``), when the preloader makes room, or to swap best-effort work out.
- restore: ``make_resident`` again, from the pool straight, or from disk; a damaged snapshot is SESSION_CORRUPT.
- spill and evict: a checkpoint that needs pool room moves older snapshots to disk (the snapshot path behind
  ``Checkpoints``: room.py, compression.py, disk_writes.py); when the disk is full too, the least recently used
  idle session is ``evict``ed.
- roam: ``open`` then ``install`` commits a checkpoint fetched from another node (daemon/remote/); ``drop`` lets it
  go.
- close (or expire, or a damaged state): ``drop`` forgets it in every tier.
The cell layout is kept here too, with the policy deterministic decoding asks for (llama/deterministic_mode.py):
``room_for_step`` before a decode, and every move that frees cells on purpose (``free_cells``, the calibration's
``scratch_slot``), compact the KV when it must. Runs on the engine thread only.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

import msgspec

from kvpool.daemon.config import Config
from kvpool.daemon.kv import place, policy
from kvpool.daemon.kv.checkpoints import Checkpoints
from kvpool.daemon.kv.codec.kv_types import PROFILE, StoreType
from kvpool.daemon.kv.codec.state_format import StateFormatError
from kvpool.daemon.kv.codec.tier_codec import TierCodec
from kvpool.daemon.kv.counters import TierCounters
from kvpool.daemon.kv.new_session import create_session
from kvpool.daemon.kv.pool.layout import NO_PREFIX, TIER_DISK, TIER_POOL, Snapshot
from kvpool.daemon.kv.pool.pool import Pool
from kvpool.daemon.kv.prefix.cache import PrefixCache, PrefixCorrupt
from kvpool.daemon.kv.prefix.index import shareable_length
from kvpool.daemon.kv.sessions import Session, SessionCorrupt, SessionTable
from kvpool.daemon.kv.spill_dir import SnapshotCorrupt, SpillDir, SpillError
from kvpool.daemon.kv.stores import Stores
from kvpool.daemon.llama.model import Model
from kvpool.daemon.refusals import RequestRefused
from kvpool.protocol import ErrorCode
from kvpool.protocol.status import PoolStatus, PrefixStatus, SpillStatus

if TYPE_CHECKING:
    from kvpool.daemon.media.media_cache import MediaPiece

# A compaction's copies: a prefix's sequence and cells; a session's slot, itself, the positions it shares, its own.
PrefixCopy = tuple[int, "ctypes.Array[ctypes.c_uint8]", int]  # its sequence, cells and how many
SessionCopy = tuple[int, Session, int, "ctypes.Array[ctypes.c_uint8] | None"]

log = logging.getLogger("kvpool.kv")


class Mirror(Protocol):
    """A tier that keeps a copy of every committed checkpoint on other nodes (the remote tier, daemon/remote/)."""

    def saved(self, s: Session) -> None:
        """A checkpoint of ``s`` was committed here: copy it."""
        ...

    def forget(self, session: str, delete: bool) -> None:
        """The session left this node (``delete``: and its copy goes too)."""
        ...


def held_slot(refused: RequestRefused) -> RequestRefused:
    """The refusal of a turn that needed the slot of an idle session that could not be saved to give it up: what
    stopped that session's checkpoint is not this turn's doing."""
    return RequestRefused(
        refused.code,
        f"Every hot slot is taken, and the idle session holding one could not be saved to leave it: {refused.message} "
        "Retry once that session is closed or has ended, or give the daemon more hot_slots.",
        refused.detail,
    )


class KvManager:
    def __init__(
        self,
        model: Model,
        pool: Pool,
        spill: SpillDir,
        sessions: SessionTable,
        config: Config,
        mirror: Mirror | None = None,
        profile: StoreType | None = None,
    ):
        """``mirror``: the cross-node tier, told of every commit and every session that leaves (None: none).
        ``profile``: the store type of the model's precision profile, for a tier whose type is "profile"."""
        self.model, self.pool, self.spill, self.sessions, self.config = model, pool, spill, sessions, config
        self.mirror = mirror
        self.free_slots = list(range(model.hot_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self.resident: dict[int, Session] = {}
        self.prefixes = PrefixCache(model, pool, config)
        self.counts = TierCounters()
        self.codec = TierCodec(
            model.kv, config.pool_kv_type, config.pool_kv_policy, config.spill_kv_type, model.mrope, profile
        )
        stores = Stores(pool, spill, sessions, self.codec, self.counts)
        # With a mirror, checkpoints hold every cell, shared prefix included, so that another node can restore them.
        self.checkpoints = Checkpoints(model, stores, self.prefixes, self.evict, whole=mirror is not None)
        self._compacts = model.determinism.compacts

    # ------------------------------------------------------------------ open, and the conversation

    def open(
        self,
        session_id: str,
        token: str,
        task: str,
        tokens: list[int],
        boundary: int,
        n_kv: int = 0,
        media: Sequence[tuple[int, MediaPiece]] = (),
    ) -> Session:
        """A new session (opened here, or fetched from another node with ``n_kv`` of its tokens in the checkpoint
        it brings); UNKNOWN_TASK or QUOTA_EXCEEDED when it may not be (new_session.py). ``media``: where the media
        among ``tokens`` begin (a system prompt with an image), pinned for it."""
        if not media:  # (fetched from another node: a medium it had not computed is lost, see recovery)
            tokens = place.without_lost_media(tokens, n_kv)
        s = create_session(self.pool, self.sessions, session_id, token, task, [], min(boundary, len(tokens)), n_kv)
        place.append(s, tokens, media)
        return s

    def append(self, s: Session, tokens: list[int], media: Sequence[tuple[int, MediaPiece]] = ()) -> None:
        """A turn's prompt, or a sampled token, joins the session's conversation (the next steps compute it);
        ``media``: where the media among ``tokens`` begin, each pinned for the session until its cells are computed."""
        place.append(s, tokens, media)

    def forget_uncomputed(self, s: Session) -> None:
        """The tokens past the session's computed cells go (a medium of its prompt could not be encoded)."""
        place.forget_uncomputed(s)

    def touch(self, s: Session) -> None:
        """Used now: a restarted daemon times the session out from here (the pool's record), not from its start."""
        self.pool.touch(s.entry)

    # ------------------------------------------------------------------ what scheduling reads

    @property
    def free_slot_count(self) -> int:
        return len(self.free_slots)

    def idle_resident(self) -> list[Session]:
        """Hot sessions that may hibernate for a slot, least recently used first."""
        return policy.idle_resident(self.resident.values())

    @property
    def prefix_sharing(self) -> bool:
        return self.prefixes.enabled

    @property
    def context_size(self) -> int:
        return self.model.context_size

    def shared_prefix_length(self, tokens: list[int]) -> int:
        """How many of a first prompt's ``tokens`` a shared prefix would hold (not computed again)."""
        match = self.prefixes.match(tokens, most=len(tokens) - 1)
        return match[1] if match else 0

    def kv_type_name(self, snap: Snapshot) -> str:
        return self.codec.name(snap.kv_type)

    # ------------------------------------------------------------------ hot tier

    def make_resident(self, s: Session) -> bool:
        """Give ``s`` a slot with its KV restored; False when every slot is busy generating."""
        if s.slot is not None:
            return True
        started = time.perf_counter()
        try:
            return self._make_resident(s)
        finally:
            s.restore_seconds += time.perf_counter() - started

    def _make_resident(self, s: Session) -> bool:
        if not self.free_slots:
            victim = policy.first_to_go(policy.idle_resident(self.resident.values()))
            if victim is None:
                return False
            try:
                self.hibernate(victim)
            except RequestRefused as refused:
                raise held_slot(refused) from None
        slot = self.free_slots.pop()
        try:
            # llama.cpp refuses a state it has no free cells for: free cells until it fits (each round takes out
            # another prefix or session, never the prefix this one builds on, so the loop ends).
            while not self._restore(s, slot):
                self.counts.restores_without_room += 1
                if self._free_cells(exclude=[s]):
                    continue
                if any(r.busy for r in self.resident.values()):
                    self.free_slots.append(slot)
                    return False  # the generating sessions hold the cells; try again after a step
                raise SessionCorrupt(s, "llama.cpp rejected its saved state even with an empty KV")
        except BaseException:
            if slot not in self.free_slots:
                self.free_slots.append(slot)
            raise
        place.take_slot(s, slot)
        self.resident[slot] = s
        return True

    # The cell layout. In deterministic decoding (llama/deterministic_mode.py) freed cells go to a graveyard and new
    # ones are appended after the last: the KV is laid out again (compacted) when what comes next would not fit,
    # and after cells were freed on purpose. Otherwise llama.cpp reuses freed cells and these do nothing.

    def room_for_step(self, tokens: int) -> None:
        """Before a decode of ``tokens`` (and the pad row a deterministic step may take, see Model.decode)."""
        self._ensure_room(tokens, pad=True)

    @contextlib.contextmanager
    def scratch_slot(self) -> Iterator[int | None]:
        """A free slot to run synthetic steps in (the cost model's calibration), its cells reclaimed after; None
        when every slot is taken."""
        if not self.free_slots:
            yield None
            return
        try:
            yield self.free_slots[-1]
        finally:
            self.model.forget_sequence(self.free_slots[-1])
            self._reclaim()

    def _reclaim(self) -> None:
        """Cells were freed outside a restore (a calibration's, idle sessions hibernated for room): reuse them."""
        if self._compacts:
            self._compact()

    def _ensure_room(self, cells: int, pad: bool = False) -> None:
        """Compact when the next ``cells`` would not fit after the last appended cell (deterministic decoding)."""
        if self._compacts and self.model.cells_free() < cells + pad:
            self._compact()

    def _compact(self) -> None:
        """Lay the KV out again: every hot sequence's cells contiguous and in position order from the first
        cell, the graveyard emptied. Shared prefixes first, then each resident session's own cells, then the
        prefix cells it shares given back: what a restore does, in one pass, from copies taken first."""
        prefixes, sessions = self._copies()
        self.model.clear()
        self._load(prefixes, sessions)
        self.counts.compactions += 1

    @contextlib.contextmanager
    def alone_first(self, s: Session) -> Iterator[None]:
        """Deterministic decoding, around a step of more rows than its steps otherwise hold (a non-causal medium is
        fed whole): flash attention's path for 64 rows and more sums a row's cells in tiles of 64 counted from the
        KV's first cell, so its sums follow where each cell of the sequence sits, not only their order. For the
        step the KV holds ``s`` alone from the first cell (its shared prefix, then its own cells), as it would with
        nothing else hot, so that the step's cells follow them; the other sequences come back after the step,
        behind its cells, each in position order. Otherwise it does nothing."""
        if not self._compacts:
            yield
            return
        prefixes, sessions = self._copies()
        mine = s.prefix.seq if s.prefix is not None and s.shares_hot else None
        self.model.clear()
        self._load([p for p in prefixes if p[0] == mine], [x for x in sessions if x[1] is s])
        try:
            yield
        finally:
            self._load([p for p in prefixes if p[0] != mine], [x for x in sessions if x[1] is not s])
            self.counts.compactions += 1

    def _copies(self) -> tuple[list[PrefixCopy], list[SessionCopy]]:
        """Every hot shared prefix's cells, and every resident session's own (past what it shares), copied."""
        model = self.model
        prefixes = sorted(
            ((p.seq, model.copy_state(p.seq), len(p.tokens)) for p in self.prefixes.hot()), key=lambda p: p[0]
        )
        sessions = []
        for slot, s in sorted(self.resident.items()):
            shared = s.prefix_len if s.prefix is not None and s.shares_hot else 0
            own = model.copy_state(slot, s.position(shared)) if s.n_kv > shared else None
            sessions.append((slot, s, shared, own))
        return prefixes, sessions

    def _load(self, prefixes: list[PrefixCopy], sessions: list[SessionCopy]) -> None:
        """Copies back, appended in order: the prefixes, then each session's own cells and the prefix cells it
        shares."""
        model = self.model
        for seq, state, cells in prefixes:
            if not model.load_state(seq, state, cells=cells):
                raise RuntimeError(f"llama.cpp refused a shared prefix's cells back while compacting (sequence {seq})")
        for slot, s, shared, own in sessions:
            if own is not None and not model.load_state(slot, own, s.position(shared), s.n_kv - shared):
                raise RuntimeError(f"llama.cpp refused session {s.id}'s cells back while compacting")
            if shared:
                assert s.prefix is not None and s.prefix.seq is not None
                model.share_cells(s.prefix.seq, slot, 0, s.position(shared))

    def cells_used(self) -> int:
        """Cells of the unified KV in use (a shared prefix's cells count once)."""
        return sum(s.n_kv - s.prefix_len * s.shares_hot for s in self.resident.values()) + self.prefixes.hot_cells()

    def hibernate(self, s: Session, preempt: bool = False) -> None:
        """Free the session's slot and cells; its state stays in the pool (or on disk). ``preempt``: the
        session is in the middle of a generation that will resume from exactly this state."""
        assert s.slot is not None and (preempt or not s.busy)
        if not s.checkpoint_fresh:
            self.checkpoint(s)
        self.model.forget_sequence(s.slot)
        del self.resident[s.slot]
        self.free_slots.append(s.slot)
        place.leave_slot(s)
        self.counts.hibernations += 1

    def free_cells(self, exclude: list[Session], count: int = 1) -> bool:
        """Make room in the unified KV (a decode found none): first a shared prefix nobody uses (but none the
        excluded sessions build on), else up to ``count`` idle sessions, least recently used first, and the freed
        cells reclaimed. False when nothing could go."""
        freed = self._free_cells(exclude, count)
        if freed:
            self._reclaim()
        return freed

    def _free_cells(self, exclude: list[Session], count: int = 1) -> bool:
        keep = {id(x.prefix) for x in exclude if x.prefix is not None}
        return self.prefixes.evict_hot(keep) or self._hibernate_idle(exclude=exclude, count=count) > 0

    def _hibernate_idle(self, exclude: Iterable[Session], count: int = 1) -> int:
        """Hibernate up to ``count`` idle resident sessions (LRU first), to free KV cells; how many moved."""
        idle = policy.idle_resident(self.resident.values(), exclude)
        for r in idle[:count]:
            self.hibernate(r)
        return min(count, len(idle))

    def _restore(self, s: Session, slot: int) -> bool:
        """Load the session's snapshot into ``slot``; False when llama.cpp refuses it (e.g. no free cells).
        A snapshot that fails its checksum raises SessionCorrupt."""
        snap = s.snapshot
        if snap is None or snap.n_kv == 0:
            if snap is not None:
                self._check_tokens_only(s)
            self.model.forget_sequence(slot)
            place.hold_cells(s, 0)
            return True
        self._ensure_room(snap.n_kv)  # (its own cells, and a prefix's when that comes back too)
        if snap.prefix_entry == NO_PREFIX:
            ok = self._load_own_cells(s, slot)
        else:
            prefix = s.prefix
            # (sliding-window models share whole prefixes only: a shorter reference cannot have come from here)
            if (
                prefix is None
                or not place.consistent(s, snap)
                or (self.model.n_swa and snap.prefix_len != len(prefix.tokens))
            ):
                raise SessionCorrupt(s, "the shared prefix its snapshot builds on is gone")
            try:
                if not self.prefixes.make_hot(prefix):
                    return False
            except PrefixCorrupt as exc:
                self.counts.checksum_failures += 1
                raise SessionCorrupt(s, str(exc)) from None
            ok = self._load_own_cells(s, slot)
            if ok:
                self.prefixes.share_into(prefix, slot, snap.prefix_len)
                place.rejoin_hot(s)
        # (a record that does not fit its bytes)
        if ok and self.model.highest_position(slot) != s.position(snap.n_kv - 1):
            self.model.forget_sequence(slot)
            raise SessionCorrupt(s, "its restored KV does not end where its snapshot record says")
        if ok:
            place.hold_cells(s, snap.n_kv)
        return ok

    def _check_tokens_only(self, s: Session) -> None:
        """A snapshot of tokens alone (a system prompt before the first turn) is checked like any other."""
        snap = s.snapshot
        assert snap is not None
        if snap.tier == TIER_POOL:
            intact = self.pool.in_bounds(snap) and self.pool.verify(snap)
        else:
            self._spill_payload(s, snap)
            intact = True
        if not intact:
            self.counts.checksum_failures += 1
            raise SessionCorrupt(s, "its saved tokens fail their checksum")

    def _load_own_cells(self, s: Session, slot: int) -> bool:
        snap = s.snapshot
        assert snap is not None
        shared = snap.prefix_len if snap.prefix_entry != NO_PREFIX else 0  # its own cells start past the prefix
        first, cells = s.position(shared), snap.n_kv - shared
        if snap.tier == TIER_POOL:
            started = time.perf_counter()
            # Verify first, on this thread: the pass leaves the snapshot in the CPU cache, so llama.cpp's load
            # then reads it from there. Measured with bench/resume.py, this is faster than verifying on a helper
            # thread while llama.cpp loads (both passes then wait on memory, and the helper first has to wake).
            if not self.pool.verify(snap):
                self.counts.checksum_failures += 1
                raise SessionCorrupt(s, "its pool snapshot fails its checksum")
            if snap.compressed:
                view = self.pool.view(snap.offset, snap.state_bytes)
                try:
                    ok = self.model.load_state(slot, self._decompress(s, view), first, cells)
                finally:
                    view.release()
            else:
                state = self.pool.address(snap.offset, snap.state_bytes)
                try:
                    ok = self.model.load_state(slot, state, first, cells)
                finally:
                    del state  # release the export of the mapping
            self.counts.restores_pool += 1
            self.counts.restore_pool.add(snap.state_bytes, time.perf_counter() - started)
        else:
            payload = self._spill_payload(s, snap)
            if snap.compressed:
                stored = memoryview(payload)[: snap.state_bytes]
                ok = self.model.load_state(slot, self._decompress(s, stored), first, cells)
            else:
                state = (ctypes.c_uint8 * snap.state_bytes).from_buffer_copy(payload, 0)
                ok = self.model.load_state(slot, state, first, cells)
            self.counts.restores_disk += 1
        return ok

    def _spill_payload(self, s: Session, snap: Snapshot) -> bytes:
        """A spilled snapshot's bytes: a damaged or foreign file closes the session (SESSION_CORRUPT); one that
        cannot be read now refuses this request alone, and the session stays for when the directory is mended."""
        try:
            return self.spill.read(s.id, snap.version, snap.checksum)
        except SnapshotCorrupt as exc:
            self.counts.checksum_failures += 1
            raise SessionCorrupt(s, str(exc)) from None
        except SpillError as exc:
            self.counts.spill_failures += 1
            log.warning("session %s: %s", s.id, exc)
            raise RequestRefused(
                ErrorCode.SPILL_UNAVAILABLE,
                f"Session {s.id}'s saved state could not be read ({exc}); the session is kept: retry once the "
                "spill directory is readable again (its path and permissions, the disk).",
            ) from None

    def _decompress(self, s: Session, stored: memoryview) -> ctypes.Array[ctypes.c_uint8]:
        """A compressed snapshot's state at the hot types, for llama.cpp to load."""
        try:
            state = self.codec.to_hot(stored)
        except StateFormatError as exc:
            self.counts.checksum_failures += 1
            raise SessionCorrupt(s, f"its compressed state cannot be read: {exc}") from None
        self.counts.restores_decompressed += 1
        return (ctypes.c_uint8 * len(state)).from_buffer(state)  # a fresh buffer of its own: no copy

    # ------------------------------------------------------------------ shared prefixes

    def share_first_prompt(self, s: Session) -> None:
        """A resident session that computes its first prompt now takes a shared prefix it begins with."""
        if s.n_kv == 0 and s.slot is not None and s.prefix is None and self.prefixes.enabled:
            self._share_prefix(s)

    def _share_prefix(self, s: Session) -> None:
        """A resident session about to compute its first prompt: take the longest shared prefix it begins with
        (its cells, not a copy) and compute only the rest."""
        assert s.slot is not None and s.n_kv == 0 and s.prefix is None
        match = self.prefixes.match(s.tokens, most=len(s.tokens) - 1)  # its last token must give logits
        if match is None:
            return
        prefix, length = match
        try:
            if not self.prefixes.make_hot(prefix):
                return
        except PrefixCorrupt as exc:
            log.warning("%s; computing session %s's prompt in full", exc, s.id)
            return
        length = shareable_length(prefix, length, self.model.n_swa)
        if length < self.prefixes.block:
            return
        self.prefixes.share_into(prefix, s.slot, length)
        self.prefixes.note_hit(prefix, length)
        place.attach(s, prefix, length, hot=True)
        place.hold_cells(s, length)
        if s.boundary <= length:
            place.take_boundary(s)

    def make_prefix(self, s: Session) -> None:
        """The session's KV reached the end of its system prompt: those cells become a shared prefix."""
        end = place.take_boundary(s)
        assert s.slot is not None and s.n_kv >= end
        if place.cut_inside_medium(s, end):  # (a system prompt that ends inside an image: nothing to share)
            return
        prefix = self.prefixes.make(s.slot, s.tokens[:end], s.task)
        if prefix is not None:
            place.move_to(s, prefix, end)

    def fed(self, s: Session, n_tokens: int) -> None:
        """A step computed ``n_tokens`` more of the resident session's tokens into its cells."""
        place.fed(s, n_tokens)

    def trim(self, s: Session) -> None:
        """Cells past the session's computed tokens go: the rows of a guess that were not taken (engine/drafts.py).
        Its place does not change: it holds tokens[:n_kv] before and after."""
        end = s.position(s.n_kv)
        assert not place.cut_inside_medium(s, s.n_kv), "a medium's cells are computed whole"
        if s.slot is not None and self.model.highest_position(s.slot) >= end:
            self.model.forget_from(s.slot, end)

    # ------------------------------------------------------------------ snapshots (checkpoints.py, room.py)

    def checkpoint(self, s: Session) -> None:
        self.checkpoints.checkpoint(s)
        if self.mirror is not None:
            self.mirror.saved(s)

    def record_tokens(self, s: Session) -> None:
        self.checkpoints.record_tokens(s)
        if self.mirror is not None and s.snapshot is not None:
            self.mirror.saved(s)

    def install(
        self, s: Session, payload: memoryview, state_bytes: int, n_kv: int, digest: int, kv_type: int, raw_bytes: int
    ) -> None:
        """Commit a checkpoint fetched from another node as ``s``'s snapshot (see Checkpoints.install)."""
        self.checkpoints.install(s, payload, state_bytes, n_kv, digest, kv_type, raw_bytes)

    def give_up_snapshot(self, s: Session) -> None:
        self.checkpoints.give_up(s)

    def evict(self, s: Session) -> None:
        """Drop a session for room: its owner gets SESSION_EVICTED from now on."""
        log.warning("evicting session %s (task %s): the pool and the spill directory are full", s.id, s.task)
        self.drop(s, evicted=True)
        self.counts.evictions += 1

    # ------------------------------------------------------------------ lifecycle

    def drop(self, s: Session, evicted: bool = False) -> None:
        """Forget a session in every tier (closed, expired, corrupt or evicted)."""
        prefix = s.prefix
        if s.slot is not None:
            self.model.forget_sequence(s.slot)
            del self.resident[s.slot]
            self.free_slots.append(s.slot)
            place.leave_slot(s)
        place.detach(s)
        if prefix is not None:
            self.prefixes.forget_if_damaged(prefix)
        # The table first, then the spill file: a crash in between leaves an orphan file (removed at the next
        # start), never a live entry naming a file that is gone.
        if evicted:
            self.pool.mark_evicted(s.entry)
        else:
            self.pool.release(s.entry)
        if s.snapshot is not None and s.snapshot.tier == TIER_DISK:
            self.spill.remove(s.id, s.snapshot.version)
        self.sessions.remove(s, evicted=evicted)
        if self.mirror is not None:
            self.mirror.forget(s.id, delete=False)

    def sessions_by_tier(self) -> dict[str, int]:
        by_tier: dict[str, int] = {}
        for s in self.sessions.by_id.values():
            by_tier[s.tier] = by_tier.get(s.tier, 0) + 1
        return by_tier

    def _snapshot_figures(self, tier: int) -> dict[str, int]:
        snaps = [snap for s in self.sessions.by_id.values() if (snap := s.snapshot) is not None and snap.tier == tier]
        return {
            "snapshots": len(snaps),
            "compressed_snapshots": sum(1 for x in snaps if x.compressed),
            "snapshot_bytes": sum(x.state_bytes for x in snaps),
            "snapshot_raw_bytes": sum(x.hot_bytes for x in snaps),
        }

    @staticmethod
    def _tier_type(setting: str, stored: StoreType | None) -> str:
        """A tier's type as set, and for "profile" what the profile stores."""
        return f"{setting}: {stored.name}" if setting == PROFILE and stored is not None else setting

    def pool_status(self) -> PoolStatus:
        usage = self.pool.usage()
        return msgspec.structs.replace(
            usage,
            kv_type=self._tier_type(self.config.pool_kv_type, self.codec.pool_type),
            kv_policy=self.config.pool_kv_policy,
            **self._snapshot_figures(TIER_POOL),
        )

    def spill_status(self) -> SpillStatus:
        return SpillStatus(
            dir=str(self.spill.path),
            used_bytes=self.spill.used_bytes,
            max_bytes=self.spill.max_bytes,
            kv_type=self._tier_type(self.config.spill_kv_type, self.codec.spill_type),
            **self._snapshot_figures(TIER_DISK),
        )

    def prefix_status(self) -> PrefixStatus:
        return self.prefixes.status(sum(s.saved_bytes for s in self.sessions.by_id.values() if s.snapshot))
