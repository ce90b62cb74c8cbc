"""The scheduler: it owns the generations' queues, their admission and their statistics.

- ``waiting``: accepted generations whose session has no hot slot yet; ``running``: generations in a hot slot,
  fed by steps until they finish.
- Admission (``admit``), when a request arrives: the task's queue limit, then its latency budgets. Under
  "budgets" a deadline-bound request whose first token cannot make its budget is refused at once, with the
  estimate, instead of being served late.
- Once a step, ``view()`` is what engine/schedule.py decides from (who gets a hot slot, who is swapped out, what
  the step feeds); the queues then follow the moves as engine/moves.py applies them (``start``, ``preempted``).
Runs on the engine thread.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass

from kvpool.daemon.config import Config, TaskProfile
from kvpool.daemon.engine.cost_model import CostModel, within
from kvpool.daemon.engine.generation import Generation
from kvpool.daemon.engine.schedule import SchedulerView
from kvpool.daemon.engine.step_work import step_policy, steps_for
from kvpool.daemon.kv.manager import KvManager
from kvpool.daemon.kv.sessions import Session, SessionTable
from kvpool.daemon.ops.latency_stats import TaskStats
from kvpool.daemon.refusals import RequestRefused
from kvpool.protocol import ErrorCode

log = logging.getLogger("kvpool.engine")

# A deadline-bound request that arrives during a step waits for it, then needs a short step of its own: steps
# may take this share of the tightest first-token budget of a task with open sessions (measured: 0.6 keeps the
# voice p99 within its 300 ms budget while long prompts still move in large chunks).
HEADROOM = 0.6


@dataclass(frozen=True, slots=True)
class Budget:
    """A generation's budgets, from its task's profile tightened by the request's own deadline; 0 means none."""

    ttft_s: float = 0.0
    tpot_s: float = 0.0
    best_effort: bool = False
    priority: int = 0


def _ms(ms: float) -> str:
    """Milliseconds as a sentence gives them: whole ones, with a tenth below 10 (a 0.5 ms budget is not "0 ms")."""
    return f"{ms:.1f} ms" if ms < 10 else f"{ms:.0f} ms"


class Scheduler:
    def __init__(self, config: Config, sessions: SessionTable, batch_capacity: int, attention_tile: int = 0):
        self.config = config
        self.sessions = sessions
        self.capacity = batch_capacity
        # (Model.attention_tile_rows: from how many rows a step's attention is tiled, and may be decoded in parts)
        self.cost = CostModel(tile=attention_tile, parts=config.step_parts)
        self.policy = step_policy(config.scheduling)
        self.waiting: list[Generation] = []
        self.running: list[Generation] = []
        self.task_stats: defaultdict[str, TaskStats] = defaultdict(TaskStats)
        # Resident memory above memory_high_water (kept by housekeeping): new sessions are refused.
        self.over_memory = False
        self._by_session: dict[str, Generation] = {}

    # ------------------------------------------------------------------ queues

    @property
    def idle(self) -> bool:
        return not (self.running or self.waiting)

    def generations(self) -> list[Generation]:
        return [*self.running, *self.waiting]

    def generation_of(self, session: Session) -> Generation | None:
        return self._by_session.get(session.id)

    def add(self, g: Generation) -> None:
        """An admitted generation: it waits for a hot slot (the next schedule() may give it one)."""
        g.session.busy = True
        self._by_session[g.session.id] = g
        self.waiting.append(g)

    def remove(self, g: Generation) -> None:
        """A generation that ended, however: out of the queues, its session free for the next one."""
        g.session.busy = False
        self._by_session.pop(g.session.id, None)
        if g in self.running:
            self.running.remove(g)
        elif g in self.waiting:
            self.waiting.remove(g)

    def in_flight(self, task: str) -> int:
        return sum(1 for g in self.generations() if g.session.task == task)

    def in_flight_for(self, client: bytes) -> int:
        return sum(1 for g in self.generations() if g.client == client)

    def queue_depth(self, task: str) -> int:
        """Generations of a task that have not produced their first token yet."""
        return sum(1 for g in self.generations() if g.session.task == task and g.first_token_at is None)

    # ------------------------------------------------------------------ admission

    def admit(
        self,
        session: Session,
        deadline_ms: float | None,
        prompt_tokens: int,
        received_at: float,
        encode_seconds: float = 0.0,
        slot_at_hand: bool = True,
    ) -> Budget:
        """The budgets a new generation of ``session`` runs with, or RequestRefused: its task's queue is full, or
        (under "budgets") its first token cannot come within its budget. ``prompt_tokens``: what it will
        compute (a shared prefix's part excluded); ``encode_seconds``: what its media's encodes are expected to
        take; ``slot_at_hand``: a hot slot can be had at once (its own, a free one, an idle session's, or a best-effort
        generation's to swap out); else it waits for a running answer to end, which the estimate counts."""
        task = session.task
        profile = self.config.tasks.get(task) or TaskProfile()  # a recovered session's task may have left
        if profile.max_queue and self.in_flight(task) >= profile.max_queue:
            self.count_refusal(task, ErrorCode.OVERLOADED)
            raise RequestRefused(
                ErrorCode.OVERLOADED,
                f"Task {task!r} already has {profile.max_queue} generations queued or running (its max_queue); "
                "retry when one has finished.",
            )
        ttft_ms = profile.ttft_ms
        if deadline_ms is not None:
            ttft_ms = min(ttft_ms, deadline_ms) if ttft_ms else deadline_ms
        budget = Budget(ttft_ms / 1000.0, profile.tpot_ms / 1000.0, profile.best_effort, profile.priority)
        if ttft_ms and not profile.best_effort and self.policy.checks_budgets:
            deadline = received_at + ttft_ms / 1000.0
            estimate = self.estimate_ttft(prompt_tokens, len(session.tokens), deadline, received_at) + encode_seconds
            if not slot_at_hand:
                estimate += self.until_a_slot_frees()
            if not within(estimate, ttft_ms / 1000.0):
                self.count_refusal(task, ErrorCode.BUDGET_UNMEETABLE)
                raise RequestRefused(
                    ErrorCode.BUDGET_UNMEETABLE,
                    f"The first token would take about {_ms(estimate * 1000.0)} but the budget is {_ms(ttft_ms)} "
                    f"({prompt_tokens} prompt tokens, {len(self.running)} generations running"
                    f"{'' if slot_at_hand else ', every hot slot held by an answer that cannot be swapped out'}); "
                    "shorten the prompt, retry later, or use a best-effort task.",
                    {
                        "estimate_ms": round(estimate * 1000.0, 1),
                        "budget_ms": ttft_ms,
                        "waited_ms": round((time.monotonic() - received_at) * 1000.0, 1),
                        "step_cap_ms": round((self.step_time_cap() or 0.0) * 1000.0, 1),
                    },
                )
        return budget

    def count_refusal(self, task: str, code: ErrorCode) -> None:
        """A request of ``task`` refused with ``code``: its refusals column in status."""
        self.task_stats[task].refusals[code.value] += 1

    def first_token_due(self) -> bool:
        """A generation with a first-token budget waits for its first token (no step should be slower than it must)."""
        return any(g.ttft_s and g.first_token_at is None for g in self.generations())

    def step_time_cap(self) -> float | None:
        """The longest a step may take: the tightest per-token budget in flight, and a share (HEADROOM) of the
        tightest first-token budget of the tasks with open sessions (one of them may ask at any moment, and
        must not wait behind a long prompt chunk)."""
        caps = [g.tpot_s for g in self.running if g.tpot_s and g.first_token_at is not None and not g.best_effort]
        for task, profile in self.config.tasks.items():
            if profile.ttft_ms and not profile.best_effort and self.sessions.count(task):
                caps.append(profile.ttft_ms / 1000.0 * HEADROOM)
        return min(caps) if caps else None

    def until_a_slot_frees(self) -> float:
        """Seconds until the running answer nearest its end has ended, were it to run to its max_tokens (it may end
        sooner): what a generation waits for that no hot slot can be had for."""
        left = [g.request.max_tokens - g.completion_tokens for g in self.running if not g.best_effort]
        if not left:
            return 0.0
        step = self.cost.predict(self.cost.shape([(g.position, 1, 1) for g in self.running]))
        return max(0, min(left)) * step

    def estimate_ttft(self, prompt_tokens: int, position: int, deadline: float, received_at: float) -> float:
        """Seconds from the request's arrival to its first token: the time it already waited (the step that was
        in flight when it came), then the prompts due no later than it and its own, in chunks next to the
        streams already decoding."""
        cap = self.step_time_cap()
        decoders = [g.position for g in self.running if g.pending_tokens == 1]
        ahead = sum(
            len(g.new_tokens) + g.pending_tokens
            for g in self.generations()
            if not g.best_effort and g.first_token_at is None and g.deadline <= deadline
        )
        _, seconds = steps_for(ahead + prompt_tokens, decoders, position, self.capacity, self.cost, cap)
        return time.monotonic() - received_at + seconds

    # ------------------------------------------------------------------ each step (engine/schedule.py decides)

    def view(self, kv: KvManager, no_room: frozenset[int], closed: bool) -> SchedulerView[Generation, Session]:
        """What schedule() reads, now."""
        return SchedulerView(
            waiting=tuple(self.waiting),
            running=tuple(self.running),
            free_slots=kv.free_slot_count,
            idle_resident=tuple(kv.idle_resident()),
            policy=self.policy,
            capacity=self.capacity,
            cost=self.cost,
            time_cap=self.step_time_cap(),
            prefix_sharing=kv.prefix_sharing,
            no_room=no_room,
            closed=closed,
        )

    def order_waiting(self) -> None:
        """The order schedule() admits them in (StepPolicy.order)."""
        self.policy.order(self.waiting)

    def start(self, g: Generation) -> None:
        """``g``'s session is hot (and holds its prompt, engine/moves.py): it runs from this step on."""
        self.waiting.remove(g)
        g.started = True
        self.running.append(g)

    def preempted(self, victim: Generation) -> None:
        """``victim`` was swapped out of its slot: it queues again, to resume where it stopped."""
        self.running.remove(victim)
        self.waiting.append(victim)
        self.task_stats[victim.session.task].preemptions += 1
