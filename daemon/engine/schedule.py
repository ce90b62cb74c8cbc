"""What the next step does, decided from a read-only view: pure logic, no llama.cpp, no pool, unit-testable.

``schedule(view)`` returns the moves that give waiting generations hot slots, most urgent first (start one whose
session is still hot; take a free slot; hibernate the least recently used idle session for one; swap a running
best-effort generation out for a deadline-bound one when every slot is generating; share a prefix with a first
prompt), and, once nothing is left to move, the step's work (engine/step_work.py). The engine applies the moves
(engine/moves.py: the KV manager moves the sessions, the scheduler its queues) and asks again: what a restore
finds (a snapshot's length, a prefix it rejoins, cells that generating sessions hold) is known only after it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from kvpool.daemon.engine.cost_model import CostModel
from kvpool.daemon.engine.step_work import Schedulable, StepPolicy, Work
from kvpool.daemon.kv.pool.layout import Snapshot


class Placed(Protocol):
    """What scheduling reads of a session's place (kv/sessions.py)."""

    @property
    def slot(self) -> int | None: ...

    @property
    def n_kv(self) -> int: ...

    @property
    def snapshot(self) -> Snapshot | None: ...

    @property
    def prefix(self) -> object | None: ...


class Queued(Schedulable, Protocol):
    """What scheduling reads of a generation (engine/generation.py)."""

    @property
    def session(self) -> Placed: ...

    @property
    def paused(self) -> bool: ...  # its client has replies it has not read: left out of steps


G = TypeVar("G", bound=Queued)
S = TypeVar("S", bound=Placed)


@dataclass(frozen=True, slots=True)
class Start(Generic[G]):
    """Its session is still hot: it runs at once (it must not queue behind one that needs a slot, because the
    slot it would wait for may be its own)."""

    g: G


@dataclass(frozen=True, slots=True)
class Restore(Generic[G]):
    """Its session takes a free slot, its KV restored from the pool or disk; then it runs."""

    g: G


@dataclass(frozen=True, slots=True)
class Hibernate(Generic[G, S]):
    """An idle resident session gives its slot to ``g``'s (checkpointed unless its snapshot is fresh)."""

    session: S
    g: G


@dataclass(frozen=True, slots=True)
class Preempt(Generic[G]):
    """A running best-effort generation is swapped out to the pool for deadline-bound ``g`` (not recomputed: it
    resumes from the same KV and sampler state, so its output does not change) and queues again."""

    victim: G
    g: G


@dataclass(frozen=True, slots=True)
class SharePrefix(Generic[G]):
    """Its session is about to compute its first prompt: take the longest shared prefix it begins with."""

    g: G


Move = Start[G] | Restore[G] | Hibernate[G, S] | Preempt[G] | SharePrefix[G]


@dataclass(frozen=True, slots=True)
class SchedulerView(Generic[G, S]):
    """What one decision reads. ``no_room``: generations whose restore found no free cells this step (the
    generating sessions hold them): they may swap best-effort work out once, then ``closed`` ends admission
    until the next step."""

    waiting: Sequence[G]  # in the order they are admitted (the scheduler's queue: most urgent first)
    running: Sequence[G]
    free_slots: int
    idle_resident: Sequence[S]  # hot sessions that may hibernate, least recently used first
    policy: StepPolicy
    capacity: int
    cost: CostModel
    time_cap: float | None
    prefix_sharing: bool
    no_room: frozenset[int] = frozenset()  # id() of such generations
    closed: bool = False


@dataclass(frozen=True, slots=True)
class StepDecision(Generic[G, S]):
    moves: tuple[Move[G, S], ...] = ()
    work: tuple[Work[G], ...] = field(default=())  # planned only when there is nothing to move


def schedule(view: SchedulerView[G, S]) -> StepDecision[G, S]:
    moves = _admissions(view)
    if moves:
        return StepDecision(tuple(moves))
    ready = [g for g in view.running if not g.paused]
    if not ready:
        return StepDecision()
    return StepDecision(work=tuple(view.policy.work(ready, view.capacity, view.cost, view.time_cap)))


def _admissions(view: SchedulerView[G, S]) -> list[Move[G, S]]:
    waiting = view.waiting
    moves: list[Move[G, S]] = []
    for g in waiting:
        if g.session.slot is not None:
            moves.append(Start(g))
            if view.prefix_sharing and _first_prompt(g.session):
                moves.append(SharePrefix(g))
    if view.closed:
        return moves
    slots, idle = view.free_slots, list(view.idle_resident)
    started = [m.g for m in moves if isinstance(m, Start)]
    victims = [r for r in [*view.running, *started] if r.best_effort]
    for g in waiting:
        if g.session.slot is not None:
            continue
        swaps = view.policy.preempts and not g.best_effort and victims
        victim = max(victims, key=lambda r: r.arrival) if swaps else None
        if id(g) in view.no_room:  # a slot is not enough: only swapping work out can free cells
            if victim is None:
                break
            victims.remove(victim)
            moves.append(Preempt(victim, g))
        elif slots:
            slots -= 1
        elif idle:
            moves.append(Hibernate(idle.pop(0), g))
        elif victim is not None:
            victims.remove(victim)
            moves.append(Preempt(victim, g))
        else:
            break  # every slot is generating: it waits for the next step
        moves.append(Restore(g))
        if g.best_effort:
            victims.append(g)
        if view.prefix_sharing and _first_prompt(g.session):
            moves.append(SharePrefix(g))
    return moves


def _first_prompt(s: Placed) -> bool:
    """Whether the session's next tokens are its first computed ones (then a shared prefix can stand for some)."""
    if s.prefix is not None:
        return False
    if s.slot is not None:
        return s.n_kv == 0
    return s.snapshot is None or s.snapshot.n_kv == 0
