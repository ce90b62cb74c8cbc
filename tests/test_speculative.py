"""Draftless speculation against real daemons on the tiny model: guesses from a session's own tokens, verified in
the step beside other sessions' rows, change no greedy answer and no seeded draw, leave no cells behind (through
hibernation and restore too), and are counted in status and Prometheus."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import msgspec

from kvpool import protocol as p
from kvpool.client import Client
from kvpool.client.cli import format_status
from kvpool.daemon.engine.step_log import StepRecord
from kvpool.daemon.ops.prometheus import render
from kvpool.protocol import TokenLogprob

from .daemon_process import DaemonProcess
from .raw import RawConnection

Start = Callable[..., DaemonProcess]
GREEDY = {"temperature": 0.0}
# Prompts whose answers repeat what came before: the tiny model's random weights fall into loops too.
PROMPTS = [
    "the cat sat on the mat; the cat sat on the mat; the cat sat on",
    '{"name": "lamp", "room": "hall"}, {"name": "fan", "room": "hall"}, {"name": "tv", "room": "',
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "0123456789 0123456789 0123456789 01234",
]
# Whether a guess pays follows the measured step times; these runs must see guesses verified (and refused)
# whatever this machine's speed, so every match feeds at least two guessed tokens (draft_min_tokens).
SPECULATE = ("--draft-tokens", "6", "--draft-min-tokens", "2")
NO_GUESSES = ("--draft-tokens", "0")
# A step with guessed rows is a batch of another shape, and llama.cpp sums in another order for another shape (a
# lone logits row by a vector kernel, several by a matrix one): a greedy answer may take the other of two tokens
# whose log-probabilities were this close, and from there it is another conversation (docs/speculative.md).
FLOAT_TIE = 0.01
TOP = 1  # log-probabilities asked for (the comparison reads each token's own; none would report none)


def step_records(path: Path) -> list[StepRecord]:
    """A daemon's step log (step_log), a record a step."""
    return [msgspec.json.decode(line, type=StepRecord) for line in path.read_bytes().splitlines()]


def same_but_at_float_ties(
    fast: list[list[TokenLogprob]], plain: list[list[TokenLogprob]], tie: float = FLOAT_TIE
) -> None:
    """Each session's greedy tokens with guesses are those without, each with its log-probability within ``tie``,
    up to a place where the two took tokens whose log-probabilities were within ``tie`` of each other (under a
    grammar too: each is the most likely the grammar allowed); from there that session is another conversation."""
    assert len(fast) == len(plain)
    for i, (a_tokens, e_tokens) in enumerate(zip(fast, plain, strict=True)):
        assert len(a_tokens) == len(e_tokens), i
        for a, e in zip(a_tokens, e_tokens, strict=True):
            assert abs(a.logprob - e.logprob) < tie, (i, a, e)
            if a.token != e.token:
                break


def answers(client: Client, prompts: list[str], max_tokens: int, turns: int = 2) -> list[list[TokenLogprob]]:
    """Every prompt's session, all generating at once (their rows share the steps), for ``turns`` turns: each
    greedy token with its log-probability."""
    sessions = [client.open_session() for _ in prompts]
    out: list[list[TokenLogprob]] = [[] for _ in prompts]
    for turn in range(turns):
        streams = [
            s.generate(prompt if turn == 0 else " and again:", max_tokens=max_tokens, logprobs=TOP, **GREEDY)
            for s, prompt in zip(sessions, prompts, strict=True)
        ]
        for i, stream in enumerate(streams):
            for chunk in stream:
                out[i].extend(chunk.logprobs or ())
            assert stream.final is not None and stream.final.usage.completion_tokens == max_tokens
    return out


def test_greedy_answers_are_the_same_with_guesses_and_most_guesses_are_taken(
    start_daemon: Start, tmp_path: Path
) -> None:
    plain = start_daemon("--hot-slots", "4", *NO_GUESSES, name="plain")
    with plain.client() as client:
        expected = answers(client, PROMPTS, 48)
        assert client.status().counters.drafted_tokens == 0
    step_log = tmp_path / "steps.jsonl"
    fast = start_daemon("--hot-slots", "4", *SPECULATE, "--step-log", str(step_log), name="fast")
    with fast.client() as client:
        got = answers(client, PROMPTS, 48)
        status = client.status()
    same_but_at_float_ties(got, expected)
    c = status.counters
    assert c.drafted_tokens > 0 and 0 < c.accepted_tokens <= c.drafted_tokens
    assert c.generated_tokens == 2 * 4 * 48
    # Each step's token and its taken guesses: fewer steps than tokens.
    assert c.decode_calls < c.generated_tokens - c.accepted_tokens // 2
    text = format_status(status)
    assert "up to 6 a step (at least 2, paying or not)" in text
    assert f"{c.accepted_tokens} of {c.drafted_tokens} guessed tokens taken" in text
    exposition = render(status, {})
    assert f'kvpool_draft_tokens_total{{kind="drafted"}} {float(c.drafted_tokens)}' in exposition
    assert f'kvpool_draft_tokens_total{{kind="accepted"}} {float(c.accepted_tokens)}' in exposition
    # The step log (step_log) has a line for each step, and its items add up to the counters.
    steps = step_records(step_log)
    items = [item for step in steps for item in step.items]
    assert len(steps) == c.decode_calls and all(step.ms > 0 and step.predicted_ms > 0 for step in steps)
    assert sum(item.sampled for item in items) == c.generated_tokens
    assert sum(item.guessed for item in items) == c.drafted_tokens
    assert sum(item.sampled - 1 for item in items if item.guessed) == c.accepted_tokens
    assert all(item.guess_kind is not None for item in items if item.guessed)
    prompts = [item for item in items if item.pending > 1]
    assert prompts and all(item.guessed == 0 for item in prompts)  # (a prompt chunk gets no guess)
    assert len({item.session for item in items}) == len(PROMPTS)


def test_rejected_guesses_leave_no_cells_through_hibernation_and_restore(start_daemon: Start) -> None:
    """One hot slot for three sessions: every turn hibernates one and restores another, so a guess's rows left in
    a snapshot would come back with it, and the next turn would differ from the run without guesses."""
    runs = {}
    for name, args in (("plain", NO_GUESSES), ("fast", SPECULATE)):
        daemon = start_daemon("--hot-slots", "1", *args, name=name)
        with daemon.client() as client:
            sessions = [client.open_session() for _ in range(3)]
            tokens: list[list[TokenLogprob]] = [[] for _ in sessions]
            for turn in range(3):
                for i, s in enumerate(sessions):
                    prompt = PROMPTS[i] if turn == 0 else f" turn {turn}:"
                    tokens[i] += s.complete(prompt, max_tokens=24, logprobs=TOP, **GREEDY).logprobs
            for s in sessions:  # the daemon's record of each conversation is exactly what was sent and answered
                assert len(s.history()) == s.final.usage.context_tokens
            status = client.status()
            assert status.moves.restores_pool >= 6
            runs[name] = (tokens, status)
    same_but_at_float_ties(runs["fast"][0], runs["plain"][0])
    assert runs["fast"][1].counters.accepted_tokens > 0
    assert runs["fast"][1].counters.drafted_tokens > runs["fast"][1].counters.accepted_tokens  # some were rejected


def test_seeded_sampling_draws_the_same_tokens_with_guesses(start_daemon: Start) -> None:
    """The sampler takes one token per row, in order, with the same random numbers: each seed's draw is the one it
    would be without guesses (but for a float-noise tie), and the tokens' distribution is the same (chi-square)."""
    seeds = range(60)
    params = {"temperature": 1.5, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    draws: dict[str, list[list[int]]] = {}
    for name, args in (("plain", NO_GUESSES), ("fast", SPECULATE)):
        daemon = start_daemon("--hot-slots", "2", *args, name=name)
        with daemon.client() as client:
            draws[name] = [
                client.open_session().complete(PROMPTS[3], max_tokens=12, seed=n, **params).tokens for n in seeds
            ]
            if args == SPECULATE:  # guessed rows were verified, draw by draw
                assert client.status().counters.drafted_tokens > 0
    same = sum(a == b for a, b in zip(draws["plain"], draws["fast"], strict=True))
    assert same >= len(seeds) - 2
    counts = {name: Counter(t for d in drawn for t in d) for name, drawn in draws.items()}
    assert chi_square_p(counts["plain"], counts["fast"]) > 1e-3


def chi_square_p(a: Counter[int], b: Counter[int]) -> float:
    """A two-sample chi-square test's p-value over the tokens both drew (rare ones pooled)."""
    na, nb = sum(a.values()), sum(b.values())
    common = [t for t in set(a) | set(b) if a[t] + b[t] >= 10]
    rare_a = na - sum(a[t] for t in common)
    rare_b = nb - sum(b[t] for t in common)
    cells = [(a[t], b[t]) for t in common] + ([(rare_a, rare_b)] if rare_a + rare_b else [])
    stat = 0.0
    for x, y in cells:
        total = x + y
        ex, ey = total * na / (na + nb), total * nb / (na + nb)
        stat += (x - ex) ** 2 / ex + (y - ey) ** 2 / ey
    dof = max(1, len(cells) - 1)
    return chi2_survival(stat, dof)


def chi2_survival(x: float, k: int) -> float:
    """P(X > x) for a chi-square of ``k`` degrees of freedom (Wilson-Hilferty: close enough for a test's bound)."""
    z = ((x / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_guesses_go_off_with_a_budget_that_has_no_room_for_them(start_daemon: Start) -> None:
    """A deadline-bound task's per-token budget caps each step: guesses that would push a step past it are not fed
    (its answer is still whole and the same)."""
    # A per-token budget no step can keep: the cap leaves no room for a single guessed row, whatever this machine's
    # speed (a first-token budget far out, so that admission never refuses).
    tight = "[tasks.default]\n[tasks.voice]\nttft_ms = 60000\ntpot_ms = 0.001\n"
    daemon = start_daemon("--hot-slots", "2", *SPECULATE, config=tight, name="capped")
    with daemon.client() as client:
        s = client.open_session(task="voice")
        answer = s.complete(PROMPTS[0], max_tokens=24, **GREEDY)
        assert answer.usage.completion_tokens == 24
        assert client.status().counters.drafted_tokens == 0
    plain = start_daemon("--hot-slots", "2", *NO_GUESSES, name="plain")
    with plain.client() as client:
        assert client.open_session().complete(PROMPTS[0], max_tokens=24, **GREEDY).tokens == answer.tokens


def test_a_promised_first_token_waits_behind_no_guessed_rows(start_daemon: Start, tmp_path: Path) -> None:
    """A step that computes the prompt of a deadline-bound task's turn carries no guessed rows: another session's
    guesses would only lengthen the step its first token waits for (which the budgets' admission estimated without
    them). They come back once the first token is out."""
    config = "[tasks.default]\n[tasks.voice]\nttft_ms = 60000\n"  # (far out: admission never refuses)
    step_log = tmp_path / "steps.jsonl"
    daemon = start_daemon("--hot-slots", "2", *SPECULATE, "--step-log", str(step_log), config=config, name="voice")
    raw = RawConnection(daemon.address)
    try:
        background, voice = raw.open(), raw.open("voice")
        # Every byte token in its prompt: whatever it samples matched earlier, so each of its steps feeds a guess.
        every_token = list(range(3, 259))
        raw.send(
            p.Generate(
                id=1,
                session=background.session,
                token=background.token,
                prompt_tokens=every_token,
                max_tokens=400,
                **GREEDY,
            )
        )
        assert isinstance(raw.recv(), p.Chunk)  # the background answer is decoding, with guesses
        raw.send(p.Generate(id=2, session=voice.session, token=voice.token, prompt=PROMPTS[2], max_tokens=24, **GREEDY))
        raw.until_final(2)
        _, background_final = raw.until_final(1)
    finally:
        raw.close()
    assert background_final.usage.completion_tokens == 400
    steps = step_records(step_log)
    voice_steps = [k for k, step in enumerate(steps) if any(i.session == voice.session for i in step.items)]
    first_token = next(k for k in voice_steps if any(i.session == voice.session and i.sampled for i in steps[k].items))
    waiting = [item for step in steps[voice_steps[0] : first_token + 1] for item in step.items]
    assert any(item.session == background.session for item in waiting)  # the background decoded beside its prompt
    assert all(item.guessed == 0 for item in waiting)
    after = [i for step in steps[first_token + 1 :] for i in step.items if i.session == background.session]
    assert after and sum(1 for item in after if item.guessed) >= len(after) - 1  # (its last may have no room)


def test_constrained_answers_guess_only_what_their_grammar_admits_and_stay_the_same(start_daemon: Start) -> None:
    schema = {
        "type": "array",
        "items": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
    }
    prompt = '[{"name": "lamp"}, {"name": "fan"}, {"name": "tv"}] again: '
    results = {}
    for name, args in (("plain", NO_GUESSES), ("fast", SPECULATE)):
        daemon = start_daemon("--hot-slots", "2", *args, name=name)
        with daemon.client() as client:
            answers_ = [
                client.open_session().complete(prompt, max_tokens=40, json_schema=schema, logprobs=TOP, **GREEDY)
                for _ in "ab"
            ]
            results[name] = ([a.logprobs for a in answers_], client.status().counters)
    same_but_at_float_ties(results["fast"][0], results["plain"][0])
    assert results["fast"][1].drafted_tokens > 0
