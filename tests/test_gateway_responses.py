"""OpenAI's Responses API through the real openai client, against a real kvpool-gateway and kvpoold (tiny model):
answers equal the chat route's; a previous_response_id chain computes only its new input, after the gateway and
the daemon restart too; stored responses are read, listed and deleted; tools, text.format, streaming events; what
cannot be honoured is refused by name."""

from __future__ import annotations

import contextlib
import json
import re
import signal
from collections.abc import Callable

import httpx
import msgspec
import openai
import pytest

from kvpool.gateway import responses_api
from kvpool.gateway.http_errors import HttpError

from .daemon_process import DaemonProcess
from .gateway_process import GatewayProcess, client_of

LIGHT = {
    "type": "function",
    "name": "set_light",
    "description": "Switch a room's light",
    "parameters": {
        "type": "object",
        "properties": {"room": {"type": "string", "enum": ["kitchen", "hall"]}, "on": {"type": "boolean"}},
        "required": ["room", "on"],
        "additionalProperties": False,
    },
}
GREEDY = {"temperature": 0.0}


def cached(response: openai.types.responses.Response) -> int:
    assert response.usage is not None
    return response.usage.input_tokens_details.cached_tokens


def test_a_response_is_the_chat_routes_answer_and_a_chain_computes_only_its_new_input(served: GatewayProcess) -> None:
    client = client_of(served)
    first = client.responses.create(
        model="tiny", input="hello there", instructions="be brief", max_output_tokens=8, **GREEDY
    )
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}],
        max_tokens=8,
        **GREEDY,
    )
    assert first.object == "response" and first.status in ("completed", "incomplete")
    assert first.output_text == chat.choices[0].message.content
    assert first.usage is not None and first.usage.input_tokens == chat.usage.prompt_tokens
    second = client.responses.create(
        model="tiny",
        input="and then?",
        instructions="be brief",
        previous_response_id=first.id,
        max_output_tokens=8,
        **GREEDY,
    )
    assert second.previous_response_id == first.id
    # Everything the first response's conversation held was kept in the chain's session: only the new input ran.
    assert cached(second) >= first.usage.input_tokens + first.usage.output_tokens - 1
    again = client.responses.retrieve(second.id)
    assert again.id == second.id and again.output_text == second.output_text
    items = client.responses.input_items.list(second.id)
    assert [i.type for i in items.data] == ["message"] and items.data[0].content[0].text == "and then?"  # type: ignore[union-attr]
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    with pytest.raises(openai.NotFoundError) as gone:
        client.responses.create(model="tiny", input="x", previous_response_id=second.id)
    assert gone.value.body["param"] == "previous_response_id"  # type: ignore[index]
    unstored = client.responses.create(model="tiny", input="not kept", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_streaming_follows_the_responses_event_sequence(served: GatewayProcess) -> None:
    client = client_of(served)
    whole = client.responses.create(model="tiny", input="count for me", max_output_tokens=8, **GREEDY)
    with client.responses.stream(model="tiny", input="count for me", max_output_tokens=8, **GREEDY) as stream:
        events = list(stream)
    kinds = [event.type for event in events]
    # (the tiny model never ends by itself: its answers stop at max_output_tokens, as OpenAI says, incomplete)
    final = next(e.response for e in events if e.type == "response.incomplete")
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert "response.output_text.delta" in kinds and "response.output_text.done" in kinds
    assert kinds[-1] == "response.incomplete" and whole.status == "incomplete"
    assert (
        final.output_text
        == whole.output_text
        == "".join(e.delta for e in events if e.type == "response.output_text.delta")
    )
    assert final.incomplete_details is not None and final.incomplete_details.reason == "max_output_tokens"
    numbers = []
    with httpx.stream(
        "POST",
        served.url + "/v1/responses",
        json={"model": "t", "input": "count", "stream": True, "max_output_tokens": 4},
    ) as raw:
        for line in raw.iter_lines():
            if line.startswith("data: "):
                numbers.append(json.loads(line[6:])["sequence_number"])
    assert numbers == list(range(len(numbers))) and len(numbers) >= 6


def test_a_tool_loop_and_structured_text(served: GatewayProcess) -> None:
    client = client_of(served)
    called = client.responses.create(
        model="tiny", input="light the kitchen", tools=[LIGHT], tool_choice="required", **GREEDY
    )
    calls = [item for item in called.output if item.type == "function_call"]
    assert calls and calls[0].name == "set_light"
    arguments = json.loads(calls[0].arguments)
    assert arguments["room"] in ("kitchen", "hall") and isinstance(arguments["on"], bool)
    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "done"}
    after = client.responses.create(
        model="tiny", input=[result], previous_response_id=called.id, tools=[LIGHT], max_output_tokens=8, **GREEDY
    )
    assert cached(after) > 0  # the call's turn was kept: only its result was computed
    # The same loop sent whole (no previous_response_id), as the Agents SDK sends it, continues by its history.
    history = [{"role": "user", "content": "light the kitchen"}, *[c.model_dump() for c in calls], result]
    resent = client.responses.create(model="tiny", input=history, tools=[LIGHT], max_output_tokens=8, **GREEDY)
    assert resent.output_text == after.output_text
    schema = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 8}}, "required": ["word"]}
    shaped = client.responses.create(
        model="tiny",
        input="one word",
        text={"format": {"type": "json_schema", "name": "w", "schema": schema, "strict": True}},
        max_output_tokens=64,
        **GREEDY,
    )
    assert isinstance(json.loads(shaped.output_text)["word"], str)


def test_what_cannot_be_honoured_is_refused_by_name(served: GatewayProcess) -> None:
    client = client_of(served)
    for kwargs, named in (
        ({"tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0]"),
        ({"prompt_cache_retention": "24h"}, "prompt_cache_retention"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"text": {"format": {"type": "text"}, "tone": "dry"}}, "text.tone"),
        ({"text": {"format": "json_object"}}, "text.format"),
        ({"text": {"format": {"type": "json_object", "schema": {}}}}, "text.format.schema"),
        ({"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation"),
        ({"stream": True, "stream_options": {"frobnicate": 1}}, "stream_options.frobnicate"),
        ({"truncation": "auto"}, "truncation"),
        ({"tools": [{**LIGHT, "frobnicate": 1}]}, "tools[0].frobnicate"),
        ({"tools": [LIGHT], "tool_choice": {"type": "function", "name": "set_light", "x": 1}}, "tool_choice.x"),
        ({"input": []}, "input"),
        ({"max_output_tokens": 10**9}, "max_output_tokens"),
        (
            {"input": [{"role": "assistant", "content": [{"type": "input_image", "image_url": "data:,"}]}]},
            "input[0].content[0]",
        ),
        ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]}, "input[0].content[0].text"),
        (
            {
                "input": [
                    {"type": "function_call", "call_id": "c1", "name": "set_light", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": 5}]},
                ]
            },
            "input[1].output[0].text",
        ),
        (
            {
                "input": [
                    {"type": "function_call", "call_id": "c1", "name": "set_light", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_image"}]},
                ]
            },
            "input[1].output[0]",
        ),
    ):
        arguments = {"model": "tiny", "input": "hi", **kwargs}
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(**arguments)  # type: ignore[arg-type]
        assert named.rsplit(".", 1)[-1] in refused.value.message, refused.value.message
        assert refused.value.body["param"] == named, refused.value.body  # type: ignore[index]
    # A chat field's error names the field as this request sent it.
    schema_without_name = {"format": {"type": "json_schema", "schema": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="tiny", input="hi", text=schema_without_name)  # type: ignore[arg-type]
    assert "text.format" in refused.value.message and "response_format" not in refused.value.message
    # ... and a message's place as its input item: after the instructions, the second item is input[1].
    calls = [
        {"type": "function_call", "call_id": "c1", "name": "set_light", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c2", "output": "on"},
    ]
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="tiny", input=calls, instructions="be brief", tools=[LIGHT])  # type: ignore[arg-type]
    assert refused.value.body["param"] == "input[1].call_id" and "input[1].call_id" in refused.value.message  # type: ignore[index]
    assert "messages[" not in refused.value.message
    # ... and a tool as written flat: its schema the daemon refuses is tools[1].parameters.
    bad = {"type": "function", "name": "bad", "parameters": {"type": "object", "properties": {"x": {"not": {}}}}}
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="tiny", input="hi", tools=[LIGHT, bad])  # type: ignore[list-item]
    assert refused.value.body["param"] == "tools[1].parameters"  # type: ignore[index]
    assert refused.value.message.startswith("Error code: 400 - tools[1].parameters.properties.x"), refused.value
    assert client.responses.create(model="tiny", input="still serving", max_output_tokens=2).status == "incomplete"


def test_each_chat_message_is_named_by_the_input_item_it_came_from() -> None:
    """The map behind the renamed errors: instructions, a stored chain (named whole, whatever of it was wrong),
    then the items, parallel calls merged into one chat message."""
    request = msgspec.convert(
        {
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "both lights"}]},
                {"type": "function_call", "call_id": "c1", "name": "set_light", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "set_light", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c2", "output": "on"},
            ],
            "instructions": "be brief",
            "tools": [LIGHT],
        },
        responses_api.ResponsesRequest,
    )
    history = [{"role": "user", "content": "before"}, {"role": "assistant", "content": "ok"}]
    body, names = responses_api.chat_request(request, history, "")
    chat = body["messages"]
    assert [m["role"] for m in chat] == ["system", "user", "assistant", "user", "assistant", "tool"]
    assert names["messages[0]"] == "instructions" and names["messages[3]"] == "input[0]"
    assert names["messages[4].tool_calls[1].id"] == "input[2].call_id" and names["messages[4]"] == "input[1]"
    assert names["messages[5].tool_call_id"] == "input[3].call_id" and names["tools[0].function"] == "tools[0]"
    error = HttpError(400, "messages[2].tool_calls[0]: x", "x", param="messages[2].tool_calls[0].id")
    assert error.renamed(names).param == "previous_response_id" and error.renamed(names).message == (
        "previous_response_id: x"
    )


def test_a_cut_answer_says_which_item_it_cut(served: GatewayProcess) -> None:
    """max_output_tokens cuts the last output item: it is "incomplete", whole or streamed; a call cut in its
    arguments is never "completed"."""
    client = client_of(served)
    text = client.responses.create(model="tiny", input="count for me", max_output_tokens=6, **GREEDY)
    assert text.status == "incomplete" and [item.status for item in text.output] == ["incomplete"]
    call = {"model": "tiny", "input": "light", "tools": [LIGHT], "tool_choice": "required", **GREEDY}
    whole = client.responses.create(**call)  # type: ignore[arg-type]
    [done] = [item for item in whole.output if item.type == "function_call"][:1]
    assert whole.status == "completed" and done.status == "completed" and json.loads(done.arguments)
    # The tiny model writes a token a byte: six short of the whole answer cuts the call inside its arguments.
    assert whole.usage is not None
    short = whole.usage.output_tokens - 6
    cut = client.responses.create(**call, max_output_tokens=short)  # type: ignore[arg-type]
    assert cut.status == "incomplete" and cut.output, cut
    assert cut.output[-1].type == "function_call" and cut.output[-1].status == "incomplete"
    assert cut.output[-1].arguments != done.arguments and done.arguments.startswith(cut.output[-1].arguments)
    with client.responses.stream(**call, max_output_tokens=short) as stream:  # type: ignore[arg-type]
        events = list(stream)
    [item_done] = [e.item for e in events if e.type == "response.output_item.done"]
    assert item_done.status == "incomplete" and events[-1].type == "response.incomplete"
    with client.responses.stream(model="tiny", input="count for me", max_output_tokens=6, **GREEDY) as stream:
        events = list(stream)
    assert [e.item.status for e in events if e.type == "response.output_item.done"] == ["incomplete"]


def test_a_chain_continues_after_the_gateway_and_the_daemon_restart(
    daemon: DaemonProcess, start_gateway: Callable[..., GatewayProcess]
) -> None:
    gateway = start_gateway(daemon.address)
    first = client_of(gateway).responses.create(
        model="tiny", input="remember the kitchen", max_output_tokens=8, **GREEDY
    )
    gateway.stop()
    daemon.stop()
    daemon.start()
    gateway = start_gateway(daemon.address)  # (the same state folder: its conversation map and stored responses)
    second = client_of(gateway).responses.create(
        model="tiny", input="what did I say?", previous_response_id=first.id, max_output_tokens=8, **GREEDY
    )
    assert first.usage is not None
    assert cached(second) >= first.usage.input_tokens + first.usage.output_tokens - 1


def test_a_stream_cut_after_its_200_is_counted_under_the_api_asked(
    daemon: DaemonProcess, start_gateway: Callable[..., GatewayProcess]
) -> None:
    """A Responses stream cut by a daemon's kill ends with error events after its 200: /metrics counts it under
    /v1/responses (it was answered through the chat route, whose name the metrics took)."""
    gateway = start_gateway(daemon.address, "--resume-wait", "0")
    with client_of(gateway).responses.stream(
        model="tiny", input="count for me", max_output_tokens=1500, **GREEDY
    ) as stream:
        events = iter(stream)
        next(events)  # under way
        daemon.stop(signal.SIGKILL)
        daemon.start()
        with contextlib.suppress(openai.APIError, httpx.HTTPError):  # (the SDK raises at the error event)
            for _ in events:
                pass
    metrics = httpx.get(gateway.url + "/metrics", timeout=30).text
    cut = re.findall(r'^kvpool_gateway_streams_cut_total\{code="\w+",route="(\S+)"\} 1\.0$', metrics, re.M)
    assert cut == ["/v1/responses"], metrics
