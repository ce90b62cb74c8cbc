"""schedule(): who gets a hot slot, who is swapped out and what a step feeds, decided from a read-only view.
Plain objects stand for sessions and generations: no llama.cpp, no shared memory, no daemon."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace

from kvpool.daemon.engine.cost_model import CostModel
from kvpool.daemon.engine.schedule import (
    Hibernate,
    Preempt,
    Restore,
    SchedulerView,
    SharePrefix,
    Start,
    StepDecision,
    schedule,
)
from kvpool.daemon.engine.step_work import budgeted_work, step_policy, urgency

BUDGETS, FCFS = step_policy("budgets"), step_policy("fcfs")


@dataclass(eq=False)
class Place:
    slot: int | None = None
    n_kv: int = 0
    snapshot: object | None = None
    prefix: object | None = None
    last_used: float = 0.0


@dataclass(eq=False)
class Gen:
    name: str
    arrival: float
    session: Place = field(default_factory=Place)
    deadline: float = math.inf
    best_effort: bool = False
    priority: int = 0
    pending_tokens: int = 4
    paused: bool = False
    feeds_medium: bool = False  # its next cells are a medium's (fed whole, alone)
    medium_seconds: float = 0.0
    medium_ready: bool = True

    @property
    def feedable_tokens(self) -> int:
        return min(self.pending_tokens, 16) if self.feeds_medium else self.pending_tokens

    @property
    def position(self) -> int:
        return self.session.n_kv

    def __repr__(self) -> str:
        return self.name


def hot(slot: int, n_kv: int = 10) -> Place:
    return Place(slot=slot, n_kv=n_kv)


def restored(n_kv: int) -> Place:
    """A hibernated session: its snapshot holds ``n_kv`` cells."""
    return Place(snapshot=SimpleNamespace(n_kv=n_kv), n_kv=n_kv)


def view(
    waiting: list[Gen],
    running: list[Gen] = [],  # noqa: B006 (never mutated)
    free_slots: int = 0,
    idle: list[Place] = [],  # noqa: B006
    **kwargs: object,
) -> SchedulerView:
    settings: dict = {"policy": BUDGETS, "capacity": 64, "cost": CostModel(), "time_cap": None, "prefix_sharing": False}
    settings.update(kwargs)
    return SchedulerView(tuple(waiting), tuple(running), free_slots, tuple(idle), **settings)


def moves(v: SchedulerView) -> list[tuple[str, ...]]:
    out = []
    for m in schedule(v).moves:
        if isinstance(m, Hibernate):
            out.append(("hibernate", f"idle@{m.session.slot}", m.g.name))
        elif isinstance(m, Preempt):
            out.append(("preempt", m.victim.name, m.g.name))
        else:
            kind = {Start: "start", Restore: "restore", SharePrefix: "share"}[type(m)]
            out.append((kind, m.g.name))
    return out


def test_a_session_still_hot_starts_before_any_that_needs_a_slot() -> None:
    urgent = Gen("urgent", arrival=2.0, deadline=1.0)
    again = Gen("again", arrival=1.0, session=hot(0))
    # Its slot is the only one: queued behind "urgent", it would wait for its own slot.
    assert moves(view([urgent, again])) == [("start", "again")]
    # Best-effort, it starts all the same, and is the work a deadline-bound request may swap out.
    again.best_effort = True
    assert moves(view([urgent, again])) == [("start", "again"), ("preempt", "again", "urgent"), ("restore", "urgent")]


def test_free_slots_go_in_the_queues_order_most_urgent_first() -> None:
    old = Gen("old", arrival=1.0)
    due = Gen("due", arrival=3.0, deadline=5.0)
    background = Gen("background", arrival=0.5, best_effort=True)
    queue = sorted([old, background, due], key=urgency)  # (Scheduler.order_waiting, once a step)
    assert queue == [due, old, background]
    assert moves(view(queue, free_slots=1)) == [("restore", "due")]
    assert moves(view(queue, free_slots=2)) == [("restore", "due"), ("restore", "old")]


def test_first_come_first_served_keeps_arrival_order() -> None:
    old, due = Gen("old", arrival=1.0), Gen("due", arrival=3.0, deadline=5.0)
    assert moves(view([old, due], free_slots=1, policy=FCFS)) == [("restore", "old")]


def test_the_least_recently_used_idle_session_gives_its_slot() -> None:
    a, b = Gen("a", arrival=1.0), Gen("b", arrival=2.0)
    lru, recent = Place(slot=3, last_used=1.0), Place(slot=4, last_used=9.0)
    assert moves(view([a, b], idle=[lru, recent])) == [
        ("hibernate", "idle@3", "a"),
        ("restore", "a"),
        ("hibernate", "idle@4", "b"),
        ("restore", "b"),
    ]


def test_a_deadline_bound_request_swaps_out_the_newest_best_effort_work() -> None:
    older = Gen("older", arrival=1.0, session=hot(0), best_effort=True, pending_tokens=1)
    newer = Gen("newer", arrival=2.0, session=hot(1), best_effort=True, pending_tokens=1)
    voice = Gen("voice", arrival=3.0, deadline=4.0)
    assert moves(view([voice], running=[older, newer])) == [("preempt", "newer", "voice"), ("restore", "voice")]


def test_best_effort_work_never_swaps_anyone_out_and_fcfs_never_preempts() -> None:
    running = Gen("running", arrival=1.0, session=hot(0), best_effort=True, pending_tokens=1)
    late = Gen("late", arrival=3.0, best_effort=True)
    decision = schedule(view([late], running=[running]))
    assert decision.moves == () and [w.item for w in decision.work] == [running]  # "late" waits for the next step
    voice = Gen("voice", arrival=3.0, deadline=4.0)
    assert moves(view([voice], running=[running], policy=FCFS)) == []


def test_a_restore_without_room_may_swap_work_out_once_then_admission_closes() -> None:
    running = Gen("running", arrival=1.0, session=hot(0), best_effort=True, pending_tokens=1)
    voice, other = Gen("voice", arrival=3.0, deadline=4.0), Gen("other", arrival=4.0, deadline=9.0)
    v = view([voice, other], running=[running], free_slots=2, no_room=frozenset({id(voice)}))
    assert moves(v) == [("preempt", "running", "voice"), ("restore", "voice"), ("restore", "other")]
    # With nothing to swap out, it waits and so does everyone behind it.
    assert moves(view([voice, other], free_slots=2, no_room=frozenset({id(voice)}))) == []
    again = Gen("again", arrival=5.0, session=hot(1))
    assert moves(view([voice, again], free_slots=2, closed=True)) == [("start", "again")]


def test_only_a_first_prompt_looks_for_a_shared_prefix() -> None:
    new = Gen("new", arrival=1.0)  # never computed: no snapshot
    back = Gen("back", arrival=2.0, session=restored(30))
    empty_hot = Gen("empty_hot", arrival=3.0, session=hot(0, n_kv=0))
    assert moves(view([new, back, empty_hot], free_slots=2, prefix_sharing=True)) == [
        ("start", "empty_hot"),
        ("share", "empty_hot"),
        ("restore", "new"),
        ("share", "new"),
        ("restore", "back"),
    ]
    assert ("share", "new") not in moves(view([new], free_slots=1, prefix_sharing=False))


def test_with_nothing_to_move_the_work_is_the_step_work_of_the_ready_generations() -> None:
    decoding = Gen("decoding", arrival=1.0, session=hot(0), pending_tokens=1, deadline=2.0)
    prompt = Gen("prompt", arrival=2.0, session=hot(1), pending_tokens=300)
    paused = Gen("paused", arrival=0.5, session=hot(2), pending_tokens=1, paused=True)
    cost = CostModel()
    v = view([], running=[decoding, prompt, paused], capacity=128, cost=cost, time_cap=0.05)
    decision = schedule(v)
    assert decision.moves == ()
    assert list(decision.work) == budgeted_work([decoding, prompt], 128, cost, 0.05)
    assert [w.item for w in decision.work] == [decoding, prompt] and decision.work[1].n_tokens < 128
    assert schedule(v) == decision and v.running == (decoding, prompt, paused)  # a pure function of its view


def work_of(decision: StepDecision[Gen, Place]) -> list[tuple[str, int]]:
    return [(w.item.name, w.n_tokens) for w in decision.work]


def test_a_medium_is_fed_whole_in_a_step_of_its_own() -> None:
    image = Gen("image", 1.0, session=hot(0), pending_tokens=40, feeds_medium=True, best_effort=True)
    assert work_of(schedule(view([], running=[image]))) == [("image", 16)]  # its 16 cells, nothing else
    talker = Gen("talker", 0.5, session=hot(1), pending_tokens=1, best_effort=True)
    reader = Gen("reader", 2.0, session=hot(2), pending_tokens=30, best_effort=True)
    # No deadline-bound work in flight and it is the oldest prompt: it goes, the others wait one step.
    assert work_of(schedule(view([], running=[talker, image, reader]))) == [("image", 16)]
    # A prompt that came before it goes first (with the decode token beside it), then the medium.
    older = Gen("older", 0.1, session=hot(2), pending_tokens=30, best_effort=True)
    assert work_of(schedule(view([], running=[talker, image, older]))) == [("talker", 1), ("older", 30)]


def test_a_best_effort_medium_waits_for_deadline_bound_work_and_a_deadline_bound_one_goes_first() -> None:
    voice = Gen("voice", 5.0, session=hot(0), pending_tokens=1, deadline=6.0)
    image = Gen("image", 1.0, session=hot(1), pending_tokens=40, feeds_medium=True, best_effort=True)
    assert work_of(schedule(view([], running=[voice, image]))) == [("voice", 1)]
    urgent = Gen("urgent", 4.0, session=hot(1), pending_tokens=40, feeds_medium=True, deadline=5.0)
    assert work_of(schedule(view([], running=[voice, urgent]))) == [("urgent", 16)]  # the earlier deadline
    chatter = Gen("chatter", 0.0, session=hot(2), pending_tokens=1, best_effort=True)
    assert work_of(schedule(view([], running=[chatter, urgent]))) == [("urgent", 16)]


def test_a_medium_goes_beside_answers_without_deadlines() -> None:
    """The default task has no budgets: a medium is not held back until an older answer without a deadline ends
    (it waited for all of it, a turn with an image behind a 25,000-token answer)."""
    chat = Gen("chat", 0.0, session=hot(0), pending_tokens=1)
    image = Gen("image", 1.0, session=hot(1), pending_tokens=40, feeds_medium=True)
    assert work_of(schedule(view([], running=[chat, image]))) == [("image", 16)]
    assert work_of(schedule(view([], running=[chat, image], time_cap=0.2))) == [("image", 16)]
    # A prompt that came before it still goes first.
    older = Gen("older", 0.5, session=hot(2), pending_tokens=30)
    assert work_of(schedule(view([], running=[chat, image, older]))) == [("chat", 1), ("older", 30)]
    # A best-effort answer's own budget does not hold a best-effort medium back either (no cap is kept for it).
    paced = Gen("paced", 0.0, session=hot(0), pending_tokens=1, best_effort=True, deadline=5.0)
    later = Gen("later", 1.0, session=hot(1), pending_tokens=40, feeds_medium=True, best_effort=True)
    assert work_of(schedule(view([], running=[paced, later]))) == [("later", 16)]


def test_fcfs_feeds_a_medium_when_it_is_the_oldest_prompt() -> None:
    image = Gen("image", 1.0, session=hot(0), pending_tokens=40, feeds_medium=True)
    text = Gen("text", 2.0, session=hot(1), pending_tokens=30)
    assert work_of(schedule(view([], running=[text, image], policy=FCFS))) == [("image", 16)]
    earlier = Gen("earlier", 0.5, session=hot(1), pending_tokens=30)
    assert work_of(schedule(view([], running=[earlier, image], policy=FCFS))) == [("earlier", 30)]


def test_a_best_effort_medium_goes_beside_deadline_bound_work_when_its_step_fits_the_cap() -> None:
    voice = Gen("voice", 5.0, session=hot(0), pending_tokens=1, deadline=6.0)
    quick = Gen(
        "quick", 1.0, session=hot(1), pending_tokens=40, feeds_medium=True, best_effort=True, medium_seconds=0.01
    )
    slow = Gen("slow", 1.0, session=hot(1), pending_tokens=40, feeds_medium=True, best_effort=True, medium_seconds=0.5)
    # (the cost model's prior: 10 ms a step and 2 ms a token, so 16 cells take 42 ms, and the cap is 0.2 s)
    assert work_of(schedule(view([], running=[voice, quick], time_cap=0.2))) == [("quick", 16)]
    assert work_of(schedule(view([], running=[voice, slow], time_cap=0.2))) == [("voice", 1)]


def test_a_medium_waiting_for_its_encode_beside_the_steps_lets_the_text_go() -> None:
    image = Gen("image", 1.0, hot(0), pending_tokens=40, feeds_medium=True, best_effort=True, medium_ready=False)
    voice = Gen("voice", 5.0, session=hot(1), pending_tokens=12, deadline=6.0)
    assert work_of(schedule(view([], running=[image, voice]))) == [("voice", 12)]
    assert work_of(schedule(view([], running=[image]))) == []  # (nothing to do but wait for it)
