"""Applying the scheduler's decisions: the KV manager moves the sessions, the scheduler its queues, in the order
schedule() gave, until a decision has nothing left to move; then its work is the step's. Engine thread only."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from enum import Enum

from kvpool.daemon.engine.generation import Generation
from kvpool.daemon.engine.schedule import Hibernate, Move, Preempt, Restore, SharePrefix, Start, schedule
from kvpool.daemon.engine.scheduler import Scheduler
from kvpool.daemon.engine.step_work import Work
from kvpool.daemon.kv.manager import KvManager, held_slot
from kvpool.daemon.kv.sessions import Session
from kvpool.daemon.refusals import RequestRefused

log = logging.getLogger("kvpool.engine")

TurnAway = Callable[[Generation, RequestRefused], None]


class Stop(Enum):
    """Why applying a decision stopped before its end."""

    REFUSED = "refused"  # a generation could not be made hot (e.g. its snapshot is damaged): it was ended
    NO_ROOM = "no_room"  # a restore found no free cells: the generating sessions hold them
    CLOSED = "closed"  # no room can be made this step


def next_work(scheduler: Scheduler, kv: KvManager, turn_away: TurnAway) -> list[Work[Generation]]:
    """Decide, apply, decide again until nothing is left to move: the step's work. ``turn_away(g, why)`` ends a
    waiting generation that could not get a hot slot (and takes it out of the queues)."""
    scheduler.order_waiting()  # once a step: a generation swapped out during it queues behind the others
    no_room: set[int] = set()
    closed = False
    for _ in range(4 + 2 * len(scheduler.generations())):  # every round moves a generation, ends one or closes
        decision = schedule(scheduler.view(kv, frozenset(no_room), closed))
        if not decision.moves:
            return list(decision.work)
        stopped = apply(decision.moves, scheduler, kv, turn_away)
        if isinstance(stopped, Generation):  # its restore found no room
            # A generation may swap work out once a step, as it waits for room: after that, admission closes.
            swapped = any(isinstance(m, Preempt) and m.g is stopped for m in decision.moves)
            closed = closed or swapped or id(stopped) in no_room
            no_room.add(id(stopped))
        elif stopped is Stop.CLOSED:
            closed = True
    log.error("scheduling did not settle; this step runs what is running")
    return list(schedule(replace(scheduler.view(kv, frozenset(no_room), True), waiting=())).work)


def apply(
    moves: Sequence[Move[Generation, Session]], scheduler: Scheduler, kv: KvManager, turn_away: TurnAway
) -> Generation | Stop | None:
    """Apply ``moves`` in order; None when all were, else where it stopped (a generation whose restore found no
    room, or why)."""

    def start(g: Generation) -> None:
        if g.new_tokens:  # first admission (a preempted generation comes back with nothing new)
            kv.append(g.session, g.new_tokens, g.media)  # (the session takes the media's pins over)
            g.new_tokens, g.media = [], []
        scheduler.start(g)

    for move in moves:
        if isinstance(move, Start):
            start(move.g)
        elif isinstance(move, SharePrefix):
            kv.share_first_prompt(move.g.session)
        elif isinstance(move, Hibernate):
            if move.session.slot is None:  # a restore before it already hibernated it for cells: its slot is free
                continue
            started = time.perf_counter()
            try:
                kv.hibernate(move.session)
            except RequestRefused as refused:  # no room to checkpoint it: the generation it was for cannot start
                turn_away(move.g, held_slot(refused))
                return Stop.REFUSED
            finally:
                move.g.session.restore_seconds += time.perf_counter() - started
        elif isinstance(move, Preempt):
            try:
                kv.hibernate(move.victim.session, preempt=True)
            except RequestRefused as refused:  # no room to swap it out: g waits for a slot like anyone else
                log.warning("could not preempt session %s: %s", move.victim.session.id, refused.message)
                return Stop.CLOSED
            scheduler.preempted(move.victim)
            log.info(
                "preempted best-effort session %s for deadline-bound session %s",
                move.victim.session.id,
                move.g.session.id,
            )
        elif isinstance(move, Restore):
            try:
                resident = kv.make_resident(move.g.session)
            except RequestRefused as refused:
                turn_away(move.g, refused)
                return Stop.REFUSED
            if not resident:
                return move.g
            start(move.g)
    return None
