"""The prefix index and sharing rules: pure logic, no model."""

from __future__ import annotations

from kvpool.daemon.engine.step_work import fcfs_work
from kvpool.daemon.kv import place
from kvpool.daemon.kv.policy import prefix_eviction_order
from kvpool.daemon.kv.pool.layout import TIER_POOL, Snapshot
from kvpool.daemon.kv.prefix.index import Prefix, PrefixIndex, block_keys, shareable_length
from kvpool.daemon.kv.sessions import Session

from .test_scheduler import Item


def prefix(tokens: list[int], **kw: object) -> Prefix:
    return Prefix(id=f"p{len(tokens)}", task="default", tokens=tokens, **kw)  # type: ignore[arg-type]


def test_longest_match_is_found_by_blocks_then_extended_token_by_token() -> None:
    index = PrefixIndex(block=4)
    system = list(range(1, 23))  # 5 whole blocks and 2 tokens
    index.add(p := prefix(system))
    assert index.longest_match([*system, 99, 98]) == (p, 22)  # the whole prefix, past its last whole block
    assert index.longest_match(system[:10] + [0] * 10) == (p, 10)  # a session sharing only its first 10
    assert index.longest_match(system[:3] + [0] * 10) is None  # less than one block: nothing to share
    assert index.longest_match([0, *system]) is None  # the same tokens elsewhere are not a prefix


def test_the_deepest_matching_prefix_wins_and_removal_gives_blocks_back() -> None:
    index = PrefixIndex(block=4)
    short, longer = prefix(list(range(1, 9))), prefix(list(range(1, 17)))
    index.add(short)
    index.add(longer)
    assert index.longest_match(list(range(1, 20))) == (longer, 16)
    index.remove(longer, [short])
    assert index.longest_match(list(range(1, 20))) == (short, 8)
    index.remove(short, [])
    assert len(index) == 0


def test_a_hash_collision_never_shares() -> None:
    index = PrefixIndex(block=4)
    p = prefix([1, 2, 3, 4, 5, 6, 7, 8])
    index.add(p)
    p.tokens[:] = [9, 9, 9, 9, 9, 9, 9, 9]  # the stored key no longer describes its tokens, as a collision would
    assert index.longest_match([1, 2, 3, 4, 5, 6, 7, 8, 0]) is None


def test_block_keys_chain_every_earlier_block() -> None:
    a = block_keys([1, 2, 3, 4, 5, 6], 2)
    b = block_keys([0, 2, 3, 4, 5, 6], 2)
    assert len(a) == 3 and all(x != y for x, y in zip(a, b, strict=True))


def test_sliding_window_sharing_needs_the_whole_window_before_the_cut() -> None:
    whole = prefix(list(range(800)), lowest_position=0)
    assert shareable_length(whole, 700, window=512) == 700
    trimmed = prefix(list(range(800)), lowest_position=289)  # a restored prefix keeps the last 512 positions
    assert shareable_length(trimmed, 800, window=512) == 0  # 800 - 512 = 288 < 289: a cell before it is missing
    assert shareable_length(prefix(list(range(800)), lowest_position=288), 800, window=512) == 800
    assert shareable_length(trimmed, 600, window=512) == 0
    assert shareable_length(trimmed, 600, window=0) == 600  # no window: every position attends everywhere


def test_only_unused_prefixes_are_evicted_least_recently_used_first() -> None:
    used = prefix([1] * 8, users=1, last_used=1.0)
    shared_hot = prefix([2] * 8, hot_users=1, last_used=0.5)
    old, new = prefix([3] * 8, last_used=2.0), prefix([4] * 8, last_used=3.0)
    assert prefix_eviction_order([new, used, old, shared_hot]) == [old, new]


def test_a_prompt_chunk_stops_at_the_end_of_the_system_prompt() -> None:
    # 500 pending tokens, 120 of them up to the prefix boundary: the chunk ends there and samples nothing
    item = Item(pending_tokens=500, arrival=0.0, feedable=120)
    assert [(w.n_tokens, w.completes) for w in fcfs_work([item], 512)] == [(120, False)]


def session(tokens: list[int]) -> Session:
    return Session(id="s", token="t", task="default", entry=0, context_limit=4096, tokens=tokens)


def snapshot(prefix_entry: int, prefix_len: int) -> Snapshot:
    return Snapshot(1, TIER_POOL, 0, 64, 32, 8, 8, 0, prefix_len=prefix_len, prefix_entry=prefix_entry)


def test_a_snapshot_names_its_prefix_only_if_the_tokens_agree() -> None:
    p = prefix(list(range(20)), entry=3)
    s = session([*range(20), 7, 7])
    place.attach(s, p, 20, hot=False)
    assert place.consistent(s, snapshot(3, 20))
    assert not place.consistent(s, snapshot(4, 20))  # another entry
    assert not place.consistent(s, snapshot(3, 21))  # longer than the prefix
    p.tokens[5] = 99  # the entry was reused by a prefix with other tokens
    assert not place.consistent(s, snapshot(3, 20))


def test_counts_follow_a_session_through_its_moves() -> None:
    first, longer = prefix(list(range(16)), entry=1), prefix(list(range(40)), entry=2)
    s = session(list(range(48)))
    place.attach(s, first, 16, hot=True)
    place.move_to(s, longer, 40)  # it made a longer prefix from its own cells: it moves there
    assert (first.users, first.hot_users, longer.users, longer.hot_users) == (0, 0, 1, 1)
    place.commit(s, snapshot(2, 40))  # a suffix-only snapshot on the longer prefix
    place.leave_hot(s)  # hibernated: still a user (its snapshot needs the prefix), no longer hot
    assert (longer.users, longer.hot_users, s.prefix) == (1, 0, longer)
    place.rejoin_hot(s)
    place.commit(s, snapshot(-1, 0))  # a whole snapshot: it needs the prefix only while it shares the cells
    place.leave_hot(s)
    assert (longer.users, longer.hot_users, s.prefix) == (0, 0, None)
