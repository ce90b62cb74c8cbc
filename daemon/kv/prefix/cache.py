"""Shared prefixes in the hot and warm tiers: their llama.cpp sequences and their pool snapshots.

A prefix is made from the cells of the session that computed it first: when that session's KV reaches the end
of its system prompt, the cells are shared into a prefix sequence with llama_memory_seq_cp (no copy, no
compute). Later sessions that begin with the same tokens get the cells the same way and compute only what
follows. The prefix's state is saved once to the pool, so sessions can hibernate only their own cells past it
and a restarted daemon still shares it.

Sliding-window models (Gemma 3) stay exact because a prefix sequence is never extended: it keeps the cells
of every position it was made with, up to the window before its end, and a session takes L positions only
when the window before L is all there (see prefixes.shareable_length). A prefix restored from its snapshot
holds only the window's cells for the sliding layers, so it is then shared at (nearly) its full length only.
Runs on the engine thread only.
"""

from __future__ import annotations

import logging
import secrets
import time

import msgspec

from kvpool.daemon.config import Config
from kvpool.daemon.kv import policy
from kvpool.daemon.kv.pool.allocator import Extent
from kvpool.daemon.kv.pool.layout import LIVE, PREFIX, TIER_POOL, EntryInfo, payload_bytes
from kvpool.daemon.kv.pool.pool import Pool
from kvpool.daemon.kv.prefix.index import Prefix, PrefixIndex, shareable_length
from kvpool.daemon.llama.model import Model
from kvpool.protocol.status import PrefixCounts, PrefixInfo, PrefixStatus

log = logging.getLogger("kvpool.prefixes")


class PrefixCorrupt(Exception):
    """A prefix's pool snapshot fails its checksum."""


class PrefixCache:
    def __init__(self, model: Model, pool: Pool, config: Config):
        self.model, self.pool = model, pool
        self.enabled = bool(model.prefix_seqs)
        self.max_prefixes = config.max_prefixes if self.enabled else 0
        self.block = config.prefix_block_tokens
        self.index = PrefixIndex(self.block)
        self.by_id: dict[str, Prefix] = {}
        self.free_seqs = list(reversed(model.prefix_seqs))
        self.counts = PrefixCounts()

    # ------------------------------------------------------------------ lookup and sharing

    def match(self, tokens: list[int], most: int) -> tuple[Prefix, int] | None:
        """The prefix ``tokens`` begin with and how many of its positions can be shared (at most ``most``)."""
        if not self.enabled:
            return None
        found = self.index.longest_match(tokens)
        if found is None:
            return None
        prefix, length = found
        # (a cut inside an image whose cells share a position keeps none of it: kv/positions.py)
        length = prefix.positions.floor(min(length, most, len(prefix.tokens)))
        if self.model.n_swa and length < len(prefix.tokens):
            # A sliding-window layer may reuse a cell of a prefix nobody shares once the cell is a window behind
            # the prefix's end; the prefix then holds the window before its end, not before any earlier cut.
            return None
        if prefix.seq is not None:
            length = shareable_length(prefix, length, self.model.n_swa)
        return (prefix, length) if length >= self.block else None

    def make_hot(self, prefix: Prefix) -> bool:
        """Put the prefix in the unified KV (from its pool snapshot); False when no sequence or cells are free."""
        if prefix.seq is not None:
            prefix.last_used = time.monotonic()
            return True
        snap = prefix.snapshot
        if snap is None:
            return False
        if not self.pool.verify(snap):
            self._discard_snapshot(prefix)
            raise PrefixCorrupt(f"the snapshot of shared prefix {prefix.id} fails its checksum")
        seq = self._free_seq()
        if seq is None:
            return False
        state = self.pool.address(snap.offset, snap.state_bytes)
        try:
            ok = self.model.load_state(seq, state, cells=len(prefix.tokens))
        finally:
            del state
        if not ok:
            self.free_seqs.append(seq)
            return False
        prefix.seq = seq
        prefix.lowest_position = self.model.lowest_position(seq)
        prefix.last_used = time.monotonic()
        self.counts.restores += 1
        return True

    def forget_if_damaged(self, prefix: Prefix) -> None:
        if prefix.damaged and not prefix.in_use and prefix.id in self.by_id:
            self._forget(prefix)

    def _discard_snapshot(self, prefix: Prefix) -> None:
        """A damaged prefix: out of the index (so the next session with its system prompt makes a new one) and,
        once no session's snapshot needs it, out of the pool. Sessions built on it report SESSION_CORRUPT."""
        prefix.damaged = True
        self.index.remove(prefix, self.by_id.values())
        if not prefix.in_use:
            self._forget(prefix)

    def share_into(self, prefix: Prefix, slot: int, length: int) -> None:
        """Give the session in ``slot`` the prefix's first ``length`` cells (prefix_links counts it)."""
        assert prefix.seq is not None
        self.model.share_cells(prefix.seq, slot, 0, prefix.positions.at(length))
        prefix.last_used = time.monotonic()

    def note_hit(self, prefix: Prefix, length: int) -> None:
        prefix.hits += 1
        self.counts.hits += 1
        self.counts.tokens_saved += length

    # ------------------------------------------------------------------ making prefixes

    def make(self, slot: int, tokens: list[int], task: str) -> Prefix | None:
        """Turn the first len(tokens) cells of the session in ``slot`` into a shared prefix (None when one with
        these tokens exists, or no room for another)."""
        if not self.enabled or len(tokens) < self.block:
            return None
        found = self.index.longest_match(tokens)
        if found is not None and found[1] == len(tokens) == len(found[0].tokens):
            return None
        if len(self.by_id) >= self.max_prefixes and not self._forget_one_unused():
            return None
        seq = self._free_seq()
        if seq is None:
            return None
        self.model.forget_sequence(seq)
        prefix = Prefix(id=secrets.token_hex(8), task=task, tokens=list(tokens), seq=seq)
        self.model.share_cells(slot, seq, 0, prefix.positions.at(len(tokens)))
        prefix.lowest_position = self.model.lowest_position(seq)
        if shareable_length(prefix, len(tokens), self.model.n_swa) == 0:
            self.model.forget_sequence(seq)  # the window before its end is gone already: nothing exact to share
            self.free_seqs.append(seq)
            return None
        self.by_id[prefix.id] = prefix
        self.index.add(prefix)
        self._save(prefix)
        self.counts.made += 1
        log.info("shared prefix %s made from %d tokens of task %s", prefix.id, len(tokens), task)
        return prefix

    def _save(self, prefix: Prefix) -> None:
        """Write the prefix's whole state to the pool once (it never changes). Without room it stays hot only,
        and sessions on it take whole snapshots."""
        assert prefix.seq is not None
        state_bytes = self.model.state_size(prefix.seq)
        extent = self.allocate(payload_bytes(state_bytes, len(prefix.tokens)), keep=prefix)
        if extent is None:
            log.info("no pool room for the snapshot of prefix %s; it is shared while hot only", prefix.id)
            return
        entry = self.pool.claim(prefix.id, "", prefix.task, kind=PREFIX)
        if entry is None:
            self.pool.allocator.free(extent)
            return
        state = self.pool.address(extent.offset, state_bytes)
        try:
            written = self.model.save_state(prefix.seq, state)
        finally:
            del state
        if written != state_bytes:
            self.pool.allocator.free(extent)
            self.pool.release(entry)
            return
        prefix.snapshot = self.pool.commit_written(entry, extent, state_bytes, prefix.tokens, len(prefix.tokens))
        prefix.entry = entry

    # ------------------------------------------------------------------ eviction

    def _free_seq(self) -> int | None:
        if not self.free_seqs and not self.evict_hot():
            return None
        return self.free_seqs.pop()

    def evict_hot(self, keep: set[int] | None = None) -> bool:
        """Take the least recently used prefix that no resident session shares out of the unified KV (its pool
        snapshot stays; one without a snapshot and without users is forgotten). ``keep``: ids of prefixes that
        must stay (a restore in progress builds on them). False when none can go."""
        keep = keep or set()
        prefix = policy.first_to_go(policy.hot_prefixes_nobody_shares(self.by_id.values(), keep))
        if prefix is None:
            return False
        assert prefix.seq is not None
        self.model.forget_sequence(prefix.seq)
        self.free_seqs.append(prefix.seq)
        prefix.seq = None
        self.counts.hot_evictions += 1
        if prefix.snapshot is None:
            self._forget(prefix)
        return True

    def allocate(self, nbytes: int, keep: Prefix | None = None) -> Extent | None:
        """A free pool extent of ``nbytes``, dropping the snapshots of prefixes nobody uses (never ``keep``, least
        recently used first) until one fits; None when that is not enough."""
        extent = self.pool.allocator.allocate(nbytes)
        while extent is None and self.drop_unused_snapshot(keep=keep):
            extent = self.pool.allocator.allocate(nbytes)
        return extent

    def drop_unused_snapshot(self, keep: Prefix | None = None) -> bool:
        """Free pool room by forgetting the least recently used prefix no session uses (before any session
        snapshot is spilled). False when every prefix with a snapshot is in use."""
        return self._forget_one_unused(keep, with_snapshot=True)

    def _forget_one_unused(self, keep: Prefix | None = None, with_snapshot: bool = False) -> bool:
        for prefix in policy.prefix_eviction_order(self.by_id.values()):
            if prefix is not keep and (prefix.snapshot is not None or not with_snapshot):
                self._forget(prefix)
                return True
        return False

    def _forget(self, prefix: Prefix) -> None:
        assert not prefix.in_use
        if prefix.seq is not None:
            self.model.forget_sequence(prefix.seq)
            self.free_seqs.append(prefix.seq)
            prefix.seq = None
        if prefix.entry is not None:
            self.pool.release(prefix.entry)
            prefix.entry, prefix.snapshot = None, None
        self.by_id.pop(prefix.id, None)
        self.index.remove(prefix, self.by_id.values())
        self.counts.dropped += 1

    # ------------------------------------------------------------------ restart

    def recover(self, entries: list[EntryInfo]) -> dict[int, Prefix]:
        """Rebuild the prefixes from their pool entries (cold until a session needs them); by entry index."""
        by_entry: dict[int, Prefix] = {}
        for e in entries:
            if e.kind != PREFIX or e.state != LIVE:
                continue
            snap = e.snapshot
            if snap is None or snap.tier != TIER_POOL or not self.pool.intact(e.index, snap) or not self.enabled:
                self.pool.release(e.index)  # never committed, damaged, or sharing is off now
                continue
            prefix = Prefix(id=e.session, task=e.task, tokens=self.pool.tokens(snap), entry=e.index, snapshot=snap)
            self.by_id[prefix.id] = prefix
            self.index.add(prefix)
            by_entry[e.index] = prefix
        return by_entry

    def forget_unused_after_recovery(self) -> None:
        """Beyond max_prefixes (the config changed), forget unused prefixes."""
        while len(self.by_id) > self.max_prefixes and self._forget_one_unused():
            pass

    # ------------------------------------------------------------------ figures

    def hot(self) -> list[Prefix]:
        """The prefixes in the unified KV."""
        return [x for x in self.by_id.values() if x.seq is not None]

    def hot_cells(self) -> int:
        return sum(len(x.tokens) for x in self.hot())

    def status(self, pool_bytes_saved: int) -> PrefixStatus:
        """``pool_bytes_saved``: snapshot bytes sessions did not store again because they build on a prefix."""
        prefixes = list(self.by_id.values())
        return PrefixStatus(
            **msgspec.structs.asdict(self.counts),
            enabled=self.enabled,
            count=len(prefixes),
            hot=sum(1 for x in prefixes if x.seq is not None),
            max=self.max_prefixes,
            block_tokens=self.block,
            pool_bytes=sum(x.snapshot.length for x in prefixes if x.snapshot is not None),
            users=sum(x.users for x in prefixes),
            hot_users=sum(x.hot_users for x in prefixes),
            shared_cells=sum(len(x.tokens) * max(0, x.hot_users) for x in prefixes if x.seq is not None),
            each=[
                PrefixInfo(
                    id=x.id,
                    task=x.task,
                    tokens=len(x.tokens),
                    hot=x.seq is not None,
                    pool_bytes=x.snapshot.length if x.snapshot is not None else 0,
                    users=x.users,
                    hot_users=x.hot_users,
                    hits=x.hits,
                )
                for x in sorted(prefixes, key=lambda x: -x.last_used)
            ],
            pool_bytes_saved=pool_bytes_saved,
        )
