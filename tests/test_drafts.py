"""Guesses from a session's own tokens and how many a step feeds (engine/drafts.py): pure logic, no model."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvpool.daemon.engine.cost_model import FEATURES, CostModel, StepShape, calibrate
from kvpool.daemon.engine.drafts import FORCED_PRIOR, RETRY_EVERY, RETRY_TOKENS, WINDOW, Drafter, with_drafts
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


def test_a_run_of_one_token_is_guessed_to_go_on_as_long_as_the_earlier_run_from_its_start() -> None:
    # A number's zeros: the first record's run had six, the second's has three so far. Its last three tokens match
    # the first run where that run reached three zeros: the guess is the rest of that run, then what followed it
    # (indexed at every place in the run, its latest place would end this run at once: [comma, 8, 1, 5, zero]).
    zero, comma = 0, 9
    tokens = [7, 1, 5, zero, zero, zero, zero, zero, zero, comma, 8, 1, 5, zero, zero, zero]
    assert drafter(tokens, most=5, ngram=3).guess() == [zero, zero, zero, comma, 8]
    # Once the run being written is longer than the n-gram, its own start is the latest place: it goes on.
    assert drafter([2, zero, zero, zero, zero, zero], most=3, ngram=3).guess() == [zero, zero, zero]
    # A run cut by the window's start is counted from there: its n-grams are indexed all the same.
    long_ago = drafter([zero] * (WINDOW + 4) + [comma, 8, zero, zero, zero], most=2, ngram=3)
    assert long_ago.guess() == [zero, zero] and long_ago.matched == 3
    # After a run, a token that ends it is no substitution of the run's next token: the places of the run's n-gram
    # lie inside earlier runs, and what followed there is more of the run.
    assert drafter([1, zero, zero, zero, zero, zero, comma, 8, 2, 3, 5, zero, zero, zero, 7], ngram=3).guess() == []


def test_a_constrained_guess_is_the_longest_its_grammar_admits_among_the_latest_matches() -> None:
    # After '",' a JSON record goes on with its next key: the grammar admits only the match followed by it.
    name, room, kind, sep = 50, 51, 52, 60
    tokens = [name, 1, sep, room, 2, sep, kind, 3, name, 4, sep, room, 5, sep]  # the second record, after "room"
    want_kind = lambda guess: guess[: next((i for i, t in enumerate(guess) if t in (name, room)), len(guess))]  # noqa: E731
    d = drafter(tokens, ngram=3)
    assert d.guess()[0] == room  # the latest match, without a grammar
    assert d.guess(want_kind)[:2] == [kind, 3] and d.matched == 1


def test_forced_text_is_guessed_as_the_model_wrote_it_where_the_context_has_it() -> None:
    # Gemma 3 writes `"watts": ` as ` "` `watt` `s` `":` ` `, where its tokenizer has `watts`: guessed the
    # tokenizer's way, the key was refused at its second token in every record.
    light, sep, q, watts, watt, s, colon, space, one, zero, room, merged = range(20, 32)
    piece = {light: b"light", sep: b'",', q: b' "', watts: b"watts", watt: b"watt", s: b"s", colon: b'":',
             space: b" ", one: b"1", zero: b"0", room: b"room", merged: b'": 1'}  # fmt: skip
    tokenizer_split = [q, watts, colon, space]

    def guess(tokens: list[int], most: int = 8) -> list[int]:
        d = drafter(tokens, most=most, ngram=3)
        d.forced, d.piece = lambda: tokenizer_split, piece.__getitem__
        out = d.guess()
        assert d.matched == 0  # (measured as forced text, whichever split)
        return out

    record = [light, sep, q, watt, s, colon, space, one, zero]
    assert guess([*record, light, sep]) == [q, watt, s, colon, space]
    assert guess([*record, light, sep], most=3) == [q, watt, s]  # (as far as a guess goes, the model's split)
    assert guess([light, sep]) == tokenizer_split  # nowhere earlier
    assert guess([light, sep, q, room, colon, space, one, light, sep]) == tokenizer_split  # another text there
    # Where the model wrote the text's end merged with what followed it, the guess stops before that token.
    assert guess([light, sep, q, watt, s, merged, zero, light, sep]) == [q, watt, s]
    d = drafter([*record, light, sep], most=8, ngram=3)
    d.forced = lambda: tokenizer_split
    assert d.guess() == tokenizer_split  # (no way to read a token's bytes: the tokenizer's split)


def test_forced_text_starts_from_its_own_prior_not_from_the_refused_short_matches() -> None:
    # An answer's first guesses are short matches, often refused; the grammar's forced text is mostly taken, and a
    # JSON answer's first record fed its keys a token or three at a time when it started from their figures.
    d = drafter([1, 2, 3, 4, 5, 6, 7, 8, 9, 3, 4], ngram=4)
    assert d.guess() and d.matched == 2
    for _ in range(3):
        d.observe(2, 0)  # (refused)
    d.forced = lambda: [40, 41, 42]
    assert d.guess() == [40, 41, 42] and d.matched == 0
    assert d.acceptance == FORCED_PRIOR
    d.observe(3, 0)  # ... and then follows what it measures
    assert d.acceptance < FORCED_PRIOR


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
    d.matched = 3  # (guesses after a 3-token match)
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
    d.observe(4, 0)  # (measured: not paying)
    lengths = [d.length(0, 6) for _ in range(3 * RETRY_EVERY)]
    assert lengths.count(RETRY_TOKENS) == 3 and lengths.count(0) == 3 * RETRY_EVERY - 3
    assert d.length(5, 6) == 5


def test_a_kind_of_guess_not_measured_yet_is_measured_at_once_where_it_is_likely_right() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 3, 4]
    d = drafter(tokens, ngram=4)
    assert d.guess() and d.matched == 2
    assert d.length(0, 4) == 0  # a short match in free text is often wrong: it waits for a retry
    d.observe(RETRY_TOKENS, 0)  # (refused)
    tokens += [5, 6]
    assert d.guess() and d.matched == 4
    assert d.acceptance < 0.5  # a long match, priced on the refused one's figures ...
    assert d.length(0, 4) == RETRY_TOKENS  # ... is measured at once all the same
    assert d.length(0, 2) == 2
    # What a grammar admitted is measured at once, however short its match.
    d = drafter([1, 2, 3, 4, 5, 6, 7, 8, 9, 3, 4], ngram=4)
    assert d.guess(lambda guess: guess) and d.matched == 2
    assert d.length(0, 4) == RETRY_TOKENS
    # A guess that starts at a changing slot is not: it waits for the slot's token.
    tokens = record(1)
    d = drafter(tokens, most=4)
    for token in [*record(2), 10, 11, 12]:
        d.guess()
        tokens.append(token)
    assert d.guess() == [2, 20, 21, 22] and d.length(0, 4) == 0


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
        fit.theta = np.zeros(FEATURES)
        fit.theta[:3] = [fixed, per_token, per_output]
        fit.usable = fit.theta.copy()
    return model


def repetitive(acceptance: float) -> Drafter:
    d = drafter([1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], most=6)
    d._stats = {(n, False, False): [acceptance * 100, 100.0] for n in range(1, 4)}  # as if measured over many steps
    d._overall[False] = [acceptance * 100, 100.0]
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


def amd_epyc(start: int, n: int, outputs: int = 1) -> float:
    """A step's seconds as bench/guess_rows.py measured them on an AMD EPYC (roughly): one logits row by a vector
    kernel, several by a matrix kernel with a cost of its own, and an odd last row a pass over the weights alone."""
    logits = 0.008 if outputs == 1 else 0.014 + 0.0025 * outputs + (0.021 if outputs % 2 else 0.0)
    return 0.006 + 0.0025 * n + logits


def test_a_guess_is_priced_by_its_logits_kernel_and_takes_an_even_number_of_rows_where_odd_ones_cost_more() -> None:
    """Calibrated on a machine whose odd logits rows cost a pass of their own, the cost model prices every guess
    length right, and a well-taken guess stops one short rather than pay for an odd row."""
    model = CostModel()
    calibrate(model, amd_epyc, repeat=20, guess_rows=16)
    for k in range(17):
        assert math.isclose(
            model.predict(StepShape.of([(128, 1 + k, 1 + k)])), amd_epyc(128, 1 + k, 1 + k), rel_tol=0.05
        ), k
    for streams in range(1, 9):  # decode steps of several sessions are priced by the same kernel
        shape = StepShape.of([(128, 1, 1)] * streams)
        assert math.isclose(model.predict(shape), amd_epyc(128, streams, streams), rel_tol=0.05), streams
    [w] = with_drafts([Work(Item(repetitive(0.95)), 1, True)], 64, 16, model, None)
    assert len(w.draft) == 5  # 5.5 tokens in 50 ms, where 6 would give 6.3 in 76
    [w] = with_drafts([Work(Item(repetitive(0.3)), 1, True)], 64, 16, model, None)
    assert w.draft == ()  # 1.3 tokens in 30 ms, against 1 in 16.5


def test_where_odd_logits_rows_cost_more_a_guess_evens_them_out_taken_or_not() -> None:
    """Three decoding sessions on such a machine: a fourth row (a guess, however poorly taken) costs less than the
    odd third row's pass, so one session gets one guessed token; on a machine without that cost, none does."""
    work = [Work(Item(repetitive(0.02)), 1, True) for _ in range(3)]
    odd_costly = CostModel()
    calibrate(odd_costly, amd_epyc, repeat=20, guess_rows=16)
    assert [len(w.draft) for w in with_drafts(work, 64, 16, odd_costly, None)] == [1, 0, 0]

    def linear(start: int, n: int, outputs: int = 1) -> float:
        return 0.015 + 0.0012 * n + 0.0026 * outputs

    even = CostModel()
    calibrate(even, linear, repeat=20, guess_rows=16)
    assert [len(w.draft) for w in with_drafts(work, 64, 16, even, None)] == [0, 0, 0]


def zen4_avx512(start: int, n: int, outputs: int = 1) -> float:
    """The same AMD EPYC with an AVX-512 build of llama.cpp (roughly, bench/guess_rows.py): the matrix kernel's
    tiles are four logits rows wide, so three rows cost a tile like four, and five to seven a second pass."""
    logits = 0.008 if outputs == 1 else 0.014 + 0.0021 * outputs + (0.016 if outputs > 4 and outputs % 4 else 0.0)
    return 0.006 + 0.002 * n + logits


def test_where_the_kernel_takes_logits_rows_four_at_a_time_the_fit_says_so_and_guesses_fill_its_tiles() -> None:
    """Calibrated on an AVX-512 build, the cost model prices the rows past a multiple of four, not odd rows (and on
    the AVX2 build the other way round); a well-taken guess stops at a whole tile, and five poorly-guessing
    sessions get three guessed rows between them, which cost less than the fifth row's pass."""
    tiles_of_four, tiles_of_two = CostModel(), CostModel()
    calibrate(tiles_of_four, zen4_avx512, repeat=20, guess_rows=16)
    calibrate(tiles_of_two, amd_epyc, repeat=20, guess_rows=16)
    four, two = tiles_of_four.status().small_steps, tiles_of_two.status().small_steps
    assert four.outputs_past_fours_ms > 15 and abs(four.odd_outputs_ms) < 0.5
    assert two.odd_outputs_ms > 20 and abs(two.outputs_past_fours_ms) < 0.5
    for k in range(17):
        assert math.isclose(
            tiles_of_four.predict(StepShape.of([(128, 1 + k, 1 + k)])), zen4_avx512(128, 1 + k, 1 + k), rel_tol=0.05
        ), k
    [w] = with_drafts([Work(Item(repetitive(0.95)), 1, True)], 64, 16, tiles_of_four, None)
    assert len(w.draft) == 3  # 3.7 tokens in 36 ms, where 6 (of the most 6) would give 6.3 in 61
    five = [Work(Item(repetitive(0.02)), 1, True) for _ in range(5)]
    assert sum(len(w.draft) for w in with_drafts(five, 64, 16, tiles_of_four, None)) == 3
    assert sum(len(w.draft) for w in with_drafts(five[:3], 64, 16, tiles_of_four, None)) == 0


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


def record(value: int) -> list[int]:
    """A record of a list: its key, its value, the rest of it (the same in every record)."""
    return [10, 11, 12, value, 20, 21, 22, 23]


def test_where_the_last_token_replaced_another_the_guess_is_what_followed_the_one_it_replaced() -> None:
    # The second record's value differs: no earlier place ends with it, but "10 11 12" stood before another value.
    d = drafter(record(1) + record(2)[:4], most=4)
    assert d.guess() == [20, 21, 22, 23] and d.matched == -3
    # A match that ends with the last token is preferred to a substitution with as long a context before it.
    d = drafter([7, 11, 12, 2, 30, 31, *record(1), *record(2)[:4]], most=2)
    assert d.guess() == [30, 31] and d.matched == 3
    # Two tokens before the replaced one are too few to guess from.
    assert drafter([11, 12, 1, 20, 21, 11, 12, 2]).guess() == []


def test_a_guess_that_starts_at_a_slot_that_changed_is_measured_apart_and_starts_low() -> None:
    tokens = record(1)
    d = drafter(tokens, most=4)
    for token in record(2):  # the engine asks for a guess every step
        d.guess()
        tokens.append(token)
    for _ in range(8):  # guesses of the records' common part, all taken
        d.observe(4, 4)
    tokens += [10, 11, 12]
    assert d.guess() == [2, 20, 21, 22]  # the third record's value: the second's, which replaced the first's
    assert d.acceptance < 0.3
    tokens.append(3)
    assert d.guess() == [20, 21, 22, 23] and d.matched == -3
    assert d.acceptance > 0.9  # the rest of the record: as the other guesses measured
    # A slot whose value was refused where it was guessed changes too.
    d = drafter(tokens := [*record(1), 10, 11, 12], most=4)
    assert d.guess() == [1, 20, 21, 22]
    d.observe(4, 0)
    tokens += [2, 20, 21, 22, 23, 10, 11, 12]
    assert d.guess() == [2, 20, 21, 22] and d.acceptance < 0.3


def test_a_prediction_is_guessed_where_the_answer_follows_it_read_in_order_and_measured_apart() -> None:
    prompt = [40, 41, 42]
    tokens = [*prompt, 10]  # the answer's first token, sampled from the prompt's step
    d = drafter(tokens, most=3, ngram=2)
    d.predict([10, 11, 12, 13, 11, 12, 20, EOG, 30], lead=prompt)
    # Indexed behind the prompt's end, the prediction's start matches as long as n-grams go ("42 10").
    assert d.guess() == [11, 12, 13] and d.matched == 2
    own = d.acceptance
    d.observe(3, 3)
    tokens += [11, 12, 13, 11, 12]  # taken, and the answer went on as predicted
    # "11 12" stands twice in the prediction: it is read on from where the answer is, not from its start.
    assert d.guess() == [20]  # (and stops at the end of a turn, as the context's guesses do)
    d.observe(1, 0)
    assert (d.predicted_accepted, d.predicted_rejected) == (3, 1)
    assert d.accepted_tokens == 3 and d.drafted_tokens == 4
    # The context's own guesses are measured apart from the prediction's: its figures moved, theirs did not.
    tokens += [21, 40, 41]
    assert d.guess() == [42, 10, 11] and d.acceptance == own
    assert drafter([*prompt, 10], most=3).guess() == []  # (without the prediction, nothing to guess)


def test_a_prediction_and_the_context_match_alike_and_the_longer_match_wins() -> None:
    # The context has "1 2 3" followed by 4; the prediction has only "3" followed by 9: the longer match wins.
    d = drafter([1, 2, 3, 4, 0, 1, 2, 3], most=2, ngram=3)
    d.predict([3, 9, 9])
    assert d.guess() == [4, 0] and d.matched == 3
    # Matches of one length: the prediction's first.
    d = drafter([5, 3, 4, 0, 6, 3], most=2, ngram=3)
    d.predict([3, 9, 9])
    assert d.guess() == [9, 9] and d.matched == 1
