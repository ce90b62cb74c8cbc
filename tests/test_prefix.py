"""Prefix sharing against real daemons on the tiny model: exactness, the tiers, restarts, eviction order."""

from __future__ import annotations

import signal
from collections.abc import Callable

import pytest

from kvpool.client import Client
from kvpool.client.errors import SessionCorrupt
from kvpool.protocol.status import PrefixStatus

from .daemon_process import DaemonProcess, run_until_exit
from .test_tiers import flip_pool_byte, pool_snapshot_offset

Start = Callable[..., DaemonProcess]
GREEDY = {"temperature": 0.0}
# ~470 tokens on the tiny model's byte vocabulary (a space is "▁": three byte tokens).
SYSTEM = "You are the voice assistant of a small robot. Answer in one short sentence, politely. " * 4
OTHER_SYSTEM = "You describe camera frames for a vision task: objects, colours, positions, motion. " * 4
NO_SHARING = "prefix_slots = 0\n"


def prefixes(client: Client) -> PrefixStatus:
    return client.status().prefixes


def token_count(client: Client, system: str) -> int:
    """How many tokens a session opened with ``system`` starts with."""
    s = client.open_session(system_prompt=system)
    n = next(info.context_tokens for info in client.sessions() if info.session == s.id)
    s.close()
    return n


def conversation(client: Client, n: int, turns: int, system: str = SYSTEM, max_tokens: int = 6) -> list[list[int]]:
    """``n`` sessions with one system prompt, ``turns`` greedy turns each, round-robin."""
    sessions = [client.open_session(system_prompt=system) for _ in range(n)]
    out: list[list[int]] = [[] for _ in range(n)]
    for turn in range(turns):
        for i, s in enumerate(sessions):
            out[i] += s.complete(f"user {i} says {turn}{'!' * i}", max_tokens=max_tokens, **GREEDY).tokens
    return out


def test_sessions_sharing_a_system_prompt_equal_unshared_ones(start_daemon: Start) -> None:
    shared = start_daemon("--hot-slots", "4", "--context-size", "4096", name="shared")
    with shared.client() as client:
        result = conversation(client, 4, 3)
        computed = client.status().counters.prompt_tokens
        info = prefixes(client)
        # the first session computed the prompt; the three others took its cells
        assert info.made == 1 and info.hits == 3
        prompt_tokens = token_count(client, SYSTEM)
        assert info.tokens_saved == 3 * prompt_tokens
        assert {s.shared_tokens for s in client.sessions()} == {prompt_tokens}
        status = client.status()
        # the prompt's cells are counted once, not four times
        assert status.kv.cells_used < 2 * prompt_tokens
        # a session given the same text as its first prompt (no system prompt) finds it by its token blocks
        plain = client.open_session(system_prompt="")
        plain.complete(SYSTEM + "user 9 says 0", max_tokens=4, **GREEDY)
        assert prefixes(client).hits == 4
    unshared = start_daemon("--hot-slots", "4", "--context-size", "4096", config=NO_SHARING, name="unshared")
    with unshared.client() as client:
        assert conversation(client, 4, 3) == result
        # the unshared daemon computed the system prompt four times, the shared one once
        assert client.status().counters.prompt_tokens - computed == 3 * token_count(client, SYSTEM)
        assert prefixes(client).hits == 0 and client.status().kv.cells_used > 4 * token_count(client, SYSTEM)


def test_hibernated_sharing_sessions_store_only_their_own_cells_and_restore_exactly(start_daemon: Start) -> None:
    # one hot slot: every turn of another session hibernates the previous one
    shared = start_daemon("--hot-slots", "1", "--context-size", "4096", name="shared")
    with shared.client() as client:
        result = conversation(client, 3, 3)
        status = client.status()
        assert status.moves.hibernations >= 6 and status.moves.restores_pool >= 6
        sizes = [s.snapshot_bytes for s in client.sessions()]
        assert status.prefixes.pool_bytes_saved > 0
    unshared = start_daemon("--hot-slots", "1", "--context-size", "4096", config=NO_SHARING, name="unshared")
    with unshared.client() as client:
        assert conversation(client, 3, 3) == result
        unshared_sizes = [s.snapshot_bytes for s in client.sessions()]
    # ~330 tokens of context, of which ~300 are the shared prompt: each snapshot is a fraction of a whole one
    assert max(sizes) * 4 < min(unshared_sizes)


def test_sharing_survives_a_crash_and_stays_exact(start_daemon: Start) -> None:
    args = ("--hot-slots", "2", "--context-size", "4096")
    daemon = start_daemon(*args, name="crash")
    with daemon.client() as client:
        sessions = [client.open_session(system_prompt=SYSTEM) for _ in range(3)]
        for i, s in enumerate(sessions):
            s.complete(f"first {i}", max_tokens=5, **GREEDY)
        ids = [(s.id, s.token) for s in sessions]
        untouched = client.open_session(system_prompt=SYSTEM)  # opened, no turn yet: only tokens to keep
        system_tokens = untouched.history()
    daemon.stop(signal.SIGKILL)
    daemon.start()
    with daemon.client() as client:
        info = prefixes(client)
        assert info.count == 1 and info.users == 3  # the prefix came back with its sessions
        assert client.resume_session(untouched.id, untouched.token).history() == system_tokens
        after = [
            client.resume_session(*ident).complete(f"second {i}", max_tokens=6, **GREEDY).tokens
            for i, ident in enumerate(ids)
        ]
        newcomer = client.open_session(system_prompt=SYSTEM)
        newcomer.complete("first 9", max_tokens=4, **GREEDY)
        assert prefixes(client).hits == 1  # a new session shares the recovered prefix
    reference = start_daemon(*args, config=NO_SHARING, name="reference")
    with reference.client() as client:
        expected = []
        for i in range(3):
            s = client.open_session(system_prompt=SYSTEM)
            s.complete(f"first {i}", max_tokens=5, **GREEDY)
            expected.append(s.complete(f"second {i}", max_tokens=6, **GREEDY).tokens)
    assert after == expected


def test_a_prefix_in_use_is_kept_and_an_unused_one_goes_first(start_daemon: Start) -> None:
    daemon = start_daemon("--hot-slots", "2", "--context-size", "4096", config="max_prefixes = 2\n")
    with daemon.client() as client:
        keeper = client.open_session(system_prompt=SYSTEM)
        keeper.complete("hello", max_tokens=3, **GREEDY)
        passing = client.open_session(system_prompt=OTHER_SYSTEM)
        passing.complete("frame 1", max_tokens=3, **GREEDY)
        passing.close()  # its prefix now has no user
        mine, other = token_count(client, SYSTEM), token_count(client, OTHER_SYSTEM)
        by_tokens = {x.tokens: x for x in prefixes(client).each}
        assert by_tokens[mine].users == 1 and by_tokens[other].users == 0
        # a third prefix needs room: the unused one goes, the one in use stays
        third = client.open_session(system_prompt="A third system prompt, for a notification summariser. " * 3)
        third.complete("mail", max_tokens=3, **GREEDY)
        info = prefixes(client)
        kept = {x.tokens for x in info.each}
        assert info.dropped == 1 and mine in kept and other not in kept
        again = client.open_session(system_prompt=SYSTEM)
        again.complete("hello", max_tokens=3, **GREEDY)
        assert prefixes(client).hits == 1


def test_pool_pressure_drops_an_unused_prefix_before_any_session_snapshot(start_daemon: Start) -> None:
    # a 1 MiB pool (~960 KiB of extents) and ~280 bytes of tiny-model state per token
    daemon = start_daemon("--hot-slots", "1", "--context-size", "4096", "--cache-pool-size", "1MiB")
    with daemon.client() as client:
        user = client.open_session(system_prompt=SYSTEM)
        user.complete("in use", max_tokens=3, **GREEDY)
        unused = client.open_session(system_prompt=OTHER_SYSTEM)
        unused.complete("gone soon", max_tokens=3, **GREEDY)
        unused.close()
        assert prefixes(client).count == 2
        first_spill_dropped = None
        for i in range(12):  # sessions of ~600 tokens each until the pool must make room
            client.open_session(system_prompt="").complete(f"{i} " + "filler text " * 50, max_tokens=3, **GREEDY)
            status = client.status()
            if status.moves.spills and first_spill_dropped is None:
                first_spill_dropped = status.prefixes.dropped
        assert first_spill_dropped == 1  # the unused prefix was gone before the first session snapshot moved
        info = prefixes(client)
        assert [x.users for x in info.each] == [1]  # the prefix in use is still there
        assert user.complete("still exact?", max_tokens=3, **GREEDY).finish_reason == "length"


def test_turning_sharing_off_over_a_pool_that_needs_it_is_refused(start_daemon: Start) -> None:
    daemon = start_daemon("--hot-slots", "2", "--context-size", "4096")
    with daemon.client() as client:
        client.open_session(system_prompt=SYSTEM).complete("one", max_tokens=2, **GREEDY)
        client.open_session(system_prompt=SYSTEM).complete("two", max_tokens=2, **GREEDY)  # a suffix-only snapshot
    daemon.stop()
    daemon.config = NO_SHARING
    result = run_until_exit(daemon.command())
    assert result.returncode == 1
    assert "build on shared prefixes" in result.stderr and "--reset-pool" in result.stderr
    daemon.config = None
    daemon.start()  # with sharing on again, everything is still there
    with daemon.client() as client:
        assert len(client.sessions()) == 2 and prefixes(client).users == 2


def test_damaged_prefix_or_system_prompt_is_reported_never_used(start_daemon: Start) -> None:
    daemon = start_daemon("--hot-slots", "1", "--context-size", "4096", config="prefix_slots = 1\n")
    with daemon.client() as client:
        # a system prompt not yet computed is kept as tokens alone: damage them
        waiting = client.open_session(system_prompt=OTHER_SYSTEM)
        offset, _ = pool_snapshot_offset(daemon.pool_name, waiting.id)
        flip_pool_byte(daemon.pool_name, offset + 2)
        with pytest.raises(SessionCorrupt, match="checksum"):
            waiting.complete("hello", max_tokens=2, **GREEDY)

        a = client.open_session(system_prompt=SYSTEM)
        a.complete("first", max_tokens=2, **GREEDY)  # makes prefix P
        (p,) = prefixes(client).each
        b = client.open_session(system_prompt="Another system prompt, for another task entirely. " * 3)
        b.complete("second", max_tokens=2, **GREEDY)  # hibernates a (its snapshot builds on P); P leaves the KV
        assert [x.hot for x in prefixes(client).each if x.id == p.id] == [False]
        offset, state_bytes = pool_snapshot_offset(daemon.pool_name, p.id)
        flip_pool_byte(daemon.pool_name, offset + state_bytes // 2)
        with pytest.raises(SessionCorrupt, match="checksum"):
            a.complete("again", max_tokens=2, **GREEDY)  # its prefix is damaged: reported, not used
        # the damaged prefix is never offered again: the next session computes the prompt and makes a new one
        hits = prefixes(client).hits
        c = client.open_session(system_prompt=SYSTEM)
        c.complete("third", max_tokens=2, **GREEDY)
        assert prefixes(client).hits == hits and p.id not in {x.id for x in prefixes(client).each}
        client.open_session(system_prompt=SYSTEM).complete("fourth", max_tokens=2, **GREEDY)
        assert prefixes(client).hits == hits + 1
        assert b.complete("still fine", max_tokens=2, **GREEDY).usage.completion_tokens == 2
