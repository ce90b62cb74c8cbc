"""Guesses from a session's own tokens and how many a step feeds (engine/drafts.py): pure logic, no model."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from kvpool.daemon.engine.cost_model import CostModel, StepShape, calibrate
from kvpool.daemon.engine.drafts import RETRY_EVERY, RETRY_TOKENS, Drafter, with_drafts
from kvpool.daemon.engine.step_work import Work

EOG = 99


def drafter(tokens: list[int], most: int = 4, ngram: int = 3) -> Drafter:
    return Drafter(tokens, ngram, most, lambda t: t == EOG)


def test_a_guess_is_what_followed_the_latest_earlier_match_of_the_longest_n_gram() -> None:
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    # "1 2 3" matched at the start (then 4 5 9 ...); "2 3" alone more recently (then 7 8): the longest wins.
    assert drafter(tokens).guess() == [4, 5, 9, 2]
    assert drafter([5, 2, 3, 7, 8, 6, 2, 3]).guess() == [7, 8, 6, 2]
    assert drafter([1, 2, 3, 4]).guess() == []  # nothing earlier ends as the context does
    assert drafter([3, 4]).guess() == []  # a match must end before the context's last token
    d = drafter([6, 5, 1, 2, 9, 7, 2], ngram=3)
    assert d.guess() == [9, 7, 2, 9] and d.matched == 1  # down to one token, when nothing longer matches


def test_a_guess_that_runs_into_the_end_goes_on_with_itself_and_the_longest_match_tells_lines_apart() -> None:
    # "7 8" last seen three tokens back: the line "9 7 8" repeats.
    assert drafter([7, 8, 1, 2, 3, 4, 5, 7, 8, 9, 7, 8], most=7).guess() == [9, 7, 8, 9, 7, 8, 9]
    # Two lines end in "4 5"; the longer match picks the one being copied.
    lines = [1, 2, 4, 5, 10, 11, 3, 3, 4, 5, 20, 21, 0, 3, 3, 4, 5]
    assert drafter(lines, most=2, ngram=4).guess() == [20, 21]
    assert drafter(lines, most=2, ngram=2).guess() == [20, 21]  # (the latest of equally long matches)


def test_a_constrained_guess_is_the_longest_its_grammar_admits_among_the_latest_matches() -> None:
    # After '",' a JSON record goes on with its next key: the grammar admits only the match followed by it.
    name, room, kind, sep = 50, 51, 52, 60
    tokens = [name, 1, sep, room, 2, sep, kind, 3, name, 4, sep, room, 5, sep]  # the second record, after "room"
    want_kind = lambda guess: guess[: next((i for i, t in enumerate(guess) if t in (name, room)), len(guess))]  # noqa: E731
    d = drafter(tokens, ngram=3)
    assert d.guess()[0] == room  # the latest match, without a grammar
    assert d.guess(want_kind)[:2] == [kind, 3] and d.matched == 1


def test_the_index_follows_the_conversation_as_it_grows_and_when_it_loses_tokens() -> None:
    tokens = [1, 2, 3, 4]
    d = drafter(tokens)
    assert d.guess() == []
    tokens += [5, 1, 2]
    assert d.guess() == [3, 4, 5, 1]
    tokens += [3, 4, 5, 1, 2]  # the latest match moves on: "1 2" now also at 5..6, followed by 3 4 5 1
    assert d.guess() == [3, 4, 5, 1]
    del tokens[4:]  # (a prompt that could not be computed goes)
    tokens += [6, 2, 3]
    assert d.guess() == [4, 6, 2, 3]


def test_a_guess_stops_at_the_end_of_a_turn_and_at_a_mediums_cells() -> None:
    assert drafter([1, 2, 5, 6, EOG, 7, 1, 2]).guess() == [5, 6]
    assert drafter([1, 2, 5, -3, -3, 6, 1, 2]).guess() == [5]
    assert drafter([1, 2, EOG, 1, 2]).guess() == []


def test_acceptance_is_measured_for_each_match_length() -> None:
    d = drafter([1, 2, 3, 9, 2, 3, 1, 2, 3])
    assert d.guess() and d.matched == 3
    for _ in range(10):
        d.observe(4, 4)
    long = d.acceptance
    d.matched = 1
    untried = d.acceptance
    assert 0.5 < untried < long  # a match length not tried yet starts from what the others measured
    for _ in range(10):
        d.observe(4, 0)
    assert d.acceptance < 0.2  # ... and then has its own figures
    d.matched = 3
    assert d.acceptance > 0.6


def test_acceptance_follows_what_was_taken() -> None:
    d = drafter([])
    start = d.acceptance
    for _ in range(10):
        d.observe(4, 4)
    assert d.acceptance > 0.9 > start
    for _ in range(30):
        d.observe(4, 0)
    assert d.acceptance < 0.2
    assert (d.drafted_tokens, d.accepted_tokens) == (160, 40)
    assert abs(d.expected_tokens(3) - sum(d.acceptance**i for i in (1, 2, 3))) < 1e-12


def test_a_generation_whose_guesses_do_not_pay_retries_a_short_one_now_and_then() -> None:
    d = drafter([])
    lengths = [d.length(0, 6) for _ in range(3 * RETRY_EVERY)]
    assert lengths.count(RETRY_TOKENS) == 3 and lengths.count(0) == 3 * RETRY_EVERY - 3
    assert d.length(5, 6) == 5


@dataclass(eq=False)
class Item:
    drafter: Drafter | None
    draft_room: int = 100
    position: int = 100
    grammar_admits: int | None = None

    @property
    def admitted(self) -> Callable[[list[int]], list[int]] | None:
        n = self.grammar_admits
        return None if n is None else (lambda guess: guess[:n])


def cost(fixed: float, per_token: float, per_output: float) -> CostModel:
    model = CostModel()
    for fit in (model.small, model.large):
        fit.usable = fit.theta = __import__("numpy").array([fixed, per_token, per_output, 0.0, 0.0])
    return model


def repetitive(acceptance: float) -> Drafter:
    d = drafter([1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], most=6)
    d._stats = {n: [acceptance * 100, 100.0] for n in range(1, 4)}  # as if measured over many steps
    d._overall = [acceptance * 100, 100.0]
    return d


def test_a_guess_gets_rows_while_its_expected_tokens_pay_for_them() -> None:
    # A step costs 20 ms, a row 1 ms: a guess taken 9 times in 10 pays for all its rows.
    model = cost(0.020, 0.0005, 0.0005)
    work = [Work(Item(repetitive(0.9)), 1, True)]
    [w] = with_drafts(work, 64, 16, model, None)
    assert w.draft == (4, 5, 6, 7, 8, 1)
    # Taken once in fifty: not even its first row pays (2 % more tokens for 5 % more time).
    [w] = with_drafts([Work(Item(repetitive(0.02)), 1, True)], 64, 16, model, None)
    assert w.draft == ()


def test_a_guess_whose_first_rows_cost_most_is_priced_so_and_a_long_one_pays() -> None:
    """As bench/guess_rows.py measured on an AMD EPYC: a sequence's guessed rows cost a step a large amount once
    (here 25 ms) beside each row's own cost. Calibrated on such a machine, the cost model prices a short and a long
    guess alike right, so a well-taken guess gets its rows and a poor one none."""

    def machine(start: int, n: int, outputs: int = 1) -> float:
        return 0.015 + 0.0012 * n + 0.0006 * outputs + (0.025 if outputs > 1 else 0.0)

    model = CostModel()
    calibrate(model, machine, repeat=20, guess_rows=16)
    for k in (1, 4, 6, 16):
        assert math.isclose(
            model.predict(StepShape.of([(128, 1 + k, 1 + k)])), machine(128, 1 + k, 1 + k), rel_tol=0.05
        )
    assert math.isclose(model.predict(StepShape.of([(128, 1, 1)])), machine(128, 1), rel_tol=0.05)
    [w] = with_drafts([Work(Item(repetitive(0.95)), 1, True)], 64, 16, model, None)
    assert len(w.draft) == 6  # 6 tokens of 95 % each: 6.0 tokens in 52.6 ms against 1 in 16.8
    [w] = with_drafts([Work(Item(repetitive(0.3)), 1, True)], 64, 16, model, None)
    assert w.draft == ()  # 1.4 tokens in 43.6 ms


def test_the_least_a_guess_feeds_is_fed_unpaid_but_within_the_cap_and_the_guess() -> None:
    """draft_min_tokens: a guess taken once in fifty pays for no row, and still feeds the least asked for; never
    more than the guess has, and never past the step's cap."""
    model = cost(0.020, 0.0005, 0.0005)
    [w] = with_drafts([Work(Item(repetitive(0.02)), 1, True)], 64, 16, model, None, least=4)
    assert w.draft == (4, 5, 6, 7)
    [w] = with_drafts([Work(Item(repetitive(0.02)), 1, True)], 64, 16, model, None, least=30)
    assert w.draft == (4, 5, 6, 7, 8, 1)  # all the guess has (at most 6)
    [w] = with_drafts([Work(Item(repetitive(0.95)), 1, True)], 64, 16, model, None, least=2)
    assert len(w.draft) == 6  # one that pays gets what pays
    [w] = with_drafts([Work(Item(repetitive(0.02)), 1, True)], 64, 16, model, 0.0212, least=4)
    assert w.draft == ()  # 4 rows would pass the cap: none


def test_guesses_stay_within_the_steps_cap_its_rows_and_the_answers_room() -> None:
    model = cost(0.020, 0.0005, 0.0005)
    item = Item(repetitive(0.95))
    [w] = with_drafts([Work(item, 1, True)], 64, 16, model, 0.0242)  # room for 3 more rows of 1 ms
    assert len(w.draft) == 3
    [w] = with_drafts([Work(item, 1, True)], 64, 2, model, None)  # two spare output rows
    assert len(w.draft) == 2
    [w] = with_drafts([Work(item, 1, True)], 3, 16, model, None)  # a batch of three tokens
    assert len(w.draft) == 2
    [w] = with_drafts([Work(Item(repetitive(0.95), draft_room=1), 1, True)], 64, 16, model, None)
    assert len(w.draft) == 1
    [w] = with_drafts([Work(Item(repetitive(0.95), grammar_admits=4), 1, True)], 64, 16, model, None)
    assert w.draft == (4, 5, 6, 7)  # a guess stops where its grammar would refuse it


def test_only_a_decode_token_gets_a_guess_and_each_guess_counts_in_the_next_ones_step() -> None:
    model = cost(0.020, 0.0005, 0.0005)
    prompt = Work(Item(repetitive(0.95)), 40, False)
    no_drafter = Work(Item(None), 1, True)
    a, b = Work(Item(repetitive(0.95)), 1, True), Work(Item(repetitive(0.95)), 1, True)
    out = with_drafts([prompt, no_drafter, a, b], 64, 7, model, None)
    assert out[0].draft == () and out[1].draft == ()
    assert len(out[2].draft) == 6 and len(out[3].draft) == 1  # the second gets the one spare row left
    shape = StepShape.of([(100, 40, 0), (100, 1, 1), (100, 7, 7), (100, 2, 2)])
    assert shape.outputs == 10 and shape.tokens == 50
