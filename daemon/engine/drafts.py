"""Draftless speculation: guesses at a generation's next tokens from its own context, and how many a step feeds.

A generation that decodes one token a step may feed a few more rows in the same step: the tokens that followed
the last place its session's context (its prompt, earlier turns, what it generated) had the same few tokens as
it has now (prompt lookup, an n-gram match), or, where its last token took another's place after the same few
tokens (a record's new value, a renamed word), the tokens that followed the one it replaced. The step computes
their logits beside everyone else's rows; the runner then samples row by row and goes on while what it samples
is the guess (runner.py). Each token so comes from the same sampler, one per row, in order, as one step at a
time would give it: greedy output is the same token for token (up to the float noise any change of batch
brings, docs/speculative.md), and seeded sampling draws the same random numbers in the same order, so its
distribution is kept exactly. The cells of rejected rows are removed (KvManager.trim).

How many rows a guess gets follows what it pays: each generation's measured acceptance (the chance that a guessed
token is taken, given the ones before it were) against what the step cost model predicts the extra rows cost.
When guessing stops paying, a generation guesses again only every RETRY_EVERY steps, with a short guess, to see
whether its text has turned repetitive. Pure logic, no llama.cpp.

A request may also carry a *prediction*: the answer its client expects (the file an edit will give back mostly
unchanged; OpenAI's Predicted Outputs). Its n-grams are a second place to find what comes next, read in order
from where the answer left it last, and its guesses are measured apart from the context's.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from itertools import islice, takewhile
from typing import Protocol, TypeVar

from kvpool.daemon.engine.cost_model import CostModel, within
from kvpool.daemon.engine.step_work import Work

WINDOW = 4096  # the most recent tokens of the context searched for a match
KEEP = 4  # the latest matches remembered per n-gram (a grammar may admit what follows an older one only)
CANDIDATES = 8  # matches a constrained generation's grammar is asked about, at most, per guess
DECAY = 0.9  # of the acceptance counts per step that drafted: about the last ten count
PRIOR_ACCEPTED, PRIOR_TRIED = 1.0, 2.0  # before anything is measured: one in two guessed tokens taken
RETRY_EVERY = 16  # steps between short guesses while guessing does not pay
RETRY_TOKENS = 3  # (four rows: the logits kernel's tiles take an even number at no extra pass)
TRUSTED_MATCH = 4  # the shortest match whose kind of guess is measured as soon as it comes (Drafter._trusted)
SUBSTITUTED_MIN = 3  # the shortest match before a replaced token that is guessed from
# Before anything is measured, a guess that starts at a slot which took other tokens before (a record's value, a
# counter, a number's length) is expected taken one time in four: too little to pay for a row at the step costs
# measured, so such a guess waits for the slot's token to be sampled, and the next step guesses what follows it.
VARYING_PRIOR = 0.25
FORCED = 0  # the match length a guess of what a grammar forces is measured under (no n-gram is that short)
# Before anything is measured, a guess of a grammar's forced text is expected taken nine times in ten (Gemma 3's
# were 0.88-0.95 a row, docs/speculative.md): what the grammar forces the model writes, only perhaps split
# otherwise. The answer's other guesses so far are a poor start for it: its first short matches are often refused,
# and from their figures a forced key would be fed a token or three a step.
FORCED_PRIOR = 0.9

Admitted = Callable[[list[int]], list[int]]  # the part of a guess a generation's grammar admits


class Drafter:
    """One generation's guesses: an index of the n-grams of its session's tokens (kept up to date as they grow)
    and its measured acceptance, for each match length (a one-token match guesses wrong more often than a long
    one, and pays or not on its own figures)."""

    def __init__(self, tokens: list[int], ngram_max: int, most: int, stops_guess: Callable[[int], bool]):
        """``tokens``: the session's conversation (the same list, read as it grows); ``ngram_max``: the longest
        match looked for (the longest found wins); ``most``: tokens per guess; ``stops_guess(token)``: a token a
        guess must not run past (the end of a turn: what follows it is the next prompt, not this answer)."""
        self.tokens = tokens
        self.ngram_max = max(1, ngram_max)
        self.most = most
        self.stops_guess = stops_guess
        # n-gram -> where the tokens after its latest KEEP matches begin, the latest last
        self._index: dict[tuple[int, ...], list[int]] = {}
        self._indexed = max(0, len(tokens) - WINDOW)  # n-grams ending before this position are indexed
        self._window_start = self._indexed  # (a run is counted from here: what lies before was never indexed)
        self._stats: dict[tuple[int, bool, bool], list[float]] = {}  # the guesses' _key -> [accepted, tried], decayed
        # All match lengths together, decayed: the context's guesses (False) and the prediction's (True) apart.
        self._overall = {False: [PRIOR_ACCEPTED, PRIOR_TRIED], True: [PRIOR_ACCEPTED, PRIOR_TRIED]}
        self.matched = 0  # the match length of the last guess
        # Where the last guess's first token came from (None: no earlier place, a grammar's forced text), and the
        # context's length then.
        self._start: int | None = None
        self._end = 0
        self._constrained = False  # (the last guess was asked of the generation's grammar)
        # Positions of the context that took another token than the same few tokens had before them at an earlier
        # place: where a guess was refused, and both ends of a substitution found (_matches). A guess that starts
        # at one starts at a slot that changes (a record's value, a counter, a number's length): its acceptance is
        # measured apart from the other guesses of its match length.
        self._varying: set[int] = set()
        self._idle_steps = 0
        self.drafted_tokens = self.accepted_tokens = 0
        # What the generation's grammar forces next, as tokens (jump_forward = "guess"; engine/jumps.py): the guess
        # whenever there is such a text.
        self.forced: Callable[[], list[int]] | None = None
        self.piece: Callable[[int], bytes] | None = None  # a token's bytes (the model's), to read forced text with
        self._predicted: list[int] = []
        self._predicted_index: dict[tuple[int, ...], list[int]] = {}  # n-gram -> where the prediction goes on after it
        self._read = 0  # where in the prediction the answer is, as far as the prediction's guesses tell
        self._from_prediction = False  # (the last guess came from the prediction; _start is a place in it)
        self.predicted_accepted = self.predicted_rejected = 0  # the prediction's guessed tokens taken, refused

    def predict(self, tokens: list[int], lead: Sequence[int] = ()) -> None:
        """The answer the client expects (a request's prediction): guesses follow it where the answer does.
        ``lead``: the context's last tokens before the answer (the prompt's end), indexed as if they stood before the
        prediction, so that the answer's first tokens match it as long as the context's earlier answers do."""
        lead = list(lead)[-self.ngram_max :]
        joined = lead + list(tokens)
        self._predicted = list(tokens)
        self._predicted_index.clear()
        for after in range(len(lead) + 1, len(joined)):  # (places in the prediction past its first token)
            for ngram in _ngrams_before(joined, after, self.ngram_max):
                self._predicted_index.setdefault(ngram, []).append(after - len(lead))
        self._read = 0

    @property
    def from_prediction(self) -> bool:
        """The last guess came from the request's prediction (its place is one in the prediction, not the context)."""
        return self._from_prediction

    @property
    def acceptance(self) -> float:
        """The chance that a token of the last guess is taken, given that the ones before it were: as measured
        for guesses of its match length (apart for those that start at a changing slot), starting from what all
        its guesses measured (a match length it has not tried yet is as good as the others until it shows
        otherwise), from VARYING_PRIOR at a changing slot, or from FORCED_PRIOR for a grammar's forced text."""
        key = self._key
        overall = self._overall[key[2]]
        if key[1]:
            start = VARYING_PRIOR
        elif key[0] == FORCED:  # (never the prediction's: its matches are a token or longer)
            start = FORCED_PRIOR
        else:
            start = overall[0] / overall[1]
        accepted, tried = self._stats.get(key, (0.0, 0.0))
        return (accepted + PRIOR_TRIED * start) / (tried + PRIOR_TRIED)

    def guess(self, admitted: Admitted | None = None) -> list[int]:
        """The tokens after the latest earlier place the context ended as it does now, for the longest such
        ending (at most ``most``). Past the context's end, the guess goes on with itself: a repeating line repeats.
        Where the context's last token replaced another (a record's new value, a renamed word), the tokens after
        the one it replaced are guessed too, when the match before it is longer than any that ends with it.
        ``admitted``: a generation's grammar; then the longest part it admits of the latest CANDIDATES matches.
        Where the grammar forces a text (``forced``), that text is the guess, split as the model wrote it where
        the context has it (_as_written)."""
        end = self._end = len(self.tokens)
        self._constrained = admitted is not None
        self._from_prediction = False
        if self._indexed > end:  # the conversation lost tokens (a prompt that could not be computed): start again
            self._index.clear()
            self._varying.clear()
            self._indexed = self._window_start = max(0, end - WINDOW)
        self._index_up_to(end - 1)  # the n-grams ending before the last token: the current one is no match
        if self.forced is not None and (forced := self.forced()):
            self.matched, self._start = FORCED, None
            return self._as_written(forced, end)[: self.most]
        best: list[int] = []
        for asked, (matched, start, whole, predicted) in enumerate(self._matches(end), 1):
            if admitted is None:
                self.matched, self._start, self._from_prediction = matched, start, predicted
                return whole
            part = admitted(whole)
            if len(part) > len(best):
                best, self.matched, self._start, self._from_prediction = part, matched, start, predicted
            if (part and len(part) == len(whole)) or asked >= CANDIDATES:
                return best
        return best

    def _as_written(self, forced: list[int], end: int) -> list[int]:
        """``forced`` (the tokenizer's tokens of what the grammar forces next) as the model wrote the same text after
        the latest of CANDIDATES places that ended as the context does now: a model may split a text otherwise than
        its tokenizer does (Gemma 3 writes ``watt`` ``s`` where its tokenizer has ``watts``), and a guess split the
        tokenizer's way was refused there in every record. Where the model wrote the text's end merged with what
        followed it, the guess stops before that token; where the place's tokens end first (at ``most``), the
        guess is the part they spell. ``forced`` itself where no earlier place spelled the text (or no ``piece``
        reads a token's bytes). Matches in the context only: a substitution found marks changing slots, and a
        prediction's tokens are not the model's."""
        if self.piece is None:
            return forced
        text = b"".join(map(self.piece, forced))
        for _, _, whole, predicted in islice(self._matches(end, substitutions=False), CANDIDATES):
            if predicted:  # (a prediction is the tokenizer's or the client's tokens, not the model's)
                continue
            written, spelled = [], b""
            for token in whole:
                part = self.piece(token)
                if part and text.startswith(spelled + part):
                    written.append(token)
                    spelled += part
                    if len(spelled) == len(text):
                        return written
                    continue
                if written and part and (spelled + part).startswith(text):  # (its end merged with what followed)
                    return written
                break
            else:  # (the place's tokens ran out, at ``most`` or a turn's end, all of them the text's)
                if written:
                    return written
        return forced

    @property
    def _key(self) -> tuple[int, bool, bool]:
        """What the last guess's acceptance is measured under: its match length, whether it starts at a changing
        slot of the context, and whether it came from the prediction."""
        varying = not self._from_prediction and self._start in self._varying
        return self.matched, varying, self._from_prediction

    @property
    def _trusted(self) -> bool:
        """The last guess is of a kind that is mostly right: forced text, a match (or the tokens before a
        substitution) of TRUSTED_MATCH tokens or more, what the generation's grammar admitted, or what its client
        predicted; not one that starts at a changing slot. (A short match in free text is often wrong: measuring
        each one at once cost free chat more than it gave.)"""
        matched, varying, predicted = self._key
        return not varying and (predicted or self._constrained or matched == FORCED or abs(matched) >= TRUSTED_MATCH)

    def _matches(self, end: int, substitutions: bool = True) -> Iterator[tuple[int, int, list[int], bool]]:
        """Each earlier place's continuation, the longest match first, the latest first among equals (and the
        prediction's before the context's): its match length, where it starts, its tokens, and whether it is the
        prediction's. The match length is n for a match of the last n tokens; -n for a match of the n tokens before
        the last, which stood at an earlier place where another token followed them (the last token took its
        place: what came after it there is the guess)."""
        tokens = self.tokens
        # The run of one token the last token follows: an n-gram before the last token no longer than it is that
        # token repeated, whose places lie inside earlier runs (_index_up_to), where the run went on.
        run_before_last = _run_ending_at(tokens, end - 2, self.ngram_max) if end >= 2 else 0
        for n in range(min(self.ngram_max, end), 0, -1):
            ngram = tuple(tokens[end - n : end])
            if (after := self._in_prediction(ngram)) is not None and (whole := self._predicted_run(after)):
                yield n, after, whole, True
            for after in reversed(self._index.get(ngram, ())):
                if whole := self._continuation(after, end):
                    yield n, after, whole, False
            if not substitutions or n < SUBSTITUTED_MIN or n >= end:
                continue
            for after in reversed(self._index.get(tuple(tokens[end - 1 - n : end - 1]), ())):
                if n <= run_before_last and tokens[after] == tokens[end - 2]:
                    continue
                if after < end - 1 and tokens[after] != tokens[end - 1]:
                    self._varying.update((after, end - 1))
                    if whole := self._continuation(after + 1, end):
                        yield -n, after + 1, whole, False

    def _in_prediction(self, ngram: tuple[int, ...]) -> int | None:
        """Where the prediction goes on after ``ngram``: its first such place from where the answer is in it (the
        prediction is read in order), else its last one before; None where it has no more tokens after it."""
        places = self._predicted_index.get(ngram)
        if not places:
            return None
        ahead = bisect.bisect_left(places, self._read)  # (the places are in order)
        return places[ahead] if ahead < len(places) else places[-1]

    def _predicted_run(self, after: int) -> list[int]:
        """The prediction from ``after`` on, up to ``most`` tokens and short of the end of a turn."""
        return list(takewhile(lambda token: not self.stops_guess(token), self._predicted[after : after + self.most]))

    def _continuation(self, after: int, end: int) -> list[int]:
        tokens, out = self.tokens, []
        while len(out) < self.most:
            at = after + len(out)
            token = tokens[at] if at < end else out[at - end]  # (past the end: the guess itself)
            if token < 0 or self.stops_guess(token):  # a medium's cells, or the end of a turn
                break
            out.append(token)
        return out

    def _index_up_to(self, end: int) -> None:
        """Index the n-grams ending before ``end``. An n-gram of one token repeated is indexed once per run of that
        token, where the run reached n: what follows it there is the run as long as that one from its start, so a
        run (a number's zeros, a rule of dashes) is guessed to go on as long as the earlier one. Indexed at every
        place inside the run, its latest place was the earlier run's last, and every guess ended the run there. (A
        run longer than the longest n-gram matches its own start once it is that long: it is guessed to go on.)"""
        tokens, index = self.tokens, self._index
        for last in range(self._indexed, end):
            run = _run_ending_at(tokens, last, min(self.ngram_max + 1, last + 1 - self._window_start))
            for ngram in _ngrams_before(tokens, last + 1, self.ngram_max):
                if len(ngram) < run:  # (inside a longer run of its one token)
                    continue
                positions = index.setdefault(ngram, [])
                positions.append(last + 1)
                if len(positions) > KEEP:
                    del positions[0]
        self._indexed = max(self._indexed, end)

    def expected_tokens(self, k: int) -> float:
        """Tokens a guess of ``k`` adds, expected: each is taken with the acceptance, if all before it were."""
        a = self.acceptance
        return sum(a**i for i in range(1, k + 1))

    def length(self, paying: int, available: int) -> int:
        """How many tokens of a guess of ``available`` to feed, when ``paying`` is the most that pays: where it is
        none, a short guess all the same for a likely-right kind not measured yet, and every RETRY_EVERY steps."""
        if paying > 0 or available == 0:
            self._idle_steps = 0
            return paying
        # A kind of guess not measured yet is measured at once, short, where it is likely right: priced on the
        # others' figures, a long copied run waited RETRY_EVERY steps after a short match's guess was refused at
        # the answer's first token.
        if self._key in self._stats or not self._trusted:
            self._idle_steps += 1
            if self._idle_steps < RETRY_EVERY:
                return 0
            self._idle_steps = 0
        return min(RETRY_TOKENS, available)

    def observe(self, drafted: int, accepted: int, kept: int | None = None) -> None:
        """A step fed ``drafted`` tokens of the last guess and ``accepted`` of them were taken; ``kept`` of those
        are in the answer (fewer where a stop ended it inside the run; the prediction's counts are of these)."""
        kept = accepted if kept is None else kept
        if not drafted:
            return
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        rejected = 1 if accepted < drafted else 0  # the first refused guess ends the run: the rest say nothing
        for stats in (self._stats.setdefault(self._key, [0.0, 0.0]), self._overall[self._from_prediction]):
            stats[0] = DECAY * stats[0] + accepted
            stats[1] = DECAY * stats[1] + accepted + rejected
        if self._from_prediction:
            assert self._start is not None
            self.predicted_accepted += kept
            self.predicted_rejected += drafted - kept
            # The answer took the guess's first ``accepted`` tokens and then sampled one: if that one follows the
            # prediction too, the answer is next at the place after it.
            self._read = self._start + accepted + 1
        elif rejected and self._start is not None:
            self._varying.add(self._end + accepted)  # (where the token sampled in place of the guessed one goes)


def _run_ending_at(tokens: Sequence[int], last: int, most: int) -> int:
    """How many times the token at ``last`` is repeated up to it (1: the token before is another), at most ``most``."""
    token, run = tokens[last], 1
    while run < most and last - run >= 0 and tokens[last - run] == token:
        run += 1
    return run


def _ngrams_before(tokens: Sequence[int], after: int, most: int) -> Iterator[tuple[int, ...]]:
    """The n-grams that end just before place ``after`` of ``tokens``, of 1 to ``most`` tokens."""
    for n in range(1, min(most, after) + 1):
        yield tuple(tokens[after - n : after])


class Drafting(Protocol):
    """What a step's work item needs to be given a guess (engine/generation.py)."""

    @property
    def drafter(self) -> Drafter | None: ...

    @property
    def draft_room(self) -> int: ...  # guessed tokens it may take (before its token limit and its context's end)

    @property
    def position(self) -> int: ...

    @property
    def admitted(self) -> Admitted | None: ...  # the part of a guess its grammar admits (None: no grammar)


D = TypeVar("D", bound=Drafting)


def with_drafts(
    step_work: Sequence[Work[D]],
    capacity: int,
    spare_outputs: int,
    cost: CostModel,
    time_cap: float | None,
    least: int = 0,
) -> list[Work[D]]:
    """The step's work with a guess for each decoding generation whose guess pays: the step's tokens per second
    (every generation's token, plus the guesses' expected ones) over its predicted time, one generation after the
    other, the most urgent first. ``capacity``: tokens one decode takes; ``spare_outputs``: output rows beyond one
    per sequence the context has room for; ``time_cap``: the step's cap, which no guess may push it past;
    ``least``: guessed tokens fed whether they pay or not (draft_min_tokens), as many as the guess has."""
    chunks = [(w.item.position, w.n_tokens, 1 if w.completes else 0) for w in step_work]
    shape = cost.shape(chunks)
    made = float(sum(1 for w in step_work if w.completes))  # tokens the step gives without guesses
    seconds = cost.predict(shape)
    out = list(step_work)
    for i, w in enumerate(step_work):
        drafter = w.item.drafter
        if drafter is None or not w.completes or w.n_tokens != 1:
            continue
        guess = drafter.guess(w.item.admitted)
        available = min(len(guess), w.item.draft_room, capacity - shape.tokens, spare_outputs)
        if available <= 0:
            drafter.length(0, 0)
            continue
        best, best_rate, best_seconds = 0, made / seconds, seconds
        for k in range(1, available + 1):
            predicted = cost.predict(cost.shape(_grown(chunks, i, k)))
            if not _fits(predicted, time_cap):
                break
            rate = (made + drafter.expected_tokens(k)) / predicted
            if rate > best_rate:
                best, best_rate, best_seconds = k, rate, predicted
        k = max(drafter.length(best, available), min(least, available))
        if k != best:  # a retry, or the least a guess feeds: this step pays for its rows, if its cap allows them
            best_seconds = cost.predict(cost.shape(_grown(chunks, i, k)))
            if not _fits(best_seconds, time_cap):
                k, best_seconds = 0, seconds
        if k:
            out[i] = replace(w, draft=tuple(guess[:k]))
            chunks = _grown(chunks, i, k)
            shape = cost.shape(chunks)
            spare_outputs -= k
            made += drafter.expected_tokens(k)
            seconds = best_seconds
    return out


def _grown(chunks: list[tuple[int, int, int]], i: int, k: int) -> list[tuple[int, int, int]]:
    """``chunks`` with chunk ``i`` (one decode token) grown by ``k`` guessed rows, each with its logits."""
    return [*chunks[:i], (chunks[i][0], 1 + k, 1 + k), *chunks[i + 1 :]]


def _fits(seconds: float, time_cap: float | None) -> bool:
    return time_cap is None or within(seconds, time_cap)
