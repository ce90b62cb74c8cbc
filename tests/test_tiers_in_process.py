"""The tiers' logic in this process (fake model, real pool and spill directory): which session moves where and
when. What llama.cpp computes after a move is checked on real daemons in tests/test_tiers.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvpool.daemon.kv.manager import KvManager
from kvpool.daemon.kv.sessions import SessionCorrupt

from .fake_model import FakeModel
from .kv_in_process import compute, kv_on_fake_model, open_session

SMALL_POOL = (28 + 64) << 10  # a header, a 64-entry table (28 KiB), and the smallest area a pool may have


def fake(kv: KvManager) -> FakeModel:
    assert isinstance(kv.model, FakeModel)
    return kv.model


def test_hibernate_then_restore_brings_back_every_position(tmp_path: Path) -> None:
    with kv_on_fake_model(tmp_path) as kv:
        s = open_session(kv)
        compute(kv, s, 40)
        slot = s.slot
        kv.hibernate(s)
        assert s.slot is None and s.tier == "pool" and fake(kv).positions(slot) == []  # type: ignore[arg-type]
        assert kv.make_resident(s)
        assert s.slot is not None and fake(kv).positions(s.slot) == list(range(40)) and s.n_kv == 40
        assert kv.counts.hibernations == 1 and kv.counts.restores_pool == 1 and kv.counts.checkpoints == 1


def test_a_slot_goes_to_whoever_waits_by_hibernating_the_least_recently_used(tmp_path: Path) -> None:
    with kv_on_fake_model(tmp_path, hot_slots=2) as kv:
        a, b, c = (open_session(kv) for _ in range(3))
        compute(kv, a, 10)
        compute(kv, b, 10)
        compute(kv, a, 5)  # a is now the more recent
        compute(kv, c, 10)
        assert b.tier == "pool" and a.tier == "hot" and c.tier == "hot"
        compute(kv, b, 1)  # back in: the least recently used of a and c (a) gives way
        assert a.tier == "pool" and b.tier == "hot" and b.n_kv == 11


def test_busy_sessions_never_give_way(tmp_path: Path) -> None:
    with kv_on_fake_model(tmp_path, hot_slots=1) as kv:
        a, b = open_session(kv), open_session(kv)
        compute(kv, a, 10)
        a.busy = True
        assert not kv.make_resident(b) and a.tier == "hot"
        a.busy = False
        assert kv.make_resident(b) and a.tier == "pool"


def test_a_full_pool_spills_the_least_recently_used_snapshot_and_restores_it_from_disk(tmp_path: Path) -> None:
    # each 200-cell snapshot is about 14 KB: the smallest area (64 KiB) holds four
    with kv_on_fake_model(tmp_path, hot_slots=1, pool_bytes=SMALL_POOL) as kv:
        sessions = [open_session(kv) for _ in range(6)]
        for s in sessions:
            compute(kv, s, 200)
        assert kv.counts.spills > 0 and sessions[0].tier == "disk" and sessions[-1].tier == "hot"
        compute(kv, sessions[0], 1)
        assert kv.counts.restores_disk == 1
        assert fake(kv).positions(sessions[0].slot) == list(range(201))  # type: ignore[arg-type]


def test_both_tiers_full_evicts_the_least_recently_used_idle_session(tmp_path: Path) -> None:
    with kv_on_fake_model(tmp_path, hot_slots=1, pool_bytes=SMALL_POOL, spill_bytes=32 << 10) as kv:
        sessions = [open_session(kv) for _ in range(8)]
        for s in sessions:
            compute(kv, s, 200)
        first = sessions[0]
        assert kv.counts.evictions > 0 and first.id in kv.sessions.evicted
        assert first.id not in kv.sessions.by_id and sessions[-1].id in kv.sessions.by_id


def test_a_damaged_pool_snapshot_is_refused_as_corrupt(tmp_path: Path) -> None:
    with kv_on_fake_model(tmp_path) as kv:
        s = open_session(kv)
        compute(kv, s, 40)
        kv.hibernate(s)
        assert s.snapshot is not None
        kv.pool.address(s.snapshot.offset, s.snapshot.state_bytes)[100] ^= 0xFF
        with pytest.raises(SessionCorrupt, match="checksum"):
            kv.make_resident(s)
        assert kv.counts.checksum_failures == 1 and fake(kv).loads == 0  # never loaded


def test_a_pool_snapshot_with_two_words_swapped_is_refused_as_corrupt(tmp_path: Path) -> None:
    """Two 8-byte words trade places inside one 32 KiB block: every byte is still there, in the wrong place. A sum
    of words, however weighted by block, cannot see that; the checksum must."""
    with kv_on_fake_model(tmp_path) as kv:
        s = open_session(kv)
        compute(kv, s, 40)
        kv.hibernate(s)
        assert s.snapshot is not None and s.snapshot.state_bytes > 1024
        words = np.frombuffer(kv.pool.view(s.snapshot.offset, 1024), dtype="<u8")
        first, second = 8, 100  # within the cells' K and V rows: two different words
        assert words[first] != words[second]
        words[[first, second]] = words[[second, first]]
        del words  # a view into the mapping
        with pytest.raises(SessionCorrupt, match="checksum"):
            kv.make_resident(s)
        assert kv.counts.checksum_failures == 1 and fake(kv).loads == 0  # never loaded
