"""A spill directory that fails under a running daemon: files swapped, unreadable or unwritable, damaged while the
daemon is down. Each costs the sessions on it only what it must, says so, and never hands one session another's
KV or a history it does not have."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from kvpool.client import Client, Session
from kvpool.client.errors import SessionCorrupt, SpillUnavailable

from .daemon_process import DaemonProcess

Start = Callable[..., DaemonProcess]
GREEDY = {"temperature": 0.0}
LONG = "x" * 700  # a ~180 KB snapshot on the tiny model: eight of them overflow a 1 MiB pool onto disk
SPILLING = ("--context-size", "2048", "--cache-pool-size", "1MiB", "--spill-max-bytes", "64MiB")


def spilled_sessions(client: Client, count: int = 8) -> tuple[list[Session], list[Session]]:
    """``count`` sessions with a long turn each: those whose snapshot went to disk, and the others."""
    sessions = [client.open_session() for _ in range(count)]
    for i, s in enumerate(sessions):  # (each its own text: two alike would hold the same KV, and swap harmlessly)
        s.complete(f"{i} {LONG}", max_tokens=2, **GREEDY)
    on_disk = {i.session for i in client.sessions() if i.tier == "disk"}
    assert on_disk, "the pool should have overflowed onto disk"
    return [s for s in sessions if s.id in on_disk], [s for s in sessions if s.id not in on_disk]


@contextmanager
def spill_dir_replaced_by_a_file(daemon: DaemonProcess) -> Iterator[None]:
    """The spill directory gone and a file in its place (a failed mount, an operator's slip): every read and
    write there fails with ENOTDIR, not for room."""
    moved = daemon.spill_dir.with_name("moved-away")
    os.rename(daemon.spill_dir, moved)
    daemon.spill_dir.write_text("not a directory")
    try:
        yield
    finally:
        daemon.spill_dir.unlink()
        os.rename(moved, daemon.spill_dir)


def swap_files(daemon: DaemonProcess, a: Session, b: Session) -> None:
    """Put each session's spill file under the other's name (each file is whole and passes its own checksum)."""
    (fa,) = daemon.spill_dir.glob(f"{a.id}.*.snap")
    (fb,) = daemon.spill_dir.glob(f"{b.id}.*.snap")
    versions = fa.name[len(a.id) :], fb.name[len(b.id) :]
    held = fa.with_name("held")
    os.rename(fa, held)
    os.rename(fb, fa.with_name(a.id + versions[1]))
    os.rename(held, fb.with_name(b.id + versions[0]))


def test_a_spill_file_in_another_sessions_place_is_refused_never_loaded(start_daemon: Start) -> None:
    daemon = start_daemon("--hot-slots", "1", *SPILLING)
    with daemon.client() as client:
        on_disk, _ = spilled_sessions(client)
        a, b = on_disk[:2]
        b_history = b.history()
        swap_files(daemon, a, b)
        with pytest.raises(SessionCorrupt, match="another snapshot than the one its session's record names"):
            a.complete(" and?", max_tokens=4, **GREEDY)
        saved = (b.id, b.token)
    # The same after a restart: B's file is A's, and B is closed rather than shown A's conversation.
    daemon.stop()
    daemon.start()
    with daemon.client() as client:
        with pytest.raises(SessionCorrupt, match="found damaged when the daemon started") as refused:
            client.resume_session(*saved)
        assert "another snapshot" in str(refused.value)
        assert saved[0] not in {i.session for i in client.sessions()}
        assert client.status().moves.checksum_failures == 1  # (this daemon's count: B's, at start)
        fresh = client.open_session()
        assert fresh.complete("still serving", max_tokens=3, **GREEDY).usage.completion_tokens == 3
    assert b_history  # (B had a history; what it held is gone with its file, never shown under another's name)


def test_a_spill_file_damaged_while_the_daemon_was_down_gives_no_placeholder_history(start_daemon: Start) -> None:
    daemon = start_daemon("--hot-slots", "1", *SPILLING)
    with daemon.client() as client:
        on_disk, _ = spilled_sessions(client)
        assert len(on_disk) >= 2
        victim, intact = on_disk[0], on_disk[-1]
        saved, kept = (victim.id, victim.token), (intact.id, intact.token)
        intact_history = intact.history()
    daemon.stop(signal.SIGKILL)
    (path,) = daemon.spill_dir.glob(f"{saved[0]}.*.snap")
    path.write_bytes(path.read_bytes()[:-100])  # cut inside its token list
    daemon.start()
    with daemon.client() as client:
        assert saved[0] not in {i.session for i in client.sessions()}
        with pytest.raises(SessionCorrupt, match="truncated"):
            client.resume_session(*saved)
        assert not path.exists()  # its file went with it
        survivor = client.resume_session(*kept)
        assert survivor.history() == intact_history
        assert survivor.complete(" more", max_tokens=2, **GREEDY).usage.completion_tokens == 2


def test_an_unreadable_spill_directory_refuses_only_the_sessions_on_it(start_daemon: Start) -> None:
    """A read error is not damage: the session stays, and answers once the directory is back; a session generating
    beside it is not cut."""
    daemon = start_daemon("--hot-slots", "2", *SPILLING)
    with daemon.client() as client:
        on_disk, hot = spilled_sessions(client)
        victim, bystander = on_disk[0], hot[-1]
        victim_history = victim.history()
        with spill_dir_replaced_by_a_file(daemon):
            stream = bystander.generate(" tell me more", max_tokens=200, **GREEDY)
            first = next(iter(stream))
            with pytest.raises(SpillUnavailable, match="the session is kept"):
                victim.complete(" again", max_tokens=2, **GREEDY)
            for _ in stream:
                pass
            assert first.tokens and stream.final is not None
            assert stream.final.finish_reason in ("stop", "length")
            status = client.status()
            assert status.moves.spill_failures >= 1 and status.moves.checksum_failures == 0
        assert victim.history() == victim_history
        assert victim.complete(" again", max_tokens=2, **GREEDY).usage.completion_tokens == 2


def test_a_spill_directory_that_fails_writes_evicts_nobody(start_daemon: Start) -> None:
    """With the pool full and the spill directory failing, new snapshots are refused (or kept hot, not durable), and
    no idle session is evicted for room the directory could not take anyway."""
    daemon = start_daemon("--hot-slots", "1", *SPILLING)
    with daemon.client() as client:
        on_disk, in_pool = spilled_sessions(client)
        everyone = on_disk + in_pool
        refused = 0
        with spill_dir_replaced_by_a_file(daemon):
            newcomers = [client.open_session() for _ in range(3)]
            for s in newcomers + in_pool:
                try:
                    s.complete(LONG, max_tokens=2, **GREEDY)
                except SpillUnavailable as exc:
                    assert "no session was dropped" in str(exc)
                    refused += 1
            status = client.status()
            assert status.moves.evictions == 0 and status.sessions.evicted == 0
            assert status.moves.spill_failures >= 1
        assert refused >= 1
        for s in everyone + newcomers:  # every session still answers once the directory is back
            assert s.complete(" ok", max_tokens=2, **GREEDY).usage.completion_tokens == 2
        assert client.status().moves.evictions == 0


def test_a_spill_file_unreadable_at_start_keeps_its_session_for_a_start_that_can_read_it(
    start_daemon: Start,
) -> None:
    """An I/O error is not damage: the session is neither closed nor its file removed (a permissions slip after a
    restore from backup, a disk that was slow to come up); its owner is told, and the next start brings it back."""
    daemon = start_daemon("--hot-slots", "1", *SPILLING)
    with daemon.client() as client:
        on_disk, _ = spilled_sessions(client)
        victim = on_disk[0]
        saved, history = (victim.id, victim.token), victim.history()
    daemon.stop(signal.SIGKILL)
    (path,) = daemon.spill_dir.glob(f"{saved[0]}.*.snap")
    aside = path.with_name("aside")
    os.rename(path, aside)
    path.mkdir()  # reading it fails (EISDIR): not missing, not damaged
    daemon.start()
    with daemon.client() as client:
        with pytest.raises(SpillUnavailable, match="could not be read when the daemon started"):
            client.resume_session(*saved)
        assert client.status().moves.spill_failures == 1
    daemon.stop()
    path.rmdir()
    os.rename(aside, path)
    daemon.start()
    with daemon.client() as client:
        back = client.resume_session(*saved)
        assert back.history() == history
        assert back.complete(" again", max_tokens=2, **GREEDY).usage.completion_tokens == 2
