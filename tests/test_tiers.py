"""The KV tiers against real daemons: hibernation, restarts, crashes, spill, eviction, corruption."""

from __future__ import annotations

import mmap
import signal
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import posix_ipc
import pytest

from kvpool import protocol as p
from kvpool.client import Client
from kvpool.client.errors import NotOwner, PoolFull, QuotaExceeded, SessionCorrupt, SessionEvicted
from kvpool.daemon.kv.pool.layout import ENTRY, HEADER

from .daemon_process import DaemonProcess, run_until_exit
from .raw import RawConnection
from .tinymodel import build_tiny_model

Start = Callable[..., DaemonProcess]
GREEDY = {"temperature": 0.0}


def prompt_of(i: int, turn: int) -> str:
    return f"session {i} turn {turn}: " + "abcdefghij"[i % 10] * (3 + i % 5)


def run_turns(client: Client, sessions: dict[int, object], turns: range, max_tokens: int = 6) -> dict:
    """Round-robin: turn t of every session, then turn t+1: every turn needs a different resident set."""
    out: dict[int, list[list[int]]] = {i: [] for i in sessions}
    for turn in turns:
        for i, s in sessions.items():
            out[i].append(s.complete(prompt_of(i, turn), max_tokens=max_tokens, **GREEDY).tokens)
    return out


def reference(start_daemon: Start, n: int, turns: range, name: str = "ref", **kw: object) -> dict:
    """The same turns with a slot for every session (nothing is ever hibernated)."""
    daemon = start_daemon("--hot-slots", str(n), "--context-size", "8192", name=name)
    with daemon.client() as client:
        sessions = {i: client.open_session() for i in range(n)}
        result = run_turns(client, sessions, turns, **kw)
        assert client.status().moves.hibernations == 0
    daemon.stop()
    return result


def test_32_sessions_on_2_slots_are_exact(start_daemon: Start) -> None:
    daemon = start_daemon("--hot-slots", "2", "--context-size", "1024", "--max-sessions", "40")
    with daemon.client() as client:
        sessions = {i: client.open_session() for i in range(32)}
        result = run_turns(client, sessions, range(3))
        status = client.status()
        assert status.moves.hibernations >= 32 * 3 - 2
        assert status.moves.restores_pool >= 32 * 2 - 2
        assert status.sessions_by_tier == {"hot": 2, "pool": 30}
        listed = {s.session: s for s in client.sessions()}
        assert all(info.snapshot_bytes > 0 for info in listed.values())
    assert result == reference(start_daemon, 32, range(3))


def resume_all(client: Client, ids: dict[int, tuple[str, str]]) -> dict[int, object]:
    return {i: client.resume_session(sid, token) for i, (sid, token) in ids.items()}


def test_sigkill_mid_generation_loses_no_completed_turn(start_daemon: Start) -> None:
    daemon = start_daemon("--hot-slots", "2", "--context-size", "8192", "--max-sessions", "8")
    with daemon.client() as client:
        sessions = {i: client.open_session() for i in range(4)}
        ids = {i: (s.id, s.token) for i, s in sessions.items()}
        run_turns(client, sessions, range(2))
    raw = RawConnection(daemon.address)
    sid, token = ids[0]
    raw.send(p.Generate(id=7, session=sid, token=token, prompt="interrupted turn", max_tokens=4000, **GREEDY))
    assert isinstance(raw.recv(), p.Chunk)  # the generation is running
    daemon.stop(signal.SIGKILL)
    raw.close()

    daemon.start()  # the same pool, the same address
    with daemon.client() as client:
        assert client.status().sessions.open == 4
        after = run_turns(client, resume_all(client, ids), range(2, 3))
    expected = reference(start_daemon, 4, range(3))
    assert {i: turns for i, turns in after.items()} == {i: [t[2]] for i, t in expected.items()}


def test_clean_restart_keeps_resident_sessions(start_daemon: Start) -> None:
    # on_evict: nothing is checkpointed after a turn, so only the SIGTERM checkpoint can save the hot ones.
    daemon = start_daemon("--hot-slots", "4", "--context-size", "4096", "--checkpoint", "on_evict")
    with daemon.client() as client:
        sessions = {i: client.open_session() for i in range(3)}
        ids = {i: (s.id, s.token) for i, s in sessions.items()}
        run_turns(client, sessions, range(2))
        assert client.status().sessions_by_tier == {"hot": 3}
        assert daemon.stop() == 0
        daemon.start()
        # The same client and session objects go on: ZeroMQ reconnects to the restarted daemon by itself.
        assert client.status().sessions_by_tier == {"pool": 3}
        after = run_turns(client, sessions, range(2, 3))
    with daemon.client() as other_process:
        assert resume_all(other_process, ids)[0].id == ids[0][0]
    expected = reference(start_daemon, 3, range(3))
    assert after == {i: [t[2]] for i, t in expected.items()}


LONG = "x" * 700  # ~700 tokens of byte-fallback text: a ~180 KB snapshot on the tiny model


def test_pool_full_spills_to_disk_and_restores_exactly(start_daemon: Start) -> None:
    daemon = start_daemon(
        "--hot-slots", "1", "--context-size", "2048", "--cache-pool-size", "1MiB", "--spill-max-bytes", "64MiB"
    )
    with daemon.client() as client:
        sessions = {i: client.open_session() for i in range(8)}
        first = {i: s.complete(LONG + prompt_of(i, 0), max_tokens=4, **GREEDY).tokens for i, s in sessions.items()}
        status = client.status()
        assert status.moves.spills > 0 and status.sessions_by_tier.get("disk", 0) > 0
        assert status.spill.used_bytes > 0
        second = {i: s.complete(prompt_of(i, 1), max_tokens=6, **GREEDY).tokens for i, s in sessions.items()}
        assert client.status().moves.restores_disk > 0
    ref = start_daemon("--hot-slots", "8", "--context-size", "8192", name="ref")
    with ref.client() as client:
        for i in range(8):
            s = client.open_session()
            assert s.complete(LONG + prompt_of(i, 0), max_tokens=4, **GREEDY).tokens == first[i]
            assert s.complete(prompt_of(i, 1), max_tokens=6, **GREEDY).tokens == second[i]


def test_both_tiers_full_evicts_to_the_right_client_only(start_daemon: Start) -> None:
    daemon = start_daemon(
        "--hot-slots", "1", "--context-size", "2048", "--cache-pool-size", "1MiB", "--spill-max-bytes", "600KiB"
    )
    with daemon.client() as owner:
        sessions = [owner.open_session() for _ in range(10)]
        for s in sessions:
            s.complete(LONG, max_tokens=2, **GREEDY)
        status = owner.status()
        assert status.moves.evictions > 0 and status.sessions.evicted > 0
        evicted = [s for s in sessions if s.id not in {i.session for i in owner.sessions()}]
        assert evicted and sessions[-1] not in evicted  # the least recently used go first
        victim = evicted[0]
        with daemon.client() as stranger, pytest.raises(NotOwner):
            stranger.resume_session(victim.id, "0" * 32)
        with pytest.raises(SessionEvicted, match="evicted"):
            victim.complete("more", max_tokens=2)
        survivor = sessions[-1]
        assert survivor.complete("more", max_tokens=2, **GREEDY).usage.completion_tokens == 2


def pool_snapshot_offset(pool_name: str, session_id: str) -> tuple[int, int]:
    """Find a session's committed snapshot in the segment (as the daemon's table says)."""
    shm = posix_ipc.SharedMemory(pool_name)
    with mmap.mmap(shm.fd, shm.size) as m:
        shm.close_fd()
        header = np.frombuffer(m, dtype=HEADER, count=1)[0]
        table = np.frombuffer(m, dtype=ENTRY, count=int(header["entries"]), offset=int(header["table_offset"]))
        (row,) = [e for e in table if e["session"].decode() == session_id]
        records = row["records"]
        r = records[int(np.argmax(records["version"]))]
        result = int(r["offset"]), int(r["state_bytes"])
        del header, table, row, records, r
    return result


def flip_pool_byte(pool_name: str, offset: int) -> None:
    shm = posix_ipc.SharedMemory(pool_name)
    with mmap.mmap(shm.fd, shm.size) as m:
        m[offset] ^= 0xFF
    shm.close_fd()


def test_corrupted_snapshots_are_reported_for_that_session_only(start_daemon: Start) -> None:
    daemon = start_daemon(
        "--hot-slots", "1", "--context-size", "2048", "--cache-pool-size", "1MiB", "--spill-max-bytes", "64MiB"
    )
    with daemon.client() as client:
        victim, other = client.open_session(), client.open_session()
        victim.complete("victim's turn", max_tokens=4, **GREEDY)
        other.complete("other's turn", max_tokens=4, **GREEDY)  # hibernates the victim into the pool
        offset, state_bytes = pool_snapshot_offset(daemon.pool_name, victim.id)
        flip_pool_byte(daemon.pool_name, offset + state_bytes // 2)
        with pytest.raises(SessionCorrupt, match="checksum"):
            victim.complete("again", max_tokens=2)
        assert other.complete("still fine", max_tokens=3, **GREEDY).usage.completion_tokens == 3
        assert client.status().moves.checksum_failures == 1

        # The same for a snapshot on disk: fill the pool so that sessions spill, then damage one file.
        spilled = [client.open_session() for _ in range(6)]
        for s in spilled:
            s.complete(LONG, max_tokens=2, **GREEDY)
        spilled_ids = {s.id for s in spilled}
        on_disk = [i.session for i in client.sessions() if i.tier == "disk" and i.session in spilled_ids]
        assert on_disk
        (path,) = daemon.spill_dir.glob(f"{on_disk[0]}.*.snap")
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(data)
        damaged = next(s for s in spilled if s.id == on_disk[0])
        with pytest.raises(SessionCorrupt):
            damaged.complete("again", max_tokens=2)
        healthy = next(s for s in spilled if s.id != on_disk[0])
        assert healthy.complete("fine", max_tokens=2, **GREEDY).usage.completion_tokens == 2


def test_pool_of_another_model_is_refused(start_daemon: Start, short_tmp: Path) -> None:
    daemon = start_daemon()
    with daemon.client() as client:
        client.open_session().complete("keep me", max_tokens=2)
    assert daemon.stop() == 0
    other_model = build_tiny_model(short_tmp / "other.gguf", seed=1)
    cmd = [arg if arg != str(daemon.model) else str(other_model) for arg in daemon.command()]
    refused = run_until_exit(cmd)
    assert refused.returncode == 1 and "another model" in refused.stderr and "--reset-pool" in refused.stderr
    daemon.model = other_model
    daemon.args.append("--reset-pool")
    daemon.start()
    with daemon.client() as client:
        assert client.status().sessions.open == 0
    assert "discarded pool segment" in daemon.log() and "with the 1 sessions it held" in daemon.log()


def test_sessions_expire_in_every_tier(start_daemon: Start) -> None:
    daemon = start_daemon("--hot-slots", "1", "--session-timeout", "1")
    with daemon.client() as client:
        a, b = client.open_session(), client.open_session()
        a.complete("a", max_tokens=2)
        b.complete("b", max_tokens=2)  # a is now in the pool, b is hot
        assert client.status().sessions_by_tier == {"pool": 1, "hot": 1}
        end = time.monotonic() + 30
        while client.status().sessions.open and time.monotonic() < end:
            time.sleep(0.2)  # polling a bounded wait for the daemon's 1 s timeout
        status = client.status()
        assert status.sessions.open == 0 and status.pool.used_bytes == 0


def test_a_session_read_within_its_timeout_is_not_idle(start_daemon: Start) -> None:
    """session_timeout counts from a session's last request: a client that reads its history (a transcript view)
    or cancels keeps it (only turns and resumes counted, and a polled session expired under its reader)."""
    daemon = start_daemon("--session-timeout", "1.5")
    with daemon.client() as client:
        s = client.open_session()
        s.complete("a", max_tokens=2, **GREEDY)
        end = time.monotonic() + 4.0  # past twice the timeout, the quantity under test
        while time.monotonic() < end:
            assert s.history()  # (UNKNOWN_SESSION once expired)
            s.cancel()
            time.sleep(0.3)
        deadline = time.monotonic() + 30
        while client.status().sessions.open and time.monotonic() < deadline:
            time.sleep(0.2)  # left alone now, it expires (a bounded wait for the daemon's housekeeping)
        assert client.status().sessions.open == 0


def test_idle_time_counts_from_the_last_turn_across_restarts(start_daemon: Start) -> None:
    # session_timeout must measure idleness from a session's last turn, also after a crash: a session opened long
    # ago but used a moment before the restart must not be taken for an idle one.
    daemon = start_daemon("--hot-slots", "1", "--session-timeout", "600")
    with daemon.client() as client:
        s = client.open_session()
        time.sleep(2.0)  # the session's age before its turn: the quantity under test, not a synchronisation
        s.complete("a", max_tokens=2, **GREEDY)
    daemon.stop(signal.SIGKILL)
    daemon.start()
    with daemon.client() as client:
        info = next(i for i in client.sessions() if i.session == s.id)
    assert info.age_s - info.idle_s >= 1.5, info


def test_a_turn_that_could_not_be_saved_is_never_rolled_back_by_a_crash(start_daemon: Start) -> None:
    # A 1 MiB pool and a 1 MiB spill cap: a ~5,000-token snapshot (~1.3 MB on the tiny model) fits neither, so the
    # checkpoint after that turn fails. The session goes on while the daemon runs; after a crash its owner must
    # get SESSION_EVICTED, not the older context of its first turn answering as if the long turn never happened.
    args = ("--hot-slots", "2", "--context-size", "8192", "--cache-pool-size", "1MiB", "--spill-max-bytes", "1MiB")
    daemon = start_daemon(*args)
    with daemon.client() as client:
        big, small = client.open_session(), client.open_session()
        big.complete("first turn", max_tokens=2, **GREEDY)  # checkpointed: a small snapshot in the pool
        small.complete("kept", max_tokens=3, **GREEDY)
        small_history = small.history()
        long_turn = big.complete("x" * 5000, max_tokens=2, **GREEDY)  # its checkpoint fails
        assert long_turn.usage.context_tokens > 5000
        assert big.complete(" and on", max_tokens=2, **GREEDY).usage.context_tokens > 5000  # still usable
        saved = {i.session: i.saved for i in client.sessions()}
        assert saved == {big.id: False, small.id: True}  # `kvpool sessions` shows which one a crash would cost
        ids = {"big": (big.id, big.token), "small": (small.id, small.token)}
    daemon.stop(signal.SIGKILL)
    daemon.start()
    with daemon.client() as client:
        with pytest.raises(SessionEvicted):
            client.resume_session(*ids["big"])
        assert client.resume_session(*ids["small"]).history() == small_history  # the others are untouched


def test_a_snapshot_that_cannot_fit_beside_its_predecessor_spills_nobody_else(start_daemon: Start) -> None:
    # A 1 MiB pool: a session's ~600 KB snapshot grows to ~700 KB. Until the new one is committed the old one
    # stays, so the new one can never fit the pool, however many other snapshots are spilled: it goes to disk
    # at once, and the small snapshots of the other sessions stay where they are.
    args = ("--hot-slots", "3", "--context-size", "8192", "--cache-pool-size", "1MiB", "--spill-max-bytes", "64MiB")
    daemon = start_daemon(*args)
    with daemon.client() as client:
        big, b, c = client.open_session(), client.open_session(), client.open_session()
        big.complete("x" * 2350, max_tokens=2, **GREEDY)
        for s in (b, c):
            s.complete("small", max_tokens=2, **GREEDY)
        before = client.status()
        assert before.spill.used_bytes == 0
        big.complete("y" * 400, max_tokens=2, **GREEDY)
        after = client.status()
        assert after.moves.checkpoints == before.moves.checkpoints + 1
        assert after.spill.used_bytes > 600_000  # the big snapshot went to disk
        assert after.moves.spills == before.moves.spills == 0  # nobody else was moved for it
        small = {i.session: i for i in client.sessions() if i.session in (b.id, c.id)}
        assert all(i.snapshot_bytes > 0 for i in small.values()) and len(small) == 2


def test_a_turn_refused_for_another_sessions_unsaveable_state_says_so(start_daemon: Start) -> None:
    """One slot, held by an idle session too large to save anywhere: another session's turn is refused, and the
    sentence says whose state could not move (it read as if this turn's own snapshot did not fit)."""
    daemon = start_daemon(
        "--hot-slots", "1", "--context-size", "8192", "--cache-pool-size", "1MiB", "--spill-max-bytes", "0"
    )
    with daemon.client() as client:
        large, small = client.open_session(), client.open_session()
        large.complete("x" * 5000, max_tokens=2, **GREEDY)
        with pytest.raises(PoolFull, match="the idle session holding one could not be saved to leave it") as refused:
            small.complete("hello", max_tokens=2, **GREEDY)
        assert "more hot_slots" in refused.value.message
        assert large.complete(" more", max_tokens=2, **GREEDY).usage.completion_tokens == 2  # (it stays hot)


def test_pool_quota_of_a_task(start_daemon: Start) -> None:
    config = """
[tasks.default]
[tasks.voice]
pool_quota = "100KiB"
"""
    daemon = start_daemon("--hot-slots", "2", config=config)
    with daemon.client() as client:
        s = client.open_session("voice")
        s.complete(LONG, max_tokens=2)  # its checkpoint alone is larger than the quota
        with pytest.raises(QuotaExceeded, match="pool_quota"):
            s.complete("more", max_tokens=2)
        other = client.open_session()  # other tasks are not affected
        assert other.complete(LONG, max_tokens=2).usage.completion_tokens == 2
        # The task's refusals column counts its quota's refusals (it counted only queue and budget refusals).
        assert client.status().tasks["voice"].refusals == {"QUOTA_EXCEEDED": 1}


def test_restore_into_a_full_kv_hibernates_instead_of_failing(start_daemon: Start) -> None:
    # 256 cells for 2 slots: two 150-token sessions never fit together, so every restore needs room first.
    daemon = start_daemon("--hot-slots", "2", "--context-size", "256")
    text = "y" * 140
    with daemon.client() as client:
        b, a = client.open_session(), client.open_session()
        first_b = b.complete(text, max_tokens=4, **GREEDY).tokens
        a.complete(text + "a", max_tokens=4, **GREEDY)  # no cells left: b is hibernated
        second_b = b.complete("!", max_tokens=4, **GREEDY).tokens  # a free slot, but no free cells
        status = client.status()
        assert status.moves.checksum_failures == 0 and status.moves.restores_pool >= 1
        assert status.moves.restores_without_room >= 1
    ref = start_daemon("--hot-slots", "1", "--context-size", "512", name="ref")
    with ref.client() as client:
        s = client.open_session()
        assert s.complete(text, max_tokens=4, **GREEDY).tokens == first_b
        assert s.complete("!", max_tokens=4, **GREEDY).tokens == second_b


def test_with_spilling_disabled_a_full_pool_evicts_the_oldest_idle_session(start_daemon: Start) -> None:
    daemon = start_daemon(
        "--hot-slots", "1", "--context-size", "2048", "--cache-pool-size", "1MiB", "--spill-max-bytes", "0"
    )
    with daemon.client() as client:
        sessions = [client.open_session() for _ in range(8)]
        for s in sessions:
            assert s.complete(LONG, max_tokens=2, **GREEDY).usage.completion_tokens == 2
        assert client.status().moves.evictions > 0
        with pytest.raises(SessionEvicted):
            sessions[0].complete("more", max_tokens=2)
        assert sessions[-1].complete("more", max_tokens=2, **GREEDY).usage.completion_tokens == 2


def test_a_pool_is_never_shared_and_must_match_the_config(start_daemon: Start) -> None:
    first = start_daemon()
    second = DaemonProcess(first.workdir.parent / "second", first.model)
    second.pool_name = first.pool_name  # same pool, other address
    second.workdir.mkdir()
    refused = run_until_exit(second.command())
    assert refused.returncode == 1 and "in use by another running kvpoold" in refused.stderr
    assert first.stop() == 0
    resized = run_until_exit([*first.command(), "--cache-pool-size", "32MiB"])
    assert resized.returncode == 1 and "cache_pool_size" in resized.stderr and "--reset-pool" in resized.stderr


def test_a_hot_session_never_waits_for_its_own_slot(start_daemon: Start) -> None:
    """One slot, held by idle session A. B (not hot) and then A ask at once: A must not queue behind B, which
    waits for the slot A holds (this deadlocked both)."""
    daemon = start_daemon("--hot-slots", "1", "--scheduling", "fcfs")
    raw = RawConnection(daemon.address)
    try:
        a, b = raw.open(), raw.open()
        raw.send(p.Generate(id=2, session=a.session, token=a.token, prompt="first", max_tokens=3, temperature=0.0))
        raw.until_final(2)  # A is now hot and idle
        raw.send(p.Generate(id=3, session=b.session, token=b.token, prompt="bee", max_tokens=3, temperature=0.0))
        raw.send(p.Generate(id=4, session=a.session, token=a.token, prompt="again", max_tokens=3, temperature=0.0))
        finals = {raw.until_final(i)[1].usage.completion_tokens for i in (3, 4)}  # bounded by the socket timeout
        assert finals == {3}
    finally:
        raw.close()
