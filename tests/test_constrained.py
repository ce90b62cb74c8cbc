"""Constrained decoding in the daemon, for every client: GBNF grammars and JSON Schemas (through llama.cpp's grammar
sampler), lazy grammars, continuing a constrained answer (after a daemon restart too), refusals in words, and the
samplers and log-probabilities a generate request carries. The tiny model's weights are random: whatever it
"wants", the grammar decides what is valid, so every output below is checked against its schema."""

from __future__ import annotations

import json
import math
import signal
from collections.abc import Callable

import jsonschema
import pytest

from kvpool.client import Client
from kvpool.client.errors import BadRequest

from .daemon_process import DaemonProcess

Start = Callable[..., DaemonProcess]
BRACE = 3 + ord("{")  # the tiny vocabulary: <unk> <s> </s>, then one token per byte

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "pet": {"enum": ["cat", "dog", "none"]},
        },
        "required": ["name", "age", "pet"],
    },
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 2, "maxItems": 4},
    {
        "type": "object",
        "properties": {
            "light": {
                "type": "object",
                "properties": {"room": {"type": "string", "maxLength": 8}, "on": {"type": "boolean"}},
            },
            "level": {"anyOf": [{"type": "null"}, {"type": "number"}]},
        },
        "required": ["light"],
    },
]


def complete_json(s: object, prompt: str, schema: dict, **kw: object) -> object:
    answer = s.complete(prompt, json_schema=schema, max_tokens=400, **kw)  # type: ignore[attr-defined]
    assert answer.finish_reason == "stop", answer  # the grammar ends the answer, not max_tokens
    value = json.loads(answer.text)
    jsonschema.validate(value, schema)
    return value


@pytest.mark.parametrize("schema", SCHEMAS, ids=["object", "array", "nested"])
def test_json_schema_answers_always_validate(daemon: DaemonProcess, schema: dict) -> None:
    with daemon.client() as client:
        for seed in range(4):
            with client.open_session() as s:
                complete_json(s, "Describe it:", schema, temperature=0.9, seed=seed)
        with client.open_session() as s:
            complete_json(s, "Describe it:", schema, temperature=0.0)


def test_a_gbnf_grammar_limits_the_answer_and_ends_it(daemon: DaemonProcess) -> None:
    grammar = 'root ::= ("yes" | "no") " because " [a-z]{3,8} "."'
    with daemon.client() as client, client.open_session() as s:
        for seed in range(3):
            answer = s.complete("Is it?", grammar=grammar, temperature=1.0, seed=seed, max_tokens=64)
            head, _, reason = answer.text.partition(" because ")
            assert head in ("yes", "no") and reason.endswith(".") and 3 <= len(reason) - 1 <= 8, answer.text
            assert answer.finish_reason == "stop"


def test_bad_grammars_and_schemas_are_refused_in_words_and_the_daemon_keeps_serving(daemon: DaemonProcess) -> None:
    with daemon.client() as client, client.open_session() as s:
        cases = [
            ({"grammar": 'root ::= "a'}, "not valid GBNF: unexpected end of input"),
            ({"grammar": "root ::= foo"}, "Undefined rule identifier 'foo'"),
            ({"grammar": 'start ::= "a"'}, "GBNF: grammar does not contain a 'root' symbol"),
            ({"json_schema": {"type": "object", "not": {"type": "string"}}}, "`not`"),
            ({"json_schema": {"type": "number", "minimum": 0.5}}, "only on integers"),
            ({"json_schema": "{not json"}, "not valid JSON"),
            ({"json_schema": {"type": "string", "format": "email"}}, "email"),
            ({"grammar": 'root ::= "a"', "json_schema": {"type": "string"}}, "not both"),
            ({"grammar_trigger_words": ["<call>"]}, "need a `grammar`"),
            ({"grammar": 'root ::= "a"', "grammar_from": 10_000}, "grammar_from"),
        ]
        for fields, words in cases:
            with pytest.raises(BadRequest, match=words if not words.startswith("`") else f"\\{words}"):
                s.complete("x", max_tokens=4, **fields)
        assert s.complete("still here", max_tokens=3).usage.completion_tokens == 3


def test_a_lazy_grammar_starts_at_its_trigger(daemon: DaemonProcess) -> None:
    """Free text until the trigger token comes (the bias makes it come at once); from it on, the grammar."""
    grammar = 'root ::= "{" [a-z]{2,5} "}"'
    with daemon.client() as client, client.open_session() as s:
        answer = s.complete(
            "go",
            grammar=grammar,
            grammar_trigger_tokens=[BRACE],
            logit_bias={BRACE: 100.0},
            temperature=0.0,
            max_tokens=32,
        )
        assert answer.text.startswith("{") and answer.text.endswith("}") and answer.finish_reason == "stop"
        inner = answer.text[1:-1]
        assert 2 <= len(inner) <= 5 and inner.isalpha(), answer.text
        free = s.complete("go", grammar=grammar, grammar_trigger_tokens=[BRACE], temperature=0.0, max_tokens=8)
        assert free.finish_reason == "length" and "{" not in free.text  # never triggered: free text


def test_a_constrained_answer_cut_short_continues_across_a_daemon_restart(start_daemon: Start) -> None:
    schema = SCHEMAS[0]
    daemon = start_daemon("--hot-slots", "2", "--context-size", "2048")
    with daemon.client() as client:
        s = client.open_session()
        sid, token = s.id, s.token
        start = len(s.history()) + len(client.tokenize("Describe it:", add_bos=True))
        first = s.complete("Describe it:", json_schema=schema, max_tokens=6, temperature=0.0)
        assert first.finish_reason == "length"
    daemon.stop(signal.SIGKILL)  # the finished turn is checkpointed: the cut answer survives
    daemon.start()
    with daemon.client() as client:
        s = client.resume_session(sid, token)
        rest = s.complete("", json_schema=schema, grammar_from=start, max_tokens=400, temperature=0.0)
        assert rest.finish_reason == "stop"
        jsonschema.validate(json.loads(first.text + rest.text), schema)
        with pytest.raises(BadRequest, match="does not fit"):  # another grammar cannot take this answer over
            s.complete("", grammar='root ::= "x"', grammar_from=start, max_tokens=4)


def test_a_preempted_constrained_generation_stays_valid(start_daemon: Start) -> None:
    config = "[tasks.default]\n[tasks.voice]\nttft_ms = 30000\n[tasks.background]\nbest_effort = true\n"
    daemon = start_daemon("--hot-slots", "1", "--context-size", "2048", config=config)
    # Exactly 1,301 tokens (the tiny model spells byte by byte): the answer is still running, by a margin of a
    # second or so, when the urgent request arrives.
    grammar = 'root ::= "[" item ("," item){99} "]"\nitem ::= "\\"" [a-z]{10} "\\""'
    schema = {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{10}$"}, "minItems": 100, "maxItems": 100}
    with (
        daemon.client() as client,
        daemon.client() as other,
        client.open_session(task="background") as slow,
        other.open_session(task="voice") as urgent,
    ):
        stream = slow.generate("List:", grammar=grammar, max_tokens=1400, temperature=0.7, seed=3)
        first = next(stream)
        assert urgent.complete("now", max_tokens=4).usage.completion_tokens == 4  # takes the only slot
        text = first.text + "".join(chunk.text for chunk in stream)
        jsonschema.validate(json.loads(text), schema)
        assert client.status().tasks["background"].preemptions >= 1


def test_logprobs_come_with_every_token(daemon: DaemonProcess) -> None:
    with daemon.client() as client, client.open_session() as s:
        answer = s.complete("hello", max_tokens=6, temperature=0.0, logprobs=3)
        assert len(answer.logprobs) == len(answer.tokens) == 6
        for entry, token in zip(answer.logprobs, answer.tokens, strict=True):
            assert entry.token == token and entry.logprob <= 0.0 and len(entry.top) == 3
            assert entry.piece == bytes([token - 3]) and all(t.piece == bytes([t.token - 3]) for t in entry.top)
            assert entry.top[0].token == token and entry.top[0].logprob == entry.logprob  # greedy took the best
            assert [t.logprob for t in entry.top] == sorted((t.logprob for t in entry.top), reverse=True)
            assert math.fsum(math.exp(t.logprob) for t in entry.top) <= 1.0 + 1e-6
        none = s.complete("again", max_tokens=2, temperature=0.0)
        assert none.logprobs == []


def test_logit_bias_and_penalties_change_what_is_sampled(daemon: DaemonProcess) -> None:
    z = 3 + ord("z")
    with daemon.client() as client, client.open_session() as s:
        forced = s.complete("x", max_tokens=5, temperature=0.0, logit_bias={z: 100.0})
        assert forced.text == "zzzzz"
        banned = s.complete("x", max_tokens=5, temperature=0.0, logit_bias={z: 100.0}, presence_penalty=2.0,
                            repeat_penalty=10.0, repeat_last_n=8)  # fmt: skip
        assert banned.text.count("z") < 5  # the penalties push the repeated token down
        with pytest.raises(BadRequest, match="vocabulary"):
            s.complete("x", max_tokens=2, logit_bias={10**6: 1.0})


def test_the_cli_generates_from_a_schema(daemon: DaemonProcess, tmp_path: object) -> None:
    import subprocess
    import sys

    schema = json.dumps(SCHEMAS[1])
    done = subprocess.run(
        [sys.executable, "-m", "kvpool.client.cli", "--address", daemon.address, "generate", "numbers:",
         "--json-schema", schema, "--max-tokens", "200", "--temperature", "0", "--logprobs", "2"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    jsonschema.validate(json.loads(done.stdout), SCHEMAS[1])
    assert len(done.stderr.strip().splitlines()) >= 3  # one log-probability line per token


def test_the_sync_client_turns_a_schema_dict_into_its_text(daemon: DaemonProcess) -> None:
    with Client(daemon.address) as client, client.open_session() as s:
        complete_json(s, "x", {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]})
