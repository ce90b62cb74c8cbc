"""A request's prediction (the answer its client expects, OpenAI's Predicted Outputs) against real daemons on the
tiny model: where the answer follows it, its tokens are guessed and verified in the step, the answer stays the one
sampling gives, right prediction or wrong, and the final message counts what was taken and refused; where it cannot
be used it is refused with a sentence, and the daemon keeps serving."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvpool.client import Client
from kvpool.client.errors import BadRequest, ContextOverflow
from kvpool.protocol import Final, TokenLogprob

from .daemon_process import DaemonProcess
from .test_speculative import GREEDY, NO_GUESSES, SPECULATE, TOP, same_but_at_float_ties, step_records

Start = Callable[..., DaemonProcess]
# Prompts whose greedy answers the tiny model does not loop in at once: the context's own n-grams guess little of
# them, so what is guessed and taken comes from the prediction.
PROMPTS = ["a quiet morning in the garden", "list the rooms of the house"]
TOKENS = 40


def answer(client: Client, prompt: str, **extra: object) -> tuple[list[TokenLogprob], Final]:
    with client.open_session() as session:
        stream = session.generate(prompt, max_tokens=TOKENS, logprobs=TOP, **GREEDY, **extra)
        out = [logprob for chunk in stream for logprob in chunk.logprobs or ()]
        assert stream.final is not None and stream.final.usage.completion_tokens == TOKENS
        return out, stream.final


def test_a_prediction_is_guessed_where_the_answer_follows_it_and_the_answer_stays_the_same(
    start_daemon: Start, tmp_path: Path
) -> None:
    with start_daemon("--hot-slots", "2", *NO_GUESSES, name="plain").client() as client:
        expected = [answer(client, prompt)[0] for prompt in PROMPTS]
        wrong_text = client.detokenize([t.token for t in reversed(expected[0])])
    step_log = tmp_path / "steps.jsonl"
    with start_daemon("--hot-slots", "2", *SPECULATE, "--step-log", str(step_log), name="fast").client() as client:
        own = [answer(client, prompt) for prompt in PROMPTS]
        right = [
            answer(client, prompt, prediction_tokens=[t.token for t in tokens])
            for prompt, tokens in zip(PROMPTS, expected, strict=True)
        ]
        as_text = answer(client, PROMPTS[0], prediction=client.detokenize([t.token for t in expected[0]]))
        wrong = answer(client, PROMPTS[0], prediction=wrong_text)
    same_but_at_float_ties([tokens for tokens, _ in right], expected)
    same_but_at_float_ties([as_text[0], wrong[0]], [expected[0], expected[0]])
    for _, final in own:  # no prediction: nothing counted as its
        assert final.usage.accepted_prediction_tokens == final.usage.rejected_prediction_tokens == 0
    for (tokens, final), plain in zip([*right, as_text], [*expected, expected[0]], strict=True):
        usage = final.usage
        # Most of the answer came as the prediction's guesses, taken, as far as the answer followed it (a float tie
        # may part them: a step with guessed rows is a batch of another shape).
        agree = next((i for i, (a, b) in enumerate(zip(tokens, plain, strict=True)) if a.token != b.token), TOKENS)
        assert usage.accepted_prediction_tokens >= agree // 2 - 2, (usage, agree)
        assert usage.accepted_prediction_tokens > usage.rejected_prediction_tokens
    assert wrong[1].usage.accepted_prediction_tokens < as_text[1].usage.accepted_prediction_tokens
    assert wrong[1].usage.rejected_prediction_tokens > 0  # guessed (draft_min_tokens feeds it), and refused
    # The step log tells the prediction's guesses from the context's: its rows are those the answers counted.
    items = [i for step in step_records(step_log) for i in step.items]
    finals = [final for _, final in [*own, *right, as_text, wrong]]
    predicted = [i for i in items if i.predicted]
    assert all(i.guessed for i in predicted) and any(i.guessed and not i.predicted for i in items)
    assert sum(i.sampled - 1 for i in predicted) == sum(f.usage.accepted_prediction_tokens for f in finals)
    assert sum(i.guessed - (i.sampled - 1) for i in predicted) == sum(
        f.usage.rejected_prediction_tokens for f in finals
    )


def test_an_answer_a_stop_string_ends_inside_a_guess_counts_only_the_predicted_tokens_it_kept(
    start_daemon: Start, tmp_path: Path
) -> None:
    """A stop string can end an answer inside a run of guessed tokens that sampling took: the usage counts the
    prediction's tokens the answer kept, and those after the stop as refused (computed and thrown away)."""
    step_log = tmp_path / "steps.jsonl"
    cut_inside = 0
    thrown_away = 0  # guessed tokens sampling took after a stop: computed, never in an answer
    with start_daemon("--hot-slots", "2", *SPECULATE, "--step-log", str(step_log), name="fast").client() as client:
        with client.open_session() as session:
            plain = session.complete(PROMPTS[1], max_tokens=TOKENS, **GREEDY)
        text = client.detokenize(plain.tokens)
        for end in range(len(text) // 3, len(text) // 3 + 8):  # answers cut at eight places past its first third
            # The shortest stop string that ends there and nowhere before (the tiny model writes runs of one byte).
            stop = next(text[i:end] for i in range(end - 1, -1, -1) if text.find(text[i:end]) == i)
            with client.open_session() as session:
                stream = session.generate(
                    PROMPTS[1], max_tokens=TOKENS, stop=[stop], prediction_tokens=plain.tokens, **GREEDY
                )
                got = [token for chunk in stream for token in chunk.tokens]
            assert stream.final is not None and stream.final.finish_reason == "stop"
            usage = stream.final.usage
            runs = [i for step in step_records(step_log) for i in step.items if i.session == session.id and i.sampled]
            kept_last = len(got) - sum(i.sampled for i in runs[:-1])  # (the stop came in the last run)
            cut_inside += runs[-1].predicted and kept_last < runs[-1].sampled
            taken = sum(i.sampled - 1 for i in runs[:-1] if i.predicted) + (kept_last - 1) * runs[-1].predicted
            fed = sum(i.guessed for i in runs if i.predicted)
            assert (usage.accepted_prediction_tokens, usage.rejected_prediction_tokens) == (taken, fed - taken)
            assert usage.accepted_prediction_tokens < usage.completion_tokens == len(got)
            thrown_away += (runs[-1].sampled - kept_last) if runs[-1].guessed else 0
        # The daemon's counters count what the answers kept too (they counted the guesses after a stop as taken:
        # more tokens "accepted" than generated).
        guessed = [i for step in step_records(step_log) for i in step.items if i.guessed and i.sampled]
        assert client.status().counters.accepted_tokens == sum(i.sampled - 1 for i in guessed) - thrown_away
    assert thrown_away and cut_inside  # (a stop came inside a run of the prediction's tokens that sampling took)


def test_a_prediction_that_cannot_be_used_is_refused_with_a_sentence(start_daemon: Start) -> None:
    plain = start_daemon("--hot-slots", "2", *NO_GUESSES, name="plain")
    with plain.client() as client, client.open_session() as session:
        with pytest.raises(BadRequest, match="draft_tokens"):
            session.complete("x", max_tokens=2, prediction="y")
        assert session.complete("x", max_tokens=2, **GREEDY).usage.completion_tokens == 2
    with start_daemon("--hot-slots", "2", "--context-size", "2048", *SPECULATE, name="fast").client() as client:
        with client.open_session() as fresh:
            untouched = fresh.complete("x", max_tokens=2, **GREEDY).usage.context_tokens
        with client.open_session() as session:
            with pytest.raises(BadRequest, match="prefill"):
                session.complete("x", max_tokens=0, prediction="y")
            with pytest.raises(BadRequest, match="not both"):
                session.complete("x", max_tokens=2, prediction="y", prediction_tokens=[1])
            with pytest.raises(BadRequest, match="outside this model's vocabulary"):
                session.complete("x", max_tokens=2, prediction_tokens=[10**6])
            with pytest.raises(BadRequest, match="prediction_tokens"):  # the client library checks types
                session.complete("x", max_tokens=2, prediction_tokens="y")
            with pytest.raises(ContextOverflow, match="prediction is 3000 tokens") as refused:  # (2048 cells)
                session.complete("x", max_tokens=2, prediction_tokens=[1] * 3000)
            assert refused.value.detail["room"] < 2048
            usage = session.complete("x", max_tokens=2, **GREEDY).usage
            assert usage.context_tokens == untouched  # the refused requests applied nothing to the session
