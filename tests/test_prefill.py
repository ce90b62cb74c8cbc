"""A prefill (`generate` with max_tokens 0), against a real kvpoold on the tiny model: the prompt is computed once,
into the session's KV, and the next turn continues from it as if both had been sent together."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvpool import protocol as p
from kvpool.client import Client
from kvpool.client.errors import KvpoolError

from .daemon_process import DaemonProcess

Start = Callable[..., DaemonProcess]


def byte_tokens(text: str) -> list[int]:
    """The tiny model's token ids for raw bytes (ids 0-2 are <unk> <s> </s>)."""
    return [b + 3 for b in text.encode()]


START, REST = [1, *byte_tokens("The robot said to the kitchen")], byte_tokens(" and then")


def computed(client: Client) -> tuple[int, int]:
    """(prompt tokens computed, tokens generated) so far, by the daemon's count."""
    counters = client.status().counters
    return counters.prompt_tokens, counters.generated_tokens


def one_shot(client: Client, tokens: list[int]) -> list[int]:
    with client.open_session() as fresh:
        return fresh.complete(tokens, max_tokens=8, temperature=0.0).tokens


def test_a_prefill_computes_its_prompt_once_and_the_next_turn_continues_from_it(daemon: DaemonProcess) -> None:
    with daemon.client() as client, client.open_session() as s:
        before = computed(client)
        prefill = s.complete(START, max_tokens=0)
        assert prefill.finish_reason == p.FinishReason.LENGTH
        assert prefill.tokens == [] and prefill.text == ""
        assert prefill.usage.completion_tokens == 0 and prefill.usage.context_tokens == len(START)
        after_prefill = computed(client)
        assert after_prefill == (before[0] + len(START), before[1])
        answer = s.complete(REST, max_tokens=8, temperature=0.0)
        # The turn computed its own tokens only: the prefill's are in the KV.
        assert computed(client) == (after_prefill[0] + len(REST), after_prefill[1] + 8)
        assert answer.usage.context_tokens == len(START) + len(REST) + 8
        assert s.history() == START + REST + answer.tokens
        assert answer.tokens == one_shot(client, START + REST)


def test_a_prefill_after_an_answer_computes_its_last_token_too(daemon: DaemonProcess) -> None:
    with daemon.client() as client, client.open_session() as s:
        first = s.complete(START, max_tokens=4, temperature=0.0)
        before = computed(client)
        s.complete(REST, max_tokens=0)
        # The answer's last token (sampled, not yet in the KV) and the new prompt.
        assert computed(client) == (before[0] + 1 + len(REST), before[1])
        answer = s.complete(byte_tokens("!"), max_tokens=6, temperature=0.0)
        assert answer.tokens == one_shot(client, START + first.tokens + REST + byte_tokens("!"))[:6]


def test_a_prefill_with_nothing_to_compute_is_refused_and_the_session_goes_on(daemon: DaemonProcess) -> None:
    with daemon.client() as client, client.open_session() as s:
        s.complete(START, max_tokens=0)
        for prompt, max_tokens in (([], 0), ([], 5)):  # everything the session holds is computed
            with pytest.raises(KvpoolError) as refused:
                s.complete(prompt, max_tokens=max_tokens)
            assert refused.value.code == "BAD_REQUEST" and "empty" in refused.value.message
        answer = s.complete(REST, max_tokens=8, temperature=0.0)
        assert answer.tokens == one_shot(client, START + REST)


def test_a_prefilled_session_hibernates_and_continues_from_the_pool(start_daemon: Start) -> None:
    daemon = start_daemon("--hot-slots", "1", "--context-size", "2048", "--threads", "2")
    with daemon.client() as client, client.open_session() as s, client.open_session() as other:
        s.complete(START, max_tokens=0)
        other.complete([1, *byte_tokens("Something else")], max_tokens=4, temperature=0.0)  # takes the only slot
        tiers = {info.session: info.tier for info in client.sessions()}
        assert tiers[s.id] == "pool"
        restores, before = client.status().moves.restores_pool, computed(client)
        answer = s.complete(REST, max_tokens=8, temperature=0.0)
        assert client.status().moves.restores_pool == restores + 1
        assert computed(client) == (before[0] + len(REST), before[1] + 8)  # restored, not computed again
        assert answer.tokens == one_shot(client, START + REST)


def test_a_prefill_in_deterministic_mode_continues_as_the_whole_prompt_would(start_daemon: Start) -> None:
    """Deterministic decoding pads one-token steps with a row of its own; a prefill's steps ask for no logits at all,
    and the turn after it still reads what the whole prompt at once gives."""
    daemon = start_daemon("--hot-slots", "2", "--context-size", "2048", "--threads", "2", "--deterministic")
    with daemon.client() as client, client.open_session() as s, client.open_session() as whole:
        s.complete(START[:1], max_tokens=0)  # a one-token step: padded
        s.complete(START[1:], max_tokens=0)
        split = s.complete(REST, max_tokens=8, temperature=0.0, logprobs=0)
        once = whole.complete(START + REST, max_tokens=8, temperature=0.0, logprobs=0)
        assert split.tokens == once.tokens
        assert [t.logprob for t in split.logprobs] == pytest.approx([t.logprob for t in once.logprobs], abs=1e-4)
