"""Grammar jump-forward: what a constrained answer's grammar forces (a JSON record's keys and separators) goes in
without a step of its own: guessed and verified by sampling (the default), or appended unsampled. Real daemons on
the tiny model (its vocabulary is bytes, so a forced text has one spelling and both ways give the answer sampling
every token gives); the tokenization rule and the grammar's fixed whitespace are pure."""

from __future__ import annotations

import json
from collections.abc import Callable

import jsonschema

from kvpool.client import Client
from kvpool.client.cli import format_status
from kvpool.daemon.engine.jumps import forced_tokens
from kvpool.daemon.llama.model.grammar import json_schema_grammar
from kvpool.daemon.ops.prometheus import render

from .daemon_process import DaemonProcess

Start = Callable[..., DaemonProcess]
GREEDY = {"temperature": 0.0}
# Records the tiny model can finish: the grammar leaves it the first letter of a name and a digit.
SCHEMA = {
    "type": "array",
    "minItems": 3,
    "maxItems": 3,
    "items": {
        "type": "object",
        "properties": {
            "name": {"enum": ["lamp", "fan", "kettle"]},
            "room": {"enum": ["hall", "kitchen"]},
            "watts": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["name", "room", "watts"],
    },
}
PROMPT = '[{"name": "lamp", "room": "hall", "watts": 5}] and the others: '
OFF = ("--jump-forward", "off")


def answers(client: Client, n: int = 2, **params: object) -> list[tuple[str, list[int]]]:
    out = []
    for _ in range(n):
        answer = client.open_session().complete(PROMPT, max_tokens=200, json_schema=SCHEMA, **GREEDY, **params)
        assert answer.finish_reason == "stop"
        out.append((answer.text, answer.tokens))
    return out


def test_forced_text_is_guessed_and_taken_and_changes_no_answer(start_daemon: Start) -> None:
    runs = {}
    # (all of each forced text is guessed, paying or not: how much of it pays follows the measured step times)
    whole = ("--draft-min-tokens", "16")
    for name, args in (("plain", ("--draft-tokens", "0", *OFF)), ("jumping", whole)):
        daemon = start_daemon("--hot-slots", "2", *args, name=name)
        with daemon.client() as client:
            runs[name] = (answers(client), client.status())
    assert runs["jumping"][0] == runs["plain"][0]
    for text, _ in runs["jumping"][0]:
        records = json.loads(text)
        jsonschema.validate(records, SCHEMA)
        assert text.startswith('[{"name": "')  # the fixed whitespace: one space after `:` and `,`
    status = runs["jumping"][1]
    c = status.counters
    assert status.drafts.jump_forward == "guess"
    # Each record's keys and separators are forced: most of an answer's tokens come without a step of their own.
    assert c.jumped_tokens > c.generated_tokens // 3
    assert c.jumped_tokens <= c.accepted_tokens <= c.drafted_tokens
    assert c.decode_calls < c.generated_tokens // 2
    assert runs["plain"][1].counters.jumped_tokens == 0
    assert f"{c.jumped_tokens} forced tokens guessed and taken" in format_status(status)
    assert f'kvpool_draft_tokens_total{{kind="jumped"}} {float(c.jumped_tokens)}' in render(status, {})


def test_appended_forced_tokens_give_the_answer_sampling_gives(start_daemon: Start) -> None:
    """Appended unsampled (no guesses at all): the same answers in fewer steps; an answer asking for
    log-probabilities gets one for every token (its forced text is guessed for instead)."""
    plain = start_daemon("--hot-slots", "2", "--draft-tokens", "0", *OFF, name="plain")
    with plain.client() as client:
        expected = answers(client)
        with_logprobs = client.open_session().complete(PROMPT, max_tokens=200, json_schema=SCHEMA, logprobs=2, **GREEDY)
        plain_calls = client.status().counters.decode_calls
    appending = start_daemon("--hot-slots", "2", "--draft-tokens", "0", "--jump-forward", "append", name="append")
    with appending.client() as client:
        got = answers(client)
        c = client.status().counters
        assert got == expected
        assert c.jumped_tokens > c.generated_tokens // 3 and c.drafted_tokens == 0
        assert c.decode_calls < plain_calls - c.jumped_tokens // 2
        before = c.jumped_tokens
        answer = client.open_session().complete(PROMPT, max_tokens=200, json_schema=SCHEMA, logprobs=2, **GREEDY)
        assert answer.tokens == with_logprobs.tokens
        assert len(answer.logprobs) == len(answer.tokens)
        assert [lp.logprob for lp in answer.logprobs] == [lp.logprob for lp in with_logprobs.logprobs]
        # (without guesses, a forced text is neither appended nor guessed for an answer that reports logprobs)
        assert client.status().counters.jumped_tokens == before


def test_an_answer_stopped_inside_appended_text_continues_as_if_sampled(start_daemon: Start) -> None:
    """A stop string inside the forced text ends the answer where sampling would; the tokens appended but not
    computed are computed with the next turn, which goes on as it would have. (A room's name is forced after its
    first letter: `itchen"` or `all"`, appended whole by the tiny model's byte tokens.)"""
    results = {}
    for name, mode in (("plain", "off"), ("append", "append")):
        daemon = start_daemon("--hot-slots", "2", "--draft-tokens", "0", "--jump-forward", mode, name=name)
        with daemon.client() as client:
            session = client.open_session()
            first = session.complete(PROMPT, max_tokens=200, json_schema=SCHEMA, stop=["itche", 'll"'], **GREEDY)
            assert first.finish_reason == "stop" and '"room": "' in first.text
            second = session.complete(" go on:", max_tokens=40, **GREEDY)
            results[name] = (first.text, first.tokens, second.tokens, client.status().counters.jumped_tokens)
    assert results["append"][:3] == results["plain"][:3]
    assert results["append"][3] > 0 and results["plain"][3] == 0


def test_forced_text_is_tokenized_in_its_context_and_only_as_far_as_it_is_spelled() -> None:
    vocab = {1: b"{", 2: b'"', 3: b"name", 4: b'":', 5: b' "', 6: b'{"', 7: b"\xe2\x96\x81", 8: b" ", 9: b"x"}
    longest = sorted(vocab.items(), key=lambda kv: -len(kv[1]))

    def tokenize(text: str, merge_braces: bool = True, space_mark: bool = False) -> list[int]:
        data, out = text.encode(), []
        if space_mark:
            data = data.replace(b" ", b"\xe2\x96\x81")
        while data:
            for token, piece in longest:
                if token == 6 and not merge_braces:
                    continue
                if data.startswith(piece):
                    out.append(token)
                    data = data[len(piece) :]
                    break
            else:
                raise AssertionError(data)
        return out

    def piece(token: int) -> bytes:
        return vocab[token]

    # After `x`, the forced `{"name": "` is its own tokens.
    assert forced_tokens([9], b'{"name": "', tokenize, piece) == [6, 3, 4, 5]
    # After `{`, a forced `"` would merge with it into `{"`: the boundary would move, so nothing.
    assert forced_tokens([1], b'"name', tokenize, piece) == []
    assert forced_tokens([1], b'"name', lambda t: tokenize(t, merge_braces=False), piece) == [2, 3]
    # A tokenizer that spells a space with its space mark: the tokens up to the space still go.
    assert forced_tokens([9], b'{"name": "', lambda t: tokenize(t, space_mark=True), piece) == [6, 3, 4]
    # A medium's cells as context, or no context: nothing.
    assert forced_tokens([-5], b'{"', tokenize, piece) == [] and forced_tokens([], b'{"', tokenize, piece) == []


def test_json_schema_grammars_fix_the_whitespace_as_json_dumps_writes_it() -> None:
    gbnf = json_schema_grammar(SCHEMA)
    assert 'space ::= ""' in gbnf
    assert '"," space' not in gbnf and '":" space' not in gbnf
    assert '", "' in gbnf and '": "' in gbnf
    # A key or enum value that spells a separator keeps it: its quotes are escaped in the rule's literal.
    odd = json_schema_grammar({"type": "object", "properties": {",": {"const": ":"}}, "required": [","]})
    assert r'"\",\""' in odd and r'"\":\""' in odd
