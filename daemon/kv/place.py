"""Where a session's KV is, and the only code that changes it.

A session's place: its hot slot and how many of its tokens that slot's cells hold, its committed snapshot (in the
pool or on disk), the shared prefix it builds on, and the end of its system prompt; and the conversation those
count in, its tokens, which grow here only. Sessions show these read-only
(kv/sessions.py); the KV manager (kv/manager.py and the snapshot path behind it) moves them through the
functions here, so that every change of place is one named move. A test fails when another module assigns one.

Prefix links are kept right through every move: a session builds on a prefix while its hot cells for the first
``prefix_len`` cells are the prefix's own (``shares_hot``), or while its committed snapshot holds only its
cells past them. The prefix's ``users`` counts such sessions (its pool snapshot must stay), ``hot_users`` those of
the first kind (its hot copy must stay). Pure bookkeeping: no llama.cpp, no pool access.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvpool.daemon.kv.pool.layout import NO_PREFIX, Snapshot
from kvpool.daemon.kv.positions import Positions, in_band
from kvpool.daemon.kv.prefix.index import Prefix


@dataclass(eq=False, slots=True)
class SessionPlace:
    slot: int | None = None  # the llama.cpp sequence holding the KV while the session is hot
    n_kv: int = 0  # while hot, its cells hold tokens[:n_kv]
    snapshot: Snapshot | None = None  # the last committed snapshot (pool or disk)
    prefix: Prefix | None = None  # the shared prefix its hot cells or its snapshot build on
    prefix_len: int = 0  # how many of its cells come from it
    shares_hot: bool = False  # its hot cells for them are the prefix's own
    # The end of its system prompt: once its KV reaches it, those cells become a shared prefix (0: none).
    boundary: int = 0
    saved_bytes: int = 0  # what its last snapshot did not store again because it builds on a prefix
    cell_positions: Positions | None = None  # where its tokens' cells sit (kv/positions.py), from its tokens when read


class Medium(Protocol):
    """What the moves need of a medium (a piece of one) whose cells a session holds uncomputed (media_cache.py)."""

    n_tokens: int
    pins: int


class Session(Protocol):
    """What the moves need of a session (kv/sessions.py): its place, its tokens and its uncomputed media."""

    place: SessionPlace
    tokens: list[int]
    media: dict[int, Medium]


# ---------------------------------------------------------------------- the conversation


def append(s: Session, tokens: list[int], media: Sequence[tuple[int, Medium]] = ()) -> None:
    """A turn's prompt, or a sampled token, joins the conversation: the next steps compute its cells. ``media``:
    where among ``tokens`` media cells begin (their placeholders), each medium pinned by the caller already: the
    session holds that pin until the medium's cells are computed (``fed``) or the session goes (``detach``)."""
    at = len(s.tokens)
    s.tokens.extend(tokens)
    if any(in_band(t) for t in tokens):
        s.place.cell_positions = None
    for offset, medium in media:
        s.media[at + offset] = medium


def positions(s: Session) -> Positions:
    """Where the session's cells sit, from its tokens (kept until they change in a way that moves them)."""
    if s.place.cell_positions is None:
        s.place.cell_positions = Positions.of(s.tokens)
    return s.place.cell_positions


def cut_inside_medium(s: Session, i: int) -> bool:
    """Cell ``i`` is inside a medium whose cells share one position: no cut there keeps whole cells."""
    return positions(s).floor(i) != i


def forget_uncomputed(s: Session) -> None:
    """The tokens past its computed cells go (a medium among them could not be encoded): the conversation ends
    where its cells do, and its uncomputed media are let go of."""
    del s.tokens[s.place.n_kv :]
    s.place.cell_positions = None
    for start in [start for start in s.media if start >= s.place.n_kv]:
        s.media.pop(start).pins -= 1


def without_lost_media(tokens: list[int], n_kv: int) -> list[int]:
    """A conversation as a restarted daemon can go on with it: a medium whose cells were not computed before the
    stop cannot be computed now (its pixels are not kept), so the tokens end before the first such cell."""
    lost = next((i for i in range(n_kv, len(tokens)) if tokens[i] < 0), len(tokens))
    return tokens[:lost]


def _settle_media(s: Session) -> None:
    """Media whose cells are all computed now: the session lets go of them."""
    n_kv = s.place.n_kv
    for start in [start for start, m in s.media.items() if start + m.n_tokens <= n_kv]:
        s.media.pop(start).pins -= 1


# ---------------------------------------------------------------------- the hot tier


def take_slot(s: Session, slot: int) -> None:
    s.place.slot = slot


def leave_slot(s: Session) -> None:
    """The session's slot and cells are freed: it shares no cells now, and builds on its prefix only through a
    suffix-only snapshot."""
    s.place.slot = None
    leave_hot(s)


def hold_cells(s: Session, n_kv: int) -> None:
    """Its slot's cells hold its first ``n_kv`` tokens (restored, shared from a prefix, or emptied)."""
    s.place.n_kv = n_kv
    if s.media:
        _settle_media(s)


def fed(s: Session, n_tokens: int) -> None:
    """A step computed ``n_tokens`` more of its tokens into its cells."""
    s.place.n_kv += n_tokens
    if s.media:
        _settle_media(s)


def take_boundary(s: Session) -> int:
    """The end of its system prompt, which stops being one (it became a prefix, or a prefix covers it)."""
    end, s.place.boundary = s.place.boundary, 0
    return end


# ---------------------------------------------------------------------- snapshots


def commit(s: Session, snapshot: Snapshot) -> None:
    """A snapshot of the session was committed in the pool's table: it is the one a restore reads."""
    s.place.snapshot = snapshot


def note_saved(s: Session, saved_bytes: int) -> None:
    """After a checkpoint: the bytes it did not store again because it builds on a prefix, and the prefix let go
    of when nothing builds on it now."""
    s.place.saved_bytes = saved_bytes
    settle(s)


def lose_snapshot(s: Session) -> None:
    """Its saved state is given up (its KV stays hot)."""
    s.place.snapshot = None
    settle(s)


# ---------------------------------------------------------------------- prefix links


def attach(s: Session, prefix: Prefix, length: int, hot: bool) -> None:
    place = s.place
    assert place.prefix is None
    prefix.users += 1
    prefix.hot_users += int(hot)
    place.prefix, place.prefix_len, place.shares_hot = prefix, length, hot


def move_to(s: Session, prefix: Prefix, length: int) -> None:
    """The session (resident) just made ``prefix`` from its own cells: it builds on it from now on, unless its
    committed snapshot builds on the prefix it took its first cells from (then it stays with that one)."""
    if s.place.prefix is not None:
        snap = s.place.snapshot
        if snap is not None and snap.prefix_entry != NO_PREFIX:
            return
        detach(s)
    attach(s, prefix, length, hot=True)


def consistent(s: Session, snap: Snapshot) -> bool:
    """The prefix the session is linked to is the one its snapshot names, and holds the session's tokens (a
    table entry index is reused once a prefix is gone: a stale reference must not pass)."""
    p = s.place.prefix
    return (
        p is not None
        and p.entry == snap.prefix_entry
        and snap.prefix_len <= len(p.tokens)
        and p.tokens[: snap.prefix_len] == s.tokens[: snap.prefix_len]
    )


def leave_hot(s: Session) -> None:
    place = s.place
    if place.prefix is not None and place.shares_hot:
        place.prefix.hot_users -= 1
        place.shares_hot = False
    settle(s)


def rejoin_hot(s: Session) -> None:
    """Its suffix was restored and the prefix's cells shared back into its slot."""
    place = s.place
    assert place.prefix is not None and not place.shares_hot
    place.prefix.hot_users += 1
    place.shares_hot = True


def settle(s: Session) -> None:
    """Let go of the prefix once neither the hot cells nor the committed snapshot build on it."""
    place = s.place
    if place.prefix is None or place.shares_hot:
        return
    snap = place.snapshot
    if snap is None or snap.prefix_entry == NO_PREFIX:
        place.prefix.users -= 1
        place.prefix, place.prefix_len = None, 0


def detach(s: Session) -> None:
    """The session is gone."""
    for medium in s.media.values():
        medium.pins -= 1
    s.media.clear()
    place = s.place
    if place.prefix is not None:
        place.prefix.hot_users -= int(place.shares_hot)
        place.prefix.users -= 1
        place.prefix, place.prefix_len, place.shares_hot = None, 0, False


def suffix_start(s: Session) -> int:
    """Where the session's own cells begin, when its snapshot can leave out a shared prefix (0: whole).
    Only a prefix with a pool snapshot can be left out, so that the snapshot can always be restored."""
    p = s.place.prefix
    if p is None or not s.place.shares_hot or p.entry is None or s.place.n_kv <= s.place.prefix_len:
        return 0
    return s.place.prefix_len


def snapshot_ref(s: Session, first: int) -> tuple[int, int]:
    """(prefix entry, prefix length) for the record of a snapshot whose cells start at ``first``."""
    if not first:
        return NO_PREFIX, 0
    assert s.place.prefix is not None and s.place.prefix.entry is not None
    return s.place.prefix.entry, first
