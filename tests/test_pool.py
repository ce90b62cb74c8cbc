"""The pool's pure parts: the extent allocator (property tests) and the segment layout, on real segments (no model,
no daemon)."""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Iterator

import numpy as np
import posix_ipc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.daemon.kv.pool.allocator import Extent, ExtentAllocator
from kvpool.daemon.kv.pool.checksum import checksum
from kvpool.daemon.kv.pool.layout import EVICTED, LAYOUT_VERSION, LIVE, TIER_DISK, TIER_POOL, UNSAVED
from kvpool.daemon.kv.pool.pool import Pool
from kvpool.daemon.kv.pool.segment import PoolError

AREA_START, AREA_SIZE, ALIGN = 4096, 64 * 1024, 64

# ---------------------------------------------------------------- allocator


def check_invariants(allocator: ExtentAllocator, used: list[Extent]) -> None:
    pieces = sorted(used + allocator.holes)
    cursor = AREA_START
    for piece in pieces:  # used and free extents tile the area exactly: no overlap, no lost byte
        assert piece.offset == cursor, f"gap or overlap at {cursor}: {piece}"
        cursor = piece.end
    assert cursor == AREA_START + AREA_SIZE
    holes = allocator.holes
    assert all(a.end < b.offset for a, b in itertools.pairwise(holes)), "adjacent holes not coalesced"


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "evict"]), st.integers(1, 20_000)), max_size=120))
def test_random_alloc_free_evict_never_overlaps_or_loses_bytes(ops: list[tuple[str, int]]) -> None:
    allocator = ExtentAllocator(AREA_START, AREA_SIZE, ALIGN)
    used: list[Extent] = []  # in allocation order: the front is the "least recently used"
    for op, n in ops:
        if op == "alloc":
            extent = allocator.allocate(n)
            if extent is None:
                assert allocator.largest_free < allocator.rounded(n)
            else:
                assert extent.length >= n and extent.offset % ALIGN == 0
                # first fit: no hole below the chosen one was large enough
                assert all(h.length < extent.length for h in allocator.holes if h.end <= extent.offset)
                used.append(extent)
        elif op == "free" and used:
            allocator.free(used.pop(n % len(used)))
        elif op == "evict" and used:  # evict the LRU until the request fits, as the pool does
            while used and allocator.largest_free < allocator.rounded(n):
                allocator.free(used.pop(0))
            extent = allocator.allocate(n)  # n <= the area, so once everything is evicted it must fit
            assert extent is not None
            used.append(extent)
        check_invariants(allocator, used)
        assert allocator.free_bytes + sum(e.length for e in used) == AREA_SIZE
        rebuilt = ExtentAllocator.from_used(AREA_START, AREA_SIZE, used, ALIGN)
        assert rebuilt.holes == allocator.holes  # the free list is derivable from the table alone
    for extent in used:
        allocator.free(extent)
    assert allocator.holes == [Extent(AREA_START, AREA_SIZE)]  # fully coalesced


def test_double_free_and_overlapping_tables_are_refused() -> None:
    allocator = ExtentAllocator(AREA_START, AREA_SIZE, ALIGN)
    extent = allocator.allocate(100)
    assert extent is not None
    allocator.free(extent)
    with pytest.raises(ValueError):
        allocator.free(extent)
    with pytest.raises(ValueError):
        ExtentAllocator.from_used(AREA_START, AREA_SIZE, [Extent(4096, 128), Extent(4160, 64)], ALIGN)


# ---------------------------------------------------------------- segment


@pytest.fixture
def pool_name() -> Iterator[str]:
    name = f"/kvpool-test-{secrets.token_hex(6)}"
    yield name
    Pool.unlink(name)


def open_pool(name: str, fingerprint: str = "a" * 32, layout: str = "type_k=1") -> Pool:
    return Pool.open(name, 1 << 20, 8, fingerprint, layout)


def write_snapshot(pool: Pool, index: int, payload: bytes, tokens: list[int]) -> None:
    extent = pool.allocator.allocate(len(payload) + 4 * len(tokens))
    assert extent is not None
    pool.view(extent.offset, len(payload))[:] = payload
    pool.write_tokens(extent.offset + len(payload), tokens)
    digest = checksum(pool.view(extent.offset, len(payload) + 4 * len(tokens)))
    pool.commit(
        index, TIER_POOL, extent, len(payload), len(tokens), len(tokens) - 1, digest, len(payload) + 4 * len(tokens)
    )


def test_sessions_and_snapshots_survive_reattach(pool_name: str) -> None:
    pool = open_pool(pool_name)
    assert pool.created
    index = pool.claim("0123456789abcdef", "t" * 32, "voice")
    assert index is not None
    write_snapshot(pool, index, b"first state", [1, 2, 3])
    write_snapshot(pool, index, b"second, longer state", [1, 2, 3, 4, 5])
    used = pool.usage().used_bytes
    pool.close()

    again = open_pool(pool_name)
    assert not again.created
    (entry,) = again.entries()
    assert (entry.session, entry.token, entry.task) == ("0123456789abcdef", "t" * 32, "voice")
    snap = entry.snapshot
    assert snap is not None and snap.version == 2 and again.verify(snap)
    assert bytes(again.view(snap.offset, snap.state_bytes)) == b"second, longer state"
    assert again.tokens(snap) == [1, 2, 3, 4, 5]
    assert again.usage().used_bytes == used  # the free list was rebuilt from the table
    again.release(index)
    assert again.usage().used_bytes == 0
    again.close()


def test_uncommitted_write_leaves_the_last_snapshot(pool_name: str) -> None:
    pool = open_pool(pool_name)
    index = pool.claim("s1", "t", "default")
    assert index is not None
    write_snapshot(pool, index, b"committed", [7])
    # A crash between writing a new extent and its commit: the bytes are there, the record is not switched.
    extent = pool.allocator.allocate(64)
    assert extent is not None
    pool.view(extent.offset, 9)[:] = b"half-done"
    pool.close()
    again = open_pool(pool_name)
    snap = again.committed(index)
    assert snap is not None and bytes(again.view(snap.offset, snap.state_bytes)) == b"committed"
    assert again.usage().used_bytes == again.allocator.rounded(9 + 4)  # the orphan extent is free again
    again.close()


def test_flipped_byte_fails_the_checksum(pool_name: str) -> None:
    pool = open_pool(pool_name)
    index = pool.claim("s1", "t", "default")
    assert index is not None
    write_snapshot(pool, index, b"precious state", [1, 2])
    snap = pool.committed(index)
    assert snap is not None and pool.verify(snap)
    pool.view(snap.offset + 3, 1)[0] ^= 0x40
    assert not pool.verify(snap)
    pool.close()


def test_disk_tier_record_and_eviction_tombstone(pool_name: str) -> None:
    pool = open_pool(pool_name)
    index = pool.claim("s1", "t", "default")
    assert index is not None
    write_snapshot(pool, index, b"state", [1])
    snap = pool.commit(index, TIER_DISK, None, 5, 1, 0, 123, 9)
    assert snap.tier == TIER_DISK and snap.version == 2 and pool.usage().used_bytes == 0
    pool.mark_evicted(index)
    (entry,) = pool.entries()
    assert entry.snapshot is None and entry.session == "s1"
    pool.close()


@pytest.mark.parametrize("damage", ["past the area", "over another extent"])
def test_a_damaged_record_costs_only_its_own_session(pool_name: str, damage: str) -> None:
    pool = open_pool(pool_name)
    good, bad = pool.claim("good", "t", "default"), pool.claim("bad", "t", "default")
    assert good is not None and bad is not None
    write_snapshot(pool, good, b"good state", [1, 2])
    write_snapshot(pool, bad, b"bad state", [3, 4])
    good_snap, bad_snap = pool.committed(good), pool.committed(bad)
    assert good_snap is not None and bad_snap is not None
    records = pool.table[bad]["records"]
    newest = int(np.argmax(records["version"]))
    records["offset"][newest] = pool.size + 4096 if damage == "past the area" else good_snap.offset
    del records  # a view into the mapping: it must go before the pool is closed
    used = pool.usage().used_bytes - pool.allocator.rounded(bad_snap.length)
    pool.close()
    again = open_pool(pool_name)  # attaches: the other sessions are not lost with the damaged one
    snaps = {e.session: e.snapshot for e in again.entries()}
    assert again.verify(snaps["good"]) and again.usage().used_bytes == used
    damaged = snaps["bad"]
    assert damaged is not None and not (again.in_bounds(damaged) and again.verify(damaged))
    again.release(bad)  # its bytes were never its own: nothing is freed twice
    assert again.usage().used_bytes == used and again.verify(snaps["good"])
    again.close()


def attach_after_crash_in_mark_evicted(pool_name: str) -> tuple[Pool, int]:
    """A pool whose one session was being evicted when the daemon died: a tombstone that still holds a record."""
    pool = open_pool(pool_name)
    index = pool.claim("s1", "t", "default")
    assert index is not None
    write_snapshot(pool, index, b"state of an evicted session", [1, 2])
    pool.table[index]["state"] = EVICTED  # mark_evicted's first store; the record is not cleared yet
    pool.close()
    return open_pool(pool_name), index


@pytest.mark.parametrize("how", ["settled at attach", "reused by claim"])
def test_a_tombstone_left_by_a_crash_gives_its_extent_back(pool_name: str, how: str) -> None:
    again, index = attach_after_crash_in_mark_evicted(pool_name)
    assert again.usage().used_bytes > 0  # the tombstone's record still counts at attach
    if how == "settled at attach":
        again.settle()  # what recovery does first
        (entry,) = again.entries()
        assert entry.state == EVICTED and entry.snapshot is None and entry.session == "s1"  # still a tombstone
    else:
        for i in range(8):  # fill every free entry, so the next claim reuses the tombstone
            if i != index:
                assert again.claim(f"other{i}", "t", "default") is not None
        assert again.claim("s2", "t", "default") == index
    assert again.usage().used_bytes == 0  # its extent was freed, not leaked
    again.close()


def test_overlapping_records_keep_the_one_whose_checksum_matches(pool_name: str) -> None:
    pool = open_pool(pool_name)
    bad, good = pool.claim("bad", "t", "default"), pool.claim("good", "t", "default")
    assert bad is not None and good is not None
    write_snapshot(pool, bad, b"bad state", [3, 4])  # the lower offset
    write_snapshot(pool, good, b"good state", [1, 2])
    good_snap = pool.committed(good)
    assert good_snap is not None
    records = pool.table[bad]["records"]
    records["offset"][int(np.argmax(records["version"]))] = good_snap.offset - 32  # damaged: runs into good's
    del records
    pool.close()
    again = open_pool(pool_name)
    snaps = {e.session: e.snapshot for e in again.entries()}
    assert again.unowned == {bad} and again.verify(snaps["good"]) and not again.verify(snaps["bad"])
    assert again.usage().used_bytes == again.allocator.rounded(good_snap.length)
    again.close()


def test_a_given_up_checkpoint_comes_back_evicted_unless_saved_again(pool_name: str) -> None:
    pool = open_pool(pool_name)
    gone, saved_again, prompt_only = (pool.claim(f"s{i}", "t", "default") for i in range(3))
    assert gone is not None and saved_again is not None and prompt_only is not None
    for index in (gone, saved_again):
        write_snapshot(pool, index, b"older turn", [1, 2])
        pool.discard(index)  # given up for room: the session's KV is hot, its saved state is gone
    write_snapshot(pool, saved_again, b"newer turn", [1, 2, 3])  # the next checkpoint succeeds
    pool.mark_unsaved(prompt_only)  # a system prompt with no room to be recorded
    states = {e.session: e.state for e in pool.entries()}
    assert states == {"s0": UNSAVED, "s1": LIVE, "s2": UNSAVED}
    pool.close()
    again = open_pool(pool_name)
    again.settle()  # what recovery does first
    states = {e.session: (e.state, e.snapshot is not None) for e in again.entries()}
    assert states == {"s0": (EVICTED, False), "s1": (LIVE, True), "s2": (EVICTED, False)}
    again.close()


@pytest.mark.parametrize(
    ("fingerprint", "layout", "message"),
    [("b" * 32, "type_k=1", "another model"), ("a" * 32, "type_k=8", "KV layout")],
)
def test_mismatched_segment_is_refused(pool_name: str, fingerprint: str, layout: str, message: str) -> None:
    open_pool(pool_name).close()
    with pytest.raises(PoolError, match=message) as err:
        open_pool(pool_name, fingerprint, layout)
    assert "--reset-pool" in str(err.value)
    reset = Pool.open(pool_name, 1 << 20, 8, fingerprint, layout, reset=True)
    assert reset.created
    reset.close()


def test_foreign_segment_is_refused(pool_name: str) -> None:
    shm = posix_ipc.SharedMemory(pool_name, posix_ipc.O_CREX, size=1 << 20)
    shm.close_fd()  # zero-filled: not a kvpool pool
    with pytest.raises(PoolError, match="not a kvpool pool"):
        open_pool(pool_name)


def test_full_dev_shm_is_a_clear_error(pool_name: str) -> None:
    with pytest.raises(PoolError, match="cache_pool_size"):
        Pool.open(pool_name, 1 << 50, 8, "a" * 32, "x")  # a petabyte: posix_fallocate says no
    assert not Pool.unlink(pool_name), "a failed create must not leave a segment behind"


def test_two_words_swapped_inside_a_block_fail_the_checksum(pool_name: str) -> None:
    pool = open_pool(pool_name)
    index = pool.claim("s1", "t", "default")
    assert index is not None
    write_snapshot(pool, index, bytes(range(256)) * 64, [1, 2])  # 16 KiB: one 32 KiB block
    snap = pool.committed(index)
    assert snap is not None and pool.verify(snap)
    view = pool.view(snap.offset, 64)
    view[0:8], view[56:64] = bytes(view[56:64]), bytes(view[0:8])
    view.release()
    assert not pool.verify(snap)
    pool.close()


def test_a_pool_of_the_previous_layout_is_refused_with_the_reset_sentence(pool_name: str) -> None:
    pool = open_pool(pool_name)
    pool.header[0]["layout"] = LAYOUT_VERSION - 1  # as a daemon of the block-sum checksum wrote it
    pool.close()
    with pytest.raises(PoolError, match=f"layout version {LAYOUT_VERSION - 1}") as err:
        open_pool(pool_name)
    assert "--reset-pool" in str(err.value)
