"""Anthropic's Messages API through the real `anthropic` client, against a real kvpool-gateway and kvpoold (tiny
model): answers equal the chat route's, streamed or not; tools; stop sequences; reuse; count_tokens; errors in
Anthropic's shape."""

from __future__ import annotations

from collections.abc import Callable

import anthropic
import httpx
import msgspec
import openai
import pytest

from kvpool.gateway import anthropic_messages
from kvpool.gateway.http_errors import HttpError

from .daemon_process import DaemonProcess
from .gateway_process import GatewayProcess, client_of

WAIT_S = 30.0
USE = {"type": "tool_use", "name": "set_light", "input": {"room": "hall", "on": True}}
LIGHT = {
    "name": "set_light",
    "description": "Switch a room's light",
    "input_schema": {
        "type": "object",
        "properties": {"room": {"type": "string", "enum": ["kitchen", "hall"]}, "on": {"type": "boolean"}},
        "required": ["room", "on"],
    },
}


def claude(gateway: GatewayProcess, api_key: str = "none") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gateway.url, api_key=api_key, max_retries=0, timeout=WAIT_S)


GREEDY = {"temperature": 0.0}  # (the SDK no longer has sampling arguments; older clients send them, and so can this)


def ask(c: anthropic.Anthropic, messages: list[dict], **kw: object) -> anthropic.types.Message:
    extra = {**GREEDY, **kw.pop("extra_body", {})}  # type: ignore[dict-item]
    kw.setdefault("max_tokens", 8)
    return c.messages.create(model="tiny", messages=messages, extra_body=extra, **kw)  # type: ignore[arg-type]


def text_of(message: anthropic.types.Message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def test_an_answer_is_the_chat_routes_answer_streamed_or_not(served: GatewayProcess) -> None:
    c = claude(served)
    conversation = [{"role": "user", "content": "hello there"}]
    message = ask(c, conversation, system="be brief")
    reference = client_of(served).chat.completions.create(
        model="tiny",
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}],
        temperature=0.0,
        max_tokens=8,
    )
    assert message.type == "message" and message.role == "assistant" and message.model == "tiny"
    assert text_of(message) == reference.choices[0].message.content
    assert message.stop_reason in ("max_tokens", "end_turn") and message.usage.output_tokens <= 8
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) == reference.usage.prompt_tokens
    with c.messages.stream(
        model="tiny", max_tokens=8, system="be brief", messages=conversation, extra_body=GREEDY
    ) as s:  # type: ignore[arg-type]
        kinds = [event.type for event in s]
        streamed = s.get_final_message()
    assert kinds[0] == "message_start" and "content_block_delta" in kinds and kinds[-1] == "message_stop"
    assert text_of(streamed) == text_of(message) and streamed.stop_reason == message.stop_reason


def test_a_conversation_continues_from_its_history_and_says_what_it_reused(served: GatewayProcess) -> None:
    c = claude(served)
    history: list[dict] = [{"role": "user", "content": "tell me about the kitchen"}]
    first = ask(c, history)
    history += [{"role": "assistant", "content": text_of(first)}, {"role": "user", "content": "and the hall?"}]
    second = ask(c, history)
    assert (first.usage.cache_read_input_tokens or 0) == 0
    assert (second.usage.cache_read_input_tokens or 0) >= first.usage.input_tokens  # the first turn was not redone
    # count_tokens renders and tokenizes the prompt as a new conversation's: the first turn's whole prompt.
    counted = c.messages.count_tokens(model="tiny", messages=history[:1])  # type: ignore[arg-type]
    assert counted.input_tokens == first.usage.input_tokens
    longer = c.messages.count_tokens(model="tiny", messages=history, system="be brief")  # type: ignore[arg-type]
    assert longer.input_tokens > counted.input_tokens


def test_a_tool_loop(served: GatewayProcess) -> None:
    c = claude(served)
    history: list[dict] = [{"role": "user", "content": "light the kitchen"}]
    called = ask(c, history, max_tokens=256, tools=[LIGHT], tool_choice={"type": "any"})
    assert called.stop_reason == "tool_use"
    [use] = [block for block in called.content if block.type == "tool_use"][:1]
    assert use.name == "set_light" and use.input["room"] in ("kitchen", "hall") and isinstance(use.input["on"], bool)
    history += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in called.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "done"}]},
    ]
    after = ask(c, history, tools=[LIGHT])
    assert after.stop_reason in ("max_tokens", "end_turn", "tool_use")
    assert (after.usage.cache_read_input_tokens or 0) > 0  # the call's turn was kept: only the result is computed
    with c.messages.stream(
        model="tiny",
        max_tokens=256,
        messages=history[:1],
        tools=[LIGHT],
        tool_choice={"type": "any"},
        extra_body=GREEDY,
    ) as s:  # type: ignore[arg-type]
        streamed = s.get_final_message()
    assert [b.input for b in streamed.content if b.type == "tool_use"] == [
        b.input for b in called.content if b.type == "tool_use"
    ]


def test_a_stop_sequence_is_named(served: GatewayProcess) -> None:
    c = claude(served)
    conversation = [{"role": "user", "content": "count with me"}]
    free = text_of(ask(c, conversation, max_tokens=16))
    stop = free[3:5]
    assert len(stop) == 2 and stop not in free[:3]  # (the tiny model's answer is long enough to cut)
    stopped = ask(c, conversation, max_tokens=16, stop_sequences=[stop])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert text_of(stopped) == free[: free.index(stop)]


def test_what_would_read_as_another_answer_is_refused_by_its_own_name(served: GatewayProcess) -> None:
    """A stop sequence beside tools could only cut the tool call it shapes (reported as a finished tool_use); a
    last assistant message asks to continue it, which the chat route would answer as a closed turn: both refused,
    naming the field as sent. Errors of the chat route it goes through name the Messages request's fields."""
    c = claude(served)
    hi = [{"role": "user", "content": "hi"}]
    for messages, extra, named in (
        (hi, {"tools": [LIGHT], "tool_choice": {"type": "any"}, "stop_sequences": ['"on"']}, "`stop_sequences`"),
        (hi, {"tools": [LIGHT], "stop_sequences": ["}"]}, "`stop_sequences`"),
        ([*hi, {"role": "assistant", "content": "The answer is"}], {}, "messages[1]"),
        (hi, {"stop_sequences": [""]}, "stop_sequences[0]"),
        (hi, {"metadata": {"user_id": "u" * 300}}, "metadata.user_id"),
        (
            hi,
            {"tools": [LIGHT, {"name": "bad", "input_schema": {"properties": {"x": {"not": {}}}}}]},
            "tools[1].input_schema",
        ),
        (  # (with a system message the chat route's index is one more: the message is named as sent)
            [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nobody", "content": "on"}]}],
            {"system": "be brief"},
            "messages[0].content[0].tool_use_id",
        ),
        (hi, {"tool_choice": {"type": "auto", "disable_parallel_tool_use": True}}, "`tool_choice` needs `tools`"),
    ):
        with pytest.raises(anthropic.BadRequestError) as refused:
            ask(c, messages, **extra)
        message = refused.value.body["error"]["message"]  # type: ignore[index]
        assert named in message, message
        assert "parallel_tool_calls" not in message and "$.stop[" not in message and "$.user" not in message
    # Tools offered but not to be called: the answer is text, and its stop sequence is honoured and named.
    free = text_of(ask(c, hi, max_tokens=16, tools=[LIGHT], tool_choice={"type": "none"}))
    stop = free[3:5]
    stopped = ask(c, hi, max_tokens=16, tools=[LIGHT], tool_choice={"type": "none"}, stop_sequences=[stop])
    assert stopped.stop_reason == "stop_sequence" and text_of(stopped) == free[: free.index(stop)]
    assert text_of(ask(c, hi, extra_body={"thinking": {"type": "disabled"}}))  # (asks for nothing: served)


def test_a_renamed_error_names_each_field_once() -> None:
    """The chat route's names become the request's, each once: a chat message one place on (after a system
    message) is not renamed again as the message before it."""
    names = {
        "messages[0]": "system",
        "messages[1]": "messages[0]",
        "messages[1].tool_call_id": "messages[0].content[0].tool_use_id",
        "stop": "stop_sequences",
    }
    error = HttpError(400, "messages[1].tool_call_id: no call; see `stop` and `$.stop[0]`.", "x", param="messages[1]")
    renamed = error.renamed(names)
    assert renamed.param == "messages[0]" and (renamed.status, renamed.code) == (400, "x")
    assert renamed.message == (
        "messages[0].content[0].tool_use_id: no call; see `stop_sequences` and `$.stop_sequences[0]`."
    )
    assert error.renamed({}).message == error.message


def test_each_chat_message_is_named_by_the_message_or_block_it_came_from() -> None:
    """The map behind the renamed errors, against the translation itself: a system message first, a text message,
    an assistant's text and call, a tool result before the text and image of its turn."""
    request = msgspec.convert(
        {
            "model": "tiny",
            "max_tokens": 5,
            "system": "be brief",
            "tools": [LIGHT],
            "messages": [
                {"role": "user", "content": "light"},
                {"role": "assistant", "content": [{"type": "text", "text": "ok"}, {**USE, "id": "t1"}]},
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t1", "content": "done"},
                        {"type": "text", "text": "and this?"},
                        {"type": "image", "source": {"type": "url", "url": "https://example.invalid/a.png"}},
                    ],
                },
            ],
        },
        anthropic_messages.MessagesRequest,
    )
    body, names = anthropic_messages.chat_request(request)
    chat = body["messages"]
    assert [m["role"] for m in chat] == ["system", "user", "assistant", "tool", "user"]
    assert names["messages[0]"] == "system" and names["messages[1]"] == "messages[0]"
    assert (
        names["messages[2]"] == "messages[1]" and names["messages[2].tool_calls[0].id"] == "messages[1].content[1].id"
    )
    assert names["messages[3].tool_call_id"] == "messages[2].content[0].tool_use_id"
    assert names["messages[4]"] == "messages[2]" and names["messages[4].content[1]"] == "messages[2].content[2]"
    assert names["tools[0].function.parameters"] == "tools[0].input_schema"
    error = HttpError(400, "messages[4].content[1]: no images here.", "x", param="messages[4].content[1].image_url")
    assert error.renamed(names).param == "messages[2].content[2].image_url"


def test_errors_come_in_anthropics_shape(daemon: DaemonProcess, start_gateway: Callable[..., GatewayProcess]) -> None:
    gateway = start_gateway(daemon.address, "--api-key", "k")
    with pytest.raises(anthropic.AuthenticationError):
        ask(claude(gateway, api_key="wrong"), [{"role": "user", "content": "hi"}])
    c = claude(gateway, api_key="k")  # (sent as x-api-key, as Anthropic's clients do)
    assert text_of(ask(c, [{"role": "user", "content": "hi"}]))
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    for messages, extra, named in (
        ([{"role": "user", "content": [image]}], {}, "--mmproj"),  # (this daemon reads text only)
        ([{"role": "user", "content": "hi"}], {"extra_body": {"thinking": {"type": "enabled"}}}, "thinking"),
        ([{"role": "user", "content": "hi"}], {"extra_body": {"frobnicate": 1}}, "frobnicate"),
    ):
        with pytest.raises(anthropic.BadRequestError) as refused:
            ask(c, messages, **extra)
        error = refused.value.body["error"]  # type: ignore[index]
        assert refused.value.body["type"] == "error" and error["type"] == "invalid_request_error"  # type: ignore[index]
        assert named in error["message"], error
    raw = httpx.post(gateway.url + "/v1/messages", headers={"x-api-key": "k"}, json={"model": "tiny", "messages": []})
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"  # no max_tokens
    assert "max_tokens" in raw.json()["error"]["message"]
    with pytest.raises(openai.AuthenticationError):  # the OpenAI routes still answer in OpenAI's shape
        client_of(gateway, api_key="wrong").models.list()
