"""Which tokens the next engine step feeds to llama.cpp: pure logic, no llama.cpp, unit-testable.

Every running generation has tokens of its session that are not in the KV yet ("pending"): a whole prompt
at first, then exactly one (the token it just sampled).

- "budgets" (default): earliest deadline first. Decode tokens of deadline-bound generations always ride in
  the next step; prompts are fed in chunks sized by the cost model so that the step stays within the time cap
  (the tightest per-token budget in flight, or the headroom kept for deadline-bound tasks that may ask at any
  moment). Best-effort work only gets what is left.
- "fcfs": every decode token first, then prompts oldest first in chunks as large as the batch allows: the
  behaviour of a server without budgets, kept to measure against.

A medium's cells (an image, audio) are fed whole, from its embeddings, in a decode of their own (llama.cpp takes
tokens or embeddings in one batch, not both; a non-causal image's cells attend to each other both ways), after its
encode: such a step feeds that medium alone. Under "budgets" it goes when it is more urgent than all the text work,
or when it is the oldest prompt waiting and either no generation with a deadline is in flight (a task without
budgets has none) or its step (its encode and its rows) stays within the step's time cap; it cannot be cut to fit
that cap, so a deadline-bound request that arrives during a longer one waits for it (docs/multimodal.md says how
long).
Under "fcfs" it goes when it is the oldest prompt.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from kvpool.daemon.engine.cost_model import CostModel, within

MIN_CHUNK = 8  # the most urgent prompt always moves by at least this much, however tight the cap


class Schedulable(Protocol):
    @property
    def pending_tokens(self) -> int: ...

    @property
    def feedable_tokens(self) -> int: ...  # how many pending tokens one step may feed (a chunk may end early)

    @property
    def position(self) -> int: ...  # where its next tokens go (tokens already in the KV)

    @property
    def arrival(self) -> float: ...

    @property
    def deadline(self) -> float: ...  # when its next token is due (math.inf: no deadline)

    @property
    def best_effort(self) -> bool: ...

    @property
    def priority(self) -> int: ...

    @property
    def feeds_medium(self) -> bool: ...  # its next cells are a medium's, fed whole in a step of their own

    @property
    def medium_seconds(self) -> float: ...  # what that feed costs before its rows are decoded (its encode)

    @property
    def medium_ready(self) -> bool: ...  # that feed can go now (not waiting for an encode beside the steps)


T = TypeVar("T", bound=Schedulable)


@dataclass(frozen=True, slots=True)
class Work(Generic[T]):
    item: T
    n_tokens: int  # how many of its pending tokens this step feeds
    completes: bool  # True when this chunk feeds the last pending token: the step samples for it
    draft: tuple[int, ...] = ()  # guessed tokens fed after it, each with its row of logits (engine/drafts.py)


@dataclass(frozen=True, slots=True)
class StepPolicy:
    """How steps are filled and who waits: the ``scheduling`` setting, read once (``step_policy``), so that the
    scheduler, schedule() and the engine ask this object instead of the setting."""

    budgets: bool  # False: first come first served

    @property
    def name(self) -> str:
        return "budgets" if self.budgets else "fcfs"

    @property
    def checks_budgets(self) -> bool:
        """Admission refuses a deadline-bound request whose first token cannot make its budget, and the cost model
        that predicts it is calibrated at start."""
        return self.budgets

    @property
    def preempts(self) -> bool:
        """A deadline-bound generation may swap a running best-effort one out when every slot is generating."""
        return self.budgets

    def order(self, waiting: list[T]) -> None:
        """The waiting queue in the order it is admitted: most urgent first (fcfs: arrival order, as it is)."""
        if self.budgets:
            waiting.sort(key=urgency)

    def work(self, ready: list[T], capacity: int, cost: CostModel, time_cap: float | None) -> list[Work[T]]:
        text = [g for g in ready if not g.feeds_medium]
        media = [g for g in ready if g.feeds_medium and g.medium_ready]  # (the others wait for their encode)
        step_work = budgeted_work(text, capacity, cost, time_cap) if self.budgets else fcfs_work(text, capacity)
        if media and self._medium_first(media, step_work, cost, time_cap):
            return [medium_work(min(media, key=urgency if self.budgets else _arrival))]
        return step_work

    def _medium_first(self, media: list[T], step_work: list[Work[T]], cost: CostModel, time_cap: float | None) -> bool:
        """Whether this step feeds a medium instead of the text work it would (see the module's docstring)."""
        if not step_work:
            return True
        prompts = [w.item for w in step_work if w.item.pending_tokens > 1]
        oldest = min((g.arrival for g in prompts), default=float("inf"))
        if not self.budgets:
            return min(g.arrival for g in media) < oldest
        first = min(media, key=urgency)
        if urgency(first) < min(urgency(w.item) for w in step_work):
            return True
        if first.arrival >= oldest:
            return False
        # Deadline-bound work is what has a deadline and is not best-effort: a task without budgets (the default's)
        # has none, and a medium that waited for its answer would wait for all of it.
        if not any(not w.item.best_effort and math.isfinite(w.item.deadline) for w in step_work):
            return True
        # Deadline-bound work is in flight: the medium goes only in a step that stays within the cap it keeps.
        n = first.feedable_tokens
        seconds = cost.predict(cost.shape([(first.position, n, n == first.pending_tokens)])) + first.medium_seconds
        return time_cap is not None and within(seconds, time_cap)


def step_policy(scheduling: str) -> StepPolicy:
    return StepPolicy(budgets=scheduling != "fcfs")


def _arrival(g: Schedulable) -> float:
    return g.arrival


def medium_work(g: T) -> Work[T]:
    """The step that feeds ``g``'s medium: its cells whole (from where its computed ones end)."""
    n = g.feedable_tokens
    return Work(g, n, n == g.pending_tokens)


def urgency(g: Schedulable) -> tuple[bool, float, int, float]:
    """Sort key: deadline-bound before best-effort, then earliest deadline, higher priority, older."""
    return (g.best_effort, g.deadline, -g.priority, g.arrival)


def fcfs_work(running: list[T], token_budget: int) -> list[Work[T]]:
    decoding = [g for g in running if g.pending_tokens == 1]
    prefilling = sorted((g for g in running if g.pending_tokens > 1), key=lambda g: g.arrival)
    step_work = [Work(g, 1, True) for g in decoding[:token_budget]]
    budget = token_budget - len(step_work)
    for g in prefilling:
        if budget <= 0:
            break
        n = min(g.feedable_tokens, budget)
        step_work.append(Work(g, n, n == g.pending_tokens))
        budget -= n
    return step_work


def budgeted_work(running: list[T], token_budget: int, cost: CostModel, time_cap: float | None) -> list[Work[T]]:
    step_work: list[Work[T]] = []
    chunks: list[tuple[int, int, bool]] = []

    def fits(chunk: tuple[int, int, bool]) -> bool:
        if sum(c[1] for c in chunks) + chunk[1] > token_budget:
            return False
        return time_cap is None or within(cost.predict(cost.shape([*chunks, chunk])), time_cap)

    def add(g: T, n: int) -> None:
        chunk = (g.position, n, n == g.pending_tokens)
        step_work.append(Work(g, n, chunk[2]))
        chunks.append(chunk)

    for g in sorted((g for g in running if g.pending_tokens == 1), key=urgency):
        if sum(c[1] for c in chunks) >= token_budget:
            break
        if not g.best_effort or fits((g.position, 1, True)):  # deadline-bound decode tokens always ride
            add(g, 1)
    for g in sorted((g for g in running if g.pending_tokens > 1), key=urgency):
        room = token_budget - sum(c[1] for c in chunks)
        if room <= 0:
            break
        if g.best_effort and any(not w.item.best_effort and w.item.pending_tokens > 1 for w in step_work):
            break  # a deadline-bound prompt is in this step: keep the step short so its first token comes soon
        n = _largest_chunk(g, min(g.feedable_tokens, room), fits)
        if n == 0:
            prompt_moving = any(w.item.pending_tokens > 1 for w in step_work)
            if prompt_moving or (g.best_effort and step_work):
                break
            n = min(g.feedable_tokens, room, MIN_CHUNK)  # progress for the most urgent prompt
        add(g, n)
    if not step_work and running:  # nothing fitted the cap: the most urgent work still moves, by the least amount
        g = min(running, key=urgency)
        add(g, min(g.feedable_tokens, MIN_CHUNK))
    return step_work


def _largest_chunk(g: Schedulable, most: int, fits: Callable[[tuple[int, int, bool]], bool]) -> int:
    """The largest n <= most whose chunk keeps the step within its cap (predicted time grows with n)."""
    lo, hi = 0, most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits((g.position, mid, mid == g.pending_tokens)):
            lo = mid
        else:
            hi = mid - 1
    return lo


def steps_for(
    prompt_tokens: int,
    decoders: Sequence[int],
    position: int,
    token_budget: int,
    cost: CostModel,
    time_cap: float | None,
) -> tuple[int, float]:
    """How many steps and seconds a prompt of ``prompt_tokens`` at ``position`` needs next to a decode token at
    each of ``decoders``' positions, in chunks that keep each step within ``time_cap`` (for admission control)."""
    if prompt_tokens <= 0:
        return 0, 0.0
    room = max(1, token_budget - len(decoders))
    chunk = room
    decoding = [(at, 1, 1) for at in decoders]

    def step(n: int) -> float:
        return cost.predict(cost.shape([*decoding, (position, n, 1)]))

    if time_cap is not None:
        lo, hi = MIN_CHUNK, room
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if within(step(mid), time_cap):
                lo = mid
            else:
                hi = mid - 1
        chunk = min(room, lo)

    full, rest = divmod(prompt_tokens, chunk)
    return full + (rest > 0), full * step(chunk) + (step(rest) if rest else 0.0)
