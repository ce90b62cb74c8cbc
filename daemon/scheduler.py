"""Which tokens the next engine step feeds to llama.cpp: pure bookkeeping, no llama.cpp, unit-testable.

Every running generation has some tokens of its session's history that are not in the KV yet ("pending"):
a whole new prompt at first, then exactly one (the token it just sampled). One step feeds one token to
every decoding generation first, so a long prompt never stalls the streams already flowing, and then
spends the rest of the step's token budget on prompts, oldest first, in chunks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar


class Schedulable(Protocol):
    @property
    def pending_tokens(self) -> int: ...

    @property
    def arrival(self) -> float: ...


T = TypeVar("T", bound=Schedulable)


@dataclass(frozen=True, slots=True)
class Work(Generic[T]):
    item: T
    n_tokens: int  # how many of its pending tokens this step feeds
    completes: bool  # True when this chunk feeds the last pending token: the step samples for it


def plan_step(running: list[T], token_budget: int) -> list[Work[T]]:
    """Decode tokens for every generating item, then prefill chunks FCFS within ``token_budget``."""
    decoding = [g for g in running if g.pending_tokens == 1]
    prefilling = sorted((g for g in running if g.pending_tokens > 1), key=lambda g: g.arrival)
    plan = [Work(g, 1, True) for g in decoding[:token_budget]]
    budget = token_budget - len(plan)
    for g in prefilling:
        if budget <= 0:
            break
        n = min(g.pending_tokens, budget)
        plan.append(Work(g, n, n == g.pending_tokens))
        budget -= n
    return plan
