"""Draftless speculation: guesses at a generation's next tokens from its own context, and how many a step feeds.

A generation that decodes one token a step may feed a few more rows in the same step: the tokens that followed
the last place its session's context (its prompt, earlier turns, what it generated) had the same few tokens as
it has now (prompt lookup, an n-gram match). The step computes their logits beside everyone else's rows; the
runner then samples row by row and goes on while what it samples is the guess (runner.py). Each token so comes
from the same sampler, one per row, in order, as one step at a time would give it: greedy output is the same
token for token (up to the float noise any change of batch brings, docs/speculative.md), and seeded sampling
draws the same random numbers in the same order, so its distribution is kept exactly. The cells of rejected rows
are removed (KvManager.trim).

How many rows a guess gets follows what it pays: each generation's measured acceptance (the chance that a guessed
token is taken, given the ones before it were) against what the step cost model predicts the extra rows cost.
When guessing stops paying, a generation guesses again only every RETRY_EVERY steps, with a short guess, to see
whether its text has turned repetitive. Pure logic, no llama.cpp.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Protocol, TypeVar

from kvpool.daemon.engine.cost_model import CostModel, StepShape, within
from kvpool.daemon.engine.step_work import Work

NGRAM_MIN = 2  # a one-token match guesses wrong too often to pay for its rows
WINDOW = 4096  # the most recent tokens of the context searched for a match
DECAY = 0.9  # of the acceptance counts per step that drafted: about the last ten count
PRIOR_ACCEPTED, PRIOR_TRIED = 1.0, 2.0  # before anything is measured: one in two guessed tokens taken
RETRY_EVERY = 16  # steps between short guesses while guessing does not pay
RETRY_TOKENS = 2


class Drafter:
    """One generation's guesses: an index of the n-grams of its session's tokens (kept up to date as they grow)
    and its measured acceptance."""

    def __init__(self, tokens: list[int], ngram_max: int, most: int, stops_guess: Callable[[int], bool]):
        """``tokens``: the session's conversation (the same list, read as it grows); ``ngram_max``: the longest
        match looked for (the longest found wins); ``most``: tokens per guess; ``stops_guess(token)``: a token a
        guess must not run past (the end of a turn: what follows it is the next prompt, not this answer)."""
        self.tokens = tokens
        self.ngram_max = max(NGRAM_MIN, ngram_max)
        self.most = most
        self.stops_guess = stops_guess
        self._index: dict[tuple[int, ...], int] = {}  # n-gram -> where the tokens after its latest match begin
        # ... and after the match before it: a latest match just behind the context's end has few tokens after it
        # (a repeating line), the one before has a whole guess's worth.
        self._before: dict[tuple[int, ...], int] = {}
        self._indexed = max(0, len(tokens) - WINDOW)  # n-grams ending before this position are indexed
        self.accepted, self.tried = PRIOR_ACCEPTED, PRIOR_TRIED
        self._idle_steps = 0
        self.drafted_tokens = self.accepted_tokens = 0

    @property
    def acceptance(self) -> float:
        """The chance that a guessed token is taken, given that the tokens guessed before it were."""
        return self.accepted / self.tried

    def guess(self) -> list[int]:
        """The tokens after the latest earlier place the context ended as it does now (at most ``most``)."""
        tokens = self.tokens
        end = len(tokens)
        if self._indexed > end:  # the conversation lost tokens (a prompt that could not be computed): start again
            self._index.clear()
            self._before.clear()
            self._indexed = max(0, end - WINDOW)
        self._index_up_to(end - 1)  # the n-grams ending before the last token: the current one is no match
        for n in range(self.ngram_max, NGRAM_MIN - 1, -1):
            if end < n:
                continue
            key = tuple(tokens[end - n : end])
            after = self._index.get(key)
            if after is None:
                continue
            if end - after < self.most and key in self._before:
                after = self._before[key]
            guess: list[int] = []
            for token in tokens[after : after + self.most]:
                if token < 0 or self.stops_guess(token):  # a medium's cells, or the end of a turn
                    break
                guess.append(token)
            if guess:
                return guess
        return []

    def _index_up_to(self, end: int) -> None:
        tokens, index, before = self.tokens, self._index, self._before
        for last in range(self._indexed, end):
            for n in range(NGRAM_MIN, self.ngram_max + 1):
                first = last - n + 1
                if first >= 0:
                    key = tuple(tokens[first : last + 1])
                    if key in index:
                        before[key] = index[key]
                    index[key] = last + 1
        self._indexed = max(self._indexed, end)

    def expected_tokens(self, k: int) -> float:
        """Tokens a guess of ``k`` adds, expected: each is taken with the acceptance, if all before it were."""
        a = self.acceptance
        return sum(a**i for i in range(1, k + 1))

    def length(self, paying: int, available: int) -> int:
        """How many tokens of a guess of ``available`` to feed, when ``paying`` is the most that pays: a short retry
        every RETRY_EVERY steps it is none."""
        if paying > 0 or available == 0:
            self._idle_steps = 0
            return paying
        self._idle_steps += 1
        if self._idle_steps < RETRY_EVERY:
            return 0
        self._idle_steps = 0
        return min(RETRY_TOKENS, available)

    def observe(self, drafted: int, accepted: int) -> None:
        """A step fed ``drafted`` guessed tokens and ``accepted`` of them were taken."""
        if not drafted:
            return
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        rejected = 1 if accepted < drafted else 0  # the first refused guess ends the run: the rest say nothing
        self.accepted = DECAY * self.accepted + accepted
        self.tried = DECAY * self.tried + accepted + rejected


class Drafting(Protocol):
    """What a step's work item needs to be given a guess (engine/generation.py)."""

    @property
    def drafter(self) -> Drafter | None: ...

    @property
    def draft_room(self) -> int: ...  # guessed tokens it may take (before its token limit and its context's end)

    @property
    def position(self) -> int: ...

    def admitted(self, guess: list[int]) -> list[int]: ...  # the part of a guess its grammar admits


D = TypeVar("D", bound=Drafting)


def with_drafts(
    step_work: Sequence[Work[D]], capacity: int, spare_outputs: int, cost: CostModel, time_cap: float | None
) -> list[Work[D]]:
    """The step's work with a guess for each decoding generation whose guess pays: the step's tokens per second
    (every generation's token, plus the guesses' expected ones) over its predicted time, one generation after the
    other, the most urgent first. ``capacity``: tokens one decode takes; ``spare_outputs``: output rows beyond one
    per sequence the context has room for; ``time_cap``: the step's cap, which no guess may push it past."""
    chunks = [(w.item.position, w.n_tokens, 1 if w.completes else 0) for w in step_work]
    tokens = sum(w.n_tokens for w in step_work)
    made = float(sum(1 for w in step_work if w.completes))  # tokens the step gives without guesses
    seconds = cost.predict(StepShape.of(chunks))
    out = list(step_work)
    for i, w in enumerate(step_work):
        drafter = w.item.drafter
        if drafter is None or not w.completes or w.n_tokens != 1:
            continue
        guess = w.item.admitted(drafter.guess())
        available = min(len(guess), w.item.draft_room, capacity - tokens, spare_outputs)
        if available <= 0:
            drafter.length(0, 0)
            continue
        best, best_rate, best_seconds = 0, made / seconds, seconds
        for k in range(1, available + 1):
            chunks[i] = (w.item.position, 1 + k, 1 + k)
            predicted = cost.predict(StepShape.of(chunks))
            if time_cap is not None and not within(predicted, time_cap):
                break
            rate = (made + drafter.expected_tokens(k)) / predicted
            if rate > best_rate:
                best, best_rate, best_seconds = k, rate, predicted
        k = drafter.length(best, available)
        chunks[i] = (w.item.position, 1 + k, 1 + k)
        if k != best:  # a retry: this step pays for its rows, if its cap allows them
            best_seconds = cost.predict(StepShape.of(chunks))
            if time_cap is not None and not within(best_seconds, time_cap):
                k, best_seconds = 0, seconds
                chunks[i] = (w.item.position, 1, 1)
        if k:
            out[i] = replace(w, draft=tuple(guess[:k]))
            tokens += k
            spare_outputs -= k
            made += drafter.expected_tokens(k)
            seconds = best_seconds
    return out
