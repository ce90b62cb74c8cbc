"""Tool calls and structured output through the gateway, with the real `openai` client: kvpool's envelope format
(docs/gateway.md) held by the daemon's grammar, so calls and JSON answers always parse and validate, streamed or
not; a tool loop keeps its KV. The tiny model's weights are random: tool_choice (required, named) and logit_bias
force the branch a test needs; the grammar guarantees the syntax."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from kvpool import protocol as p
from kvpool.gateway.shaping import ChoiceFormat, ChoiceState
from kvpool.gateway.tools import EnvelopeParser

from .daemon_process import DaemonProcess
from .gateway_process import WAIT_S, GatewayProcess, client_of, metric
from .test_speculative import FLOAT_TIE, NO_GUESSES, SPECULATE

LIGHT = {
    "type": "function",
    "function": {
        "name": "set_light",
        "description": "Switch a room's light on or off",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"room": {"enum": ["kitchen", "hall"]}, "on": {"type": "boolean"}},
            "required": ["room", "on"],
            "additionalProperties": False,
        },
    },
}
TIMER = {
    "type": "function",
    "function": {
        "name": "start_timer",
        "description": "Start a timer",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"minutes": {"type": "integer", "minimum": 1, "maximum": 90}},
            "required": ["minutes"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [LIGHT, TIMER]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
RECORD = {
    "type": "object",
    "properties": {
        "label": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "count": {"type": "integer", "minimum": 0, "maximum": 20},
        "seen": {"type": "boolean"},
    },
    "required": ["label", "count", "seen"],
}
RESPOND = {str(3 + ord("r")): 30.0}  # the envelope's first key: "response", not "tool_calls"
ASK = {"temperature": 0.0, "max_tokens": 300}


def create(c: openai.OpenAI, messages: list[Any], **kw: Any) -> Any:
    return c.chat.completions.create(model="tiny", messages=messages, **{**ASK, **kw})


def check_calls(message: Any, names: set[str] | None = None) -> None:
    assert message.content is None and message.tool_calls
    for call in message.tool_calls:
        assert re.fullmatch(r"call_[0-9a-f]{24}", call.id) and call.type == "function"
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


# ---------------------------------------------------------------------- the envelope, read as it arrives


@pytest.mark.parametrize(
    "text",
    [
        '{"tool_calls": [{"name": "a", "arguments": {"s": "x\\"}y", "n": [1, 2.5e3, true, null]}}, '
        '{"name":"b","arguments":{ }}]}',
        '{ "response" : "caf\\u00e9 \\ud83d\\ude00 \\n\\t\\\\ done" }',
        '{"response": {"label": "x", "count": 3}}',
        '{"tool_calls": [{"name": "a", "arguments": {"s": "cut sh',
    ],
)
def test_the_envelope_reads_the_same_whole_or_one_character_at_a_time(text: str) -> None:
    whole, pieces = EnvelopeParser(), EnvelopeParser()
    whole.feed(text)
    for char in text:
        pieces.feed(char)
    assert [(c.name, c.arguments) for c in whole.calls] == [(c.name, c.arguments) for c in pieces.calls]
    assert (whole.response, whole.responding) == (pieces.response, pieces.responding)
    if text.startswith('{"tool_calls": [{"name": "a", "arguments": {"s": "x'):
        assert [c.name for c in whole.calls] == ["a", "b"]
        assert whole.calls[0].arguments == '{"s": "x\\"}y", "n": [1, 2.5e3, true, null]}'  # exactly as written
        assert whole.calls[1].arguments == "{ }"
    elif '"response" :' in text:
        assert whole.response == "café 😀 \n\t\\ done"
    elif "label" in text:
        assert json.loads(whole.response) == {"label": "x", "count": 3}
    else:
        assert whole.calls[0].arguments == '{"s": "cut sh' and whole.calls[0].named
    assert whole.whole == pieces.whole == (not text.endswith("cut sh"))


def test_calls_a_stop_string_cut_are_not_reported_as_tool_calls() -> None:
    """The finish reason of a tool envelope that ended normally: tool_calls only when the envelope closed. A stop
    string matched inside it (a template's implied one, written as text) leaves half a call: the answer stopped."""
    usage, timings = (
        p.Usage(prompt_tokens=1, completion_tokens=9, context_tokens=10),
        p.Timings(queue_ms=0, ttft_ms=0, total_ms=0, decode_tokens_per_s=0),
    )
    for text, stop, reason in (
        ('{"tool_calls": [{"name": "a", "arguments": {"x": 1}}]}', None, "tool_calls"),
        ('{"tool_calls": [{"name": "a", "arguments": {"x": "cut', "\nUser:", "stop"),
        ('{"tool_calls": [{"name": "a", "arguments": {"x": "cu', None, "stop"),
    ):
        state = ChoiceState(0, ChoiceFormat(chat=True, tools=True))
        state.add(p.Chunk(text=text, tokens=[1]))
        state.final = p.Final(finish_reason=p.FinishReason.STOP, usage=usage, timings=timings, stop=stop)
        assert state.finish_reason() == reason, text
        # Half a call is no call: the message hands over only calls whose envelope closed.
        assert bool(state.message().get("tool_calls")) == (reason == "tool_calls") == bool(state.calls())
    state.final = p.Final(finish_reason=p.FinishReason.LENGTH, usage=usage, timings=timings)
    assert state.finish_reason() == "length"  # cut by its limit, and saying so: the call as far as it went
    assert state.calls() == [("a", '{"x": "cu')]


# ---------------------------------------------------------------------- calls


def test_auto_gives_a_valid_call_or_a_valid_answer(served: GatewayProcess) -> None:
    c = client_of(served)
    kinds = set()
    for seed in range(4):
        reply = create(c, [{"role": "user", "content": "kitchen light on"}], tools=TOOLS, temperature=1.0, seed=seed)
        choice = reply.choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            check_calls(choice.message)
            kinds.add("call")
        else:
            assert choice.finish_reason == "stop" and isinstance(choice.message.content, str)
            kinds.add("answer")
    assert kinds  # either way, valid
    answer = create(c, [{"role": "user", "content": "hi"}], tools=TOOLS, logit_bias=RESPOND)
    assert answer.choices[0].message.tool_calls is None and isinstance(answer.choices[0].message.content, str)


def test_a_required_call_and_a_named_call(served: GatewayProcess) -> None:
    c = client_of(served)
    for seed in range(3):
        forced = create(
            c, [{"role": "user", "content": "do it"}], tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed
        )
        assert forced.choices[0].finish_reason == "tool_calls"
        check_calls(forced.choices[0].message)
        named = create(
            c,
            [{"role": "user", "content": "do it"}],
            tools=TOOLS,
            temperature=1.0,
            seed=seed,
            tool_choice={"type": "function", "function": {"name": "start_timer"}},
        )
        check_calls(named.choices[0].message, {"start_timer"})


def test_parallel_calls_come_as_a_list(served: GatewayProcess) -> None:
    comma = {str(3 + ord(",")): 100.0}  # after a call, another one
    reply = create(
        client_of(served),
        [{"role": "user", "content": "both"}],
        tools=TOOLS,
        tool_choice="required",
        logit_bias=comma,
        max_tokens=200,
    )
    calls = reply.choices[0].message.tool_calls
    assert len(calls) >= 2 and len({call.id for call in calls}) == len(calls)
    for call in calls[:-1]:  # the last may be cut by max_tokens
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_streamed_calls_reassemble_as_the_sdk_does_into_the_answer_not_streamed(served: GatewayProcess) -> None:
    c = client_of(served)
    messages = [{"role": "user", "content": "kitchen light"}]
    for choice_kw in (
        {"tool_choice": "required"},
        {"tool_choice": {"type": "function", "function": {"name": "set_light"}}},
    ):
        plain = create(c, messages, tools=TOOLS, **choice_kw)
        with c.chat.completions.stream(model="tiny", messages=messages, tools=TOOLS, **ASK, **choice_kw) as stream:
            streamed = stream.get_final_completion()
        # and by hand, chunk by chunk: the opening delta of a call carries its id and name, the others pieces
        state = ChatCompletionStreamState(input_tools=TOOLS)
        openings = []
        for chunk in create(c, messages, tools=TOOLS, stream=True, **choice_kw):
            state.handle_chunk(chunk)
            for choice in chunk.choices:
                for delta in choice.delta.tool_calls or ():
                    if delta.id is not None:
                        assert delta.function.arguments == "" and delta.function.name
                        openings.append(delta.index)
                    else:
                        assert delta.function.name is None and delta.function.arguments
        by_hand = state.get_final_completion()
        expected = [(t.function.name, t.function.arguments) for t in plain.choices[0].message.tool_calls]
        for completion in (streamed, by_hand):
            choice = completion.choices[0]
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            assert [(t.function.name, t.function.arguments) for t in choice.message.tool_calls] == expected
            for call in choice.message.tool_calls:  # strict tools: the SDK parsed them
                assert call.function.parsed_arguments == json.loads(call.function.arguments)
        assert openings == list(range(len(expected)))


def test_a_streamed_answer_is_content_decoded_from_its_envelope(served: GatewayProcess) -> None:
    c = client_of(served)
    messages = [{"role": "user", "content": "say something"}]
    plain = create(c, messages, tools=TOOLS, logit_bias=RESPOND, max_tokens=60)
    text = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in create(c, messages, tools=TOOLS, logit_bias=RESPOND, max_tokens=60, stream=True)
        if chunk.choices
    )
    assert plain.choices[0].message.tool_calls is None and text == plain.choices[0].message.content


def test_a_tool_loop_keeps_its_kv(served: GatewayProcess) -> None:
    """user -> call -> result -> answer -> user: each request's cached tokens cover the whole earlier history, the
    call (rendered as the raw text the model generated) and the tool's result included. The first call is streamed
    and its message sent back as the SDK's stream helper built it."""
    c = client_of(served)
    messages: list[Any] = [
        {"role": "system", "content": "You run a house."},
        {"role": "user", "content": "turn the kitchen light on"},
    ]
    with c.chat.completions.stream(
        model="tiny",
        messages=messages,
        tools=TOOLS,
        tool_choice="required",
        prompt_cache_key="house",
        stream_options={"include_usage": True},
        **ASK,
    ) as stream:
        first = stream.get_final_completion()
    call = first.choices[0].message
    check_calls(call)
    messages += [call, *({"role": "tool", "tool_call_id": t.id, "content": "ok"} for t in call.tool_calls)]
    second = create(c, messages, tools=TOOLS, logit_bias=RESPOND, prompt_cache_key="house", max_tokens=40)
    # (and the opening of the result, prefilled while the "tool" ran)
    prefilled = metric(served, "kvpool_gateway_prefilled_tokens_total")
    assert prefilled > 0
    assert second.usage.prompt_tokens_details.cached_tokens == (
        first.usage.prompt_tokens + first.usage.completion_tokens + prefilled
    )
    messages += [second.choices[0].message, {"role": "user", "content": "and a timer"}]
    third = create(c, messages, tools=TOOLS, tool_choice="required", prompt_cache_key="house")
    assert (
        third.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens + second.usage.completion_tokens
    )
    check_calls(third.choices[0].message)
    # a history the gateway did not generate (another gateway's call ids) still renders, computed afresh
    light = {"name": "set_light", "arguments": '{"room":"hall","on":true}'}
    foreign = [
        {"role": "user", "content": "light"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "x1", "type": "function", "function": light}]},
        {"role": "tool", "tool_call_id": "x1", "content": "done"},
    ]
    again = create(c, foreign, tools=TOOLS, logit_bias=RESPOND, max_tokens=40)
    assert again.usage.prompt_tokens_details.cached_tokens == 0 and again.choices[0].message.content is not None
    with pytest.raises(openai.BadRequestError, match="tool_call_id") as unknown:
        create(c, [*foreign[:1], {"role": "tool", "tool_call_id": "nobody", "content": "?"}], tools=TOOLS)
    assert unknown.value.body["param"] == "messages[1].tool_call_id"  # type: ignore[index]


def computed(answer: Any) -> int:
    """The prompt tokens an answer computed (not taken from its session)."""
    return int(answer.usage.prompt_tokens - answer.usage.prompt_tokens_details.cached_tokens)


def test_the_opening_of_a_tools_result_is_computed_before_the_result_comes(
    daemon: DaemonProcess, start_gateway: Callable[..., GatewayProcess]
) -> None:
    """After a call, the gateway computes what the request carrying its result begins with (the end of the turn,
    `{"tool_response": {"name": ..., "content": "`) while the tool runs: that request computes the rest only."""
    eager = start_gateway(daemon.address, name="eager")
    plain = start_gateway(daemon.address, "--no-tool-result-prefill", name="plain")
    answers = {}
    for name, gateway in (("eager", eager), ("plain", plain)):
        c = client_of(gateway)
        messages: list[Any] = [{"role": "user", "content": "the hall light, please"}]
        call = create(c, messages, tools=TOOLS, tool_choice="required", prompt_cache_key="hall").choices[0].message
        messages += [call, *({"role": "tool", "tool_call_id": t.id, "content": "done"} for t in call.tool_calls)]
        answers[name] = create(c, messages, tools=TOOLS, logit_bias=RESPOND, prompt_cache_key="hall", max_tokens=40)
    eager_answer, plain_answer = answers["eager"], answers["plain"]
    prefilled = metric(eager, "kvpool_gateway_prefilled_tokens_total")
    assert prefilled > 0 and metric(plain, "kvpool_gateway_prefilled_tokens_total") == 0
    # Tokenized apart, the rest gets again what this tokenizer puts in front of a text (SentencePiece's "▁").
    with daemon.client() as client:
        in_front = len(client.tokenize("ab", add_bos=False)) - 2
    assert computed(eager_answer) == computed(plain_answer) - prefilled + in_front
    assert eager_answer.choices[0].message.content is not None


def test_a_conversation_that_goes_on_without_the_results_starts_afresh(served: GatewayProcess) -> None:
    """A client that answers a call with a user message instead of its result (OpenAI's API would refuse it) gets
    its answer from exactly that conversation: the prefilled opening does not match, so a new session computes it."""
    c = client_of(served)
    messages: list[Any] = [{"role": "user", "content": "a timer"}]
    call = create(c, messages, tools=TOOLS, tool_choice="required", prompt_cache_key="odd").choices[0].message
    messages += [call, {"role": "user", "content": "never mind"}]
    answer = create(c, messages, tools=TOOLS, logit_bias=RESPOND, prompt_cache_key="odd", max_tokens=40)
    assert answer.usage.prompt_tokens_details.cached_tokens == 0
    alone = create(c, messages, tools=TOOLS, logit_bias=RESPOND, max_tokens=40)  # the same, without a conversation
    assert answer.choices[0].message.content == alone.choices[0].message.content is not None


def test_schemas_with_local_references_work_inside_the_envelope(served: GatewayProcess) -> None:
    """pydantic writes nested models as `$defs` and `#/$defs/...` references: relative to the tool's parameters (or
    the response's schema), not to the envelope they are put in."""
    room = {"type": "string", "enum": ["kitchen", "hall"]}
    move = {
        "type": "function",
        "function": {
            "name": "move",
            "parameters": {
                "type": "object",
                "properties": {"to": {"$ref": "#/$defs/Room"}, "via": {"$ref": "#/$defs/Room"}},
                "required": ["to", "via"],
                "$defs": {"Room": room},
            },
        },
    }
    record = {
        "type": "object",
        "properties": {"where": {"$ref": "#/definitions/Room"}},
        "required": ["where"],
        "definitions": {"Room": room},
    }
    c = client_of(served)
    for seed in range(2):
        call = create(
            c,
            [{"role": "user", "content": "go"}],
            tools=[LIGHT, move],
            temperature=1.0,
            seed=seed,
            tool_choice={"type": "function", "function": {"name": "move"}},
        )
        arguments = json.loads(call.choices[0].message.tool_calls[0].function.arguments)
        jsonschema.validate(arguments, move["function"]["parameters"])
    answer = create(
        c,
        [{"role": "user", "content": "where?"}],
        tools=[move],
        logit_bias=RESPOND,
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": record}},
    )
    jsonschema.validate(json.loads(answer.choices[0].message.content), record)


def test_an_invalid_tool_schema_is_a_400_naming_the_tool(served: GatewayProcess) -> None:
    bad = {
        "type": "function",
        "function": {
            "name": "bad",
            "parameters": {"type": "object", "properties": {"x": {"type": "string", "not": {"const": "y"}}}},
        },
    }
    with pytest.raises(openai.BadRequestError, match="not") as refused:
        create(client_of(served), [{"role": "user", "content": "hi"}], tools=[LIGHT, bad])
    body = refused.value.body
    assert body["param"] == "tools[1].function.parameters"  # type: ignore[index]
    assert body["message"].startswith("tools[1].function.parameters.properties.x")  # type: ignore[index]
    twice = httpx.post(
        served.url + "/v1/chat/completions",
        timeout=WAIT_S,
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": [LIGHT, LIGHT]},
    )
    assert twice.status_code == 400 and twice.json()["error"]["param"] == "tools[1].function.name"


# ---------------------------------------------------------------------- structured output


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_structured_output_always_parses_and_validates(served: GatewayProcess, stream: bool) -> None:
    c = client_of(served)
    formats: list[tuple[dict[str, Any], dict[str, Any]]] = [
        ({"type": "json_schema", "json_schema": {"name": "record", "schema": RECORD, "strict": True}}, RECORD),
        ({"type": "json_schema", "json_schema": {"name": "record", "schema": RECORD}}, RECORD),  # strict false
        ({"type": "json_object"}, {"type": "object"}),
    ]
    close = {str(3 + ord("}")): 20.0}  # a free-form object on random weights: closed soon
    for response_format, schema in formats:
        for seed in range(3):
            kw: dict[str, Any] = {"response_format": response_format, "temperature": 0.9, "seed": seed}
            if response_format["type"] == "json_object":
                kw["logit_bias"] = close
            for chat in (True, False):
                if chat:
                    reply = c.chat.completions.create(
                        model="tiny",
                        messages=[{"role": "user", "content": "a frame"}],
                        max_tokens=300,
                        stream=stream,
                        **kw,
                    )
                else:
                    reply = c.completions.create(
                        model="tiny",
                        prompt="A frame:",
                        max_tokens=300,
                        stream=stream,
                        extra_body={"response_format": response_format},
                        **{k: v for k, v in kw.items() if k != "response_format"},
                    )
                text = (
                    collect(reply, chat)
                    if stream
                    else (reply.choices[0].message.content if chat else reply.choices[0].text)
                )
                jsonschema.validate(json.loads(text), schema)
    assert (
        c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4, response_format={"type": "text"}
        )
        .choices[0]
        .message.content
    )


def collect(stream: Any, chat: bool) -> str:
    return "".join((ch.choices[0].delta.content if chat else ch.choices[0].text) or "" for ch in stream if ch.choices)


def test_a_structured_response_next_to_tools(served: GatewayProcess) -> None:
    """With tools and response_format, an answer that is not a call follows the response_format's schema: the
    content is its JSON text."""
    reply = create(
        client_of(served),
        [{"role": "user", "content": "count them"}],
        tools=TOOLS,
        logit_bias=RESPOND,
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": RECORD}},
    )
    message = reply.choices[0].message
    assert message.tool_calls is None and reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(message.content), RECORD)


def test_an_unsupported_schema_keyword_is_the_daemons_sentence(served: GatewayProcess) -> None:
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(openai.BadRequestError, match="uniqueItems") as refused:
        create(client_of(served), [{"role": "user", "content": "hi"}], response_format=bad)
    assert refused.value.body["param"] == "response_format.json_schema.schema"  # type: ignore[index]


def test_tool_calls_are_the_same_with_and_without_guesses(
    start_daemon: Callable[..., DaemonProcess], start_gateway: Callable[..., GatewayProcess]
) -> None:
    """A tool envelope is fixed text between the model's choices (docs/gateway.md): guessed as the grammar's forced
    text and from the calls before it (docs/speculative.md), verified, it gives the calls sampling every token
    gives, up to a float tie (a step with guessed rows is a batch of another shape)."""
    comma = {str(3 + ord(",")): 100.0}  # after a call, another one: the envelope repeats
    replies, counters = {}, {}
    for name, flags in (("plain", NO_GUESSES), ("fast", SPECULATE)):
        daemon = start_daemon("--hot-slots", "2", *flags, name=name)
        gateway = start_gateway(daemon.address, name=f"gw-{name}")
        replies[name] = create(
            client_of(gateway), [{"role": "user", "content": "both lights"}], tools=TOOLS, tool_choice="required",
            logit_bias=comma, max_tokens=120, logprobs=True,
        )  # fmt: skip
        with daemon.client() as client:
            counters[name] = client.status().counters
    fast, plain = (replies[n].choices[0].logprobs.content for n in ("fast", "plain"))
    assert len(fast) == len(plain) == 120
    for a, b in zip(fast, plain, strict=True):
        # Where they part, the two tokens were a near-tie. (Elsewhere the envelope's forced tokens can be very
        # unlikely ones, whose log-probabilities carry more float noise than a tie's: -16.85 against -16.81.)
        if a.token != b.token:
            assert abs(a.logprob - b.logprob) < FLOAT_TIE, (a, b)
            break
    else:  # the same answer: the same calls (their ids are the gateway's own)
        calls = {n: [(c.function.name, c.function.arguments) for c in replies[n].choices[0].message.tool_calls or ()]
                 for n in replies}  # fmt: skip
        assert calls["fast"] == calls["plain"] and calls["plain"]
    assert counters["fast"].accepted_tokens > 0 and counters["fast"].jumped_tokens > 0
    assert counters["plain"].drafted_tokens == 0
